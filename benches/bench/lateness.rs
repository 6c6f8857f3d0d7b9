//! Workload 13, waiting acquires: how late a waiting acquire is admitted
//! after the instant the database allows it, and what it costs, with many
//! waiters on one key (issue 24, item 1).
//!
//! For each limiter, `WAITERS` tasks (1,000; 100 with `--quick`) wait at once
//! on one key of 10 admissions per second (a token bucket of rate 10 and
//! burst 1; fixed and sliding windows of 10 per second), each doing what
//! `acquire` does, on a connection of a pool of 16: in line with the other
//! waiters (one async mutex, FIFO: only the head reserves), one call of the
//! limiter's `*_reserve` function; refused (a reservation reaches at most
//! `burst / rate`, or one window, ahead, so a deep queue is refused with the
//! instant), the head sleeps `o_wait_us` and reserves again; admitted, it
//! leaves the line and sleeps `o_wait_us` counted from the reply. The
//! lateness below is that of the admitting reservation. The instant the
//! database allows is its decision plus
//! `o_wait_us`, and the decision lies between the moment the call was sent
//! and the moment its reply came: so each admission is late by at least
//! `admitted - (reply + wait)` (this process's timer and scheduling) and at
//! most `admitted - (sent + wait)` (that plus the round trip). The table gives
//! both bounds' p50 and p99, the admissions per second over the run (the
//! key allows 10), and the round trips per admission: the calls of the
//! reserve function counted by PostgreSQL (`pg_stat_user_functions`, with
//! `track_functions = 'all'` on the bench database) over the admissions.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::{AssertSqlSafe, PgPool};

use crate::load::{pool, unique};
use crate::report::{Cell, Target, fmt_opt, fmt_rate, markdown_table, percentile};
use crate::{Ctx, Res, Server, Workload};

/// Connections the waiters share.
const CONNECTIONS: u32 = 16;

/// The limiters and their reservation, `$1` the limiter's name.
const LIMITERS: [(&str, &str, &str); 3] = [
    (
        "TokenBucket::acquire",
        "token_bucket_reserve",
        "SELECT o_allowed, o_wait_us FROM pgsemaphore.token_bucket_reserve($1, 'hot', 10, 1, 1, '366 days')",
    ),
    (
        "FixedWindow::acquire",
        "fixed_window_reserve",
        "SELECT o_allowed, o_wait_us FROM pgsemaphore.fixed_window_reserve($1, 'hot', 10, '1 s', 1, '366 days')",
    ),
    (
        "SlidingWindow::acquire",
        "sliding_window_reserve",
        "SELECT o_allowed, o_wait_us FROM pgsemaphore.sliding_window_reserve($1, 'hot', 10, '1 s', 1, '366 days')",
    ),
];

pub async fn lateness_workload(ctx: &mut Ctx) -> Res<()> {
    let waiters = if ctx.settings.quick { 100 } else { 1_000 };
    let servers = ctx.servers.clone();
    let mut rows = Vec::new();
    let mut cells = Vec::new();
    for server in &servers {
        for (implementation, function, statement) in LIMITERS {
            let cell = run(server, implementation, function, statement, waiters).await?;
            let get = |k: &str| cell.extra.get(k).and_then(|v| v.as_f64());
            let us = |k: &str| get(k).map(|us| Duration::from_secs_f64(us / 1e6));
            rows.push(vec![
                server.label.to_owned(),
                implementation.to_owned(),
                waiters.to_string(),
                fmt_opt(us("late_lo_p50_us")),
                fmt_opt(us("late_hi_p50_us")),
                fmt_opt(us("late_lo_p99_us")),
                fmt_opt(us("late_hi_p99_us")),
                fmt_rate(get("admitted_per_sec").unwrap_or(0.0)),
                format!("{:.2}", get("round_trips_per_admission").unwrap_or(0.0)),
            ]);
            let p50 = get("late_hi_p50_us").map(|us| us / 1e3);
            ctx.report.targets.push(Target::at_most(
                Workload::Lateness,
                format!(
                    "{}: {implementation}, {waiters} waiters on a key of 10/s: admitted within \
                     10 ms of the instant allowed (p50, upper bound)",
                    server.label
                ),
                p50,
                10.0,
                fmt_opt(us("late_hi_p50_us")),
            ));
            let trips = get("round_trips_per_admission");
            ctx.report.targets.push(Target::at_most(
                Workload::Lateness,
                format!(
                    "{}: {implementation}, {waiters} waiters: ≤ 2 round trips per admission",
                    server.label
                ),
                trips,
                2.0,
                format!("{:.2}", trips.unwrap_or(0.0)),
            ));
            cells.push(cell);
        }
    }
    ctx.report.print(&format!(
        "## 13. Waiting acquires: lateness and round trips\n\n\
         {waiters} waiters at once on one key of 10 per second, on {CONNECTIONS} connections, \
         in line as `acquire`'s are (only the head reserves; refused, it sleeps until the instant \
         it was told and reserves again); admitted, each sleeps until the instant the database \
         gave. Late by (the admitting reservation): at least \
         `admitted - (reply + wait)`, at most `admitted - (sent + wait)`. Round trips: the \
         reserve function's calls counted by PostgreSQL over the admissions.\n"
    ));
    ctx.report.print(&markdown_table(
        &[
            "server",
            "limiter",
            "waiters",
            "late p50 (at least)",
            "late p50 (at most)",
            "late p99 (at least)",
            "late p99 (at most)",
            "admitted/s",
            "round trips per admission",
        ],
        &rows,
    ));
    ctx.report.add_cells(cells);
    Ok(())
}

