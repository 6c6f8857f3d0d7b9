//! Results: cells (one per implementation and configuration, repeated),
//! targets, the report, and formatting.

use std::time::Duration;

use serde_json::{Map, Value, json};

use crate::Workload;
use crate::load::Load;

/// One repetition's figures, for the median and the spread.
#[derive(Debug, Clone, Copy)]
pub struct Rep {
    pub rate: Option<f64>,
    pub p50: Option<Duration>,
}

/// One measured combination of workload, implementation and configuration.
#[derive(Debug)]
pub struct Cell {
    pub workload: &'static str,
    pub implementation: String,
    pub config: Map<String, Value>,
    /// Successful operations measured.
    pub ops: u64,
    /// Claims refused (no slot free), where that can happen.
    pub refused: u64,
    pub errors: u64,
    /// The measured window, for throughput; `None` for latency-only cells.
    pub elapsed: Option<Duration>,
    /// Per-operation latencies, sorted.
    pub samples: Vec<Duration>,
    /// Ratios to baselines, by name; `None` when the baseline measured zero.
    pub ratios: Vec<(String, Option<f64>)>,
    pub extra: Map<String, Value>,
    /// Each repetition's throughput and p50, when the cell was repeated.
    pub reps: Vec<Rep>,
}

impl Cell {
    pub fn new(workload: Workload, implementation: impl Into<String>, config: Value) -> Cell {
        Cell {
            workload: workload.name(),
            implementation: implementation.into(),
            config: match config {
                Value::Object(map) => map,
                _ => Map::new(),
            },
            ops: 0,
            refused: 0,
            errors: 0,
            elapsed: None,
            samples: Vec::new(),
            ratios: Vec::new(),
            extra: Map::new(),
            reps: Vec::new(),
        }
    }

    /// Repetitions of one cell as one: counts and samples added up,
    /// throughput and p50 the median of the repetitions' (with their spread),
    /// `extra` from the median repetition but for the `summed` keys, added up.
    pub fn from_reps(mut cells: Vec<Cell>, summed: &[&str]) -> Cell {
        let reps: Vec<Rep> = cells
            .iter()
            .map(|c| Rep {
                rate: c.ops_per_sec(),
                p50: c.p50(),
            })
            .collect();
        let median = median_index(&reps);
        let mut merged = cells.swap_remove(median);
        for cell in cells {
            merged.ops += cell.ops;
            merged.refused += cell.refused;
            merged.errors += cell.errors;
            merged.elapsed = match (merged.elapsed, cell.elapsed) {
                (Some(a), Some(b)) => Some(a + b),
                (a, b) => a.or(b),
            };
            merged.samples.extend(cell.samples);
            for key in summed {
                let total = merged.extra.get(*key).and_then(Value::as_u64).unwrap_or(0)
                    + cell.extra.get(*key).and_then(Value::as_u64).unwrap_or(0);
                merged.extra.insert((*key).to_owned(), total.into());
            }
            if let Some(error) = cell.extra.get("first_error") {
                merged
                    .extra
                    .entry("first_error")
                    .or_insert_with(|| error.clone());
            }
        }
        merged.samples.sort_unstable();
        merged.reps = reps;
        merged
    }

    /// The throughput's (min, max) over the repetitions.
    pub fn rate_spread(&self) -> Option<(f64, f64)> {
        let rates: Vec<f64> = self.reps.iter().filter_map(|r| r.rate).collect();
        let min = rates.iter().copied().reduce(f64::min)?;
        let max = rates.iter().copied().reduce(f64::max)?;
        Some((min, max))
    }

    /// The p50's (min, max) over the repetitions.
    pub fn p50_spread(&self) -> Option<(Duration, Duration)> {
        let p50s = self.reps.iter().filter_map(|r| r.p50);
        Some((p50s.clone().min()?, p50s.max()?))
    }

    pub fn from_load(
        workload: Workload,
        implementation: impl Into<String>,
        config: Value,
        load: Load,
    ) -> Cell {
        let mut cell = Cell::new(workload, implementation, config);
        cell.ops = load.samples.len() as u64;
        cell.refused = load.refused;
        cell.errors = load.errors;
        cell.elapsed = Some(load.elapsed);
        cell.samples = load.samples;
        cell.samples.sort_unstable();
        if let Some(error) = load.first_error {
            cell.extra.insert("first_error".into(), error.into());
        }
        cell
    }

