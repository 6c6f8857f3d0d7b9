//! The driver: a primary and a streaming standby, and for each run a
//! database, a router in front of the primary, the worker processes, the
//! failover (the primary lost, the standby promoted, the router switched),
//! the workers stopped, and the new primary's slot table read for the
//! checker.

use std::time::Duration;

use pg_semaphore::{Mutex, Semaphore};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, Connection, PgConnection};
use testkit::replica::{self, ReplicaPair, Replication};
use testkit::router::Router;

use crate::checker::{Times, check};
use crate::logs::read_logs;
use crate::report::Report;
use crate::sentinels::{claim_cut_off, hold_through};
use crate::support::BoxError;
use crate::support::chaos::{Log, Workers, log_dir, now_us, slot_rows};
use crate::{
    ACQUIRE_TIMEOUT, AFTER, BEFORE, CUT_OFF, DRIVER, LEASE, MUTEX, PARTITION, SENTINELS_FOR,
    SERIAL, Scenario, WORKER_ENTRY_POINT, WORKER_ENV, WORKERS, checked_semaphores,
};

/// `runs` failovers on one pair (a new standby cloned after each), each
/// checked; prints each one's counts and the totals per scenario. Nothing
/// when the server binaries are missing (the test skips).
pub async fn failovers(mode: Replication, runs: u32) -> Result<Vec<Report>, BoxError> {
    let _serial = SERIAL.lock().await;
    if !replica::installed() {
        return Ok(Vec::new());
    }
    let started = tokio::time::Instant::now();
    let mut pair = ReplicaPair::start(mode).await?;
    println!("failover: {}", pair.description());
    let mut reports = Vec::new();
    for run in 1..=runs {
        if run > 1 {
            pair.reinit_standby().await?;
        }
        let scenario = Scenario::of_run(run);
        let report = one_failover(&mut pair, run, scenario).await?;
        println!(
            "failover ({} replication, run {run}/{runs}, {}): {report}",
            mode.label(),
            scenario.label()
        );
        reports.push(report);
    }
    for scenario in [Scenario::Crash, Scenario::Partition] {
        let mut total = Report {
            scenario,
            ..Report::default()
        };
        for report in reports.iter().filter(|r| r.scenario == scenario) {
            total.add(report);
        }
        if total.runs > 0 {
            println!(
                "failover ({} replication, {}): TOTAL over {} run(s): {total}",
                mode.label(),
                scenario.label(),
                total.runs
            );
        }
    }
    println!(
        "failover ({} replication): {runs} run(s) in {:.0?}",
        mode.label(),
        started.elapsed()
    );
    Ok(reports)
}

/// The router on a runtime of its own, as HAProxy is a process of its own:
/// the traffic it forwards does not delay the driver's timers (the
/// sentinels' deadlines, the mutex's heartbeat).
struct RouterProcess {
    router: Option<Router>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl RouterProcess {
    async fn start(upstream: String) -> Result<RouterProcess, BoxError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("router")
            .enable_all()
            .build()?;
        let router = runtime.spawn(Router::start(upstream)).await?;
        Ok(RouterProcess {
            router: Some(router),
            runtime: Some(runtime),
        })
    }
}

impl std::ops::Deref for RouterProcess {
    type Target = Router;

