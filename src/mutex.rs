use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgAdvisoryLock, PgAdvisoryLockKey, PgRow};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, Postgres, Row, Transaction};
use tokio::sync::{mpsc, oneshot, watch};

use crate::error::{Error, Result};

/// Cancels a lock statement whose caller has gone, found by the unique token
/// at the start of its text (see [`token`]). Only a backend running exactly
/// that statement matches, and that backend's connection is owned by the task
/// that sends this, so no other statement can ever be cancelled. The token
/// (`/* pgsemaphore lock 1f.2a.3c */`: fixed text and hex digits, nothing to
/// escape) is inlined so the statement uses the simple protocol, which also
/// works through PgBouncer.
fn cancel_wait_sql(token: &str) -> String {
    format!(
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
         WHERE state = 'active' AND pid <> pg_backend_pid() AND starts_with(query, '{token}')"
    )
}

/// How often an abandoned lock wait is cancelled again until it has ended.
const CANCEL_RETRY: Duration = Duration::from_millis(50);

/// The default interval at which a session lock checks that its connection is alive.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);

/// The longest `lock_timeout` PostgreSQL accepts (`INT_MAX` milliseconds);
/// longer timeouts mean "wait without limit".
const MAX_LOCK_TIMEOUT_MS: u128 = i32::MAX as u128;

/// A mutex on a PostgreSQL advisory lock: mutual exclusion across every
/// process that uses the same database.
///
/// The default lock is **transaction-scoped** (`pg_advisory_xact_lock`): the
/// guard owns a transaction, the lock is released when that transaction
/// commits or rolls back, and if the process or the connection dies, the
/// server rolls back and frees the lock. Nothing expires, nothing leaks.
/// For holds that must outlive a transaction, see
/// [`lock_session`](Mutex::lock_session).
///
/// Keys: [`Mutex::new`] derives the 64-bit key from a name exactly as sqlx's
/// [`PgAdvisoryLock::new`] does, so this mutex and a `PgAdvisoryLock` on the
/// same name exclude each other; [`Mutex::with_key`] and
/// [`Mutex::with_key_pair`] take explicit keys.
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use pg_semaphore::Mutex;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let mutex = Mutex::new("nightly-report");
/// let mut guard = mutex.lock_timeout(&pool, Duration::from_secs(5)).await?;
/// // Work done in the guard's transaction commits atomically with the release.
/// sqlx::query("UPDATE jobs SET last_run = now() WHERE name = 'nightly-report'")
///     .execute(&mut *guard)
///     .await?;
/// guard.commit().await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[derive(Clone)]
pub struct Mutex {
    key: Key,
    label: String,
    heartbeat: Duration,
}

impl fmt::Debug for Mutex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mutex")
            .field("name", &self.label)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// PostgreSQL's two advisory key spaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    BigInt(i64),
    IntPair(i32, i32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Exclusive,
    Shared,
}

#[derive(Debug, Clone, Copy)]
enum Wait {
    /// `pg_try_advisory_*`: never waits.
    Try,
    /// Waits up to this long (PostgreSQL's `lock_timeout`).
    Timeout(Duration),
    /// Waits without limit.
    Forever,
}

impl Mutex {
    /// A mutex on the key sqlx's [`PgAdvisoryLock::new`] derives from `name`.
    ///
    /// ```
    /// use pg_semaphore::{Mutex, PgAdvisoryLockKey};
    /// let mutex = Mutex::new("my first Postgres advisory lock!");
    /// // The value sqlx's own documentation pins for this name.
    /// assert_eq!(mutex.key(), PgAdvisoryLockKey::BigInt(-5560419505042474287));
    /// ```
    pub fn new(name: impl AsRef<str>) -> Self {
        let name = name.as_ref();
        let key = PgAdvisoryLock::new(name)
            .key()
            .as_bigint()
            .expect("sqlx derives 64-bit advisory keys from strings");
        Mutex {
            key: Key::BigInt(key),
            label: format!("mutex {name:?}"),
            heartbeat: DEFAULT_HEARTBEAT,
        }
    }

