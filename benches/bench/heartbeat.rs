//! Workload 17, what the heartbeat costs: workload 1's cycle (`try_acquire`
//! and release, 8 clients, capacity 32) while another client holds H
//! permits whose heartbeat renews them, against the same cycle with nothing
//! held.
//!
//! - **none held**: the cycle alone (the baseline);
//! - **90 s lease**: a holder (a pool and `Client` of its own) holds H
//!   permits of one semaphore of capacity H, each permit with its own
//!   heartbeat, renewed every third of the lease (30 s);
//! - **10 s lease**: the same, renewed every 3.33 s.
//!
//! The holder takes its H permits one by one, spread evenly over one
//! heartbeat interval (`--quick`: all at once), so that the renewals are
//! spread as those of holders that came at different times, and any window
//! sees the steady rate. Renewals are counted on the server: the holder's
//! rows in `pgsemaphore.slots` are read at the window's start and then at
//! least twice per heartbeat interval, and each row whose `expires_at`
//! moved on between two readings is one renewal (a permit cannot renew
//! twice between two readings). After each cell the holder releases every
//! permit, the bench checks that none of its slots is still live, and the
//! holder's client and pool stop.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use pg_semaphore::{Permit, Semaphore};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::load::{pool, run_load, unique};
use crate::report::{
    Cell, fmt_dur, fmt_int, fmt_opt, fmt_rate, fmt_rate_spread, fmt_ratio, markdown_table,
    throughput_ratios,
};
use crate::semaphore::try_cycle;
use crate::{Ctx, POOL_SPARE, Res, Server, Settings, Workload};

const CLIENTS: usize = 8;
const CAPACITY: u32 = 32;
/// The holder's pool: its heartbeats share these connections.
const HOLDER_CONNECTIONS: u32 = 4;
const NONE_HELD: &str = "none held";

/// The leases of the cells with permits held: today's default and the
/// proposed one.
const LEASES: [Duration; 2] = [Duration::from_secs(90), Duration::from_secs(10)];

pub async fn heartbeat_workload(ctx: &mut Ctx) -> Res<()> {
    let s = ctx.settings.clone();
    let mut all = Vec::new();
    for held in [100u32, 1_000] {
        for server in &ctx.servers.clone() {
            let config = json!({ "server": server.label, "held": held, "clients": CLIENTS });
            let mut reps: [Vec<Cell>; 3] = Default::default();
            for _ in 0..s.reps {
                reps[0].push(cell(server, &s, held, None, config.clone()).await?);
                for (i, lease) in LEASES.into_iter().enumerate() {
                    reps[i + 1].push(cell(server, &s, held, Some(lease), config.clone()).await?);
                }
            }
            let summed = ["renewals", "observed_ms", "lost", "release_errors"];
            let mut group: Vec<Cell> = reps
                .into_iter()
                .map(|r| Cell::from_reps(r, &summed))
                .collect();
            throughput_ratios(&mut group, "vs_none", 0);
            all.extend(group);
        }
    }

    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            let held = c.implementation != NONE_HELD;
            let count = |key: &str| c.extra.get(key).and_then(Value::as_u64).unwrap_or(0);
            vec![
                c.config["server"].as_str().unwrap_or("").to_owned(),
                c.config["held"].to_string(),
                c.implementation.clone(),
                fmt_rate_spread(c),
                fmt_ratio(c.ratio("vs_none")),
                fmt_opt(c.p50()),
                fmt_opt(c.p99()),
                if held {
                    format!(
                        "{} ({})",
                        fmt_rate(renewals_per_sec(c).unwrap_or(0.0)),
                        fmt_rate(c.extra["expected_per_sec"].as_f64().unwrap_or(0.0))
                    )
                } else {
                    "–".into()
                },
                fmt_int(c.errors + count("release_errors")),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 17. Heartbeat: the cycle while H permits are held and renewed\n\n\
         8 clients loop on workload 1's cycle (try_acquire + release, capacity 32) while a \
         holder with a pool of {HOLDER_CONNECTIONS} connections of its own holds H permits of \
         another semaphore (capacity H), each renewed by its own heartbeat every third of the \
         lease; the baseline holds none. The holder takes its permits spread over one heartbeat \
         interval{}, so renewals come at their steady rate, and releases them all after the \
         cell. cycles/s: median of {} runs of {} s (min–max), ÷ none the ratio to the run's \
         baseline on the same server and H. renewals/s: rows of the holder whose expires_at \
         moved on, read on the server at the window's start and at least twice per heartbeat \
         interval, over the {} windows together; in brackets H ÷ the interval. errors: failed \
         cycles and failed releases (a permit lost before its release fails it).\n",
        if s.quick {
            " (--quick: all at once, so no renewal falls in a window)"
        } else {
            ""
        },
        s.reps,
        s.cell.as_secs_f64(),
        s.reps,
    ));
    ctx.report.print(&markdown_table(
        &[
            "server",
            "H",
            "permits held",
            "cycles/s (min–max)",
            "÷ none",
            "p50 cycle",
            "p99 cycle",
            "renewals/s (H ÷ interval)",
            "errors",
        ],
        &rows,
    ));
    ctx.report.add_cells(all);
    Ok(())
}

