//! The advisory-lock mutex on a real PostgreSQL: exclusion across
//! connections and processes, timeouts, sqlx interop, shared locks, the
//! caller's transaction, deadlocks, cancellation, and session locks.

mod support;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use pg_semaphore::{
    Error, LostReason, Mutex, MutexGuard, PgAdvisoryLockKey, SessionGuard, WaitedFor,
};
use sqlx::postgres::{PgAdvisoryLock, PgPoolOptions};
use sqlx::{Either, PgPool};
use support::TestResult;
use tokio::time::Instant;

/// Read-modify-write of a counter with no row lock of its own: only mutual
/// exclusion keeps increments from being lost.
async fn unsafe_increment(guard: &mut MutexGuard) -> sqlx::Result<()> {
    let n: i64 = sqlx::query_scalar("SELECT n FROM counter")
        .fetch_one(&mut **guard)
        .await?;
    tokio::task::yield_now().await;
    sqlx::query("UPDATE counter SET n = $1")
        .bind(n + 1)
        .execute(&mut **guard)
        .await?;
    Ok(())
}

async fn create_counter(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::query("CREATE TABLE counter (n bigint NOT NULL)")
        .execute(pool)
        .await?;
    sqlx::query("INSERT INTO counter VALUES (0)")
        .execute(pool)
        .await?;
    Ok(())
}

async fn counter(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT n FROM counter")
        .fetch_one(pool)
        .await
        .expect("read counter")
}

/// Advisory locks that someone is waiting for.
async fn waiting_advisory_locks(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
          WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()",
    )
    .fetch_one(pool)
    .await
    .expect("read pg_locks")
}