    /// A mutex on an explicit 64-bit key.
    ///
    /// ```
    /// use pg_semaphore::{Mutex, PgAdvisoryLockKey};
    /// let by_id = Mutex::with_key(42);
    /// assert_eq!(by_id.key(), PgAdvisoryLockKey::BigInt(42));
    /// ```
    pub fn with_key(key: i64) -> Self {
        Mutex {
            key: Key::BigInt(key),
            label: format!("mutex key {key}"),
            heartbeat: DEFAULT_HEARTBEAT,
        }
    }

    /// A mutex on an explicit pair of 32-bit keys. PostgreSQL keeps this key
    /// space apart from the 64-bit one: `with_key_pair(0, 42)` and
    /// `with_key(42)` are different locks.
    ///
    /// ```
    /// use pg_semaphore::{Mutex, PgAdvisoryLockKey};
    /// let by_pair = Mutex::with_key_pair(7, 1001);
    /// assert_eq!(by_pair.key(), PgAdvisoryLockKey::IntPair(7, 1001));
    /// ```
    pub fn with_key_pair(first: i32, second: i32) -> Self {
        Mutex {
            key: Key::IntPair(first, second),
            label: format!("mutex key ({first}, {second})"),
            heartbeat: DEFAULT_HEARTBEAT,
        }
    }

