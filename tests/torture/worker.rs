//! A worker process: many tasks hammer the lease semaphores, the advisory
//! semaphores and the mutex, cancel their own acquires at random, and log
//! what each was told, one line per event:
//! - `A <id> <semaphore> <slot> <t>`: acquired (t after the claim returned);
//! - `E <id> <t>`: stopped work, about to release;
//! - `R <id> <outcome>`: what release said (`ok` or the lost reason);
//! - `L <id> <t> <reason>`: told the permit was lost, stopped work at t;
//! - `T <semaphore>`: an acquire timed out; `C`: an acquire cancelled on purpose;
//! - `X <error>`: a database error (expected while the chaos runs);
//! - `M`: a mutex-protected increment committed.
//!
//! The advisory tasks log the same letters in lower case, a hold named by
//! `<id>` = `<task>.<n>` within its worker:
//! - `a <id> <semaphore> <slot> <backend pid> <t> <locked>`: acquired (t as
//!   above; `locked`: the permit's `acquired_at`, the claim statement's
//!   clock, this host's);
//! - `e <id> <t>`, `l <id> <t> <reason>`, `t <semaphore>`, `c`, `x <error>`;
//! - `r <id> <outcome>`: `ok`, `lost <reason>`, `error <error>`, or
//!   `dropped` / `dropped-lost` when the task dropped the permit instead of
//!   releasing it (`-lost`: `is_lost()` said so just before).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use pg_semaphore::{AdvisorySemaphore, Error, Mutex, Semaphore, WaitedFor};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::chaos::{
    self, Log, Rng, WorkerArgs, now_us, one_line, release_outcome, until_ok,
};
use crate::{
    ACQUIRE_TIMEOUT, ADVISORY, ADVISORY_TASKS, HEARTBEAT, LEASE, MUTEX, MUTEX_TASKS,
    SEMAPHORE_TASKS, SEMAPHORES,
};

/// The worker: runs its tasks until the driver writes the stop file.
pub async fn worker(args: WorkerArgs) {
    let log = Log::open(&args.log).expect("open the worker log");
    let options: PgConnectOptions = args.url.parse().expect("worker url");
    let label = args.label.as_str();
    let pool = until_ok(
        || {
            PgPoolOptions::new()
                .max_connections(6)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(options.clone().application_name(label))
        },
        |error| log.line(format!("X connect: {error}")),
    )
    .await;
    let client = pg_semaphore::Client::new(pool.clone())
        .holder(label)
        .fallback_interval(Duration::from_millis(500))
        .advisory_heartbeat(HEARTBEAT)
        .advisory_connections(3);
    let mut semaphores = Vec::new();
    for (name, capacity) in SEMAPHORES {
        let build = || {
            Semaphore::builder(name, capacity)
                .lease(LEASE)
                .build(&client)
        };
        semaphores.push(until_ok(build, |error| log.line(format!("X build: {error}"))).await);
    }
    let mut advisory = Vec::new();
    for (name, capacity) in ADVISORY {
        let build = || AdvisorySemaphore::builder(name, capacity).build(&client);
        let failed = |error: Error| log.line(format!("x build: {}", one_line(&error)));
        advisory.push(until_ok(build, failed).await);
    }
    let stopping = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..SEMAPHORE_TASKS {
        let (semaphores, log, stopping) = (semaphores.clone(), log.clone(), stopping.clone());
        tasks.spawn(semaphore_task(semaphores, log, stopping, task as u64));
    }
    for task in 0..ADVISORY_TASKS {
        let (advisory, log, stopping) = (advisory.clone(), log.clone(), stopping.clone());
        tasks.spawn(advisory_task(advisory, log, stopping, 200 + task as u64));
    }
    for task in 0..MUTEX_TASKS {
        let (pool, log, stopping) = (pool.clone(), log.clone(), stopping.clone());
        tasks.spawn(mutex_task(pool, log, stopping, 100 + task as u64));
    }
    args.run_until_stopped(&stopping, tasks).await;
    // A worker that stops lives to flush its advisory audit log: with the
    // last handle gone, the writer writes what is queued (at most one
    // flush interval, 500 ms, after a permit ended) and stops.
    drop(advisory);
    tokio::time::sleep(Duration::from_millis(1500)).await;
}

/// One acquire of a worker task, cancelled at a random point one time in
/// five. A cancel, a timeout or an error is logged (with `marks`: the
/// letters of those three events for this kind of semaphore, see the log
/// format above) and gives `None`; after an error, the task pauses 20 ms.
async fn acquire_or_log<P, F>(
    acquire: impl Fn() -> F,
    rng: &mut Rng,
    log: &Log,
    name: &str,
    [cancelled, timed_out, failed]: [&str; 3],
) -> Option<P>
where
    F: std::future::Future<Output = Result<P, Error>>,
{
    // Bounded by a timeout around the cancel-safe future (a timeout is
    // logged as such).
    let bounded = || async {
        tokio::time::timeout(ACQUIRE_TIMEOUT, acquire())
            .await
            .unwrap_or_else(|_| {
                Err(Error::Timeout {
                    waited_for: WaitedFor::Permit {
                        semaphore: name.to_owned(),
                    },
                    timeout: ACQUIRE_TIMEOUT,
                })
            })
    };
    let acquired = if rng.below(5) == 0 {
        // Cancel the acquire at a random point.
        let patience = Duration::from_micros(rng.below(30_000));
        tokio::select! {
            result = bounded() => result,
            () = tokio::time::sleep(patience) => {
                log.line(cancelled.to_owned());
                return None;
            }
        }
    } else {
        bounded().await
    };
    match acquired {
        Ok(permit) => Some(permit),
        Err(Error::Timeout { .. }) => {
            log.line(format!("{timed_out} {name}"));
            None
        }
        Err(error) => {
            log.line(format!("{failed} acquire: {}", one_line(&error)));
            tokio::time::sleep(Duration::from_millis(20)).await;
            None
        }
    }
}

