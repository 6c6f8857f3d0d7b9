//! The dangerous interleavings of the admission functions, made deterministic:
//! two connections, one paused inside a transaction (an open `BEGIN`, a
//! `FOR SHARE` fence, an uncommitted renewal), the other acting. Load tests
//! alone missed an over-admission; each test here names the interleaving it
//! pins and what the hard limit requires of it.

mod support;

use std::time::Duration;

use pg_semaphore::{Error, Priority, Semaphore};
use sqlx::PgPool;
use support::{TestResult, connect, live_rows};

/// A semaphore without heartbeats, so leases run out on their own.
async fn semaphore(pool: &PgPool, name: &str, capacity: u32) -> pg_semaphore::Result<Semaphore> {
    Semaphore::builder(name, capacity)
        .lease(Duration::from_secs(60))
        .without_heartbeat()
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await
}

/// Interleaving: a claim meets a live row whose lease has ended but that a
/// fence transaction (`Permit::fence`, `FOR SHARE`) keeps locked past its
/// lease. The claim cannot reap it (SKIP LOCKED), so the row still holds
/// its slot and must count as held; the docs promise that work committed in
/// the fenced transaction happened while the permit was held. With the
/// capacity lowered below a live slot number, the free-slot search no
/// longer hides the miscount.
#[tokio::test]
async fn a_fenced_holder_past_its_lease_still_counts_after_the_capacity_drops() -> TestResult {
    let db = support::migrated_db().await;
    let sem = semaphore(&db.pool, "fenced-drop", 4).await?;
    let short = Duration::from_millis(1500);
    let p0 = sem.acquiring().lease(short).try_acquire().await?;
    let p1 = sem.acquiring().lease(short).try_acquire().await?;
    let p2 = sem.acquiring().lease(short).try_acquire().await?;
    let p3 = sem.try_acquire().await?; // 60 s: stays unexpired throughout
    assert_eq!((p0.slot(), p1.slot(), p2.slot(), p3.slot()), (0, 1, 2, 3));
    p0.release().await?;
    p2.release().await?;
    pg_semaphore::admin::set_capacity(&db.pool, "fenced-drop", 2).await?;
    // Slots 1 and 3 are held: at capacity 2 nothing more is admitted.
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));

    // The holder of slot 1 fences its write, and its transaction outlives the lease.
    let mut fenced = db.pool.begin().await?;
    p1.fence(&mut fenced).await?;
    tokio::time::sleep(short + Duration::from_millis(500)).await;

    let other = support::another_pool(&db, 2).await;
    let sem_b = semaphore(&other, "fenced-drop", 2).await?;
    let admitted = sem_b.try_acquire().await;
    let live = live_rows(&db.pool, "fenced-drop").await;
    assert!(
        matches!(admitted, Err(Error::NoSlotsAvailable { .. })),
        "a claim was admitted beside a fenced holder and slot 3's holder at capacity 2 \
         ({live} live rows): {admitted:?}"
    );
    assert_eq!(live, 2);

    // Once the fence commits, the expired row can be reaped and its slot reused.
    fenced.commit().await?;
    let next = sem_b.try_acquire().await?;
    assert_eq!(live_rows(&db.pool, "fenced-drop").await, 2);
    next.release().await?;
    p3.release().await?;
    Ok(())
}

/// Interleaving: a claim meets a live row whose renewal is in flight: the
/// renewal's UPDATE holds the row lock and has not committed, and the old
/// lease ends meanwhile. The claim sees an expired row it cannot reap; the
/// renewal will commit a fresh lease, so the row holds its slot.
#[tokio::test]
async fn an_uncommitted_renewal_across_the_old_expiry_still_counts() -> TestResult {
    let db = support::migrated_db().await;
    let sem = semaphore(&db.pool, "renewing", 4).await?;
    let token = b"renewing-holder!".to_vec();
    let p0 = sem.try_acquire().await?;
    let id1 = support::claim_with_token(&db.pool, "renewing", "1500 ms", &token).await?;
    let p2 = sem.try_acquire().await?;
    let p3 = sem.try_acquire().await?;
    assert_eq!((p0.slot(), p2.slot(), p3.slot()), (0, 2, 3));
    p0.release().await?;
    p2.release().await?;
    pg_semaphore::admin::set_capacity(&db.pool, "renewing", 2).await?;

    // A renewal of slot 1, paused before its commit, across the old expiry.
    let mut renewer = connect(&db).await?;
    sqlx::query("BEGIN").execute(&mut renewer).await?;
    let renewed: Vec<(i64, String)> =
        sqlx::query_as("SELECT o_id, o_outcome FROM pgsemaphore.renew(p_ids => $1, p_token => $2, p_lease => '60 seconds')")
            .bind(vec![id1])
            .bind(&token)
            .fetch_all(&mut renewer)
            .await?;
    assert_eq!(renewed, vec![(id1, "renewed".to_owned())]);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let admitted = sem.try_acquire().await;
    let live = live_rows(&db.pool, "renewing").await;
    assert!(
        matches!(admitted, Err(Error::NoSlotsAvailable { .. })),
        "a claim was admitted while slot 1's renewal was in flight ({live} live rows at \
         capacity 2): {admitted:?}"
    );
    sqlx::query("COMMIT").execute(&mut renewer).await?;
    // Renewed: slot 1 is held for a minute more, and the semaphore is full.
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    p3.release().await?;
    Ok(())
}

