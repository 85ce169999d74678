// Time-series line charts on a plain <canvas> (no library): the last ``windowS`` seconds, a y
// axis scaled to the data, one line per series (null values leave a gap), a legend with the
// latest values. ``draws`` counts the redraws.
"use strict";
window.srt = window.srt || {};

(function (srt) {
  const PAD = { left: 46, right: 10, top: 22, bottom: 18 };
  const AXIS = "#8a94a6";
  const GRID = "#e3e7ee";

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    if (a >= 1000) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a >= 1) return v.toFixed(2);
    return v.toPrecision(2);
  }

  class LineChart {
    // series: [{key, label, color}]; options: {windowS, yMax (a fixed top, e.g. 100 for %)}
    constructor(canvas, series, options) {
      this.canvas = canvas;
      this.series = series;
      this.windowS = (options && options.windowS) || 300;
      this.yMax = options && options.yMax;
      this.draws = 0;
    }

    _size() {
      const dpr = window.devicePixelRatio || 1;
      const w = Math.max(100, this.canvas.clientWidth);
      const h = Math.max(80, this.canvas.clientHeight);
      if (this.canvas.width !== Math.round(w * dpr) || this.canvas.height !== Math.round(h * dpr)) {
        this.canvas.width = Math.round(w * dpr);
        this.canvas.height = Math.round(h * dpr);
      }
      const ctx = this.canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      return [ctx, w, h];
    }

    _axes(ctx, w, h, top, now) {
      ctx.font = "11px system-ui, sans-serif";
      ctx.lineWidth = 1;
      ctx.textBaseline = "middle";
      for (let k = 0; k <= 4; k++) {
        const y = PAD.top + ((h - PAD.top - PAD.bottom) * k) / 4;
        ctx.strokeStyle = GRID;
        ctx.beginPath();
        ctx.moveTo(PAD.left, y);
        ctx.lineTo(w - PAD.right, y);
        ctx.stroke();
        ctx.fillStyle = AXIS;
        ctx.textAlign = "right";
        ctx.fillText(fmt(top * (1 - k / 4)), PAD.left - 4, y);
      }
      ctx.textAlign = "center";
      ctx.textBaseline = "alphabetic";
      const minutes = Math.round(this.windowS / 60);
      for (let k = 0; k <= minutes; k++) {
        const x = PAD.left + ((w - PAD.left - PAD.right) * k) / minutes;
        ctx.fillText(k === minutes ? "now" : `-${minutes - k}m`, x, h - 4);
      }
      return now;
    }

    // points: [{t: seconds, values: {key: number | null}}], oldest first
    draw(points, now) {
      const [ctx, w, h] = this._size();
      ctx.clearRect(0, 0, w, h);
      now = now || (points.length ? points[points.length - 1].t : Date.now() / 1000);
      const visible = points.filter((p) => p.t >= now - this.windowS);
      let max = 0;
      for (const p of visible) for (const s of this.series) max = Math.max(max, p.values[s.key] || 0);
      const top = this.yMax || niceMax(max * 1.1);
      this._axes(ctx, w, h, top, now);
      const x = (t) => PAD.left + ((w - PAD.left - PAD.right) * (t - (now - this.windowS))) / this.windowS;
      const y = (v) => PAD.top + (h - PAD.top - PAD.bottom) * (1 - Math.min(v, top) / top);
      ctx.lineWidth = 1.6;
      let legendX = PAD.left;
      for (const s of this.series) {
        ctx.strokeStyle = s.color;
        ctx.beginPath();
        let pen = false;
        let latest = null;
        for (const p of visible) {
          const v = p.values[s.key];
          if (v === null || v === undefined || !isFinite(v)) {
            pen = false;
            continue;
          }
          latest = v;
          if (pen) ctx.lineTo(x(p.t), y(v));
          else ctx.moveTo(x(p.t), y(v));
          pen = true;
        }
        ctx.stroke();
        ctx.fillStyle = s.color;
        ctx.textAlign = "left";
        const label = `${s.label} ${fmt(latest)}`;
        ctx.fillText(label, legendX, 12);
        legendX += ctx.measureText(label).width + 14;
      }
      this.draws++;
    }
  }

  srt.charts = { LineChart, fmt };
})(window.srt);
