// The live dashboard: draws each snapshot the server sends over `events`
// (server-sent events, relative to this page, so the page works under any
// prefix). It never queries the database. Every string from the data
// reaches the page through textContent or an attribute, never as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
// The page's own URL may lack its trailing slash (`/ops/limits`): resolve
// `events` under it, not beside it. The query (a token) goes along.
const here = location.pathname.endsWith("/") ? "" : location.pathname.split("/").pop() + "/";
const EVENTS = here + "events" + location.search;

// chrono writes up to nine fractional digits; Date.parse wants three.
const ms = (text) => Date.parse(String(text).replace(/(\.\d{3})\d+/, "$1"));
const pad = (n, width) => String(n).padStart(width || 2, "0");

/// 2026-11-21 08:00:00Z
function stamp(text) {
  if (!text) return "-";
  const d = new Date(ms(text));
  return `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ` +
    `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}:${pad(d.getUTCSeconds())}Z`;
}

/// 250ms, 4.2s, 3m07s, 2h05m, 3d04h: as the CLI prints durations.
function human(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 0) return `-${human(-seconds)}`;
  const s = Math.floor(seconds);
  if (s < 1) return `${Math.round(seconds * 1000)}ms`;
  if (s < 60) return `${seconds.toFixed(1)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${pad(s % 60)}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${pad(Math.floor((s % 3600) / 60))}m`;
  return `${Math.floor(s / 86400)}d${pad(Math.floor((s % 86400) / 3600))}h`;
}

function node(tag, className, content) {
  const n = document.createElement(tag);
  if (className) n.className = className;
  if (content !== undefined && content !== null) n.textContent = String(content);
  return n;
}

function cell(row, content, className) {
  const td = node("td", className, content);
  row.appendChild(td);
  return td;
}