async fn run(
    server: &Server,
    implementation: &str,
    function: &str,
    statement: &'static str,
    waiters: usize,
) -> Res<Cell> {
    let admin = pool(&server.opts, 1).await?;
    let db: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&admin)
        .await?;
    sqlx::query(AssertSqlSafe(format!(
        r#"ALTER DATABASE "{db}" SET track_functions = 'all'"#
    )))
    .execute(&admin)
    .await?;
    let calls_before = calls(&admin, function).await?;
    let pool: PgPool = pool(&server.opts, CONNECTIONS).await?;
    let name: Arc<str> = unique("bench-lateness").into();
    let started = Instant::now();
    let line = Arc::new(tokio::sync::Mutex::new(()));
    let tasks: Vec<_> = (0..waiters)
        .map(|_| {
            let (pool, name, line) = (pool.clone(), name.clone(), line.clone());
            tokio::spawn(async move {
                let head = line.lock().await;
                let (sent, reply, wait) = loop {
                    let mut conn = pool.acquire().await?;
                    let sent = Instant::now();
                    let (allowed, wait_us): (bool, i64) = sqlx::query_as(statement)
                        .bind(&*name)
                        .fetch_one(&mut *conn)
                        .await?;
                    let reply = Instant::now();
                    drop(conn);
                    let wait = Duration::from_micros(wait_us.max(0) as u64);
                    if allowed {
                        break (sent, reply, wait);
                    }
                    if wait.is_zero() {
                        return Err("refused with no instant".into());
                    }
                    tokio::time::sleep(wait).await;
                };
                drop(head);
                tokio::time::sleep_until((reply + wait).into()).await;
                let admitted = Instant::now();
                Ok::<_, crate::BoxError>((
                    admitted.saturating_duration_since(reply + wait),
                    admitted.saturating_duration_since(sent + wait),
                    admitted,
                ))
            })
        })
        .collect();
    let (mut lo, mut hi) = (Vec::new(), Vec::new());
    let mut last = started;
    for task in tasks {
        let (l, h, admitted) = task.await??;
        lo.push(l);
        hi.push(h);
        last = last.max(admitted);
    }
    let elapsed = last - started;
    pool.close().await;
    // Closed backends report their function counts as they exit.
    let mut calls_after = calls_before;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        calls_after = calls(&admin, function).await?;
        if calls_after - calls_before >= waiters as i64 {
            break;
        }
    }
    admin.close().await;
    lo.sort_unstable();
    hi.sort_unstable();
    let us = |d: Option<Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e6);
    let config = json!({ "server": server.label, "waiters": waiters, "rate_per_sec": 10 });
    let mut cell = Cell::new(Workload::Lateness, implementation, config);
    cell.ops = waiters as u64;
    cell.elapsed = Some(elapsed);
    let extra = &mut cell.extra;
    extra.insert("late_lo_p50_us".into(), us(percentile(&lo, 50.0)).into());
    extra.insert("late_lo_p99_us".into(), us(percentile(&lo, 99.0)).into());
    extra.insert("late_hi_p50_us".into(), us(percentile(&hi, 50.0)).into());
    extra.insert("late_hi_p99_us".into(), us(percentile(&hi, 99.0)).into());
    extra.insert(
        "admitted_per_sec".into(),
        (waiters as f64 / elapsed.as_secs_f64().max(1e-9)).into(),
    );
    extra.insert(
        "round_trips_per_admission".into(),
        ((calls_after - calls_before) as f64 / waiters as f64).into(),
    );
    cell.samples = hi;
    Ok(cell)
}

/// The reserve function's calls so far, as PostgreSQL counts them.
async fn calls(pool: &PgPool, function: &str) -> Res<i64> {
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(pool)
        .await?;
    Ok(sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_user_functions \
         WHERE schemaname = 'pgsemaphore' AND funcname = $1",
    )
    .bind(function)
    .fetch_one(pool)
    .await?)
}