    /// How often a session lock checks that its connection is alive (default
    /// [`DEFAULT_HEARTBEAT`]); a dead connection is reported by
    /// [`SessionGuard::lost`] within about this interval. Zero is raised to 10 ms.
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = interval.max(Duration::from_millis(10));
        self
    }

    /// The advisory lock key, as sqlx spells it.
    pub fn key(&self) -> PgAdvisoryLockKey {
        match self.key {
            Key::BigInt(key) => PgAdvisoryLockKey::BigInt(key),
            Key::IntPair(first, second) => PgAdvisoryLockKey::IntPair(first, second),
        }
    }

    /// How the mutex is named in errors and logs (`mutex "name"` or `mutex key 42`).
    pub fn name(&self) -> &str {
        &self.label
    }

    /// Takes the lock exclusively in a new transaction, waiting without limit.
    ///
    /// # Errors
    ///
    /// [`Error::Deadlock`] when PostgreSQL detects a deadlock (only possible
    /// when the caller holds other locks), [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the wait runs in a spawned task that owns the
    /// connection; if the caller goes away, the task cancels the waiting
    /// statement on the server and rolls back, so no lock is left held or
    /// queued.
    pub async fn lock(&self, pool: &PgPool) -> Result<MutexGuard> {
        self.acquire(pool, Mode::Exclusive, Wait::Forever)
            .await
            .map(expect_guard)
    }

    /// Takes the lock exclusively in a new transaction, waiting up to `timeout`.
    ///
    /// The wait uses PostgreSQL's `lock_timeout` (set for this statement only;
    /// the transaction's previous setting is restored once the lock is held),
    /// so the server gives up at the deadline. Timeouts beyond PostgreSQL's
    /// maximum (about 24.8 days) wait without limit.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] after `timeout` (SQLSTATE 55P03), [`Error::Deadlock`],
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Mutex::lock).
    pub async fn lock_timeout(&self, pool: &PgPool, timeout: Duration) -> Result<MutexGuard> {
        self.acquire(pool, Mode::Exclusive, Wait::Timeout(timeout))
            .await
            .map(expect_guard)
    }

    /// Takes the lock exclusively if nobody holds it; `Ok(None)` when busy.
    ///
    /// # Errors
    ///
    /// [`Error::Database`] only: "busy" is `Ok(None)`, never an error.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Mutex::lock).
    pub async fn try_lock(&self, pool: &PgPool) -> Result<Option<MutexGuard>> {
        self.acquire(pool, Mode::Exclusive, Wait::Try).await
    }

    /// Takes the lock in shared (reader) mode, waiting without limit: any
    /// number of shared holders, or one exclusive holder.
    ///
    /// # Errors
    ///
    /// As [`lock`](Mutex::lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Mutex::lock).
    pub async fn lock_shared(&self, pool: &PgPool) -> Result<MutexGuard> {
        self.acquire(pool, Mode::Shared, Wait::Forever)
            .await
            .map(expect_guard)
    }

    /// Takes the lock in shared mode, waiting up to `timeout`.
    ///
    /// # Errors
    ///
    /// As [`lock_timeout`](Mutex::lock_timeout).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Mutex::lock).
    pub async fn lock_shared_timeout(
        &self,
        pool: &PgPool,
        timeout: Duration,
    ) -> Result<MutexGuard> {
        self.acquire(pool, Mode::Shared, Wait::Timeout(timeout))
            .await
            .map(expect_guard)
    }

    /// Takes the lock in shared mode unless an exclusive holder has it.
    ///
    /// # Errors
    ///
    /// As [`try_lock`](Mutex::try_lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Mutex::lock).
    pub async fn try_lock_shared(&self, pool: &PgPool) -> Result<Option<MutexGuard>> {
        self.acquire(pool, Mode::Shared, Wait::Try).await
    }

    /// Takes the lock exclusively inside a transaction the caller already
    /// has; it is released when that transaction ends. `None` waits without
    /// limit.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// let mut tx = pool.begin().await?;
    /// pg_semaphore::Mutex::new("ledger").lock_in(&mut tx, Some(Duration::from_secs(2))).await?;
    /// sqlx::query("INSERT INTO ledger (amount) VALUES (10)").execute(&mut *tx).await?;
    /// tx.commit().await?; // releases the lock
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`lock_timeout`](Mutex::lock_timeout). After an error the
    /// transaction is aborted: roll it back.
    ///
    /// # Cancel safety
    ///
    /// The statement runs on the caller's connection: if the future is
    /// dropped mid-wait, roll the transaction back (dropping it does), which
    /// also releases the lock if it was granted.
    pub async fn lock_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let wait = timeout.map_or(Wait::Forever, Wait::Timeout);
        let sql = self.xact_sql(Mode::Exclusive, wait, &token());
        sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut **tx)
            .await
            .map_err(|e| self.lock_error(e, wait))?;
        Ok(())
    }

    /// Takes the lock exclusively inside the caller's transaction if nobody
    /// holds it; returns whether it did.
    ///
    /// # Errors
    ///
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// As [`lock_in`](Mutex::lock_in).
    pub async fn try_lock_in(&self, tx: &mut Transaction<'_, Postgres>) -> Result<bool> {
        let sql = self.xact_sql(Mode::Exclusive, Wait::Try, &token());
        let rows = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut **tx)
            .await?;
        try_result(&rows)
    }

    /// Runs `work` under the exclusive lock, in the lock's transaction:
    /// commits (releasing the lock) when it returns `Ok`, rolls back when it
    /// returns `Err`. `None` waits for the lock without limit.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// use pg_semaphore::Mutex;
    /// let rows = Mutex::new("rebuild-index")
    ///     .with_lock(&pool, None, |conn| {
    ///         Box::pin(async move {
    ///             let done = sqlx::query("DELETE FROM search_queue").execute(conn).await?;
    ///             Ok::<_, pg_semaphore::Error>(done.rows_affected())
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// What `work` returns, or the lock's errors ([`Error::Timeout`],
    /// [`Error::Deadlock`], [`Error::Database`]) and a failed commit,
    /// converted with `From<Error>`.
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped, the transaction is rolled back (by the
    /// guard's drop) and the lock released.
    pub async fn with_lock<T, E, F>(
        &self,
        pool: &PgPool,
        timeout: Option<Duration>,
        work: F,
    ) -> std::result::Result<T, E>
    where
        F: for<'c> FnOnce(
            &'c mut PgConnection,
        )
            -> Pin<Box<dyn Future<Output = std::result::Result<T, E>> + Send + 'c>>,
        E: From<Error>,
    {
        let mut guard = match timeout {
            Some(timeout) => self.lock_timeout(pool, timeout).await?,
            None => self.lock(pool).await?,
        };
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

    /// Takes a **session-scoped** exclusive lock on a dedicated connection,
    /// for holds that must outlive a transaction (a leader, a long job).
    /// `None` waits without limit.
    ///
    /// The connection is detached from the pool, so the pool can never hand
    /// it to someone else while it holds the lock. A background task pings
    /// it every [`heartbeat`](Mutex::heartbeat); if the connection dies, the
    /// server has freed the lock and [`SessionGuard::lost`] resolves so the
    /// holder can stop. Release with [`SessionGuard::unlock`]; dropping the
    /// guard closes the connection, which frees the lock too.
    ///
    /// Session locks need a direct connection: they do not work through a
    /// transaction-pooling proxy such as PgBouncer.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`], [`Error::Deadlock`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Mutex::lock): a cancelled wait is cancelled
    /// on the server and the connection closed.
    pub async fn lock_session(
        &self,
        pool: &PgPool,
        timeout: Option<Duration>,
    ) -> Result<SessionGuard> {
        let wait = timeout.map_or(Wait::Forever, Wait::Timeout);
        self.acquire_session(pool, wait)
            .await
            .map(|guard| guard.expect("a waiting session lock returns a guard or an error"))
    }

    /// Takes a session-scoped exclusive lock if nobody holds it; `Ok(None)` when busy.
    ///
    /// # Errors
    ///
    /// [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock_session`](Mutex::lock_session).
    pub async fn try_lock_session(&self, pool: &PgPool) -> Result<Option<SessionGuard>> {
        self.acquire_session(pool, Wait::Try).await
    }

    /// The key as SQL arguments: `42` or `7, 1001` (integers: nothing to escape).
    fn key_args(&self) -> String {
        match self.key {
            Key::BigInt(k) => format!("{k}::int8"),
            Key::IntPair(a, b) => format!("{a}::int4, {b}::int4"),
        }
    }

    /// The transaction-scoped lock statement, one round trip (simple query
    /// protocol, so it also works through PgBouncer without prepared
    /// statements). It starts with a unique token so that a wait whose
    /// caller has gone can be found and cancelled; it sets `lock_timeout`
    /// for the lock only and restores the transaction's own setting after.
    fn xact_sql(&self, mode: Mode, wait: Wait, token: &str) -> String {
        let args = self.key_args();
        let function = match (mode, wait) {
            (Mode::Exclusive, Wait::Try) => "pg_try_advisory_xact_lock",
            (Mode::Shared, Wait::Try) => "pg_try_advisory_xact_lock_shared",
            (Mode::Exclusive, _) => "pg_advisory_xact_lock",
            (Mode::Shared, _) => "pg_advisory_xact_lock_shared",
        };
        match lock_timeout_ms(wait) {
            None => format!("{token} SELECT {function}({args})"),
            // One statement: the inner select reads the transaction's
            // lock_timeout, sets ours and waits for the lock (left to right);
            // the outer one then restores theirs.
            Some(ms) => format!(
                "{token} SELECT set_config('lock_timeout', t.saved, true) FROM (SELECT \
                 current_setting('lock_timeout') AS saved, \
                 set_config('lock_timeout', '{ms}ms', true) AS ours, \
                 {function}({args}) AS locked) AS t"
            ),
        }
    }

    /// The one-round-trip waiting lock (see [`Mutex::wait_xact_lock`]): the
    /// lock statement in the query's implicit transaction, then `BEGIN`.
    fn wait_sql(&self, mode: Mode, wait: Wait, token: &str) -> String {
        format!("{}; BEGIN", self.xact_sql(mode, wait, token))
    }

    /// The session-scoped lock statement; also returns the backend's pid.
    fn session_sql(&self, wait: Wait, token: &str) -> String {
        let args = self.key_args();
        match lock_timeout_ms(wait) {
            None => format!("{token} SELECT pg_backend_pid(), pg_try_advisory_lock({args})"),
            Some(ms) => format!(
                "{token} SET lock_timeout = '{ms}ms'; \
                 SELECT pg_backend_pid(), pg_advisory_lock({args}); \
                 SET lock_timeout = DEFAULT"
            ),
        }
    }

    fn lock_error(&self, error: sqlx::Error, wait: Wait) -> Error {
        let code = error.as_database_error().and_then(|e| e.code());
        match (code.as_deref(), wait) {
            (Some("55P03"), Wait::Timeout(timeout)) => {
                tracing::info!(
                    mutex = %self.label,
                    timeout_ms = timeout.as_millis() as u64,
                    "mutex lock timed out"
                );
                Error::Timeout {
                    name: self.label.clone(),
                    timeout,
                }
            }
            (Some("40P01"), _) => {
                tracing::warn!(
                    mutex = %self.label,
                    "deadlock detected waiting for a mutex; its transaction was rolled back"
                );
                Error::Deadlock {
                    name: self.label.clone(),
                }
            }
            _ => error.into(),
        }
    }

    /// One event per waiting lock granted (never per poll: a wait is one
    /// statement), with how long it waited.
    fn trace_locked(&self, mode: Mode, scope: &'static str, started: std::time::Instant) {
        tracing::debug!(
            mutex = %self.label,
            mode = ?mode,
            scope,
            waited_ms = started.elapsed().as_millis() as u64,
            "mutex locked"
        );
    }

    /// Runs the transaction-scoped lock in a spawned task that owns the
    /// transaction, so that a caller who goes away mid-wait never leaves a
    /// lock held or queued.
    async fn acquire(&self, pool: &PgPool, mode: Mode, wait: Wait) -> Result<Option<MutexGuard>> {
        let (reply, response) = oneshot::channel();
        let mutex = self.clone();
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut reply = reply;
            let token = token();
            let started = std::time::Instant::now();
            let outcome = match wait {
                Wait::Try => mutex.try_xact_lock(&pool, mode, &token, &mut reply).await,
                _ => {
                    mutex
                        .wait_xact_lock(&pool, mode, wait, &token, &mut reply)
                        .await
                }
            };
            let Some(outcome) = outcome else {
                return; // the caller has gone; everything was let go of
            };
            if let (Ok(Some(_)), Wait::Timeout(_) | Wait::Forever) = (&outcome, wait) {
                mutex.trace_locked(mode, "transaction", started);
            }
            let response = outcome.map(|tx| {
                tx.map(|tx| MutexGuard {
                    tx: Some(tx),
                    name: mutex.label.clone(),
                    shared: mode == Mode::Shared,
                })
            });
            // If the caller left just now, the guard comes back and its drop rolls back.
            let _ = reply.send(response);
        });
        response
            .await
            .unwrap_or(Err(Error::Database(sqlx::Error::WorkerCrashed)))
    }

    /// A waiting lock in **one round trip**: `wait_sql` takes the lock in the
    /// implicit transaction of a multi-statement simple query and ends with
    /// `BEGIN`, which turns that implicit transaction into the explicit one
    /// sqlx's `begin_with` expects. If the lock fails (timeout, deadlock,
    /// cancel), the implicit transaction is rolled back and the `BEGIN` never
    /// runs, so the connection goes back to the pool clean. `None` when the
    /// caller has gone.
    async fn wait_xact_lock<T>(
        &self,
        pool: &PgPool,
        mode: Mode,
        wait: Wait,
        token: &str,
        reply: &mut oneshot::Sender<T>,
    ) -> Option<Result<Option<Transaction<'static, Postgres>>>> {
        let sql = self.wait_sql(mode, wait, token);
        let begin = pool.begin_with(AssertSqlSafe(sql));
        match run_or_cancel(pool, begin, token, reply).await {
            Some(Ok(tx)) => Some(Ok(Some(tx))),
            Some(Err(error)) => Some(Err(self.lock_error(error, wait))),
            None => None, // a transaction that began anyway was dropped: rolled back
        }
    }

    /// A try-lock: `BEGIN`, then `pg_try_advisory_xact_lock` (it never waits,
    /// so there is nothing to cancel); `Ok(None)` when busy.
    async fn try_xact_lock<T>(
        &self,
        pool: &PgPool,
        mode: Mode,
        token: &str,
        reply: &mut oneshot::Sender<T>,
    ) -> Option<Result<Option<Transaction<'static, Postgres>>>> {
        let mut tx = match pool.begin().await {
            Ok(tx) => tx,
            Err(error) => return Some(Err(error.into())),
        };
        let sql = self.xact_sql(mode, Wait::Try, token);
        let statement = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(&mut *tx);
        let rows = match run_or_cancel(pool, statement, token, reply).await? {
            Ok(rows) => rows,
            Err(error) => return Some(Err(error.into())),
        };
        Some(match try_result(&rows) {
            Ok(true) => Ok(Some(tx)),
            Ok(false) => {
                let _ = tx.rollback().await;
                Ok(None)
            }
            Err(error) => Err(error),
        })
    }

    async fn acquire_session(&self, pool: &PgPool, wait: Wait) -> Result<Option<SessionGuard>> {
        let (reply, response) = oneshot::channel();
        let mutex = self.clone();
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut reply = reply;
            let mut conn = match pool.acquire().await {
                // Detached: the pool can never recycle it while it holds the lock.
                Ok(conn) => conn.detach(),
                Err(error) => {
                    let _ = reply.send(Err(error.into()));
                    return;
                }
            };
            let token = token();
            let started = std::time::Instant::now();
            let sql = mutex.session_sql(wait, &token);
            let statement = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(&mut conn);
            let Some(result) = run_or_cancel(&pool, statement, &token, &mut reply).await else {
                let _ = conn.close().await; // the session ends: any lock is freed
                return;
            };
            let row = match result {
                Ok(rows) => rows.into_iter().next(),
                Err(error) => {
                    let error = mutex.lock_error(error, wait);
                    if matches!(error, Error::Timeout { .. }) {
                        // lock_timeout can fire just as the lock is granted;
                        // a session lock would then survive the error.
                        let unlock = format!("SELECT pg_advisory_unlock({})", mutex.key_args());
                        if let Ok(true) = sqlx::query_scalar::<_, bool>(AssertSqlSafe(unlock))
                            .fetch_one(&mut conn)
                            .await
                        {
                            tracing::debug!(mutex = %mutex.label, "lock granted as lock_timeout fired; released");
                        }
                    }
                    let _ = conn.close().await;
                    let _ = reply.send(Err(error));
                    return;
                }
            };
            let (pid, held) = match row.map(|r| session_row(&r, wait)) {
                Some(Ok(parsed)) => parsed,
                Some(Err(error)) => {
                    let _ = conn.close().await;
                    let _ = reply.send(Err(error.into()));
                    return;
                }
                None => {
                    let _ = conn.close().await;
                    let _ = reply.send(Err(Error::Database(sqlx::Error::RowNotFound)));
                    return;
                }
            };
            if !held {
                let _ = conn.close().await;
                let _ = reply.send(Ok(None));
                return;
            }
            if !matches!(wait, Wait::Try) {
                mutex.trace_locked(Mode::Exclusive, "session", started);
            }
            let (commands, inbox) = mpsc::channel(1);
            let (lost_tx, lost) = watch::channel(false);
            let guard = SessionGuard {
                name: mutex.label.clone(),
                pid,
                commands,
                lost,
            };
            if reply.send(Ok(Some(guard))).is_err() {
                let _ = conn.close().await;
                return;
            }
            hold_session(conn, mutex, inbox, lost_tx).await;
        });
        response
            .await
            .unwrap_or(Err(Error::Database(sqlx::Error::WorkerCrashed)))
    }
}

