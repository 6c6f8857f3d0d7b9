//! Network partitions: a client cut off by a half-open link (a blackholing
//! proxy: packets vanish, no FIN, no RST) must learn it within its
//! heartbeat, and the server must let go of what that client held, within
//! a bound the client chose, not when the server's TCP keepalive gives up
//! (hours). And a claim whose reply is lost must not hold its slot for a
//! whole lease.

mod support;

use std::time::Duration;

use pg_semaphore::{Error, LostReason, Mutex, Semaphore};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use support::TestResult;
use support::proxy::Proxy;
use tokio::time::Instant;

/// A pool whose connections go through `proxy`.
async fn through(proxy: &Proxy, max_connections: u32) -> sqlx::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(proxy.options())
        .await
}

/// Polls `check` until it holds or `within` passes; how long it took.
async fn within<F, Fut>(within: Duration, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    loop {
        if check().await {
            return Some(started.elapsed());
        }
        if started.elapsed() >= within {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A leader behind a partition learns it lost the lock within two
/// heartbeats (a ping unanswered within a heartbeat is a loss), and
/// unlocking does not hang on the dead link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_session_lock_holder_learns_within_two_heartbeats() -> TestResult {
    let db = support::migrated_db().await;
    let proxy = Proxy::start(&db).await;
    let pool = through(&proxy, 2).await?;
    let heartbeat = Duration::from_millis(200);
    let mutex = Mutex::new("partitioned-leader").heartbeat(heartbeat);
    let leader = mutex
        .locking()
        .lock_session(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    let lost = leader.lost();
    tokio::time::sleep(heartbeat * 2).await;
    assert!(!leader.is_lost());

    proxy.blackhole();
    let cut_off = Instant::now();
    let reason = tokio::time::timeout(Duration::from_secs(5), lost)
        .await
        .map_err(|_| "the leader was not told it lost the lock behind a partition")?;
    assert_eq!(reason, LostReason::ConnectionLost);
    let told = cut_off.elapsed();
    assert!(
        told <= heartbeat * 2 + Duration::from_millis(300),
        "told after {told:?}, more than two heartbeats"
    );
    let unlocked = tokio::time::timeout(Duration::from_secs(5), leader.unlock()).await;
    assert!(
        matches!(unlocked, Ok(Err(Error::LockLost { .. }))),
        "unlock after the loss: {unlocked:?}"
    );
    proxy.restore();
    Ok(())
}

/// The server frees a partitioned session's lock on its own: the session
/// ends after three silent heartbeats (`idle_session_timeout`, at least a
/// second), so another process takes the lock within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_frees_a_partitioned_session_lock() -> TestResult {
    let db = support::migrated_db().await;
    let proxy = Proxy::start(&db).await;
    let pool = through(&proxy, 2).await?;
    let mutex = Mutex::new("abandoned-leader").heartbeat(Duration::from_millis(200));
    let leader = mutex
        .locking()
        .lock_session(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    assert!(matches!(
        mutex.locking().no_wait().lock(&db.client).await,
        Err(Error::Locked { .. })
    ));

    proxy.blackhole();
    let freed = within(Duration::from_secs(10), || async {
        mutex.locking().no_wait().lock(&db.client).await.is_ok()
    })
    .await
    .ok_or("the server kept a partitioned session's lock for 10 s")?;
    assert!(
        freed < Duration::from_secs(4),
        "freed only {freed:?} after the partition"
    );
    drop(leader);
    Ok(())
}

/// A transaction-scoped guard with `idle_timeout` bounds a dark client: the
/// server ends the idle transaction and frees the lock. Without it, the lock
/// stays held while the partition lasts (here, 3 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guards_idle_timeout_frees_its_lock_behind_a_partition() -> TestResult {
    let db = support::migrated_db().await;
    let proxy = Proxy::start(&db).await;
    let pool = through(&proxy, 4).await?;

    let unbounded = Mutex::new("dark-guard-unbounded");
    let held = unbounded
        .lock(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    let bounded = Mutex::new("dark-guard").idle_timeout(Duration::from_secs(1));
    let guard = bounded
        .lock(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    proxy.blackhole();

    let freed = within(Duration::from_secs(10), || async {
        bounded.locking().no_wait().lock(&db.client).await.is_ok()
    })
    .await
    .ok_or("the guard's lock was not freed behind the partition")?;
    assert!(freed < Duration::from_secs(4), "freed after {freed:?}");
    assert!(
        matches!(
            unbounded.locking().no_wait().lock(&db.client).await,
            Err(Error::Locked { .. })
        ),
        "without idle_timeout the server keeps the lock (until its TCP keepalive gives up)"
    );
    drop((held, guard));
    Ok(())
}

/// A fenced transaction cut off by a partition holds its claim's row lock
/// (a release waits for it) only as long as the transaction's own
/// `idle_in_transaction_session_timeout` allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dark_fence_is_bounded_by_its_idle_in_transaction_timeout() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("dark-fence", 1)
        .build(&db.client)
        .await?;
    let permit = sem.try_acquire().await?;
    let proxy = Proxy::start(&db).await;
    let dark = through(&proxy, 1).await?;
    let mut tx = dark.begin().await?;
    tx.execute("SET LOCAL idle_in_transaction_session_timeout = '1s'")
        .await?;
    permit.fence(&mut tx).await?;
    proxy.blackhole();

    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), permit.release())
        .await
        .map_err(|_| "the release waited for the dark fence for 10 s")??;
    assert!(started.elapsed() < Duration::from_secs(4));
    drop(tx);
    Ok(())
}

/// A claim that committed while its reply was lost (the connection broke on
/// the way back) is released by its token in the background, within
/// seconds, not at the end of its 60 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_was_lost_does_not_hold_its_slot_for_a_lease() -> TestResult {
    let db = support::migrated_db().await;
    let proxy = Proxy::start(&db).await;
    let pool = through(&proxy, 2).await?;
    let sem = Semaphore::builder("lost-reply", 1)
        .lease(Duration::from_secs(60))
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;

    // Hold the semaphore's row, so that the claim waits on the server.
    let mut blocker = db.pool.begin().await?;
    blocker
        .execute("SELECT 1 FROM pgsemaphore.semaphores WHERE name = 'lost-reply' FOR NO KEY UPDATE")
        .await?;
    let claim = tokio::spawn(async move { sem.try_acquire().await });
    let waiting = within(Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
              WHERE datname = current_database() AND wait_event_type = 'Lock' \
                AND query LIKE '%pgsemaphore.claim%')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap_or(false)
    })
    .await;
    assert!(waiting.is_some(), "the claim never reached the server");

    // The link goes dark; the claim commits on the server; its reply is held.
    proxy.blackhole();
    blocker.commit().await?;
    let live = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pgsemaphore.live_slots WHERE semaphore = 'lost-reply'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap_or(-1)
    };
    assert!(
        within(Duration::from_secs(10), || async { live().await == 1 })
            .await
            .is_some(),
        "the claim did not commit"
    );
    // The connection breaks: the reply is lost, the client gets an error.
    proxy.reset().await;
    proxy.restore();
    let outcome = tokio::time::timeout(Duration::from_secs(10), claim).await??;
    assert!(
        matches!(outcome, Err(Error::Database(_))),
        "the client saw {outcome:?}"
    );

    let freed = within(Duration::from_secs(10), || async { live().await == 0 })
        .await
        .ok_or("the claim nobody knew about held its slot")?;
    assert!(freed < Duration::from_secs(5), "freed after {freed:?}");
    let (completed,): (bool,) = sqlx::query_as(
        "SELECT completed_at IS NOT NULL FROM pgsemaphore.slots WHERE semaphore = 'lost-reply'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert!(completed, "released by its token, not reaped");
    Ok(())
}

/// A waiting acquire rides out an outage (a restart, a failover, a
/// partition): the claim round trip that broke is retried until the database
/// answers again, and the wait goes on; it does not end with the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquire_rides_out_an_outage() -> TestResult {
    let db = support::migrated_db().await;
    let holder = Semaphore::builder("outage", 1).build(&db.client).await?;
    let held = holder.try_acquire().await?;
    let proxy = Proxy::start(&db).await;
    let pool = through(&proxy, 2).await?;
    let sem = Semaphore::builder("outage", 1)
        .build(
            &pg_semaphore::Client::new(pool.clone()).fallback_interval(Duration::from_millis(200)),
        )
        .await?;
    let waiter = tokio::spawn(async move {
        sem.acquiring()
            .timeout(Duration::from_secs(30))
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The link goes dark while the slot frees, for longer than the pool's
    // acquire timeout (2 s): the waiter's claims fail (no connection), then
    // its connections break, and the link comes back.
    proxy.blackhole();
    held.release().await?;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    proxy.reset().await;
    proxy.restore();
    let permit = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .map_err(|_| "the waiter never came back from the outage")??;
    let permit = permit.map_err(|e| format!("the wait ended with the outage's error: {e}"))?;
    permit.release().await?;
    Ok(())
}
