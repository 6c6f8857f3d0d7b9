//! The torture test: several worker processes, each with many tasks, hammer
//! three lease semaphores (capacities 1, 3 and 16), two advisory semaphores
//! (capacities 1 and 4, heartbeat 250 ms) and a mutex with random hold
//! times, while a chaos driver SIGKILLs whole workers mid-hold, terminates
//! random backends (LISTEN connections and advisory sessions holding slots
//! included), crashes and restarts the PostgreSQL server once (when the
//! harness owns it), and a reaper runs. Workers cancel their own acquires at
//! random points, and now and then drop an advisory permit instead of
//! releasing it. The driver logs what it did, with timestamps
//! (`chaos.events`: kills, terminated backend pids, the crash).
//!
//! An independent checker then asserts, from the workers' own timestamps, the
//! driver's events, the slot table and the audit logs:
//! - never more than `capacity` holders at any instant, never two holders of
//!   a slot, never two holders of the mutex (and no lost update under it);
//!   for an advisory semaphore, a hold lasts from its lock to the earliest of
//!   its end of work, its lost notice, the end of its backend (terminated, or
//!   the crash) and its worker's death: a slot is free the moment its backend
//!   ends, while its holder learns of it only at its next heartbeat, so the
//!   holds cut short that way are counted and printed, not hidden;
//! - every slot of a killed holder was freed within lease + reaper interval
//!   (plus a slack for scheduling and the restart); a killed worker's
//!   advisory slots were free within a second;
//! - an advisory holder whose backend ended was told within two heartbeats
//!   (plus a slack for scheduling), unless its work ended or its worker died
//!   first;
//! - every claim a worker was given is in the audit log with exactly one
//!   outcome, matching what the worker was told; every row of the advisory
//!   audit log is a hold its worker logged, with the outcome the worker saw,
//!   and a worker that stopped normally has a row for each of its holds (a
//!   killed worker's queued rows are lost, as documented);
//! - no acquire hung (timed out) and no worker failed to stop;
//! - after the chaos, every semaphore serves again at full capacity.
//!
//! It prints the counts so a reviewer sees what was exercised. Runs in about
//! a minute; `PGSEM_TORTURE_SECS` lengthens the chaos phase. The logs are in
//! the directory it prints first, kept when an assertion fails.
//!
//! The program, a file a role: [`worker`] (a worker process: this test
//! binary run again for [`torture_worker_entry_point`]), [`driver`] (the
//! chaos, then the calm), [`logs`] (what the workers and the driver wrote,
//! read back), [`checker`] (the lease semaphores and the mutex) and
//! [`advisory_checker`] (the advisory semaphores). What it shares with
//! `tests/failover/` (the processes, the logs, the clock) is
//! `support::chaos`.

#[path = "../support/mod.rs"]
mod support;

mod advisory_checker;
mod checker;
mod driver;
mod logs;
mod worker;

use std::time::Duration;

use support::TestResult;
use support::chaos::WorkerArgs;

/// The semaphores under test: (name, capacity).
const SEMAPHORES: [(&str, u32); 3] = [("cap1", 1), ("cap3", 3), ("cap16", 16)];
/// The advisory semaphores under test: (name, capacity).
const ADVISORY: [(&str, u32); 2] = [("adv1", 1), ("adv4", 4)];
const MUTEX: &str = "torture-mutex";
const LEASE: Duration = Duration::from_secs(2);
const REAP_EVERY: Duration = Duration::from_millis(250);
/// The advisory sessions' heartbeat: short, so that a holder whose backend
/// ends is told within the run (the server's `idle_session_timeout` is then
/// its floor of 1 s, four heartbeats).
const HEARTBEAT: Duration = Duration::from_millis(250);
/// How long past two heartbeats a holder may learn that its backend ended.
/// Two heartbeats is the library's bound: a session that answered just
/// before its backend ended skips the next tick (it answered within the
/// heartbeat) and pings at the one after. The slack is scheduling: the tick,
/// the failed ping and the holder's wake-up each need a thread of a worker
/// process, on 2 cores shared by 3 to 4 workers (2 runtime threads each),
/// about 40 backends, the driver, a crash recovery and whatever else runs
/// on the machine. Six runs measured at most 216 to 422 ms from a backend's
/// end to its holder's notice (the report prints the largest), under two
/// heartbeats; the bound, 1 s, is also when the server would end a silent
/// session.
const TOLD_SLACK: Duration = Duration::from_millis(500);
/// How long after a worker's SIGKILL its advisory slots must be free: its
/// sessions' sockets close with the process, and each backend ends as soon
/// as it reads the end of the stream (the slack is scheduling).
const KILL_FREES_WITHIN: Duration = Duration::from_secs(1);
/// An acquire that waits this long is a hang: holds last at most 1.5 s, and
/// a killed holder's slot is free again after about LEASE + REAP_EVERY.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(15);
const WORKERS: usize = 3;
const SEMAPHORE_TASKS: usize = 8;
const ADVISORY_TASKS: usize = 6;
const MUTEX_TASKS: usize = 2;

/// The prefix of the environment variables that make a process a worker
/// (see [`WorkerArgs`]).
const WORKER_ENV: &str = "PGSEM_TORTURE";
/// The test a worker process runs: [`torture_worker_entry_point`].
const WORKER_ENTRY_POINT: &str = "torture_worker_entry_point";

/// A worker process, when the driver runs this binary for this test (see
/// [`worker`]); nothing in a normal test run.
#[test]
fn torture_worker_entry_point() {
    WorkerArgs::run(WORKER_ENV, worker::worker);
}

/// The chaos and the checks; see the [crate docs](self).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torture() -> TestResult {
    driver::torture().await
}
