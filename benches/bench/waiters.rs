//! Workload 4, many waiters: 1,000 tasks waiting on one held permit: connections,
//! memory, the order they are served in, the time to drain.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pg_semaphore::{Error, Semaphore};
use serde_json::{Value, json};
use sqlx::PgConnection;

use crate::load::{connect, pool, rss_bytes};
use crate::report::{
    Cell, Target, fmt_bytes, fmt_dur, fmt_int, fmt_opt, fmt_rate, markdown_table, round,
};
use crate::{Ctx, Res, Server, Workload};

/// The waiters workload's pool (sqlx's default size) and each waiter's patience.
const WAITERS_POOL: u32 = 10;
const WAITERS_PATIENCE: Duration = Duration::from_secs(60);

/// Client backends on the bench database, other than the measuring one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    pub total: i64,
    pub active: i64,
    pub idle: i64,
    pub idle_in_transaction: i64,
    pub listening: i64,
}

pub async fn activity(conn: &mut PgConnection) -> Res<Activity> {
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
pub async fn waiters_workload(ctx: &mut Ctx) -> Res<()> {
    let n = ctx.settings.waiters;
    let mut cells = Vec::new();
    let mut columns = Vec::new();
    let mut measures = Vec::new();
    for server in &ctx.servers.clone() {
        let (cell, rows, target) = waiters_on(server, n).await?;
        measures = rows.iter().map(|r| r[0].clone()).collect();
        columns.push(
            rows.into_iter()
                .map(|mut r| r.remove(1))
                .collect::<Vec<_>>(),
        );
        cells.push(cell);
        ctx.report.targets.push(target);
    }
    let rows: Vec<Vec<String>> = measures
        .iter()
        .enumerate()
        .map(|(i, measure)| {
            std::iter::once(measure.clone())
                .chain(columns.iter().map(|c| c[i].clone()))
                .collect()
        })
        .collect();
    ctx.report.print(&format!(
        "## 4. Many waiters\n\n\
         {} tasks call claim().timeout({} s).acquire() on one capacity-1 semaphore whose permit is held \
         (pool of {WAITERS_POOL}). Arrival = the order the tasks called it; \
         served = the order acquire returned. Measured once per server.\n",
        fmt_int(n as u64),
        WAITERS_PATIENCE.as_secs()
    ));
    let headers: Vec<&str> = std::iter::once("measure")
        .chain(ctx.servers.iter().map(|s| s.label))
        .collect();
    ctx.report.print(&markdown_table(&headers, &rows));
    ctx.report.add_cells(cells);
    Ok(())
}

/// One server's run: the cell, the table's (measure, value) rows, the target.
async fn waiters_on(server: &Server, n: usize) -> Res<(Cell, Vec<Vec<String>>, Target)> {
    let mut monitor = connect(&server.opts).await?;
    let before = activity(&mut monitor).await?;
    let pool = pool(&server.opts, WAITERS_POOL).await?;
    let sem = Semaphore::builder("bench-waiters", 1)
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;
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
                match sem.acquiring().timeout(WAITERS_PATIENCE).acquire().await {
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
        json!({ "server": server.label, "waiters": n, "pool_max_connections": WAITERS_POOL }),
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
    rows.push(vec!["errors".into(), errors.to_string()]);
    let target = Target::at_most(
        Workload::Waiters,
        format!(
            "{}: connections used while {} wait ≤ 2 (pool holds none)",
            server.label,
            fmt_int(n as u64)
        ),
        Some(used as f64),
        2.0,
        format!("{used} (pool in use {pool_in_use}, outside the pool {outside_pool})"),
    );
    Ok((cell, rows, target))
}
