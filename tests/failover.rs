//! Failover on a real streaming replica: worker processes hammer semaphores
//! of capacities 1 and 3 through a router while the test stops the primary
//! hard (`pg_ctl stop -m immediate`), promotes the standby, and switches the
//! router to it, as HAProxy does in front of Patroni when its health check
//! flips (sqlx cannot fail over by itself: it has no multi-host connection
//! strings nor `target_session_attrs`). Runs alternate two ways of losing
//! the primary: a **crash** while the standby streams, and a **partition**
//! (the replication link is cut for 400 ms under load, then the primary is
//! stopped), the case where an asynchronous standby is behind.
//!
//! The workers log what they were told, with their own µs timestamps: every
//! claim (its id, slot and the database's `created_at`), when work stopped,
//! what release said, every permit reported lost. The driver holds two
//! sentinel permits with heartbeats through the failover (leases of 6 s and
//! 1 s) on a semaphore of capacity 2 that workers probe with `try_acquire`,
//! a session mutex, and, in partition runs, a claim made while the standby
//! is cut off. An independent checker then compares the logs with the **new
//! primary's** audit log:
//!
//! - **synchronous replication** (`synchronous_standby_names` naming the
//!   standby, `synchronous_commit = on`): every claim a holder was given is
//!   on the new primary with its slot, holder and `created_at`, every
//!   acknowledged release with its outcome, every acknowledged renewal; no
//!   claim is acknowledged while the standby is cut off; never more than
//!   `capacity` holders and never a slot held twice, on the workers' clocks
//!   or in the table; the sentinels were renewed on the new primary or
//!   reported lost before their slots went to anyone else;
//! - **asynchronous replication**: acknowledged claims can be missing after
//!   promotion and a slot can then be granted twice. The test counts them and
//!   asserts what is guaranteed even so: the new primary's table is
//!   consistent, every claim acknowledged while the standby was cut off is
//!   missing from it (the checker finds them), and every over-admission on
//!   the workers' clocks involves a claim the new primary lost or let expire
//!   while its holder worked (the checker names it);
//! - in both: the session mutex is reported lost (advisory locks are not
//!   replicated) and can be taken again on the new primary; the `LISTEN`
//!   connections reconnect to the new primary; every semaphore, and every
//!   worker, is served again after the switch; no acquire hangs.
//!
//! CI runs 2 synchronous and 3 asynchronous failovers (a minute and a half);
//! `PGSEMAPHORE_FAILOVER_RUNS=20` runs 20 of each (half of them partitions)
//! and prints the totals; `PGSEMAPHORE_FAILOVER_KEEP=1` keeps each run's
//! logs and prints where.

mod support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use pg_semaphore::{Error, Mutex, Semaphore};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};
use support::workers::{Log, Rng, max_overlap, now_us, one_line};
use testkit::replica::{self, ReplicaPair, Replication};
use testkit::router::Router;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// The semaphores under test: (name, capacity). Workers wait for `cap1` and
/// `cap3`; `cap2` holds the driver's two sentinels through the failover, and
/// workers probe it with `try_acquire`: one of them admitted while a
/// sentinel believes it holds its slot is an over-admission.
const SEMAPHORES: [(&str, u32); 3] = [("cap1", 1), ("cap3", 3), ("cap2", 2)];
/// The semaphore of the driver's claim made while the standby is cut off
/// (see [`claim_cut_off`]): no worker uses it, so its slot is free and the
/// claim is one round trip, whatever the workers hold. On a contended
/// semaphore the claim, and every worker's, could find no slot for the
/// whole window, and the run then measured nothing.
const CUT_OFF: (&str, u32) = ("cut-off", 1);

/// Every semaphore the checker checks: the workers', and [`CUT_OFF`].
fn checked_semaphores() -> impl Iterator<Item = (&'static str, u32)> {
    SEMAPHORES.into_iter().chain([CUT_OFF])
}
const LEASE: Duration = Duration::from_secs(2);
/// An acquire that waits this long is a hang.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(15);
const WORKERS: usize = 3;
const TASKS: usize = 6;
const MUTEX: &str = "failover-mutex";
/// Load before the primary is stopped, and after the router switched.
const BEFORE: Duration = Duration::from_millis(2500);
const AFTER: Duration = Duration::from_millis(3500);
/// How long the replication link is partitioned before the primary is
/// stopped, in the [`Scenario::Partition`] runs.
const PARTITION: Duration = Duration::from_millis(400);
/// The sentinels are released this long after the switch (if not lost).
const SENTINELS_FOR: Duration = Duration::from_millis(1500);
/// The holder label of the driver's own permits.
const DRIVER: &str = "driver";

