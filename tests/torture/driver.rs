//! The chaos driver: it starts the worker processes, then for
//! `PGSEM_TORTURE_SECS` (40 s by default) SIGKILLs whole workers mid-hold,
//! terminates random backends (LISTEN connections and advisory sessions
//! holding slots included) and crashes and restarts the server once (when
//! the harness owns it), while a reaper runs; then lets the workers run
//! undisturbed, stops them, and hands the logs to the checkers. What it did
//! goes to its own log, `chaos.events` (see [`Events`](crate::logs::Events)).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, Utc};
use pg_semaphore::{AdvisorySemaphore, Semaphore, admin::Reaper};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::support::chaos::{Log, Rng, Workers, log_dir, now_us, us};
use crate::support::{self, TestResult};
use crate::{
    ACQUIRE_TIMEOUT, ADVISORY, LEASE, REAP_EVERY, SEMAPHORES, WORKER_ENTRY_POINT, WORKER_ENV,
    WORKERS,
};
use crate::{advisory_checker, checker, logs};

/// The worker processes, and what the driver did to them.
struct Chaos {
    workers: Workers,
    /// label -> when it was SIGKILLed (driver's clock, µs).
    killed: HashMap<String, i64>,
    /// The driver's own log (`chaos.events`, see [`Events`](crate::logs::Events)).
    events: Log,
}

impl Chaos {
    /// SIGKILLs a random worker and starts another; logs it (`K`), and
    /// returns the victim's label and when it was killed.
    fn kill_one(&mut self, rng: &mut Rng) -> std::io::Result<(String, i64)> {
        // Stamped before the signal: the process may die at once, and its
        // slots are free only after it has.
        let (label, at) = self.workers.kill_one(rng)?;
        self.killed.insert(label.clone(), at);
        self.events.line(format!("K {label} {at}"));
        Ok((label, at))
    }
}

#[derive(Default, Debug)]
struct Counts {
    kills: u64,
    terminations: u64,
    listen_terminations: u64,
    advisory_terminations: u64,
    restarts: u64,
}

/// Which backend [`terminate_one`] picks.
#[derive(Debug, Clone, Copy)]
enum Victim {
    /// Any backend of the test database but the driver's.
    Any,
    /// A LISTEN connection.
    Listen,
    /// An advisory session that holds a slot.
    AdvisoryHolder,
}

/// Terminates one random backend of the test database that is not the
/// driver's, of the kind `victim`; returns its pid, the server's clock just
/// before `pg_terminate_backend` (the backend, and any advisory lock it
/// holds, ends after that), and its application name.
async fn terminate_one(
    pool: &PgPool,
    database: &str,
    victim: Victim,
) -> Result<Option<(i32, DateTime<Utc>, String)>, sqlx::Error> {
    let kind = match victim {
        Victim::Any => "any",
        Victim::Listen => "listen",
        Victim::AdvisoryHolder => "advisory",
    };
    // The target list is evaluated in order: the clock is read before the signal.
    let row: Option<(i32, DateTime<Utc>, String, bool)> = sqlx::query_as(
        "SELECT pid, clock_timestamp(), application_name, pg_terminate_backend(pid) FROM ( \
             SELECT pid, application_name FROM pg_stat_activity \
              WHERE datname = $1 AND pid <> pg_backend_pid() \
                AND application_name <> 'torture-driver' \
                AND ($2 = 'any' \
                     OR ($2 = 'listen' AND query LIKE 'LISTEN%') \
                     OR ($2 = 'advisory' AND pid IN (SELECT h.pid FROM pgsemaphore.advisory_holders h))) \
              ORDER BY random() LIMIT 1) victim",
    )
    .bind(database)
    .bind(kind)
    .fetch_optional(pool)
    .await?;
    Ok(row
        .filter(|(.., terminated)| *terminated)
        .map(|(pid, at, application, _)| (pid, at, application)))
}

