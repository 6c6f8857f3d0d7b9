//! Workload 6, rate limiters: decisions of the token bucket, the fixed and the
//! sliding window, against a bare single-row `UPDATE`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pg_semaphore::{FixedWindow, SlidingWindow, TokenBucket};
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, PgPool};

use crate::load::{Outcome, pool, run_load, splitmix64};
use crate::mutex::Keys;
use crate::report::{
    Cell, Target, fmt_int, fmt_opt, fmt_rate, fmt_rate_spread, fmt_ratio, markdown_table,
    throughput_ratios,
};
use crate::{BASELINE_SCHEMA, Ctx, POOL_SPARE, Res, Server, Settings, Workload};

/// The rate workload's keys ("per user") and each limiter's limit per second.
const RATE_KEYS: u64 = 1_000;
const RATE_LIMIT: u32 = 1_000;

pub const RATE_UPDATE: &str = "bare UPDATE counter row (baseline)";
pub const RATE_BUCKET: &str = "ours: TokenBucket";
pub const RATE_FIXED: &str = "ours: FixedWindow";
pub const RATE_SLIDING: &str = "ours: SlidingWindow";
pub const RATE_LIMITERS: [&str; 3] = [RATE_BUCKET, RATE_FIXED, RATE_SLIDING];

/// What a rate cell calls: the baseline statement or one of our limiters.
#[derive(Debug)]
pub enum RateOp {
    Update(PgPool),
    Bucket(TokenBucket),
    Fixed(FixedWindow),
    Sliding(SlidingWindow),
}

impl RateOp {
    /// One decision; `true` when admitted (the baseline always counts).
    pub async fn decide(&self, key: &str) -> Res<bool> {
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
pub fn rate_key(keys: Keys, salt: u64, client: usize, seq: u64) -> String {
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
pub async fn rate_workload(ctx: &mut Ctx) -> Res<()> {
    for server in &ctx.servers {
        let pool = pool(&server.opts, 2).await?;
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
    let servers = ctx.servers.clone();
    let s = ctx.settings.clone();
    for clients in [1usize, 8] {
        for keys in [Keys::Hot, Keys::Spread] {
            for server in &servers {
                let config =
                    json!({ "server": server.label, "clients": clients, "keys": keys.label() });
                let mut reps: [Vec<Cell>; 4] = Default::default();
                for rep in 0..s.reps {
                    for (i, implementation) in std::iter::once(RATE_UPDATE)
                        .chain(RATE_LIMITERS)
                        .enumerate()
                    {
                        let salt =
                            splitmix64((clients as u64) << 16 | (rep as u64) << 8 | i as u64);
                        reps[i].push(
                            rate_cell(
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
                let mut group: Vec<Cell> = reps
                    .into_iter()
                    .map(|r| Cell::from_reps(r, &["admitted"]))
                    .collect();
                throughput_ratios(&mut group, "vs_update", 0);
                let label = format!("{}, {clients} clients, {} key", server.label, keys.label());
                for (slot, cell) in worst.iter_mut().zip(&group[1..]) {
                    let ratio = cell.ratio("vs_update").unwrap_or(0.0);
                    if slot.as_ref().is_none_or(|(w, _)| ratio < *w) {
                        *slot = Some((ratio, label.clone()));
                    }
                }
                all.extend(group);
            }
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
                c.config["server"].as_str().unwrap_or("").to_owned(),
                c.config["clients"].to_string(),
                c.config["keys"].as_str().unwrap_or("").to_owned(),
                fmt_rate_spread(c),
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
         divided by the baseline's on the same server in the same configuration; decisions/s \
         is the median of {} runs (min–max).\n",
        fmt_int(RATE_KEYS),
        fmt_int(u64::from(RATE_LIMIT)),
        fmt_int(u64::from(RATE_LIMIT)),
        fmt_int(u64::from(RATE_LIMIT)),
        fmt_int(u64::from(RATE_LIMIT)),
        s.reps,
    ));
    ctx.report.print(&markdown_table(
        &[
            "implementation",
            "server",
            "clients",
            "keys",
            "decisions/s (min–max)",
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
            format!(
                "{implementation} ≥ 0.5x the bare UPDATE, at each of the {} configurations",
                4 * servers.len()
            ),
            Some(ratio),
            0.5,
            format!("worst {ratio:.2}x ({at})"),
        ));
    }
    ctx.report.add_cells(all);
    Ok(())
}

pub async fn rate_cell(
    server: &Server,
    s: &Settings,
    implementation: &'static str,
    clients: usize,
    keys: Keys,
    salt: u64,
    config: Value,
) -> Res<Cell> {
    let pool = pool(&server.opts, clients as u32 + POOL_SPARE).await?;
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
    let from = Instant::now() + s.warmup;
    let counter = admitted.clone();
    let load = run_load(clients, s.warmup, s.cell, move |client, seq| {
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
    })
    .await?;
    pool.close().await;
    let mut cell = Cell::from_load(Workload::Rate, implementation, config, load);
    cell.extra
        .insert("admitted".into(), admitted.load(Ordering::Relaxed).into());
    eprintln!("{}", cell.progress());
    Ok(cell)
}
