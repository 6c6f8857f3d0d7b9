//! Workload 10, the Redis baseline: Stripe's concurrent requests limiter (seed 002),
//! what many would pick instead of a database semaphore, against ours.
//!
//! As in the seed's text, a claim is `ZREMRANGEBYSCORE key -inf (now - TTL)`
//! (clearing requests that probably got lost) and then one Lua script that
//! counts the sorted set and adds the request's id if the count is below the
//! capacity; a release is `ZREM key id`. The script runs by `EVALSHA` (the
//! redis crate's `Script`, loading it on first use), as production clients
//! do. Redis here keeps nothing on disk: no durability, no audit log.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::aio::MultiplexedConnection;
use serde_json::{Value, json};

use crate::load::{Outcome, run_load, unique};
use crate::report::{
    Cell, fmt_int, fmt_opt, fmt_rate, fmt_rate_spread, fmt_ratio, markdown_table, throughput_ratios,
};
use crate::semaphore::sem_ours;
use crate::{Ctx, Res, Settings, Workload};

/// Where the Redis is: `PGSEMAPHORE_BENCH_REDIS_URL`, else this.
pub const REDIS_URL: &str = "redis://127.0.0.1:6379/";
const REDIS_IMPL: &str = "seed 002: Redis sorted set + Lua (Stripe)";

/// The seed's `concurrent_requests_limiter.lua`, verbatim.
const SCRIPT: &str = r#"local key = KEYS[1]

local capacity = tonumber(ARGV[1])
local timestamp = tonumber(ARGV[2])
local id = ARGV[3]

local count = redis.call("zcard", key)
local allowed = count < capacity

if allowed then
  redis.call("zadd", key, timestamp, id)
end

return { allowed, count }
"#;

/// The seed's TTL: "the maximum length a request can take".
const TTL_SECS: u64 = 60;
const CAPACITY: u32 = 4;

pub async fn redis_workload(ctx: &mut Ctx) -> Res<()> {
    let url = std::env::var("PGSEMAPHORE_BENCH_REDIS_URL").unwrap_or_else(|_| REDIS_URL.into());
    let client = redis::Client::open(url.as_str())?;
    let probe = tokio::time::timeout(
        Duration::from_secs(2),
        client.get_multiplexed_async_connection(),
    )
    .await;
    if let Err(error) = probe
        .map_err(|_| "no answer within 2 s".to_owned())
        .and_then(|r| r.map_err(|e| e.to_string()))
    {
        let message =
            format!("Redis is not reachable at {url} ({error}): the Redis baseline is skipped.");
        eprintln!("  {message}");
        ctx.report
            .print(&format!("## 10. Redis baseline (seed 002)\n\n{message}\n"));
        return Ok(());
    }

    let s = ctx.settings.clone();
    let servers = ctx.servers.clone();
    let mut all = Vec::new();
    for clients in [1usize, 8, 32] {
        let mut reps: Vec<Vec<Cell>> = (0..=servers.len()).map(|_| Vec::new()).collect();
        for _ in 0..s.reps {
            for (i, server) in servers.iter().enumerate() {
                let config =
                    json!({ "server": server.label, "clients": clients, "capacity": CAPACITY });
                reps[i].push(sem_ours(server, &s, clients, CAPACITY, config).await?);
            }
            reps[servers.len()].push(redis_cell(&client, &s, clients, CAPACITY).await?);
        }
        let mut group: Vec<Cell> = reps.into_iter().map(|r| Cell::from_reps(r, &[])).collect();
        let redis_index = group.len() - 1;
        throughput_ratios(&mut group, "vs_redis", redis_index);
        all.extend(group);
    }

    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.implementation.clone(),
                c.config["server"].as_str().unwrap_or("–").to_owned(),
                c.config["clients"].to_string(),
                fmt_rate_spread(c),
                fmt_rate(c.refused_per_sec().unwrap_or(0.0)),
                fmt_opt(c.p50()),
                fmt_opt(c.p99()),
                fmt_ratio(c.ratio("vs_redis")),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 10. Redis baseline (seed 002)\n\n\
         One limiter of capacity {CAPACITY}: ours (a semaphore: try_acquire + release, on each \
         server) against Stripe's concurrent requests limiter on the Redis at {url} \
         (ZREMRANGEBYSCORE, then the seed's Lua script by EVALSHA; ZREM to release; one \
         connection per client, like a pool). cycles/s: successful claim + release cycles, \
         median of {} runs (min–max); refused: claims that found it full. Redis keeps nothing \
         on disk here and writes no audit log: the ratio is what durability and the audit \
         trail cost.\n",
        s.reps
    ));
    ctx.report.print(&markdown_table(
        &[
            "implementation",
            "server",
            "clients",
            "cycles/s (min–max)",
            "refused/s",
            "p50 cycle",
            "p99 cycle",
            "÷ Redis",
            "errors",
        ],
        &rows,
    ));
    ctx.report.add_cells(all);
    Ok(())
}

/// One cell of the Redis limiter of `capacity`.
pub async fn redis_cell(
    client: &redis::Client,
    s: &Settings,
    clients: usize,
    capacity: u32,
) -> Res<Cell> {
    let mut connections = Vec::with_capacity(clients);
    for _ in 0..clients {
        connections.push(client.get_multiplexed_async_connection().await?);
    }
    let connections: Arc<Vec<MultiplexedConnection>> = Arc::new(connections);
    let key: Arc<str> = format!(
        "pgsem-bench:concurrent_requests_limiter.{}",
        unique(&format!("c{clients}"))
    )
    .into();
    let script = Arc::new(redis::Script::new(SCRIPT));
    let load = run_load(clients, s.warmup, s.cell, {
        let key = key.clone();
        move |client, seq| {
            let mut con = connections[client].clone();
            let (key, script) = (key.clone(), script.clone());
            async move {
                let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
                let id = format!("{client}-{seq}");
                // Clear out old requests that probably got lost.
                redis::cmd("ZREMRANGEBYSCORE")
                    .arg(&*key)
                    .arg("-inf")
                    .arg(now.saturating_sub(TTL_SECS))
                    .query_async::<()>(&mut con)
                    .await?;
                let (allowed, _count): (Option<i64>, i64) = script
                    .key(&*key)
                    .arg(capacity)
                    .arg(now)
                    .arg(&id)
                    .invoke_async(&mut con)
                    .await?;
                if allowed != Some(1) {
                    return Ok(Outcome::Refused);
                }
                // post_request_bookkeeping
                redis::cmd("ZREM")
                    .arg(&*key)
                    .arg(&id)
                    .query_async::<()>(&mut con)
                    .await?;
                Ok(Outcome::Done)
            }
        }
    })
    .await?;
    let mut con = client.get_multiplexed_async_connection().await?;
    redis::cmd("DEL")
        .arg(&*key)
        .query_async::<()>(&mut con)
        .await?;
    let config = json!({ "server": Value::Null, "clients": clients, "capacity": capacity });
    let cell = Cell::from_load(Workload::Redis, REDIS_IMPL, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}
