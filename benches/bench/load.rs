//! Load generation and databases: the closed loop every throughput cell
//! runs, pools, connections, and the bench's databases.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

use crate::Res;

#[derive(Debug, Clone, Copy)]
pub enum Outcome {
    /// The operation succeeded (a cycle, a lock).
    Done,
    /// A fail-fast claim found no free slot.
    Refused,
}

/// What a closed-loop load measured.
#[derive(Debug, Default)]
pub struct Load {
    pub samples: Vec<Duration>,
    pub refused: u64,
    pub errors: u64,
    pub elapsed: Duration,
    pub first_error: Option<String>,
}

/// Runs `op` in a closed loop on `clients` tasks: a warm-up, then a measured
/// window. Operations that *start* in the window are measured; the window
/// ends when the last of them finishes. `op` gets the client's index and its
/// operation sequence number.
pub async fn run_load<F, Fut>(
    clients: usize,
    warmup: Duration,
    window: Duration,
    op: F,
) -> Res<Load>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Res<Outcome>> + Send + 'static,
{
    let op = Arc::new(op);
    let from = Instant::now() + warmup;
    let until = from + window;
    let tasks: Vec<_> = (0..clients)
        .map(|client| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut load = Load::default();
                let mut last_end = from;
                for seq in 0u64.. {
                    let began = Instant::now();
                    if began >= until {
                        break;
                    }
                    let result = op(client, seq).await;
                    let ended = Instant::now();
                    let measured = began >= from;
                    if measured {
                        last_end = last_end.max(ended);
                    }
                    match result {
                        Ok(Outcome::Done) if measured => load.samples.push(ended - began),
                        Ok(Outcome::Refused) if measured => load.refused += 1,
                        Ok(_) => {}
                        Err(error) => {
                            load.errors += u64::from(measured);
                            load.first_error.get_or_insert_with(|| error.to_string());
                            // Do not spin on a persistent error.
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
                (load, last_end)
            })
        })
        .collect();
    let mut total = Load::default();
    let mut last_end = from;
    for task in tasks {
        let (load, end) = task.await?;
        total.samples.extend(load.samples);
        total.refused += load.refused;
        total.errors += load.errors;
        if total.first_error.is_none() {
            total.first_error = load.first_error;
        }
        last_end = last_end.max(end);
    }
    total.elapsed = last_end.saturating_duration_since(from);
    if let Some(error) = &total.first_error {
        eprintln!("  error during the load: {error}");
    }
    Ok(total)
}

/// A field of a `key : value` file such as /proc/cpuinfo or /proc/meminfo.
pub fn proc_value(path: &str, key: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_owned())
        })
}

/// `123456 kB` in bytes.
pub fn kib(value: &str) -> Option<u64> {
    value
        .split_whitespace()
        .next()?
        .parse::<u64>()
        .ok()
        .map(|k| k * 1024)
}

/// This process's resident set size.
pub fn rss_bytes() -> Option<u64> {
    proc_value("/proc/self/status", "VmRSS").and_then(|v| kib(&v))
}

pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub async fn pool(opts: &PgConnectOptions, max_connections: u32) -> Res<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(opts.clone())
        .await?)
}

/// A connection of its own, retrying while a fresh server finishes starting.
pub async fn connect(opts: &PgConnectOptions) -> Res<PgConnection> {
    let mut attempts = 0;
    loop {
        match PgConnection::connect_with(opts).await {
            Ok(conn) => return Ok(conn),
            Err(error) if attempts >= 50 => return Err(error.into()),
            Err(_) => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

pub async fn create_database(server: &PgConnectOptions, name: &str) -> Res<()> {
    drop_database(server, name).await?; // a leftover of an interrupted run
    let mut admin = connect(server).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"CREATE DATABASE "{name}" TEMPLATE template0"#
    )))
    .execute(&mut admin)
    .await?;
    admin.close().await?;
    Ok(())
}

pub async fn drop_database(server: &PgConnectOptions, name: &str) -> Res<()> {
    let mut admin = connect(server).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
    )))
    .execute(&mut admin)
    .await?;
    admin.close().await?;
    Ok(())
}

/// `prefix` made unique within this run (`prefix_7`): tables and rows that
/// a repeated cell creates again.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{prefix}_{}", NEXT.fetch_add(1, Ordering::Relaxed))
}
