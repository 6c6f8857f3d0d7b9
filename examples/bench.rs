//! Benchmarks pg-semaphore side by side with the designs it comes from, in one
//! run on one server, and checks the project's performance targets.
//!
//! ```text
//! cargo run --release --example bench                  # every workload (~6 min + growth)
//! cargo run --release --example bench -- --quick       # every workload ~5x shorter
//! cargo run --release --example bench -- --json        # JSON instead of markdown tables
//! cargo run --release --example bench -- --only mutex  # semaphore|mutex|wakeup|waiters|growth|rate
//! ```
//!
//! It finds or starts PostgreSQL exactly as the tests do (`DATABASE_URL`, else
//! a throwaway server from the local binaries, else Docker), creates a database
//! of its own (`pgsem_bench_<pid>`, dropped at the end), migrates it, and runs:
//!
//! 1. **semaphore**: fail-fast claim + immediate release cycles, against the
//!    Django slot table of seed 001 and the counter row of seed 000;
//! 2. **mutex**: lock + unlock, against a raw `pg_advisory_xact_lock` loop
//!    and sqlx's `PgAdvisoryLock`;
//! 3. **wakeup**: time from a release to the waiter's `acquire()` returning,
//!    against a `SELECT 1` round trip and the polling fallback;
//! 4. **waiters**: 1,000 tasks waiting on one permit: connections, memory,
//!    order served, time to drain;
//! 5. **growth**: a million cycles, the slot table's size without and with
//!    a retention reaper (each run in a fresh database of its own);
//! 6. **rate**: rate limiter decisions (token bucket, fixed window, sliding
//!    window), against a bare single-row `UPDATE` counter.
//!
//! Baselines are plain SQL on sqlx, in their own schema (`bench_baseline`).
//! Every ratio and PASS/FAIL is computed from numbers measured in the same
//! run. Tables (or JSON) go to stdout, progress to stderr.

use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pg_semaphore::{
    Error, FixedWindow, Mutex, PgAdvisoryLockKey, Reaper, Semaphore, SlidingWindow, TokenBucket,
};
use serde_json::{Map, Value, json};
use sqlx::postgres::{PgAdvisoryLock, PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};
use testkit::server;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

const USAGE: &str = "usage: cargo run --release --example bench -- [--json] [--quick] \
                     [--only semaphore|mutex|wakeup|waiters|growth|rate]";

/// The schema the baselines' tables live in; never `pgsemaphore`.
const BASELINE_SCHEMA: &str = "bench_baseline";

/// Extra pooled connections beyond one per client.
const POOL_SPARE: u32 = 2;

/// The mutex workload's hot key, and the range its spread keys are drawn from.
const HOT_KEY: i64 = 4_242;
const SPREAD_BASE: i64 = 1_000_000;
const SPREAD_KEYS: u64 = 100_000;

/// How long the wake-up workload lets the waiter settle into waiting.
const WAKE_SETTLE: Duration = Duration::from_millis(30);

/// The waiters workload's pool (sqlx's default size) and each waiter's patience.
const WAITERS_POOL: u32 = 10;
const WAITERS_PATIENCE: Duration = Duration::from_secs(60);

/// The growth workload's shape and its retention reaper.
const GROWTH_CLIENTS: usize = 8;
const GROWTH_CAPACITY: u32 = 4;
const REAPER_INTERVAL: Duration = Duration::from_secs(1);
const REAPER_RETENTION: Duration = Duration::from_secs(2);

/// The rate workload's keys ("per user") and each limiter's limit per second.
const RATE_KEYS: u64 = 1_000;
const RATE_LIMIT: u32 = 1_000;

// ---------------------------------------------------------------------------
// Command line and settings
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    Semaphore,
    Mutex,
    Wakeup,
    Waiters,
    Growth,
    Rate,
}

impl Workload {
    const ALL: [Workload; 6] = [
        Workload::Semaphore,
        Workload::Mutex,
        Workload::Wakeup,
        Workload::Waiters,
        Workload::Growth,
        Workload::Rate,
    ];

    fn name(self) -> &'static str {
        match self {
            Workload::Semaphore => "semaphore",
            Workload::Mutex => "mutex",
            Workload::Wakeup => "wakeup",
            Workload::Waiters => "waiters",
            Workload::Growth => "growth",
            Workload::Rate => "rate",
        }
    }

    fn parse(name: &str) -> Result<Workload, String> {
        Workload::ALL
            .into_iter()
            .find(|w| w.name() == name)
            .ok_or_else(|| format!("unknown workload {name:?}"))
    }
}

#[derive(Debug, Default)]
struct Args {
    json: bool,
    quick: bool,
    only: Option<Workload>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args::default();
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--json" => args.json = true,
            "--quick" => args.quick = true,
            "--only" => {
                let name = it.next().ok_or("--only needs a workload")?;
                args.only = Some(Workload::parse(&name)?);
            }
            "-h" | "--help" => return Err(String::new()),
            other => match other.strip_prefix("--only=") {
                Some(name) => args.only = Some(Workload::parse(name)?),
                None => return Err(format!("unknown argument {other:?}")),
            },
        }
    }
    Ok(args)
}

/// How long each workload runs; `--quick` divides everything by about 5.
#[derive(Debug, Clone)]
struct Settings {
    quick: bool,
    warmup: Duration,
    cell: Duration,
    wake_warmup: usize,
    wake_reps: usize,
    select_reps: usize,
    fallback_reps: usize,
    waiters: usize,
    growth_cycles: u64,
}

impl Settings {
    fn new(quick: bool) -> Settings {
        if quick {
            Settings {
                quick,
                warmup: Duration::from_millis(100),
                cell: Duration::from_millis(600),
                wake_warmup: 3,
                wake_reps: 40,
                select_reps: 200,
                fallback_reps: 4,
                waiters: 200,
                growth_cycles: 100_000,
            }
        } else {
            Settings {
                quick,
                warmup: Duration::from_millis(500),
                cell: Duration::from_secs(3),
                wake_warmup: 10,
                wake_reps: 200,
                select_reps: 1_000,
                fallback_reps: 20,
                waiters: 1_000,
                growth_cycles: 1_000_000,
            }
        }
    }

    /// The growth workload measures the table size every tenth of the run.
    fn growth_checkpoint(&self) -> u64 {
        (self.growth_cycles / 10).max(1)
    }
}

// ---------------------------------------------------------------------------
// Results: cells, targets, the report
// ---------------------------------------------------------------------------

/// One measured combination of workload, implementation and configuration.
#[derive(Debug)]
struct Cell {
    workload: &'static str,
    implementation: String,
    config: Map<String, Value>,
    /// Successful operations measured.
    ops: u64,
    /// Claims refused (no slot free), where that can happen.
    refused: u64,
    errors: u64,
    /// The measured window, for throughput; `None` for latency-only cells.
    elapsed: Option<Duration>,
    /// Per-operation latencies, sorted.
    samples: Vec<Duration>,
    /// Ratios to baselines, by name; `None` when the baseline measured zero.
    ratios: Vec<(String, Option<f64>)>,
    extra: Map<String, Value>,
}

