//! Wake-ups at fleet scale: a release nobody waits for sends no NOTIFY (which
//! PostgreSQL serialises across the whole instance), a waiter that registers
//! while a release is in flight is never left asleep (the wake-up gate: the
//! registration waits for the release, or the release for the
//! registration), and a waiter behind a crashed
//! holder is served when that holder's lease ends, with no reaper and no
//! fallback re-check. Fallbacks are 30 s or more here: only the right
//! wake-up makes a test pass in time.

mod support;

use std::time::Duration;

use pg_semaphore::Semaphore;
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection, PgPool};
use support::TestResult;
use tokio::time::Instant;

const FAR: Duration = Duration::from_secs(30);

/// A LISTEN connection on the crate's channel, as an outside observer.
async fn observer(db: &support::TestDb) -> sqlx::Result<PgListener> {
    let mut listener = PgListener::connect_with(&db.pool).await?;
    listener.listen("pgsemaphore").await?;
    Ok(listener)
}

/// The next notification within `within`, if any.
async fn next_notification(listener: &mut PgListener, within: Duration) -> Option<String> {
    match tokio::time::timeout(within, listener.recv()).await {
        Ok(Ok(notification)) => Some(notification.payload().to_owned()),
        _ => None,
    }
}

async fn registered(pool: &PgPool, semaphore: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pgsemaphore.wakeups \
                         WHERE semaphore = $1 AND until > clock_timestamp())",
    )
    .bind(semaphore)
    .fetch_one(pool)
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_nobody_waits_for_sends_no_notification() -> TestResult {
    let db = support::migrated_db().await;
    let mut listener = observer(&db).await?;
    let sem = Semaphore::builder("quiet", 1)
        .build(&db.client.clone().fallback_interval(FAR))
        .await?;
    for _ in 0..5 {
        sem.try_acquire().await?.release().await?;
    }
    sem.try_acquire_many(1).await?.release().await?;
    assert_eq!(
        next_notification(&mut listener, Duration::from_millis(500)).await,
        None,
        "a release nobody waited for sent a NOTIFY"
    );
    assert!(!registered(&db.pool, "quiet").await?);

    // Someone waits: then the release notifies.
    let held = sem.try_acquire().await?;
    let other = support::another_pool(&db, 2).await;
    let waiting = Semaphore::builder("quiet", 1)
        .build(&pg_semaphore::Client::new(other.clone()).fallback_interval(FAR))
        .await?;
    let waiter = tokio::spawn(async move { waiting.acquire().await });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !registered(&db.pool, "quiet").await? {
        assert!(Instant::now() < deadline, "the waiter never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    held.release().await?;
    assert_eq!(
        next_notification(&mut listener, Duration::from_secs(5)).await,
        Some("quiet".to_owned())
    );
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await???
        .release()
        .await?;
    let _ = next_notification(&mut listener, Duration::from_millis(200)).await;

    // Its last waiter gone, the process takes its registration back at once
    // (not when its lease ends): releases are quiet again.
    let deadline = Instant::now() + Duration::from_secs(2);
    while registered(&db.pool, "quiet").await? {
        assert!(
            Instant::now() < deadline,
            "the registration outlived the last waiter"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sem.try_acquire().await?.release().await?;
    assert_eq!(
        next_notification(&mut listener, Duration::from_millis(500)).await,
        None,
        "a release sent a NOTIFY after the last waiter had left"
    );
    Ok(())
}

/// The key of a semaphore's wake-up gate (see `pgsemaphore.release`),
/// as `pg_locks` shows it: a two-int advisory lock.
const GATE_CLASS: i64 = 1_885_828_965;

/// Whether a backend waits for `semaphore`'s wake-up gate right now.
async fn waits_for_gate(pool: &PgPool, semaphore: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks \
                         WHERE locktype = 'advisory' AND NOT granted AND objsubid = 2 \
                           AND classid::bigint = $1 \
                           AND objid::bigint = hashtext($2)::bigint & 4294967295)",
    )
    .bind(GATE_CLASS)
    .bind(semaphore)
    .fetch_one(pool)
    .await
}

async fn until_waiting_for_gate(pool: &PgPool, semaphore: &str) {
    let waiting = support::eventually(Duration::from_secs(10), || async {
        waits_for_gate(pool, semaphore)
            .await
            .expect("read pg_locks")
    })
    .await;
    assert!(waiting, "nobody waited for the gate");
}

/// Interleaving: a release R is in flight (its UPDATE and its check for
/// waiters done, not committed) while a waiter W claims, finds the slot
/// taken (R's row is still live in its snapshot) and registers for
/// wake-ups. R found no registration and will send nothing; were W's
/// registration to commit now, W would sleep until its fallback. R holds
/// its semaphore's wake-up gate until it ends (`pgsemaphore.release`),
/// and W's registration waits for it, so the claim W makes after
/// registering comes after R's commit and sees the free slot. The release
/// runs step by step here, in an open transaction, to pause before its
/// commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_waits_for_a_release_in_flight_that_saw_no_waiter() -> TestResult {
    let db = support::migrated_db().await;
    let mut listener = observer(&db).await?;
    Semaphore::builder("racing", 1)
        .build(&db.client.clone().fallback_interval(FAR))
        .await?;
    let token = b"racing-holder-01".to_vec();
    let id = support::claim_with_token(&db.pool, "racing", "90 s", &token).await?;

    // R: the release, paused before its commit. Nobody is registered yet,
    // so it leaves no wake-up to send after its commit.
    let mut release = PgConnection::connect_with(&db.options).await?;
    sqlx::query("BEGIN").execute(&mut release).await?;
    let (outcome, wake): (String, bool) = sqlx::query_as(
        "SELECT o_outcome, o_wake FROM pgsemaphore.release(p_ids => ARRAY[$1], p_token => $2)",
    )
    .bind(id)
    .bind(&token)
    .fetch_one(&mut release)
    .await?;
    assert_eq!((outcome.as_str(), wake), ("released", false));

    // W: claims (refused: R is not committed), then registers: that waits
    // for R's gate.
    let other = support::another_pool(&db, 2).await;
    let waiting = Semaphore::builder("racing", 1)
        .build(&pg_semaphore::Client::new(other.clone()).fallback_interval(FAR))
        .await?;
    let waiter = tokio::spawn(async move { waiting.acquire().await });
    until_waiting_for_gate(&db.pool, "racing").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "admitted before the release committed"
    );
    assert!(
        !registered(&db.pool, "racing").await?,
        "the registration committed while a release that did not see it was in flight"
    );

    // R commits, and sends nothing: W's registration commits after it, and
    // W's claim after that sees the free slot.
    sqlx::query("COMMIT").execute(&mut release).await?;
    let permit = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .map_err(|_| "the waiter slept through a release that committed as it registered")???;
    assert_eq!(
        next_notification(&mut listener, Duration::from_millis(200)).await,
        None,
        "the release notified although it saw no waiter"
    );
    permit.release().await?;
    release.close().await?;
    Ok(())
}