/// Renewals per second over every repetition's observed window together.
fn renewals_per_sec(cell: &Cell) -> Option<f64> {
    let renewals = cell.extra.get("renewals")?.as_u64()?;
    let ms = cell.extra.get("observed_ms")?.as_u64()?;
    (ms > 0).then(|| renewals as f64 * 1e3 / ms as f64)
}

/// One repetition: the cycle, with H permits held under `lease` or none.
async fn cell(
    server: &Server,
    s: &Settings,
    held: u32,
    lease: Option<Duration>,
    config: Value,
) -> Res<Cell> {
    let holder = match lease {
        Some(lease) => Some(Holder::start(server, s, held, lease).await?),
        None => None,
    };
    let pool = pool(&server.opts, CLIENTS as u32 + POOL_SPARE).await?;
    let sem = Semaphore::builder(unique("bench-hb-cycle"), CAPACITY)
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    let from = Instant::now() + s.warmup;
    let counting = holder.as_ref().map(|h| {
        let (observer, ids) = (h.observer.clone(), h.ids());
        let every = (h.interval / 2).min(s.cell);
        tokio::spawn(count_renewals(observer, ids, from, from + s.cell, every))
    });
    let load = run_load(CLIENTS, s.warmup, s.cell, move |_, _| {
        let sem = sem.clone();
        async move { try_cycle(&sem).await }
    })
    .await?;
    pool.close().await;
    let name = match lease {
        None => NONE_HELD.to_owned(),
        Some(lease) => format!(
            "{} s lease, renewed every {:.3} s",
            lease.as_secs(),
            (lease / 3).as_secs_f64()
        )
        .replace(".000 s", " s"),
    };
    let mut cell = Cell::from_load(Workload::Heartbeat, name, config, load);
    if let (Some(holder), Some(counting)) = (holder, counting) {
        let (renewals, observed) = counting.await??;
        cell.extra.insert("renewals".into(), renewals.into());
        cell.extra
            .insert("observed_ms".into(), (observed.as_millis() as u64).into());
        cell.extra.insert(
            "expected_per_sec".into(),
            (f64::from(held) / holder.interval.as_secs_f64()).into(),
        );
        cell.extra.insert(
            "spread_ms".into(),
            (holder.spread.as_millis() as u64).into(),
        );
        let (lost, release_errors) = holder.stop().await?;
        cell.extra.insert("lost".into(), lost.into());
        cell.extra
            .insert("release_errors".into(), release_errors.into());
        eprintln!(
            "{}; {renewals} renewals in {} ({}/s); {lost} lost, {release_errors} failed releases",
            cell.progress(),
            fmt_dur(observed),
            fmt_rate(renewals as f64 / observed.as_secs_f64().max(1e-9)),
        );
    } else {
        eprintln!("{}", cell.progress());
    }
    Ok(cell)
}

/// The client holding H permits with their heartbeat on.
struct Holder {
    pool: PgPool,
    client: pg_semaphore::Client,
    /// Reads the holder's rows; a pool apart from the holder's and the cycle's.
    observer: PgPool,
    name: String,
    permits: Vec<Permit>,
    interval: Duration,
    /// How long taking the H permits took.
    spread: Duration,
}