impl Cell {
    fn new(workload: Workload, implementation: impl Into<String>, config: Value) -> Cell {
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
        }
    }

    fn from_load(
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

    fn from_samples(
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

    fn ops_per_sec(&self) -> Option<f64> {
        let elapsed = self.elapsed?.as_secs_f64();
        (elapsed > 0.0).then(|| self.ops as f64 / elapsed)
    }

    fn refused_per_sec(&self) -> Option<f64> {
        let elapsed = self.elapsed?.as_secs_f64();
        (elapsed > 0.0).then(|| self.refused as f64 / elapsed)
    }

    fn p50(&self) -> Option<Duration> {
        percentile(&self.samples, 50.0)
    }

    fn p99(&self) -> Option<Duration> {
        percentile(&self.samples, 99.0)
    }

    fn ratio(&self, name: &str) -> Option<f64> {
        self.ratios
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, r)| *r)
    }

    fn config_str(&self) -> String {
        self.config
            .iter()
            .map(|(k, v)| format!("{k}={}", v.to_string().trim_matches('"')))
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn to_json(&self) -> Value {
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
            "p99_us": self.p99().map(micros),
            "ratios": ratios,
            "extra": self.extra,
        })
    }

    /// A one-line summary for the progress log.
    fn progress(&self) -> String {
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
fn throughput_ratios(cells: &mut [Cell], name: &str, baseline: usize) {
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
struct Target {
    workload: &'static str,
    target: String,
    measured: String,
    value: Option<f64>,
    threshold: f64,
    pass: bool,
}

impl Target {
    /// `value >= threshold` (a missing value fails).
    fn at_least(
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
    fn at_most(
        workload: Workload,
        target: impl Into<String>,
        value: Option<f64>,
        threshold: f64,
        measured: impl Into<String>,
    ) -> Target {
        let pass = value.is_some_and(|v| v <= threshold);
        Target::new(workload, target, value, threshold, measured, pass)
    }

    fn new(
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

    fn verdict(&self) -> &'static str {
        if self.pass { "PASS" } else { "FAIL" }
    }

    fn to_json(&self) -> Value {
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
struct Report {
    json: bool,
    machine: Vec<(&'static str, String)>,
    settings: Value,
    cells: Vec<Cell>,
    targets: Vec<Target>,
}

impl Report {
    fn print(&self, text: &str) {
        if !self.json {
            println!("{text}");
        }
    }

    fn add_cells(&mut self, cells: Vec<Cell>) {
        self.cells.extend(cells);
    }

    fn print_machine(&self) {
        let rows: Vec<Vec<String>> = self
            .machine
            .iter()
            .map(|(k, v)| vec![(*k).to_owned(), v.clone()])
            .collect();
        self.print("# pg-semaphore benchmark\n");
        self.print(&markdown_table(&["", ""], &rows));
    }

    fn print_targets(&self) {
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

    fn print_json(&self, total: Duration) {
        let machine: Map<String, Value> = self
            .machine
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Value::from(v.clone())))
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

// ---------------------------------------------------------------------------
// Running the benchmark
// ---------------------------------------------------------------------------

/// What every workload needs.
#[derive(Debug)]
struct Ctx {
    /// The server's default database (for CREATE/DROP DATABASE).
    server: PgConnectOptions,
    /// The bench database.
    opts: PgConnectOptions,
    pid: u32,
    /// Databases created besides the bench database, to drop at the end.
    extra_dbs: Vec<String>,
    settings: Settings,
    report: Report,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            if message.is_empty() {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            eprintln!("{message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench failed: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Res<()> {
    let started = Instant::now();
    // Finding or starting the server blocks (initdb, pg_ctl): keep it off the runtime.
    let server = tokio::task::spawn_blocking(server::server).await?;
    eprintln!("PostgreSQL: {}", server.description);
    let pid = std::process::id();
    let db = format!("pgsem_bench_{pid}");
    create_database(&server.options, &db).await?;
    let settings = Settings::new(args.quick);
    let mut ctx = Ctx {
        server: server.options.clone(),
        opts: server.options.clone().database(&db),
        pid,
        extra_dbs: Vec::new(),
        report: Report {
            json: args.json,
            machine: Vec::new(),
            settings: json!({
                "quick": args.quick,
                "only": args.only.map(Workload::name),
                "warmup_s": settings.warmup.as_secs_f64(),
                "cell_s": settings.cell.as_secs_f64(),
                "wake_reps": settings.wake_reps,
                "select_reps": settings.select_reps,
                "fallback_reps": settings.fallback_reps,
                "waiters": settings.waiters,
                "growth_cycles": settings.growth_cycles,
            }),
            cells: Vec::new(),
            targets: Vec::new(),
        },
        settings,
    };
    ctx.report
        .machine
        .push(("server", server.description.clone()));
    ctx.report.machine.push(("database", db.clone()));

    let outcome = tokio::select! {
        outcome = run_workloads(&mut ctx, args.only) => outcome,
        _ = tokio::signal::ctrl_c() => Err("interrupted".into()),
    };

    // Clean up whatever happened.
    for name in ctx.extra_dbs.iter().chain(std::iter::once(&db)) {
        if let Err(error) = drop_database(&ctx.server, name).await {
            eprintln!("could not drop database {name}: {error}");
        }
    }
    outcome?;

    let total = started.elapsed();
    if args.json {
        ctx.report.print_json(total);
    } else {
        ctx.report.print_targets();
        println!("Total run time: {:.1} s.", total.as_secs_f64());
    }
    Ok(())
}

async fn run_workloads(ctx: &mut Ctx, only: Option<Workload>) -> Res<()> {
    {
        let pool = pool(&ctx.opts, 2).await?;
        pg_semaphore::migrate(&pool).await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE SCHEMA {BASELINE_SCHEMA};
             CREATE TABLE {BASELINE_SCHEMA}.counters (
                 name text PRIMARY KEY,
                 max  integer NOT NULL,
                 used integer NOT NULL DEFAULT 0
             );"
        )))
        .execute(&pool)
        .await?;
        describe_machine(&pool, &mut ctx.report).await?;
        pool.close().await;
    }
    let settings = &ctx.settings;
    ctx.report.machine.push((
        "settings",
        format!(
            "{} s per cell after a {} s warm-up{}",
            settings.cell.as_secs_f64(),
            settings.warmup.as_secs_f64(),
            if settings.quick { " (--quick)" } else { "" }
        ),
    ));
    ctx.report.machine.push((
        "pools",
        "sqlx defaults except size (test_before_acquire = true: a ping per checkout), \
         the same for every implementation"
            .to_owned(),
    ));
    ctx.report.print_machine();

    for workload in Workload::ALL {
        if only.is_some_and(|only| only != workload) {
            continue;
        }
        eprintln!("== {}", workload.name());
        let started = Instant::now();
        match workload {
            Workload::Semaphore => semaphore_workload(ctx).await?,
            Workload::Mutex => mutex_workload(ctx).await?,
            Workload::Wakeup => wakeup_workload(ctx).await?,
            Workload::Waiters => waiters_workload(ctx).await?,
            Workload::Growth => growth_workload(ctx).await?,
            Workload::Rate => rate_workload(ctx).await?,
        }
        let took = started.elapsed().as_secs_f64();
        eprintln!("== {} took {took:.1} s", workload.name());
        ctx.report.print(&format!(
            "_{} workload: {took:.1} s of wall time._\n",
            workload.name()
        ));
    }
    Ok(())
}

/// The header: the machine and the server, so numbers can be compared.
async fn describe_machine(pool: &PgPool, report: &mut Report) -> Res<()> {
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    report.machine.push(("nproc", nproc.to_string()));
    report.machine.push((
        "cpu",
        proc_value("/proc/cpuinfo", "model name").unwrap_or_else(|| "unknown".into()),
    ));
    let memory = proc_value("/proc/meminfo", "MemTotal")
        .and_then(|v| kib(&v))
        .map_or_else(|| "unknown".into(), |b| fmt_bytes(b as f64));
    report.machine.push(("memory", memory));
    let version: String = sqlx::query_scalar("SELECT version()")
        .fetch_one(pool)
        .await?;
    report.machine.push(("postgresql", version));
    let settings: String = sqlx::query_scalar(
        "SELECT string_agg(name || '=' || setting || coalesce(unit, ''), ', ' ORDER BY name) \
         FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'max_connections', \
         'shared_buffers', 'autovacuum_naptime')",
    )
    .fetch_one(pool)
    .await?;
    report.machine.push(("server settings", settings));
    Ok(())
}

// ---------------------------------------------------------------------------
// Shared helpers: load generation, percentiles, formatting, databases
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Outcome {
    /// The operation succeeded (a cycle, a lock).
    Done,
    /// A fail-fast claim found no free slot.
    Refused,
}

/// What a closed-loop load measured.
#[derive(Debug, Default)]
struct Load {
    samples: Vec<Duration>,
    refused: u64,
    errors: u64,
    elapsed: Duration,
    first_error: Option<String>,
}

/// Runs `op` in a closed loop on `clients` tasks: a warm-up, then a measured
/// window. Operations that *start* in the window are measured; the window
/// ends when the last of them finishes. `op` gets the client's index and its
/// operation sequence number.
async fn run_load<F, Fut>(clients: usize, warmup: Duration, window: Duration, op: F) -> Res<Load>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Res<Outcome>> + Send + 'static,
{
    let op = Arc::new(op);
    let from = Instant::now() + warmup;
    let until = from + window;
    let tasks: Vec<_> = (0..clients)
        .map(|client| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut load = Load::default();
                let mut last_end = from;
                for seq in 0u64.. {
                    let began = Instant::now();
                    if began >= until {
                        break;
                    }
                    let result = op(client, seq).await;
                    let ended = Instant::now();
                    let measured = began >= from;
                    if measured {
                        last_end = last_end.max(ended);
                    }
                    match result {
                        Ok(Outcome::Done) if measured => load.samples.push(ended - began),
                        Ok(Outcome::Refused) if measured => load.refused += 1,
                        Ok(_) => {}
                        Err(error) => {
                            load.errors += u64::from(measured);
                            load.first_error.get_or_insert_with(|| error.to_string());
                            // Do not spin on a persistent error.
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
                (load, last_end)
            })
        })
        .collect();
    let mut total = Load::default();
    let mut last_end = from;
    for task in tasks {
        let (load, end) = task.await?;
        total.samples.extend(load.samples);
        total.refused += load.refused;
        total.errors += load.errors;
        if total.first_error.is_none() {
            total.first_error = load.first_error;
        }
        last_end = last_end.max(end);
    }
    total.elapsed = last_end.saturating_duration_since(from);
    if let Some(error) = &total.first_error {
        eprintln!("  error during the load: {error}");
    }
    Ok(total)
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

fn micros(d: Duration) -> f64 {
    round(d.as_secs_f64() * 1e6, 1)
}

fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// `412 µs`, `3.21 ms`, `45.6 ms`, `2.03 s`.
fn fmt_dur(d: Duration) -> String {
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

fn fmt_opt(d: Option<Duration>) -> String {
    d.map_or_else(|| "–".into(), fmt_dur)
}

/// A whole number with thousands separators: `12,345`.
fn fmt_int(n: u64) -> String {
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

fn fmt_rate(rate: f64) -> String {
    if rate < 100.0 {
        format!("{rate:.1}")
    } else {
        fmt_int(rate.round() as u64)
    }
}

fn fmt_ratio(ratio: Option<f64>) -> String {
    ratio.map_or_else(|| "–".into(), |r| format!("{r:.2}x"))
}

fn fmt_bytes(bytes: f64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if bytes >= 1024.0 * MIB {
        format!("{:.2} GiB", bytes / (1024.0 * MIB))
    } else {
        format!("{:.1} MiB", bytes / MIB)
    }
}

/// A markdown table, columns padded; columns whose every cell is a number
/// (or `–`) are right-aligned.
fn markdown_table(headers: &[&str], rows: &[Vec<String>]) -> String {
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

/// A field of a `key : value` file such as /proc/cpuinfo or /proc/meminfo.
fn proc_value(path: &str, key: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_owned())
        })
}

/// `123456 kB` in bytes.
fn kib(value: &str) -> Option<u64> {
    value
        .split_whitespace()
        .next()?
        .parse::<u64>()
        .ok()
        .map(|k| k * 1024)
}

/// This process's resident set size.
fn rss_bytes() -> Option<u64> {
    proc_value("/proc/self/status", "VmRSS").and_then(|v| kib(&v))
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

async fn pool(opts: &PgConnectOptions, max_connections: u32) -> Res<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(opts.clone())
        .await?)
}

/// A connection of its own, retrying while a fresh server finishes starting.
async fn connect(opts: &PgConnectOptions) -> Res<PgConnection> {
    let mut attempts = 0;
    loop {
        match PgConnection::connect_with(opts).await {
            Ok(conn) => return Ok(conn),
            Err(error) if attempts >= 50 => return Err(error.into()),
            Err(_) => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

async fn create_database(server: &PgConnectOptions, name: &str) -> Res<()> {
    drop_database(server, name).await?; // a leftover of an interrupted run
    let mut admin = connect(server).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"CREATE DATABASE "{name}" TEMPLATE template0"#
    )))
    .execute(&mut admin)
    .await?;
    admin.close().await?;
    Ok(())
}

async fn drop_database(server: &PgConnectOptions, name: &str) -> Res<()> {
    let mut admin = connect(server).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
    )))
    .execute(&mut admin)
    .await?;
    admin.close().await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// 1. Semaphore acquire + release cycles
// ---------------------------------------------------------------------------

const SEM_OURS: &str = "ours";
const SEM_DJANGO: &str = "seed 001 (Django slot table)";
const SEM_COUNTER: &str = "seed 000 (counter row)";

/// Fail-fast claim and immediate release, at 1, 8 and 32 clients, capacity 4 and 32.
async fn semaphore_workload(ctx: &mut Ctx) -> Res<()> {
    let mut all = Vec::new();
    for clients in [1usize, 8, 32] {
        for capacity in [4u32, 32] {
            let config = json!({ "clients": clients, "capacity": capacity });
            let mut group = vec![
                sem_ours(ctx, clients, capacity, config.clone()).await?,
                sem_django(ctx, clients, capacity, config.clone()).await?,
                sem_counter(ctx, clients, capacity, config).await?,
            ];
            throughput_ratios(&mut group, "vs_seed001", 1);
            throughput_ratios(&mut group, "vs_counter", 2);
            all.extend(group);
        }
    }

    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.implementation.clone(),
                c.config["clients"].to_string(),
                c.config["capacity"].to_string(),
                fmt_rate(c.ops_per_sec().unwrap_or(0.0)),
                fmt_int(c.refused),
                fmt_rate(c.refused_per_sec().unwrap_or(0.0)),
                fmt_opt(c.p50()),
                fmt_opt(c.p99()),
                fmt_ratio(c.ratio("vs_seed001")),
                fmt_ratio(c.ratio("vs_counter")),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 1. Semaphore: try_acquire + release cycles\n\n\
         Each client loops: claim without waiting; if it got a slot, release it at once. \
         cycles/s counts successful claim+release cycles; refused counts claims that found \
         every slot taken. Latency is per successful cycle (claim + release). Ratios are \
         cycles/s divided by the baseline's in the same configuration. {} s per cell.\n",
        ctx.settings.cell.as_secs_f64()
    ));
    ctx.report.print(&markdown_table(
        &[
            "implementation",
            "clients",
            "capacity",
            "cycles/s",
            "refused",
            "refused/s",
            "p50 cycle",
            "p99 cycle",
            "÷ seed 001",
            "÷ counter",
            "errors",
        ],
        &rows,
    ));

    let ours = all.iter().find(|c| {
        c.implementation == SEM_OURS && c.config["clients"] == 8 && c.config["capacity"] == 4
    });
    let vs_django = ours.and_then(|c| c.ratio("vs_seed001"));
    let vs_counter = ours.and_then(|c| c.ratio("vs_counter"));
    ctx.report.targets.push(Target::at_least(
        Workload::Semaphore,
        "8 clients, capacity 4: ours ≥ 5x seed 001 cycles/s",
        vs_django,
        5.0,
        fmt_ratio(vs_django),
    ));
    ctx.report.targets.push(Target::at_least(
        Workload::Semaphore,
        "8 clients, capacity 4: ours ≥ 0.5x counter cycles/s",
        vs_counter,
        0.5,
        fmt_ratio(vs_counter),
    ));
    ctx.report.add_cells(all);
    Ok(())
}

async fn sem_ours(ctx: &Ctx, clients: usize, capacity: u32, config: Value) -> Res<Cell> {
    let pool = pool(&ctx.opts, clients as u32 + POOL_SPARE).await?;
    let sem = Semaphore::builder(format!("bench-sem-c{clients}-k{capacity}"), capacity)
        .build(&pool)
        .await?;
    let load = run_load(
        clients,
        ctx.settings.warmup,
        ctx.settings.cell,
        move |_, _| {
            let sem = sem.clone();
            async move {
                match sem.try_acquire().await {
                    Ok(permit) => {
                        permit.release().await?;
                        Ok(Outcome::Done)
                    }
                    Err(Error::NoSlotsAvailable { .. }) => Ok(Outcome::Refused),
                    Err(error) => Err(error.into()),
                }
            }
        },
    )
    .await?;
    pool.close().await;
    let cell = Cell::from_load(Workload::Semaphore, SEM_OURS, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}

/// The SQL of seed 001 (Django), for one table.
struct DjangoSql {
    sweep: Arc<str>,
    lock: Arc<str>,
    claim: Arc<str>,
    release: Arc<str>,
}

impl DjangoSql {
    fn new(table: &str) -> DjangoSql {
        DjangoSql {
            sweep: format!(
                "UPDATE {table} SET timed_out_at = now() \
                 WHERE created_at < now() - interval '90 seconds' \
                   AND completed_at IS NULL AND timed_out_at IS NULL"
            )
            .into(),
            lock: format!("LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE").into(),
            claim: format!(
                "INSERT INTO {table} (created_at, slot) \
                 SELECT now(), coalesce(min(slot), 0) \
                 FROM generate_series(0, $1) slot \
                 WHERE NOT EXISTS ( \
                     SELECT * FROM {table} \
                     WHERE {table}.slot = slot.slot \
                       AND completed_at IS NULL \
                       AND timed_out_at IS NULL) \
                 ON CONFLICT DO NOTHING \
                 RETURNING id"
            )
            .into(),
            release: format!("UPDATE {table} SET completed_at = now() WHERE id = $1").into(),
        }
    }
}

async fn sem_django(ctx: &Ctx, clients: usize, capacity: u32, config: Value) -> Res<Cell> {
    let pool = pool(&ctx.opts, clients as u32 + POOL_SPARE).await?;
    // A fresh table per cell, as the seed's model and migration define it.
    let name = format!("django_c{clients}_k{capacity}");
    let table = format!("{BASELINE_SCHEMA}.{name}");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {table} (
             id           bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
             created_at   timestamptz NOT NULL,
             completed_at timestamptz,
             timed_out_at timestamptz,
             slot         smallint NOT NULL CHECK (slot >= 0)
         );
         CREATE UNIQUE INDEX {name}_one_per_slot ON {table} (slot)
             WHERE completed_at IS NULL AND timed_out_at IS NULL;"
    )))
    .execute(&pool)
    .await?;
    let sql = Arc::new(DjangoSql::new(&table));
    let last_slot = capacity as i32 - 1; // the seed's NUM_SLOTS - 1
    let op_pool = pool.clone();
    let load = run_load(
        clients,
        ctx.settings.warmup,
        ctx.settings.cell,
        move |_, _| {
            let pool = op_pool.clone();
            let sql = sql.clone();
            async move {
                // claim(): the timeout sweep on its own, then the locked insert.
                sqlx::query(AssertSqlSafe(sql.sweep.clone()))
                    .execute(&pool)
                    .await?;
                let mut tx = pool.begin().await?;
                sqlx::query(AssertSqlSafe(sql.lock.clone()))
                    .execute(&mut *tx)
                    .await?;
                let id: Option<i64> = sqlx::query_scalar(AssertSqlSafe(sql.claim.clone()))
                    .bind(last_slot)
                    .fetch_optional(&mut *tx)
                    .await?;
                tx.commit().await?;
                let Some(id) = id else {
                    return Ok(Outcome::Refused); // NoSlotsAvailableException
                };
                // release()
                sqlx::query(AssertSqlSafe(sql.release.clone()))
                    .bind(id)
                    .execute(&pool)
                    .await?;
                Ok(Outcome::Done)
            }
        },
    )
    .await?;
    pool.close().await;
    let cell = Cell::from_load(Workload::Semaphore, SEM_DJANGO, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}

async fn sem_counter(ctx: &Ctx, clients: usize, capacity: u32, config: Value) -> Res<Cell> {
    let pool = pool(&ctx.opts, clients as u32 + POOL_SPARE).await?;
    let name = format!("bench-counter-c{clients}-k{capacity}");
    sqlx::query("INSERT INTO bench_baseline.counters (name, max, used) VALUES ($1, $2, 0)")
        .bind(&name)
        .bind(capacity as i32)
        .execute(&pool)
        .await?;
    let name: Arc<str> = name.into();
    let op_pool = pool.clone();
    let load = run_load(
        clients,
        ctx.settings.warmup,
        ctx.settings.cell,
        move |_, _| {
            let pool = op_pool.clone();
            let name = name.clone();
            async move {
                let used: Option<i32> = sqlx::query_scalar(
                    "UPDATE bench_baseline.counters SET used = used + 1 \
                     WHERE name = $1 AND used < max RETURNING used",
                )
                .bind(&*name)
                .fetch_optional(&pool)
                .await?;
                if used.is_none() {
                    return Ok(Outcome::Refused);
                }
                sqlx::query("UPDATE bench_baseline.counters SET used = used - 1 WHERE name = $1")
                    .bind(&*name)
                    .execute(&pool)
                    .await?;
                Ok(Outcome::Done)
            }
        },
    )
    .await?;
    pool.close().await;
    let cell = Cell::from_load(Workload::Semaphore, SEM_COUNTER, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}

// ---------------------------------------------------------------------------
// 2. Mutex lock + unlock
// ---------------------------------------------------------------------------

const MUTEX_OURS: &str = "ours (Mutex::lock + commit)";
const MUTEX_RAW: &str = "raw pg_advisory_xact_lock loop";
const MUTEX_SQLX: &str = "sqlx PgAdvisoryLock";

#[derive(Debug, Clone, Copy)]
enum Keys {
    Hot,
    Spread,
}

impl Keys {
    fn label(self) -> &'static str {
        match self {
            Keys::Hot => "hot",
            Keys::Spread => "spread",
        }
    }

    /// The key for a client's `seq`-th operation.
    fn key(self, salt: u64, client: usize, seq: u64) -> i64 {
        match self {
            Keys::Hot => HOT_KEY,
            Keys::Spread => {
                let r = splitmix64(salt ^ ((client as u64) << 40) ^ seq);
                SPREAD_BASE + (r % SPREAD_KEYS) as i64
            }
        }
    }
}

/// Lock + unlock at 1 and 8 clients, one hot key or keys spread over 100,000.
async fn mutex_workload(ctx: &mut Ctx) -> Res<()> {
    let mut all = Vec::new();
    let mut worst_raw: Option<(f64, String)> = None;
    let mut worst_sqlx: Option<(f64, String)> = None;
    let mut all_raw = true;
    let mut all_sqlx = true;
    for clients in [1usize, 8] {
        for keys in [Keys::Hot, Keys::Spread] {
            let config = json!({ "clients": clients, "keys": keys.label() });
            let mut group = Vec::new();
            for (i, implementation) in [MUTEX_OURS, MUTEX_RAW, MUTEX_SQLX].into_iter().enumerate() {
                let salt = splitmix64((clients as u64) << 8 | i as u64);
                group.push(
                    mutex_cell(ctx, implementation, clients, keys, salt, config.clone()).await?,
                );
            }
            throughput_ratios(&mut group, "vs_raw_loop", 1);
            throughput_ratios(&mut group, "vs_sqlx", 2);
            let label = format!("{clients} clients, {} key", keys.label());
            let raw = group[0].ratio("vs_raw_loop");
            let sqlx = group[0].ratio("vs_sqlx");
            all_raw &= raw.is_some_and(|r| r >= 0.9);
            all_sqlx &= sqlx.is_some_and(|r| r >= 1.0);
            let raw = raw.unwrap_or(0.0);
            let sqlx = sqlx.unwrap_or(0.0);
            if worst_raw.as_ref().is_none_or(|(w, _)| raw < *w) {
                worst_raw = Some((raw, label.clone()));
            }
            if worst_sqlx.as_ref().is_none_or(|(w, _)| sqlx < *w) {
                worst_sqlx = Some((sqlx, label));
            }
            all.extend(group);
        }
    }

    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.implementation.clone(),
                c.config["clients"].to_string(),
                c.config["keys"].as_str().unwrap_or("").to_owned(),
                fmt_rate(c.ops_per_sec().unwrap_or(0.0)),
                fmt_opt(c.p50()),
                fmt_opt(c.p99()),
                fmt_ratio(c.ratio("vs_raw_loop")),
                fmt_ratio(c.ratio("vs_sqlx")),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 2. Mutex: lock + unlock\n\n\
         hot = every operation on one key; spread = each operation a random key out of \
         {}. Ratios are locks/s divided by the baseline's in the same configuration.\n",
        fmt_int(SPREAD_KEYS)
    ));
    ctx.report.print(&markdown_table(
        &[
            "implementation",
            "clients",
            "keys",
            "locks/s",
            "p50 lock+unlock",
            "p99 lock+unlock",
            "÷ raw loop",
            "÷ sqlx",
            "errors",
        ],
        &rows,
    ));

    let (raw, raw_at) = worst_raw.unwrap_or((0.0, String::new()));
    let (sqlx, sqlx_at) = worst_sqlx.unwrap_or((0.0, String::new()));
    ctx.report.targets.push(Target {
        workload: Workload::Mutex.name(),
        target: "ours ≥ 0.9x the raw loop, at each of the 4 configurations".into(),
        measured: format!("worst {raw:.2}x ({raw_at})"),
        value: Some(raw),
        threshold: 0.9,
        pass: all_raw,
    });
    ctx.report.targets.push(Target {
        workload: Workload::Mutex.name(),
        target: "ours ≥ 1.0x sqlx PgAdvisoryLock, at each of the 4 configurations".into(),
        measured: format!("worst {sqlx:.2}x ({sqlx_at})"),
        value: Some(sqlx),
        threshold: 1.0,
        pass: all_sqlx,
    });
    ctx.report.add_cells(all);
    Ok(())
}

