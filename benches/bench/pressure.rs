//! Workload 12, MVCC pressure: every design's throughput, interval by
//! interval, while something holds back the xmin horizon that VACUUM needs,
//! against the same design's undisturbed rate measured just before.
//!
//! The pressures (`--pressure NAME`, all four by default):
//!
//! - `query`: a query in the bench's own database runs for the whole window
//!   (`SELECT pg_sleep(...)`), as a long report or analytics query would;
//! - `idle-xact`: a session in the bench's database opened a transaction,
//!   took an xid and went idle (a bug's `idle in transaction`);
//! - `other-db`: the same long query, in another database of the same server
//!   (the lease semaphore in a database of its own, the application's
//!   database busy);
//! - `pg-dump`: a real `pg_dump` of the bench database, grown by a filler
//!   table of about 300 MB, read at 25 MB/s (a backup over a modest link),
//!   restarted as soon as it ends for the whole window.
//!
//! Each design runs alone, with 4 clients: `--minutes` (10 by default, 1 with
//! `--quick`) under the pressure in 30 s intervals (10 s with `--quick`),
//! after three undisturbed intervals (one with `--quick`), the last of which
//! is the baseline: a fresh lease semaphore's table slows down until
//! autovacuum first visits it (`autovacuum_naptime`, a minute), then
//! recovers, so its first interval is no baseline. Between designs the pressure ends and the
//! database is vacuumed, so each starts from clean tables. The tables give
//! the rate of each interval as a ratio to the undisturbed one, the p99 cycle
//! of the last interval, and the horizon's age (in xids) that VACUUM was held
//! to at the end; the workload is opt-in (`--only pressure`), not part of a
//! default run: ten minutes per design and pressure is hours in all.

use std::future::Future;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pg_semaphore::{AdvisorySemaphore, Error, Mutex, RateLimiter, RatePolicy, Semaphore};
use serde_json::json;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};
use tokio::io::AsyncReadExt;

use crate::advisory::raw_cycle;
use crate::load::{Outcome, connect, create_database, pool, run_load, splitmix64, unique};
use crate::mutex::Keys;
use crate::rate::rate_key;
use crate::report::{
    Cell, Target, fmt_int, fmt_opt, fmt_rate, fmt_ratio, markdown_table, percentile,
};
use crate::semaphore::counter_cycle;
use crate::{Ctx, POOL_SPARE, Res, Server, Workload};

/// Clients per design, as in the measurement that filed the issue.
pub const CLIENTS: usize = 4;
/// Capacity of the semaphores: 4 clients are never refused.
const CAPACITY: u32 = 64;
/// The filler table that makes the dumped database a few hundred MB.
const FILLER_ROWS: i64 = 1_200_000;
/// How fast the pg_dump's output is read.
const DUMP_BYTES_PER_SEC: u64 = 25 * 1024 * 1024;

pub const P_LEASE: &str = "lease Semaphore";
pub const P_ADVISORY: &str = "AdvisorySemaphore";
pub const P_MUTEX: &str = "Mutex (spread keys)";
pub const P_BUCKET: &str = "TokenBucket (1,000 keys)";
pub const P_COUNTER: &str = "counter row (seed 000)";
pub const P_RAW: &str = "raw advisory-lock cycle";
pub const P_UPDATE_HOT: &str = "bare UPDATE counter row (hot key)";
pub const P_BUCKET_HOT: &str = "TokenBucket (hot key)";
pub const P_SLIDING_HOT: &str = "SlidingWindow (hot key)";
pub const P_FIXED_HOT: &str = "FixedWindow (hot key)";
/// The designs a default run measures (the hot-key ones only when named in
/// `--designs`).
const DESIGNS: [&str; 6] = [P_LEASE, P_ADVISORY, P_MUTEX, P_BUCKET, P_COUNTER, P_RAW];
/// Every design and the short name `--designs` takes, in the order they run.
const ALL_DESIGNS: [(&str, &str); 10] = [
    (P_LEASE, "lease"),
    (P_ADVISORY, "advisory"),
    (P_MUTEX, "mutex"),
    (P_BUCKET, "bucket"),
    (P_COUNTER, "counter"),
    (P_RAW, "raw"),
    (P_UPDATE_HOT, "update-hot"),
    (P_BUCKET_HOT, "bucket-hot"),
    (P_SLIDING_HOT, "sliding-hot"),
    (P_FIXED_HOT, "fixed-hot"),
];

