//! The semaphore extensions on a real PostgreSQL: `wait_idle`, weighted
//! permits, reserved capacity for critical traffic, the fair queue (FIFO
//! across processes, LIFO, queue limit, cancelled and crashed waiters).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pg_semaphore::{Error, Semaphore};
use sqlx::PgPool;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Long enough that only a notification, never the fallback re-check, can
/// wake a waiter within a test.
const NO_FALLBACK: Duration = Duration::from_secs(600);

/// A bound on how long a test waits for something that should happen.
const PATIENCE: Duration = Duration::from_secs(30);

/// Live rows of a semaphore, straight from the slot table.
async fn live_rows(pool: &PgPool, semaphore: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pgsemaphore.slots \
         WHERE semaphore = $1 AND completed_at IS NULL AND timed_out_at IS NULL",
    )
    .bind(semaphore)
    .fetch_one(pool)
    .await
    .expect("count live rows")
}

#[tokio::test]
async fn wait_idle_wakes_when_the_last_holder_releases_and_not_before() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("group", 3).build(&db.pool).await?;
    // Returns at once when nobody holds a permit.
    sem.wait_idle_timeout(PATIENCE).await?;

    let first = sem.acquire().await?;
    let other = support::another_pool(&db, 2).await;
    let second = Semaphore::builder("group", 3)
        .build(&other)
        .await?
        .acquire()
        .await?;

    // The waiter lives in a third "process" whose fallback never fires.
    let third = support::another_pool(&db, 2).await;
    let watcher = Semaphore::builder("group", 3)
        .fallback_interval(NO_FALLBACK)
        .build(&third)
        .await?;
    let busy = watcher.wait_idle_timeout(Duration::from_millis(50)).await;
    assert!(matches!(busy, Err(Error::Timeout { .. })), "{busy:?}");

    let last_released = Arc::new(AtomicBool::new(false));
    let waiter = tokio::spawn({
        let last_released = last_released.clone();
        async move {
            watcher.wait_idle_timeout(PATIENCE).await?;
            Ok::<_, Error>(last_released.load(Ordering::SeqCst))
        }
    });
    // Releasing one of two holders notifies the waiter, which must keep waiting.
    first.release().await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiter.is_finished(),
        "wait_idle returned with a holder left"
    );
    last_released.store(true, Ordering::SeqCst);
    second.release().await?;
    assert!(waiter.await??, "wait_idle returned before the last release");
    assert_eq!(live_rows(&db.pool, "group").await, 0);
    Ok(())
}