fn expect_guard(guard: Option<MutexGuard>) -> MutexGuard {
    guard.expect("a waiting lock returns a guard or an error")
}

/// `lock_timeout` in milliseconds for a waiting lock: `None` for a try-lock,
/// `0` (PostgreSQL's "no limit") for an unbounded or out-of-range wait.
fn lock_timeout_ms(wait: Wait) -> Option<u128> {
    match wait {
        Wait::Try => None,
        Wait::Forever => Some(0),
        Wait::Timeout(timeout) => {
            // Round up, and never 0 (which would mean "no limit").
            let ms = timeout.as_nanos().div_ceil(1_000_000).max(1);
            Some(if ms > MAX_LOCK_TIMEOUT_MS { 0 } else { ms })
        }
    }
}

/// A unique marker for one lock statement: a comment with only hex digits.
fn token() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!(
        "/* pgsemaphore lock {:x}.{:x}.{:x} */",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        nanos
    )
}

/// Runs a lock statement; if the caller goes away while it runs, cancels it
/// on the server (from another connection), lets it end, and returns `None`.
async fn run_or_cancel<F, R, T>(
    pool: &PgPool,
    statement: F,
    token: &str,
    reply: &mut oneshot::Sender<T>,
) -> Option<std::result::Result<R, sqlx::Error>>
where
    F: Future<Output = std::result::Result<R, sqlx::Error>>,
{
    let mut statement = pin!(statement);
    tokio::select! {
        biased;
        result = &mut statement => Some(result),
        () = reply.closed() => {
            // The statement may not have reached the server yet (it can still
            // be waiting for a pool connection), so cancel until it has ended
            // (cancelled, or granted just before); what it returns is then
            // dropped, which rolls back.
            loop {
                if let Err(error) = cancel_wait(pool, token).await {
                    tracing::warn!(%error, "could not cancel an abandoned lock wait; retrying");
                }
                tokio::select! {
                    _ = &mut statement => return None,
                    () = tokio::time::sleep(CANCEL_RETRY) => {}
                }
            }
        }
    }
}

