//! Workload 2, the mutex: lock + unlock, against a raw `pg_advisory_xact_lock` loop
//! and sqlx's `PgAdvisoryLock`.

use pg_semaphore::{Mutex, PgAdvisoryLockKey};
use serde_json::{Value, json};
use sqlx::postgres::PgAdvisoryLock;

use crate::load::{Outcome, pool, run_load, splitmix64};
use crate::report::{
    Cell, Target, fmt_int, fmt_opt, fmt_rate_spread, fmt_ratio, markdown_table, throughput_ratios,
};
use crate::{Ctx, POOL_SPARE, Res, Server, Settings, Workload};

/// The mutex workload's hot key, and the range its spread keys are drawn from.
const HOT_KEY: i64 = 4_242;
const SPREAD_BASE: i64 = 1_000_000;
const SPREAD_KEYS: u64 = 100_000;

pub const MUTEX_OURS: &str = "ours (Mutex::lock + commit)";
pub const MUTEX_RAW: &str = "raw pg_advisory_xact_lock loop";
pub const MUTEX_SQLX: &str = "sqlx PgAdvisoryLock";

#[derive(Debug, Clone, Copy)]
pub enum Keys {
    Hot,
    Spread,
}

impl Keys {
    pub fn label(self) -> &'static str {
        match self {
            Keys::Hot => "hot",
            Keys::Spread => "spread",
        }
    }

    /// The key for a client's `seq`-th operation.
    pub fn key(self, salt: u64, client: usize, seq: u64) -> i64 {
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
pub async fn mutex_workload(ctx: &mut Ctx) -> Res<()> {
    let mut all = Vec::new();
    let mut worst_raw: Option<(f64, String)> = None;
    let mut worst_sqlx: Option<(f64, String)> = None;
    let mut all_raw = true;
    let mut all_sqlx = true;
    let servers = ctx.servers.clone();
    let s = ctx.settings.clone();
    let implementations = [MUTEX_OURS, MUTEX_RAW, MUTEX_SQLX];
    for clients in [1usize, 8] {
        for keys in [Keys::Hot, Keys::Spread] {
            for server in &servers {
                let config =
                    json!({ "server": server.label, "clients": clients, "keys": keys.label() });
                let mut reps: [Vec<Cell>; 3] = Default::default();
                for rep in 0..s.reps {
                    for (i, implementation) in implementations.into_iter().enumerate() {
                        let salt =
                            splitmix64((clients as u64) << 16 | (rep as u64) << 8 | i as u64);
                        reps[i].push(
                            mutex_cell(
                                server,
                                &s,
                                implementation,
                                clients,
                                keys,
                                salt,
                                config.clone(),
                            )
                            .await?,
                        );
                    }
                }
                let mut group: Vec<Cell> =
                    reps.into_iter().map(|r| Cell::from_reps(r, &[])).collect();
                throughput_ratios(&mut group, "vs_raw_loop", 1);
                throughput_ratios(&mut group, "vs_sqlx", 2);
                let label = format!("{}, {clients} clients, {} key", server.label, keys.label());
                let raw = group[0].ratio("vs_raw_loop");
                let sqlx = group[0].ratio("vs_sqlx");
                all_raw &= raw.is_some_and(|r| r >= 0.9);
                all_sqlx &= sqlx.is_some_and(|r| r >= 0.9);
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
    }

    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.implementation.clone(),
                c.config["server"].as_str().unwrap_or("").to_owned(),
                c.config["clients"].to_string(),
                c.config["keys"].as_str().unwrap_or("").to_owned(),
                fmt_rate_spread(c),
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
         {}. locks/s: the median of {} runs and their min–max. Ratios are median locks/s \
         divided by the baseline's on the same server in the same configuration.\n",
        fmt_int(SPREAD_KEYS),
        s.reps
    ));
    ctx.report.print(&markdown_table(
        &[
            "implementation",
            "server",
            "clients",
            "keys",
            "locks/s (min–max)",
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
        target: format!(
            "ours ≥ 0.9x the raw loop, at each of the {} configurations",
            4 * servers.len()
        ),
        measured: format!("worst {raw:.2}x ({raw_at})"),
        value: Some(raw),
        threshold: 0.9,
        pass: all_raw,
    });
    ctx.report.targets.push(Target {
        workload: Workload::Mutex.name(),
        target: format!(
            "ours ≥ 0.9x sqlx PgAdvisoryLock, at each of the {} configurations",
            4 * servers.len()
        ),
        measured: format!("worst {sqlx:.2}x ({sqlx_at})"),
        value: Some(sqlx),
        threshold: 0.9,
        pass: all_sqlx,
    });
    ctx.report.add_cells(all);
    Ok(())
}

pub async fn mutex_cell(
    server: &Server,
    s: &Settings,
    implementation: &'static str,
    clients: usize,
    keys: Keys,
    salt: u64,
    config: Value,
) -> Res<Cell> {
    let pool = pool(&server.opts, clients as u32 + POOL_SPARE).await?;
    let (warmup, window) = (s.warmup, s.cell);
    let op_pool = pool.clone();
    let load = match implementation {
        MUTEX_OURS => {
            let ours = pg_semaphore::Client::new(pool.clone());
            run_load(clients, warmup, window, move |client, seq| {
                let ours = ours.clone();
                async move {
                    let key = keys.key(salt, client, seq);
                    let guard = Mutex::with_key(key).lock(&ours).await?;
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