    pub fn from_samples(
        workload: Workload,
        implementation: impl Into<String>,
        config: Value,
        mut samples: Vec<Duration>,
    ) -> Cell {
        let mut cell = Cell::new(workload, implementation, config);
        samples.sort_unstable();
        cell.ops = samples.len() as u64;
        cell.samples = samples;
        cell
    }

    /// Operations per second: the median repetition's, when repeated.
    pub fn ops_per_sec(&self) -> Option<f64> {
        if self.reps.len() > 1 {
            return median(self.reps.iter().filter_map(|r| r.rate).collect());
        }
        let elapsed = self.elapsed?.as_secs_f64();
        (elapsed > 0.0).then(|| self.ops as f64 / elapsed)
    }

    pub fn refused_per_sec(&self) -> Option<f64> {
        let elapsed = self.elapsed?.as_secs_f64();
        (elapsed > 0.0).then(|| self.refused as f64 / elapsed)
    }

    /// The median latency: the median of the repetitions' p50s, when repeated.
    pub fn p50(&self) -> Option<Duration> {
        if self.reps.len() > 1 {
            return median(self.reps.iter().filter_map(|r| r.p50).collect());
        }
        percentile(&self.samples, 50.0)
    }

    pub fn p99(&self) -> Option<Duration> {
        percentile(&self.samples, 99.0)
    }

    pub fn ratio(&self, name: &str) -> Option<f64> {
        self.ratios
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, r)| *r)
    }

    pub fn config_str(&self) -> String {
        self.config
            .iter()
            .map(|(k, v)| format!("{k}={}", v.to_string().trim_matches('"')))
            .collect::<Vec<_>>()
            .join(" ")
    }

    pub fn to_json(&self) -> Value {
        let ratios: Map<String, Value> = self
            .ratios
            .iter()
            .map(|(name, r)| (name.clone(), r.map_or(Value::Null, |r| json!(round(r, 4)))))
            .collect();
        json!({
            "workload": self.workload,
            "implementation": self.implementation,
            "configuration": self.config,
            "ops": self.ops,
            "refused": self.refused,
            "errors": self.errors,
            "elapsed_s": self.elapsed.map(|e| round(e.as_secs_f64(), 4)),
            "ops_per_sec": self.ops_per_sec().map(|r| round(r, 1)),
            "p50_us": self.p50().map(micros),
            "reps": self.reps.iter().map(|r| json!({
                "ops_per_sec": r.rate.map(|v| round(v, 1)),
                "p50_us": r.p50.map(micros),
            })).collect::<Vec<_>>(),
            "p99_us": self.p99().map(micros),
            "ratios": ratios,
            "extra": self.extra,
        })
    }

    /// A one-line summary for the progress log.
    pub fn progress(&self) -> String {
        let mut line = format!(
            "  {} {} [{}]: {} ok",
            self.workload,
            self.implementation,
            self.config_str(),
            self.ops
        );
        if let Some(rate) = self.ops_per_sec() {
            line += &format!(" ({}/s)", fmt_rate(rate));
        }
        if self.refused > 0 {
            line += &format!(", {} refused", self.refused);
        }
        line += &format!(", p50 {}, p99 {}", fmt_opt(self.p50()), fmt_opt(self.p99()));
        if self.errors > 0 {
            line += &format!(", {} ERRORS", self.errors);
        }
        line
    }
}

/// Sets `name` on every cell: its throughput divided by `baseline`'s.
pub fn throughput_ratios(cells: &mut [Cell], name: &str, baseline: usize) {
    let base = cells[baseline].ops_per_sec();
    for cell in cells.iter_mut() {
        let ratio = match (cell.ops_per_sec(), base) {
            (Some(ours), Some(base)) if base > 0.0 => Some(ours / base),
            _ => None,
        };
        cell.ratios.push((name.to_owned(), ratio));
    }
}