async fn mutex_cell(
    ctx: &Ctx,
    implementation: &'static str,
    clients: usize,
    keys: Keys,
    salt: u64,
    config: Value,
) -> Res<Cell> {
    let pool = pool(&ctx.opts, clients as u32 + POOL_SPARE).await?;
    let (warmup, window) = (ctx.settings.warmup, ctx.settings.cell);
    let op_pool = pool.clone();
    let load = match implementation {
        MUTEX_OURS => {
            run_load(clients, warmup, window, move |client, seq| {
                let pool = op_pool.clone();
                async move {
                    let key = keys.key(salt, client, seq);
                    let guard = Mutex::with_key(key).lock(&pool).await?;
                    guard.commit().await?;
                    Ok(Outcome::Done)
                }
            })
            .await?
        }
        MUTEX_RAW => {
            run_load(clients, warmup, window, move |client, seq| {
                let pool = op_pool.clone();
                async move {
                    let key = keys.key(salt, client, seq);
                    let mut tx = pool.begin().await?;
                    sqlx::query("SELECT pg_advisory_xact_lock($1)")
                        .bind(key)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(Outcome::Done)
                }
            })
            .await?
        }
        _ => {
            run_load(clients, warmup, window, move |client, seq| {
                let pool = op_pool.clone();
                async move {
                    let key = keys.key(salt, client, seq);
                    let lock = PgAdvisoryLock::with_key(PgAdvisoryLockKey::BigInt(key));
                    let guard = lock.acquire(pool.acquire().await?).await?;
                    let _conn = guard.release_now().await?;
                    Ok(Outcome::Done)
                }
            })
            .await?
        }
    };
    pool.close().await;
    let cell = Cell::from_load(Workload::Mutex, implementation, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}

// ---------------------------------------------------------------------------
// 3. Wake-up latency
// ---------------------------------------------------------------------------

const WAKE_OURS: &str = "ours: release → waiting acquire() returns (LISTEN/NOTIFY)";
const WAKE_SELECT_HELD: &str = "SELECT 1 round trip (held connection)";
const WAKE_SELECT_POOL: &str = "SELECT 1 through the pool (checkout + ping + query)";
const WAKE_SELECT_IDLE: &str = "SELECT 1 round trip after 30 ms idle (held connection)";
const WAKE_NOTIFY: &str =
    "raw pg_notify → sqlx PgListener receives it, after 30 ms idle (for profiling)";

/// A capacity-1 semaphore: time from the holder's release to the waiter's return.
async fn wakeup_workload(ctx: &mut Ctx) -> Res<()> {
    let s = ctx.settings.clone();

    // Baseline: SELECT 1 round trips.
    let pool_a = pool(&ctx.opts, 2).await?;
    let mut held = Vec::with_capacity(s.select_reps);
    let mut pooled = Vec::with_capacity(s.select_reps);
    {
        let mut conn = pool_a.acquire().await?;
        for i in 0..s.select_reps + s.wake_warmup {
            let t = Instant::now();
            let _: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut *conn).await?;
            if i >= s.wake_warmup {
                held.push(t.elapsed());
            }
        }
    }
    // The same round trip after the wake-up's idle pause (cold backend and client).
    let mut idle = Vec::with_capacity(s.wake_reps);
    {
        let mut conn = pool_a.acquire().await?;
        for i in 0..s.wake_reps + s.wake_warmup {
            tokio::time::sleep(WAKE_SETTLE).await;
            let t = Instant::now();
            let _: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut *conn).await?;
            if i >= s.wake_warmup {
                idle.push(t.elapsed());
            }
        }
    }
    for i in 0..s.select_reps + s.wake_warmup {
        let t = Instant::now();
        let _: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&pool_a).await?;
        if i >= s.wake_warmup {
            pooled.push(t.elapsed());
        }
    }
    pool_a.close().await;
    let select_held = Cell::from_samples(Workload::Wakeup, WAKE_SELECT_HELD, json!({}), held);
    let select_pool = Cell::from_samples(Workload::Wakeup, WAKE_SELECT_POOL, json!({}), pooled);
    let select_idle = Cell::from_samples(
        Workload::Wakeup,
        WAKE_SELECT_IDLE,
        json!({ "settle_ms": WAKE_SETTLE.as_millis() as u64 }),
        idle,
    );
    eprintln!("{}", select_held.progress());
    eprintln!("{}", select_pool.progress());
    eprintln!("{}", select_idle.progress());

    // Ours, woken by NOTIFY.
    let ours = wake_cell(ctx, WAKE_OURS.to_owned(), None, s.wake_warmup, s.wake_reps).await?;

    // The notification path disabled: transaction_pooling(true) polls every fallback interval.
    let mut polling = Vec::new();
    for fallback in [
        pg_semaphore::DEFAULT_FALLBACK_INTERVAL,
        Duration::from_millis(100),
    ] {
        let label = format!(
            "transaction_pooling(true), no LISTEN, fallback {}",
            fmt_dur(fallback)
        );
        polling.push(wake_cell(ctx, label, Some(fallback), 0, s.fallback_reps).await?);
    }

    let notify = notify_cell(ctx).await?;

    let base = select_held.p50();
    let mut cells = vec![select_held, select_pool, ours];
    cells.extend(polling);
    cells.push(select_idle);
    cells.push(notify);
    for cell in &mut cells {
        let ratio = match (cell.p50(), base) {
            (Some(p50), Some(base)) if !base.is_zero() => {
                Some(p50.as_secs_f64() / base.as_secs_f64())
            }
            _ => None,
        };
        cell.ratios.push(("p50_vs_select1_p50".into(), ratio));
    }
    // The like-for-like baseline: a wake-up happens on a path that has been
    // idle (the waiter, the holder's next statement, the listener), and on this
    // kind of machine an idle round trip costs several hot ones; so the target
    // compares with a SELECT 1 after the same idle pause. Both are printed.
    let idle_base = cells
        .iter()
        .find(|c| c.implementation == WAKE_SELECT_IDLE)
        .and_then(Cell::p50);
    for cell in &mut cells {
        let ratio = match (cell.p50(), idle_base) {
            (Some(p50), Some(base)) if !base.is_zero() => {
                Some(p50.as_secs_f64() / base.as_secs_f64())
            }
            _ => None,
        };
        cell.ratios.push(("p50_vs_idle_select1_p50".into(), ratio));
    }

    let rows: Vec<Vec<String>> = cells
        .iter()
        .map(|c| {
            vec![
                c.implementation.clone(),
                fmt_int(c.ops),
                fmt_opt(c.p50()),
                fmt_opt(c.p99()),
                fmt_opt(c.samples.last().copied()),
                fmt_ratio(c.ratio("p50_vs_select1_p50")),
                fmt_ratio(c.ratio("p50_vs_idle_select1_p50")),
                c.extra
                    .get("release_p50_us")
                    .and_then(Value::as_f64)
                    .map_or_else(
                        || "–".into(),
                        |us| fmt_dur(Duration::from_secs_f64(us / 1e6)),
                    ),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 3. Wake-up latency\n\n\
         Capacity-1 semaphore; a holder (own pool) holds the permit, a waiter (another pool) \
         calls acquire(); {} ms later the holder takes t0 and releases. Latency = when \
         acquire() returns − t0 (includes the release round trip). Polling rows: both handles \
         built with transaction_pooling(true), fresh pools. \"of which release() p50\": t0 until the \
         holder's release() returned. \"idle SELECT 1\": the same round trip after the wake-up's idle pause, \
         the like-for-like baseline the target uses (a wake-up runs on paths that have been idle). The raw \
         NOTIFY row is for profiling only.\n",
        WAKE_SETTLE.as_millis()
    ));
    ctx.report.print(&markdown_table(
        &[
            "measurement",
            "reps",
            "p50",
            "p99",
            "max",
            "p50 ÷ SELECT 1 p50",
            "p50 ÷ idle SELECT 1 p50",
            "of which release() p50",
        ],
        &rows,
    ));

    let ours = &cells[2];
    let ratio = ours.ratio("p50_vs_idle_select1_p50");
    ctx.report.targets.push(Target::at_most(
        Workload::Wakeup,
        "ours p50 ≤ 5x SELECT 1 p50 (after the same idle pause)",
        ratio,
        5.0,
        format!(
            "{} ({} vs {}; vs a hot SELECT 1 ({}): {})",
            fmt_ratio(ratio),
            fmt_opt(ours.p50()),
            fmt_opt(idle_base),
            fmt_opt(cells[0].p50()),
            fmt_ratio(ours.ratio("p50_vs_select1_p50")),
        ),
    ));
    // No polling floor: wake-ups must come well before the shortest poll tested.
    let shortest = Duration::from_millis(100);
    let p99 = ours.p99().map(|d| d.as_secs_f64() * 1e3);
    ctx.report.targets.push(Target::at_most(
        Workload::Wakeup,
        format!(
            "no polling floor: ours p99 < {} (shortest fallback tested; default {})",
            fmt_dur(shortest),
            fmt_dur(pg_semaphore::DEFAULT_FALLBACK_INTERVAL)
        ),
        p99,
        shortest.as_secs_f64() * 1e3,
        format!(
            "p50 {}, p99 {} (polling at {}: p50 {})",
            fmt_opt(ours.p50()),
            fmt_opt(ours.p99()),
            fmt_dur(pg_semaphore::DEFAULT_FALLBACK_INTERVAL),
            fmt_opt(cells[3].p50())
        ),
    ));
    ctx.report.add_cells(cells);
    Ok(())
}

