//! Transaction-scoped locks (`pg_advisory_xact_lock`): the lock lives in a
//! transaction, which the [`MutexGuard`] owns (or the caller's, for
//! `lock_in`), and ends with it.

use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;

use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, SqlSafeStr, Transaction};

use crate::db::{self, CallerGone};
use crate::error::{Error, Result};

use super::cancel::{run_or_cancel, token};
use super::{Mode, Mutex, Wait, run_on, try_result};

/// Takes a transaction-scoped lock in a spawned task that owns the
/// connection, so that a caller who goes away mid-wait never leaves a lock
/// held or queued.
pub(super) async fn lock(
    mutex: &Mutex,
    pool: &PgPool,
    mode: Mode,
    wait: Wait,
) -> Result<MutexGuard> {
    let (mutex, pool) = (mutex.clone(), pool.clone());
    db::detached(move |mut caller| async move {
        let started = std::time::Instant::now();
        // Gone before a connection was free: nothing was sent, nothing to undo.
        let conn = tokio::select! {
            conn = pool.acquire() => conn?,
            () = caller.wait() => return Err(db::caller_gone()),
        };
        let token = token();
        let tx = match wait {
            Wait::Try => try_lock(&mutex, &pool, conn, mode, &token, &mut caller).await?,
            _ => wait_lock(&mutex, &pool, conn, mode, wait, &token, &mut caller).await?,
        };
        if wait != Wait::Try {
            mutex.trace_locked(mode, "transaction", started);
        }
        // If the caller left just now, the guard is dropped there: it rolls back.
        Ok(MutexGuard {
            tx: Some(tx),
            name: mutex.label.clone(),
            shared: mode == Mode::Shared,
        })
    })
    .await
}

/// A waiting lock in **one round trip**: the lock statement runs in the
/// implicit transaction of a multi-statement simple query that ends with
/// `BEGIN`, which turns that implicit transaction into the explicit one
/// sqlx's `Transaction` expects. If the lock fails (timeout, deadlock,
/// cancel), the implicit transaction is rolled back and the `BEGIN` never
/// runs, so the connection goes back to the pool clean.
async fn wait_lock(
    mutex: &Mutex,
    pool: &PgPool,
    conn: sqlx::pool::PoolConnection<Postgres>,
    mode: Mode,
    wait: Wait,
    token: &str,
    caller: &mut CallerGone,
) -> Result<Transaction<'static, Postgres>> {
    let sql = format!("{}; BEGIN", mutex.xact_sql(mode, wait, token));
    let begin = Transaction::begin(conn, Some(AssertSqlSafe(sql).into_sql_str()));
    match run_or_cancel(pool, begin, token, caller).await {
        Some(Ok(tx)) => Ok(tx),
        Some(Err(error)) => Err(mutex.lock_error(error, wait)),
        // The caller has gone; a transaction that began anyway was dropped.
        None => Err(db::caller_gone()),
    }
}

/// A try-lock: `BEGIN`, then `pg_try_advisory_xact_lock` (it never waits,
/// so there is nothing to cancel); [`Error::Locked`] when busy.
async fn try_lock(
    mutex: &Mutex,
    pool: &PgPool,
    conn: sqlx::pool::PoolConnection<Postgres>,
    mode: Mode,
    token: &str,
    caller: &mut CallerGone,
) -> Result<Transaction<'static, Postgres>> {
    let mut tx = Transaction::begin(conn, None).await?;
    let statement = run_on(&mut tx, mutex.xact_sql(mode, Wait::Try, token));
    let rows = match run_or_cancel(pool, statement, token, caller).await {
        Some(rows) => rows?,
        None => return Err(db::caller_gone()),
    };
    if try_result(&rows)? {
        Ok(tx)
    } else {
        let _ = tx.rollback().await;
        Err(mutex.locked())
    }
}