impl Holder {
    /// Takes `held` permits of a fresh semaphore of capacity `held` with
    /// `lease`, spread evenly over one heartbeat interval (`--quick`: at once).
    async fn start(server: &Server, s: &Settings, held: u32, lease: Duration) -> Res<Holder> {
        let observer = pool(&server.opts, 1).await?;
        let pool = pool(&server.opts, HOLDER_CONNECTIONS).await?;
        let client = pg_semaphore::Client::new(pool.clone());
        let name = unique("bench-hb-held");
        let sem = Semaphore::builder(name.clone(), held)
            .lease(lease)
            .build(&client)
            .await?;
        let interval = lease / 3; // the default heartbeat
        let spread = if s.quick { Duration::ZERO } else { interval };
        let started = Instant::now();
        let mut claims = JoinSet::new();
        for i in 0..held {
            let (sem, at) = (sem.clone(), started + spread * i / held);
            claims.spawn(async move {
                tokio::time::sleep_until(at).await;
                sem.try_acquire().await
            });
        }
        let mut permits = Vec::with_capacity(held as usize);
        while let Some(claimed) = claims.join_next().await {
            permits.push(claimed??);
        }
        Ok(Holder {
            pool,
            client,
            observer,
            name,
            permits,
            interval,
            spread: started.elapsed(),
        })
    }

    fn ids(&self) -> Vec<i64> {
        self.permits.iter().map(Permit::id).collect()
    }

    /// Releases every permit, checks that none of the semaphore's slots is
    /// still live, and stops the holder's client and pools. Returns the
    /// permits found lost and the releases that failed.
    async fn stop(self) -> Res<(u64, u64)> {
        let lost = self.permits.iter().filter(|p| p.is_lost()).count() as u64;
        let mut releases = JoinSet::new();
        for permit in self.permits {
            releases.spawn(permit.release());
        }
        let mut failed = 0u64;
        while let Some(released) = releases.join_next().await {
            if let Err(error) = released? {
                failed += 1;
                eprintln!("  heartbeat: a release failed: {error}");
            }
        }
        let live: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pgsemaphore.slots \
             WHERE semaphore = $1 AND completed_at IS NULL AND timed_out_at IS NULL",
        )
        .bind(&self.name)
        .fetch_one(&self.observer)
        .await?;
        if live != 0 {
            return Err(format!("{live} slots of {} still live after release", self.name).into());
        }
        self.client.shutdown().await?;
        self.pool.close().await;
        self.observer.close().await;
        Ok((lost, failed))
    }
}

/// Counts the renewals of claims `ids` from `from` to `until`, reading their
/// `expires_at` every `every` (shorter than the heartbeat interval, so that
/// a claim renews at most once between two readings). Returns the count and
/// the time from the first reading to the last.
async fn count_renewals(
    observer: PgPool,
    ids: Vec<i64>,
    from: Instant,
    until: Instant,
    every: Duration,
) -> Res<(u64, Duration)> {
    tokio::time::sleep_until(from).await;
    let mut before = expiries(&observer, &ids).await?;
    let first = Instant::now();
    let mut last = first;
    let mut renewals = 0u64;
    let mut at = from;
    while at < until {
        at = (at + every).min(until);
        tokio::time::sleep_until(at).await;
        let after = expiries(&observer, &ids).await?;
        last = Instant::now();
        renewals += after
            .iter()
            .filter(|(id, expires)| before.get(*id).is_some_and(|b| *expires > b))
            .count() as u64;
        before = after;
    }
    Ok((renewals, last - first))
}

async fn expiries(observer: &PgPool, ids: &[i64]) -> Res<HashMap<i64, DateTime<Utc>>> {
    let rows: Vec<(i64, DateTime<Utc>)> =
        sqlx::query_as("SELECT id, expires_at FROM pgsemaphore.slots WHERE id = ANY($1)")
            .bind(ids)
            .fetch_all(observer)
            .await?;
    Ok(rows.into_iter().collect())
}