/// `reps` timed wake-ups (after `warmup` untimed ones); `fallback` = polling mode.
async fn wake_cell(
    ctx: &Ctx,
    label: String,
    fallback: Option<Duration>,
    warmup: usize,
    reps: usize,
) -> Res<Cell> {
    let name = format!("bench-wake-{}", fallback.map_or(0, |f| f.as_millis()));
    let build = |pool: PgPool| {
        let name = name.clone();
        async move {
            let mut builder = Semaphore::builder(name, 1);
            if let Some(fallback) = fallback {
                builder = builder
                    .transaction_pooling(true)
                    .fallback_interval(fallback);
            }
            builder.build(&pool).await
        }
    };
    let holder_pool = pool(&ctx.opts, 2).await?;
    let waiter_pool = pool(&ctx.opts, 2).await?;
    let holder = build(holder_pool.clone()).await?;
    let waiter = build(waiter_pool.clone()).await?;
    let patience = fallback.unwrap_or(Duration::ZERO) * 3 + Duration::from_secs(10);
    let mut samples = Vec::with_capacity(reps);
    let mut releases = Vec::with_capacity(reps);
    for i in 0..warmup + reps {
        let permit = holder.try_acquire().await?;
        let waiter = waiter.clone();
        let task = tokio::spawn(async move {
            let permit = waiter.acquire().await?;
            let woke = Instant::now();
            permit.release().await?;
            Ok::<_, Error>(woke)
        });
        tokio::time::sleep(WAKE_SETTLE).await;
        let t0 = Instant::now();
        permit.release().await?;
        let released = t0.elapsed();
        let woke = tokio::time::timeout(patience, task)
            .await
            .map_err(|_| format!("the waiter was not woken within {patience:?}"))???;
        let latency = woke
            .checked_duration_since(t0)
            .ok_or("the waiter acquired before the holder released")?;
        if i >= warmup {
            samples.push(latency);
            releases.push(released);
        }
    }
    drop((holder, waiter));
    holder_pool.close().await;
    waiter_pool.close().await;
    let config = json!({ "fallback_ms": fallback.map(|f| f.as_millis() as u64), "settle_ms": WAKE_SETTLE.as_millis() as u64 });
    let mut cell = Cell::from_samples(Workload::Wakeup, label, config, samples);
    releases.sort_unstable();
    let release_p50 = percentile(&releases, 50.0);
    let release_p99 = percentile(&releases, 99.0);
    cell.extra
        .insert("release_p50_us".into(), json!(release_p50.map(micros)));
    cell.extra
        .insert("release_p99_us".into(), json!(release_p99.map(micros)));
    eprintln!("{}", cell.progress());
    Ok(cell)
}