/// A performance target and its verdict, from this run's measurements.
#[derive(Debug)]
pub struct Target {
    pub workload: &'static str,
    pub target: String,
    pub measured: String,
    pub value: Option<f64>,
    pub threshold: f64,
    pub pass: bool,
}

impl Target {
    /// `value >= threshold` (a missing value fails).
    pub fn at_least(
        workload: Workload,
        target: impl Into<String>,
        value: Option<f64>,
        threshold: f64,
        measured: impl Into<String>,
    ) -> Target {
        let pass = value.is_some_and(|v| v >= threshold);
        Target::new(workload, target, value, threshold, measured, pass)
    }

    /// `value <= threshold` (a missing value fails).
    pub fn at_most(
        workload: Workload,
        target: impl Into<String>,
        value: Option<f64>,
        threshold: f64,
        measured: impl Into<String>,
    ) -> Target {
        let pass = value.is_some_and(|v| v <= threshold);
        Target::new(workload, target, value, threshold, measured, pass)
    }

    pub fn new(
        workload: Workload,
        target: impl Into<String>,
        value: Option<f64>,
        threshold: f64,
        measured: impl Into<String>,
        pass: bool,
    ) -> Target {
        Target {
            workload: workload.name(),
            target: target.into(),
            measured: measured.into(),
            value,
            threshold,
            pass,
        }
    }

    pub fn verdict(&self) -> &'static str {
        if self.pass { "PASS" } else { "FAIL" }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "workload": self.workload,
            "target": self.target,
            "measured": self.measured,
            "value": self.value.map(|v| round(v, 4)),
            "threshold": self.threshold,
            "pass": self.pass,
        })
    }
}

/// Collects everything; prints markdown as it goes, or JSON at the end.
#[derive(Debug)]
pub struct Report {
    pub json: bool,
    pub machine: Vec<(String, String)>,
    pub settings: Value,
    pub cells: Vec<Cell>,
    pub targets: Vec<Target>,
}

impl Report {
    pub fn print(&self, text: &str) {
        if !self.json {
            println!("{text}");
        }
    }

    pub fn add_cells(&mut self, cells: Vec<Cell>) {
        self.cells.extend(cells);
    }

    pub fn print_machine(&self) {
        let rows: Vec<Vec<String>> = self
            .machine
            .iter()
            .map(|(k, v)| vec![k.clone(), v.clone()])
            .collect();
        self.print("# pg-semaphore benchmark\n");
        self.print(&markdown_table(&["", ""], &rows));
    }

    pub fn print_targets(&self) {
        let rows: Vec<Vec<String>> = self
            .targets
            .iter()
            .map(|t| {
                vec![
                    t.workload.to_owned(),
                    t.target.clone(),
                    t.measured.clone(),
                    t.verdict().to_owned(),
                ]
            })
            .collect();
        self.print("## Targets\n");
        self.print(&markdown_table(
            &["workload", "target", "measured", "result"],
            &rows,
        ));
        let passed = self.targets.iter().filter(|t| t.pass).count();
        self.print(&format!(
            "{passed} of {} targets met.\n",
            self.targets.len()
        ));
    }

    pub fn print_json(&self, total: Duration) {
        let machine: Map<String, Value> = self
            .machine
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.clone())))
            .collect();
        let out = json!({
            "machine": machine,
            "settings": self.settings,
            "cells": self.cells.iter().map(Cell::to_json).collect::<Vec<_>>(),
            "targets": self.targets.iter().map(Target::to_json).collect::<Vec<_>>(),
            "total_seconds": round(total.as_secs_f64(), 1),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&out).unwrap_or_else(|e| format!("\"{e}\""))
        );
    }
}

/// The index of the repetition with the median throughput (else p50).
fn median_index(reps: &[Rep]) -> usize {
    let mut order: Vec<usize> = (0..reps.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |r: &Rep| r.rate.unwrap_or(0.0) + r.p50.map_or(0.0, |d| d.as_secs_f64());
        key(&reps[a]).total_cmp(&key(&reps[b]))
    });
    order
        .get(reps.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(0)
}

/// The median (the mean of the middle two of an even count).
pub fn median<T: Copy + PartialOrd + Median>(mut values: Vec<T>) -> Option<T> {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some(T::mean(values[n / 2 - 1], values[n / 2])),
    }
}

