//! Through PgBouncer 1.18 in transaction pooling mode (`support::pgbouncer`).
//!
//! A client holds a server connection only from `BEGIN` to `COMMIT`, or outside
//! a transaction for one round trip (up to `Sync`). What that means for sqlx 0.9:
//!
//! - Every `sqlx::query*`, with or without bind parameters, uses the extended
//!   protocol in two round trips: `Parse`/`Describe`/`Sync`, then
//!   `Bind`/`Execute`/`Close`/`Sync`. Outside a transaction the second may reach
//!   another server connection, where the statement is missing (SQLSTATE 26000)
//!   or, far worse, where another client's statement of the same name (or the
//!   unnamed one) waits: it runs with our parameters and we read its result.
//! - `statement_cache_capacity(0)` does not make statements unnamed. sqlx still
//!   parses `sqlx_s_1`, `sqlx_s_2`, ... (counted per client connection) and,
//!   with the cache off, never closes them, so inside a transaction the name is
//!   often taken on the server connection already (SQLSTATE 42P05).
//! - What works: an explicit transaction and `.persistent(false)`, together;
//!   and, outside transactions, parameterless `raw_sql` (one simple-protocol
//!   round trip).
//!
//! Needs the `pgbouncer` binary: without it each test returns at once, after
//! one line saying how to install it (`bash scripts/test.sh` does, and sets
//! `PGSEMAPHORE_REQUIRE_TOOLS=1`, under which a missing PgBouncer fails).

mod support;

use sqlx::{AssertSqlSafe, Connection, PgConnection, Row};
use support::TestResult;
use support::pgbouncer::{bouncer, pool_through_bouncer};

const TASKS: i32 = 8;
const ROUND_TRIPS: i32 = 50;

