// Starts the page: the two views (Chat, Dashboard; #dashboard in the address opens the second),
// the served model's name from GET /v1/models (asking for the API key if the server wants one).
"use strict";
window.srt = window.srt || {};

(function (srt) {
  const $ = (id) => document.getElementById(id);

  srt.setStatus = (text) => {
    $("status").textContent = text;
  };

  function show(view) {
    for (const name of ["chat", "dashboard"]) {
      $(`view-${name}`).classList.toggle("hidden", name !== view);
      $(`tab-${name}`).classList.toggle("active", name === view);
    }
    if (view === "dashboard") srt.dashboard.draw();
    history.replaceState(null, "", view === "chat" ? location.pathname : `#${view}`);
  }

  async function loadModel() {
    try {
      const resp = await srt.api.fetch("/v1/models");
      if (!resp.ok) throw new Error(await srt.api.errorMessage(resp));
      const body = await resp.json();
      srt.modelName = body.data && body.data.length ? body.data[0].id : "default";
      $("model-name").textContent = srt.modelName;
    } catch (e) {
      srt.setStatus(`models: ${e.message}`);
    }
  }

  function init() {
    for (const tab of document.querySelectorAll(".tab")) {
      tab.addEventListener("click", () => show(tab.dataset.view));
    }
    srt.chat.init();
    srt.dashboard.init();
    show(location.hash === "#dashboard" ? "dashboard" : "chat");
    srt.ready = loadModel();
  }

  srt.show = show;
  init();
})(window.srt);
