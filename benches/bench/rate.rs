//! Workload 6, rate limiters: decisions of the token bucket, the fixed and the
//! sliding window, against a bare single-row `UPDATE`, at 1, 8 and 32
//! clients, on one hot key and on keys spread over 1,000 (issue 24: every
//! limiter ≥ 0.5x the `UPDATE` in each of these cells, on both servers; issue
//! 35 raised it to 0.6x).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pg_semaphore::{RateLimiter, RatePolicy};
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
/// The numbers of clients each configuration is measured at.
const RATE_CLIENTS: [usize; 3] = [1, 8, 32];

pub const RATE_UPDATE: &str = "bare UPDATE counter row (baseline)";
pub const RATE_BUCKET: &str = "ours: TokenBucket";
pub const RATE_FIXED: &str = "ours: FixedWindow";
pub const RATE_SLIDING: &str = "ours: SlidingWindow";
pub const RATE_LIMITERS: [&str; 3] = [RATE_BUCKET, RATE_FIXED, RATE_SLIDING];
/// Every row of a configuration, in the order each repetition runs them:
/// the baseline first (the ratios' denominator), then the limiters.
const RATE_ROWS: [&str; 4] = [RATE_UPDATE, RATE_BUCKET, RATE_FIXED, RATE_SLIDING];

/// What a rate cell calls: the baseline statement or one of our limiters.
#[derive(Debug)]
pub enum RateOp {
    Update(PgPool),
    Bucket(RateLimiter),
    Fixed(RateLimiter),
    Sliding(RateLimiter),
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

/// Decisions at 1, 8 and 32 clients, on one hot key or spread over 1,000
/// keys, each limiter against a bare
/// `UPDATE ... SET n = n + 1 WHERE key = $1`, interleaved repetition by
/// repetition; a target per limiter and cell.
pub async fn rate_workload(ctx: &mut Ctx) -> Res<()> {
    let most = RATE_CLIENTS.into_iter().max().unwrap_or(1) as u32 + POOL_SPARE;
    for server in &ctx.servers {
        let pool = pool(&server.opts, 2).await?;
        enough_connections(&pool, server, most).await?;
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
    let mut targets = Vec::new();
    let servers = ctx.servers.clone();
    let s = ctx.settings.clone();
    for clients in RATE_CLIENTS {
        for keys in [Keys::Hot, Keys::Spread] {
            for server in &servers {
                let config =
                    json!({ "server": server.label, "clients": clients, "keys": keys.label() });
                let mut reps: [Vec<Cell>; RATE_ROWS.len()] = Default::default();
                for rep in 0..s.reps {
                    for (i, implementation) in RATE_ROWS.into_iter().enumerate() {
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
                let base = group[0].ops_per_sec().unwrap_or(0.0);
                let label = format!(
                    "{}, {clients} client{}, {}",
                    server.label,
                    if clients == 1 { "" } else { "s" },
                    match keys {
                        Keys::Hot => "hot key",
                        Keys::Spread => "spread keys",
                    }
                );
                for cell in &group[1..=RATE_LIMITERS.len()] {
                    let ratio = cell.ratio("vs_update");
                    targets.push(Target::at_least(
                        Workload::Rate,
                        format!("{label}: {} ≥ 0.6x the bare UPDATE", cell.implementation),
                        ratio,
                        0.6,
                        format!(
                            "{} ({} vs {} decisions/s)",
                            fmt_ratio(ratio),
                            fmt_rate(cell.ops_per_sec().unwrap_or(0.0)),
                            fmt_rate(base),
                        ),
                    ));
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
    let clients = match RATE_CLIENTS.map(|c| c.to_string()).split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    };
    ctx.report.print(&format!(
        "## 6. Rate limiters: decisions\n\n\
         Each client loops: one check of one permit (a decision, admitted or refused; \
         both update the key's row), at {clients} clients. hot = every decision on one key; \
         spread = each on a random key out of {} (created on first use, mostly during the \
         warm-up). Each limiter allows {} per second per key (token bucket: rate and burst \
         {}; windows: {} per 1 s). The baseline is one prepared `UPDATE ... SET n = n + 1 \
         WHERE key = $1` on a table of the same keys: the least a database counter can do. \
         admitted/s shows the limits holding on the hot key: about {} per second, plus what \
         the bucket or window had left when the measurement began. Ratios are decisions/s \
         divided by the baseline's on the same server in the same configuration; decisions/s \
         is the median of {} runs (min–max), the rows of a configuration taking turns within \
         each run.\n",
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
    ctx.report.targets.extend(targets);
    ctx.report.add_cells(all);
    Ok(())
}

/// Fails early, before any cell, when the server cannot take `needed`
/// more connections (the largest cell's pool): the throwaway servers allow
/// 400; a `DATABASE_URL` server may allow fewer, or be busy.
async fn enough_connections(pool: &PgPool, server: &Server, needed: u32) -> Res<()> {
    let (max, free): (i32, i32) = sqlx::query_as(
        "SELECT current_setting('max_connections')::int, \
                current_setting('max_connections')::int \
                - current_setting('superuser_reserved_connections')::int \
                - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int",
    )
    .fetch_one(pool)
    .await?;
    if free < needed as i32 {
        return Err(format!(
            "the rate workload needs {needed} connections at once on the {} server, which has \
             max_connections={max} and {free} free: raise max_connections",
            server.label
        )
        .into());
    }
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
            RateLimiter::builder(
                name,
                RatePolicy::token_bucket(f64::from(RATE_LIMIT), RATE_LIMIT),
            )
            .build(&pg_semaphore::Client::new(pool.clone()))?,
        ),
        RATE_FIXED => RateOp::Fixed(
            RateLimiter::builder(name, RatePolicy::fixed_window(RATE_LIMIT, window))
                .build(&pg_semaphore::Client::new(pool.clone()))?,
        ),
        RATE_SLIDING => RateOp::Sliding(
            RateLimiter::builder(name, RatePolicy::sliding_window(RATE_LIMIT, window))
                .build(&pg_semaphore::Client::new(pool.clone()))?,
        ),
        other => return Err(format!("no rate row {other:?}").into()),
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
