// Draws a pg-semaphore report from the JSON in #report-data (a serialized
// `pg_semaphore::audit::Report`, and the semaphore's outcome counters per
// minute in `outcomes`, or null for a family key), with the helpers of
// chart.js, which precedes it in the page's one script.

// An advisory semaphore's report draws its log of finished permits: no
// live one, no claim id; a lost permit (the server freed its slots) is
// drawn as a lease's timed-out claim, a released or dropped one as a
// completed claim.
const advisory = data.kind === "advisory";
const words = advisory
  ? { claims: "finished permits", completed: "released", timed_out: "lost" }
  : { claims: "claims", completed: "completed", timed_out: "timed out" };

function laneLabel(lane) {
  const first = lane * data.slots_per_lane;
  return data.slots_per_lane === 1 ? `slot ${first}` : `slots ${first}-${first + data.slots_per_lane - 1}`;
}

function header() {
  document.title = `pg-semaphore report: ${data.semaphore}`;
  document.getElementById("name").textContent = data.semaphore;
  document.getElementById("window").textContent =
    `${stamp(since)} to ${stamp(until)} (${human(span / 1000)}), capacity ${count(data.capacity)}, ` +
    `read at ${stamp(asOf)}`;
  const s = data.summary;
  const peak = Math.max(0, ...data.occupancy.map((b) => b.peak));
  const mean = data.occupancy.reduce((sum, b) => sum + b.mean, 0) / Math.max(data.occupancy.length, 1);
  const stats = document.getElementById("stats");
  for (const [value, label, className] of [
    [count(s.total), words.claims, "total"],
    [count(s.completed), words.completed, "completed"],
    ...(advisory ? [[count(s.dropped), "dropped", "completed"]] : []),
    [count(s.timed_out), words.timed_out, "timed_out"],
    ...(advisory ? [] : [[count(s.live), "live", "live"]]),
    [human(s.p50_hold_seconds), "p50 hold", "p50"],
    [human(s.p95_hold_seconds), "p95 hold", "p95"],
    [human(s.max_hold_seconds), "max hold", "max"],
    [`${count(peak)} / ${count(data.capacity)}`, "peak held / capacity", "peak"],
    [mean.toFixed(2), "mean held", "mean"],
  ]) {
    const box = html("div", `stat ${className}`);
    box.appendChild(html("div", "value", value));
    box.appendChild(html("div", "label", label));
    stats.appendChild(box);
  }
  const notice = document.getElementById("notice");
  if (advisory) {
    document.getElementById("timeline-title").textContent = "Finished permits per slot";
    for (const node of document.querySelectorAll(".word-completed")) node.textContent = "released (or dropped)";
    for (const node of document.querySelectorAll(".word-timed-out")) node.textContent = "lost";
    for (const node of document.querySelectorAll(".lease-only")) node.hidden = true;
    const last = data.claims.reduce((t, p) => Math.max(t, ms(p.ended_at)), -Infinity);
    notice.textContent =
      "Advisory semaphore: drawn from its audit log, which holds finished permits only " +
      "(written in batches after they end), so the picture ends at the last finished permit" +
      (data.claims.length > 0 ? ` (${stamp(last)})` : "") +
      ". Who holds a slot now: pg-semaphore status.";
    notice.hidden = false;
  }
  if (data.aggregated) {
    const lanes = data.slots_per_lane > 1 ? `, each lane standing for ${data.slots_per_lane} slots` : "";
    notice.textContent = (advisory ? `${notice.textContent} ` : "") +
      `Aggregated: ${count(s.total)} ${words.claims} in this window, ` +
      `${data.slots_per_lane > 1 ? "on too many slots to give each a lane" : "too many to draw one bar each"}. ` +
      `The timeline shows how busy each slot was in each of ${count(data.occupancy.length)} buckets of ` +
      `${human(data.bucket_seconds)}${lanes} (darker is busier; red where ${advisory ? "permits were lost" : "claims timed out"}). ` +
      `Hover a cell for its claims and most frequent holder.`;
    notice.hidden = false;
  }
}