/// For profiling, not a target: `SELECT pg_notify(..)` on one connection until
/// a sqlx `PgListener` on another receives it.
async fn notify_cell(ctx: &Ctx) -> Res<Cell> {
    let s = &ctx.settings;
    let pool = pool(&ctx.opts, 2).await?;
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
    listener.listen("bench_wake").await?;
    let mut conn = pool.acquire().await?;
    let mut samples = Vec::with_capacity(s.wake_reps);
    for i in 0..s.wake_warmup + s.wake_reps {
        tokio::time::sleep(WAKE_SETTLE).await;
        let t0 = Instant::now();
        sqlx::query("SELECT pg_notify('bench_wake', '')")
            .execute(&mut *conn)
            .await?;
        tokio::time::timeout(Duration::from_secs(10), listener.recv())
            .await
            .map_err(|_| "a NOTIFY was not delivered within 10 s")??;
        if i >= s.wake_warmup {
            samples.push(t0.elapsed());
        }
    }
    drop(conn);
    drop(listener);
    pool.close().await;
    let cell = Cell::from_samples(Workload::Wakeup, WAKE_NOTIFY, json!({}), samples);
    eprintln!("{}", cell.progress());
    Ok(cell)
}

// ---------------------------------------------------------------------------
// 4. Many waiters
// ---------------------------------------------------------------------------

