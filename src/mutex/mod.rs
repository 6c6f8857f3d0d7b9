//! The mutex: PostgreSQL advisory locks. This module is the public face
//! ([`Mutex`]: keys and every lock method, each a short delegation, straight
//! down); below it:
//!
//! - [`xact`]: transaction-scoped locks: their lock statement, the code that
//!   runs it, and their [`MutexGuard`];
//! - [`session`]: session-scoped locks on a dedicated connection: their lock
//!   and unlock statements, the task that holds one, and their
//!   [`SessionGuard`];
//! - [`lock`], under both: the lock a mutex names, the wait as
//!   `lock_timeout`, and the reading of a lock statement's answer and errors;
//! - [`cancel`]: cancelling a lock wait whose caller has gone.

mod cancel;
mod lock;
mod session;
mod xact;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sqlx::postgres::{PgAdvisoryLock, PgAdvisoryLockKey};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::error::{Error, Result};

use self::lock::{Key, Lock, Mode, Wait};
pub use self::session::SessionGuard;
pub use self::xact::MutexGuard;

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
/// Busy and timeouts read as for a semaphore: `try_*` fails fast with
/// [`Error::Locked`] ([`Error::is_busy`]), `*_timeout` gives up with
/// [`Error::Timeout`], and the plain methods wait without limit.
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
    lock: Lock,
}

