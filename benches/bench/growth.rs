//! Workload 5, growth of the slot table: a million cycles without and with a
//! retention reaper, and the table's size as they go.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pg_semaphore::{Error, Semaphore, admin::Reaper};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};

use crate::load::{connect, create_database, drop_database, pool};
use crate::report::{
    Cell, Target, fmt_bytes, fmt_dur, fmt_int, fmt_opt, fmt_rate, fmt_ratio, markdown_table, round,
    throughput_ratios,
};
use crate::{Ctx, POOL_SPARE, Res, Server, Workload};

/// The growth workload's shape and its retention reaper.
const GROWTH_CLIENTS: usize = 8;
const GROWTH_CAPACITY: u32 = 4;
const REAPER_INTERVAL: Duration = Duration::from_secs(1);
const REAPER_RETENTION: Duration = Duration::from_secs(2);

/// A million cycles without and with a retention reaper; the slot table's size.
pub async fn growth_workload(ctx: &mut Ctx) -> Res<()> {
    let mut cells = Vec::new();
    for server in &ctx.servers.clone() {
        let plain = growth_run(ctx, server, false).await?;
        let retention = growth_run(ctx, server, true).await?;
        let mut pair = vec![plain, retention];
        throughput_ratios(&mut pair, "vs_no_retention", 0);
        cells.extend(pair);
    }
    let checkpoint = ctx.settings.growth_checkpoint();

    let size = |c: &Cell, key: &str| c.extra.get(key).and_then(Value::as_f64);
    let rows: Vec<Vec<String>> = cells
        .iter()
        .map(|c| {
            let first = size(c, "size_first_checkpoint_bytes");
            let end = size(c, "size_end_bytes");
            vec![
                c.implementation.clone(),
                c.config["server"].as_str().unwrap_or("").to_owned(),
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
         each run once per server, in a fresh database. Size = pg_total_relation_size('pgsemaphore.slots') \
         (table + indexes + TOAST). Retention run: Reaper::builder().interval({}).retention({}).\n",
        fmt_int(ctx.settings.growth_cycles),
        fmt_dur(REAPER_INTERVAL),
        fmt_dur(REAPER_RETENTION)
    ));
    ctx.report.print(&markdown_table(
        &[
            "run",
            "server",
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
                    cell.config["server"].as_str().unwrap_or("").to_owned(),
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
            "server",
            "cycles",
            "elapsed",
            "size",
            "~live tuples",
            "~dead tuples",
            "autovacuums",
        ],
        &progress_rows,
    ));

    for pair in cells.chunks(2) {
        let [without, with] = pair else { continue };
        // The reference: the first checkpoint by which retention was in force
        // (a whole retention plus a reaper interval since the start). In a
        // full run that is the first checkpoint; in a --quick one, later.
        let in_force = (REAPER_RETENTION + REAPER_INTERVAL).as_secs_f64();
        let reference = with.extra.get("checkpoints").and_then(|points| {
            points
                .as_array()?
                .iter()
                .find(|p| p["elapsed_s"].as_f64().is_some_and(|e| e >= in_force))
                .cloned()
        });
        let first = reference.as_ref().and_then(|p| p["bytes"].as_f64());
        let at = reference
            .as_ref()
            .and_then(|p| p["cycles"].as_u64())
            .unwrap_or(checkpoint);
        let end = size(with, "size_end_bytes");
        let ratio = end.zip(first).map(|(e, f)| e / f);
        ctx.report.targets.push(Target::at_most(
            Workload::Growth,
            format!(
                "{}: with retention: size after {} ≤ 2x size after {} (the first checkpoint \
                 with retention in force)",
                with.config["server"].as_str().unwrap_or(""),
                fmt_int(ctx.settings.growth_cycles),
                fmt_int(at)
            ),
            ratio,
            2.0,
            format!(
                "{} ({} → {}; without retention {} → {} from {})",
                fmt_ratio(ratio),
                first.map_or_else(|| "–".into(), fmt_bytes),
                end.map_or_else(|| "–".into(), fmt_bytes),
                size(without, "size_first_checkpoint_bytes").map_or_else(|| "–".into(), fmt_bytes),
                size(without, "size_end_bytes").map_or_else(|| "–".into(), fmt_bytes),
                fmt_int(checkpoint),
            ),
        ));
    }
    ctx.report.add_cells(cells);
    Ok(())
}

/// The statistics collector's view of `pgsemaphore.slots`: live and dead
/// tuples (estimates, flushed about once a second) and autovacuum runs.
pub async fn slots_stats(conn: &mut PgConnection) -> Res<(i64, i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT coalesce(n_live_tup, 0), coalesce(n_dead_tup, 0), coalesce(autovacuum_count, 0) \
         FROM pg_stat_user_tables WHERE relid = 'pgsemaphore.slots'::regclass",
    )
    .fetch_one(conn)
    .await?)
}

pub async fn slots_size(conn: &mut PgConnection) -> Res<i64> {
    Ok(
        sqlx::query_scalar("SELECT pg_total_relation_size('pgsemaphore.slots')")
            .fetch_one(conn)
            .await?,
    )
}

pub async fn growth_run(ctx: &mut Ctx, server: &Server, retention: bool) -> Res<Cell> {
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
    ctx.extra_dbs.push((server.admin.clone(), db.clone()));
    create_database(&server.admin, &db).await?;
    let opts = server.admin.clone().database(&db);
    let pool = pool(&opts, GROWTH_CLIENTS as u32 + POOL_SPARE).await?;
    pg_semaphore::migrate(&pool).await?;
    let sem = Semaphore::builder("bench-growth", GROWTH_CAPACITY)
        .build(&pg_semaphore::Client::new(pool.clone()))
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
    drop_database(&server.admin, &db).await?;
    ctx.extra_dbs.retain(|(_, d)| d != &db);

    let mut cell = Cell::new(
        Workload::Growth,
        label,
        json!({
            "server": server.label,
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