/// `--designs lease,advisory`: the designs to run, in the workload's order.
pub fn parse_designs(list: &str) -> Result<Vec<&'static str>, String> {
    let asked: Vec<&str> = list.split(',').map(str::trim).collect();
    if let Some(unknown) = asked
        .iter()
        .find(|a| !ALL_DESIGNS.iter().any(|(_, name)| name == *a))
    {
        let names: Vec<&str> = ALL_DESIGNS.iter().map(|(_, name)| *name).collect();
        return Err(format!("unknown design {unknown:?} ({})", names.join("|")));
    }
    Ok(ALL_DESIGNS
        .into_iter()
        .filter(|(_, name)| asked.contains(name))
        .map(|(design, _)| design)
        .collect())
}

/// What holds the horizon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pressure {
    Query,
    IdleXact,
    OtherDb,
    PgDump,
}

impl Pressure {
    pub const ALL: [Pressure; 4] = [
        Pressure::Query,
        Pressure::IdleXact,
        Pressure::OtherDb,
        Pressure::PgDump,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Pressure::Query => "query",
            Pressure::IdleXact => "idle-xact",
            Pressure::OtherDb => "other-db",
            Pressure::PgDump => "pg-dump",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Pressure::Query => "a long query in the same database",
            Pressure::IdleXact => "an idle transaction holding an xid in the same database",
            Pressure::OtherDb => "a long query in another database",
            Pressure::PgDump => "pg_dump of the same database (about 300 MB) in a loop",
        }
    }

    pub fn parse(name: &str) -> Result<Pressure, String> {
        Pressure::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| format!("unknown pressure {name:?} (query|idle-xact|other-db|pg-dump)"))
    }
}

type OpFuture = Pin<Box<dyn Future<Output = Res<Outcome>> + Send>>;
pub type Op = Arc<dyn Fn(usize, u64) -> OpFuture + Send + Sync>;

pub async fn pressure_workload(ctx: &mut Ctx) -> Res<()> {
    let s = ctx.settings.clone();
    let servers = ctx.servers.clone();
    let interval = if s.quick {
        Duration::from_secs(10)
    } else {
        Duration::from_secs(30)
    };
    let minutes = s
        .pressure_minutes
        .unwrap_or(if s.quick { 1.0 } else { 10.0 });
    let intervals = ((minutes * 60.0) / interval.as_secs_f64()).ceil().max(1.0) as usize;
    let undisturbed_intervals = if s.quick { 1 } else { 3 };
    let schedule = Schedule {
        interval,
        intervals,
        undisturbed_intervals,
        warmup: s.warmup,
    };
    let pressures: Vec<Pressure> = match s.pressure {
        Some(p) => vec![p],
        None => Pressure::ALL.to_vec(),
    };
    let mut cells = Vec::new();
    for server in &servers {
        let other_db = format!("pgsem_bench_{}_other", ctx.pid);
        if pressures.contains(&Pressure::OtherDb) {
            create_database(&server.admin, &other_db).await?;
            ctx.extra_dbs.push((server.admin.clone(), other_db.clone()));
        }
        if pressures.contains(&Pressure::PgDump) {
            fill(server).await?;
        }
        if s.pressure_interleave {
            for &pressure in &pressures {
                interleaved(ctx, server, pressure, &other_db, minutes).await?;
            }
            continue;
        }
        for &pressure in &pressures {
            let mut rows = Vec::new();
            let designs = s.pressure_designs.clone().unwrap_or(DESIGNS.to_vec());
            for design in designs {
                let cell = run_design(server, design, pressure, &other_db, schedule).await?;
                rows.push(row(&cell));
                cells.push(cell);
            }
            ctx.report.print(&format!(
                "## 12. Under MVCC pressure ({}): {}\n\n\
                 {CLIENTS} clients per design, each alone. Undisturbed: cycles/s in the last of \
                 {undisturbed_intervals} intervals of {} s just before (all of them in the \
                 second column: a fresh lease semaphore slows until autovacuum first visits). \
                 Then {intervals} intervals of {} s with {}. Ratios: each interval's cycles/s \
                 divided by the undisturbed rate. Horizon: how many xids VACUUM was held behind \
                 at the end.\n",
                server.label,
                pressure.name(),
                interval.as_secs(),
                interval.as_secs(),
                pressure.describe(),
            ));
            ctx.report.print(&markdown_table(
                &[
                    "design",
                    "undisturbed cycles/s",
                    "undisturbed intervals",
                    "worst interval",
                    "last interval",
                    "p99 undisturbed",
                    "p99 last interval",
                    "horizon held (xids)",
                    "errors",
                    "ratio per interval",
                ],
                &rows,
            ));
        }
    }
    targets(ctx, &cells, &servers);
    ctx.report.add_cells(cells);
    Ok(())
}

