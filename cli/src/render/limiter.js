// Draws a rate limiter's decisions per minute from the JSON in
// #report-data ({"kind": "rate_limiter", limiter, limiter_kind, since,
// until, as_of, stored, minutes, total}), with the helpers of chart.js,
// which precedes it in the page's one script.

function limiterHeader() {
  const name = `${data.limiter} (${data.limiter_kind})`;
  document.title = `pg-semaphore report: ${name}`;
  document.getElementById("name").textContent = name;
  document.getElementById("window").textContent =
    `${stamp(since)} to ${stamp(until)} (${human(span / 1000)}), read at ${stamp(asOf)}`;
  const t = data.total;
  const decided = t.admitted + t.refused + t.timed_out;
  const busiest = Math.max(0, ...data.minutes.map((m) => m.admitted + m.refused + m.timed_out));
  const stats = document.getElementById("stats");
  for (const [value, label, className] of [
    [count(t.admitted), "admitted", "admitted"],
    [count(t.refused), "refused", "refused"],
    [count(t.timed_out), "timed out", "timed_out"],
    [decided === 0 ? "-" : `${(((t.refused + t.timed_out) * 100) / decided).toFixed(1)}%`, "refused or timed out", "share"],
    [count(busiest), "decisions in the busiest minute", "busiest"],
    [(busiest / 60).toFixed(2), "per second in the busiest minute", "rate"],
  ]) {
    const box = html("div", `stat ${className}`);
    box.appendChild(html("div", "value", value));
    box.appendChild(html("div", "label", label));
    stats.appendChild(box);
  }
  document.getElementById("stored").textContent = `Stored now: ${data.stored}.`;
}

limiterHeader();
minuteBars("decisions", data.minutes, [
  { key: "admitted", label: "admitted", className: "admitted" },
  { key: "refused", label: "refused", className: "refused" },
  { key: "timed_out", label: "timed out", className: "timed_out" },
]);
document.body.dataset.rendered = "true";