/// Interleaving, the other order: a waiter's registration has taken the
/// wake-up gate and is not committed yet when a release R (what
/// `Permit::release` runs: `CALL pgsemaphore.release_then_wake`) comes to
/// look for waiters. R never waits at the gate (a session that held it
/// would stall every release): it finds it taken, so it leaves the check to
/// after its commit (`o_wake`), and the waiter, whose registration commits
/// after R's check, claims after that and sees the slot R freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_meeting_a_registration_in_flight_never_waits_and_misses_nobody() -> TestResult {
    let db = support::migrated_db().await;
    Semaphore::builder("racing-2", 1)
        .build(&db.client.clone().fallback_interval(FAR))
        .await?;
    let token = b"racing-holder-02".to_vec();
    let id = support::claim_with_token(&db.pool, "racing-2", "90 s", &token).await?;

    // W: a registration, paused before its commit (it holds the gate).
    let mut registration = PgConnection::connect_with(&db.options).await?;
    sqlx::query("BEGIN").execute(&mut registration).await?;
    sqlx::query(
        "SELECT pgsemaphore.keep_waiting(p_semaphore => 'racing-2', p_lease => interval '10 s', \
                                         p_tickets => '{}', p_token => 'a waiting process'::bytea, \
                                         p_register => true, p_spell => 1)",
    )
    .execute(&mut registration)
    .await?;

    // R: the release, as the crate sends it: it does not wait.
    let (outcome,): (String,) = tokio::time::timeout(
        Duration::from_secs(1),
        sqlx::query_as("CALL pgsemaphore.release_then_wake(p_ids => ARRAY[$1], p_token => $2, p_lost => false)")
            .bind(id)
            .bind(&token)
            .fetch_one(&db.pool),
    )
    .await
    .map_err(|_| "the release waited for a registration's gate")??;
    assert_eq!(outcome, "released");

    // W commits, then claims: it sees the free slot.
    sqlx::query("COMMIT").execute(&mut registration).await?;
    let claimed =
        support::claim_with_token(&db.pool, "racing-2", "90 s", b"racing-waiter-02").await?;
    assert!(claimed > id);
    registration.close().await?;
    Ok(())
}

/// Under REPEATABLE READ a statement sees the transaction's first snapshot,
/// so a check for waiters inside the release could miss a registration
/// that committed while it waited at the gate: there the release leaves
/// the check to after its commit (`o_wake`), as every other transaction
/// that frees slots does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_repeatable_read_a_release_checks_for_waiters_after_its_commit() -> TestResult {
    let db = support::migrated_db().await;
    Semaphore::builder("snapshot", 1).build(&db.client).await?;
    let token = b"snapshot-holder!".to_vec();
    let id = support::claim_with_token(&db.pool, "snapshot", "90 s", &token).await?;
    let mut conn = db.pool.acquire().await?;
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *conn)
        .await?;
    let (outcome, wake): (String, bool) = sqlx::query_as(
        "SELECT o_outcome, o_wake FROM pgsemaphore.release(p_ids => ARRAY[$1], p_token => $2)",
    )
    .bind(id)
    .bind(&token)
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query("COMMIT").execute(&mut *conn).await?;
    assert_eq!((outcome.as_str(), wake), ("released", true));
    Ok(())
}

/// A holder that crashed (its permit leaked, no heartbeat) blocks a waiter
/// only until its lease ends: the claim told the waiter when that is, so it
/// looks again then, with no reaper running and its fallback 30 s away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_behind_a_crashed_holder_is_served_when_its_lease_ends() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("crashed-holder", 1)
        .without_heartbeat()
        .build(&db.client.clone().fallback_interval(FAR))
        .await?;
    let lease = Duration::from_millis(1500);
    let crashed = sem.acquiring().lease(lease).try_acquire().await?;
    let claimed = Instant::now();
    std::mem::forget(crashed); // never released, never renewed

    let permit = tokio::time::timeout(Duration::from_secs(10), sem.acquire())
        .await
        .map_err(|_| "the waiter slept past the crashed holder's lease")??;
    let waited = claimed.elapsed();
    assert!(
        waited >= lease - Duration::from_millis(50),
        "served before the lease ended: {waited:?}"
    );
    assert!(
        waited < lease + Duration::from_secs(1),
        "served {:?} after the lease ended",
        waited - lease
    );
    permit.release().await?;
    Ok(())
}
