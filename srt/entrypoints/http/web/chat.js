// The chat view: a conversation through POST /v1/chat/completions, streamed (SSE) token by
// token, with the sampling settings, an optional JSON schema (response_format json_schema), a
// stop button (aborts the fetch; the server aborts the request when the connection closes) and
// per-reply figures: TTFT and tokens/s measured here, usage and the server's phase timings.
"use strict";
window.srt = window.srt || {};

(function (srt) {
  const $ = (id) => document.getElementById(id);
  // messages: the conversation sent with each request; replies: each reply's text and figures
  const state = { messages: [], replies: [], controller: null };

  function addMessage(role, text) {
    const wrap = document.createElement("div");
    wrap.className = `msg msg-${role}`;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role;
    const body = document.createElement("div");
    body.className = "body";
    if (role === "user") body.textContent = text;
    else srt.markdown.renderInto(body, text);
    const stats = document.createElement("div");
    stats.className = "stats";
    wrap.append(who, body, stats);
    const box = $("messages");
    box.appendChild(wrap);
    box.scrollTop = box.scrollHeight;
    return { wrap, body, stats };
  }

  function number(id, parse) {
    const v = parse($(id).value);
    if (!isFinite(v)) throw new Error(`${$(id).previousSibling.textContent.trim()}: not a number`);
    return v;
  }

  function parseJson(id, what) {
    const text = $(id).value.trim();
    if (!text) return null;
    try {
      return JSON.parse(text);
    } catch (e) {
      throw new Error(`${what}: ${e.message}`);
    }
  }

  // the request body of the conversation so far, from the settings panel
  function buildRequest() {
    const messages = [];
    const system = $("system-prompt").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.messages);
    const body = {
      model: srt.modelName || "default",
      messages,
      stream: true,
      stream_options: { include_usage: true },
      return_timings: true,
      temperature: number("temperature", parseFloat),
      top_p: number("top-p", parseFloat),
      max_tokens: number("max-tokens", (v) => parseInt(v, 10)),
    };
    const schema = parseJson("json-schema", "JSON schema");
    if (schema !== null) {
      body.response_format = { type: "json_schema", json_schema: { name: "output", schema } };
    }
    const extra = parseJson("extra-fields", "Extra request fields");
    if (extra !== null) {
      if (typeof extra !== "object" || Array.isArray(extra)) throw new Error("Extra request fields: give a JSON object");
      Object.assign(body, extra);
    }
    return body;
  }

  function ms(seconds) {
    return seconds === null || seconds === undefined ? "–" : `${(seconds * 1000).toFixed(0)} ms`;
  }

  function statsText(r) {
    const parts = [`TTFT ${r.ttftMs === null ? "–" : r.ttftMs.toFixed(0) + " ms"}`];
    if (r.tokensPerS !== null) parts.push(`${r.tokensPerS.toFixed(1)} tok/s`);
    if (r.usage) parts.push(`${r.usage.completion_tokens} tokens (prompt ${r.usage.prompt_tokens})`);
    parts.push(`finish: ${r.finish || "–"}`);
    const m = r.metrics;
    if (m) {
      parts.push(
        `server: queue ${ms(m.queue_time)}, prefill ${ms(m.prefill_time)}, decode ${ms(m.decode_time)}, ` +
          `ttft ${ms(m.ttft)}, e2e ${ms(m.e2e_latency)}`,
      );
    }
    return parts.join(" · ");
  }

  // reads the SSE stream of ``resp`` into ``r`` (content, usage, metrics), rendering as it goes
  async function readStream(resp, r, view) {
    let pending = false;
    for await (const data of srt.api.sseData(resp)) {
      if (data === "[DONE]") break;
      const ev = JSON.parse(data);
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) r.usage = ev.usage;
      if (ev.metrics && ev.metrics.length) r.metrics = ev.metrics[0];
      for (const c of ev.choices || []) {
        if (c.delta && c.delta.content) {
          if (r.tFirst === null) r.tFirst = performance.now();
          r.content += c.delta.content;
          r.chunks++;
        }
        if (c.finish_reason) r.finish = c.finish_reason;
      }
      if (!pending) {
        pending = true;
        requestAnimationFrame(() => {
          pending = false;
          srt.markdown.renderInto(view.body, r.content);
          $("messages").scrollTop = $("messages").scrollHeight;
        });
      }
    }
  }

  function finishReply(r, view, t0) {
    const tEnd = performance.now();
    r.ttftMs = r.tFirst === null ? null : r.tFirst - t0;
    const n = r.usage ? r.usage.completion_tokens : r.chunks;
    r.tokensPerS = r.tFirst !== null && n > 1 && tEnd > r.tFirst ? ((n - 1) * 1000) / (tEnd - r.tFirst) : null;
    srt.markdown.renderInto(view.body, r.content);
    view.wrap.classList.remove("streaming");
    view.stats.textContent = statsText(r);
    if (r.error) {
      const err = document.createElement("div");
      err.className = "error";
      err.textContent = r.error;
      view.wrap.appendChild(err);
    }
    if (r.content) state.messages.push({ role: "assistant", content: r.content });
    else if (r.error) state.messages.pop(); // the request failed: its message leaves the conversation
    state.replies.push(r);
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  async function send(text) {
    if (state.controller || !text.trim()) return;
    state.messages.push({ role: "user", content: text });
    addMessage("user", text);
    const view = addMessage("assistant", "");
    view.wrap.classList.add("streaming");
    const r = { content: "", chunks: 0, tFirst: null, usage: null, metrics: null, finish: null, error: null };
    const t0 = performance.now();
    state.controller = new AbortController();
    setBusy(true);
    try {
      const resp = await srt.api.fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(buildRequest()),
        signal: state.controller.signal,
      });
      if (!resp.ok) throw new Error(await srt.api.errorMessage(resp));
      await readStream(resp, r, view);
    } catch (e) {
      if (e.name === "AbortError") r.finish = "stopped";
      else r.error = e.message;
    } finally {
      state.controller = null;
      finishReply(r, view, t0);
      setBusy(false);
    }
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  function init() {
    const prompt = $("prompt");
    $("chat-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = prompt.value;
      prompt.value = "";
      send(text);
    });
    prompt.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) {
        ev.preventDefault();
        $("chat-form").requestSubmit();
      }
    });
    $("stop").addEventListener("click", stop);
    $("clear-chat").addEventListener("click", () => {
      stop();
      state.messages.length = 0;
      $("messages").replaceChildren();
    });
  }

  srt.chat = { init, send, stop, state, buildRequest };
})(window.srt);