/// Client backends on the bench database, other than the measuring one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Activity {
    total: i64,
    active: i64,
    idle: i64,
    idle_in_transaction: i64,
    listening: i64,
}

async fn activity(conn: &mut PgConnection) -> Res<Activity> {
    let (total, active, idle, idle_in_transaction, listening): (i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT count(*), \
                    count(*) FILTER (WHERE state = 'active'), \
                    count(*) FILTER (WHERE state = 'idle'), \
                    count(*) FILTER (WHERE state LIKE 'idle in transaction%'), \
                    count(*) FILTER (WHERE query ILIKE 'LISTEN%') \
             FROM pg_stat_activity \
             WHERE datname = current_database() AND backend_type = 'client backend' \
               AND pid <> pg_backend_pid()",
        )
        .fetch_one(conn)
        .await?;
    Ok(Activity {
        total,
        active,
        idle,
        idle_in_transaction,
        listening,
    })
}

/// N tasks wait on one held permit: connections, memory, then the drain.
async fn waiters_workload(ctx: &mut Ctx) -> Res<()> {
    let n = ctx.settings.waiters;
    let mut monitor = connect(&ctx.opts).await?;
    let before = activity(&mut monitor).await?;
    let pool = pool(&ctx.opts, WAITERS_POOL).await?;
    let sem = Semaphore::builder("bench-waiters", 1).build(&pool).await?;
    let held = sem.try_acquire().await?;
    let rss_before = rss_bytes();

    let arrivals = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(AtomicUsize::new(0));
    let spawned = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (sem, arrivals, served) = (sem.clone(), arrivals.clone(), served.clone());
            tokio::spawn(async move {
                let arrival = arrivals.fetch_add(1, Ordering::SeqCst);
                match sem.acquire_timeout(WAITERS_PATIENCE).await {
                    Ok(permit) => {
                        let at = Instant::now();
                        let order = served.fetch_add(1, Ordering::SeqCst);
                        permit.release().await?;
                        Ok(Some((order, arrival, at)))
                    }
                    Err(Error::Timeout { .. }) => Ok(None),
                    Err(error) => Err(error),
                }
            })
        })
        .collect();

    // Wait until every task has called acquire and the database has been quiet for 1 s.
    let mut quiet_polls = 0;
    let mut last = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    let (waiting, settled) = loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = activity(&mut monitor).await?;
        let quiet = arrivals.load(Ordering::SeqCst) == n
            && now.active == 0
            && pool.num_idle() == pool.size() as usize
            && last == Some(now);
        last = Some(now);
        quiet_polls = if quiet { quiet_polls + 1 } else { 0 };
        if quiet_polls >= 10 {
            break (now, true);
        }
        if Instant::now() >= deadline {
            break (now, false);
        }
    };
    let settle_time = spawned.elapsed();
    let rss_waiting = rss_bytes();
    let (pool_size, pool_idle) = (pool.size() as i64, pool.num_idle() as i64);
    let pool_in_use = pool_size - pool_idle;
    let outside_pool = (waiting.total - before.total - pool_size).max(0);
    let used = pool_in_use + outside_pool;

    // Release, and let every waiter pass through.
    let released = Instant::now();
    held.release().await?;
    let mut results = Vec::with_capacity(n);
    let mut timeouts = 0u64;
    let mut errors = 0u64;
    for task in tasks {
        match task.await? {
            Ok(Some(result)) => results.push(result),
            Ok(None) => timeouts += 1,
            Err(error) => {
                errors += 1;
                eprintln!("  waiter failed: {error}");
            }
        }
    }
    let drained = results
        .iter()
        .map(|(_, _, at)| *at)
        .max()
        .map_or(Duration::ZERO, |at| at.saturating_duration_since(released));
    results.sort_by_key(|(order, _, _)| *order);
    let in_order = results.windows(2).filter(|w| w[0].1 < w[1].1).count();
    let pairs = results.len().saturating_sub(1);
    let in_order_fraction = (pairs > 0).then(|| in_order as f64 / pairs as f64);
    let mut previous = released;
    let handoffs: Vec<Duration> = results
        .iter()
        .map(|(_, _, at)| {
            let gap = at.saturating_duration_since(previous);
            previous = *at;
            gap
        })
        .collect();
    drop(sem);
    pool.close().await;

    let mut cell = Cell::from_samples(
        Workload::Waiters,
        "ours: hand-off from one waiter's release to the next grant",
        json!({ "waiters": n, "pool_max_connections": WAITERS_POOL }),
        handoffs,
    );
    cell.refused = timeouts;
    cell.errors = errors;
    cell.elapsed = Some(drained);
    let rss_delta = match (rss_before, rss_waiting) {
        (Some(a), Some(b)) => Some(b as i64 - a as i64),
        _ => None,
    };
    let extra = json!({
        "settled": settled,
        "settle_s": round(settle_time.as_secs_f64(), 3),
        "db_backends_before": before.total,
        "db_backends_waiting": waiting.total,
        "db_backends_waiting_active": waiting.active,
        "db_backends_waiting_idle": waiting.idle,
        "db_backends_waiting_idle_in_transaction": waiting.idle_in_transaction,
        "db_backends_listening": waiting.listening,
        "pool_size": pool_size,
        "pool_idle": pool_idle,
        "pool_in_use": pool_in_use,
        "connections_outside_pool": outside_pool,
        "connections_used_while_waiting": used,
        "rss_before_bytes": rss_before,
        "rss_waiting_bytes": rss_waiting,
        "rss_delta_bytes": rss_delta,
        "served": results.len(),
        "timeouts": timeouts,
        "in_order_fraction": in_order_fraction.map(|f| round(f, 4)),
        "drain_s": round(drained.as_secs_f64(), 3),
    });
    if let Value::Object(extra) = extra {
        cell.extra = extra;
    }
    eprintln!("{}", cell.progress());

    let rss = |b: Option<u64>| b.map_or_else(|| "unknown".into(), |b| fmt_bytes(b as f64));
    let mut rows = vec![
        vec![
            "tasks waiting".into(),
            format!(
                "{} (settled after {:.1} s{})",
                fmt_int(n as u64),
                settle_time.as_secs_f64(),
                if settled {
                    ""
                } else {
                    "; NOT settled within 60 s"
                }
            ),
        ],
        vec![
            format!("pool (max {WAITERS_POOL}): size / idle / in use"),
            format!("{pool_size} / {pool_idle} / {pool_in_use}"),
        ],
        vec![
            "backends on the bench DB while waiting (excl. the measuring one)".into(),
            format!(
                "{} total: {} idle, {} active, {} idle in transaction; {} last ran LISTEN; {} before the workload",
                waiting.total,
                waiting.idle,
                waiting.active,
                waiting.idle_in_transaction,
                waiting.listening,
                before.total
            ),
        ],
        vec![
            "connections used while waiting (pool in use + outside the pool)".into(),
            format!("{used} ({pool_in_use} + {outside_pool})"),
        ],
        vec![
            "RSS before / while waiting".into(),
            format!(
                "{} / {} ({})",
                rss(rss_before),
                rss(rss_waiting),
                rss_delta.map_or_else(
                    || "unknown".into(),
                    |d| format!(
                        "{:+.1} MiB, {:.1} KiB per waiter",
                        d as f64 / 1048576.0,
                        d as f64 / 1024.0 / n as f64
                    )
                )
            ),
        ],
        vec![
            "drain: all served after the release".into(),
            format!(
                "{} served, {} timed out, in {} ({}/s)",
                fmt_int(results.len() as u64),
                timeouts,
                fmt_dur(drained),
                fmt_rate(cell.ops_per_sec().unwrap_or(0.0))
            ),
        ],
        vec![
            "hand-off (grant to next grant) p50 / p99 / max".into(),
            format!(
                "{} / {} / {}",
                fmt_opt(cell.p50()),
                fmt_opt(cell.p99()),
                fmt_opt(cell.samples.last().copied())
            ),
        ],
        vec![
            "adjacent pairs served in arrival order".into(),
            in_order_fraction.map_or_else(
                || "–".into(),
                |f| format!("{:.1}% ({in_order} of {pairs})", f * 100.0),
            ),
        ],
    ];
    if errors > 0 {
        rows.push(vec!["errors".into(), errors.to_string()]);
    }
    ctx.report.print(&format!(
        "## 4. Many waiters\n\n\
         {} tasks call acquire_timeout({} s) on one capacity-1 semaphore whose permit is held \
         (pool of {WAITERS_POOL}). Arrival = the order the tasks called acquire_timeout; \
         served = the order acquire returned.\n",
        fmt_int(n as u64),
        WAITERS_PATIENCE.as_secs()
    ));
    ctx.report
        .print(&markdown_table(&["measure", "value"], &rows));
    ctx.report.targets.push(Target::at_most(
        Workload::Waiters,
        format!(
            "connections used while {} wait ≤ 2 (pool holds none)",
            fmt_int(n as u64)
        ),
        Some(used as f64),
        2.0,
        format!("{used} (pool in use {pool_in_use}, outside the pool {outside_pool})"),
    ));
    ctx.report.add_cells(vec![cell]);
    Ok(())
}

// ---------------------------------------------------------------------------
// 5. Growth of the slot table
// ---------------------------------------------------------------------------

