// What every pg-semaphore page draws with: the window of the page's data
// (#report-data: `since`, `until`, `as_of`), SVG and HTML helpers, the
// time axis, and the outcome counters' per-minute bars. Every string from
// the data reaches the page through textContent or an attribute, never as
// markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 1200;
const LEFT = 84;
const RIGHT = 16;
const PLOT = WIDTH - LEFT - RIGHT;

const data = JSON.parse(document.getElementById("report-data").textContent);
// chrono writes up to nine fractional digits; Date.parse wants three.
const ms = (text) => Date.parse(text.replace(/(\.\d{3})\d+/, "$1"));
const since = ms(data.since);
const until = ms(data.until);
const asOf = ms(data.as_of);
const span = Math.max(until - since, 1);
const x = (t) => LEFT + ((Math.min(Math.max(t, since), until) - since) / span) * PLOT;

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (parent) parent.appendChild(node);
  return node;
}

function text(parent, x0, y0, content, attrs) {
  const node = el("text", Object.assign({ x: x0, y: y0 }, attrs || {}), parent);
  node.textContent = content;
  return node;
}

function tooltip(node, lines) {
  el("title", {}, node).textContent = lines.filter((l) => l !== "").join("\n");
}

function html(tag, className, content) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (content !== undefined) node.textContent = content;
  return node;
}

function svgIn(id, height) {
  const svg = el("svg", { viewBox: `0 0 ${WIDTH} ${height}`, role: "img" });
  document.getElementById(id).appendChild(svg);
  return svg;
}

const pad = (n, width) => String(n).padStart(width || 2, "0");

/// 2026-11-21 08:00:00.000Z
function stamp(t) {
  const d = new Date(t);
  return `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ` +
    `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}:${pad(d.getUTCSeconds())}.` +
    `${pad(d.getUTCMilliseconds(), 3)}Z`;
}

/// A tick label, as precise as the step needs.
function tickLabel(t, step) {
  const d = new Date(t);
  const hms = `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}`;
  if (step >= 86400000) return `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())}`;
  if (step >= 60000) return span > 86400000 ? `${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ${hms}` : hms;
  if (step >= 1000) return `${hms}:${pad(d.getUTCSeconds())}`;
  return `${hms}:${pad(d.getUTCSeconds())}.${pad(d.getUTCMilliseconds(), 3)}`;
}

/// 250ms, 4.2s, 3m07s, 2h05m, 3d04h: as the CLI prints durations.
function human(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const s = Math.floor(seconds);
  if (s < 1) return `${Math.round(seconds * 1000)}ms`;
  if (s < 60) return `${seconds.toFixed(1)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${pad(s % 60)}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${pad(Math.floor((s % 3600) / 60))}m`;
  return `${Math.floor(s / 86400)}d${pad(Math.floor((s % 86400) / 3600))}h`;
}

const count = (n) => Number(n).toLocaleString("en-US");

/// A round step (1, 2 or 5 times a power of ten) giving at most `ticks` ticks up to `max`.
function niceStep(max, ticks) {
  const raw = Math.max(max / ticks, 1);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
}

/// Time axis steps in milliseconds: 1 ms to a year.
const TIME_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 15e3, 3e4, 6e4, 12e4,
  3e5, 6e5, 9e5, 18e5, 36e5, 72e5, 108e5, 216e5, 432e5, 864e5, 1728e5, 6048e5, 2592e6, 31536e6];

/// The time axis under a chart: gridlines, ticks, and the window's two ends
/// written out in full.
function timeAxis(svg, top, bottom) {
  const step = TIME_STEPS.find((s) => span / s <= 8) || niceStep(span, 8);
  const grid = el("g", { class: "grid" }, svg);
  const axis = el("g", { class: "axis" }, svg);
  el("line", { x1: LEFT, x2: LEFT + PLOT, y1: bottom, y2: bottom }, axis);
  for (let t = Math.ceil(since / step) * step; t <= until; t += step) {
    el("line", { x1: x(t), x2: x(t), y1: top, y2: bottom }, grid);
    const edge = x(t) - LEFT < 40 || LEFT + PLOT - x(t) < 40;
    if (!edge) text(axis, x(t), bottom + 14, tickLabel(t, step), { "text-anchor": "middle", class: "tick" });
  }
  text(axis, LEFT, bottom + 28, stamp(since), { class: "edge axis-start" });
  text(axis, LEFT + PLOT, bottom + 28, stamp(until), { "text-anchor": "end", class: "edge axis-end" });
}

/// Bars per minute of the outcome counters (`rows`: {minute, admitted,
/// refused, timed_out}), the `series` stacked in order, each
/// {key, label, className}, across the page's window, into #`id`. Each
/// bar spans its minute (clipped to the window); hover for its counts and
/// the rate per second.
function minuteBars(id, rows, series) {
  const box = document.getElementById(id);
  const shown = rows.filter((r) => series.some((s) => r[s.key] > 0));
  if (shown.length === 0) {
    box.appendChild(html("p", "empty", "none in this window"));
    return;
  }
  const height = 160;
  const top = 8;
  const bottom = top + height;
  const svg = svgIn(id, bottom + 36);
  svg.setAttribute("id", `${id}-svg`);
  const sum = (r) => series.reduce((total, s) => total + r[s.key], 0);
  const yMax = Math.max(...shown.map(sum), 1) * 1.1;
  const y = (v) => bottom - (v / yMax) * height;
  const grid = el("g", { class: "grid" }, svg);
  const axis = el("g", { class: "axis" }, svg);
  const yStep = niceStep(yMax, 4);
  for (let v = 0; v <= yMax; v += yStep) {
    el("line", { x1: LEFT, x2: LEFT + PLOT, y1: y(v), y2: y(v) }, grid);
    text(axis, LEFT - 8, y(v) + 4, count(v), { "text-anchor": "end" });
  }
  timeAxis(svg, top, bottom);
  const marks = el("g", { class: "marks" }, svg);
  for (const r of shown) {
    const start = ms(r.minute);
    const x0 = x(start);
    const width = Math.max(x(start + 60000) - x0 - 1, 1);
    let base = bottom;
    for (const s of series) {
      if (r[s.key] === 0) continue;
      const h = bottom - y(r[s.key]);
      const bar = el("rect", {
        class: `minute ${s.className}`, "data-minute": r.minute, "data-series": s.key,
        "data-count": r[s.key], x: x0, y: base - h, width, height: h,
      }, marks);
      tooltip(bar, [
        `${stamp(start)} + 1 minute`,
        ...series.map((t) => `${count(r[t.key])} ${t.label} (${(r[t.key] / 60).toFixed(2)}/s)`),
      ]);
      base -= h;
    }
  }
}
