//! Workload 13, semaphore families: does a claim on a key of a family cost
//! what a claim on a named semaphore costs, with 10, 10,000 and 1,000,000
//! keys in the table? Fail-fast claim + immediate release cycles at 8
//! clients, capacity 4 per key, each cell 3 times interleaved with its
//! baseline:
//!
//! - **named**: 100 named semaphores, each client picks one at random per
//!   cycle (the baseline);
//! - **family, hot keys**: 100 keys of a family, picked the same way, with
//!   N keys of that family in the table (each process's handle of a key is
//!   cached: one round trip per claim);
//! - **family, random key**: a key drawn from all N per cycle, so that a
//!   process meets keys it has not opened yet (one more round trip for
//!   those, and its handle cache of 10,000 keys forgets them all when full).
//!
//! The keys are written straight into the table (as the owner, the rows
//! `open_family_key` would create), growing from one size to the next in
//! one database; the named baseline runs beside each size.

use pg_semaphore::{Error, Semaphore, SemaphoreFamily};
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, PgPool};

use crate::load::{Outcome, pool, run_load, splitmix64};
use crate::report::{
    Cell, fmt_int, fmt_opt, fmt_rate_spread, fmt_ratio, markdown_table, throughput_ratios,
};
use crate::{Ctx, POOL_SPARE, Res, Settings, Workload};

const NAMED: &str = "named (100 semaphores)";
const HOT: &str = "family, hot keys (100 of N)";
const RANDOM: &str = "family, random key (of N)";
const CLIENTS: usize = 8;
const CAPACITY: u32 = 4;
const HOT_KEYS: u64 = 100;
const FAMILY: &str = "bench-family";

pub async fn family_workload(ctx: &mut Ctx) -> Res<()> {
    let s = ctx.settings.clone();
    let sizes: &[u64] = if s.quick {
        &[10, 1_000, 10_000]
    } else {
        &[10, 10_000, 1_000_000]
    };
    let mut all = Vec::new();
    for server in &ctx.servers.clone() {
        let pool = pool(&server.opts, CLIENTS as u32 + POOL_SPARE).await?;
        let family = SemaphoreFamily::builder(FAMILY, CAPACITY)
            .build(&pg_semaphore::Client::new(pool.clone()))
            .await?;
        let mut named = Vec::new();
        for i in 0..HOT_KEYS {
            named.push(
                Semaphore::builder(format!("bench-named-{i}"), CAPACITY)
                    .build(&pg_semaphore::Client::new(pool.clone()))
                    .await?,
            );
        }
        for &keys in sizes {
            populate(&pool, keys).await?;
            let config = json!({ "server": server.label, "keys": keys, "clients": CLIENTS });
            let mut reps: [Vec<Cell>; 3] = Default::default();
            for _ in 0..s.reps {
                reps[0].push(named_cell(&s, &named, config.clone()).await?);
                reps[1]
                    .push(family_cell(&s, &family, HOT_KEYS.min(keys), HOT, config.clone()).await?);
                reps[2].push(family_cell(&s, &family, keys, RANDOM, config.clone()).await?);
            }
            let mut group: Vec<Cell> = reps.into_iter().map(|r| Cell::from_reps(r, &[])).collect();
            throughput_ratios(&mut group, "vs_named", 0);
            all.extend(group);
        }
        pool.close().await;
    }
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.implementation.clone(),
                c.config["server"].as_str().unwrap_or("").to_owned(),
                fmt_int(c.config["keys"].as_u64().unwrap_or(0)),
                fmt_rate_spread(c),
                fmt_opt(c.p50()),
                fmt_opt(c.p99()),
                fmt_ratio(c.ratio("vs_named")),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 13. Semaphore families: a claim on a key against a named claim\n\n\
         {CLIENTS} clients loop: try_acquire on a key (or a named semaphore) picked at random, \
         release at once; capacity {CAPACITY} per key. cycles/s counts claim+release cycles \
         (median of {} runs of {} s, and their min–max); \"÷ named\" is the median divided by \
         the named semaphores' in the same run with the same table. N keys of the family are in \
         `pgsemaphore.semaphores` throughout.\n",
        s.reps,
        s.cell.as_secs_f64()
    ));
    ctx.report.print(&markdown_table(
        &[
            "implementation",
            "server",
            "keys (N)",
            "cycles/s (min–max)",
            "p50 cycle",
            "p99 cycle",
            "÷ named",
            "errors",
        ],
        &rows,
    ));
    ctx.report.add_cells(all);
    Ok(())
}

/// Makes keys `k0` .. `k{keys-1}` of the family exist (the rows a first use
/// creates), in batches, then lets the planner know the table's new size.
async fn populate(pool: &PgPool, keys: u64) -> Res<()> {
    let have: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.semaphores WHERE family = $1")
            .bind(FAMILY)
            .fetch_one(pool)
            .await?;
    let mut from = have.max(0) as u64;
    eprintln!("  families: {from} -> {keys} keys");
    while from < keys {
        let to = (from + 2_000).min(keys); // the insert trigger takes an advisory lock per row
        sqlx::query(
            "INSERT INTO pgsemaphore.semaphores (name, capacity, default_lease, family, family_key) \
             SELECT '@' || $1 || '/k' || g, $2, '90 s', $1, 'k' || g \
               FROM generate_series($3::bigint, $4::bigint - 1) g \
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(FAMILY)
        .bind(CAPACITY as i32)
        .bind(from as i64)
        .bind(to as i64)
        .execute(pool)
        .await?;
        from = to;
    }
    sqlx::raw_sql(AssertSqlSafe(
        "VACUUM ANALYZE pgsemaphore.semaphores".to_owned(),
    ))
    .execute(pool)
    .await?;
    Ok(())
}

async fn named_cell(s: &Settings, named: &[Semaphore], config: Value) -> Res<Cell> {
    let named = named.to_vec();
    let load = run_load(CLIENTS, s.warmup, s.cell, move |client, seq| {
        let sem =
            named[(splitmix64((client as u64) << 32 | seq) % named.len() as u64) as usize].clone();
        async move { cycle(sem.try_acquire().await).await }
    })
    .await?;
    let cell = Cell::from_load(Workload::Family, NAMED, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}

async fn family_cell(
    s: &Settings,
    family: &SemaphoreFamily,
    keys: u64,
    implementation: &str,
    config: Value,
) -> Res<Cell> {
    let family = family.clone();
    let load = run_load(CLIENTS, s.warmup, s.cell, move |client, seq| {
        let family = family.clone();
        let key = format!("k{}", splitmix64((client as u64) << 32 | seq) % keys);
        async move { cycle(family.try_acquire(&key).await).await }
    })
    .await?;
    let cell = Cell::from_load(Workload::Family, implementation, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}

async fn cycle(claimed: Result<pg_semaphore::Permit, Error>) -> Res<Outcome> {
    match claimed {
        Ok(permit) => {
            permit.release().await?;
            Ok(Outcome::Done)
        }
        Err(Error::NoSlotsAvailable { .. }) => Ok(Outcome::Refused),
        Err(error) => Err(error.into()),
    }
}