/// A million cycles without and with a retention reaper; the slot table's size.
async fn growth_workload(ctx: &mut Ctx) -> Res<()> {
    let plain = growth_run(ctx, false).await?;
    let retention = growth_run(ctx, true).await?;
    let mut cells = vec![plain, retention];
    throughput_ratios(&mut cells, "vs_no_retention", 0);
    let checkpoint = ctx.settings.growth_checkpoint();

    let size = |c: &Cell, key: &str| c.extra.get(key).and_then(Value::as_f64);
    let rows: Vec<Vec<String>> = cells
        .iter()
        .map(|c| {
            let first = size(c, "size_first_checkpoint_bytes");
            let end = size(c, "size_end_bytes");
            vec![
                c.implementation.clone(),
                fmt_int(c.ops),
                c.elapsed
                    .map_or_else(|| "–".into(), |e| format!("{:.1} s", e.as_secs_f64())),
                fmt_rate(c.ops_per_sec().unwrap_or(0.0)),
                fmt_int(c.refused),
                fmt_opt(c.p50()),
                fmt_opt(c.p99()),
                first.map_or_else(|| "–".into(), fmt_bytes),
                end.map_or_else(|| "–".into(), fmt_bytes),
                fmt_ratio(end.zip(first).map(|(e, f)| e / f)),
                c.extra
                    .get("rows_end")
                    .and_then(Value::as_u64)
                    .map_or_else(|| "–".into(), fmt_int),
                fmt_ratio(c.ratio("vs_no_retention")),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 5. Growth of pgsemaphore.slots\n\n\
         {} try_acquire+release cycles, {GROWTH_CLIENTS} clients, capacity {GROWTH_CAPACITY}, \
         each run in a fresh database. Size = pg_total_relation_size('pgsemaphore.slots') \
         (table + indexes + TOAST). Retention run: Reaper::builder().interval({}).retention({}).\n",
        fmt_int(ctx.settings.growth_cycles),
        fmt_dur(REAPER_INTERVAL),
        fmt_dur(REAPER_RETENTION)
    ));
    ctx.report.print(&markdown_table(
        &[
            "run",
            "cycles",
            "time",
            "cycles/s",
            "refused",
            "p50 cycle",
            "p99 cycle",
            &format!("size @ {}", fmt_int(checkpoint)),
            "size @ end",
            "end ÷ first",
            "rows @ end",
            "cycles/s ÷ no retention",
        ],
        &rows,
    ));
    let mut progress_rows = Vec::new();
    for cell in &cells {
        if let Some(Value::Array(points)) = cell.extra.get("checkpoints") {
            for point in points {
                progress_rows.push(vec![
                    cell.implementation.clone(),
                    point["cycles"].as_u64().map_or_else(|| "–".into(), fmt_int),
                    point["elapsed_s"]
                        .as_f64()
                        .map_or_else(|| "–".into(), |e| format!("{e:.1} s")),
                    point["bytes"]
                        .as_f64()
                        .map_or_else(|| "–".into(), fmt_bytes),
                    point["live_tuples"]
                        .as_u64()
                        .map_or_else(|| "–".into(), fmt_int),
                    point["dead_tuples"]
                        .as_u64()
                        .map_or_else(|| "–".into(), fmt_int),
                    point["autovacuum_count"]
                        .as_u64()
                        .map_or_else(|| "–".into(), fmt_int),
                ]);
            }
        }
    }
    ctx.report.print(
        "Size at each checkpoint (tuple counts and autovacuum runs from pg_stat_user_tables, \
         which lags by up to about a second; the server's autovacuum_naptime is in the header):\n",
    );
    ctx.report.print(&markdown_table(
        &[
            "run",
            "cycles",
            "elapsed",
            "size",
            "~live tuples",
            "~dead tuples",
            "autovacuums",
        ],
        &progress_rows,
    ));

    let with = &cells[1];
    let first = size(with, "size_first_checkpoint_bytes");
    let end = size(with, "size_end_bytes");
    let ratio = end.zip(first).map(|(e, f)| e / f);
    ctx.report.targets.push(Target::at_most(
        Workload::Growth,
        format!(
            "with retention: size after {} ≤ 2x size after {}",
            fmt_int(ctx.settings.growth_cycles),
            fmt_int(checkpoint)
        ),
        ratio,
        2.0,
        format!(
            "{} ({} → {}; without retention {} → {})",
            fmt_ratio(ratio),
            first.map_or_else(|| "–".into(), fmt_bytes),
            end.map_or_else(|| "–".into(), fmt_bytes),
            size(&cells[0], "size_first_checkpoint_bytes").map_or_else(|| "–".into(), fmt_bytes),
            size(&cells[0], "size_end_bytes").map_or_else(|| "–".into(), fmt_bytes),
        ),
    ));
    ctx.report.add_cells(cells);
    Ok(())
}

/// The statistics collector's view of `pgsemaphore.slots`: live and dead
/// tuples (estimates, flushed about once a second) and autovacuum runs.
async fn slots_stats(conn: &mut PgConnection) -> Res<(i64, i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT coalesce(n_live_tup, 0), coalesce(n_dead_tup, 0), coalesce(autovacuum_count, 0) \
         FROM pg_stat_user_tables WHERE relid = 'pgsemaphore.slots'::regclass",
    )
    .fetch_one(conn)
    .await?)
}

async fn slots_size(conn: &mut PgConnection) -> Res<i64> {
    Ok(
        sqlx::query_scalar("SELECT pg_total_relation_size('pgsemaphore.slots')")
            .fetch_one(conn)
            .await?,
    )
}

async fn growth_run(ctx: &mut Ctx, retention: bool) -> Res<Cell> {
    let label = if retention {
        "with retention"
    } else {
        "no retention"
    };
    // Each run gets a fresh database: the slot table holds only this run's claims.
    let db = format!(
        "pgsem_bench_{}_growth_{}",
        ctx.pid,
        if retention { "retention" } else { "plain" }
    );
    ctx.extra_dbs.push(db.clone());
    create_database(&ctx.server, &db).await?;
    let opts = ctx.server.clone().database(&db);
    let pool = pool(&opts, GROWTH_CLIENTS as u32 + POOL_SPARE).await?;
    pg_semaphore::migrate(&pool).await?;
    let sem = Semaphore::builder("bench-growth", GROWTH_CAPACITY)
        .build(&pool)
        .await?;
    let mut monitor = connect(&opts).await?;
    let reaper = if retention {
        Some(
            Reaper::builder()
                .interval(REAPER_INTERVAL)
                .retention(REAPER_RETENTION)
                .spawn(&pool)?,
        )
    } else {
        None
    };

    let total = ctx.settings.growth_cycles;
    let checkpoint = ctx.settings.growth_checkpoint();
    let done = Arc::new(AtomicU64::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Instant)>();
    let started = Instant::now();
    let clients: Vec<_> = (0..GROWTH_CLIENTS)
        .map(|_| {
            let (sem, done, tx) = (sem.clone(), done.clone(), tx.clone());
            tokio::spawn(async move {
                let mut samples = Vec::with_capacity((total / GROWTH_CLIENTS as u64) as usize + 16);
                let mut refused = 0u64;
                while done.load(Ordering::Relaxed) < total {
                    let began = Instant::now();
                    match sem.try_acquire().await {
                        Ok(permit) => {
                            permit.release().await?;
                            let ended = Instant::now();
                            samples.push(ended - began);
                            let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                            if n.is_multiple_of(checkpoint) && n <= total {
                                let _ = tx.send((n, ended));
                            }
                        }
                        Err(Error::NoSlotsAvailable { .. }) => refused += 1,
                        Err(error) => return Err(error),
                    }
                }
                Ok((samples, refused))
            })
        })
        .collect();
    drop(tx);

    let mut checkpoints = Vec::new();
    while let Some((n, at)) = rx.recv().await {
        let bytes = slots_size(&mut monitor).await?;
        let (live, dead, autovacuums) = slots_stats(&mut monitor).await?;
        let elapsed = at.saturating_duration_since(started);
        let rate = n as f64 / elapsed.as_secs_f64().max(1e-9);
        let estimate = if n == checkpoint {
            format!(
                "; {} cycles will take about {:.0} s",
                fmt_int(total),
                total as f64 / rate
            )
        } else {
            String::new()
        };
        eprintln!(
            "  growth {label}: {} cycles in {:.1} s ({}/s), pgsemaphore.slots {} \
             (~{} live, ~{} dead tuples, {autovacuums} autovacuums){estimate}",
            fmt_int(n),
            elapsed.as_secs_f64(),
            fmt_rate(rate),
            fmt_bytes(bytes as f64),
            fmt_int(live.max(0) as u64),
            fmt_int(dead.max(0) as u64),
        );
        checkpoints.push(json!({
            "cycles": n,
            "elapsed_s": round(elapsed.as_secs_f64(), 2),
            "bytes": bytes,
            "live_tuples": live,
            "dead_tuples": dead,
            "autovacuum_count": autovacuums,
        }));
    }
    let mut samples = Vec::with_capacity(total as usize + 16);
    let mut refused = 0;
    for client in clients {
        let (s, r) = client.await??;
        samples.extend(s);
        refused += r;
    }
    let elapsed = started.elapsed();
    let size_end = slots_size(&mut monitor).await?;
    let rows_end: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.slots")
        .fetch_one(&mut monitor)
        .await?;
    let (_, dead, autovacuums) = slots_stats(&mut monitor).await?;
    if let Some(reaper) = reaper {
        reaper.shutdown().await;
    }
    drop(sem);
    pool.close().await;
    monitor.close().await?;
    drop_database(&ctx.server, &db).await?;
    ctx.extra_dbs.retain(|d| d != &db);

    let mut cell = Cell::new(
        Workload::Growth,
        label,
        json!({
            "clients": GROWTH_CLIENTS,
            "capacity": GROWTH_CAPACITY,
            "cycles": total,
            "retention_s": retention.then_some(REAPER_RETENTION.as_secs_f64()),
            "reaper_interval_s": retention.then_some(REAPER_INTERVAL.as_secs_f64()),
        }),
    );
    samples.sort_unstable();
    cell.ops = samples.len() as u64;
    cell.samples = samples;
    cell.refused = refused;
    cell.elapsed = Some(elapsed);
    let first = checkpoints.first().map(|c| c["bytes"].clone());
    let extra = json!({
        "size_first_checkpoint_bytes": first,
        "first_checkpoint_cycles": checkpoint,
        "size_end_bytes": size_end,
        "rows_end": rows_end,
        "dead_tuples_end": dead,
        "autovacuum_count": autovacuums,
        "checkpoints": checkpoints,
    });
    if let Value::Object(extra) = extra {
        cell.extra = extra;
    }
    eprintln!("{}", cell.progress());
    Ok(cell)
}

