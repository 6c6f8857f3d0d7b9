//! Workload 3, wake-up latency: from a release to the waiting `acquire()` returning,
//! against `SELECT 1` round trips and the polling fallback.

use std::time::{Duration, Instant};

use pg_semaphore::{AdvisorySemaphore, Error, Semaphore};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::load::{pool, unique};
use crate::report::{
    Cell, Target, fmt_dur, fmt_int, fmt_opt, fmt_p50_spread, fmt_ratio, markdown_table, micros,
    percentile,
};
use crate::{Ctx, Res, Server, Settings, Workload};

/// How long the wake-up workload lets the waiter settle into waiting.
pub const WAKE_SETTLE: Duration = Duration::from_millis(30);

pub const WAKE_OURS: &str = "ours: release → waiting acquire() returns (LISTEN/NOTIFY)";
pub const WAKE_ADVISORY: &str =
    "AdvisorySemaphore: release → waiting acquire() returns (LISTEN/NOTIFY)";
pub const WAKE_SELECT_HELD: &str = "SELECT 1 round trip (held connection)";
pub const WAKE_SELECT_POOL: &str = "SELECT 1 through the pool (checkout + ping + query)";
pub const WAKE_SELECT_IDLE: &str = "SELECT 1 round trip after 30 ms idle (held connection)";
pub const WAKE_NOTIFY: &str =
    "raw pg_notify → sqlx PgListener receives it, after 30 ms idle (for profiling)";

/// A capacity-1 semaphore: time from the holder's release to the waiter's
/// return, on each server, against SELECT 1 round trips.
pub async fn wakeup_workload(ctx: &mut Ctx) -> Res<()> {
    let s = ctx.settings.clone();
    let mut all = Vec::new();
    for server in &ctx.servers.clone() {
        let cells = wakeup_on(server, &s).await?;
        let ours = &cells[2];
        let idle_base = cells
            .iter()
            .find(|c| c.implementation == WAKE_SELECT_IDLE)
            .and_then(Cell::p50);
        let label = server.label;
        let ratio = ours.ratio("p50_vs_idle_select1_p50");
        ctx.report.targets.push(Target::at_most(
            Workload::Wakeup,
            format!("{label}: ours p50 ≤ 5x SELECT 1 p50 (after the same idle pause)"),
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
        let advisory = cells.iter().find(|c| c.implementation == WAKE_ADVISORY);
        let ratio = advisory.and_then(|c| c.ratio("p50_vs_idle_select1_p50"));
        ctx.report.targets.push(Target::at_most(
            Workload::Wakeup,
            format!("{label}: AdvisorySemaphore p50 ≤ 3x SELECT 1 p50 (after the same idle pause)"),
            ratio,
            3.0,
            format!(
                "{} ({} vs {})",
                fmt_ratio(ratio),
                fmt_opt(advisory.and_then(Cell::p50)),
                fmt_opt(idle_base),
            ),
        ));
        // No polling floor: wake-ups must come well before the shortest poll tested.
        let shortest = Duration::from_millis(100);
        let p99 = ours.p99().map(|d| d.as_secs_f64() * 1e3);
        ctx.report.targets.push(Target::at_most(
            Workload::Wakeup,
            format!(
                "{label}: no polling floor: ours p99 < {} (shortest fallback tested; default {})",
                fmt_dur(shortest),
                fmt_dur(pg_semaphore::limits::DEFAULT_FALLBACK_INTERVAL)
            ),
            p99,
            shortest.as_secs_f64() * 1e3,
            format!(
                "p50 {}, p99 {} (polling at {}: p50 {})",
                fmt_opt(ours.p50()),
                fmt_opt(ours.p99()),
                fmt_dur(pg_semaphore::limits::DEFAULT_FALLBACK_INTERVAL),
                fmt_opt(cells[3].p50())
            ),
        ));
        all.extend(cells);
    }

    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.implementation.clone(),
                c.config["server"].as_str().unwrap_or("").to_owned(),
                fmt_int(c.ops),
                fmt_p50_spread(c),
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
         acquire() returns − t0 (includes the release round trip). Ours and the SELECT 1 rows \
         are measured {} times, interleaved: p50 is the median of the runs' p50s (min–max), \
         p99 and max over all runs; the polling and raw NOTIFY rows are measured once. \
         Polling rows: both handles built with transaction_pooling(true), fresh pools. \
         The AdvisorySemaphore row: the same, with a capacity-1 advisory semaphore (measured \
         {} times, interleaved with ours). \
         \"of which release() p50\": t0 until the holder's release() returned. \"idle SELECT 1\": \
         the same round trip after the wake-up's idle pause, the like-for-like baseline the \
         target uses (a wake-up runs on paths that have been idle). The raw NOTIFY row is for \
         profiling only.\n",
        WAKE_SETTLE.as_millis(),
        s.reps,
        s.reps
    ));
    ctx.report.print(&markdown_table(
        &[
            "measurement",
            "server",
            "samples",
            "p50 (min–max)",
            "p99",
            "max",
            "p50 ÷ SELECT 1 p50",
            "p50 ÷ idle SELECT 1 p50",
            "of which release() p50",
        ],
        &rows,
    ));
    ctx.report.add_cells(all);
    Ok(())
}

