//! Transaction-scoped locks (`pg_advisory_xact_lock`): the lock lives in a
//! transaction, which the [`MutexGuard`] owns (or the caller's, for
//! [`Locking::lock_in`](super::Locking::lock_in)), and ends with it. The lock statement ([`statement`]) is here,
//! beside the code that runs it.

use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, SqlSafeStr, Transaction};

use crate::detached::{CallerGone, caller_gone, detached};
use crate::error::{Error, Result};

use super::cancel::{run_or_cancel, token};
use super::lock::{Lock, MAX_LOCK_TIMEOUT_MS, Mode, Wait, lock_timeout_ms, run_on, try_result};

/// The transaction-scoped lock statement, one round trip (simple query
/// protocol, so it also works through PgBouncer without prepared
/// statements). It starts with a unique token so that a wait whose
/// caller has gone can be found and cancelled, and sets the guard's
/// `idle_in_transaction_session_timeout`, if any, for the transaction.
///
/// A waiting lock first tries the lock; only when that fails does it set
/// `lock_timeout` for the wait and restore the transaction's own
/// setting after it, all in one flat expression: the `CASE`'s `ELSE`
/// runs only if the try failed, and the elements of an `ARRAY[..]` are
/// evaluated in order (read the setting, set ours, wait), so element 1
/// is the transaction's setting, restored by the outer `set_config`.
/// Under pgbench (8 clients, spread keys) a transaction locked this way
/// ran at 0.85x–0.99x of one locked by a prepared
/// `pg_advisory_xact_lock($1)`; a subquery doing the same (an InitPlan,
/// planned on every call: the simple protocol plans every statement) ran
/// at 0.72x–0.76x. The try does
/// not jump the queue: a lock request that conflicts with a queued
/// waiter fails like one that conflicts with a holder.
fn statement(mutex: &Lock, mode: Mode, wait: Wait, token: &str) -> String {
    let args = mutex.key_args();
    let (try_function, function) = functions(mode);
    let idle = idle_setting(mutex);
    match lock_timeout_ms(wait) {
        None => format!("{token} SELECT {idle}{try_function}({args})"),
        // One statement: the try; if it failed, read the transaction's
        // lock_timeout, set ours, wait for the lock (the array's
        // elements, left to right), then restore theirs (element 1).
        Some(ms) => format!(
            "{token} SELECT {idle}CASE WHEN {try_function}({args}) THEN NULL ELSE \
             set_config('lock_timeout', (ARRAY[current_setting('lock_timeout'), \
             set_config('lock_timeout', '{ms}ms', true), \
             {function}({args})::text])[1], true) END"
        ),
    }
}

/// The statement of a wait without limit in a transaction the guard owns
/// ([`lock`]): the lock function alone, relying on the session's
/// `lock_timeout` being PostgreSQL's default, 0 (no limit). PostgreSQL
/// parses, analyses and plans every simple-protocol statement: for
/// [`statement`]'s six calls that was a third of the backend's time per
/// lock (perf, pgbench, 1 client), and in a probe of 8 tasks on spread
/// keys (5 runs of 3 s) a statement of one such call ran 1.23x the locks/s
/// of the full one (medians 29,678 and 24,087). A session whose `lock_timeout` is
/// not 0 ends such a wait with 55P03; [`lock`] then waits again with the
/// full statement, and so does every later wait of this process
/// ([`SESSION_LOCK_TIMEOUT`]).
fn bare_statement(mutex: &Lock, mode: Mode, token: &str) -> String {
    let (_, function) = functions(mode);
    format!(
        "{token} SELECT {}{function}({})",
        idle_setting(mutex),
        mutex.key_args()
    )
}

/// Set once a session's own `lock_timeout` ended a wait of
/// [`bare_statement`] in this process: from then on every wait sets
/// `lock_timeout` itself ([`statement`]), as waits with a limit always do.
static SESSION_LOCK_TIMEOUT: AtomicBool = AtomicBool::new(false);

/// The try and the waiting lock function of a mode.
fn functions(mode: Mode) -> (&'static str, &'static str) {
    match mode {
        Mode::Exclusive => ("pg_try_advisory_xact_lock", "pg_advisory_xact_lock"),
        Mode::Shared => (
            "pg_try_advisory_xact_lock_shared",
            "pg_advisory_xact_lock_shared",
        ),
    }
}

/// The guard's `idle_in_transaction_session_timeout`, if any, set for the
/// transaction: the first call of a lock statement, or nothing.
fn idle_setting(mutex: &Lock) -> String {
    match mutex.idle_timeout {
        Some(timeout) => format!(
            "set_config('idle_in_transaction_session_timeout', '{}ms', true), ",
            timeout.as_millis().clamp(1, MAX_LOCK_TIMEOUT_MS)
        ),
        None => String::new(),
    }
}