/// One failover at a time in this process: two pairs and their workers at
/// once would share two cores, and blur the timings.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How the primary is lost. Runs alternate: odd runs crash, even runs partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// The primary is stopped hard while the standby streams from it (a
    /// crashed server process: what it had sent still arrives).
    Crash,
    /// The replication link is partitioned for [`PARTITION`] under load,
    /// then the primary is stopped hard (a primary cut off from its standby,
    /// then lost).
    Partition,
}

impl Scenario {
    fn of_run(run: u32) -> Scenario {
        if run % 2 == 1 {
            Scenario::Crash
        } else {
            Scenario::Partition
        }
    }

    fn label(self) -> &'static str {
        match self {
            Scenario::Crash => "crash",
            Scenario::Partition => "partition, then crash",
        }
    }
}

// ---------------------------------------------------------------- workers --

/// One worker process: a few tasks, and a log of what each was told, one line per event:
/// - `A <key> <id> <semaphore> <slot> <t> <asked> <created>`: acquired (t
///   after the claim returned, asked when the acquire began, created: the
///   database's `created_at`, µs);
/// - `E <key> <t>`: stopped work, about to release;
/// - `R <key> <outcome>`: what release said (`ok`, `lost <reason>`, `error ..`);
/// - `L <key> <t> <reason>`: told the permit was lost, stopped work at t;
/// - `T <t> <semaphore>`: an acquire timed out; `C`: one cancelled on purpose;
/// - `X <t> <error>`: a database error (expected during the failover).
///
/// `key` names the claim in its worker's log (ids may repeat across an
/// asynchronous failover: the new primary can hand out an id again).
#[test]
fn failover_worker_entry_point() {
    let (Ok(url), Ok(log), Ok(label), Ok(stop)) = (
        std::env::var("PGSEM_FAILOVER_URL"),
        std::env::var("PGSEM_FAILOVER_LOG"),
        std::env::var("PGSEM_FAILOVER_LABEL"),
        std::env::var("PGSEM_FAILOVER_STOP"),
    ) else {
        return; // Not a worker: nothing to do in a normal test run.
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(worker(url, PathBuf::from(log), label, PathBuf::from(stop)));
}

async fn worker(url: String, log: PathBuf, label: String, stop: PathBuf) {
    let log = Log::open(&log).expect("open the worker log");
    let options: PgConnectOptions = url.parse().expect("worker url");
    let pool = loop {
        match PgPoolOptions::new()
            .max_connections(TASKS as u32 + 2)
            .acquire_timeout(Duration::from_secs(3))
            .connect_with(options.clone().application_name(&label))
            .await
        {
            Ok(pool) => break pool,
            Err(error) => {
                log.line(format!("X {} connect: {}", now_us(), one_line(&error)));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let mut semaphores = Vec::new();
    for (name, capacity) in SEMAPHORES {
        let sem = loop {
            match Semaphore::builder(name, capacity)
                .lease(LEASE)
                .holder(&label)
                .fallback_interval(Duration::from_millis(500))
                .build(&pool)
                .await
            {
                Ok(sem) => break sem,
                Err(error) => {
                    log.line(format!("X {} build: {}", now_us(), one_line(&error)));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        semaphores.push(sem);
    }
    let stopping = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..TASKS {
        let (semaphores, log, stopping) = (semaphores.clone(), log.clone(), stopping.clone());
        tasks.spawn(semaphore_task(semaphores, log, stopping, task as u64));
    }
    while !stop.exists() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stopping.store(true, Ordering::SeqCst);
    while tasks.join_next().await.is_some() {}
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
                result = sem.acquire_timeout(ACQUIRE_TIMEOUT) => result,
                () = tokio::time::sleep(patience) => {
                    log.line("C".to_owned());
                    continue;
                }
            }
        } else {
            sem.acquire_timeout(ACQUIRE_TIMEOUT).await
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
        tokio::select! {
            () = tokio::time::sleep(hold) => {
                log.line(format!("E {key} {}", now_us()));
                log.line(format!("R {key} {}", release_outcome(permit.release().await)));
            }
            reason = permit.lost() => {
                log.line(format!("L {key} {} {reason:?}", now_us()));
                drop(permit);
            }
        }
    }
}

fn release_outcome(result: Result<(), Error>) -> String {
    match result {
        Ok(()) => "ok".to_owned(),
        Err(Error::PermitLost { reason, .. }) => format!("lost {reason:?}"),
        Err(error) => format!("error {}", one_line(&error)),
    }
}

// ----------------------------------------------------------------- driver --

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_with_synchronous_replication() -> TestResult {
    for report in failovers(Replication::Synchronous, runs(2)).await? {
        let what = report.scenario.label();
        assert_eq!(report.missing, 0, "{what}: acknowledged claims were lost");
        assert_eq!(
            report.releases_lost, 0,
            "{what}: acknowledged releases were lost"
        );
        assert_eq!(
            report.ended_early_untold, 0,
            "{what}: acknowledged renewals were lost"
        );
        assert_eq!(
            (report.over_capacity, report.slots_twice),
            (0, 0),
            "{what}: over-admissions across the failover"
        );
        assert_eq!(
            report.sentinels_missing, 0,
            "{what}: a sentinel's claim was missing on the new primary"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_with_asynchronous_replication() -> TestResult {
    // What was lost is measured, not asserted: the checker has found every
    // acknowledged claim the new primary lacks, and explained every
    // over-admission by one of them.
    for report in failovers(Replication::Asynchronous, runs(3)).await? {
        if report.scenario == Scenario::Partition {
            assert!(
                report.acknowledged_partitioned > 0,
                "no claim was acknowledged while the standby was cut off: the run measured nothing"
            );
        }
    }
    Ok(())
}

/// How many failovers of each mode: `PGSEMAPHORE_FAILOVER_RUNS`, else `default`.
fn runs(default: u32) -> u32 {
    std::env::var("PGSEMAPHORE_FAILOVER_RUNS")
        .ok()
        .and_then(|runs| runs.parse().ok())
        .unwrap_or(default)
        .max(1)
}

/// `runs` failovers on one pair (a new standby cloned after each), each
/// checked; prints each one's counts and the totals per scenario. Nothing
/// when the server binaries are missing (the test skips).
async fn failovers(mode: Replication, runs: u32) -> Result<Vec<Report>, BoxError> {
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

type BoxError = Box<dyn std::error::Error + Send + Sync>;

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

struct Worker {
    label: String,
    child: Child,
}

/// The driver's own permits and mutex, held through the failover.
struct Held {
    sentinels: Vec<tokio::task::JoinHandle<()>>,
    release: tokio::sync::watch::Sender<bool>,
    mutex_lost: tokio::task::JoinHandle<i64>,
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
            .build(&driver)
            .await?;
    }

    let dir = std::env::temp_dir().join(format!(
        "pgsem-failover-{}-{run}-{}",
        std::process::id(),
        now_us()
    ));
    std::fs::create_dir_all(&dir)?;
    let stop = dir.join("stop");
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/{database}",
        router.address().port()
    );
    let mut workers = Vec::new();
    for n in 1..=WORKERS {
        let label = format!("w{n}");
        let child = Command::new(std::env::current_exe()?)
            .args([
                "failover_worker_entry_point",
                "--exact",
                "--test-threads=1",
                "--nocapture",
            ])
            .env("PGSEM_FAILOVER_URL", &url)
            .env("PGSEM_FAILOVER_LOG", dir.join(format!("{label}.log")))
            .env("PGSEM_FAILOVER_LABEL", &label)
            .env("PGSEM_FAILOVER_STOP", &stop)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        workers.push(Worker { label, child });
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
                .holder(DRIVER)
                .lease(LEASE)
                .build(&driver)
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
    let relocked = Mutex::new(MUTEX).try_lock_session(&driver).await?;
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
    for worker in &workers {
        assert!(
            listening.contains(&worker.label),
            "worker {}'s LISTEN connection is not on the new primary: {listening:?}",
            worker.label
        );
    }

    std::fs::write(&stop, b"stop")?;
    let deadline = tokio::time::Instant::now() + ACQUIRE_TIMEOUT + Duration::from_secs(15);
    for mut worker in workers {
        loop {
            if let Some(status) = worker.child.try_wait()? {
                assert!(status.success(), "worker {} failed: {status}", worker.label);
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = worker.child.kill();
                panic!("worker {} did not stop: a task hung", worker.label);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // The workers released what they held; reap the claims whose release
    // could not reach a server (their leases ended during the failover).
    // A claim still within its lease is checked as held until it ends.
    let reaped_at = now_us();
    pg_semaphore::reap(&driver).await?;
    driver.close().await;

    let rows: Vec<SlotRow> = sqlx::query_as(
        "SELECT id, semaphore, slot, holder, created_at, expires_at, completed_at, timed_out_at \
         FROM pgsemaphore.slots ORDER BY id",
    )
    .fetch_all(&mut direct)
    .await?;
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

/// Two sentinel permits on `cap2`, each renewed by a heartbeat (one with a
/// lease that outlasts the outage, one that may not), and a session lock,
/// taken by the driver just before the failover and watched by tasks that
/// log to the driver's log like a worker.
async fn hold_through(driver: &PgPool, log: &Log) -> Result<Held, BoxError> {
    let (release, released) = tokio::sync::watch::channel(false);
    let sem = Semaphore::builder("cap2", 2)
        .holder(DRIVER)
        .lease(LEASE)
        .build(driver)
        .await?;
    let mut sentinels = Vec::new();
    for (key, lease) in [
        ("long", Duration::from_secs(6)),
        ("short", Duration::from_secs(1)),
    ] {
        let asked = now_us();
        let permit = sem
            .claim()
            .lease(lease)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .await?;
        let acquired = (asked, now_us());
        let watch = held_by_driver(key, acquired, permit, log.clone(), released.clone());
        sentinels.push(tokio::spawn(watch));
    }
    let guard = Mutex::new(MUTEX).lock_session(driver).await?;
    let lost = guard.lost();
    let mutex_lost = tokio::spawn(async move {
        let _reason = lost.await;
        let at = now_us();
        drop(guard);
        at
    });
    Ok(Held {
        sentinels,
        release,
        mutex_lost,
    })
}

/// In a partition run: a claim on [`CUT_OFF`]'s free slot made while the
/// standby is cut off, held (with a heartbeat) until the sentinels are
/// released. Under asynchronous replication it is acknowledged at once and
/// the new primary lacks it; under synchronous replication its commit waits
/// until the primary is stopped, and it is never acknowledged (logged `N`).
fn claim_cut_off(sem: Semaphore, log: &Log, held: &Held) -> tokio::task::JoinHandle<()> {
    let (log, released) = (log.clone(), held.release.subscribe());
    tokio::spawn(async move {
        let asked = now_us();
        match sem.try_acquire().await {
            Ok(permit) => {
                let acquired = (asked, now_us());
                held_by_driver("cut-off", acquired, permit, log, released).await;
            }
            Err(error) => log.line(format!("N cut-off {} {}", now_us(), one_line(&error))),
        }
    })
}

/// Logs the driver's `permit` as acquired (`acquired`: when it was asked
/// for, and when it was given), and watches it: `L` when it is lost, else
/// released (`E`, `R`) once `released` turns true.
async fn held_by_driver(
    key: &'static str,
    (asked, at): (i64, i64),
    permit: pg_semaphore::Permit,
    log: Log,
    mut released: tokio::sync::watch::Receiver<bool>,
) {
    log.line(format!(
        "A {key} {} {} {} {at} {asked} {}",
        permit.id(),
        permit.semaphore_name(),
        permit.slot(),
        permit.acquired_at().timestamp_micros()
    ));
    tokio::select! {
        reason = permit.lost() => {
            log.line(format!("L {key} {} {reason:?}", now_us()));
        }
        _ = async { released.wait_for(|r| *r).await.map(|_| ()) } => {
            log.line(format!("E {key} {}", now_us()));
            log.line(format!("R {key} {}", release_outcome(permit.release().await)));
        }
    }
}

// ---------------------------------------------------------------- checker --

/// When the failover's steps happened (µs, the shared clock).
struct Times {
    partitioned: Option<i64>,
    stopped: i64,
    promoted: i64,
    switched: i64,
    mutex_lost: i64,
    /// When the final reap began: every claim whose lease had ended by then
    /// has an outcome.
    reaped: i64,
}

/// A claim as its holder saw it.
#[derive(Debug, Clone)]
struct Claim {
    worker: String,
    key: String,
    id: i64,
    semaphore: String,
    slot: u32,
    /// When the holder was told it held the permit.
    at: i64,
    /// When its acquire began.
    asked: i64,
    /// The database's `created_at`, as the claim returned it.
    created: i64,
    /// When the holder stopped work (E or L).
    end: Option<i64>,
    /// What release said, or the lost reason.
    outcome: Option<String>,
    lost: bool,
}

#[derive(Debug, Default)]
struct Logs {
    claims: Vec<Claim>,
    timeouts: Vec<String>,
    cancellations: u64,
    /// Claims the driver made while the standby was cut off, and that were
    /// never acknowledged (`N` lines).
    refused: usize,
    /// Every database error a worker saw: µs, and the message.
    errors: Vec<(i64, String)>,
}

fn read_logs(dir: &Path) -> std::io::Result<Logs> {
    let mut logs = Logs::default();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "log") {
            continue;
        }
        let worker = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut by_key: HashMap<String, usize> = HashMap::new();
        for line in std::fs::read_to_string(&path)?.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let int = |i: usize| fields.get(i).and_then(|f| f.parse::<i64>().ok());
            let key = fields.get(1).map(|k| (*k).to_owned()).unwrap_or_default();
            match fields[0] {
                "A" => {
                    if let (Some(id), Some(sem), Some(slot), Some(at), Some(asked), Some(created)) =
                        (int(2), fields.get(3), int(4), int(5), int(6), int(7))
                    {
                        by_key.insert(key.clone(), logs.claims.len());
                        logs.claims.push(Claim {
                            worker: worker.clone(),
                            key,
                            id,
                            semaphore: (*sem).to_owned(),
                            slot: slot as u32,
                            at,
                            asked,
                            created,
                            end: None,
                            outcome: None,
                            lost: false,
                        });
                    }
                }
                "E" => {
                    if let (Some(&i), Some(at)) = (by_key.get(&key), int(2)) {
                        logs.claims[i].end = Some(at);
                    }
                }
                "L" => {
                    if let (Some(&i), Some(at)) = (by_key.get(&key), int(2)) {
                        let claim = &mut logs.claims[i];
                        claim.end = Some(at);
                        claim.outcome = Some(format!("lost {}", fields[3..].join(" ")));
                        claim.lost = true;
                    }
                }
                "R" => {
                    if let Some(&i) = by_key.get(&key) {
                        logs.claims[i].outcome = Some(fields[2..].join(" "));
                    }
                }
                "T" => logs.timeouts.push(line.to_owned()),
                "C" => logs.cancellations += 1,
                "N" => logs.refused += 1,
                "X" => {
                    if let Some(at) = int(1) {
                        logs.errors.push((at, fields[2..].join(" ")));
                    }
                }
                _ => {}
            }
        }
    }
    Ok(logs)
}

#[derive(sqlx::FromRow)]
struct SlotRow {
    id: i64,
    semaphore: String,
    slot: i32,
    holder: String,
    created_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    completed_at: Option<DateTime<Utc>>,
    timed_out_at: Option<DateTime<Utc>>,
}

impl SlotRow {
    /// When the claim stopped holding its slot on this server (its lease's
    /// end if it is still live).
    fn end(&self) -> i64 {
        us(self
            .completed_at
            .or(self.timed_out_at)
            .unwrap_or(self.expires_at))
    }
}

fn us(at: DateTime<Utc>) -> i64 {
    at.timestamp_micros()
}

/// What one failover (or several, summed) showed.
#[derive(Debug)]
struct Report {
    scenario: Scenario,
    runs: u32,
    /// Claims workers (and the driver) were given.
    acknowledged: usize,
    /// Of those, given before the primary was stopped.
    acknowledged_before: usize,
    /// Of those, created after the replication link was partitioned.
    acknowledged_partitioned: usize,
    /// Acknowledged claims not on the new primary (no row with their id, or
    /// the id was handed out again to another claim).
    missing: usize,
    /// Of the missing, ids the new primary handed out again.
    ids_reused: usize,
    /// Releases acknowledged `ok` whose claim is not completed on the new primary.
    releases_acknowledged: usize,
    releases_lost: usize,
    /// Claims whose row on the new primary ended before their holder
    /// stopped (a lost renewal), and of those, claims whose holder was never
    /// told the permit was lost.
    ended_early: usize,
    ended_early_untold: usize,
    /// Over-admissions on the workers' clocks: episodes with more holders
    /// than capacity, and with a slot held twice; their total lengths; and
    /// what each was.
    over_capacity: usize,
    over_capacity_us: i64,
    slots_twice: usize,
    slots_twice_us: i64,
    episodes: Vec<String>,
    /// Sentinels renewed on the new primary, and reported lost.
    sentinels_renewed: usize,
    sentinels_lost: usize,
    sentinels_missing: usize,
    /// The driver's claim made while the standby was cut off (partition
    /// runs): acknowledged, and of those missing on the new primary; or not
    /// acknowledged.
    cut_off_acknowledged: usize,
    cut_off_missing: usize,
    cut_off_refused: usize,
    /// Claims served after the switch; acquires begun before it and served after.
    served_after: usize,
    waited_through: usize,
    errors: usize,
    /// The kinds of those errors (their first words), with counts.
    error_kinds: BTreeMap<String, usize>,
    /// ms from stopping the primary: promoted, router switched, mutex reported lost.
    promote_ms: i64,
    switch_ms: i64,
    mutex_lost_ms: i64,
}

impl Default for Report {
    fn default() -> Report {
        Report {
            scenario: Scenario::Crash,
            runs: 0,
            acknowledged: 0,
            acknowledged_before: 0,
            acknowledged_partitioned: 0,
            missing: 0,
            ids_reused: 0,
            releases_acknowledged: 0,
            releases_lost: 0,
            ended_early: 0,
            ended_early_untold: 0,
            over_capacity: 0,
            over_capacity_us: 0,
            slots_twice: 0,
            slots_twice_us: 0,
            episodes: Vec::new(),
            sentinels_renewed: 0,
            sentinels_lost: 0,
            sentinels_missing: 0,
            cut_off_acknowledged: 0,
            cut_off_missing: 0,
            cut_off_refused: 0,
            served_after: 0,
            waited_through: 0,
            errors: 0,
            error_kinds: BTreeMap::new(),
            promote_ms: 0,
            switch_ms: 0,
            mutex_lost_ms: 0,
        }
    }
}

impl Report {
    fn add(&mut self, other: &Report) {
        self.runs += other.runs;
        self.acknowledged += other.acknowledged;
        self.acknowledged_before += other.acknowledged_before;
        self.acknowledged_partitioned += other.acknowledged_partitioned;
        self.missing += other.missing;
        self.ids_reused += other.ids_reused;
        self.releases_acknowledged += other.releases_acknowledged;
        self.releases_lost += other.releases_lost;
        self.ended_early += other.ended_early;
        self.ended_early_untold += other.ended_early_untold;
        self.over_capacity += other.over_capacity;
        self.over_capacity_us += other.over_capacity_us;
        self.slots_twice += other.slots_twice;
        self.slots_twice_us += other.slots_twice_us;
        self.episodes.extend(other.episodes.iter().cloned());
        self.sentinels_renewed += other.sentinels_renewed;
        self.sentinels_lost += other.sentinels_lost;
        self.sentinels_missing += other.sentinels_missing;
        self.cut_off_acknowledged += other.cut_off_acknowledged;
        self.cut_off_missing += other.cut_off_missing;
        self.cut_off_refused += other.cut_off_refused;
        self.served_after += other.served_after;
        self.waited_through += other.waited_through;
        self.errors += other.errors;
        for (kind, n) in &other.error_kinds {
            *self.error_kinds.entry(kind.clone()).or_default() += n;
        }
        self.promote_ms = self.promote_ms.max(other.promote_ms);
        self.switch_ms = self.switch_ms.max(other.switch_ms);
        self.mutex_lost_ms = self.mutex_lost_ms.max(other.mutex_lost_ms);
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let max = if self.runs > 1 { " (max)" } else { "" };
        writeln!(
            f,
            "{} acknowledged claims ({} before the primary stopped, {} after the standby was cut \
             off); {} missing on the new primary ({} ids handed out again); {} acknowledged \
             releases, {} lost; {} leases ended on the new primary while their holders worked \
             ({} holders never told)",
            self.acknowledged,
            self.acknowledged_before,
            self.acknowledged_partitioned,
            self.missing,
            self.ids_reused,
            self.releases_acknowledged,
            self.releases_lost,
            self.ended_early,
            self.ended_early_untold,
        )?;
        writeln!(
            f,
            "    over-admissions: {} over capacity ({} ms in all), {} slots held twice ({} ms); \
             sentinels: {} renewed on the new primary, {} reported lost, {} missing; claims made \
             while the standby was cut off: {} acknowledged ({} missing), {} never acknowledged",
            self.over_capacity,
            self.over_capacity_us / 1000,
            self.slots_twice,
            self.slots_twice_us / 1000,
            self.sentinels_renewed,
            self.sentinels_lost,
            self.sentinels_missing,
            self.cut_off_acknowledged,
            self.cut_off_missing,
            self.cut_off_refused,
        )?;
        write!(
            f,
            "    {} claims served after the switch ({} by acquires begun before it); {} database \
             errors seen by workers {:?}; promoted {} ms and switched {} ms after the stop{max}, \
             session mutex reported lost after {} ms{max}",
            self.served_after,
            self.waited_through,
            self.errors,
            self.error_kinds,
            self.promote_ms,
            self.switch_ms,
            self.mutex_lost_ms,
        )?;
        for episode in &self.episodes {
            write!(f, "\n    over-admission: {episode}")?;
        }
        Ok(())
    }
}

/// Checks one failover from the workers' logs and the new primary's audit
/// log, asserting what holds whatever the replication, and counting what
/// the replication decides (the callers assert those counts).
fn check(
    mode: Replication,
    scenario: Scenario,
    rows: &[SlotRow],
    logs: &Logs,
    times: &Times,
) -> Report {
    let sync = mode == Replication::Synchronous;
    let capacity: HashMap<&str, u32> = checked_semaphores().collect();
    let by_id: HashMap<i64, &SlotRow> = rows.iter().map(|r| (r.id, r)).collect();
    let mut error_kinds = BTreeMap::new();
    for (_, message) in &logs.errors {
        let kind: Vec<&str> = message.split(' ').take(4).collect();
        *error_kinds.entry(kind.join(" ")).or_default() += 1;
    }
    let mut report = Report {
        scenario,
        runs: 1,
        error_kinds,
        acknowledged: logs.claims.len(),
        promote_ms: (times.promoted - times.stopped) / 1000,
        switch_ms: (times.switched - times.stopped) / 1000,
        mutex_lost_ms: (times.mutex_lost - times.stopped) / 1000,
        errors: logs.errors.len(),
        cut_off_refused: logs.refused,
        ..Report::default()
    };

    // 1. The new primary's table is consistent, whatever it lost: at most
    //    one outcome per claim, never more than capacity, never a slot twice.
    for row in rows {
        assert!(
            !(row.completed_at.is_some() && row.timed_out_at.is_some()),
            "claim {} has two outcomes",
            row.id
        );
        assert!(
            row.completed_at.is_some()
                || row.timed_out_at.is_some()
                || us(row.expires_at) > times.reaped,
            "claim {} is live past its lease after the reap",
            row.id
        );
    }
    for (name, cap) in checked_semaphores() {
        let mine: Vec<&SlotRow> = rows.iter().filter(|r| r.semaphore == name).collect();
        let max = max_overlap(mine.iter().map(|r| (us(r.created_at), r.end())));
        assert!(
            max <= cap as usize,
            "{name}: {max} claims overlapped in the new primary's table, capacity {cap}"
        );
        let mut per_slot: HashMap<i32, Vec<(i64, i64)>> = HashMap::new();
        for row in &mine {
            per_slot
                .entry(row.slot)
                .or_default()
                .push((us(row.created_at), row.end()));
        }
        for (slot, intervals) in per_slot {
            assert!(
                max_overlap(intervals) <= 1,
                "{name}: slot {slot} was held twice at once in the new primary's table"
            );
        }
    }

    // 2. Every claim a holder was told about, against the new primary.
    //    `unprotected`: why the new primary did not hold the claim's slot for
    //    as long as its holder worked, if it did not.
    let mut unprotected: Vec<Option<&'static str>> = vec![None; logs.claims.len()];
    for (i, claim) in logs.claims.iter().enumerate() {
        let end = claim.end.unwrap_or_else(|| {
            panic!(
                "claim {} ({} of {}) never ended",
                claim.id, claim.key, claim.worker
            )
        });
        assert!(capacity.contains_key(claim.semaphore.as_str()), "{claim:?}");
        if claim.at < times.stopped {
            report.acknowledged_before += 1;
        }
        // Created after the standby was cut off: the standby never saw it.
        // Under synchronous replication it cannot have been acknowledged;
        // under asynchronous, it was, and the new primary must lack it.
        let partitioned = times
            .partitioned
            .is_some_and(|at| claim.created > at && claim.created < times.stopped);
        if partitioned {
            report.acknowledged_partitioned += 1;
            assert!(
                !sync,
                "claim {} ({} of {}) was acknowledged while the synchronous standby was cut off",
                claim.id, claim.key, claim.worker
            );
        }
        let sentinel = claim.worker == DRIVER && claim.key != "cut-off";
        let cut_off = claim.worker == DRIVER && claim.key == "cut-off";
        report.cut_off_acknowledged += usize::from(cut_off);
        let row = by_id.get(&claim.id).filter(|row| {
            row.holder == claim.worker
                && row.semaphore == claim.semaphore
                && row.slot as u32 == claim.slot
                && us(row.created_at) == claim.created
        });
        assert!(
            !(partitioned && row.is_some()),
            "claim {} was created after the standby was cut off, yet the new primary has it",
            claim.id
        );
        let Some(row) = row else {
            unprotected[i] = Some("missing on the new primary");
            report.missing += 1;
            if by_id.contains_key(&claim.id) {
                report.ids_reused += 1;
            }
            if sentinel {
                report.sentinels_missing += 1;
            }
            report.cut_off_missing += usize::from(cut_off);
            continue;
        };
        if claim.outcome.as_deref() == Some("ok") {
            report.releases_acknowledged += 1;
            if row.completed_at.is_none() {
                report.releases_lost += 1;
            }
        }
        if row.end() < end {
            // Its lease ended on the new primary before its holder stopped:
            // a renewal the holder was told about is missing (or the holder
            // heard too late that the permit was lost).
            unprotected[i] = Some("its lease ended on the new primary while its holder worked");
            report.ended_early += 1;
            report.ended_early_untold += usize::from(!claim.lost);
        }
        if sync {
            // What the holder was told matches the new primary.
            match claim.outcome.as_deref() {
                Some("ok") => assert!(
                    row.completed_at.is_some(),
                    "claim {}: released ok on the old primary, not completed on the new one",
                    claim.id
                ),
                Some(told) if told.contains("TimedOut") => assert!(
                    row.timed_out_at.is_some(),
                    "claim {}: told {told}, not timed out",
                    claim.id
                ),
                Some(told) if told.contains("AlreadyReleased") => assert!(
                    row.completed_at.is_some(),
                    "claim {}: told {told}, not completed",
                    claim.id
                ),
                _ => {}
            }
        }
        if sentinel {
            if claim.lost {
                report.sentinels_lost += 1;
            } else {
                // Held through the failover, never told it was lost, and
                // released ok: its heartbeat renewed it on the new primary.
                assert_eq!(
                    claim.outcome.as_deref(),
                    Some("ok"),
                    "sentinel {}: neither renewed nor reported lost",
                    claim.key
                );
                assert!(
                    us(row.expires_at) > times.switched,
                    "sentinel {}: released ok, but never renewed on the new primary",
                    claim.key
                );
                report.sentinels_renewed += 1;
            }
        }
    }
    let sentinels = logs
        .claims
        .iter()
        .filter(|c| c.worker == DRIVER && c.key != "cut-off")
        .count();
    assert_eq!(
        sentinels, 2,
        "the driver's sentinels are missing from its log"
    );

    // 3. Holders on the workers' own clocks: more than capacity (or two on a
    //    slot) is an over-admission. Each must involve a claim the new
    //    primary did not protect (lost it, or let it end while its holder
    //    worked): with everything acknowledged on the new primary, the
    //    database's limit holds across the failover.
    for (name, cap) in checked_semaphores() {
        let mine: Vec<usize> = (0..logs.claims.len())
            .filter(|&i| logs.claims[i].semaphore == name)
            .collect();
        for episode in over_admissions(logs, &unprotected, &mine, cap as usize, times) {
            report.over_capacity += 1;
            report.over_capacity_us += episode.length;
            report.episodes.push(format!("{name}: {}", episode.what));
        }
        let mut slots: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for &i in &mine {
            slots.entry(logs.claims[i].slot).or_default().push(i);
        }
        for (slot, on_slot) in slots {
            for episode in over_admissions(logs, &unprotected, &on_slot, 1, times) {
                report.slots_twice += 1;
                report.slots_twice_us += episode.length;
                report
                    .episodes
                    .push(format!("{name} slot {slot}: {}", episode.what));
            }
        }
    }

    // 4. A holder told its permit was lost was told before the new primary
    //    gave its slot to anyone else.
    if sync {
        let mut next_on_slot: HashMap<i64, i64> = HashMap::new();
        let mut last_on_slot: HashMap<(&str, i32), &SlotRow> = HashMap::new();
        for row in rows {
            if let Some(previous) = last_on_slot.insert((row.semaphore.as_str(), row.slot), row) {
                next_on_slot.insert(previous.id, us(row.created_at));
            }
        }
        for claim in logs.claims.iter().filter(|c| c.lost) {
            if let (Some(next), Some(told)) = (next_on_slot.get(&claim.id), claim.end) {
                assert!(
                    *next > told,
                    "claim {}'s slot went to another holder {} µs before its holder was told",
                    claim.id,
                    told - next
                );
            }
        }
    }

    // 5. The load went on on the new primary: every semaphore and every
    //    worker served after the switch, and no acquire hung.
    let after: Vec<&Claim> = logs
        .claims
        .iter()
        .filter(|c| c.at > times.switched && c.worker != DRIVER)
        .collect();
    report.served_after = after.len();
    report.waited_through = after.iter().filter(|c| c.asked < times.switched).count();
    let semaphores: HashSet<&str> = after.iter().map(|c| c.semaphore.as_str()).collect();
    let workers: HashSet<&str> = after.iter().map(|c| c.worker.as_str()).collect();
    for (name, _) in SEMAPHORES {
        assert!(
            semaphores.contains(name),
            "{name} served no claim after the switch"
        );
    }
    assert_eq!(
        workers.len(),
        WORKERS,
        "some workers were not served after the switch: {workers:?}"
    );
    assert!(
        logs.timeouts.is_empty(),
        "acquires timed out (a hang): {:?}",
        logs.timeouts
    );
    report
}

/// An over-admission: its length (µs), and what it was.
struct Episode {
    length: i64,
    what: String,
}

/// Over-admission episodes among `claims` (indexes into `logs.claims`) on
/// the holders' clocks, with more than `limit` open at once. Panics if one
/// involves only claims the new primary protected (see `unprotected`).
fn over_admissions(
    logs: &Logs,
    unprotected: &[Option<&'static str>],
    claims: &[usize],
    limit: usize,
    times: &Times,
) -> Vec<Episode> {
    // Ends sort before starts at the same instant: a hand-over is not an overlap.
    let mut events: Vec<(i64, i32, usize)> = Vec::new();
    for &i in claims {
        let claim = &logs.claims[i];
        events.push((claim.at, 1, i));
        events.push((claim.end.unwrap_or(claim.at), -1, i));
    }
    events.sort();
    let mut open: HashSet<usize> = HashSet::new();
    let mut episodes = Vec::new();
    let mut current: Option<(i64, usize, BTreeMap<String, &str>)> = None;
    for (at, delta, i) in events {
        if delta > 0 {
            open.insert(i);
        } else {
            open.remove(&i);
        }
        if open.len() > limit {
            let holders: Vec<&Claim> = open.iter().map(|&j| &logs.claims[j]).collect();
            assert!(
                open.iter().any(|&j| unprotected[j].is_some()),
                "{} holders at once, each held on the new primary: {holders:#?}",
                open.len()
            );
            let (_, most, culprits) = current.get_or_insert_with(|| (at, 0, BTreeMap::new()));
            *most = (*most).max(open.len());
            for &j in &open {
                if let Some(why) = unprotected[j] {
                    let claim = &logs.claims[j];
                    culprits.insert(
                        format!("{} of {} (id {})", claim.key, claim.worker, claim.id),
                        why,
                    );
                }
            }
        } else if let Some((from, most, culprits)) = current.take() {
            episodes.push(Episode {
                length: at - from,
                what: format!(
                    "{most} holders for {} ms from {} ms after the switch; not held by the new \
                     primary: {culprits:?}",
                    (at - from) / 1000,
                    (from - times.switched) / 1000,
                ),
            });
        }
    }
    episodes
}