/// The wake-up cells of one server, in the table's order: SELECT 1 held, SELECT
/// 1 pooled, ours, polling at the default fallback, polling at 100 ms, idle
/// SELECT 1, raw NOTIFY; with their ratios.
async fn wakeup_on(server: &Server, s: &Settings) -> Res<Vec<Cell>> {
    let mut selects: [Vec<Cell>; 3] = Default::default();
    let mut ours = Vec::new();
    let mut advisory = Vec::new();
    for _ in 0..s.reps {
        for (i, cell) in select_cells(server, s).await?.into_iter().enumerate() {
            selects[i].push(cell);
        }
        ours.push(
            wake_cell(
                server,
                WAKE_OURS.to_owned(),
                None,
                s.wake_warmup,
                s.wake_reps,
            )
            .await?,
        );
        advisory.push(advisory_wake_cell(server, s.wake_warmup, s.wake_reps).await?);
    }
    let [held, pooled, idle] = selects.map(|reps| Cell::from_reps(reps, &[]));
    let ours = Cell::from_reps(ours, &[]);
    let advisory = Cell::from_reps(advisory, &[]);
    for cell in [&held, &pooled, &idle, &ours, &advisory] {
        eprintln!("{}", cell.progress());
    }

    // The notification path disabled: transaction_pooling(true) polls every fallback interval.
    let mut polling = Vec::new();
    for fallback in [
        pg_semaphore::limits::DEFAULT_FALLBACK_INTERVAL,
        Duration::from_millis(100),
    ] {
        let label = format!(
            "transaction_pooling(true), no LISTEN, fallback {}",
            fmt_dur(fallback)
        );
        polling.push(wake_cell(server, label, Some(fallback), 0, s.fallback_reps).await?);
    }

    let notify = notify_cell(server, s).await?;

    let base = held.p50();
    let mut cells = vec![held, pooled, ours];
    cells.extend(polling);
    cells.push(idle);
    cells.push(notify);
    cells.push(advisory);
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
    Ok(cells)
}

/// One run of the SELECT 1 baselines: held connection, through the pool,
/// and after the wake-up's idle pause.
async fn select_cells(server: &Server, s: &Settings) -> Res<[Cell; 3]> {
    let config = json!({ "server": server.label, "settle_ms": WAKE_SETTLE.as_millis() as u64 });
    // Baseline: SELECT 1 round trips.
    let pool_a = pool(&server.opts, 2).await?;
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
    let select_held = Cell::from_samples(Workload::Wakeup, WAKE_SELECT_HELD, config.clone(), held);
    let select_pool =
        Cell::from_samples(Workload::Wakeup, WAKE_SELECT_POOL, config.clone(), pooled);
    let select_idle = Cell::from_samples(Workload::Wakeup, WAKE_SELECT_IDLE, config.clone(), idle);
    Ok([select_held, select_pool, select_idle])
}