function timeline() {
  const laneHeight = Math.max(3, Math.min(22, Math.floor(440 / Math.max(data.lanes, 1))));
  const top = 4;
  const bottom = top + laneHeight * data.lanes;
  const svg = svgIn("timeline", bottom + 36);
  svg.setAttribute("id", "timeline-svg");
  svg.dataset.lanes = data.lanes;
  const lanes = el("g", { class: "lanes" }, svg);
  for (let lane = 0; lane < data.lanes; lane++) {
    const y = top + lane * laneHeight;
    if (lane % 2 === 0) el("rect", { class: "lane-bg", x: LEFT, y, width: PLOT, height: laneHeight }, lanes);
    if (laneHeight >= 10 || lane % Math.ceil(10 / laneHeight) === 0) {
      text(lanes, LEFT - 8, y + Math.min(laneHeight, 14) - 3, laneLabel(lane), { "text-anchor": "end", class: "lane-label" });
    }
  }
  timeAxis(svg, top, bottom);
  const marks = el("g", { class: "marks" }, svg);
  const gap = laneHeight > 6 ? 2 : 0;
  if (!data.aggregated && advisory) {
    if (data.claims.length === 0) {
      text(marks, LEFT + PLOT / 2, top + 16, "no finished permits in this window", { "text-anchor": "middle", class: "empty" });
    }
    // An outcome in the advisory log's words.
    const said = { completed: "released", dropped: "dropped", timed_out: "lost" };
    data.claims.forEach((p, i) => {
      const start = ms(p.claimed_at);
      const end = ms(p.ended_at);
      const x0 = x(start);
      for (const slot of p.slots) {
        const bar = el("rect", {
          class: `bar ${p.outcome === "timed_out" ? "timed_out" : "completed"} permit${start < since ? " clipped" : ""}`,
          "data-permit": i,
          "data-outcome": said[p.outcome],
          x: x0,
          y: top + slot * laneHeight + gap / 2,
          width: Math.max(x(end) - x0, 1),
          height: laneHeight - gap,
        }, marks);
        tooltip(bar, [
          `permit on slot${p.slots.length > 1 ? "s" : ""} ${p.slots.join(", ")}: ${said[p.outcome]}`,
          `holder: ${p.holder}`,
          `acquired ${stamp(start)}`,
          `ended ${stamp(end)}`,
          `held ${human(p.held_seconds)}`,
          p.metadata === null ? "" : `metadata: ${JSON.stringify(p.metadata, null, 1)}`,
        ]);
      }
    });
    return;
  }
  if (!data.aggregated) {
    if (data.claims.length === 0) {
      text(marks, LEFT + PLOT / 2, top + 16, "no claims in this window", { "text-anchor": "middle", class: "empty" });
    }
    for (const c of data.claims) {
      const start = ms(c.claimed_at);
      const end = c.ended_at === null ? Math.min(asOf, until) : ms(c.ended_at);
      const x0 = x(start);
      const bar = el("rect", {
        class: `bar ${c.outcome}${start < since ? " clipped" : ""}`,
        "data-id": c.id,
        x: x0,
        y: top + c.slots[0] * laneHeight + gap / 2,
        width: Math.max(x(end) - x0, 1),
        height: laneHeight - gap,
      }, marks);
      tooltip(bar, [
        `claim #${c.id} on slot ${c.slots[0]}: ${c.outcome.replace("_", " ")}`,
        `holder: ${c.holder}`,
        `claimed ${stamp(start)}`,
        c.ended_at === null ? "still held" : `ended ${stamp(end)}`,
        `held ${human(c.held_seconds)}`,
        c.metadata === null ? "" : `metadata: ${JSON.stringify(c.metadata, null, 1)}`,
      ]);
    }
    return;
  }
  const width = PLOT / data.occupancy.length;
  const perCell = data.bucket_seconds * data.slots_per_lane;
  for (const cell of data.cells) {
    const busy = Math.min(cell.busy_seconds / perCell, 1);
    const light = 92 - Math.round(busy * 62);
    const hue = cell.timed_out > 0 ? "0, 70%" : "221, 83%";
    const start = since + cell.bucket * data.bucket_seconds * 1000;
    const rect = el("rect", {
      class: "cell",
      x: LEFT + cell.bucket * width,
      y: top + cell.lane * laneHeight + gap / 2,
      width: Math.max(width - 0.3, 0.5),
      height: laneHeight - gap,
      fill: `hsl(${hue}, ${light}%)`,
    }, marks);
    tooltip(rect, [
      `${laneLabel(cell.lane)}, ${stamp(start)} + ${human(data.bucket_seconds)}`,
      `busy ${(busy * 100).toFixed(0)}%, ${count(cell.claims)} ${advisory ? "permits" : "claims"}, ` +
        `${count(cell.timed_out)} ${words.timed_out}`,
      `most frequent holder: ${cell.top_holder}`,
    ]);
  }
}