async fn semaphore_task(
    semaphores: Vec<Semaphore>,
    log: Log,
    stopping: Arc<AtomicBool>,
    salt: u64,
) {
    let mut rng = Rng::seeded(salt);
    while !stopping.load(Ordering::SeqCst) {
        // The small semaphores are the contended ones: pick them more often.
        let sem = &semaphores[[0, 0, 1, 1, 2][rng.below(5) as usize]];
        let acquire = || sem.acquire();
        let Some(permit) =
            acquire_or_log(acquire, &mut rng, &log, sem.name(), ["C", "T", "X"]).await
        else {
            continue;
        };
        let id = permit.id();
        log.line(format!(
            "A {id} {} {} {}",
            sem.name(),
            permit.slot(),
            now_us()
        ));
        // Mostly short holds; now and then, on the wide semaphore, a long one
        // that outlives the heartbeat interval (renewals) and may be caught
        // by the server's crash (lost permits).
        let hold = if sem.capacity() == 16 && rng.below(50) == 0 {
            Duration::from_millis(800 + rng.below(1700))
        } else {
            Duration::from_micros(rng.below(40_000))
        };
        chaos::hold(permit, &id.to_string(), &log, tokio::time::sleep(hold)).await;
    }
}

async fn advisory_task(
    semaphores: Vec<AdvisorySemaphore>,
    log: Log,
    stopping: Arc<AtomicBool>,
    salt: u64,
) {
    let mut rng = Rng::seeded(salt);
    let mut held = 0u64;
    while !stopping.load(Ordering::SeqCst) {
        let sem = &semaphores[rng.below(semaphores.len() as u64) as usize];
        let acquire = || sem.acquire();
        let Some(permit) =
            acquire_or_log(acquire, &mut rng, &log, sem.name(), ["c", "t", "x"]).await
        else {
            continue;
        };
        held += 1;
        let id = format!("{salt}.{held}");
        log.line(format!(
            "a {id} {} {} {} {} {}",
            sem.name(),
            permit.slot(),
            permit.backend_pid(),
            now_us(),
            permit.acquired_at().timestamp_micros()
        ));
        // Mostly short holds; now and then a long one, many heartbeats long,
        // for the chaos to cut (a terminated backend, the server's crash).
        let long = if sem.capacity() == 1 { 30 } else { 8 };
        let hold = if rng.below(long) == 0 {
            Duration::from_millis(300 + rng.below(1200))
        } else {
            Duration::from_micros(rng.below(40_000))
        };
        let lost = permit.lost();
        tokio::select! {
            () = tokio::time::sleep(hold) => {
                log.line(format!("e {id} {}", now_us()));
                let outcome = if rng.below(10) == 0 {
                    // Dropped, not released: released in the background.
                    let was_lost = permit.is_lost();
                    drop(permit);
                    if was_lost { "dropped-lost" } else { "dropped" }.to_owned()
                } else {
                    release_outcome(permit.release().await)
                };
                log.line(format!("r {id} {outcome}"));
            }
            reason = lost => {
                log.line(format!("l {id} {} {reason:?}", now_us()));
                drop(permit);
            }
        }
    }
}

async fn mutex_task(pool: PgPool, log: Log, stopping: Arc<AtomicBool>, salt: u64) {
    let mut rng = Rng::seeded(salt);
    let mutex = Mutex::new(MUTEX);
    let client = pg_semaphore::Client::new(pool.clone());
    while !stopping.load(Ordering::SeqCst) {
        let locked = if rng.below(5) == 0 {
            let patience = Duration::from_micros(rng.below(20_000));
            tokio::select! {
                result = mutex.locking().timeout(ACQUIRE_TIMEOUT).lock(&client) => result,
                () = tokio::time::sleep(patience) => {
                    log.line("C".to_owned());
                    continue;
                }
            }
        } else {
            mutex.locking().timeout(ACQUIRE_TIMEOUT).lock(&client).await
        };
        let mut guard = match locked {
            Ok(guard) => guard,
            Err(Error::Timeout { .. }) => {
                log.line(format!("T {MUTEX}"));
                continue;
            }
            Err(error) => {
                log.line(format!("X lock: {}", one_line(&error)));
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        // An unsafe read-modify-write: only mutual exclusion keeps it exact.
        let pause = Duration::from_micros(rng.below(5_000));
        let work = async {
            // The test server runs with synchronous_commit = off; an increment
            // acknowledged to the worker must survive the crash.
            sqlx::query("SET LOCAL synchronous_commit = on")
                .execute(&mut *guard)
                .await?;
            let started: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
                .fetch_one(&mut *guard)
                .await?;
            let value: i64 = sqlx::query_scalar("SELECT v FROM torture_counter")
                .fetch_one(&mut *guard)
                .await?;
            tokio::time::sleep(pause).await;
            sqlx::query("UPDATE torture_counter SET v = $1")
                .bind(value + 1)
                .execute(&mut *guard)
                .await?;
            sqlx::query(
                "INSERT INTO torture_mutex_log (started_at, ended_at) VALUES ($1, clock_timestamp())",
            )
            .bind(started)
            .execute(&mut *guard)
            .await?;
            Ok::<_, sqlx::Error>(())
        };
        match work.await {
            Ok(()) => match guard.commit().await {
                Ok(()) => log.line("M".to_owned()),
                Err(error) => log.line(format!("X commit: {}", one_line(&error))),
            },
            Err(error) => log.line(format!("X mutex work: {}", one_line(&error))),
        }
    }
}
