"""CSS and JavaScript of the self-contained HTML report (plain SVG, no library, no network).

The script reads the panels (``backprism.plot.panels.Panel.to_dict``) embedded in the page as
JSON and draws each one as an SVG chart with:

* hover: the nearest point (or histogram bin) of every visible series, in a tooltip;
* zoom: drag a rectangle to zoom, mouse wheel to zoom the x axis around the cursor,
  double-click to reset; clicking a legend entry hides/shows its series.
"""

__all__ = ["CSS", "SCRIPT"]

CSS = r"""
* { box-sizing: border-box; }
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0;
  background: #f3f5f8; color: #222; }
header { background: #1f3b63; color: white; padding: 14px 24px; }
header h1 { margin: 0; font-size: 22px; }
header .sub { opacity: 0.85; font-size: 13px; margin-top: 4px; }
main { padding: 14px 20px 40px; }
.warnings { background: #fff4e5; border-left: 4px solid #e0701b; padding: 8px 14px;
  margin-bottom: 14px; font-size: 14px; }
.warnings.ok { background: #eaf6ec; border-left-color: #2c9a48; }
.warnings li { margin: 2px 0; }
.groups { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 14px; }
.group h2, .wide h2 { margin: 4px 0 8px; font-size: 17px; color: #1f5fa8; text-align: center; }
.card { background: white; border-radius: 6px; box-shadow: 0 1px 3px rgba(0,0,0,0.12);
  padding: 8px 10px 6px; margin-bottom: 14px; position: relative; }
.card h3 { margin: 0; font-size: 14px; display: flex; justify-content: space-between;
  align-items: baseline; gap: 8px; }
.card h3 .info { font-weight: normal; font-size: 11px; color: #666; text-align: right; }
.card.untracked { background: #f7f7f7; color: #888; }
.card.untracked .note { font-style: italic; padding: 26px 0; text-align: center; font-size: 13px; }
.tests { display: grid; grid-template-columns: 1.4fr 1fr; gap: 6px; align-items: start; }
.tests .small h4 { margin: 2px 0 0; font-size: 12px; }
.wide { margin-top: 4px; }
.others { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 14px; }
svg.chart { width: 100%; height: auto; display: block; user-select: none; cursor: crosshair; }
svg.chart text { font-size: 10px; fill: #444; }
svg.chart .axis line, svg.chart .axis path { stroke: #999; }
svg.chart .grid line { stroke: #ececec; }
svg.chart .sel { fill: rgba(31,95,168,0.12); stroke: #1f5fa8; stroke-dasharray: 3 2; }
.legend { font-size: 11px; display: flex; flex-wrap: wrap; gap: 4px 12px; margin: 2px 0 0; }
.legend span { cursor: pointer; white-space: nowrap; }
.legend span.off { opacity: 0.35; text-decoration: line-through; }
.legend i { display: inline-block; width: 12px; height: 3px; margin-right: 4px;
  vertical-align: middle; }
#tooltip { position: fixed; pointer-events: none; background: rgba(20,20,20,0.88);
  color: white; font-size: 12px; padding: 5px 8px; border-radius: 4px; display: none;
  z-index: 10; white-space: pre; }
.hint { font-size: 11px; color: #777; margin: 0 0 10px; }
@media (max-width: 1100px) { .groups, .others { grid-template-columns: 1fr; } }
"""

