//! Leases seen from the holder, on a real PostgreSQL: heartbeats keep a busy
//! holder's slot, a lost permit is signalled (reaped, released by an
//! operator, or the database out of reach), and fail-open admission.

mod support;

use std::time::Duration;

use pg_semaphore::{Error, LostReason, Semaphore};
use sqlx::PgPool;
use support::TestResult;
use support::proxy::Proxy;

/// Whether the claim's row is live with an unexpired lease, on the database clock.
async fn live_and_unexpired(pool: &PgPool, id: i64) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT completed_at IS NULL AND timed_out_at IS NULL AND expires_at > clock_timestamp() \
         FROM pgsemaphore.slots WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
}

#[tokio::test]
async fn a_heartbeat_keeps_a_busy_holders_slot_past_its_lease() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("renewed", 1)
        .lease(Duration::from_secs(3))
        .heartbeat(Duration::from_millis(300))
        .build(&db.client)
        .await?;
    let permit = sem.try_acquire().await?;
    let first_expiry = permit.expires_at();
    // Hold for over two leases while a reaper runs flat out.
    let until = tokio::time::Instant::now() + Duration::from_secs(8);
    while tokio::time::Instant::now() < until {
        assert_eq!(
            pg_semaphore::admin::reap(&db.pool).await?,
            0,
            "a renewed slot was reaped"
        );
        assert!(
            matches!(sem.try_acquire().await, Err(Error::NoSlotsAvailable { .. })),
            "someone else got the slot of a live, renewed permit"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!permit.is_lost());
    let expires_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT expires_at FROM pgsemaphore.slots WHERE id = $1")
            .bind(permit.id())
            .fetch_one(&db.pool)
            .await?;
    assert!(
        expires_at > first_expiry + chrono::Duration::seconds(4),
        "the lease was renewed on the database: {first_expiry} -> {expires_at}"
    );
    permit.release().await?;
    assert_eq!(sem.available_permits().await?, 1);
    Ok(())
}

#[tokio::test]
async fn without_a_heartbeat_the_lease_runs_out_and_the_holder_is_told() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("unrenewed", 1)
        .lease(Duration::from_secs(2))
        .without_heartbeat()
        .build(&db.client)
        .await?;
    let permit = sem.try_acquire().await?;
    assert!(!permit.is_lost());
    let reason = tokio::time::timeout(Duration::from_secs(10), permit.lost())
        .await
        .expect("lost() never fired although the lease ran out");
    assert_eq!(reason, LostReason::LeaseExpired);
    assert!(permit.is_lost());
    // Told before the database would let anyone else in.
    assert!(
        live_and_unexpired(&db.pool, permit.id()).await?,
        "the lease had already ended on the database when the holder was told"
    );
    let mut reaped = 0;
    for _ in 0..100 {
        reaped += pg_semaphore::admin::reap(&db.pool).await?;
        if reaped > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(reaped, 1);
    assert!(permit.is_lost(), "lost is final");
    let next = sem.try_acquire().await?;
    match permit.release().await {
        Err(Error::PermitLost {
            reason: LostReason::TimedOut { .. },
            ..
        }) => {}
        other => panic!("expected PermitLost(TimedOut), got {other:?}"),
    }
    next.release().await?;
    Ok(())
}

#[tokio::test]
async fn a_heartbeat_reports_a_permit_reaped_or_released_behind_its_back() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("taken-away", 2)
        .lease(Duration::from_secs(30))
        .heartbeat(Duration::from_millis(100))
        .build(&db.client)
        .await?;
    let reaped = sem.try_acquire().await?;
    let released = sem.try_acquire().await?;
    // An operator (or a clock jump) ends both claims directly in the table.
    sqlx::query("UPDATE pgsemaphore.slots SET timed_out_at = clock_timestamp() WHERE id = $1")
        .bind(reaped.id())
        .execute(&db.pool)
        .await?;
    sqlx::query("SELECT pgsemaphore.force_release(p_id => $1)")
        .bind(released.id())
        .execute(&db.pool)
        .await?;
    let wait = Duration::from_secs(10);
    let reason = tokio::time::timeout(wait, reaped.lost()).await?;
    assert!(matches!(reason, LostReason::TimedOut { .. }), "{reason:?}");
    let reason = tokio::time::timeout(wait, released.lost()).await?;
    assert!(
        matches!(reason, LostReason::AlreadyReleased { .. }),
        "{reason:?}"
    );
    assert!(reaped.is_lost() && released.is_lost());
    assert!(matches!(
        reaped.release().await,
        Err(Error::PermitLost {
            reason: LostReason::TimedOut { .. },
            ..
        })
    ));
    assert!(matches!(
        released.release().await,
        Err(Error::PermitLost {
            reason: LostReason::AlreadyReleased { .. },
            ..
        })
    ));
    Ok(())
}

