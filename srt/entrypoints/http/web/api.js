// The page's calls to the server: the API key (asked before the first call when the server
// marked the page with data-api-key="yes", or after a 401; kept in sessionStorage, sent as a
// Bearer token on every call), and the server-sent-events reader of streamed responses.
"use strict";
window.srt = window.srt || {};

(function (srt) {
  const KEY = "srt-api-key";
  let asking = null; // the promise of the open key dialog, shared by concurrent callers

  function withKey(headers) {
    const out = Object.assign({}, headers || {});
    const key = sessionStorage.getItem(KEY);
    if (key) out.Authorization = "Bearer " + key;
    return out;
  }

  function askKey(message) {
    if (asking) return asking;
    const dialog = document.getElementById("key-dialog");
    const form = document.getElementById("key-form");
    const input = document.getElementById("key-input");
    document.getElementById("key-error").textContent = message || "";
    asking = new Promise((resolve) => {
      form.addEventListener("submit", function onSubmit(ev) {
        ev.preventDefault();
        if (!input.value) return;
        sessionStorage.setItem(KEY, input.value);
        input.value = "";
        form.removeEventListener("submit", onSubmit);
        dialog.close();
        asking = null;
        resolve();
      });
    });
    dialog.oncancel = (ev) => ev.preventDefault(); // Escape keeps it open: the calls wait for the key
    if (!dialog.open) dialog.showModal();
    input.focus();
    return asking;
  }

  // fetch(path, options) with the API key; on 401 asks for the key and tries again
  async function apiFetch(path, options) {
    options = options || {};
    if (document.body.dataset.apiKey === "yes" && sessionStorage.getItem(KEY) === null) await askKey("");
    for (let attempt = 0; ; attempt++) {
      const resp = await fetch(path, Object.assign({}, options, { headers: withKey(options.headers) }));
      if (resp.status !== 401 || attempt >= 5) return resp;
      const refused = sessionStorage.getItem(KEY) !== null;
      sessionStorage.removeItem(KEY);
      await askKey(refused ? "The server refused that key." : "");
    }
  }

  // the message of an error response (OpenAI's {"error": {"message"}} shape, else the text)
  async function errorMessage(resp) {
    const text = await resp.text();
    try {
      const body = JSON.parse(text);
      if (body && body.error && body.error.message) return `${resp.status}: ${body.error.message}`;
    } catch (_) {
      /* not JSON */
    }
    return `${resp.status}: ${text || resp.statusText}`;
  }

  // yields the data of each server-sent event of a streamed response, as it arrives
  async function* sseData(resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let m;
      while ((m = /\r?\n\r?\n/.exec(buf)) !== null) {
        const block = buf.slice(0, m.index);
        buf = buf.slice(m.index + m[0].length);
        const data = block
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  }

  srt.api = { fetch: apiFetch, errorMessage, sseData, askKey };
})(window.srt);