function table(headers, rows) {
  const t = node("table");
  const head = node("tr");
  for (const h of headers) head.appendChild(node("th", h.startsWith("#") ? "n" : "", h.replace(/^#/, "")));
  t.appendChild(node("thead")).appendChild(head);
  const body = t.appendChild(node("tbody"));
  for (const r of rows) {
    const tr = body.appendChild(node("tr"));
    r.forEach((value, i) => cell(tr, value, headers[i].startsWith("#") ? "n" : ""));
  }
  return t;
}

function bar(held, capacity) {
  const outer = node("span", held >= capacity ? "bar full" : "bar");
  const inner = outer.appendChild(node("span"));
  inner.style.width = `${capacity > 0 ? Math.min(100, (100 * held) / capacity) : 100}%`;
  return outer;
}

const sum = (minutes, field) => minutes.reduce((total, m) => total + (m[field] || 0), 0);

/// Per-minute bars over the snapshot's window (16 minutes overlap its 15,
/// the last one under way): `fields` stacked, colours in order.
function spark(minutes, fields, colours, snap) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 160 22");
  const since = ms(snap.since);
  const width = 10;
  const max = Math.max(1, ...minutes.map((m) => fields.reduce((t, f) => t + m[f], 0)));
  for (const m of minutes) {
    const slot = Math.floor((ms(m.minute) - since) / 60000);
    if (slot < 0 || slot > 15) continue;
    let y = 22;
    fields.forEach((f, i) => {
      const h = (20 * m[f]) / max;
      if (h <= 0) return;
      y -= h;
      const rect = document.createElementNS(SVG, "rect");
      for (const [k, v] of Object.entries({ x: slot * width, y, width: width - 1, height: h, fill: colours[i] })) {
        rect.setAttribute(k, String(v));
      }
      const title = document.createElementNS(SVG, "title");
      title.textContent = `${stamp(m.minute)}: ${m[f]} ${f.replace("_", " ")}`;
      rect.appendChild(title);
      svg.appendChild(rect);
    });
  }
  return svg;
}

// Which rows are open (by kind and name), kept across snapshots.
const open = new Set();

function tbody(id) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  return body;
}

function empty(body, columns, text) {
  const tr = body.appendChild(node("tr"));
  const td = cell(tr, text, "empty");
  td.colSpan = columns;
}

function drawSemaphores(snap) {
  const body = tbody("semaphores");
  if (!snap.semaphores.length) empty(body, 8, "no semaphores");
  for (const s of snap.semaphores) {
    const id = `${s.kind}:${s.name}`;
    const tr = body.appendChild(node("tr", "row"));
    tr.dataset.semaphore = s.name;
    cell(tr, s.kind);
    cell(tr, s.name);
    const held = cell(tr, "");
    held.appendChild(bar(s.held, s.capacity));
    held.appendChild(document.createTextNode(`${s.held}`));
    // After a capacity drop, holders above it drain as they release (no
    // new claim is admitted meanwhile).
    const above = s.holders.filter((h) => h.slot >= s.capacity).length;
    if (above > 0) held.appendChild(node("span", "tag bad", ` draining: ${above} above capacity`));
    cell(tr, s.capacity, "n");
    cell(tr, s.kind === "lease" ? s.waiting : "-", "n");
    cell(tr, sum(s.minutes, "refused"), "n");
    cell(tr, sum(s.minutes, "timed_out"), "n");
    cell(tr, "").appendChild(spark(s.minutes, ["refused", "timed_out"], ["#ea580c", "#dc2626"], snap));
    tr.addEventListener("click", () => {
      if (open.has(id)) open.delete(id); else open.add(id);
      drawSemaphores(snap);
    });
    if (!open.has(id)) continue;
    const detail = body.appendChild(node("tr", "detail"));
    const td = cell(detail, "");
    td.colSpan = 8;
    td.appendChild(node("strong", "", `Holders of ${s.name}`));
    if (!s.holders.length) {
      td.appendChild(node("p", "empty", "nobody holds it"));
    } else if (s.kind === "lease") {
      td.appendChild(table(
        ["#slot", "holder", "#claim", "since", "#held for", "lease ends", "#lease left", "#silent for"],
        s.holders.map((h) => [h.slot, h.holder, h.id, stamp(h.claimed_at || h.created_at), human(h.age_seconds),
          stamp(h.expires_at), human(h.lease_left_seconds), human(h.silent_seconds)]),
      ));
    } else {
      td.appendChild(table(
        ["#slot", "#pid", "application", "client", "session since", "shared"],
        s.holders.map((h) => [h.slot, h.pid, h.application_name, h.client_addr, stamp(h.backend_start), h.shared ? "yes" : "no"]),
      ));
    }
    if (s.kind === "lease") {
      td.appendChild(node("strong", "", "Waiting, by fairness key"));
      if (!s.waiters.length) td.appendChild(node("p", "empty", "nobody waits"));
      else td.appendChild(table(["fairness key", "#waiters", "#permits", "waiting since"],
        s.waiters.map((w) => [w.key === null ? "(default)" : w.key, w.waiters, w.permits, stamp(w.oldest)])));
    }
  }
}

function drawFamilies(snap) {
  const body = tbody("families");
  if (!snap.families.length) empty(body, 8, "no families");
  for (const f of snap.families) {
    const tr = body.appendChild(node("tr"));
    tr.dataset.family = f.name;
    cell(tr, f.name);
    cell(tr, f.default_capacity, "n");
    cell(tr, f.keys, "n");
    const rules = cell(tr, f.rules.length ? "" : "-");
    for (const r of f.rules) rules.appendChild(node("span", "tag", `${r.kind} ${r.match} → ${r.capacity}`));
    const busy = cell(tr, f.busiest.length ? "" : "-");
    for (const k of f.busiest) {
      const line = busy.appendChild(node("div"));
      line.appendChild(bar(k.held, k.capacity));
      line.appendChild(document.createTextNode(`${k.key}: ${k.held}/${k.capacity}`));
    }
    cell(tr, sum(f.minutes, "refused"), "n");
    cell(tr, sum(f.minutes, "timed_out"), "n");
    cell(tr, "").appendChild(spark(f.minutes, ["refused", "timed_out"], ["#ea580c", "#dc2626"], snap));
  }
}

function policy(limit) {
  if (!limit) return "none stored";
  if (limit.kind === "token_bucket") return `${limit.rate}/s, burst ${limit.burst}`;
  return `${limit.permit_limit} per ${human(limit.window_seconds)}`;
}

function drawLimiters(snap) {
  const body = tbody("limiters");
  if (!snap.limiters.length) empty(body, 9, "no rate limiters");
  for (const l of snap.limiters) {
    const tr = body.appendChild(node("tr"));
    tr.dataset.limiter = l.name;
    cell(tr, l.kind);
    cell(tr, l.name);
    cell(tr, policy(l.limit));
    const paused = cell(tr, "");
    if (l.paused) paused.appendChild(node("span", "tag bad", `paused until ${stamp(l.paused_until)}`));
    else paused.textContent = "no";
    cell(tr, l.paused_keys, "n");
    cell(tr, l.keys, "n");
    cell(tr, sum(l.minutes, "admitted"), "n");
    cell(tr, sum(l.minutes, "refused"), "n");
    cell(tr, "").appendChild(spark(l.minutes, ["admitted", "refused"], ["#16a34a", "#ea580c"], snap));
  }
}

function drawMutexes(snap) {
  const body = tbody("mutexes");
  if (!snap.mutexes.length) empty(body, 6, "no mutex is held or waited for");
  for (const m of snap.mutexes) {
    const tr = body.appendChild(node("tr"));
    cell(tr, m.key);
    cell(tr, `${m.granted ? "held" : "waiting"}${m.shared ? " (shared)" : ""}`);
    cell(tr, m.pid, "n");
    cell(tr, m.application_name || "-");
    cell(tr, m.client_addr || "-");
    cell(tr, stamp(m.since));
  }
}

function drawHorizon(snap) {
  const box = document.getElementById("horizon");
  const h = snap.horizon;
  const warn = h && (h.held_for_seconds === null || h.held_for_seconds >= snap.horizon_warning_seconds);
  box.hidden = !warn;
  if (!warn) return;
  const who = h.name ? `${h.kind.replace("_", " ")} ${h.name}` : `pid ${h.pid}`;
  const details = [h.application_name && `application "${h.application_name}"`, h.user && `user "${h.user}"`, h.state]
    .filter(Boolean).join(", ");
  box.textContent = `VACUUM is held back: the xmin horizon is held ` +
    `${h.held_for_seconds === null ? "" : `for ${human(h.held_for_seconds)} `}by ${who}` +
    `${details ? ` (${details})` : ""}, ${h.age_xids} transaction ids behind` +
    `${h.since ? `, since ${stamp(h.since)}` : ""}. Every row a lease semaphore updates meanwhile ` +
    `leaves a version nobody can remove (see pg-semaphore doctor).`;
}

function draw(snap) {
  const outage = document.getElementById("outage");
  if (snap.error) {
    outage.hidden = false;
    outage.textContent = `database unreachable since ${stamp(snap.error.since)}: ${snap.error.message}` +
      (snap.sampled_at ? ` (showing the last snapshot, of ${stamp(snap.sampled_at)})` : "");
  } else {
    outage.hidden = true;
  }
  document.body.classList.toggle("stale", Boolean(snap.error));
  if (!snap.sampled_at) return;
  document.getElementById("state").textContent =
    `live: sampled every ${human(snap.interval_seconds)}, last at ${stamp(snap.sampled_at)}`;
  document.body.dataset.sampledAt = snap.sampled_at;
  drawSemaphores(snap);
  drawFamilies(snap);
  drawLimiters(snap);
  drawMutexes(snap);
  drawHorizon(snap);
}

const source = new EventSource(EVENTS);
source.addEventListener("snapshot", (event) => draw(JSON.parse(event.data)));
source.addEventListener("open", () => {
  document.getElementById("state").textContent = "connected, waiting for the first sample…";
});
source.addEventListener("error", () => {
  document.getElementById("state").textContent = "connection to the dashboard lost: reconnecting…";
});