/// `--interleave`: the chosen designs in turns of 5 s (3 s with
/// `--quick`), two undisturbed rounds, then rounds under the pressure for
/// `minutes`; a table of each design's rate under the pressure as a ratio to
/// its own undisturbed median, and to the hot-key `UPDATE` baseline's rate
/// in the same rounds (when it is among the designs).
async fn interleaved(
    ctx: &mut Ctx,
    server: &Server,
    pressure: Pressure,
    other_db: &str,
    minutes: f64,
) -> Res<()> {
    let slice = Duration::from_secs(if ctx.settings.quick { 3 } else { 5 });
    let designs = ctx
        .settings
        .pressure_designs
        .clone()
        .unwrap_or(DESIGNS.to_vec());
    let pool = pool(&server.opts, CLIENTS as u32 + POOL_SPARE).await?;
    let mut ops = Vec::new();
    for design in &designs {
        ops.push((*design, design_op(server, &pool, design).await?));
    }
    let calm = rounds(
        &ops,
        slice,
        Duration::from_secs(2),
        2,
        f64::INFINITY,
        "undisturbed",
    )
    .await?;
    let held = Held::start(server, pressure, other_db).await?;
    let pressed = rounds(&ops, slice, Duration::ZERO, usize::MAX, minutes, "pressure").await?;
    let horizon = horizon_age(&pool).await.unwrap_or(0);
    held.stop(server).await?;
    drop(ops);
    pool.close().await;
    vacuum(server).await?;
    let rates: Vec<(Vec<f64>, Vec<f64>)> = calm.into_iter().zip(pressed).collect();
    let baseline = designs.iter().position(|d| *d == P_UPDATE_HOT);
    let tail = |v: &[f64]| v[v.len().saturating_sub(3)..].to_vec();
    let mut rows = Vec::new();
    for (i, design) in designs.iter().enumerate() {
        let (calm, pressed) = &rates[i];
        let base = median(calm);
        let spread = calm
            .iter()
            .map(|r| (r / base - 1.0).abs())
            .fold(0.0, f64::max);
        let ratios: Vec<f64> = pressed.iter().map(|r| r / base.max(1e-9)).collect();
        let versus = |rounds: &[f64], of: &[f64]| median(rounds) / median(of).max(1e-9);
        rows.push(vec![
            design.to_string(),
            fmt_rate(base),
            format!("±{:.0}%", spread * 100.0),
            fmt_ratio(ratios.iter().copied().reduce(f64::min)),
            fmt_ratio(Some(median(&tail(&ratios)))),
            baseline.map_or(String::new(), |b| {
                fmt_ratio(Some(versus(calm, &rates[b].0)))
            }),
            baseline.map_or(String::new(), |b| {
                fmt_ratio(Some(versus(&tail(pressed), &tail(&rates[b].1))))
            }),
            ratios
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(" "),
        ]);
    }
    ctx.report.print(&format!(
        "## 12b. Under MVCC pressure, interleaved ({}): {}\n\n\
         {CLIENTS} clients; the designs take turns of {} s: 2 undisturbed rounds, then rounds \
         for {minutes} min with {}. Each design's ratio: its cycles/s in a round under the \
         pressure over its undisturbed median (noise: the undisturbed rounds' largest \
         distance from their median). \"vs UPDATE\": the design's median over the hot-key \
         bare UPDATE's median in the same rounds (undisturbed; the last 3 rounds under the \
         pressure). Horizon held at the end: {} xids.\n",
        server.label,
        pressure.name(),
        slice.as_secs(),
        pressure.describe(),
        fmt_int(horizon as u64),
    ));
    ctx.report.print(&markdown_table(
        &[
            "design",
            "undisturbed cycles/s",
            "noise",
            "worst round",
            "last 3 rounds (median)",
            "vs UPDATE undisturbed",
            "vs UPDATE last 3 rounds",
            "ratio per round",
        ],
        &rows,
    ));
    Ok(())
}