/// Takes the lock inside the caller's transaction.
pub(super) async fn lock_in(
    mutex: &Mutex,
    tx: &mut Transaction<'_, Postgres>,
    wait: Wait,
) -> Result<()> {
    let started = std::time::Instant::now();
    let rows = run_on(tx, mutex.xact_sql(Mode::Exclusive, wait, &token()))
        .await
        .map_err(|e| mutex.lock_error(e, wait))?;
    if wait == Wait::Try && !try_result(&rows)? {
        return Err(mutex.locked());
    }
    if wait != Wait::Try {
        mutex.metrics.waited(started.elapsed());
    }
    Ok(())
}

/// Runs `work` in the guard's transaction: commits on `Ok`, rolls back on `Err`.
pub(super) async fn with_lock<T, E, F>(mut guard: MutexGuard, work: F) -> std::result::Result<T, E>
where
    F: for<'c> FnOnce(
        &'c mut PgConnection,
    ) -> Pin<Box<dyn Future<Output = std::result::Result<T, E>> + Send + 'c>>,
    E: From<Error>,
{
    match work(&mut guard).await {
        Ok(value) => {
            guard.commit().await?;
            Ok(value)
        }
        Err(error) => {
            if let Err(rollback) = guard.rollback().await {
                tracing::warn!(error = %rollback, "rollback after a failed with_lock closure failed");
            }
            Err(error)
        }
    }
}

/// A transaction-scoped lock, held until its transaction ends.
///
/// Run the protected work on the guard (`&mut *guard` is a
/// [`PgConnection`] inside the transaction, or use [`tx`](MutexGuard::tx)),
/// then [`commit`](MutexGuard::commit): the work and the release commit
/// atomically. **Dropping the guard rolls the transaction back**, which
/// releases the lock; like sqlx's own transactions the rollback is queued on
/// the connection and runs when it returns to the pool, so it is not
/// immediate.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut guard = pg_semaphore::Mutex::new("ledger").lock(&pool).await?;
/// sqlx::query("INSERT INTO ledger (amount) VALUES (10)")
///     .execute(guard.tx().as_mut())
///     .await?;
/// guard.commit().await?; // the insert and the release commit together
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[must_use = "the lock is released (rolled back) when the guard is dropped"]
pub struct MutexGuard {
    tx: Option<Transaction<'static, Postgres>>,
    name: String,
    shared: bool,
}

impl fmt::Debug for MutexGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MutexGuard")
            .field("mutex", &self.name)
            .field("shared", &self.shared)
            .finish_non_exhaustive()
    }
}

impl MutexGuard {
    /// The transaction that holds the lock.
    pub fn tx(&mut self) -> &mut Transaction<'static, Postgres> {
        self.tx
            .as_mut()
            .expect("the transaction lives as long as the guard")
    }

    /// Whether this is a shared (reader) lock.
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// Commits the transaction, which releases the lock.
    ///
    /// # Errors
    ///
    /// [`Error::Database`] when the commit fails; the lock is released anyway
    /// (the transaction ends either way).
    ///
    /// # Cancel safety
    ///
    /// If cancelled, the commit may or may not have happened; the lock is
    /// released in both cases.
    pub async fn commit(mut self) -> Result<()> {
        let tx = self
            .tx
            .take()
            .expect("the transaction lives as long as the guard");
        tx.commit().await?;
        Ok(())
    }

    /// Rolls the transaction back, which releases the lock, and waits for it.
    ///
    /// # Errors
    ///
    /// [`Error::Database`] when the connection failed; the server rolls back
    /// a broken connection's transaction itself.
    ///
    /// # Cancel safety
    ///
    /// If cancelled, the rollback still happens when the connection returns
    /// to the pool.
    pub async fn rollback(mut self) -> Result<()> {
        let tx = self
            .tx
            .take()
            .expect("the transaction lives as long as the guard");
        tx.rollback().await?;
        Ok(())
    }
}

impl Deref for MutexGuard {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.tx
            .as_ref()
            .expect("the transaction lives as long as the guard")
    }
}

impl DerefMut for MutexGuard {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.tx
            .as_mut()
            .expect("the transaction lives as long as the guard")
    }
}