/// Bound queries on a pool of 4 client connections shared by 8 tasks, each in
/// its own transaction as an unnamed statement. Each task's SQL differs, so
/// running another client's statement would give a wrong number, not the same one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bound_queries_in_transactions_round_trip() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    let db = support::empty_db().await;
    let pool = pool_through_bouncer(&db, 4).await;
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let sql = format!("SELECT $1::int + {}", task * 1000);
                for i in 0..ROUND_TRIPS {
                    let mut tx = pool.begin().await?;
                    let got: i32 = sqlx::query_scalar(AssertSqlSafe(sql.clone()))
                        .bind(i)
                        .persistent(false)
                        .fetch_one(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    assert_eq!(got, task * 1000 + i, "task {task}, round trip {i}");
                }
                Ok::<_, sqlx::Error>(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(())
}

/// Parameterless `raw_sql` is one round trip, so it is safe outside transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn simple_queries_outside_transactions_round_trip() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    let db = support::empty_db().await;
    let pool = pool_through_bouncer(&db, 4).await;
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let pool = pool.clone();
            tokio::spawn(async move {
                for i in 0..ROUND_TRIPS {
                    let expected = task * 1000 + i;
                    let row = sqlx::raw_sql(AssertSqlSafe(format!("SELECT {expected}::int")))
                        .fetch_one(&pool)
                        .await?;
                    assert_eq!(row.try_get::<i32, _>(0)?, expected, "task {task}");
                }
                Ok::<_, sqlx::Error>(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(())
}

/// A transaction-level advisory lock taken through the bouncer is a real lock
/// on the server: a direct connection cannot take it until the transaction ends.
#[tokio::test]
async fn xact_advisory_lock_through_the_bouncer_excludes_a_direct_connection() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    const KEY: i64 = 0x5E4A_0001;
    let db = support::empty_db().await;
    let pool = pool_through_bouncer(&db, 2).await;
    let direct_try = || {
        sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock($1)")
            .bind(KEY)
            .fetch_one(&db.pool)
    };

    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(KEY)
        .persistent(false)
        .execute(&mut *tx)
        .await?;
    assert!(
        !direct_try().await?,
        "a direct connection took a lock held through the bouncer"
    );
    tx.commit().await?;
    assert!(
        direct_try().await?,
        "the lock outlived the transaction that took it"
    );
    Ok(())
}

/// Transaction pooling is really on: one client connection is served by
/// different backends in successive transactions, and a backend serves
/// several client connections.
#[tokio::test]
async fn one_client_connection_is_served_by_several_backends() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    async fn backend_pid(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
        let mut tx = conn.begin().await?;
        let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(pid)
    }

    // A database of its own, so a pool of server connections of its own.
    let db = support::empty_db().await;
    let options = bouncer().await.options(&db.name);
    let mut a = PgConnection::connect_with(&options).await?;
    let mut b = PgConnection::connect_with(&options).await?;

    let first = backend_pid(&mut a).await?;
    // B's transaction takes the server connection A just gave back (PgBouncer
    // reuses the most recently released one) and keeps it while A runs again.
    let mut b_tx = b.begin().await?;
    let b_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .persistent(false)
        .fetch_one(&mut *b_tx)
        .await?;
    let second = backend_pid(&mut a).await?;
    b_tx.commit().await?;

    assert_eq!(b_pid, first, "B was not served by A's former backend");
    assert_ne!(second, first, "A kept its backend across transactions");
    Ok(())
}

// ---------------------------------------------------------------------------
// The crate through the bouncer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use pg_semaphore::{Error, Mutex, Priority, QueueOrder, Semaphore, audit::AuditLog};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_semaphore_holds_its_limit_through_the_bouncer() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    const CAPACITY: u32 = 2;
    let db = support::migrated_db().await; // migrations need a direct connection
    let pool = pool_through_bouncer(&db, 4).await;
    let sem = Semaphore::builder("behind-bouncer", CAPACITY)
        .build(
            &pg_semaphore::Client::new(pool.clone())
                .transaction_pooling(true)
                .fallback_interval(Duration::from_millis(50)),
        )
        .await?;
    let holding = Arc::new(AtomicU32::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..10u64 {
        let (sem, holding) = (sem.clone(), holding.clone());
        tasks.spawn(async move {
            for round in 0..5u64 {
                let permit = sem
                    .acquiring()
                    .timeout(Duration::from_secs(60))
                    .acquire()
                    .await?;
                assert!(holding.fetch_add(1, Ordering::SeqCst) < CAPACITY);
                tokio::time::sleep(Duration::from_millis((t + round) % 4)).await;
                holding.fetch_sub(1, Ordering::SeqCst);
                permit.release().await?;
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(result) = tasks.join_next().await {
        result??;
    }

    // Fail fast, the audit log and the reaper, all through the bouncer.
    let a = sem.try_acquire().await?;
    let b = sem.try_acquire().await?;
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { capacity: 2, .. })
    ));
    assert_eq!(sem.available_permits().await?, 0);
    assert_eq!(sem.holders().await?.len(), 2);
    let now = chrono::Utc::now();
    let summary = AuditLog::new(&pool)
        .summary("behind-bouncer", now - chrono::Duration::hours(1)..now)
        .await?;
    assert_eq!((summary.completed, summary.live), (50, Some(2)));
    assert_eq!(pg_semaphore::admin::reap(&pool).await?, 0);
    a.release().await?;
    b.release().await?;

    // Checked on a direct connection: every claim ended, none overlapped a slot.
    let (claims, open, max_slot): (i64, i64, i32) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE completed_at IS NULL), max(slot)
           FROM pgsemaphore.slots WHERE semaphore = 'behind-bouncer'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!((claims, open), (52, 0));
    assert!(max_slot < CAPACITY as i32);
    Ok(())
}

#[tokio::test]
async fn a_waiter_behind_the_bouncer_is_served_by_polling() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    let db = support::migrated_db().await;
    let direct = Semaphore::builder("polled", 1).build(&db.client).await?;
    let pool = pool_through_bouncer(&db, 2).await;
    let behind = Semaphore::builder("polled", 1)
        .build(
            &pg_semaphore::Client::new(pool.clone())
                .transaction_pooling(true)
                .fallback_interval(Duration::from_millis(100)),
        )
        .await?;
    let held = direct.try_acquire().await?;
    let waiter = tokio::spawn(async move {
        behind
            .acquiring()
            .timeout(Duration::from_secs(30))
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    // Nobody LISTENs: the waiter polls.
    let listening: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(listening, 0);
    held.release().await?;
    let permit = tokio::time::timeout(Duration::from_secs(20), waiter).await???;
    permit.release().await?;
    Ok(())
}

#[tokio::test]
async fn heartbeats_renew_through_the_bouncer() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    let db = support::migrated_db().await;
    let pool = pool_through_bouncer(&db, 2).await;
    let lease = Duration::from_secs(2);
    let sem = Semaphore::builder("renewed-behind", 1)
        .lease(lease)
        .heartbeat(Duration::from_millis(300))
        .build(&pg_semaphore::Client::new(pool.clone()).transaction_pooling(true))
        .await?;
    let permit = sem.try_acquire().await?;
    tokio::time::sleep(lease * 2).await;
    assert!(!permit.is_lost(), "renewals failed behind the bouncer");
    assert_eq!(pg_semaphore::admin::reap(&db.pool).await?, 0);
    let unexpired: bool = sqlx::query_scalar(
        "SELECT expires_at > clock_timestamp() FROM pgsemaphore.slots WHERE id = $1",
    )
    .bind(permit.id())
    .fetch_one(&db.pool)
    .await?;
    assert!(unexpired);
    permit.release().await?;
    Ok(())
}

#[tokio::test]
async fn the_extensions_work_through_the_bouncer() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    let db = support::migrated_db().await;
    let direct = Semaphore::builder("extended", 3).build(&db.client).await?;
    let pool = pool_through_bouncer(&db, 2).await;
    let behind = Semaphore::builder("extended", 3)
        .reserved(1)
        .queue(QueueOrder::OldestFirst)
        .build(
            &pg_semaphore::Client::new(pool.clone())
                .transaction_pooling(true)
                .fallback_interval(Duration::from_millis(100)),
        )
        .await?;
    let held = direct.try_acquire().await?;
    // A weighted claim, a queued waiter, a low-priority claim, wait_idle.
    let waiter = tokio::spawn({
        let behind = behind.clone();
        async move {
            behind
                .acquiring()
                .timeout(Duration::from_secs(30))
                .acquire_many(3)
                .await
        }
    });
    while behind.queue_len().await? == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    held.release().await?;
    let all = tokio::time::timeout(Duration::from_secs(20), waiter).await???;
    assert_eq!(all.num_permits(), 3);
    assert_eq!(behind.queue_len().await?, 0);
    all.release().await?;
    let low = behind
        .acquiring()
        .priority(Priority::Low)
        .try_acquire_many(2)
        .await?;
    assert!(
        behind
            .acquiring()
            .priority(Priority::Low)
            .try_acquire()
            .await
            .is_err()
    );
    low.release().await?;
    tokio::time::timeout(Duration::from_secs(20), behind.wait_idle()).await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mutex_works_through_the_bouncer() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    let db = support::migrated_db().await;
    sqlx::query("CREATE TABLE runs (n int)")
        .execute(&db.pool)
        .await?;
    let pool = pool_through_bouncer(&db, 4).await;
    let mutex = Mutex::new("bounced");

    let mut guard = mutex
        .locking()
        .timeout(Duration::from_secs(5))
        .lock(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    sqlx::query("INSERT INTO runs VALUES ($1)")
        .bind(1)
        .persistent(false)
        .execute(&mut *guard)
        .await?;
    // Held, as seen from a direct connection and through the bouncer.
    assert!(matches!(
        mutex.locking().no_wait().lock(&db.client).await,
        Err(Error::Locked { .. })
    ));
    assert!(matches!(
        mutex
            .locking()
            .no_wait()
            .lock(&pg_semaphore::Client::new(pool.clone()))
            .await,
        Err(Error::Locked { .. })
    ));
    assert!(matches!(
        mutex
            .locking()
            .timeout(Duration::from_millis(200))
            .lock(&pg_semaphore::Client::new(pool.clone()))
            .await,
        Err(Error::Timeout { .. })
    ));
    // A cancelled wait through the bouncer is cancelled on the server too.
    drop(
        tokio::time::timeout(
            Duration::from_millis(100),
            mutex.lock(&pg_semaphore::Client::new(pool.clone())),
        )
        .await,
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
        )
        .fetch_one(&db.pool)
        .await?;
        if waiting == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the abandoned wait stayed queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    guard.commit().await?;

    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(rows, 1, "the work committed with the release");
    assert!(
        mutex
            .locking()
            .no_wait()
            .lock(&pg_semaphore::Client::new(pool.clone()))
            .await
            .is_ok(),
        "free after commit"
    );
    Ok(())
}