// ---------------------------------------------------------------------------
// 6. Rate limiter decisions
// ---------------------------------------------------------------------------

const RATE_UPDATE: &str = "bare UPDATE counter row (baseline)";
const RATE_BUCKET: &str = "ours: TokenBucket";
const RATE_FIXED: &str = "ours: FixedWindow";
const RATE_SLIDING: &str = "ours: SlidingWindow";
const RATE_LIMITERS: [&str; 3] = [RATE_BUCKET, RATE_FIXED, RATE_SLIDING];

/// What a rate cell calls: the baseline statement or one of our limiters.
#[derive(Debug)]
enum RateOp {
    Update(PgPool),
    Bucket(TokenBucket),
    Fixed(FixedWindow),
    Sliding(SlidingWindow),
}

impl RateOp {
    /// One decision; `true` when admitted (the baseline always counts).
    async fn decide(&self, key: &str) -> Res<bool> {
        Ok(match self {
            RateOp::Update(pool) => {
                sqlx::query("UPDATE bench_baseline.rate_counters SET n = n + 1 WHERE key = $1")
                    .bind(key)
                    .execute(pool)
                    .await?;
                true
            }
            RateOp::Bucket(limiter) => limiter.check(key, 1).await?.allowed,
            RateOp::Fixed(limiter) => limiter.check(key, 1).await?.allowed,
            RateOp::Sliding(limiter) => limiter.check(key, 1).await?.allowed,
        })
    }
}

/// The key of a client's `seq`-th decision: one hot key, or one of
/// `RATE_KEYS` users at random.
fn rate_key(keys: Keys, salt: u64, client: usize, seq: u64) -> String {
    match keys {
        Keys::Hot => "hot".to_owned(),
        Keys::Spread => {
            let r = splitmix64(salt ^ ((client as u64) << 40) ^ seq);
            format!("user-{}", r % RATE_KEYS)
        }
    }
}

/// Decisions at 1 and 8 clients, on one hot key or spread over 1,000 keys,
/// each limiter against a bare `UPDATE ... SET n = n + 1 WHERE key = $1`.
async fn rate_workload(ctx: &mut Ctx) -> Res<()> {
    {
        let pool = pool(&ctx.opts, 2).await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {BASELINE_SCHEMA}.rate_counters (
                 key text PRIMARY KEY,
                 n   bigint NOT NULL DEFAULT 0
             );
             INSERT INTO {BASELINE_SCHEMA}.rate_counters (key)
             SELECT 'user-' || i FROM generate_series(0, {}) AS i
             UNION ALL SELECT 'hot';",
            RATE_KEYS - 1
        )))
        .execute(&pool)
        .await?;
        pool.close().await;
    }
    let mut all = Vec::new();
    // Per limiter: the worst ratio to the baseline and where.
    let mut worst: Vec<Option<(f64, String)>> = vec![None; RATE_LIMITERS.len()];
    for clients in [1usize, 8] {
        for keys in [Keys::Hot, Keys::Spread] {
            let config = json!({ "clients": clients, "keys": keys.label() });
            let mut group = Vec::new();
            for (i, implementation) in std::iter::once(RATE_UPDATE)
                .chain(RATE_LIMITERS)
                .enumerate()
            {
                let salt = splitmix64((clients as u64) << 8 | i as u64);
                group.push(
                    rate_cell(ctx, implementation, clients, keys, salt, config.clone()).await?,
                );
            }
            throughput_ratios(&mut group, "vs_update", 0);
            let label = format!("{clients} clients, {} key", keys.label());
            for (slot, cell) in worst.iter_mut().zip(&group[1..]) {
                let ratio = cell.ratio("vs_update").unwrap_or(0.0);
                if slot.as_ref().is_none_or(|(w, _)| ratio < *w) {
                    *slot = Some((ratio, label.clone()));
                }
            }
            all.extend(group);
        }
    }

    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            let admitted = c.extra.get("admitted").and_then(Value::as_u64).unwrap_or(0);
            let admitted_rate = c
                .elapsed
                .filter(|e| !e.is_zero())
                .map_or(0.0, |e| admitted as f64 / e.as_secs_f64());
            vec![
                c.implementation.clone(),
                c.config["clients"].to_string(),
                c.config["keys"].as_str().unwrap_or("").to_owned(),
                fmt_rate(c.ops_per_sec().unwrap_or(0.0)),
                fmt_rate(admitted_rate),
                fmt_opt(c.p50()),
                fmt_opt(c.p99()),
                fmt_ratio(c.ratio("vs_update")),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 6. Rate limiters: decisions\n\n\
         Each client loops: one check of one permit (a decision, admitted or refused; \
         both update the key's row). hot = every decision on one key; spread = each on a \
         random key out of {} (created on first use, mostly during the warm-up). Each \
         limiter allows {} per second per key (token bucket: rate and burst {}; windows: \
         {} per 1 s). The baseline is one prepared `UPDATE ... SET n = n + 1 WHERE key = $1` \
         on a table of the same keys: the least a database counter can do. admitted/s \
         shows the limits holding on the hot key: about {} per second, plus what the \
         bucket or window had left when the measurement began. Ratios are decisions/s \
         divided by the baseline's in the same configuration.\n",
        fmt_int(RATE_KEYS),
        fmt_int(u64::from(RATE_LIMIT)),
        fmt_int(u64::from(RATE_LIMIT)),
        fmt_int(u64::from(RATE_LIMIT)),
        fmt_int(u64::from(RATE_LIMIT)),
    ));
    ctx.report.print(&markdown_table(
        &[
            "implementation",
            "clients",
            "keys",
            "decisions/s",
            "admitted/s",
            "p50 decision",
            "p99 decision",
            "÷ UPDATE",
            "errors",
        ],
        &rows,
    ));

    for (implementation, worst) in RATE_LIMITERS.into_iter().zip(worst) {
        let (ratio, at) = worst.unwrap_or((0.0, String::new()));
        ctx.report.targets.push(Target::at_least(
            Workload::Rate,
            format!("{implementation} ≥ 0.5x the bare UPDATE, at each of the 4 configurations"),
            Some(ratio),
            0.5,
            format!("worst {ratio:.2}x ({at})"),
        ));
    }
    ctx.report.add_cells(all);
    Ok(())
}

async fn rate_cell(
    ctx: &Ctx,
    implementation: &'static str,
    clients: usize,
    keys: Keys,
    salt: u64,
    config: Value,
) -> Res<Cell> {
    let pool = pool(&ctx.opts, clients as u32 + POOL_SPARE).await?;
    // A limiter name per cell: no cell starts with another's state.
    let name = format!("bench-rate-c{clients}-{}", keys.label());
    let window = Duration::from_secs(1);
    let op = Arc::new(match implementation {
        RATE_UPDATE => RateOp::Update(pool.clone()),
        RATE_BUCKET => RateOp::Bucket(
            TokenBucket::builder(name)
                .rate(f64::from(RATE_LIMIT))
                .burst(RATE_LIMIT)
                .build(&pool)?,
        ),
        RATE_FIXED => RateOp::Fixed(
            FixedWindow::builder(name)
                .permit_limit(RATE_LIMIT)
                .window(window)
                .build(&pool)?,
        ),
        _ => RateOp::Sliding(
            SlidingWindow::builder(name)
                .permit_limit(RATE_LIMIT)
                .window(window)
                .build(&pool)?,
        ),
    });
    let admitted = Arc::new(AtomicU64::new(0));
    // run_load starts measuring a warm-up from now; count admissions from then on.
    let from = Instant::now() + ctx.settings.warmup;
    let counter = admitted.clone();
    let load = run_load(
        clients,
        ctx.settings.warmup,
        ctx.settings.cell,
        move |client, seq| {
            let op = op.clone();
            let counter = counter.clone();
            async move {
                let measured = Instant::now() >= from;
                let key = rate_key(keys, salt, client, seq);
                if op.decide(&key).await? && measured {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Outcome::Done)
            }
        },
    )
    .await?;
    pool.close().await;
    let mut cell = Cell::from_load(Workload::Rate, implementation, config, load);
    cell.extra
        .insert("admitted".into(), admitted.load(Ordering::Relaxed).into());
    eprintln!("{}", cell.progress());
    Ok(cell)
}
