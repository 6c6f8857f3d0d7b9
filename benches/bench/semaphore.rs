//! Workload 1, the semaphore: fail-fast claim + release cycles, against seed 001's
//! Django slot table and seed 000's counter row.

use std::sync::Arc;

use pg_semaphore::{Error, Semaphore};
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, PgPool};

use crate::load::{Outcome, pool, run_load, unique};
use crate::report::{
    Cell, Target, fmt_int, fmt_opt, fmt_rate, fmt_rate_spread, fmt_ratio, markdown_table,
    throughput_ratios,
};
use crate::{BASELINE_SCHEMA, Ctx, POOL_SPARE, Res, Server, Settings, Workload};

pub const SEM_OURS: &str = "ours";
pub const SEM_DJANGO: &str = "seed 001 (Django slot table)";
pub const SEM_COUNTER: &str = "seed 000 (counter row)";

/// Fail-fast claim and immediate release, at 1, 8 and 32 clients, capacity 4
/// and 32, on each server; each cell 3 times, interleaved with its baselines.
pub async fn semaphore_workload(ctx: &mut Ctx) -> Res<()> {
    let mut all = Vec::new();
    let servers = ctx.servers.clone();
    let s = ctx.settings.clone();
    for clients in [1usize, 8, 32] {
        for capacity in [4u32, 32] {
            for server in &servers {
                let config =
                    json!({ "server": server.label, "clients": clients, "capacity": capacity });
                let mut reps: [Vec<Cell>; 3] = Default::default();
                for _ in 0..s.reps {
                    reps[0].push(sem_ours(server, &s, clients, capacity, config.clone()).await?);
                    reps[1].push(sem_django(server, &s, clients, capacity, config.clone()).await?);
                    reps[2].push(sem_counter(server, &s, clients, capacity, config.clone()).await?);
                }
                let mut group: Vec<Cell> =
                    reps.into_iter().map(|r| Cell::from_reps(r, &[])).collect();
                throughput_ratios(&mut group, "vs_seed001", 1);
                throughput_ratios(&mut group, "vs_counter", 2);
                all.extend(group);
            }
        }
    }

    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.implementation.clone(),
                c.config["server"].as_str().unwrap_or("").to_owned(),
                c.config["clients"].to_string(),
                c.config["capacity"].to_string(),
                fmt_rate_spread(c),
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
         cycles/s counts successful claim+release cycles (median of {} runs of {} s, and their \
         min–max); refused/s counts claims that found every slot taken. Latency is per \
         successful cycle (claim + release): p50 the median of the runs' p50s, p99 over all \
         runs. Ratios are median cycles/s divided by the baseline's on the same server in the \
         same configuration.\n",
        s.reps,
        s.cell.as_secs_f64()
    ));
    ctx.report.print(&markdown_table(
        &[
            "implementation",
            "server",
            "clients",
            "capacity",
            "cycles/s (min–max)",
            "refused/s",
            "p50 cycle",
            "p99 cycle",
            "÷ seed 001",
            "÷ counter",
            "errors",
        ],
        &rows,
    ));

    for server in &servers {
        let ours = |clients: usize| {
            all.iter().find(|c| {
                c.implementation == SEM_OURS
                    && c.config["server"] == server.label
                    && c.config["clients"] == clients
                    && c.config["capacity"] == 4
            })
        };
        let label = server.label;
        let at8 = ours(8);
        let vs_counter = at8.and_then(|c| c.ratio("vs_counter"));
        let vs_django = at8.and_then(|c| c.ratio("vs_seed001"));
        let vs_django_32 = ours(32).and_then(|c| c.ratio("vs_seed001"));
        ctx.report.targets.push(Target::at_least(
            Workload::Semaphore,
            format!("{label}: 8 clients, capacity 4: ours ≥ 0.8x counter cycles/s"),
            vs_counter,
            0.8,
            fmt_ratio(vs_counter),
        ));
        ctx.report.targets.push(Target::at_least(
            Workload::Semaphore,
            format!("{label}: 8 clients, capacity 4: ours ≥ 3x seed 001 cycles/s"),
            vs_django,
            3.0,
            fmt_ratio(vs_django),
        ));
        ctx.report.targets.push(Target::at_least(
            Workload::Semaphore,
            format!("{label}: 32 clients, capacity 4: ours ≥ 5x seed 001 cycles/s"),
            vs_django_32,
            5.0,
            fmt_ratio(vs_django_32),
        ));
    }
    ctx.report.add_cells(all);
    Ok(())
}