SCRIPT = r"""
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("backprism-data").textContent);
  const NS = "http://www.w3.org/2000/svg";
  const tip = document.getElementById("tooltip");
  const VIRIDIS = [[68,1,84],[71,44,122],[59,81,139],[44,113,142],[33,144,141],[39,173,129],
                   [92,200,99],[170,220,50],[253,231,37]];

  function viridis(t) {
    t = Math.max(0, Math.min(1, isFinite(t) ? t : 0));
    const f = t * (VIRIDIS.length - 1), i = Math.min(Math.floor(f), VIRIDIS.length - 2);
    const a = VIRIDIS[i], b = VIRIDIS[i + 1], u = f - i;
    return "rgb(" + a.map((v, k) => Math.round(v + (b[k] - v) * u)).join(",") + ")";
  }
  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function h(tag, cls, parent, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "nan";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    return String(+v.toPrecision(4));
  }
  function ok(v) { return v !== null && v !== undefined && isFinite(v); }

  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) return [lo];
    const span = hi - lo, step0 = span / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
    const err = step0 / mag;
    const step = mag * (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1);
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step)
      out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }
  function logTicks(lo, hi) {  // lo/hi are log10 values
    const out = [];
    const a = Math.floor(lo), b = Math.ceil(hi);
    const every = Math.max(1, Math.ceil((b - a) / 6));
    for (let e = a; e <= b; e += every) if (e >= lo - 1e-9 && e <= hi + 1e-9) out.push(e);
    if (out.length < 2) return niceTicks(lo, hi, 4);
    return out;
  }

  // ------------------------------------------------------------------ scales
  function extent(vals, log) {
    let lo = Infinity, hi = -Infinity;
    for (const v of vals) {
      if (!ok(v) || (log && v <= 0)) continue;
      const t = log ? Math.log10(v) : v;
      if (t < lo) lo = t;
      if (t > hi) hi = t;
    }
    if (lo === Infinity) return [0, 1];
    if (hi === lo) { const d = Math.abs(lo) * 0.1 || 0.5; return [lo - d, hi + d]; }
    const pad = (hi - lo) * 0.05;
    return [lo - pad, hi + pad];
  }

  function Chart(container, panel, opts) {
    this.panel = panel;
    this.opts = opts || {};
    this.W = this.opts.width || 480;
    this.H = this.opts.height || 250;
    this.m = {l: 52, r: this.hasRight() ? 58 : 12, t: 8, b: this.opts.small ? 22 : 34};
    this.hidden = new Set();
    this.svg = el("svg", {viewBox: "0 0 " + this.W + " " + this.H, class: "chart",
                          "data-key": panel.key}, container);
    this.legendBox = this.opts.small ? null : h("div", "legend", container);
    this.initDomain();
    this.zoom = null;
    this.draw();
    this.bind();
  }
  Chart.prototype.hasRight = function () {
    return (this.panel.series || []).some(s => s.axis === "right");
  };
  Chart.prototype.initDomain = function () {
    const p = this.panel, xs = [], yl = [], yr = [];
    for (const s of p.series || []) {
      (s.x || []).forEach(v => xs.push(v));
      (s.axis === "right" ? yr : yl).push(...(s.y || []));
      if (s.style === "bars") (s.axis === "right" ? yr : yl).push(p.ylog ? null : 0);
    }
    for (const sh of p.shapes || []) {
      const q = sh.params;
      if (sh.kind === "circle") {
        xs.push(q.cx - q.r, q.cx + q.r);
        yl.push(q.cy - q.r, q.cy + q.r);
      }
      if (sh.kind === "hline") yl.push(q.y);
    }
    if (p.heat) { xs.push(...p.heat.xedges); yl.push(...p.heat.yedges); }
    let x = p.xlim ? p.xlim.slice() : extent(xs, false);
    if (p.heat && !p.xlim) x = [Math.min(...p.heat.xedges), Math.max(...p.heat.xedges)];
    let y = p.ylim ? (p.ylog ? p.ylim.map(Math.log10) : p.ylim.slice()) : extent(yl, p.ylog);
    if (p.heat && !p.ylim) y = [Math.min(...p.heat.yedges), Math.max(...p.heat.yedges)];
    const y2 = extent(yr, p.ylog2);
    if ((p.series || []).some(s => s.style === "bars" && s.axis === "right")) y2[0] = 0;
    this.base = {x: x, y: y, y2: y2};
  };
  Chart.prototype.domain = function () {
    const d = this.zoom || this.base;
    if (this.panel.equal) {  // same units per pixel on both axes
      const pw = this.W - this.m.l - this.m.r, ph = this.H - this.m.t - this.m.b;
      let [x0, x1] = d.x, [y0, y1] = d.y;
      const ux = (x1 - x0) / pw, uy = (y1 - y0) / ph;
      if (ux > uy) { const c = (y0 + y1) / 2, hh = ux * ph / 2; y0 = c - hh; y1 = c + hh; }
      else { const c = (x0 + x1) / 2, hw = uy * pw / 2; x0 = c - hw; x1 = c + hw; }
      return {x: [x0, x1], y: [y0, y1], y2: d.y2};
    }
    return d;
  };
  Chart.prototype.sx = function (v) {
    const d = this.dom, pw = this.W - this.m.l - this.m.r;
    return this.m.l + (v - d.x[0]) / (d.x[1] - d.x[0]) * pw;
  };
  Chart.prototype.sy = function (v, right) {
    const p = this.panel, log = right ? p.ylog2 : p.ylog, rng = right ? this.dom.y2 : this.dom.y;
    if (log) v = v > 0 ? Math.log10(v) : NaN;
    const ph = this.H - this.m.t - this.m.b;
    return this.m.t + ph - (v - rng[0]) / (rng[1] - rng[0]) * ph;
  };
  Chart.prototype.inv = function (px, py) {
    const d = this.dom, pw = this.W - this.m.l - this.m.r, ph = this.H - this.m.t - this.m.b;
    return [d.x[0] + (px - this.m.l) / pw * (d.x[1] - d.x[0]),
            d.y[0] + (this.m.t + ph - py) / ph * (d.y[1] - d.y[0])];
  };

  Chart.prototype.draw = function () {
    const svg = this.svg, p = this.panel;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    this.dom = this.domain();
    const m = this.m, W = this.W, H = this.H, pw = W - m.l - m.r, ph = H - m.t - m.b;
    const cid = "clip-" + p.key.replace(/[^a-zA-Z0-9]/g, "_");
    const defs = el("defs", {}, svg);
    el("rect", {x: m.l, y: m.t, width: pw, height: ph}, el("clipPath", {id: cid}, defs));
    const grid = el("g", {class: "grid"}, svg), axis = el("g", {class: "axis"}, svg);
    const xt = niceTicks(this.dom.x[0], this.dom.x[1], this.opts.small ? 4 : 7);
    for (const t of xt) {
      const x = this.sx(t);
      el("line", {x1: x, x2: x, y1: m.t, y2: m.t + ph}, grid);
      el("text", {x: x, y: m.t + ph + 12, "text-anchor": "middle", class: "xtick"}, axis)
        .textContent = fmt(t);
    }
    const yt = p.ylog ? logTicks(this.dom.y[0], this.dom.y[1])
                      : niceTicks(this.dom.y[0], this.dom.y[1], this.opts.small ? 3 : 5);
    for (const t of yt) {
      const y = this.sy(p.ylog ? Math.pow(10, t) : t, false);
      el("line", {x1: m.l, x2: m.l + pw, y1: y, y2: y}, grid);
      el("text", {x: m.l - 4, y: y + 3, "text-anchor": "end", class: "ytick"}, axis)
        .textContent = fmt(p.ylog ? Math.pow(10, t) : t);
    }
    if (this.hasRight() && p.key !== "alpha") {
      const y2t = p.ylog2 ? logTicks(this.dom.y2[0], this.dom.y2[1])
                          : niceTicks(this.dom.y2[0], this.dom.y2[1], 5);
      for (const t of y2t) {
        const y = this.sy(p.ylog2 ? Math.pow(10, t) : t, true);
        el("text", {x: m.l + pw + 4, y: y + 3, "text-anchor": "start"}, axis)
          .textContent = fmt(p.ylog2 ? Math.pow(10, t) : t);
      }
      if (p.ylabel2) el("text", {x: W - 8, y: m.t + ph / 2, "text-anchor": "middle",
        transform: "rotate(90 " + (W - 8) + " " + (m.t + ph / 2) + ")"}, axis)
        .textContent = p.ylabel2;
    }
    el("rect", {x: m.l, y: m.t, width: pw, height: ph, fill: "none", stroke: "#bbb"}, axis);
    if (!this.opts.small) {
      el("text", {x: m.l + pw / 2, y: H - 4, "text-anchor": "middle"}, axis).textContent = p.xlabel;
      el("text", {x: 10, y: m.t + ph / 2, "text-anchor": "middle",
        transform: "rotate(-90 10 " + (m.t + ph / 2) + ")"}, axis).textContent = p.ylabel;
    }
    const plot = el("g", {"clip-path": "url(#" + cid + ")"}, svg);
    if (p.heat) this.drawHeat(plot);
    for (const sh of p.shapes || []) this.drawShape(plot, sh);
    (p.series || []).forEach((s, i) => { if (!this.hidden.has(i)) this.drawSeries(plot, s); });
    this.cross = el("line", {y1: m.t, y2: m.t + ph, stroke: "#888", "stroke-dasharray": "2 2",
                              visibility: "hidden"}, svg);
    this.sel = el("rect", {class: "sel", visibility: "hidden"}, svg);
    this.drawLegend();
  };

  Chart.prototype.drawSeries = function (g, s) {
    const right = s.axis === "right", op = s.faint ? 0.3 : 1;
    const dash = s.dashed ? "5 3" : null;
    if (s.style === "bars") {
      for (let i = 0; i < s.y.length; i++) {
        if (!ok(s.y[i]) || s.y[i] <= 0) continue;
        const x0 = this.sx(s.x[i]), x1 = this.sx(s.x[i + 1]);
        const y0 = this.sy(s.y[i], right);
        const yb = (right ? this.panel.ylog2 : this.panel.ylog)
          ? this.H - this.m.b : this.sy(0, right);
        el("rect", {x: Math.min(x0, x1), y: y0, width: Math.max(0.5, Math.abs(x1 - x0) - 0.3),
                    height: Math.max(0, yb - y0), fill: s.color,
                    "fill-opacity": s.faint ? 0.25 : 0.75}, g);
      }
      return;
    }
    if (s.style === "scatter") {
      const cs = (s.c || []).filter(ok), c0 = Math.min(...cs), c1 = Math.max(...cs);
      s.x.forEach((x, i) => {
        if (!ok(x) || !ok(s.y[i])) return;
        const col = s.c ? viridis((s.c[i] - c0) / ((c1 - c0) || 1)) : s.color;
        el("circle", {cx: this.sx(x), cy: this.sy(s.y[i], right), r: 3.2, fill: col,
                      stroke: "white", "stroke-width": 0.5}, g);
      });
      return;
    }
    let d = "", pen = false, prevY = null;
    s.x.forEach((x, i) => {
      const y = s.y[i];
      if (!ok(x) || !ok(y) || ((right ? this.panel.ylog2 : this.panel.ylog) && y <= 0)) {
        pen = false; return;
      }
      const X = this.sx(x), Y = this.sy(y, right);
      if (!pen) d += "M" + X.toFixed(2) + "," + Y.toFixed(2);
      else if (s.style === "step") d += "H" + X.toFixed(2) + "V" + Y.toFixed(2);
      else d += "L" + X.toFixed(2) + "," + Y.toFixed(2);
      pen = true; prevY = Y;
    });
    if (s.style === "step" && pen && s.x.length) d += "H" + (this.W - this.m.r);
    if (d) el("path", {d: d, fill: "none", stroke: s.color, "stroke-width": s.faint ? 1 : 1.7,
                       "stroke-opacity": op, "stroke-dasharray": dash || "none"}, g);
    if (s.style === "markers") s.x.forEach((x, i) => {
      if (ok(x) && ok(s.y[i])) el("circle", {cx: this.sx(x), cy: this.sy(s.y[i], right), r: 3,
                                             fill: s.color}, g);
    });
    return prevY;
  };

  Chart.prototype.drawShape = function (g, sh) {
    const q = sh.params, m = this.m, dash = sh.dashed ? "4 3" : "none";
    const pw = this.W - m.l - m.r, ph = this.H - m.t - m.b;
    if (sh.kind === "circle") {
      const cx = this.sx(q.cx), cy = this.sy(q.cy, false);
      const rx = Math.abs(this.sx(q.cx + q.r) - cx), ry = Math.abs(this.sy(q.cy + q.r, false) - cy);
      el("ellipse", {cx: cx, cy: cy, rx: rx, ry: ry, fill: sh.fill ? sh.color : "none",
                     "fill-opacity": 0.22, stroke: sh.color, "stroke-dasharray": dash}, g);
    } else if (sh.kind === "hband") {
      const a = this.sy(q.y0, false), b = this.sy(q.y1, false);
      el("rect", {x: m.l, width: pw, y: Math.min(a, b), height: Math.abs(a - b), fill: sh.color,
                  "fill-opacity": 0.18}, g);
    } else if (sh.kind === "vband") {
      const a = this.sx(q.x0), b = this.sx(q.x1);
      el("rect", {y: m.t, height: ph, x: Math.min(a, b), width: Math.abs(a - b), fill: sh.color,
                  "fill-opacity": 0.18}, g);
    } else if (sh.kind === "hline") {
      const y = this.sy(q.y, false);
      el("line", {x1: m.l, x2: m.l + pw, y1: y, y2: y, stroke: sh.color,
                  "stroke-dasharray": dash}, g);
    } else if (sh.kind === "vline") {
      const x = this.sx(q.x);
      el("line", {y1: m.t, y2: m.t + ph, x1: x, x2: x, stroke: sh.color,
                  "stroke-dasharray": dash}, g);
    }
  };

  Chart.prototype.drawHeat = function (g) {
    const ht = this.panel.heat, z = ht.z;
    let zmax = 0;
    z.forEach(r => r.forEach(v => { if (ok(v) && v > zmax) zmax = v; }));
    const lz = Math.log10(Math.max(zmax, 2));
    for (let i = 0; i < z.length; i++) for (let j = 0; j < z[i].length; j++) {
      const v = z[i][j];
      if (!ok(v) || v <= 0) continue;
      const x0 = this.sx(ht.xedges[i]), x1 = this.sx(ht.xedges[i + 1]);
      const y0 = this.sy(ht.yedges[j], false), y1 = this.sy(ht.yedges[j + 1], false);
      el("rect", {x: Math.min(x0, x1), y: Math.min(y0, y1), width: Math.abs(x1 - x0) + 0.4,
                  height: Math.abs(y1 - y0) + 0.4, fill: viridis(Math.log10(v) / lz)}, g);
    }
  };

  Chart.prototype.drawLegend = function () {
    if (!this.legendBox) return;
    this.legendBox.innerHTML = "";
    (this.panel.series || []).forEach((s, i) => {
      if (s.faint && s.label.endsWith("(raw)")) return;
      if (s.label === "origin" || s.label === "parabola") return;
      const span = h("span", this.hidden.has(i) ? "off" : "", this.legendBox);
      const sw = h("i", "", span);
      sw.style.background = s.style === "scatter" && s.c ? "linear-gradient(90deg," +
        viridis(0) + "," + viridis(0.5) + "," + viridis(1) + ")" : s.color;
      span.appendChild(document.createTextNode(s.label));
      span.addEventListener("click", () => {
        const raw = (this.panel.series || []).findIndex(t => t.label === s.label + " (raw)");
        for (const k of [i, raw]) if (k >= 0) {
          if (this.hidden.has(k)) this.hidden.delete(k); else this.hidden.add(k);
        }
        this.draw();
      });
    });
    for (const sh of this.panel.shapes || []) if (sh.label) {
      const span = h("span", "", this.legendBox);
      const sw = h("i", "", span);
      sw.style.background = sh.color;
      span.appendChild(document.createTextNode(sh.label));
    }
  };

  // ------------------------------------------------------------------ interaction
  Chart.prototype.point = function (ev) {
    const pt = this.svg.createSVGPoint();
    pt.x = ev.clientX; pt.y = ev.clientY;
    const r = pt.matrixTransform(this.svg.getScreenCTM().inverse());
    return [r.x, r.y];
  };
  Chart.prototype.hover = function (ev) {
    const [px, py] = this.point(ev), p = this.panel, m = this.m;
    if (px < m.l || px > this.W - m.r || py < m.t || py > this.H - m.b) { this.leave(); return; }
    const [dx, dy] = this.inv(px, py);
    const lines = [];
    if (p.heat) {
      const ht = p.heat, i = ht.xedges.findIndex((e, k) => k < ht.xedges.length - 1 &&
        dx >= e && dx < ht.xedges[k + 1]);
      const j = ht.yedges.findIndex((e, k) => k < ht.yedges.length - 1 &&
        dy >= e && dy < ht.yedges[k + 1]);
      if (i >= 0 && j >= 0) lines.push(p.xlabel + " " + fmt(ht.xedges[i]) + "…" +
        fmt(ht.xedges[i + 1]) + "\n" + p.ylabel + " " + fmt(ht.yedges[j]) + "…" +
        fmt(ht.yedges[j + 1]) + "\ncount " + fmt(ht.z[i][j]));
    }
    let xShown = null;
    (p.series || []).forEach((s, si) => {
      if (this.hidden.has(si) || s.label === "parabola" || s.label === "origin") return;
      if (s.style === "bars") {
        const k = s.x.findIndex((e, q) => q < s.x.length - 1 && dx >= e && dx < s.x[q + 1]);
        if (k >= 0) lines.push(s.label + ": [" + fmt(s.x[k]) + ", " + fmt(s.x[k + 1]) + ") → " +
                               fmt(s.y[k]));
        return;
      }
      if (s.faint) return;
      let best = -1, bd = Infinity;
      s.x.forEach((x, i) => {
        if (!ok(x) || !ok(s.y[i])) return;
        const d = s.style === "scatter"
          ? Math.hypot(this.sx(x) - px, this.sy(s.y[i], s.axis === "right") - py)
          : Math.abs(this.sx(x) - px);
        if (d < bd) { bd = d; best = i; }
      });
      if (best < 0 || bd > 40) return;
      if (s.style === "scatter") {
        const at = s.c ? " (step " + fmt(s.c[best]) + ")" : "";
        lines.push(s.label + ": α = " + fmt(s.x[best]) + at);
      } else {
        if (xShown === null) { xShown = s.x[best]; lines.unshift(p.xlabel + " " + fmt(xShown)); }
        lines.push(s.label + ": " + fmt(s.y[best]));
      }
    });
    if (xShown !== null) {
      const X = this.sx(xShown);
      this.cross.setAttribute("x1", X); this.cross.setAttribute("x2", X);
      this.cross.setAttribute("visibility", "visible");
    } else this.cross.setAttribute("visibility", "hidden");
    if (!lines.length) { tip.style.display = "none"; return; }
    tip.textContent = lines.join("\n");
    tip.style.display = "block";
    const left = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    tip.style.left = left + "px";
    tip.style.top = (ev.clientY + 14) + "px";
  };
  Chart.prototype.leave = function () {
    tip.style.display = "none";
    if (this.cross) this.cross.setAttribute("visibility", "hidden");
  };
  Chart.prototype.bind = function () {
    const svg = this.svg;
    let start = null;
    svg.addEventListener("mousedown", ev => { start = this.point(ev); ev.preventDefault(); });
    window.addEventListener("mouseup", ev => {
      if (!start) return;
      const end = this.point(ev), s = start;
      start = null;
      this.sel.setAttribute("visibility", "hidden");
      if (Math.abs(end[0] - s[0]) < 5) return;
      const a = this.inv(s[0], s[1]), b = this.inv(end[0], end[1]);
      const z = {x: [Math.min(a[0], b[0]), Math.max(a[0], b[0])], y: this.dom.y, y2: this.dom.y2};
      if (Math.abs(end[1] - s[1]) >= 5) z.y = [Math.min(a[1], b[1]), Math.max(a[1], b[1])];
      this.zoom = z;
      this.draw();
    });
    svg.addEventListener("mousemove", ev => {
      if (start) {
        const c = this.point(ev);
        const x = Math.min(c[0], start[0]), y = Math.min(c[1], start[1]);
        this.sel.setAttribute("x", x); this.sel.setAttribute("y", y);
        this.sel.setAttribute("width", Math.abs(c[0] - start[0]));
        this.sel.setAttribute("height", Math.abs(c[1] - start[1]));
        this.sel.setAttribute("visibility", "visible");
      }
      this.hover(ev);
    });
    svg.addEventListener("mouseleave", () => this.leave());
    svg.addEventListener("dblclick", () => { this.zoom = null; this.draw(); });
    svg.addEventListener("wheel", ev => {
      ev.preventDefault();
      const [px] = this.point(ev), [cx] = this.inv(px, 0), d = this.dom;
      const f = ev.deltaY > 0 ? 1.25 : 0.8;
      this.zoom = {x: [cx - (cx - d.x[0]) * f, cx + (d.x[1] - cx) * f], y: d.y, y2: d.y2};
      this.draw();
    }, {passive: false});
  };

  // ------------------------------------------------------------------ page
  function card(parent, panel) {
    const c = h("div", "card" + (panel.tracked ? "" : " untracked"), parent);
    c.dataset.panel = panel.key;
    const t = h("h3", "", c, panel.title);
    if (panel.info) h("span", "info", t, panel.info);
    if (!panel.tracked) { h("div", "note", c, panel.note || "not tracked"); return c; }
    if (panel.key === "gradtests") {
      const box = h("div", "tests", c), left = h("div", "", box), right = h("div", "", box);
      new Chart(left, panel, {width: 300, height: 300});
      for (const child of panel.children) {
        const s = h("div", "small", right);
        s.dataset.panel = child.key;
        h("h4", "", s, child.title + (child.info ? "  " + child.info : ""));
        if (child.tracked) new Chart(s, child, {width: 260, height: 82, small: true});
        else h("div", "note", s, child.note);
      }
      return c;
    }
    new Chart(c, panel, panel.key === "performance" ? {width: 1400, height: 300} : {});
    return c;
  }

  function build() {
    document.getElementById("title").textContent = DATA.title;
    document.getElementById("subtitle").textContent = DATA.subtitle;
    const warn = document.getElementById("warnings");
    if (DATA.warnings.length) {
      h("strong", "", warn, "Warnings");
      const ul = h("ul", "", warn);
      DATA.warnings.forEach(w => h("li", "", ul, w));
    } else { warn.className += " ok"; warn.textContent = "No warnings."; }
    const groups = document.getElementById("groups");
    for (const g of ["Step size", "Gradients", "Curvature"]) {
      const col = h("section", "group", groups);
      h("h2", "", col, g);
      DATA.panels.filter(p => p.group === g).forEach(p => card(col, p));
    }
    const perf = document.getElementById("performance");
    h("h2", "", perf, "Performance");
    DATA.panels.filter(p => p.group === "Performance").forEach(p => card(perf, p));
    const others = DATA.panels.filter(p => p.group === "Other");
    if (others.length) {
      const o = document.getElementById("other");
      h("h2", "", o, "Other quantities");
      const grid = h("div", "others", o);
      others.forEach(p => card(grid, p));
    }
    document.body.dataset.ready = "1";
  }
  build();
})();
"""