/// What [`median`] needs to average two values.
pub trait Median {
    fn mean(a: Self, b: Self) -> Self;
}

impl Median for f64 {
    fn mean(a: f64, b: f64) -> f64 {
        (a + b) / 2.0
    }
}

impl Median for Duration {
    fn mean(a: Duration, b: Duration) -> Duration {
        (a + b) / 2
    }
}

/// `4,568 (4,402–4,790)`: the median throughput and the spread.
pub fn fmt_rate_spread(cell: &Cell) -> String {
    let rate = fmt_rate(cell.ops_per_sec().unwrap_or(0.0));
    match cell.rate_spread() {
        Some((min, max)) if cell.reps.len() > 1 => {
            format!("{rate} ({}–{})", fmt_rate(min), fmt_rate(max))
        }
        _ => rate,
    }
}

/// `1.05 ms (0.98–1.10 ms)`: the median p50 and the spread.
pub fn fmt_p50_spread(cell: &Cell) -> String {
    let p50 = fmt_opt(cell.p50());
    match cell.p50_spread() {
        Some((min, max)) if cell.reps.len() > 1 => {
            format!("{p50} ({}–{})", fmt_dur(min), fmt_dur(max))
        }
        _ => p50,
    }
}

/// Nearest-rank percentile of sorted samples.
pub fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

pub fn micros(d: Duration) -> f64 {
    round(d.as_secs_f64() * 1e6, 1)
}

pub fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// `412 µs`, `3.21 ms`, `45.6 ms`, `2.03 s`.
pub fn fmt_dur(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1_000.0 {
        format!("{us:.0} µs")
    } else if us < 10_000.0 {
        format!("{:.2} ms", us / 1e3)
    } else if us < 1_000_000.0 {
        format!("{:.1} ms", us / 1e3)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

pub fn fmt_opt(d: Option<Duration>) -> String {
    d.map_or_else(|| "–".into(), fmt_dur)
}

/// A whole number with thousands separators: `12,345`.
pub fn fmt_int(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub fn fmt_rate(rate: f64) -> String {
    if rate < 100.0 {
        format!("{rate:.1}")
    } else {
        fmt_int(rate.round() as u64)
    }
}

pub fn fmt_ratio(ratio: Option<f64>) -> String {
    ratio.map_or_else(|| "–".into(), |r| format!("{r:.2}x"))
}

pub fn fmt_bytes(bytes: f64) -> String {
    pub const MIB: f64 = 1024.0 * 1024.0;
    if bytes >= 1024.0 * MIB {
        format!("{:.2} GiB", bytes / (1024.0 * MIB))
    } else {
        format!("{:.1} MiB", bytes / MIB)
    }
}

/// A markdown table, columns padded; columns whose every cell is a number
/// (or `–`) are right-aligned.
pub fn markdown_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let numeric = |i: usize| {
        i > 0
            && rows.iter().all(|r| {
                r.get(i).is_some_and(|c| {
                    c.starts_with(|ch: char| ch.is_ascii_digit() || matches!(ch, '–' | '-' | '+'))
                })
            })
    };
    let right: Vec<bool> = (0..headers.len()).map(numeric).collect();
    let width = |i: usize| {
        rows.iter()
            .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
            .chain(std::iter::once(headers[i].chars().count()))
            .max()
            .unwrap_or(0)
            .max(3)
    };
    let widths: Vec<usize> = (0..headers.len()).map(width).collect();
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let pad = widths[i].saturating_sub(c.chars().count());
                if right[i] {
                    format!("{}{c}", " ".repeat(pad))
                } else {
                    format!("{c}{}", " ".repeat(pad))
                }
            })
            .collect();
        format!("| {} |\n", padded.join(" | "))
    };
    let mut out = line(headers.iter().map(|h| (*h).to_owned()).collect());
    let rule: Vec<String> = widths
        .iter()
        .enumerate()
        .map(|(i, w)| {
            if right[i] {
                format!("{}:", "-".repeat(w - 1))
            } else {
                "-".repeat(*w)
            }
        })
        .collect();
    out += &format!("| {} |\n", rule.join(" | "));
    for row in rows {
        out += &line(row.clone());
    }
    out
}