    fn deref(&self) -> &Router {
        self.router.as_ref().expect("the router runs until dropped")
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        drop(self.router.take());
        // Dropping a runtime blocks, which an async context forbids.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn one_failover(
    pair: &mut ReplicaPair,
    run: u32,
    scenario: Scenario,
) -> Result<Report, BoxError> {
    let database = format!("failover_{run}");
    let mut admin = PgConnection::connect_with(&pair.primary_options()).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"CREATE DATABASE "{database}" TEMPLATE template0"#
    )))
    .execute(&mut admin)
    .await?;
    admin.close().await?;

    let router = RouterProcess::start(pair.primary_address()).await?;
    let through_router = router.options().username("postgres").database(&database);
    let driver = PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(through_router.clone().application_name("failover-driver"))
        .await?;
    pg_semaphore::migrate(&driver).await?;
    for (name, capacity) in checked_semaphores() {
        Semaphore::builder(name, capacity)
            .lease(LEASE)
            .build(&pg_semaphore::Client::new(driver.clone()))
            .await?;
    }

    let dir = log_dir(&format!("failover-{run}"))?;
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/{database}",
        router.address().port()
    );
    let mut workers = Workers::new(WORKER_ENTRY_POINT, WORKER_ENV, url, &dir);
    for _ in 0..WORKERS {
        workers.spawn()?;
    }
    tokio::time::sleep(BEFORE).await;

    // Held through the failover: two sentinels and a session lock.
    let driver_log = Log::open(&dir.join(format!("{DRIVER}.log")))?;
    let held = hold_through(&driver, &driver_log).await?;

    // The failover: the primary dies (cut off from its standby first, in a
    // partition run), the router's check marks it down, the standby is
    // promoted, the router sends everyone to it.
    let mut cut_off = None;
    let partitioned_at = match scenario {
        Scenario::Crash => None,
        Scenario::Partition => {
            // Opened before the cut (it exists: opening reads only).
            let sem = Semaphore::builder(CUT_OFF.0, CUT_OFF.1)
                .lease(LEASE)
                .build(&pg_semaphore::Client::new(driver.clone()).holder(DRIVER))
                .await?;
            pair.partition();
            let at = now_us();
            cut_off = Some(claim_cut_off(sem, &driver_log, &held));
            tokio::time::sleep(PARTITION).await;
            Some(at)
        }
    };
    let stopped_at = now_us();
    pair.stop_primary_hard().await?;
    router.take_down();
    pair.promote_standby().await?;
    let promoted_at = now_us();
    router.switch_to(pair.primary_address());
    let switched_at = now_us();

    tokio::time::sleep(SENTINELS_FOR).await;
    held.release.send_replace(true);
    for sentinel in held.sentinels {
        sentinel.await?;
    }
    if let Some(cut_off) = cut_off {
        cut_off.await?;
    }
    let mutex_lost_at = tokio::time::timeout(Duration::from_secs(10), held.mutex_lost)
        .await
        .map_err(|_| "the session mutex held through the failover was never reported lost")??;
    // Advisory locks are not replicated: the lock is free on the new primary.
    let relocked = Mutex::new(MUTEX)
        .locking()
        .no_wait()
        .lock_session(&pg_semaphore::Client::new(driver.clone()))
        .await?;
    relocked.unlock().await?;
    tokio::time::sleep(AFTER.saturating_sub(SENTINELS_FOR)).await;

    // The LISTEN connections followed the router to the new primary.
    let new_primary = pair.primary_options().database(&database);
    let mut direct = PgConnection::connect_with(&new_primary).await?;
    let listening: Vec<String> = sqlx::query_scalar(
        "SELECT application_name FROM pg_stat_activity WHERE datname = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(&database)
    .fetch_all(&mut direct)
    .await?;
    for worker in workers.labels() {
        assert!(
            listening.iter().any(|name| name == worker),
            "worker {worker}'s LISTEN connection is not on the new primary: {listening:?}",
        );
    }

    workers
        .stop(ACQUIRE_TIMEOUT + Duration::from_secs(15))
        .await?;
    // The workers released what they held; reap the claims whose release
    // could not reach a server (their leases ended during the failover).
    // A claim still within its lease is checked as held until it ends.
    let reaped_at = now_us();
    pg_semaphore::admin::reap(&driver).await?;
    driver.close().await;

    let rows = slot_rows(&mut direct).await?;
    // The pair lives on: drop this run's database (and its WAL) right away.
    direct.close().await?;
    let mut admin = PgConnection::connect_with(&pair.primary_options()).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"DROP DATABASE "{database}" WITH (FORCE)"#
    )))
    .execute(&mut admin)
    .await?;
    admin.close().await?;

    let logs = read_logs(&dir)?;
    let times = Times {
        partitioned: partitioned_at,
        stopped: stopped_at,
        promoted: promoted_at,
        switched: switched_at,
        mutex_lost: mutex_lost_at,
        reaped: reaped_at,
    };
    if std::env::var_os("PGSEMAPHORE_FAILOVER_KEEP").is_some() {
        println!(
            "failover: logs kept in {}: partitioned {partitioned_at:?}, stopped {stopped_at}, \
             promoted {promoted_at}, switched {switched_at}",
            dir.display()
        );
    }
    let report = check(pair.mode(), scenario, &rows, &logs, &times);
    if std::env::var_os("PGSEMAPHORE_FAILOVER_KEEP").is_none() {
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(report)
}
