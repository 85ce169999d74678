// The dashboard view: polls GET /dashboard_state once a second while the page is visible, keeps
// the last five minutes of samples and charts figures derived from them: requests running and
// queued, KV pool use, prefix cache hit rate and output tokens/s over the last few seconds, TTFT
// and TPOT percentiles over the last 30 s (from the differences of the cumulative histograms),
// and the scheduler's mean time per step outside and inside the model forward.
"use strict";
window.srt = window.srt || {};

(function (srt) {
  const WINDOW_S = 300;
  const POLL_MS = 1000;
  const RATE_WINDOW_S = 5;
  const PCT_WINDOW_S = 30;
  const samples = []; // endpoint bodies, oldest first
  const points = []; // {t, values}: what the charts draw
  const charts = {};
  let polling = false; // a poll loop is alive (it stops while the page is hidden)
  let configShown = "";

  // the q-quantile of the observations between histograms ``prev`` and ``cur`` (same bounds;
  // linear within a bucket; null without observations; the last bound when above every bound)
  function quantile(prev, cur, q) {
    const base = (i) => (prev ? prev.cumulative[i] : 0);
    const total = cur.count - (prev ? prev.count : 0);
    if (!(total > 0)) return null;
    const rank = q * total;
    let lower = 0;
    let below = 0;
    for (let i = 0; i < cur.bounds.length; i++) {
      const upTo = cur.cumulative[i] - base(i);
      if (upTo >= rank) {
        const inBucket = upTo - below;
        return lower + (cur.bounds[i] - lower) * (inBucket > 0 ? (rank - below) / inBucket : 1);
      }
      lower = cur.bounds[i];
      below = upTo;
    }
    return lower;
  }

  // the newest sample at least ``seconds`` older than ``cur`` (else the oldest other one)
  function before(cur, seconds) {
    let found = null;
    for (const s of samples) {
      if (s === cur) break;
      if (found === null || s.time <= cur.time - seconds) found = s;
    }
    return found;
  }

  function delta(cur, prev, key) {
    return cur.scheduler[key] - prev.scheduler[key];
  }

  function schedulerValues(cur, v) {
    const s = cur.scheduler;
    v.running = s.num_running_reqs;
    v.queued = s.num_queued_reqs;
    v.kvUsed = s.token_usage * 100;
    v.kvCache = s.max_total_num_tokens ? (100 * s.evictable_size) / s.max_total_num_tokens : null;
    const p = before(cur, RATE_WINDOW_S);
    if (!p || !p.scheduler || cur.time <= p.time) return;
    v.tokPerS = delta(cur, p, "num_generated_tokens") / (cur.time - p.time);
    const looked = delta(cur, p, "num_admitted_input_tokens");
    v.cacheHit = looked > 0 ? (100 * delta(cur, p, "num_admitted_cached_tokens")) / looked : null;
    for (const [key, name] of [["scheduling_seconds", "stepSched"], ["forward_seconds", "stepForward"]]) {
      const a = cur.scheduler.step[key];
      const b = p.scheduler.step[key];
      if (a && b && a.count > b.count) v[name] = ((a.sum - b.sum) / (a.count - b.count)) * 1000;
    }
  }

  function derive(cur) {
    const v = {};
    if (cur.scheduler) schedulerValues(cur, v);
    const p = before(cur, PCT_WINDOW_S);
    for (const [hist, name] of [["ttft", "ttft"], ["itl", "tpot"]]) {
      for (const q of [50, 90, 99]) {
        const x = quantile(p && p.requests[hist], cur.requests[hist], q / 100);
        v[`${name}${q}`] = x === null ? null : x * 1000;
      }
    }
    return { t: cur.time, values: v };
  }

  function showConfig(config) {
    const text = JSON.stringify(config);
    if (text === configShown) return;
    configShown = text;
    const rows = Object.entries(config).map(([k, val]) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      const td = document.createElement("td");
      th.textContent = k;
      td.textContent = val === null || val === undefined ? "–" : String(val);
      tr.append(th, td);
      return tr;
    });
    document.getElementById("config-table").replaceChildren(...rows);
  }

  function visible() {
    return !document.getElementById("view-dashboard").classList.contains("hidden");
  }

  function draw() {
    const now = samples.length ? samples[samples.length - 1].time : Date.now() / 1000;
    for (const c of Object.values(charts)) c.draw(points, now);
  }

  async function poll() {
    polling = true;
    try {
      const resp = await srt.api.fetch("/dashboard_state");
      if (!resp.ok) throw new Error(await srt.api.errorMessage(resp));
      const cur = await resp.json();
      samples.push(cur);
      points.push(derive(cur));
      while (samples.length && samples[0].time < cur.time - WINDOW_S - PCT_WINDOW_S) samples.shift();
      while (points.length && points[0].t < cur.time - WINDOW_S) points.shift();
      showConfig(cur.config);
      srt.setStatus(cur.scheduler ? "" : "the scheduler did not answer");
      if (visible()) draw();
    } catch (e) {
      srt.setStatus(`dashboard: ${e.message}`);
    }
    if (document.visibilityState !== "hidden") setTimeout(poll, POLL_MS);
    else polling = false;
  }

  function init() {
    const { LineChart } = srt.charts;
    const c = (id, series, options) => new LineChart(document.getElementById(id), series, options);
    charts.requests = c("chart-requests", [
      { key: "running", label: "running", color: "#2563eb" },
      { key: "queued", label: "queued", color: "#dc2626" },
    ]);
    charts.kv = c(
      "chart-kv",
      [
        { key: "kvUsed", label: "requests", color: "#7c3aed" },
        { key: "kvCache", label: "prefix cache", color: "#0d9488" },
      ],
      { yMax: 100 },
    );
    charts.cache = c("chart-cache", [{ key: "cacheHit", label: "hit rate", color: "#0d9488" }], { yMax: 100 });
    charts.throughput = c("chart-throughput", [{ key: "tokPerS", label: "tok/s", color: "#2563eb" }]);
    const pct = (prefix) => [
      { key: `${prefix}50`, label: "p50", color: "#2563eb" },
      { key: `${prefix}90`, label: "p90", color: "#d97706" },
      { key: `${prefix}99`, label: "p99", color: "#dc2626" },
    ];
    charts.ttft = c("chart-ttft", pct("ttft"));
    charts.tpot = c("chart-tpot", pct("tpot"));
    charts.step = c("chart-step", [
      { key: "stepSched", label: "scheduling", color: "#d97706" },
      { key: "stepForward", label: "forward", color: "#2563eb" },
    ]);
    document.addEventListener("visibilitychange", () => {
      if (document.visibilityState !== "hidden" && !polling) poll();
    });
    window.addEventListener("resize", () => visible() && draw());
    poll();
  }

  srt.dashboard = { init, draw, quantile, samples, points, charts };
})(window.srt);