pub async fn sem_ours(
    server: &Server,
    s: &Settings,
    clients: usize,
    capacity: u32,
    config: Value,
) -> Res<Cell> {
    let pool = pool(&server.opts, clients as u32 + POOL_SPARE).await?;
    let sem = Semaphore::builder(format!("bench-sem-c{clients}-k{capacity}"), capacity)
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    let load = run_load(clients, s.warmup, s.cell, move |_, _| {
        let sem = sem.clone();
        async move { try_cycle(&sem).await }
    })
    .await?;
    pool.close().await;
    let cell = Cell::from_load(Workload::Semaphore, SEM_OURS, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}

/// One cycle of workload 1: claim without waiting; if a slot was free,
/// release it at once.
pub async fn try_cycle(sem: &Semaphore) -> Res<Outcome> {
    match sem.try_acquire().await {
        Ok(permit) => {
            permit.release().await?;
            Ok(Outcome::Done)
        }
        Err(Error::NoSlotsAvailable { .. }) => Ok(Outcome::Refused),
        Err(error) => Err(error.into()),
    }
}

/// The SQL of seed 001 (Django), for one table.
pub struct DjangoSql {
    pub sweep: Arc<str>,
    pub lock: Arc<str>,
    pub claim: Arc<str>,
    pub release: Arc<str>,
}

impl DjangoSql {
    pub fn new(table: &str) -> DjangoSql {
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

pub async fn sem_django(
    server: &Server,
    s: &Settings,
    clients: usize,
    capacity: u32,
    config: Value,
) -> Res<Cell> {
    let pool = pool(&server.opts, clients as u32 + POOL_SPARE).await?;
    // A fresh table per cell, as the seed's model and migration define it.
    let name = unique(&format!("django_c{clients}_k{capacity}"));
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
    let load = run_load(clients, s.warmup, s.cell, move |_, _| {
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
    })
    .await?;
    pool.close().await;
    let cell = Cell::from_load(Workload::Semaphore, SEM_DJANGO, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}

pub async fn sem_counter(
    server: &Server,
    s: &Settings,
    clients: usize,
    capacity: u32,
    config: Value,
) -> Res<Cell> {
    let pool = pool(&server.opts, clients as u32 + POOL_SPARE).await?;
    let name = unique(&format!("bench-counter-c{clients}-k{capacity}"));
    sqlx::query("INSERT INTO bench_baseline.counters (name, max, used) VALUES ($1, $2, 0)")
        .bind(&name)
        .bind(capacity as i32)
        .execute(&pool)
        .await?;
    let name: Arc<str> = name.into();
    let op_pool = pool.clone();
    let load = run_load(clients, s.warmup, s.cell, move |_, _| {
        let pool = op_pool.clone();
        let name = name.clone();
        async move { counter_cycle(&pool, &name).await }
    })
    .await?;
    pool.close().await;
    let cell = Cell::from_load(Workload::Semaphore, SEM_COUNTER, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}

/// One cycle of seed 000's counter row `name`: take a unit if one is left,
/// then give it back.
pub async fn counter_cycle(pool: &PgPool, name: &str) -> Res<Outcome> {
    let used: Option<i32> = sqlx::query_scalar(
        "UPDATE bench_baseline.counters SET used = used + 1 \
             WHERE name = $1 AND used < max RETURNING used",
    )
    .bind(name)
    .fetch_optional(pool)
    .await?;
    if used.is_none() {
        return Ok(Outcome::Refused);
    }
    sqlx::query("UPDATE bench_baseline.counters SET used = used - 1 WHERE name = $1")
        .bind(name)
        .execute(pool)
        .await?;
    Ok(Outcome::Done)
}