impl fmt::Debug for Mutex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lock = &self.lock;
        f.debug_struct("Mutex")
            .field("name", &lock.label)
            .field("key", &lock.key)
            .field("heartbeat", &lock.heartbeat)
            .field("idle_timeout", &lock.idle_timeout)
            .finish()
    }
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
        let key = match PgAdvisoryLock::new(name).key() {
            PgAdvisoryLockKey::BigInt(key) => Key::BigInt(*key),
            PgAdvisoryLockKey::IntPair(a, b) => Key::IntPair(*a, *b),
            // sqlx derives 64-bit keys from names; a future variant, by its
            // Debug text, would at least stay stable.
            other => Key::BigInt(hash_fallback(&format!("{other:?}"))),
        };
        Mutex::keyed(key, format!("mutex {name:?}"))
    }

    /// A mutex on an explicit 64-bit key.
    ///
    /// ```
    /// use pg_semaphore::{Mutex, PgAdvisoryLockKey};
    /// let by_id = Mutex::with_key(42);
    /// assert_eq!(by_id.key(), PgAdvisoryLockKey::BigInt(42));
    /// ```
    pub fn with_key(key: i64) -> Self {
        Mutex::keyed(Key::BigInt(key), format!("mutex key {key}"))
    }

    /// A mutex on an explicit pair of 32-bit keys. PostgreSQL keeps this key
    /// space apart from the 64-bit one: `with_key_pair(0, 42)` and
    /// `with_key(42)` are different locks. Pairs whose first key is
    /// `1885828965` are the semaphores' wake-up gates: holding one delays
    /// that semaphore's releases (it never admits too many); use another
    /// first key.
    ///
    /// ```
    /// use pg_semaphore::{Mutex, PgAdvisoryLockKey};
    /// let by_pair = Mutex::with_key_pair(7, 1001);
    /// assert_eq!(by_pair.key(), PgAdvisoryLockKey::IntPair(7, 1001));
    /// ```
    pub fn with_key_pair(first: i32, second: i32) -> Self {
        Mutex::keyed(
            Key::IntPair(first, second),
            format!("mutex key ({first}, {second})"),
        )
    }

    fn keyed(key: Key, label: String) -> Self {
        Mutex {
            lock: Lock::new(key, label),
        }
    }

    /// How often a session lock checks that its connection is alive (default
    /// [`DEFAULT_SESSION_HEARTBEAT`](crate::DEFAULT_SESSION_HEARTBEAT)). A
    /// check that does not answer within the interval loses the lock
    /// ([`SessionGuard::lost`]); the server ends a session that sent nothing
    /// for three intervals (at least a second: `idle_session_timeout`),
    /// which frees the lock when the client went dark. Zero is raised to
    /// 10 ms.
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.lock.heartbeat = interval.max(Duration::from_millis(10));
        self
    }

    /// Bounds how long a **transaction-scoped** lock's transaction may sit
    /// idle (no statement running) before the server ends the session, which
    /// rolls back and frees the lock: PostgreSQL's
    /// `idle_in_transaction_session_timeout`, set for the guard's transaction
    /// only. A guard whose process hangs or is cut off by a network partition
    /// then frees the lock after `timeout` instead of whenever the server's
    /// TCP keepalive notices (hours, by default). Default: none. Every pause
    /// between the guard's statements must stay below it.
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.lock.idle_timeout = Some(timeout.max(Duration::from_millis(1)));
        self
    }

    /// The advisory lock key, as sqlx spells it.
    pub fn key(&self) -> PgAdvisoryLockKey {
        match self.lock.key {
            Key::BigInt(key) => PgAdvisoryLockKey::BigInt(key),
            Key::IntPair(first, second) => PgAdvisoryLockKey::IntPair(first, second),
        }
    }

    /// How the mutex is named in errors and logs (`mutex "name"` or `mutex key 42`).
    pub fn name(&self) -> &str {
        &self.lock.label
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
    /// statement on the server (once it was sent) and rolls back, so no lock
    /// is left held or queued.
    pub async fn lock(&self, pool: &PgPool) -> Result<MutexGuard> {
        xact::lock(&self.lock, pool, Mode::Exclusive, Wait::Forever).await
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
        xact::lock(&self.lock, pool, Mode::Exclusive, Wait::Timeout(timeout)).await
    }

    /// Takes the lock exclusively if nobody holds it.
    ///
    /// # Errors
    ///
    /// [`Error::Locked`] when someone else holds it, [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Mutex::lock).
    pub async fn try_lock(&self, pool: &PgPool) -> Result<MutexGuard> {
        xact::lock(&self.lock, pool, Mode::Exclusive, Wait::Try).await
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
        xact::lock(&self.lock, pool, Mode::Shared, Wait::Forever).await
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
        xact::lock(&self.lock, pool, Mode::Shared, Wait::Timeout(timeout)).await
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
    pub async fn try_lock_shared(&self, pool: &PgPool) -> Result<MutexGuard> {
        xact::lock(&self.lock, pool, Mode::Shared, Wait::Try).await
    }

    /// Takes the lock exclusively inside a transaction the caller already
    /// has, waiting without limit; it is released when that transaction ends.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// pg_semaphore::Mutex::new("ledger").lock_in(&mut tx).await?;
    /// sqlx::query("INSERT INTO ledger (amount) VALUES (10)").execute(&mut *tx).await?;
    /// tx.commit().await?; // releases the lock
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`lock`](Mutex::lock). After an error the transaction is aborted:
    /// roll it back.
    ///
    /// # Cancel safety
    ///
    /// The statement runs on the caller's connection: if the future is
    /// dropped mid-wait, roll the transaction back (dropping it does), which
    /// also releases the lock if it was granted.
    pub async fn lock_in(&self, tx: &mut Transaction<'_, Postgres>) -> Result<()> {
        xact::lock_in(&self.lock, tx, Wait::Forever).await
    }

    /// As [`lock_in`](Mutex::lock_in), waiting up to `timeout`.
    ///
    /// # Errors
    ///
    /// As [`lock_timeout`](Mutex::lock_timeout). After an error the
    /// transaction is aborted: roll it back.
    ///
    /// # Cancel safety
    ///
    /// As [`lock_in`](Mutex::lock_in).
    pub async fn lock_in_timeout(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        timeout: Duration,
    ) -> Result<()> {
        xact::lock_in(&self.lock, tx, Wait::Timeout(timeout)).await
    }

    /// Takes the lock exclusively inside the caller's transaction if nobody
    /// holds it.
    ///
    /// # Errors
    ///
    /// [`Error::Locked`] when someone else holds it, [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// As [`lock_in`](Mutex::lock_in).
    pub async fn try_lock_in(&self, tx: &mut Transaction<'_, Postgres>) -> Result<()> {
        xact::lock_in(&self.lock, tx, Wait::Try).await
    }

    /// Runs `work` under the exclusive lock, in the lock's transaction:
    /// commits (releasing the lock) when it returns `Ok`, rolls back when it
    /// returns `Err`. Waits for the lock without limit.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// use pg_semaphore::Mutex;
    /// let rows = Mutex::new("rebuild-index")
    ///     .with_lock(&pool, |conn| {
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
    /// What `work` returns, or the lock's errors ([`Error::Deadlock`],
    /// [`Error::Database`]) and a failed commit, converted with `From<Error>`.
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped, the transaction is rolled back (by the
    /// guard's drop) and the lock released.
    pub async fn with_lock<T, E, F>(&self, pool: &PgPool, work: F) -> std::result::Result<T, E>
    where
        F: for<'c> FnOnce(
            &'c mut PgConnection,
        )
            -> Pin<Box<dyn Future<Output = std::result::Result<T, E>> + Send + 'c>>,
        E: From<Error>,
    {
        xact::with_lock(self.lock(pool).await?, work).await
    }

    /// As [`with_lock`](Mutex::with_lock), waiting up to `timeout` for the lock.
    ///
    /// # Errors
    ///
    /// As [`with_lock`](Mutex::with_lock), and [`Error::Timeout`].
    ///
    /// # Cancel safety
    ///
    /// As [`with_lock`](Mutex::with_lock).
    pub async fn with_lock_timeout<T, E, F>(
        &self,
        pool: &PgPool,
        timeout: Duration,
        work: F,
    ) -> std::result::Result<T, E>
    where
        F: for<'c> FnOnce(
            &'c mut PgConnection,
        )
            -> Pin<Box<dyn Future<Output = std::result::Result<T, E>> + Send + 'c>>,
        E: From<Error>,
    {
        xact::with_lock(self.lock_timeout(pool, timeout).await?, work).await
    }

    /// Takes a **session-scoped** exclusive lock on a dedicated connection,
    /// for holds that must outlive a transaction (a leader, a long job),
    /// waiting without limit.
    ///
    /// The connection is detached from the pool, so the pool can never hand
    /// it to someone else while it holds the lock. A background task pings
    /// it every [`heartbeat`](Mutex::heartbeat); if the connection dies or a
    /// ping goes unanswered for a heartbeat, the lock is reported lost
    /// ([`SessionGuard::lost`]) so the holder can stop, and the server, which
    /// ends a session silent for three heartbeats (`idle_session_timeout`,
    /// plus TCP keepalives on its side), frees it. Release with
    /// [`SessionGuard::unlock`]; dropping the guard closes the connection,
    /// which frees the lock too.
    ///
    /// Session locks need a direct connection: they do not work through a
    /// transaction-pooling proxy such as PgBouncer.
    ///
    /// # Errors
    ///
    /// [`Error::Deadlock`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Mutex::lock): a cancelled wait is cancelled
    /// on the server and the connection closed.
    pub async fn lock_session(&self, pool: &PgPool) -> Result<SessionGuard> {
        session::lock(&self.lock, pool, Wait::Forever).await
    }

    /// As [`lock_session`](Mutex::lock_session), waiting up to `timeout`.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`], [`Error::Deadlock`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// As [`lock_session`](Mutex::lock_session).
    pub async fn lock_session_timeout(
        &self,
        pool: &PgPool,
        timeout: Duration,
    ) -> Result<SessionGuard> {
        session::lock(&self.lock, pool, Wait::Timeout(timeout)).await
    }

    /// Takes a session-scoped exclusive lock if nobody holds it.
    ///
    /// # Errors
    ///
    /// [`Error::Locked`] when someone else holds it, [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock_session`](Mutex::lock_session).
    pub async fn try_lock_session(&self, pool: &PgPool) -> Result<SessionGuard> {
        session::lock(&self.lock, pool, Wait::Try).await
    }
}

/// FNV-1a: only for a key variant sqlx might add one day (never today).
fn hash_fallback(text: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_label_errors() {
        assert_eq!(Mutex::new("jobs").name(), "mutex \"jobs\"");
        assert_eq!(Mutex::with_key(3).name(), "mutex key 3");
        assert!(
            matches!(Mutex::with_key(3).lock.locked(), Error::Locked { mutex } if mutex == "mutex key 3")
        );
    }
}