/// Takes a transaction-scoped lock in a spawned task that owns the
/// connection, so that a caller who goes away mid-wait never leaves a lock
/// held or queued.
pub(super) async fn lock(
    mutex: &Lock,
    pool: &PgPool,
    mode: Mode,
    wait: Wait,
) -> Result<MutexGuard> {
    let (mutex, pool) = (mutex.clone(), pool.clone());
    detached(move |mut caller| async move {
        let started = std::time::Instant::now();
        // At most two turns: a wait without limit first sends the bare lock
        // statement; if the session's own lock_timeout ends it, it waits
        // again with the full one (and so does every later wait).
        let tx = loop {
            // Gone before a connection was free: nothing was sent, nothing to undo.
            let conn = tokio::select! {
                conn = pool.acquire() => conn?,
                () = caller.wait() => return Err(caller_gone()),
            };
            let token = token();
            let bare = wait == Wait::Forever && !SESSION_LOCK_TIMEOUT.load(Ordering::Relaxed);
            let locked = match wait {
                Wait::Try => try_lock(&mutex, &pool, conn, mode, &token, &mut caller).await,
                _ => {
                    let sql = if bare {
                        bare_statement(&mutex, mode, &token)
                    } else {
                        statement(&mutex, mode, wait, &token)
                    };
                    wait_lock(&mutex, &pool, conn, sql, wait, &token, &mut caller).await
                }
            };
            match locked {
                Err(error) if bare && ended_by_lock_timeout(&error) => {
                    SESSION_LOCK_TIMEOUT.store(true, Ordering::Relaxed);
                    tracing::info!(
                        mutex = %mutex.label,
                        "a session's lock_timeout ended a wait without limit; this \
                         wait and every later one set lock_timeout themselves"
                    );
                }
                locked => break locked?,
            }
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
    mutex: &Lock,
    pool: &PgPool,
    conn: sqlx::pool::PoolConnection<Postgres>,
    statement: String,
    wait: Wait,
    token: &str,
    caller: &mut CallerGone,
) -> Result<Transaction<'static, Postgres>> {
    let sql = format!("{statement}; BEGIN");
    let begin = Transaction::begin(conn, Some(AssertSqlSafe(sql).into_sql_str()));
    match run_or_cancel(pool, begin, token, caller).await {
        Some(Ok(tx)) => Ok(tx),
        Some(Err(error)) => Err(mutex.lock_error(error, wait)),
        // The caller has gone; a transaction that began anyway was dropped.
        None => Err(caller_gone()),
    }
}

/// Whether a wait without limit failed on the session's `lock_timeout`
/// (55P03, which [`Lock::lock_error`] maps to a timeout only for waits
/// with a limit).
fn ended_by_lock_timeout(error: &Error) -> bool {
    let Error::Database(error) = error else {
        return false;
    };
    error.as_database_error().and_then(|e| e.code()).as_deref() == Some("55P03")
}

/// A try-lock: `BEGIN`, then `pg_try_advisory_xact_lock` (it never waits,
/// so there is nothing to cancel); [`Error::Locked`] when busy.
async fn try_lock(
    mutex: &Lock,
    pool: &PgPool,
    conn: sqlx::pool::PoolConnection<Postgres>,
    mode: Mode,
    token: &str,
    caller: &mut CallerGone,
) -> Result<Transaction<'static, Postgres>> {
    let mut tx = Transaction::begin(conn, None).await?;
    let trying = run_on(&mut tx, statement(mutex, mode, Wait::Try, token));
    let rows = match run_or_cancel(pool, trying, token, caller).await {
        Some(rows) => rows?,
        None => return Err(caller_gone()),
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
    mutex: &Lock,
    tx: &mut Transaction<'_, Postgres>,
    mode: Mode,
    wait: Wait,
) -> Result<()> {
    let started = std::time::Instant::now();
    let rows = run_on(tx, statement(mutex, mode, wait, &token()))
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
/// # let client = pg_semaphore::Client::new(pool.clone());
/// let mut guard = pg_semaphore::Mutex::new("ledger").lock(&client).await?;
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
        self.take_tx().commit().await?;
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
        self.take_tx().rollback().await?;
        Ok(())
    }

    /// The transaction, taken out of the guard to end it.
    fn take_tx(&mut self) -> Transaction<'static, Postgres> {
        self.tx
            .take()
            .expect("the transaction lives as long as the guard")
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::mutex::lock::Key;

    #[test]
    fn lock_statements_restore_the_callers_lock_timeout() {
        let mutex = Lock::new(Key::BigInt(5), "mutex key 5".into());
        assert_eq!(
            statement(&mutex, Mode::Shared, Wait::Try, "/* t */"),
            "/* t */ SELECT pg_try_advisory_xact_lock_shared(5::int8)"
        );
        let waiting = statement(
            &mutex,
            Mode::Exclusive,
            Wait::Timeout(Duration::from_secs(3)),
            "/* t */",
        );
        assert_eq!(
            waiting,
            "/* t */ SELECT CASE WHEN pg_try_advisory_xact_lock(5::int8) THEN NULL ELSE \
             set_config('lock_timeout', (ARRAY[current_setting('lock_timeout'), \
             set_config('lock_timeout', '3000ms', true), \
             pg_advisory_xact_lock(5::int8)::text])[1], true) END"
        );
        assert_eq!(
            bare_statement(&mutex, Mode::Shared, "/* t */"),
            "/* t */ SELECT pg_advisory_xact_lock_shared(5::int8)"
        );
        let idle = Lock {
            idle_timeout: Some(Duration::from_secs(4)),
            ..mutex.clone()
        };
        let bounded = statement(&idle, Mode::Exclusive, Wait::Try, "/* t */");
        assert_eq!(
            bounded,
            "/* t */ SELECT set_config('idle_in_transaction_session_timeout', '4000ms', true), \
             pg_try_advisory_xact_lock(5::int8)"
        );
        assert_eq!(
            bare_statement(&idle, Mode::Exclusive, "/* t */"),
            "/* t */ SELECT set_config('idle_in_transaction_session_timeout', '4000ms', true), \
             pg_advisory_xact_lock(5::int8)"
        );
    }
}