#[test]
fn keys_are_derived_exactly_as_sqlx_derives_them() {
    // Pinned: changing the derivation would split running fleets in two.
    let mutex = Mutex::new("my first Postgres advisory lock!");
    assert_eq!(mutex.key(), PgAdvisoryLockKey::BigInt(-5560419505042474287));
    for name in ["nightly-job", "", "🔒 ünïcode", "'; DROP TABLE x; --"] {
        assert_eq!(&Mutex::new(name).key(), PgAdvisoryLock::new(name).key());
    }
    assert_eq!(Mutex::with_key(42).key(), PgAdvisoryLockKey::BigInt(42));
    assert_eq!(
        Mutex::with_key_pair(-1, 7).key(),
        PgAdvisoryLockKey::IntPair(-1, 7)
    );
    assert_eq!(Mutex::new("job").name(), r#"mutex "job""#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_exclusion_across_connections() -> TestResult {
    const TASKS: usize = 24;
    const ROUNDS: usize = 10;
    let db = support::migrated_db().await;
    create_counter(&db.pool).await?;
    let mut pools = Vec::new();
    for _ in 0..3 {
        pools.push(support::another_pool(&db, 5).await);
    }
    let holders = Arc::new(AtomicU32::new(0));
    let mutex = Mutex::new("counter");
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..TASKS {
        let (pool, mutex, holders) = (pools[t % 3].clone(), mutex.clone(), holders.clone());
        tasks.spawn(async move {
            for round in 0..ROUNDS {
                let mut guard = if round % 2 == 0 {
                    mutex.lock(&pg_semaphore::Client::new(pool.clone())).await?
                } else {
                    mutex
                        .locking()
                        .timeout(Duration::from_secs(60))
                        .lock(&pg_semaphore::Client::new(pool.clone()))
                        .await?
                };
                assert_eq!(
                    holders.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                unsafe_increment(&mut guard).await?;
                holders.fetch_sub(1, Ordering::SeqCst);
                guard.commit().await?;
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        });
    }
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    assert_eq!(
        counter(&db.pool).await,
        (TASKS * ROUNDS) as i64,
        "an increment was lost"
    );
    Ok(())
}

/// Run as a separate OS process by `mutual_exclusion_across_processes`.
#[tokio::test]
async fn worker_process_entry_point() -> TestResult {
    let Ok(url) = std::env::var("PGSEM_MUTEX_WORKER_URL") else {
        return Ok(()); // not a worker: nothing to do
    };
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .connect(&url)
        .await?;
    let mutex = Mutex::new("cross-process");
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let (pool, mutex) = (pool.clone(), mutex.clone());
        tasks.spawn(async move {
            for _ in 0..10 {
                let mut guard = mutex
                    .locking()
                    .timeout(Duration::from_secs(60))
                    .lock(&pg_semaphore::Client::new(pool.clone()))
                    .await?;
                unsafe_increment(&mut guard).await?;
                guard.commit().await?;
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        });
    }
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    Ok(())
}

#[tokio::test]
async fn mutual_exclusion_across_processes() -> TestResult {
    let db = support::migrated_db().await;
    create_counter(&db.pool).await?;
    let url = support::server::url_for(&db.name);
    let exe = std::env::current_exe()?;
    let mut running = Vec::new();
    for _ in 0..3 {
        running.push(
            Command::new(&exe)
                .args(["worker_process_entry_point", "--exact", "--test-threads=1"])
                .env("PGSEM_MUTEX_WORKER_URL", &url)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()?,
        );
    }
    for child in running {
        let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
        assert!(
            out.status.success(),
            "worker failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Three processes of three tasks, ten increments each.
    assert_eq!(counter(&db.pool).await, 3 * 3 * 10, "an increment was lost");
    Ok(())
}

#[tokio::test]
async fn lock_timeout_gives_up_promptly() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = Mutex::new("slow");
    let held = mutex.lock(&db.client).await?;

    let other = support::another_pool(&db, 2).await;
    let started = Instant::now();
    let err = mutex
        .locking()
        .timeout(Duration::from_millis(300))
        .lock(&pg_semaphore::Client::new(other.clone()))
        .await
        .expect_err("the lock is held");
    let waited = started.elapsed();
    match err {
        Error::Timeout {
            waited_for: WaitedFor::Mutex { mutex },
            timeout,
        } => {
            assert_eq!(mutex, r#"mutex "slow""#);
            assert_eq!(timeout, Duration::from_millis(300));
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(
        waited >= Duration::from_millis(300),
        "gave up early: {waited:?}"
    );
    assert!(waited < Duration::from_secs(3), "not prompt: {waited:?}");
    assert!(err_is_busy(&mutex, &other).await);
    held.commit().await?;
    assert!(
        mutex
            .locking()
            .no_wait()
            .lock(&pg_semaphore::Client::new(other.clone()))
            .await
            .is_ok()
    );
    Ok(())
}

async fn err_is_busy(mutex: &Mutex, pool: &PgPool) -> bool {
    mutex
        .locking()
        .timeout(Duration::from_millis(10))
        .lock(&pg_semaphore::Client::new(pool.clone()))
        .await
        .is_err_and(|e| e.is_busy())
}

#[tokio::test]
async fn try_lock_is_refused_while_held_and_succeeds_when_free() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = Mutex::with_key(7);
    let first = mutex.locking().no_wait().lock(&db.client).await?;
    assert!(matches!(
        mutex.locking().no_wait().lock(&db.client).await,
        Err(Error::Locked { .. })
    ));
    // The pair key space is a different lock.
    assert!(
        Mutex::with_key_pair(0, 7)
            .locking()
            .no_wait()
            .lock(&db.client)
            .await
            .is_ok()
    );
    first.rollback().await?;
    assert!(mutex.locking().no_wait().lock(&db.client).await.is_ok());
    Ok(())
}

#[tokio::test]
async fn excludes_and_is_excluded_by_sqlx_advisory_locks() -> TestResult {
    let db = support::migrated_db().await;
    let name = "shared-with-sqlx";
    let sqlx_lock = PgAdvisoryLock::new(name);
    let mutex = Mutex::new(name);

    let held_by_sqlx = sqlx_lock.acquire(db.pool.acquire().await?).await?;
    assert!(
        matches!(
            mutex.locking().no_wait().lock(&db.client).await,
            Err(Error::Locked { .. })
        ),
        "sqlx holds it"
    );
    held_by_sqlx.release_now().await?;

    let ours = mutex.lock(&db.client).await?;
    match sqlx_lock.try_acquire(db.pool.acquire().await?).await? {
        Either::Left(_) => panic!("sqlx got the lock while our mutex held it"),
        Either::Right(_) => {}
    }
    ours.commit().await?;
    assert!(matches!(
        sqlx_lock.try_acquire(db.pool.acquire().await?).await?,
        Either::Left(_)
    ));
    Ok(())
}

#[tokio::test]
async fn shared_locks_admit_many_readers_or_one_writer() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = Mutex::new("catalog");
    let r1 = mutex.locking().shared().lock(&db.client).await?;
    let r2 = mutex
        .locking()
        .shared()
        .timeout(Duration::from_secs(5))
        .lock(&db.client)
        .await?;
    assert!(r1.is_shared() && r2.is_shared());
    assert!(
        mutex
            .locking()
            .shared()
            .no_wait()
            .lock(&db.client)
            .await
            .is_ok(),
        "a third reader"
    );
    assert!(
        matches!(
            mutex.locking().no_wait().lock(&db.client).await,
            Err(Error::Locked { .. })
        ),
        "no writer among readers"
    );
    assert!(matches!(
        mutex
            .locking()
            .timeout(Duration::from_millis(100))
            .lock(&db.client)
            .await,
        Err(Error::Timeout { .. })
    ));
    r1.commit().await?;
    r2.commit().await?;

    let writer = mutex.locking().no_wait().lock(&db.client).await?;
    assert!(!writer.is_shared());
    assert!(
        matches!(
            mutex.locking().shared().no_wait().lock(&db.client).await,
            Err(Error::Locked { .. })
        ),
        "no reader beside a writer"
    );
    writer.commit().await?;
    Ok(())
}

#[tokio::test]
async fn shared_mode_holds_in_every_scope_and_a_shared_session_lock_unlocks() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = Mutex::new("shared-scopes");
    // A reader holding a session lock, and a second one inside a caller's
    // transaction: readers admit each other...
    let reader = mutex.locking().shared().lock_session(&db.client).await?;
    assert!(reader.is_shared());
    let mut tx = db.pool.begin().await?;
    mutex.locking().shared().no_wait().lock_in(&mut tx).await?;
    // ...and exclude a writer, in any scope.
    assert!(matches!(
        mutex.locking().no_wait().lock(&db.client).await,
        Err(Error::Locked { .. })
    ));
    assert!(matches!(
        mutex.locking().no_wait().lock_session(&db.client).await,
        Err(Error::Locked { .. })
    ));
    tx.rollback().await?;
    // A shared session lock is released as shared (an exclusive unlock
    // would find nothing to release and report the lock lost).
    reader.unlock().await?;
    let writer = mutex.locking().no_wait().lock_session(&db.client).await?;
    assert!(!writer.is_shared());
    writer.unlock().await?;
    Ok(())
}

#[tokio::test]
async fn work_commits_with_the_release_and_drop_rolls_back() -> TestResult {
    let db = support::migrated_db().await;
    create_counter(&db.pool).await?;
    let mutex = Mutex::new("atomic");

    let mut guard = mutex.lock(&db.client).await?;
    unsafe_increment(&mut guard).await?;
    assert_eq!(counter(&db.pool).await, 0, "not visible before commit");
    guard.commit().await?;
    assert_eq!(counter(&db.pool).await, 1);

    let mut guard = mutex.lock(&db.client).await?;
    sqlx::query("UPDATE counter SET n = 100")
        .execute(&mut **guard.tx())
        .await?;
    drop(guard); // rolls back, and releases the lock
    let reacquired = mutex
        .locking()
        .timeout(Duration::from_secs(5))
        .lock(&db.client)
        .await?;
    assert_eq!(
        counter(&db.pool).await,
        1,
        "dropped guard's work rolled back"
    );
    reacquired.rollback().await?;
    Ok(())
}

#[tokio::test]
async fn with_lock_commits_on_ok_and_rolls_back_on_err() -> TestResult {
    let db = support::migrated_db().await;
    create_counter(&db.pool).await?;
    let mutex = Mutex::new("closure");

    let n = mutex
        .locking()
        .timeout(Duration::from_secs(5))
        .with_lock(&db.client, |conn| {
            Box::pin(async move {
                sqlx::query("UPDATE counter SET n = n + 1")
                    .execute(&mut *conn)
                    .await
                    .map_err(Error::from)?;
                sqlx::query_scalar::<_, i64>("SELECT n FROM counter")
                    .fetch_one(conn)
                    .await
                    .map_err(Error::from)
            })
        })
        .await?;
    assert_eq!(n, 1);
    assert_eq!(counter(&db.pool).await, 1);

    #[derive(Debug)]
    enum AppError {
        Lock(#[allow(dead_code)] Error),
        Refused,
    }
    impl From<Error> for AppError {
        fn from(e: Error) -> Self {
            AppError::Lock(e)
        }
    }
    let result: Result<(), AppError> = mutex
        .locking()
        .with_lock(&db.client, |conn| {
            Box::pin(async move {
                sqlx::query("UPDATE counter SET n = 50")
                    .execute(conn)
                    .await
                    .map_err(|e| AppError::Lock(e.into()))?;
                Err(AppError::Refused)
            })
        })
        .await;
    assert!(matches!(result, Err(AppError::Refused)));
    assert_eq!(counter(&db.pool).await, 1, "rolled back");
    assert!(
        mutex.locking().no_wait().lock(&db.client).await.is_ok(),
        "released"
    );
    Ok(())
}

#[tokio::test]
async fn locks_inside_the_callers_transaction_keep_its_lock_timeout() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = Mutex::new("in-tx");
    let mut tx = db.pool.begin().await?;
    sqlx::query("SET LOCAL lock_timeout = '7s'")
        .execute(&mut *tx)
        .await?;
    mutex
        .locking()
        .timeout(Duration::from_millis(250))
        .lock_in(&mut tx)
        .await?;
    let setting: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *tx)
        .await?;
    assert_eq!(setting, "7s", "the caller's lock_timeout is restored");
    assert!(
        matches!(
            mutex.locking().no_wait().lock(&db.client).await,
            Err(Error::Locked { .. })
        ),
        "held by the transaction"
    );

    let mut other = db.pool.begin().await?;
    assert!(matches!(
        mutex.locking().no_wait().lock_in(&mut other).await,
        Err(Error::Locked { .. })
    ));
    assert!(matches!(
        mutex
            .locking()
            .timeout(Duration::from_millis(100))
            .lock_in(&mut other)
            .await,
        Err(Error::Timeout { .. })
    ));
    other.rollback().await?;

    tx.commit().await?;
    let mut third = db.pool.begin().await?;
    assert!(mutex.locking().no_wait().lock_in(&mut third).await.is_ok());
    third.rollback().await?;

    // A lock that had to wait (the try failed, so lock_timeout was set for
    // the wait) restores the caller's setting as well.
    let mut holder = db.pool.begin().await?;
    mutex.locking().no_wait().lock_in(&mut holder).await?;
    let spawned = std::time::Instant::now();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        holder.commit().await
    });
    let mut waiter = db.pool.begin().await?;
    sqlx::query("SET LOCAL lock_timeout = '7s'")
        .execute(&mut *waiter)
        .await?;
    mutex
        .locking()
        .timeout(Duration::from_secs(10))
        .lock_in(&mut waiter)
        .await?;
    assert!(
        spawned.elapsed() >= Duration::from_millis(200),
        "the lock was granted only once the holder committed"
    );
    release.await??;
    let setting: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *waiter)
        .await?;
    assert_eq!(
        setting, "7s",
        "the caller's lock_timeout is restored after a wait"
    );
    waiter.rollback().await?;

    // The transaction-scoped guard restores the session's own setting too.
    let mut guard = mutex
        .locking()
        .timeout(Duration::from_millis(250))
        .lock(&db.client)
        .await?;
    let setting: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *guard)
        .await?;
    assert_eq!(
        setting, "0",
        "the protected work runs with the session's lock_timeout"
    );
    guard.rollback().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_is_reported_as_such() -> TestResult {
    let db = support::migrated_db().await;
    let (a, b) = (Mutex::new("deadlock-a"), Mutex::new("deadlock-b"));
    let mut tx1 = db.pool.begin().await?;
    let mut tx2 = db.pool.begin().await?;
    a.locking().lock_in(&mut tx1).await?;
    b.locking().lock_in(&mut tx2).await?;
    let (a2, b2) = (a.clone(), b.clone());
    let first = tokio::spawn(async move {
        let r = b2
            .locking()
            .timeout(Duration::from_secs(30))
            .lock_in(&mut tx1)
            .await;
        (r, tx1)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = a2
        .locking()
        .timeout(Duration::from_secs(30))
        .lock_in(&mut tx2)
        .await;
    let (first, _tx1) = first.await?;
    let deadlocks = [&first, &second]
        .iter()
        .filter(|r| matches!(r, Err(Error::Deadlock { .. })))
        .count();
    assert_eq!(deadlocks, 1, "first: {first:?}, second: {second:?}");
    let message = [first, second]
        .into_iter()
        .find_map(Result::err)
        .unwrap()
        .to_string();
    assert!(message.contains("deadlock detected"), "{message}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_lock_futures_never_leave_a_lock_held_or_queued() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = Mutex::new("cancelled");
    let holder = support::another_pool(&db, 1).await;
    let held = mutex
        .lock(&pg_semaphore::Client::new(holder.clone()))
        .await?;
    let alive_tasks = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    let tasks_before = alive_tasks();

    // Cancel waits of every kind at many points: before the transaction
    // starts, while it starts, while the lock statement waits.
    for i in 0..60u64 {
        let cancel_after = Duration::from_micros((i * 997) % 20_000);
        let m = &mutex;
        let pool = &db.pool;
        match i % 5 {
            0 => drop(
                tokio::time::timeout(
                    cancel_after,
                    m.lock(&pg_semaphore::Client::new(pool.clone())),
                )
                .await,
            ),
            1 => drop(
                tokio::time::timeout(
                    cancel_after,
                    m.locking()
                        .timeout(Duration::from_secs(30))
                        .lock(&pg_semaphore::Client::new(pool.clone())),
                )
                .await,
            ),
            2 => drop(
                tokio::time::timeout(
                    cancel_after,
                    m.locking()
                        .shared()
                        .lock(&pg_semaphore::Client::new(pool.clone())),
                )
                .await,
            ),
            3 => drop(
                tokio::time::timeout(
                    cancel_after,
                    m.locking()
                        .lock_session(&pg_semaphore::Client::new(pool.clone())),
                )
                .await,
            ),
            _ => drop(
                tokio::time::timeout(
                    cancel_after,
                    m.locking()
                        .no_wait()
                        .lock(&pg_semaphore::Client::new(pool.clone())),
                )
                .await,
            ),
        }
    }

    // The rest of an abandoned wait runs in a task of its own (cancel
    // safety): every one of them ends while the holder still holds, so each
    // wait was cancelled on the server, and nobody is queued behind it.
    // (Polling pg_locks alone could miss a lock statement still on its way
    // to the server, which would then take the lock below.)
    let ended = support::eventually(Duration::from_secs(10), || async {
        alive_tasks() <= tasks_before
    })
    .await;
    assert!(
        ended,
        "abandoned lock waits still running: {} tasks, {tasks_before} before",
        alive_tasks()
    );
    assert_eq!(
        waiting_advisory_locks(&db.pool).await,
        0,
        "an abandoned lock wait stayed queued"
    );
    held.commit().await?;

    // So another connection gets the lock at once.
    let other = support::another_pool(&db, 1).await;
    let guard = mutex
        .locking()
        .no_wait()
        .lock(&pg_semaphore::Client::new(other.clone()))
        .await;
    assert!(
        guard.is_ok(),
        "the lock was not free right after the holder released: {guard:?}"
    );
    Ok(())
}

#[tokio::test]
async fn session_locks_exclude_until_unlocked() -> TestResult {
    let db = support::migrated_db().await;
    // A pool of one: the session lock's connection is detached from it.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(db.options.clone())
        .await?;
    let mutex = Mutex::new("leader");
    let leader = mutex
        .locking()
        .timeout(Duration::from_secs(5))
        .lock_session(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    assert!(leader.backend_pid() > 0);
    assert!(!leader.is_lost());
    // The pool still serves other work, and the lock excludes others.
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
            .no_wait()
            .lock_session(&pg_semaphore::Client::new(pool.clone()))
            .await,
        Err(Error::Locked { .. })
    ));
    assert!(matches!(
        mutex
            .locking()
            .timeout(Duration::from_millis(200))
            .lock_session(&pg_semaphore::Client::new(pool.clone()))
            .await,
        Err(Error::Timeout { .. })
    ));
    // It outlives transactions: still held after other work commits.
    sqlx::query("SELECT 1").execute(&pool).await?;
    assert!(matches!(
        mutex
            .locking()
            .no_wait()
            .lock(&pg_semaphore::Client::new(pool.clone()))
            .await,
        Err(Error::Locked { .. })
    ));

    leader.unlock().await?;
    let next = mutex
        .locking()
        .no_wait()
        .lock_session(&pg_semaphore::Client::new(pool.clone()))
        .await?; // free after unlock
    drop(next); // closes its connection in the background
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if mutex
            .locking()
            .no_wait()
            .lock(&pg_semaphore::Client::new(pool.clone()))
            .await
            .is_ok()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "dropping the guard did not free the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

#[tokio::test]
async fn a_terminated_session_is_reported_as_lost() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = Mutex::new("fragile-leader").heartbeat(Duration::from_millis(100));
    let leader: SessionGuard = mutex.locking().lock_session(&db.client).await?;
    let lost = leader.lost();
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(leader.backend_pid())
        .fetch_one(&db.pool)
        .await?;
    assert!(terminated);
    tokio::time::timeout(Duration::from_secs(10), lost)
        .await
        .expect("the holder was not told it lost the lock");
    assert!(leader.is_lost());
    // The lock is free for others, and unlocking says what happened.
    assert!(mutex.locking().no_wait().lock(&db.client).await.is_ok());
    match leader.unlock().await {
        Err(Error::LockLost { mutex, reason }) => {
            assert_eq!(mutex, r#"mutex "fragile-leader""#);
            assert_eq!(reason, LostReason::ConnectionLost);
        }
        other => panic!("expected LockLost, got {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn an_unlocked_session_guard_is_never_reported_lost() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = Mutex::new("calm").heartbeat(Duration::from_millis(50));
    let guard = mutex.locking().lock_session(&db.client).await?;
    let lost = guard.lost();
    guard.unlock().await?;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), lost)
            .await
            .is_err(),
        "lost() resolved for a lock that was released normally"
    );
    Ok(())
}

/// Compile-time check: guards and futures can cross threads.
#[allow(dead_code)]
fn bounds(mutex: Mutex, pool: PgPool, guard: MutexGuard, session: SessionGuard) {
    fn send<T: Send>(_: &T) {}
    fn send_sync<T: Send + Sync>(_: &T) {}
    send_sync(&mutex);
    send(&guard);
    send_sync(&session);
    send(&mutex.lock(&pg_semaphore::Client::new(pool.clone())));
    send(
        &mutex
            .locking()
            .no_wait()
            .lock(&pg_semaphore::Client::new(pool.clone())),
    );
    send(
        &mutex
            .locking()
            .lock_session(&pg_semaphore::Client::new(pool.clone())),
    );
    send(&session.lost());
    send(&guard.commit());
    send(&session.unlock());
}

#[tokio::test]
async fn a_failed_wait_leaves_the_connection_clean() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = Mutex::new("clean");
    let held = mutex.lock(&db.client).await?;
    // One connection: whatever the failed lock leaves behind, the next user gets.
    let single = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options.clone())
        .await?;
    for _ in 0..3 {
        assert!(matches!(
            mutex
                .locking()
                .timeout(Duration::from_millis(50))
                .lock(&pg_semaphore::Client::new(single.clone()))
                .await,
            Err(Error::Timeout { .. })
        ));
        // The session's lock_timeout is untouched ...
        let (pid, lock_timeout): (i32, String) =
            sqlx::query_as("SELECT pg_backend_pid(), current_setting('lock_timeout')")
                .fetch_one(&single)
                .await?;
        assert_eq!(lock_timeout, "0");
        // ... and, seen from another connection, it is idle: no transaction
        // (aborted or not) was left open.
        let state: String = sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(&db.pool)
            .await?;
        assert_eq!(state, "idle", "the failed lock left a transaction open");
    }
    held.commit().await?;
    let guard = mutex
        .locking()
        .timeout(Duration::from_secs(5))
        .lock(&pg_semaphore::Client::new(single.clone()))
        .await?;
    guard.commit().await?;
    Ok(())
}

