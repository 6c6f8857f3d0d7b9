//! A worker process: a few tasks hammer the semaphores through the router,
//! and log what each was told, one line per event:
//! - `A <key> <id> <semaphore> <slot> <t> <asked> <created>`: acquired (t
//!   after the claim returned, asked when the acquire began, created: the
//!   database's `created_at`, µs);
//! - `E <key> <t>`: stopped work, about to release;
//! - `R <key> <outcome>`: what release said (`ok`, `lost <reason>`, `error ..`);
//! - `L <key> <t> <reason>`: told the permit was lost, stopped work at t;
//! - `T <t> <semaphore>`: an acquire timed out; `C`: one cancelled on purpose;
//! - `X <t> <error>`: a database error (expected during the failover).
//!
//! `key` names the claim in its worker's log (ids may repeat across an
//! asynchronous failover: the new primary can hand out an id again).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pg_semaphore::{Error, Semaphore};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::chaos::{self, Log, Rng, WorkerArgs, now_us, one_line, until_ok};
use crate::{ACQUIRE_TIMEOUT, LEASE, SEMAPHORES, TASKS};

/// The worker: runs its tasks until the driver writes the stop file.
pub async fn worker(args: WorkerArgs) {
    let log = Log::open(&args.log).expect("open the worker log");
    let options: PgConnectOptions = args.url.parse().expect("worker url");
    let label = args.label.as_str();
    let pool = until_ok(
        || {
            PgPoolOptions::new()
                .max_connections(TASKS as u32 + 2)
                .acquire_timeout(Duration::from_secs(3))
                .connect_with(options.clone().application_name(label))
        },
        |error| log.line(format!("X {} connect: {}", now_us(), one_line(&error))),
    )
    .await;
    let client = pg_semaphore::Client::new(pool.clone())
        .holder(label)
        .fallback_interval(Duration::from_millis(500));
    let mut semaphores = Vec::new();
    for (name, capacity) in SEMAPHORES {
        let build = || {
            Semaphore::builder(name, capacity)
                .lease(LEASE)
                .build(&client)
        };
        let failed = |error: Error| log.line(format!("X {} build: {}", now_us(), one_line(&error)));
        semaphores.push(until_ok(build, failed).await);
    }
    let stopping = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..TASKS {
        let (semaphores, log, stopping) = (semaphores.clone(), log.clone(), stopping.clone());
        tasks.spawn(semaphore_task(semaphores, log, stopping, task as u64));
    }
    args.run_until_stopped(&stopping, tasks).await;
}

async fn semaphore_task(
    semaphores: Vec<Semaphore>,
    log: Log,
    stopping: Arc<AtomicBool>,
    task: u64,
) {
    let mut rng = Rng::seeded(task);
    let mut n = 0u64;
    while !stopping.load(Ordering::SeqCst) {
        let asked = now_us();
        let probe = rng.below(5) == 0;
        let sem = &semaphores[if probe { 2 } else { rng.below(2) as usize }];
        let acquired = if probe {
            // The sentinels' semaphore: a probe, never a wait.
            match sem.try_acquire().await {
                Err(Error::NoSlotsAvailable { .. }) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                other => other,
            }
        } else if rng.below(8) == 0 {
            // Cancel the acquire at a random point.
            let patience = Duration::from_micros(rng.below(30_000));
            tokio::select! {
                result = sem.acquiring().timeout(ACQUIRE_TIMEOUT).acquire() => result,
                () = tokio::time::sleep(patience) => {
                    log.line("C".to_owned());
                    continue;
                }
            }
        } else {
            sem.acquiring().timeout(ACQUIRE_TIMEOUT).acquire().await
        };
        let permit = match acquired {
            Ok(permit) => permit,
            Err(Error::Timeout { .. }) => {
                log.line(format!("T {} {}", now_us(), sem.name()));
                continue;
            }
            Err(error) => {
                log.line(format!("X {} acquire: {}", now_us(), one_line(&error)));
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        n += 1;
        let key = format!("{task}.{n}");
        log.line(format!(
            "A {key} {} {} {} {} {asked} {}",
            permit.id(),
            sem.name(),
            permit.slot(),
            now_us(),
            permit.acquired_at().timestamp_micros(),
        ));
        // Mostly short holds; now and then, on cap3, a long one that
        // heartbeats, and may span the failover.
        let hold = if sem.capacity() == 3 && rng.below(25) == 0 {
            Duration::from_millis(1000 + rng.below(2000))
        } else {
            Duration::from_micros(rng.below(30_000))
        };
        chaos::hold(permit, &key, &log, tokio::time::sleep(hold)).await;
    }
}