#[tokio::test]
async fn a_holder_cut_off_from_the_database_is_told_before_its_lease_ends() -> TestResult {
    let db = support::migrated_db().await;
    let proxy = Proxy::start(&db).await;
    let remote = proxy.pool(2).await;
    let lease = Duration::from_secs(3);
    let sem = Semaphore::builder("cut-off", 1)
        .lease(lease)
        .heartbeat(Duration::from_millis(500))
        .build(&pg_semaphore::Client::new(remote.clone()))
        .await?;
    let permit = sem.try_acquire().await?;
    // Renewals work while the network does: held past a whole lease.
    tokio::time::sleep(lease + Duration::from_millis(500)).await;
    assert!(!permit.is_lost());
    assert!(live_and_unexpired(&db.pool, permit.id()).await?);

    proxy.cut().await;
    let reason = tokio::time::timeout(Duration::from_secs(20), permit.lost())
        .await
        .expect("lost() never fired although no renewal could reach the database");
    assert_eq!(reason, LostReason::LeaseExpired);
    // The holder was told while its slot was still safely its own: nobody
    // else can have been admitted yet.
    assert!(
        live_and_unexpired(&db.pool, permit.id()).await?,
        "the lease had already ended on the database when the holder was told"
    );
    // And once the lease has ended, the slot is freed for others.
    let local = Semaphore::builder("cut-off", 1)
        .lease(lease)
        .build(&db.client)
        .await?;
    let next = local
        .acquiring()
        .timeout(Duration::from_secs(20))
        .acquire()
        .await?;
    next.release().await?;
    Ok(())
}

#[tokio::test]
async fn fail_open_admits_unchecked_when_the_database_is_unreachable() -> TestResult {
    let db = support::migrated_db().await;
    let proxy = Proxy::start(&db).await;
    let remote = proxy.pool(2).await;
    let open = Semaphore::builder("shedder", 1)
        .fail_open(true)
        .build(&pg_semaphore::Client::new(remote.clone()))
        .await?;
    let closed = Semaphore::builder("shedder", 1)
        .build(&pg_semaphore::Client::new(remote.clone()))
        .await?;
    let missing = Semaphore::builder("deleted-later", 1)
        .fail_open(true)
        .build(&db.client)
        .await?;

    // While the database answers, fail-open changes nothing.
    let held = open.try_acquire().await?;
    assert!(!held.is_unchecked());
    assert!(matches!(
        open.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    held.release().await?;

    proxy.cut().await;
    let permit = open.try_acquire().await?;
    assert!(permit.is_unchecked(), "{permit:?}");
    assert_eq!(permit.id(), 0);
    assert!(!permit.is_lost());
    let mut tx = db.pool.begin().await?;
    assert!(matches!(
        permit.fence(&mut tx).await,
        Err(Error::PermitLost {
            reason: LostReason::Unchecked,
            ..
        })
    ));
    drop(tx);
    permit.release().await?;

    // Fail-closed (the default) reports the outage.
    match closed.try_acquire().await {
        // A refused connection, or a pool timeout after failed attempts.
        Err(error) => assert!(matches!(error, Error::Database(_)), "{error:?}"),
        Ok(permit) => panic!("admitted without the database: {permit:?}"),
    }
    // Waiting acquires never fail open.
    match open
        .acquiring()
        .timeout(Duration::from_secs(3))
        .acquire()
        .await
    {
        Err(error) => assert!(
            matches!(error, Error::Database(_) | Error::Timeout { .. }),
            "{error:?}"
        ),
        Ok(permit) => panic!("a waiting acquire failed open: {permit:?}"),
    }
    // An answer from the database is not an outage: it is never failed open.
    sqlx::query("DELETE FROM pgsemaphore.semaphores WHERE name = 'deleted-later'")
        .execute(&db.pool)
        .await?;
    assert!(matches!(
        missing.try_acquire().await,
        Err(Error::SemaphoreNotFound { .. })
    ));
    // Nothing was written while the database was out of reach.
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.slots")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(claims, 1, "only the claim made while the database answered");
    Ok(())
}

#[tokio::test]
async fn a_busy_pool_is_not_an_outage_and_never_fails_open() -> TestResult {
    let db = support::migrated_db().await;
    let tiny = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(500))
        .connect_with(db.options.clone())
        .await?;
    let sem = Semaphore::builder("busy-pool", 5)
        .fail_open(true)
        .build(&pg_semaphore::Client::new(tiny.clone()))
        .await?;
    // Every connection of the pool is in use: a pool timeout, with the
    // database perfectly reachable.
    let hog = tiny.acquire().await?;
    match sem.try_acquire().await {
        Err(Error::Database(sqlx::Error::PoolTimedOut)) => {}
        Ok(permit) => panic!("a busy pool failed open: {permit:?}"),
        Err(other) => panic!("expected a pool timeout, got {other:?}"),
    }
    drop(hog);
    let permit = sem.try_acquire().await?;
    assert!(!permit.is_unchecked());
    permit.release().await?;
    Ok(())
}

#[tokio::test]
async fn a_weighted_permits_heartbeat_renews_every_claim() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("renewed-many", 4)
        .lease(Duration::from_secs(2))
        .heartbeat(Duration::from_millis(300))
        .build(&db.client)
        .await?;
    let permit = sem.try_acquire_many(3).await?;
    assert_eq!(permit.ids().len(), 3);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        pg_semaphore::admin::reap(&db.pool).await?,
        0,
        "a claim of the permit expired"
    );
    for id in permit.ids() {
        assert!(
            live_and_unexpired(&db.pool, id).await?,
            "claim {id} was not renewed"
        );
    }
    assert!(!permit.is_lost());
    permit.release().await?;
    assert_eq!(sem.available_permits().await?, 4);
    Ok(())
}