/// Cancels the statement that starts with `token`, from a connection of its
/// own: the pool may be exhausted by the very waits being abandoned.
async fn cancel_wait(pool: &PgPool, token: &str) -> std::result::Result<(), sqlx::Error> {
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await?;
    let result = sqlx::raw_sql(AssertSqlSafe(cancel_wait_sql(token)))
        .execute(&mut conn)
        .await;
    let _ = conn.close().await;
    result.map(|_| ())
}

/// The result of a try-lock statement: its one boolean.
fn try_result(rows: &[PgRow]) -> Result<bool> {
    let row = rows
        .last()
        .ok_or(Error::Database(sqlx::Error::RowNotFound))?;
    Ok(row.try_get::<bool, _>(0)?)
}

/// `(pid, held)` from a session lock statement's row.
fn session_row(row: &PgRow, wait: Wait) -> std::result::Result<(i32, bool), sqlx::Error> {
    let pid: i32 = row.try_get(0)?;
    let held = match wait {
        Wait::Try => row.try_get(1)?,
        _ => true,
    };
    Ok((pid, held))
}

/// Owns a session lock's connection until the guard unlocks or drops, or the
/// connection dies.
async fn hold_session(
    mut conn: PgConnection,
    mutex: Mutex,
    mut inbox: mpsc::Receiver<oneshot::Sender<Result<()>>>,
    lost: watch::Sender<bool>,
) {
    let mut heartbeat = tokio::time::interval(mutex.heartbeat);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    heartbeat.tick().await; // the first tick is immediate
    loop {
        tokio::select! {
            command = inbox.recv() => {
                let Some(done) = command else {
                    // The guard was dropped: closing the session frees the lock.
                    let _ = conn.close().await;
                    return;
                };
                let unlock = format!("SELECT pg_advisory_unlock({})", mutex.key_args());
                let result = match sqlx::query_scalar::<_, bool>(AssertSqlSafe(unlock)).fetch_one(&mut conn).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(Error::LockLost { name: mutex.label.clone() }),
                    Err(error) => {
                        let _ = lost.send(true);
                        tracing::warn!(mutex = %mutex.label, %error, "session lock connection failed at unlock");
                        Err(Error::LockLost { name: mutex.label.clone() })
                    }
                };
                let _ = conn.close().await;
                let _ = done.send(result);
                return;
            }
            _ = heartbeat.tick() => {
                if let Err(error) = conn.ping().await {
                    tracing::warn!(mutex = %mutex.label, %error, "session lock lost: its connection died");
                    let _ = lost.send(true);
                    drop(conn);
                    // Answer a later unlock with LockLost; stop when the guard drops.
                    while let Some(done) = inbox.recv().await {
                        let _ = done.send(Err(Error::LockLost { name: mutex.label.clone() }));
                    }
                    return;
                }
            }
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

/// A session-scoped lock on a dedicated connection; made by
/// [`Mutex::lock_session`].
///
/// Release it with [`unlock`](SessionGuard::unlock). **Dropping the guard
/// closes its connection in the background** (not immediate), and the server
/// frees the lock when the session ends. Watch [`lost`](SessionGuard::lost)
/// to learn that the connection died and the lock is gone.
#[must_use = "the lock is released (its connection closed) when the guard is dropped"]
pub struct SessionGuard {
    name: String,
    pid: i32,
    commands: mpsc::Sender<oneshot::Sender<Result<()>>>,
    lost: watch::Receiver<bool>,
}

impl fmt::Debug for SessionGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionGuard")
            .field("mutex", &self.name)
            .field("backend_pid", &self.pid)
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl SessionGuard {
    /// The PostgreSQL backend process that holds the lock (as in `pg_locks.pid`).
    pub fn backend_pid(&self) -> i32 {
        self.pid
    }

    /// Whether the lock is known to be lost (its connection died). Checked
    /// every heartbeat; `false` does not prove the lock is still held.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves when the lock is lost because its connection died (server
    /// restart, `pg_terminate_backend`, network failure), detected within
    /// about one [`heartbeat`](Mutex::heartbeat). Never resolves otherwise.
    /// The future is `'static`: hand it to the task doing the protected work.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool, long_job: impl std::future::Future<Output = ()>) -> Result<(), pg_semaphore::Error> {
    /// let leader = pg_semaphore::Mutex::new("leader").lock_session(&pool, None).await?;
    /// tokio::select! {
    ///     () = long_job => leader.unlock().await?,
    ///     () = leader.lost() => eprintln!("lost leadership: stopping"),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut lost = self.lost.clone();
        async move {
            if lost.wait_for(|lost| *lost).await.is_err() {
                // Released without being lost: never resolve.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Releases the lock and closes the connection.
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] when the connection had died (the lock was
    /// already free, and someone else may have held it since).
    ///
    /// # Cancel safety
    ///
    /// If cancelled, the connection is closed and the lock freed anyway.
    pub async fn unlock(self) -> Result<()> {
        let (done, result) = oneshot::channel();
        let lost = Error::LockLost {
            name: self.name.clone(),
        };
        if self.commands.send(done).await.is_err() {
            return Err(lost);
        }
        result.await.unwrap_or(Err(lost))
    }
}