/// A lock without limit waits past the session's own `lock_timeout` (set
/// here for every connection of the pool, as `ALTER ROLE .. SET` would):
/// the first such wait in a process is ended by it and waits again with a
/// statement that sets `lock_timeout` itself; every wait is granted once
/// the holder commits, and the protected work still runs under the
/// session's setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_without_limit_outlasts_the_sessions_lock_timeout() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = Mutex::new("outlast");
    let strict = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.options.clone().options([("lock_timeout", "100ms")]))
        .await?;
    let client = pg_semaphore::Client::new(strict.clone());
    for _ in 0..2 {
        let held = mutex.lock(&db.client).await?;
        let started = Instant::now();
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(400)).await;
            held.commit().await
        });
        let mut guard = mutex.lock(&client).await?;
        assert!(
            started.elapsed() >= Duration::from_millis(400),
            "granted only once the holder committed"
        );
        release.await??;
        let setting: String = sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(&mut *guard)
            .await?;
        assert_eq!(
            setting, "100ms",
            "the work runs with the session's lock_timeout"
        );
        guard.commit().await?;
    }
    Ok(())
}

/// Sessions opened in `db`'s database so far (PostgreSQL 14+ counts them).
async fn sessions(admin: &mut sqlx::PgConnection) -> sqlx::Result<i64> {
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *admin)
        .await?;
    sqlx::query_scalar("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(&mut *admin)
        .await
}

