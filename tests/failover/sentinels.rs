//! What the driver holds through each failover: two sentinel permits with
//! heartbeats on `cap2`, a session mutex, and in partition runs a claim made
//! while the standby is cut off. Their tasks log to the driver's log like a
//! worker's (format in [`worker`](crate::worker)).

use std::time::Duration;

use pg_semaphore::{Mutex, Semaphore};
use sqlx::PgPool;

use crate::support::BoxError;
use crate::support::chaos::{self, Log, now_us, one_line};
use crate::{ACQUIRE_TIMEOUT, DRIVER, LEASE, MUTEX};

/// The driver's own permits and mutex, held through the failover.
pub struct Held {
    pub sentinels: Vec<tokio::task::JoinHandle<()>>,
    pub release: tokio::sync::watch::Sender<bool>,
    pub mutex_lost: tokio::task::JoinHandle<i64>,
}

/// Two sentinel permits on `cap2`, each renewed by a heartbeat (one with a
/// lease that outlasts the outage, one that may not), and a session lock,
/// taken by the driver just before the failover and watched by tasks that
/// log to the driver's log like a worker.
pub async fn hold_through(driver: &PgPool, log: &Log) -> Result<Held, BoxError> {
    let (release, released) = tokio::sync::watch::channel(false);
    let sem = Semaphore::builder("cap2", 2)
        .lease(LEASE)
        .build(&pg_semaphore::Client::new(driver.clone()).holder(DRIVER))
        .await?;
    let mut sentinels = Vec::new();
    for (key, lease) in [
        ("long", Duration::from_secs(6)),
        ("short", Duration::from_secs(1)),
    ] {
        let asked = now_us();
        let permit = sem
            .acquiring()
            .lease(lease)
            .timeout(ACQUIRE_TIMEOUT)
            .acquire()
            .await?;
        let acquired = (asked, now_us());
        let watch = held_by_driver(key, acquired, permit, log.clone(), released.clone());
        sentinels.push(tokio::spawn(watch));
    }
    let guard = Mutex::new(MUTEX)
        .locking()
        .lock_session(&pg_semaphore::Client::new(driver.clone()))
        .await?;
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

/// In a partition run: a claim on [`CUT_OFF`](crate::CUT_OFF)'s free slot
/// made while the standby is cut off, held (with a heartbeat) until the
/// sentinels are released. Under asynchronous replication it is
/// acknowledged at once and the new primary lacks it; under synchronous
/// replication its commit waits until the primary is stopped, and it is
/// never acknowledged (logged `N`).
pub fn claim_cut_off(sem: Semaphore, log: &Log, held: &Held) -> tokio::task::JoinHandle<()> {
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
    let released = async {
        let _ = released.wait_for(|r| *r).await;
    };
    chaos::hold(permit, key, &log, released).await;
}