/// `reps` timed wake-ups (after `warmup` untimed ones); `fallback` = polling mode.
pub async fn wake_cell(
    server: &Server,
    label: String,
    fallback: Option<Duration>,
    warmup: usize,
    reps: usize,
) -> Res<Cell> {
    let name = format!("bench-wake-{}", fallback.map_or(0, |f| f.as_millis()));
    let build = |pool: PgPool| {
        let name = name.clone();
        async move {
            let mut client = pg_semaphore::Client::new(pool);
            if let Some(fallback) = fallback {
                client = client.transaction_pooling(true).fallback_interval(fallback);
            }
            Semaphore::builder(name, 1).build(&client).await
        }
    };
    let holder_pool = pool(&server.opts, 2).await?;
    let waiter_pool = pool(&server.opts, 2).await?;
    let holder = build(holder_pool.clone()).await?;
    let waiter = build(waiter_pool.clone()).await?;
    let patience = fallback.unwrap_or(Duration::ZERO) * 3 + Duration::from_secs(10);
    let (samples, mut releases) = time_wakeups(
        warmup,
        reps,
        patience,
        || holder.try_acquire(),
        |permit| permit.release(),
        || {
            let waiter = waiter.clone();
            async move {
                let permit = waiter.acquire().await?;
                let woke = Instant::now();
                permit.release().await?;
                Ok(woke)
            }
        },
    )
    .await?;
    drop((holder, waiter));
    holder_pool.close().await;
    waiter_pool.close().await;
    let config = json!({
        "server": server.label,
        "fallback_ms": fallback.map(|f| f.as_millis() as u64),
        "settle_ms": WAKE_SETTLE.as_millis() as u64,
    });
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

/// The timed loop of a wake-up cell, for either semaphore: `warmup + reps`
/// times, the holder takes the permit (`hold`), a spawned waiter (`wait`:
/// acquire, stamp the instant it woke, release) settles into waiting for
/// [`WAKE_SETTLE`], then the holder releases (`release`) at t0. Returns the
/// timed latencies (woke − t0) and the holder's release times.
async fn time_wakeups<P, H, R, W>(
    warmup: usize,
    reps: usize,
    patience: Duration,
    hold: impl Fn() -> H,
    release: impl Fn(P) -> R,
    wait: impl Fn() -> W,
) -> Res<(Vec<Duration>, Vec<Duration>)>
where
    H: Future<Output = Result<P, Error>>,
    R: Future<Output = Result<(), Error>>,
    W: Future<Output = Result<Instant, Error>> + Send + 'static,
{
    let mut samples = Vec::with_capacity(reps);
    let mut releases = Vec::with_capacity(reps);
    for i in 0..warmup + reps {
        let permit = hold().await?;
        let task = tokio::spawn(wait());
        tokio::time::sleep(WAKE_SETTLE).await;
        let t0 = Instant::now();
        release(permit).await?;
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
    Ok((samples, releases))
}

/// `reps` timed wake-ups of a capacity-1 [`AdvisorySemaphore`] (after
/// `warmup` untimed ones): the holder and the waiter each on a pool of its
/// own, so each has its own sessions and `LISTEN` connection, as two
/// processes would.
async fn advisory_wake_cell(server: &Server, warmup: usize, reps: usize) -> Res<Cell> {
    let name = unique("bench-wake-adv");
    let holder_pool = pool(&server.opts, 2).await?;
    let waiter_pool = pool(&server.opts, 2).await?;
    let holder = AdvisorySemaphore::builder(name.clone(), 1)
        .build(&pg_semaphore::Client::new(holder_pool.clone()))
        .await?;
    let waiter = AdvisorySemaphore::builder(name, 1)
        .build(&pg_semaphore::Client::new(waiter_pool.clone()))
        .await?;
    let (samples, mut releases) = time_wakeups(
        warmup,
        reps,
        Duration::from_secs(10),
        || holder.try_acquire(),
        |permit| permit.release(),
        || {
            let waiter = waiter.clone();
            async move {
                let permit = waiter.acquire().await?;
                let woke = Instant::now();
                permit.release().await?;
                Ok(woke)
            }
        },
    )
    .await?;
    drop((holder, waiter));
    holder_pool.close().await;
    waiter_pool.close().await;
    let config = json!({ "server": server.label, "settle_ms": WAKE_SETTLE.as_millis() as u64 });
    let mut cell = Cell::from_samples(Workload::Wakeup, WAKE_ADVISORY, config, samples);
    releases.sort_unstable();
    cell.extra.insert(
        "release_p50_us".into(),
        json!(percentile(&releases, 50.0).map(micros)),
    );
    eprintln!("{}", cell.progress());
    Ok(cell)
}

/// For profiling, not a target: `SELECT pg_notify(..)` on one connection until
/// a sqlx `PgListener` on another receives it.
pub async fn notify_cell(server: &Server, s: &Settings) -> Res<Cell> {
    let pool = pool(&server.opts, 2).await?;
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
    let cell = Cell::from_samples(
        Workload::Wakeup,
        WAKE_NOTIFY,
        json!({ "server": server.label }),
        samples,
    );
    eprintln!("{}", cell.progress());
    Ok(cell)
}
