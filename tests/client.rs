//! The client: what it owns starts on first use, `shutdown` writes the
//! advisory audit queue and stops the rest, and the client stays usable.

mod support;

use std::time::Duration;

use pg_semaphore::{AdvisorySemaphore, Client, Error, Semaphore};
use sqlx::PgPool;
use support::TestResult;

/// Backends of this database whose last statement was `LISTEN "pgsemaphore"`
/// (the semaphores' wake-up connection).
async fn listeners(pool: &PgPool) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND query ILIKE 'LISTEN%pgsemaphore%' \
           AND pid <> pg_backend_pid()",
    )
    .fetch_one(pool)
    .await
}

/// The advisory semaphores' sessions open on this database.
async fn advisory_sessions(pool: &PgPool) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'pg-semaphore advisory'",
    )
    .fetch_one(pool)
    .await
}

async fn logged(pool: &PgPool, semaphore: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.advisory_claims WHERE semaphore = $1")
        .bind(semaphore)
        .fetch_one(pool)
        .await
}

#[tokio::test]
async fn a_client_starts_nothing_until_used() -> TestResult {
    let db = support::migrated_db().await;
    let client = Client::new(db.pool.clone());
    let sem = Semaphore::builder("idle-client", 1).build(&client).await?;
    let _advisory = AdvisorySemaphore::builder("idle-client-advisory", 1)
        .build(&client)
        .await?;
    sem.try_acquire().await?.release().await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        listeners(&db.pool).await?,
        0,
        "no waiter: no LISTEN connection"
    );
    assert_eq!(
        advisory_sessions(&db.pool).await?,
        0,
        "no advisory claim: no session"
    );
    Ok(())
}

#[tokio::test]
async fn shutdown_writes_the_queued_audit_records_at_once() -> TestResult {
    let db = support::migrated_db().await;
    let client = Client::new(db.pool.clone());
    let sem = AdvisorySemaphore::builder("flushed", 2)
        .build(&client)
        .await?;
    for _ in 0..3 {
        sem.try_acquire().await?.release().await?;
    }
    // Queued, not yet written (the writer waits up to half a second to batch).
    client.shutdown().await?;
    assert_eq!(
        logged(&db.pool, "flushed").await?,
        3,
        "every finished permit is in the log when shutdown returns"
    );
    Ok(())
}

#[tokio::test]
async fn shutdown_stops_the_listener_and_closes_idle_sessions() -> TestResult {
    let db = support::migrated_db().await;
    let client = Client::new(db.pool.clone());
    let sem = Semaphore::builder("woken", 1).build(&client).await?;
    let held = sem.try_acquire().await?;
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move { sem.acquire().await })
    };
    assert!(
        support::eventually(Duration::from_secs(5), || async {
            listeners(&db.pool).await.unwrap_or(0) == 1
        })
        .await,
        "a waiter starts the LISTEN connection"
    );
    held.release().await?;
    waiter.await??.release().await?;

    let advisory = AdvisorySemaphore::builder("sessions", 2)
        .build(&client)
        .await?;
    let kept = advisory.try_acquire().await?;
    let other = advisory.try_acquire().await?;
    other.release().await?;
    let open = advisory_sessions(&db.pool).await?;
    assert!(open >= 1, "a claim opened a session");

    client.shutdown().await?;
    assert!(
        support::eventually(Duration::from_secs(5), || async {
            listeners(&db.pool).await.unwrap_or(-1) == 0
        })
        .await,
        "shutdown stops the LISTEN connection"
    );
    assert!(
        support::eventually(Duration::from_secs(5), || async {
            advisory_sessions(&db.pool).await.unwrap_or(-1) == 1
        })
        .await,
        "shutdown closes the sessions that hold no permit, and keeps the one that does"
    );
    assert!(!kept.is_lost(), "a held permit keeps its session");
    assert_eq!(advisory.available_permits().await?, 1);
    kept.release().await?;

    // Still usable: what is used again starts again.
    let again = advisory.try_acquire().await?;
    again.release().await?;
    sem.try_acquire().await?.release().await?;
    Ok(())
}

#[tokio::test]
async fn a_waiter_outlives_shutdown() -> TestResult {
    let db = support::migrated_db().await;
    let client = Client::new(db.pool.clone());
    let sem = Semaphore::builder("patient", 1).build(&client).await?;
    let held = sem.try_acquire().await?;
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move {
            sem.acquiring()
                .timeout(Duration::from_secs(10))
                .acquire()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    client.shutdown().await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.release().await?;
    let permit = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter is admitted after shutdown, not left hanging")??;
    permit.release().await?;
    Ok(())
}

#[tokio::test]
async fn an_advisory_semaphore_behind_a_pooler_needs_direct_options() -> TestResult {
    let db = support::migrated_db().await;
    let pooled = Client::new(db.pool.clone()).transaction_pooling(true);
    match AdvisorySemaphore::builder("needs-direct", 1)
        .build(&pooled)
        .await
    {
        Err(Error::InvalidArgument { argument, .. }) => assert_eq!(argument, "connect_options"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let direct = pooled.connect_options(db.options.clone());
    let sem = AdvisorySemaphore::builder("needs-direct", 1)
        .build(&direct)
        .await?;
    sem.try_acquire().await?.release().await?;
    direct.shutdown().await?;
    Ok(())
}
