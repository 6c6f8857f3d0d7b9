//! `pg-semaphore report --html`: one self-contained page (no network) that
//! draws a [`Report`] (with the semaphore's outcome counters per minute),
//! or a rate limiter's decisions per minute (`--limiter`), with inline CSS,
//! JavaScript and SVG.
//!
//! The data goes into the page as JSON in a `<script
//! type="application/json">` element, with `<`, `>` and `&` written as
//! `\u003c`, `\u003e` and `\u0026`: a holder or metadata string can neither
//! close that element nor open another, and the script (`chart.js`, the
//! helpers both pages share, then `report.js` or `limiter.js`) puts every
//! string into the page with `textContent`, never as markup. The
//! Content-Security-Policy forbids loading anything from anywhere.

use chrono::{DateTime, Utc};
use pg_semaphore::admin::OutcomeCounts;
use pg_semaphore::audit::{Report, ReportShape};

use super::{LimiterHistory, json_compact, limiter_line, total};

const CSS: &str = include_str!("report.css");
const CHART_JS: &str = include_str!("chart.js");
const JS: &str = include_str!("report.js");
const LIMITER_JS: &str = include_str!("limiter.js");

/// The page's layout, which the report is read at: 240 time buckets across
/// the timeline and the occupancy chart, 30 bars in the hold-time
/// histogram, at most 100 lanes (a wider semaphore shares lanes), and a bar
/// per claim up to 5,000 claims (beyond, the database's aggregates): a page
/// of bounded size, however busy the window.
pub(crate) const SHAPE: ReportShape = ReportShape::new()
    .buckets(240)
    .hold_time_bins(30)
    .max_lanes(100)
    .max_claims(5_000);

/// The page of a semaphore's report; `outcomes`: its outcome counters'
/// minutes (`None` for a family key, counted under its family).
pub(crate) fn html(report: &Report, outcomes: Option<&[OutcomeCounts]>) -> String {
    // The report as the library serializes it, with the counters beside.
    let mut data = serde_json::to_value(report).expect("JSON of plain data");
    if let Some(object) = data.as_object_mut() {
        object.insert(
            "outcomes".into(),
            serde_json::to_value(outcomes).expect("JSON of plain data"),
        );
    }
    format!(
        r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>pg-semaphore report</title>
<style>
{CSS}</style>
</head>
<body>
<header>
<h1>pg-semaphore report: <span id="name"></span></h1>
<p class="sub" id="window"></p>
<p class="notice" id="notice" hidden></p>
<noscript><p class="notice">This report draws its charts with JavaScript: allow scripts for this file.</p></noscript>
<div class="stats" id="stats"></div>
</header>
<main>
<h2 id="timeline-title">Claims per slot</h2>
<div id="timeline"></div>
<div class="legend">
<span><i class="swatch completed"></i><span class="word-completed">completed</span></span>
<span><i class="swatch timed_out"></i><span class="word-timed-out">timed out</span></span>
<span class="lease-only"><i class="swatch live"></i>live</span>
<span><i class="swatch busy"></i><i class="swatch busy-timeout"></i>busy share of a time bucket (when aggregated)</span>
<span>hover a bar for its holder and metadata</span>
</div>
<h2>Occupancy against capacity</h2>
<div id="occupancy"></div>
<div class="legend">
<span><i class="swatch mean"></i>mean held per time bucket</span>
<span><i class="swatch peak"></i>peak held</span>
<span><i class="swatch cap"></i>capacity (now)</span>
</div>
<h2>Hold times</h2>
<div id="holds"></div>
<div class="legend">
<span><i class="swatch completed"></i><span class="word-completed">completed</span></span>
<span><i class="swatch timed_out"></i><span class="word-timed-out">timed out</span></span>
</div>
<h2>Refused and timed out per minute</h2>
<div id="refusals"></div>
<div class="legend">
<span><i class="swatch refused"></i>refused at once (no free slot, a full queue)</span>
<span><i class="swatch timed_out"></i>gave up at a timeout</span>
<span>as every process reported them, in the minute it wrote them (every 5 s); hover a bar for the rate per second</span>
</div>
</main>
<footer>pg-semaphore {version} · times in UTC</footer>
<script type="application/json" id="report-data">{data}</script>
<script>
{CHART_JS}{JS}</script>
</body>
</html>
"#,
        version = env!("CARGO_PKG_VERSION"),
        data = script_json(&json_compact(&data)),
    )
}

/// The page of a rate limiter's decisions per minute, read at `as_of`.
pub(crate) fn limiter_html(history: &LimiterHistory<'_>, as_of: DateTime<Utc>) -> String {
    let data = serde_json::json!({
        "kind": "rate_limiter",
        "limiter": history.limiter,
        "limiter_kind": history.kind,
        "since": history.window.start,
        "until": history.window.end,
        "as_of": as_of,
        "stored": limiter_line(history.info),
        "minutes": history.minutes,
        "total": total(history.minutes),
    });
    format!(
        r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>pg-semaphore report</title>
<style>
{CSS}</style>
</head>
<body>
<header>
<h1>pg-semaphore report: rate limiter <span id="name"></span></h1>
<p class="sub" id="window"></p>
<p class="sub" id="stored"></p>
<noscript><p class="notice">This report draws its charts with JavaScript: allow scripts for this file.</p></noscript>
<div class="stats" id="stats"></div>
</header>
<main>
<h2>Decisions per minute</h2>
<div id="decisions"></div>
<div class="legend">
<span><i class="swatch admitted"></i>admitted</span>
<span><i class="swatch refused"></i>refused</span>
<span><i class="swatch timed_out"></i>timed out (an acquire that could not be admitted within its wait)</span>
<span>as every process reported them, in the minute it wrote them (every 5 s); hover a bar for the rate per second</span>
</div>
</main>
<footer>pg-semaphore {version} · times in UTC</footer>
<script type="application/json" id="report-data">{data}</script>
<script>
{CHART_JS}{LIMITER_JS}</script>
</body>
</html>
"#,
        version = env!("CARGO_PKG_VERSION"),
        data = script_json(&json_compact(&data)),
    )
}

/// JSON made safe inside a `<script>` element. `<`, `>` and `&` only occur
/// inside JSON strings, where their `\u` escapes mean the same characters.
fn script_json(json: &str) -> String {
    json.replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_json_cannot_close_its_script_element() {
        let hostile = r#"{"holder":"</script><script>alert(1)</script><!-- & -->"}"#;
        let safe = script_json(hostile);
        assert!(!safe.contains('<') && !safe.contains('>') && !safe.contains('&'));
        let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
        let original: serde_json::Value = serde_json::from_str(hostile).unwrap();
        assert_eq!(back, original);
    }

    #[test]
    fn the_inline_assets_cannot_end_their_elements_early() {
        for js in [CHART_JS, JS, LIMITER_JS] {
            assert!(!js.to_ascii_lowercase().contains("</script"));
            // Strings from the data reach the page as text only.
            assert!(!js.contains("innerHTML") && !js.contains("insertAdjacentHTML"));
        }
        assert!(!CSS.to_ascii_lowercase().contains("</style"));
    }
}
