//! Wake-ups at fleet scale: a release nobody waits for sends no NOTIFY (which
//! PostgreSQL serialises across the whole instance), a release that commits
//! after a waiter registered still wakes it (the race a check inside the
//! release's own transaction would lose), and a waiter behind a crashed
//! holder is served when that holder's lease ends, with no reaper and no
//! fallback re-check. Fallbacks are 30 s or more here: only the right
//! wake-up makes a test pass in time.

mod support;

use std::time::Duration;

use pg_semaphore::Semaphore;
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::time::Instant;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

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
        .fallback_interval(FAR)
        .build(&db.pool)
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
        .fallback_interval(FAR)
        .build(&other)
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

/// Interleaving: a release R is in flight (its UPDATE done, not committed)
/// while a waiter W claims, finds the slot taken (R's row is still live in
/// its snapshot), registers for wake-ups and sleeps. Had R looked for
/// waiters inside its own transaction, it would have seen none (W was not
/// registered yet) and sent nothing, and W would sleep until its fallback.
/// R looks after its commit (what `Permit::release` runs, in
/// `pgsemaphore.release_then_wake`: the release's transaction, then
/// `pgsemaphore.wake_claimed` in one of its own), sees W's registration and
/// wakes it. The steps are run one by one here, to pause between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_committing_after_a_waiter_registered_still_wakes_it() -> TestResult {
    let db = support::migrated_db().await;
    Semaphore::builder("racing", 1)
        .fallback_interval(FAR)
        .build(&db.pool)
        .await?;
    let token = b"racing-holder-01".to_vec();
    let (status, ids): (String, Option<Vec<i64>>) = sqlx::query_as(
        "SELECT o_status, o_ids FROM pgsemaphore.claim('racing', 'holder', NULL, NULL, $1)",
    )
    .bind(&token)
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(status, "claimed");
    let id = ids.expect("claimed")[0];

    // R: the release, paused before its commit. Nobody is registered yet,
    // so a check inside this transaction would find no waiter.
    let mut release = PgConnection::connect_with(&db.options).await?;
    sqlx::query("BEGIN").execute(&mut release).await?;
    let (outcome,): (String,) =
        sqlx::query_as("SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], $2)")
            .bind(id)
            .bind(&token)
            .fetch_one(&mut release)
            .await?;
    assert_eq!(outcome, "released");
    assert!(!registered(&db.pool, "racing").await?);

    // W: claims (refused: R is not committed), registers, claims again, sleeps.
    let other = support::another_pool(&db, 2).await;
    let waiting = Semaphore::builder("racing", 1)
        .fallback_interval(FAR)
        .build(&other)
        .await?;
    let waiter = tokio::spawn(async move { waiting.acquire().await });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !registered(&db.pool, "racing").await? {
        assert!(Instant::now() < deadline, "the waiter never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "admitted before the release committed"
    );

    // R commits, then sends the wake-up from a transaction of its own.
    sqlx::query("COMMIT").execute(&mut release).await?;
    let committed = Instant::now();
    let (notified,): (bool,) = sqlx::query_as("SELECT pgsemaphore.wake_claimed($1)")
        .bind(id)
        .fetch_one(&mut release)
        .await?;
    assert!(
        notified,
        "the waiter's registration was not seen after the commit"
    );
    let permit = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .map_err(|_| "the waiter slept through a release that committed after it registered")???;
    assert!(committed.elapsed() < Duration::from_secs(2));
    permit.release().await?;
    release.close().await?;
    Ok(())
}

/// A holder that crashed (its permit leaked, no heartbeat) blocks a waiter
/// only until its lease ends: the claim told the waiter when that is, so it
/// looks again then, with no reaper running and its fallback 30 s away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_behind_a_crashed_holder_is_served_when_its_lease_ends() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("crashed-holder", 1)
        .fallback_interval(FAR)
        .without_heartbeat()
        .build(&db.pool)
        .await?;
    let lease = Duration::from_millis(1500);
    let crashed = sem.claim().lease(lease).try_acquire().await?;
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
