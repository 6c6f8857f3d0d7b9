//! Workload 13, several limits per check: one `LimiterSet` of three limits
//! (a token bucket, a fixed window and a sliding window on the same key)
//! against a single token bucket's check, in the same run. Target (issue 24):
//! the multi-limit check costs at most 1.5x a single check.

use std::sync::Arc;
use std::time::Duration;

use pg_semaphore::{LimiterSet, RateLimiter, RatePolicy};
use serde_json::{Value, json};

use crate::load::{Outcome, pool, run_load, splitmix64};
use crate::mutex::Keys;
use crate::rate::rate_key;
use crate::report::{
    Cell, Target, fmt_int, fmt_opt, fmt_rate_spread, fmt_ratio, markdown_table, throughput_ratios,
};
use crate::{Ctx, POOL_SPARE, Res, Server, Settings, Workload};

/// Each limit's permits per second per key: high enough that most
/// decisions on spread keys are admitted (an admitted multi-check charges
/// all three rows, the costlier case).
const LIMIT: u32 = 1_000;

pub const LIMITS_SINGLE: &str = "ours: TokenBucket check (baseline)";
pub const LIMITS_MULTI: &str = "ours: LimiterSet of 3 (bucket + fixed + sliding)";

/// What a cell calls.
enum Op {
    Single(RateLimiter),
    Multi(LimiterSet),
}

/// Single and multi-limit checks at 1 and 8 clients, on one hot key or
/// spread over 1,000 keys, repetitions interleaved.
pub async fn limits_workload(ctx: &mut Ctx) -> Res<()> {
    let servers = ctx.servers.clone();
    let s = ctx.settings.clone();
    let mut all = Vec::new();
    let mut worst: Option<(f64, String)> = None;
    for clients in [1usize, 8] {
        for keys in [Keys::Spread, Keys::Hot] {
            for server in &servers {
                let config =
                    json!({ "server": server.label, "clients": clients, "keys": keys.label() });
                let mut reps: [Vec<Cell>; 2] = Default::default();
                for rep in 0..s.reps {
                    for (i, implementation) in [LIMITS_SINGLE, LIMITS_MULTI].into_iter().enumerate()
                    {
                        let salt =
                            splitmix64((clients as u64) << 16 | (rep as u64) << 8 | i as u64);
                        reps[i].push(
                            limits_cell(
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
                throughput_ratios(&mut group, "vs_single", 0);
                let cost = group[1]
                    .ratio("vs_single")
                    .filter(|r| *r > 0.0)
                    .map(|r| 1.0 / r);
                let label = format!("{}, {clients} clients, {} key", server.label, keys.label());
                if let Some(cost) = cost
                    && worst.as_ref().is_none_or(|(w, _)| cost > *w)
                {
                    worst = Some((cost, label));
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
                fmt_ratio(c.ratio("vs_single")),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 13. Several limits per check\n\n\
         Each client loops: one decision of one permit. The baseline is one \
         token bucket's `RateLimiter::check`; the set checks a token bucket, a fixed window and a sliding \
         window on the same key in one `pgsemaphore.check_limits` call (all or none). Each \
         limit allows {} per second per key. hot = one key; spread = a random key out of \
         1,000. Ratios are decisions/s divided by the single check's on the same server in \
         the same configuration; decisions/s is the median of {} runs (min–max).\n",
        fmt_int(u64::from(LIMIT)),
        s.reps,
    ));
    ctx.report.print(&markdown_table(
        &[
            "implementation",
            "server",
            "clients",
            "keys",
            "decisions/s (min–max)",
            "p50 decision",
            "p99 decision",
            "÷ single",
            "errors",
        ],
        &rows,
    ));
    let (cost, at) = worst.map_or((None, String::new()), |(c, at)| (Some(c), at));
    ctx.report.targets.push(Target::at_most(
        Workload::Limits,
        format!(
            "a check of 3 limits costs ≤ 1.5x a single check (time per decision), at each of the {} configurations",
            4 * servers.len()
        ),
        cost,
        1.5,
        format!("worst {:.2}x ({at})", cost.unwrap_or(0.0)),
    ));
    ctx.report.add_cells(all);
    Ok(())
}

async fn limits_cell(
    server: &Server,
    s: &Settings,
    implementation: &'static str,
    clients: usize,
    keys: Keys,
    salt: u64,
    config: Value,
) -> Res<Cell> {
    let pool = pool(&server.opts, clients as u32 + POOL_SPARE).await?;
    // Limiter names per cell: no cell starts with another's state.
    let name = format!("bench-limits-c{clients}-{}-{salt:x}", keys.label());
    let bucket = RateLimiter::builder(
        format!("{name}-bucket"),
        RatePolicy::token_bucket(f64::from(LIMIT), LIMIT),
    )
    .build(&pg_semaphore::Client::new(pool.clone()))?;
    let op = Arc::new(if implementation == LIMITS_SINGLE {
        Op::Single(bucket)
    } else {
        let window = Duration::from_secs(1);
        let fixed = RateLimiter::builder(
            format!("{name}-fixed"),
            RatePolicy::fixed_window(LIMIT, window),
        )
        .build(&pg_semaphore::Client::new(pool.clone()))?;
        let sliding = RateLimiter::builder(
            format!("{name}-sliding"),
            RatePolicy::sliding_window(LIMIT, window),
        )
        .build(&pg_semaphore::Client::new(pool.clone()))?;
        Op::Multi(LimiterSet::new().with(&bucket).with(&fixed).with(&sliding))
    });
    let load = run_load(clients, s.warmup, s.cell, move |client, seq| {
        let op = op.clone();
        async move {
            let key = rate_key(keys, salt, client, seq);
            let _decided = match &*op {
                Op::Single(limiter) => limiter.check(&key, 1).await?,
                Op::Multi(set) => set.check(&key, 1).await?,
            };
            Ok(Outcome::Done)
        }
    })
    .await?;
    pool.close().await;
    let cell = Cell::from_load(Workload::Limits, implementation, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}
