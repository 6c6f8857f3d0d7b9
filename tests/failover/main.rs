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
//!
//! The program, a file a role: [`worker`] (a worker process: this test
//! binary run again for [`failover_worker_entry_point`]), [`driver`] (the
//! failovers), [`sentinels`] (the driver's own permits and mutex, held
//! through each), [`logs`] (what the workers and the driver logged, read
//! back), [`checker`] (one failover checked against the new primary) and
//! [`report`] (what it counted). What it shares with `tests/torture/` (the
//! processes, the logs, the clock, the slot table's checks) is
//! `support::chaos`.

#[path = "../support/mod.rs"]
mod support;

mod checker;
mod driver;
mod logs;
mod report;
mod sentinels;
mod worker;

use std::time::Duration;

use support::TestResult;
use support::chaos::WorkerArgs;
use testkit::replica::Replication;

use crate::driver::failovers;

/// The semaphores under test: (name, capacity). Workers wait for `cap1` and
/// `cap3`; `cap2` holds the driver's two sentinels through the failover, and
/// workers probe it with `try_acquire`: one of them admitted while a
/// sentinel believes it holds its slot is an over-admission.
const SEMAPHORES: [(&str, u32); 3] = [("cap1", 1), ("cap3", 3), ("cap2", 2)];
/// The semaphore of the driver's claim made while the standby is cut off
/// (see [`claim_cut_off`](sentinels::claim_cut_off)): no worker uses it, so its slot is free and the
/// claim is one round trip, whatever the workers hold. On a contended
/// semaphore the claim, and every worker's, could find no slot for the
/// whole window, and the run then measured nothing.
const CUT_OFF: (&str, u32) = ("cut-off", 1);

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
/// The prefix of the environment variables that make a process a worker
/// (see [`WorkerArgs`]).
const WORKER_ENV: &str = "PGSEM_FAILOVER";
/// The test a worker process runs: [`failover_worker_entry_point`].
const WORKER_ENTRY_POINT: &str = "failover_worker_entry_point";

/// Every semaphore the checker checks: the workers', and [`CUT_OFF`].
fn checked_semaphores() -> impl Iterator<Item = (&'static str, u32)> {
    SEMAPHORES.into_iter().chain([CUT_OFF])
}

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

/// A worker process, when the driver runs this binary for this test (see
/// [`worker`]); nothing in a normal test run.
#[test]
fn failover_worker_entry_point() {
    WorkerArgs::run(WORKER_ENV, worker::worker);
}

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