/// An abandoned lock wait that never reached the server (its pool is
/// exhausted) has nothing to cancel: dropping it must not make the crate
/// open connection after connection to look for it, exactly when the pool
/// is exhausted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_wait_for_a_pool_connection_opens_no_connections() -> TestResult {
    use sqlx::Connection;
    let db = support::migrated_db().await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(20))
        .connect_with(db.options.clone())
        .await?;
    let mutex = Mutex::new("exhausted");
    let held = mutex.lock(&pg_semaphore::Client::new(pool.clone())).await?; // the pool's only connection

    let mut admin = sqlx::PgConnection::connect_with(&db.options).await?;
    let before = sessions(&mut admin).await?;
    let abandoned = tokio::time::timeout(
        Duration::from_millis(200),
        mutex.lock(&pg_semaphore::Client::new(pool.clone())),
    )
    .await;
    assert!(abandoned.is_err(), "the wait cannot succeed");
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Let closed sessions' statistics reach the shared counters.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let opened = sessions(&mut admin).await? - before;
    assert!(
        opened <= 2,
        "abandoning one wait for a pool connection opened {opened} connections in 3 s"
    );
    held.commit().await?;
    // The pool still works, and the lock is free.
    mutex
        .locking()
        .no_wait()
        .lock(&pg_semaphore::Client::new(pool.clone()))
        .await?
        .commit()
        .await?;
    Ok(())
}
