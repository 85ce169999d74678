// A small, safe markdown renderer for model output: paragraphs, ``` code fences, `inline code`,
// **bold** / *italic*, bullet and numbered lists, # headings. It builds DOM nodes and sets their
// text with text nodes / textContent only: the model's text is never parsed as HTML, so a reply
// holding <script> or <img onerror=...> shows as those characters.
"use strict";
window.srt = window.srt || {};

(function (srt) {
  const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
  const LIST_ITEM = /^\s*(?:([-*+])|(\d{1,9})[.)])\s+(.*)$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;

  function el(tag, cls) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    return node;
  }

  // appends the inline markup of ``text`` to ``parent`` (code spans, bold, italic)
  function inline(parent, text) {
    // underscores mark emphasis only outside words (snake_case and __dunder__ names stay as they are)
    const re =
      /`([^`\n]+)`|\*\*(\S(?:.*?\S)?)\*\*|(?<!\w)__(\S(?:.*?\S)?)__(?!\w)|\*([^\s*](?:.*?[^\s*])?)\*|(?<!\w)_([^\s_](?:.*?[^\s_])?)_(?!\w)/gs;
    let last = 0;
    let m;
    while ((m = re.exec(text)) !== null) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      let node;
      if (m[1] !== undefined) {
        node = el("code");
        node.textContent = m[1];
      } else if (m[2] !== undefined || m[3] !== undefined) {
        node = el("strong");
        inline(node, m[2] !== undefined ? m[2] : m[3]);
      } else {
        node = el("em");
        inline(node, m[4] !== undefined ? m[4] : m[5]);
      }
      parent.appendChild(node);
      last = re.lastIndex;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  function listItem(line) {
    const m = LIST_ITEM.exec(line);
    return m ? { ordered: m[2] !== undefined, start: m[2] ? parseInt(m[2], 10) : 1, text: m[3] } : null;
  }

  // a fenced code block from lines[i] (the opening fence); returns [node, next index]
  function codeBlock(lines, i, fence) {
    const code = [];
    i++;
    while (i < lines.length && !(lines[i].trim().startsWith(fence[1]) && !lines[i].trim().slice(fence[1].length).trim())) {
      code.push(lines[i]);
      i++;
    }
    const pre = el("pre");
    if (fence[2]) pre.dataset.lang = fence[2];
    const node = el("code");
    node.textContent = code.join("\n");
    pre.appendChild(node);
    return [pre, i + 1];
  }

  function list(lines, i, first) {
    const node = el(first.ordered ? "ol" : "ul");
    if (first.ordered && first.start !== 1) node.start = first.start;
    let item;
    while (i < lines.length && (item = listItem(lines[i])) !== null && item.ordered === first.ordered) {
      const li = el("li");
      inline(li, item.text);
      node.appendChild(li);
      i++;
    }
    return [node, i];
  }

  // the DocumentFragment of ``text`` rendered
  function render(text) {
    const frag = document.createDocumentFragment();
    const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
    let para = [];
    const flush = () => {
      if (!para.length) return;
      const p = el("p");
      inline(p, para.join("\n"));
      frag.appendChild(p);
      para = [];
    };
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = FENCE.exec(line);
      const item = fence ? null : listItem(line);
      const heading = fence || item ? null : HEADING.exec(line);
      let node = null;
      if (fence) [node, i] = codeBlock(lines, i, fence);
      else if (item) [node, i] = list(lines, i, item);
      else if (heading) {
        node = el("h" + Math.min(6, heading[1].length + 2));
        inline(node, heading[2]);
        i++;
      } else {
        if (line.trim()) para.push(line);
        else flush();
        i++;
        continue;
      }
      flush();
      frag.appendChild(node);
    }
    flush();
    return frag;
  }

  // replaces the content of ``target`` with ``text`` rendered
  function renderInto(target, text) {
    target.replaceChildren(render(text));
  }

  srt.markdown = { render, renderInto };
})(window.srt);