/// `--interleave`: the designs measured in turns of `slice` each, rather
/// than one after the other, so that every design meets the same machine
/// (the bench shares it) and the same held horizon: rounds until `rounds`
/// are done or `minutes` have passed, whichever is first; the first slice of
/// each design after `warmup`. Returns each design's cycles/s per round.
async fn rounds(
    ops: &[(&'static str, Op)],
    slice: Duration,
    warmup: Duration,
    rounds: usize,
    minutes: f64,
    phase: &str,
) -> Res<Vec<Vec<f64>>> {
    let mut rates = vec![Vec::new(); ops.len()];
    let started = Instant::now();
    let mut round = 0;
    while round < rounds && started.elapsed().as_secs_f64() < minutes * 60.0 {
        for (i, (design, op)) in ops.iter().enumerate() {
            let op = op.clone();
            let warm = if round == 0 { warmup } else { Duration::ZERO };
            let load = run_load(CLIENTS, warm, slice, move |client, seq| op(client, seq)).await?;
            let rate = load.samples.len() as f64 / load.elapsed.as_secs_f64().max(1e-9);
            eprintln!(
                "  {phase} round {round} at {:.0} s: {design}: {rate:.0}/s{}",
                started.elapsed().as_secs_f64(),
                load.first_error
                    .map(|e| format!(" ({} errors: {e})", load.errors))
                    .unwrap_or_default()
            );
            rates[i].push(rate);
        }
        round += 1;
    }
    Ok(rates)
}

/// The median of `values` (0 for none).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

fn row(cell: &Cell) -> Vec<String> {
    let ratios: Vec<f64> = cell.extra["ratios"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
        .unwrap_or_default();
    let worst = ratios.iter().copied().reduce(f64::min);
    let get = |k: &str| cell.extra.get(k).and_then(|v| v.as_f64());
    let ms = |k: &str| get(k).map(|us| Duration::from_secs_f64(us / 1e6));
    vec![
        cell.implementation.clone(),
        fmt_rate(get("undisturbed_per_sec").unwrap_or(0.0)),
        cell.extra["undisturbed_rates"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_f64())
                    .map(fmt_rate)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default(),
        fmt_ratio(worst),
        fmt_ratio(ratios.last().copied()),
        fmt_opt(ms("undisturbed_p99_us")),
        fmt_opt(ms("last_p99_us")),
        fmt_int(get("horizon_xids").unwrap_or(0.0) as u64),
        fmt_int(cell.errors),
        ratios
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" "),
    ]
}

fn targets(ctx: &mut Ctx, cells: &[Cell], servers: &[Server]) {
    let find = |server: &str, design: &str, pressure: Pressure| {
        cells.iter().find(|c| {
            c.implementation == design
                && c.config["server"] == server
                && c.config["pressure"] == pressure.name()
        })
    };
    let worst = |cell: Option<&Cell>| {
        cell.and_then(|c| c.extra["ratios"].as_array())
            .and_then(|a| a.iter().filter_map(|v| v.as_f64()).reduce(f64::min))
    };
    let last = |cell: Option<&Cell>| {
        cell.and_then(|c| c.extra["ratios"].as_array())
            .and_then(|a| a.last().and_then(|v| v.as_f64()))
    };
    for server in servers {
        let label = server.label;
        for pressure in [Pressure::Query, Pressure::IdleXact, Pressure::PgDump] {
            // The rate limiters' designs too (issue 35: a limiter's hot key
            // ≥ 0.9x in every interval of a held query).
            for design in [
                P_ADVISORY,
                P_MUTEX,
                P_BUCKET,
                P_BUCKET_HOT,
                P_FIXED_HOT,
                P_SLIDING_HOT,
            ] {
                let Some(cell) = find(label, design, pressure) else {
                    continue;
                };
                let value = worst(Some(cell));
                ctx.report.targets.push(Target::at_least(
                    Workload::Pressure,
                    format!(
                        "{label}: {design} under {}: ≥ 0.9x undisturbed in every interval",
                        pressure.name()
                    ),
                    value,
                    0.9,
                    fmt_ratio(value),
                ));
            }
        }
        if let Some(cell) = find(label, P_LEASE, Pressure::OtherDb) {
            let value = worst(Some(cell));
            ctx.report.targets.push(Target::at_least(
                Workload::Pressure,
                format!(
                    "{label}: lease Semaphore in its own database, a query held in another: \
                     ≥ 0.9x in every interval"
                ),
                value,
                0.9,
                fmt_ratio(value),
            ));
        }
        if let Some(cell) = find(label, P_LEASE, Pressure::Query) {
            let value = last(Some(cell));
            ctx.report.targets.push(Target::at_least(
                Workload::Pressure,
                format!(
                    "{label}: lease Semaphore, a query held in its database: ≥ 0.5x at the end"
                ),
                value,
                0.5,
                fmt_ratio(value),
            ));
        }
    }
}

/// How long a design runs: `undisturbed_intervals`, then `intervals` under
/// the pressure, each `interval` long, after a `warmup`.
#[derive(Debug, Clone, Copy)]
struct Schedule {
    interval: Duration,
    intervals: usize,
    undisturbed_intervals: usize,
    warmup: Duration,
}

/// One design under one pressure: an undisturbed interval, then the
/// pressure's intervals, then the pressure ends and the database is vacuumed.
async fn run_design(
    server: &Server,
    design: &'static str,
    pressure: Pressure,
    other_db: &str,
    schedule: Schedule,
) -> Res<Cell> {
    let Schedule {
        interval,
        intervals,
        undisturbed_intervals,
        warmup,
    } = schedule;
    let pool = pool(&server.opts, CLIENTS as u32 + POOL_SPARE).await?;
    let op = design_op(server, &pool, design).await?;
    let measure = |warm: Duration| {
        let op = op.clone();
        run_load(CLIENTS, warm, interval, move |client, seq| op(client, seq))
    };
    // A fresh semaphore's table slows down until autovacuum first visits it
    // (autovacuum_naptime, a minute by default), then recovers: the rate to
    // compare with is the last of a few undisturbed intervals.
    let mut undisturbed_rates = Vec::new();
    let mut undisturbed = measure(warmup).await?;
    for i in 0..undisturbed_intervals {
        if i > 0 {
            undisturbed = measure(Duration::ZERO).await?;
        }
        let rate = undisturbed.samples.len() as f64 / undisturbed.elapsed.as_secs_f64();
        eprintln!(
            "  {} {design}: undisturbed interval {}/{undisturbed_intervals}: {} cycles/s",
            server.label,
            i + 1,
            fmt_rate(rate)
        );
        undisturbed_rates.push(rate);
    }
    let base_rate = undisturbed_rates.last().copied().unwrap_or(0.0);
    let mut sorted = undisturbed.samples.clone();
    sorted.sort_unstable();
    let base_p99 = percentile(&sorted, 99.0);

    let held = Held::start(server, pressure, other_db).await?;
    let started = Instant::now();
    let mut ratios = Vec::new();
    let mut p99s = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    let mut all_samples = Vec::new();
    for i in 0..intervals {
        let load = measure(Duration::ZERO).await?;
        let rate = load.samples.len() as f64 / load.elapsed.as_secs_f64().max(1e-9);
        let mut sorted = load.samples.clone();
        sorted.sort_unstable();
        let p99 = percentile(&sorted, 99.0);
        ratios.push(if base_rate > 0.0 {
            rate / base_rate
        } else {
            0.0
        });
        p99s.push(p99.map_or(0.0, |d| d.as_secs_f64() * 1e6));
        errors += load.errors;
        first_error = first_error.or(load.first_error);
        eprintln!(
            "  {} {design} under {}: interval {}/{intervals} at {:.0} s: {} cycles/s \
             ({:.2}x), p99 {}",
            server.label,
            pressure.name(),
            i + 1,
            started.elapsed().as_secs_f64(),
            fmt_rate(rate),
            ratios[i],
            fmt_opt(p99),
        );
        all_samples.extend(load.samples);
    }
    let horizon = horizon_age(&pool).await.unwrap_or(0);
    held.stop(server).await?;
    pool.close().await;
    drop(op);
    vacuum(server).await?;

    let config = json!({
        "server": server.label,
        "pressure": pressure.name(),
        "clients": CLIENTS,
        "interval_s": interval.as_secs(),
    });
    let mut cell = Cell::new(Workload::Pressure, design, config);
    cell.ops = all_samples.len() as u64;
    cell.errors = errors;
    cell.elapsed = Some(started.elapsed());
    all_samples.sort_unstable();
    cell.samples = all_samples;
    let extra = &mut cell.extra;
    extra.insert("undisturbed_per_sec".into(), base_rate.into());
    extra.insert("undisturbed_rates".into(), json!(undisturbed_rates));
    extra.insert(
        "undisturbed_p99_us".into(),
        base_p99.map_or(0.0, |d| d.as_secs_f64() * 1e6).into(),
    );
    extra.insert(
        "last_p99_us".into(),
        p99s.last().copied().unwrap_or(0.0).into(),
    );
    extra.insert("ratios".into(), json!(ratios));
    extra.insert("p99_us".into(), json!(p99s));
    extra.insert("horizon_xids".into(), horizon.into());
    if let Some(error) = first_error {
        extra.insert("first_error".into(), error.into());
    }
    Ok(cell)
}

/// The statement(s) of one design's cycle, on fresh objects.
async fn design_op(server: &Server, pool: &PgPool, design: &str) -> Res<Op> {
    Ok(match design {
        P_LEASE => {
            let sem = Semaphore::builder(unique("bench-pressure-lease"), CAPACITY)
                .build(&pg_semaphore::Client::new(pool.clone()))
                .await?;
            Arc::new(move |_, _| {
                let sem = sem.clone();
                Box::pin(async move {
                    match sem.try_acquire().await {
                        Ok(permit) => {
                            permit.release().await?;
                            Ok(Outcome::Done)
                        }
                        Err(Error::NoSlotsAvailable { .. }) => Ok(Outcome::Refused),
                        Err(error) => Err(error.into()),
                    }
                })
            })
        }
        P_ADVISORY => {
            let sem = AdvisorySemaphore::builder(unique("bench-pressure-adv"), CAPACITY)
                .build(&pg_semaphore::Client::new(pool.clone()).advisory_connections(CLIENTS))
                .await?;
            Arc::new(move |_, _| {
                let sem = sem.clone();
                Box::pin(async move {
                    match sem.try_acquire().await {
                        Ok(permit) => {
                            permit.release().await?;
                            Ok(Outcome::Done)
                        }
                        Err(Error::NoSlotsAvailable { .. }) => Ok(Outcome::Refused),
                        Err(error) => Err(error.into()),
                    }
                })
            })
        }
        P_MUTEX => {
            let ours = pg_semaphore::Client::new(pool.clone());
            Arc::new(move |client, seq| {
                let ours = ours.clone();
                Box::pin(async move {
                    let guard = Mutex::with_key(Keys::Spread.key(0x9e55, client, seq))
                        .lock(&ours)
                        .await?;
                    guard.commit().await?;
                    Ok(Outcome::Done)
                })
            })
        }
        P_BUCKET => {
            let limiter = RateLimiter::builder(
                unique("bench-pressure-bucket"),
                RatePolicy::token_bucket(1_000.0, 1_000),
            )
            .build(&pg_semaphore::Client::new(pool.clone()))?;
            Arc::new(move |client, seq| {
                let limiter = limiter.clone();
                Box::pin(async move {
                    let key = rate_key(Keys::Spread, 0x9e55, client, seq);
                    let _allowed = limiter.check(&key, 1).await?.allowed;
                    Ok(Outcome::Done)
                })
            })
        }
        P_UPDATE_HOT => update_op(pool).await?,
        P_BUCKET_HOT => {
            let limiter = RateLimiter::builder(
                unique("bench-pressure-bucket-hot"),
                RatePolicy::token_bucket(1e6, 1_000_000),
            )
            .build(&pg_semaphore::Client::new(pool.clone()))?;
            Arc::new(move |_, _| {
                let limiter = limiter.clone();
                Box::pin(async move {
                    let _allowed = limiter.check("hot", 1).await?.allowed;
                    Ok(Outcome::Done)
                })
            })
        }
        P_SLIDING_HOT => {
            let limiter = RateLimiter::builder(
                unique("bench-pressure-sliding-hot"),
                RatePolicy::sliding_window(1_000_000_000, Duration::from_secs(1)),
            )
            .build(&pg_semaphore::Client::new(pool.clone()))?;
            Arc::new(move |_, _| {
                let limiter = limiter.clone();
                Box::pin(async move {
                    let _allowed = limiter.check("hot", 1).await?.allowed;
                    Ok(Outcome::Done)
                })
            })
        }
        P_FIXED_HOT => {
            let limiter = RateLimiter::builder(
                unique("bench-pressure-fixed-hot"),
                RatePolicy::fixed_window(1_000_000_000, Duration::from_secs(1)),
            )
            .build(&pg_semaphore::Client::new(pool.clone()))?;
            Arc::new(move |_, _| {
                let limiter = limiter.clone();
                Box::pin(async move {
                    let _allowed = limiter.check("hot", 1).await?.allowed;
                    Ok(Outcome::Done)
                })
            })
        }
        P_COUNTER => {
            let name: Arc<str> = unique("bench-pressure-counter").into();
            sqlx::query("INSERT INTO bench_baseline.counters (name, max, used) VALUES ($1, $2, 0)")
                .bind(&*name)
                .bind(CAPACITY as i32)
                .execute(pool)
                .await?;
            let pool = pool.clone();
            Arc::new(move |_, _| {
                let pool = pool.clone();
                let name = name.clone();
                Box::pin(async move { counter_cycle(&pool, &name).await })
            })
        }
        _ => {
            let mut connections = Vec::with_capacity(CLIENTS);
            for _ in 0..CLIENTS {
                connections.push(tokio::sync::Mutex::new(connect(&server.opts).await?));
            }
            let connections = Arc::new(connections);
            let key = (splitmix64(0x9e55) >> 33) as i32;
            Arc::new(move |client, _| {
                let connections = connections.clone();
                Box::pin(async move {
                    let mut conn = connections[client].lock().await;
                    raw_cycle(&mut conn, key, CAPACITY).await
                })
            })
        }
    })
}

/// `update-hot`: a bare single-row `UPDATE ... SET n = n + 1` on one hot
/// key, the baseline the hot-key limiters are held against.
async fn update_op(pool: &PgPool) -> Res<Op> {
    let key: Arc<str> = unique("hot").into();
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bench_baseline.hot_counters (key text PRIMARY KEY, n bigint NOT NULL)",
    )
    .execute(pool)
    .await?;
    sqlx::query("INSERT INTO bench_baseline.hot_counters VALUES ($1, 0)")
        .bind(&*key)
        .execute(pool)
        .await?;
    let pool = pool.clone();
    Ok(Arc::new(move |_, _| {
        let (pool, key) = (pool.clone(), key.clone());
        Box::pin(async move {
            sqlx::query("UPDATE bench_baseline.hot_counters SET n = n + 1 WHERE key = $1")
                .bind(&*key)
                .execute(&pool)
                .await?;
            Ok(Outcome::Done)
        })
    }))
}

/// The pressure, while it lasts.
struct Held {
    /// Backends to terminate at the end (the held query, the idle transaction).
    pids: Vec<i32>,
    /// The idle transaction's connection: it must stay open.
    conn: Option<PgConnection>,
    task: Option<tokio::task::JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

impl Held {
    async fn start(server: &Server, pressure: Pressure, other_db: &str) -> Res<Held> {
        let mut held = Held {
            pids: Vec::new(),
            conn: None,
            task: None,
            stop: Arc::new(AtomicBool::new(false)),
        };
        match pressure {
            Pressure::Query | Pressure::OtherDb => {
                let opts = if pressure == Pressure::OtherDb {
                    server.admin.clone().database(other_db)
                } else {
                    server.opts.clone()
                };
                let mut conn = connect(&opts).await?;
                held.pids.push(
                    sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(&mut conn)
                        .await?,
                );
                held.task = Some(tokio::spawn(async move {
                    // Ends with an error when stop() terminates the backend.
                    let _ = sqlx::query("SELECT pg_sleep(86400)")
                        .execute(&mut conn)
                        .await;
                }));
            }
            Pressure::IdleXact => {
                let mut conn = connect(&server.opts).await?;
                held.pids.push(
                    sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(&mut conn)
                        .await?,
                );
                sqlx::raw_sql("BEGIN; SELECT pg_current_xact_id();")
                    .execute(&mut conn)
                    .await?;
                held.conn = Some(conn);
            }
            Pressure::PgDump => {
                let pg_dump = testkit::server::find_bin_dir()
                    .map(|dir| dir.join("pg_dump"))
                    .filter(|p| p.is_file())
                    .ok_or("no pg_dump beside the server binaries")?;
                let url = server.url.clone();
                let stop = held.stop.clone();
                held.task = Some(tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        if let Err(error) = dump_once(&pg_dump, &url, &stop).await {
                            eprintln!("  pg_dump: {error}");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                }));
            }
        }
        // Let the pressure take hold before the first interval.
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(held)
    }

    async fn stop(mut self, server: &Server) -> Res<()> {
        self.stop.store(true, Ordering::Relaxed);
        let mut admin = connect(&server.admin).await?;
        for pid in &self.pids {
            sqlx::query("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .execute(&mut admin)
                .await?;
        }
        admin.close().await?;
        if let Some(conn) = self.conn.take() {
            drop(conn);
        }
        if let Some(task) = self.task.take() {
            task.await?;
        }
        Ok(())
    }
}

/// One pg_dump of the bench database, its output read at the set pace and
/// thrown away; killed when `stop` is set.
async fn dump_once(pg_dump: &std::path::Path, url: &str, stop: &AtomicBool) -> Res<()> {
    let mut child = tokio::process::Command::new(pg_dump)
        .arg("--dbname")
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut out = child.stdout.take().ok_or("pg_dump without stdout")?;
    let mut buf = vec![0u8; 256 * 1024];
    let started = Instant::now();
    let mut read = 0u64;
    loop {
        if stop.load(Ordering::Relaxed) {
            child.kill().await?;
            return Ok(());
        }
        let n = out.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        read += n as u64;
        let due = Duration::from_secs_f64(read as f64 / DUMP_BYTES_PER_SEC as f64);
        if let Some(ahead) = due.checked_sub(started.elapsed()) {
            tokio::time::sleep(ahead).await;
        }
    }
    let status = child.wait().await?;
    if !status.success() {
        return Err(format!("pg_dump exited with {status}").into());
    }
    Ok(())
}

/// A table of about 300 MB in the bench database, for pg_dump to read.
async fn fill(server: &Server) -> Res<()> {
    let mut conn = connect(&server.opts).await?;
    eprintln!("  {}: filling the bench database for pg_dump", server.label);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS bench_baseline.filler AS \
             SELECT g AS id, md5(g::text) || repeat('x', 200) AS payload \
             FROM generate_series(1, {FILLER_ROWS}) g"
    )))
    .execute(&mut conn)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE bench_baseline.filler")
        .execute(&mut conn)
        .await?;
    let size: String =
        sqlx::query_scalar("SELECT pg_size_pretty(pg_database_size(current_database()))")
            .fetch_one(&mut conn)
            .await?;
    eprintln!("  {}: the bench database is {size}", server.label);
    Ok(())
}

/// How many xids the oldest snapshot of the bench database holds VACUUM
/// behind.
async fn horizon_age(pool: &PgPool) -> Res<i64> {
    Ok(sqlx::query_scalar(
        "SELECT coalesce(max(greatest(age(backend_xmin), age(backend_xid))), 0)::bigint \
         FROM pg_stat_activity WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await?)
}

async fn vacuum(server: &Server) -> Res<()> {
    let mut conn = connect(&server.opts).await?;
    sqlx::raw_sql("VACUUM").execute(&mut conn).await?;
    conn.close().await?;
    Ok(())
}