function occupancy() {
  const height = 200;
  const top = 8;
  const bottom = top + height;
  const svg = svgIn("occupancy", bottom + 36);
  svg.setAttribute("id", "occupancy-svg");
  const buckets = data.occupancy;
  const yMax = Math.max(data.capacity, ...buckets.map((b) => b.peak), 1) * 1.1;
  const y = (v) => bottom - (v / yMax) * height;
  const grid = el("g", { class: "grid" }, svg);
  const axis = el("g", { class: "axis" }, svg);
  const yStep = niceStep(yMax, 5);
  for (let v = 0; v <= yMax; v += yStep) {
    el("line", { x1: LEFT, x2: LEFT + PLOT, y1: y(v), y2: y(v) }, grid);
    text(axis, LEFT - 8, y(v) + 4, count(v), { "text-anchor": "end" });
  }
  timeAxis(svg, top, bottom);
  const width = PLOT / buckets.length;
  const marks = el("g", { class: "marks" }, svg);
  let peak = "";
  buckets.forEach((b, i) => {
    const x0 = LEFT + i * width;
    const bar = el("rect", {
      class: "occ-mean", x: x0, y: y(b.mean), width: Math.max(width - 0.3, 0.5), height: bottom - y(b.mean),
    }, marks);
    tooltip(bar, [`${stamp(ms(b.start))} + ${human(data.bucket_seconds)}`, `mean held ${b.mean.toFixed(2)}, peak ${b.peak}`]);
    peak += `${i === 0 ? "M" : "L"}${x0},${y(b.peak)}H${x0 + width}`;
  });
  el("path", { class: "occ-peak", d: peak }, marks);
  el("line", { class: "capacity", x1: LEFT, x2: LEFT + PLOT, y1: y(data.capacity), y2: y(data.capacity) }, marks);
  text(marks, LEFT + PLOT - 4, y(data.capacity) - 5, `capacity ${count(data.capacity)}`, {
    "text-anchor": "end", class: "capacity-label",
  });
}

function holdTimes() {
  const bins = data.hold_times;
  if (bins.length === 0) {
    document.getElementById("holds").appendChild(html("p", "empty", `no finished ${advisory ? "permits" : "claims"} in this window`));
    return;
  }
  const height = 160;
  const top = 8;
  const bottom = top + height;
  const svg = svgIn("holds", bottom + 36);
  svg.setAttribute("id", "holds-svg");
  const yMax = Math.max(...bins.map((b) => b.completed + b.timed_out), 1) * 1.1;
  const y = (v) => bottom - (v / yMax) * height;
  const grid = el("g", { class: "grid" }, svg);
  const axis = el("g", { class: "axis" }, svg);
  const yStep = niceStep(yMax, 4);
  for (let v = 0; v <= yMax; v += yStep) {
    el("line", { x1: LEFT, x2: LEFT + PLOT, y1: y(v), y2: y(v) }, grid);
    text(axis, LEFT - 8, y(v) + 4, count(v), { "text-anchor": "end" });
  }
  el("line", { x1: LEFT, x2: LEFT + PLOT, y1: bottom, y2: bottom }, axis);
  const width = PLOT / bins.length;
  const marks = el("g", { class: "marks" }, svg);
  bins.forEach((b, i) => {
    const x0 = LEFT + i * width;
    let base = bottom;
    for (const outcome of ["completed", "timed_out"]) {
      if (b[outcome] === 0) continue;
      const h = bottom - y(b[outcome]);
      const bar = el("rect", { class: `hold ${outcome}`, x: x0 + 1, y: base - h, width: Math.max(width - 2, 1), height: h }, marks);
      tooltip(bar, [`held ${human(b.from_seconds)} to ${human(b.to_seconds)}`, `${count(b[outcome])} ${words[outcome]}`]);
      base -= h;
    }
    if (i % 5 === 0) text(axis, x0, bottom + 14, human(b.from_seconds), { "text-anchor": "middle" });
  });
  text(axis, LEFT + PLOT, bottom + 14, human(bins[bins.length - 1].to_seconds), { "text-anchor": "end" });
  text(axis, LEFT + PLOT / 2, bottom + 30, `hold time (finished ${advisory ? "permits" : "claims"})`, { "text-anchor": "middle" });
}

/// The requests refused and timed out per minute (the outcome counters).
function refusals() {
  if (data.outcomes === null || data.outcomes === undefined) {
    document.getElementById("refusals").appendChild(
      html("p", "empty", "a family key's refusals and timeouts are counted under its family, not per key"));
    return;
  }
  minuteBars("refusals", data.outcomes, [
    { key: "refused", label: "refused", className: "refused" },
    { key: "timed_out", label: "timed out", className: "timed_out" },
  ]);
}

header();
timeline();
occupancy();
holdTimes();
refusals();
document.body.dataset.rendered = "true";