/// After `label` was SIGKILLed at `killed`: how long until none of the
/// backends its log names (`a` lines) holds an advisory slot; `None` if
/// some still did after 5 s.
async fn advisory_slots_freed(
    pool: &PgPool,
    dir: &Path,
    label: &str,
    killed: i64,
) -> Result<Option<i64>, sqlx::Error> {
    let text = std::fs::read_to_string(dir.join(format!("{label}.log"))).unwrap_or_default();
    let pids: Vec<i32> = text
        .lines()
        .filter(|line| line.starts_with("a "))
        .filter_map(|line| line.split(' ').nth(4)?.parse().ok())
        .collect::<HashSet<i32>>()
        .into_iter()
        .collect();
    let killed_at = DateTime::<Utc>::from_timestamp_micros(killed).unwrap_or_default();
    loop {
        // A pid reused by a backend started after the kill is not the worker's.
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pgsemaphore.advisory_holders \
              WHERE pid = ANY($1) AND (backend_start IS NULL OR backend_start < $2)",
        )
        .bind(&pids)
        .bind(killed_at)
        .fetch_one(pool)
        .await?;
        let after = now_us() - killed;
        if held == 0 {
            return Ok(Some(after));
        }
        if after > 5_000_000 {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The torture test: set-up, chaos, calm, checks.
pub async fn torture() -> TestResult {
    let db = support::migrated_db().await;
    sqlx::raw_sql(
        "CREATE TABLE torture_counter (v bigint NOT NULL); INSERT INTO torture_counter VALUES (0)",
    )
    .execute(&db.pool)
    .await?;
    sqlx::query(
        "CREATE TABLE torture_mutex_log (id bigserial PRIMARY KEY, started_at timestamptz NOT NULL, \
         ended_at timestamptz NOT NULL)",
    )
    .execute(&db.pool)
    .await?;
    let driver = PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(db.options.clone().application_name("torture-driver"))
        .await?;
    for (name, capacity) in SEMAPHORES {
        Semaphore::builder(name, capacity)
            .lease(LEASE)
            .build(&pg_semaphore::Client::new(driver.clone()))
            .await?;
    }
    for (name, capacity) in ADVISORY {
        AdvisorySemaphore::builder(name, capacity)
            .build(&pg_semaphore::Client::new(driver.clone()))
            .await?;
    }
    let reaper = Reaper::spawn(&driver, REAP_EVERY)?;

    let server = support::server::server();
    let chaos_for = Duration::from_secs(
        std::env::var("PGSEM_TORTURE_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(40),
    );
    let dir = log_dir("torture")?;
    println!("torture: logs in {}", dir.display());
    let url = support::server::url_for(&db.name);
    let mut chaos = Chaos {
        workers: Workers::new(WORKER_ENTRY_POINT, WORKER_ENV, url, &dir),
        killed: HashMap::new(),
        events: Log::open(&dir.join("chaos.events"))?,
    };
    for _ in 0..WORKERS {
        chaos.workers.spawn()?;
    }

    // Chaos.
    let mut rng = Rng::seeded(7);
    let mut counts = Counts::default();
    let started = tokio::time::Instant::now();
    let chaos_started_us = now_us();
    let mut restart_window: Option<(i64, i64)> = None;
    let mut sentinel = None;
    let mut next_kill = started + Duration::from_secs(3);
    let mut next_terminate = started + Duration::from_millis(700);
    let mut terminate_round = 0u64;
    let restart_at = started + chaos_for / 2;
    while started.elapsed() < chaos_for {
        let now = tokio::time::Instant::now();
        if now >= next_kill {
            let (label, at) = chaos.kill_one(&mut rng)?;
            counts.kills += 1;
            let freed = advisory_slots_freed(&driver, &dir, &label, at).await?;
            chaos.events.line(format!(
                "F {label} {}",
                freed.map_or("never".to_owned(), |us| us.to_string())
            ));
            next_kill = now + Duration::from_millis(2500 + rng.below(2000));
        }
        if now >= next_terminate {
            let victim = [Victim::Listen, Victim::AdvisoryHolder, Victim::Any]
                [(terminate_round % 3) as usize];
            terminate_round += 1;
            if let Ok(Some((pid, at, application))) = terminate_one(&driver, &db.name, victim).await
            {
                chaos
                    .events
                    .line(format!("P {pid} {} {victim:?} {application}", us(at)));
                counts.terminations += 1;
                counts.listen_terminations += u64::from(matches!(victim, Victim::Listen));
                counts.advisory_terminations += u64::from(matches!(victim, Victim::AdvisoryHolder));
            }
            next_terminate = now + Duration::from_millis(300 + rng.below(700));
        }
        if restart_window.is_none() && now >= restart_at && server.can_restart() {
            // A permit of the driver's own, renewed by its heartbeat, held
            // through the outage: its holder must be told it is lost.
            let sentinel_sem = Semaphore::builder("cap16", 16)
                .lease(LEASE)
                .build(&pg_semaphore::Client::new(driver.clone()).holder("sentinel"))
                .await?;
            let permit = sentinel_sem.try_acquire().await?;
            let told = {
                let id = permit.id();
                tokio::spawn(async move {
                    let reason = permit.lost().await;
                    let at = now_us();
                    drop(permit);
                    (id, at, reason)
                })
            };
            sentinel = Some(told);
            let from = now_us();
            // Down for longer than a lease: holders cannot renew, and must be
            // told their permits are lost before anyone else gets the slots.
            tokio::task::spawn_blocking(|| {
                support::server::server().crash_and_restart(LEASE + Duration::from_millis(500))
            })
            .await??;
            let to = now_us();
            chaos.events.line(format!("S {from} {to}"));
            restart_window = Some((from, to));
            counts.restarts += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let chaos_ended_us = now_us();
    // The sentinel was told, with no renewal possible during the outage.
    let sentinel = match sentinel {
        Some(told) => Some(tokio::time::timeout(Duration::from_secs(5), told).await??),
        None => None,
    };

    // Calm: the system must serve again, undisturbed.
    tokio::time::sleep(Duration::from_secs(6)).await;
    chaos
        .workers
        .stop(ACQUIRE_TIMEOUT + Duration::from_secs(15))
        .await?;

    // Every lease has ended by now or was released; reap what is left.
    tokio::time::sleep(LEASE + REAP_EVERY).await;
    pg_semaphore::admin::reap(&driver).await?;
    reaper.shutdown().await;

    let mut logs = logs::read_logs(&dir)?;
    if let Some((id, at, reason)) = sentinel {
        println!(
            "torture: the driver's own permit {id} held through the outage was reported lost ({reason:?})"
        );
        logs.lost_at.push((id, at, format!("{reason:?}")));
    }
    let report = checker::check(
        &driver,
        &logs,
        &chaos.killed,
        restart_window,
        chaos_started_us,
        chaos_ended_us,
    )
    .await?;
    let events = logs::read_events(&dir)?;
    let advisory_report =
        advisory_checker::check_advisory(&driver, &logs, &events, &dir, chaos_ended_us).await?;

    checker::assert_full_capacity(&db.pool).await?;

    println!(
        "torture: {:.0?} of chaos on {}: {} worker processes spawned, {} SIGKILLed, \
         {} backends terminated ({} of them LISTEN connections, {} advisory sessions holding slots), \
         {} server crash-restart(s)",
        chaos_for,
        server.description,
        chaos.workers.spawned(),
        counts.kills,
        counts.terminations,
        counts.listen_terminations,
        counts.advisory_terminations,
        counts.restarts,
    );
    println!("{report}");
    println!("{advisory_report}");
    assert!(counts.kills >= 3, "the chaos must kill workers: {counts:?}");
    assert!(
        counts.listen_terminations >= 1,
        "the chaos must kill LISTEN connections: {counts:?}"
    );
    assert!(
        counts.advisory_terminations >= 1,
        "the chaos must kill advisory sessions holding slots: {counts:?}"
    );
    if server.can_restart() {
        assert_eq!(counts.restarts, 1);
        assert!(
            sentinel.is_some(),
            "the sentinel permit was not reported lost"
        );
    } else {
        println!(
            "torture: the server is not ours ({}): no restart",
            server.description
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