/// Interleaving: a low-priority weighted claim meets an expired holder that
/// a fence keeps locked. At constant capacity the free-slot search finds
/// enough gaps, so only the count protects the reserve: the fenced row
/// must count as held, and the claim must leave the reserved slot free.
#[tokio::test]
async fn a_fenced_expired_holder_does_not_give_the_reserve_away() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("reserve-fenced", 4)
        .lease(Duration::from_secs(60))
        .without_heartbeat()
        .reserved(1)
        .build(&db.client)
        .await?;
    let short = Duration::from_millis(1500);
    let expiring = sem.acquiring().lease(short).try_acquire().await?;
    let live = sem.try_acquire().await?;

    let mut fenced = db.pool.begin().await?;
    expiring.fence(&mut fenced).await?;
    tokio::time::sleep(short + Duration::from_millis(500)).await;

    // Two held, two free, one of them reserved: a low-priority pair must wait.
    let low = sem
        .acquiring()
        .priority(Priority::Low)
        .try_acquire_many(2)
        .await;
    assert!(
        matches!(low, Err(Error::NoSlotsAvailable { .. })),
        "a low-priority claim of 2 took the reserved slot: {low:?}"
    );
    // A high-priority one may use the reserve.
    let high = sem.try_acquire_many(2).await?;
    assert_eq!(live_rows(&db.pool, "reserve-fenced").await, 4);
    fenced.commit().await?;
    high.release().await?;
    live.release().await?;
    Ok(())
}

/// Interleaving: two renewals of one claim reach its row lock out of order
/// (a retry after a broken connection while the first still runs). Here
/// the first renewal is paused behind a fence's row lock; the fencing
/// transaction renews the claim itself a second later and commits, and only
/// then does the first renewal go ahead. A renewal must never shorten a
/// lease: the later expiry stands.
#[tokio::test]
async fn renewals_applied_out_of_order_never_shorten_the_lease() -> TestResult {
    let db = support::migrated_db().await;
    semaphore(&db.pool, "renew-order", 2).await?;
    let token = b"renew-order-hold".to_vec();
    let id = support::claim_with_token(&db.pool, "renew-order", "60 seconds", &token).await?;

    let mut fence = db.pool.begin().await?;
    let fenced: (String,) =
        sqlx::query_as("SELECT o_outcome FROM pgsemaphore.fence(p_ids => $1, p_token => $2)")
            .bind(vec![id])
            .bind(&token)
            .fetch_one(&mut *fence)
            .await?;
    assert_eq!(fenced.0, "held");

    // The first renewal starts now and waits for the fence's row lock.
    let mut first = connect(&db).await?;
    let first_token = token.clone();
    let first_renewal = tokio::spawn(async move {
        sqlx::query_as::<_, (String, chrono::DateTime<chrono::Utc>)>(
            "SELECT o_outcome, o_at FROM pgsemaphore.renew(p_ids => $1, p_token => $2, p_lease => '60 seconds')",
        )
        .bind(vec![id])
        .bind(first_token)
        .fetch_one(&mut first)
        .await
    });
    let waiting = support::eventually(Duration::from_secs(5), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
              WHERE datname = current_database() AND wait_event_type = 'Lock' \
                AND query LIKE '%pgsemaphore.renew%')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap_or(false)
    });
    assert!(
        waiting.await,
        "the first renewal never blocked on the fence"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The second renewal, a second later, gets through first.
    let (outcome, later): (String, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT o_outcome, o_at FROM pgsemaphore.renew(p_ids => $1, p_token => $2, p_lease => '60 seconds')")
            .bind(vec![id])
            .bind(&token)
            .fetch_one(&mut *fence)
            .await?;
    assert_eq!(outcome, "renewed");
    fence.commit().await?;

    let (outcome, _) = first_renewal.await??;
    assert_eq!(outcome, "renewed");
    let expires_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT expires_at FROM pgsemaphore.slots WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await?;
    assert!(
        expires_at >= later,
        "a late renewal moved the lease back from {later} to {expires_at}"
    );
    Ok(())
}
