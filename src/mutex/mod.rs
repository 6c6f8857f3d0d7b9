//! The mutex: PostgreSQL advisory locks. This module is the public face
//! ([`Mutex`]: keys and the common lock; [`Locking`]: a lock's options and
//! scopes, each a short delegation, straight down); below it:
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
use sqlx::{PgConnection, Postgres, Transaction};

use crate::Client;
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
/// [`Locking::lock_session`].
///
/// Keys: [`Mutex::new`] derives the 64-bit key from a name exactly as sqlx's
/// [`PgAdvisoryLock::new`] does, so this mutex and a `PgAdvisoryLock` on the
/// same name exclude each other; [`Mutex::with_key`] and
/// [`Mutex::with_key_pair`] take explicit keys.
///
/// [`lock`](Mutex::lock) takes it exclusively, waiting without limit;
/// [`locking`](Mutex::locking) sets the options: shared mode, a bounded
/// ([`Error::Timeout`]) or fail-fast ([`Error::Locked`]) wait, the caller's
/// transaction, a session-scoped lock, or a closure run under the lock.
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use pg_semaphore::Mutex;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// # let client = pg_semaphore::Client::new(pool.clone());
/// let mutex = Mutex::new("nightly-report");
/// let mut guard = mutex.locking().timeout(Duration::from_secs(5)).lock(&client).await?;
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
    /// [`DEFAULT_SESSION_HEARTBEAT`](crate::limits::DEFAULT_SESSION_HEARTBEAT)). A
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

    /// Takes the lock exclusively in a new transaction, waiting without
    /// limit: the common path. For a shared lock, a bounded or fail-fast
    /// wait, the caller's own transaction, a session-scoped lock or a
    /// closure run under the lock, start from [`locking`](Mutex::locking).
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
    pub async fn lock(&self, client: &Client) -> Result<MutexGuard> {
        self.locking().lock(client).await
    }

    /// Starts a lock with options: the mode ([`shared`](Locking::shared);
    /// exclusive by default), the wait ([`timeout`](Locking::timeout),
    /// [`no_wait`](Locking::no_wait); without limit by default), then one of
    /// the scopes: [`lock`](Locking::lock) (a transaction the guard owns),
    /// [`lock_in`](Locking::lock_in) (the caller's transaction),
    /// [`lock_session`](Locking::lock_session) (a session on a dedicated
    /// connection), or [`with_lock`](Locking::with_lock) (a closure in the
    /// lock's transaction).
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// use std::time::Duration;
    /// use pg_semaphore::Mutex;
    /// let mutex = Mutex::new("catalog");
    /// // A reader, waiting up to 5 s (PostgreSQL's lock_timeout).
    /// let reader = mutex.locking().shared().timeout(Duration::from_secs(5)).lock(&client).await?;
    /// // A leader: a session lock, or Error::Locked at once if someone has it.
    /// match Mutex::new("leader").locking().no_wait().lock_session(&client).await {
    ///     Ok(leader) => { /* lead until leader.lost() */ }
    ///     Err(e) if e.is_busy() => { /* someone else leads */ }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn locking(&self) -> Locking<'_> {
        Locking {
            lock: &self.lock,
            mode: Mode::Exclusive,
            wait: Wait::Forever,
        }
    }
}

/// One lock's options; made by [`Mutex::locking`]. Set the mode and the
/// wait, then await one of the scopes: [`lock`](Locking::lock),
/// [`lock_in`](Locking::lock_in), [`lock_session`](Locking::lock_session)
/// or [`with_lock`](Locking::with_lock).
///
/// Busy and timeouts read as for a semaphore: [`no_wait`](Locking::no_wait)
/// fails fast with [`Error::Locked`] ([`Error::is_busy`]),
/// [`timeout`](Locking::timeout) gives up with [`Error::Timeout`], and by
/// default the lock is waited for without limit.
#[derive(Debug, Clone, Copy)]
#[must_use = "a lock request does nothing until one of its lock methods is awaited"]
pub struct Locking<'a> {
    lock: &'a Lock,
    mode: Mode,
    wait: Wait,
}

impl Locking<'_> {
    /// Shared (reader) mode: any number of shared holders, or one exclusive
    /// holder. Default: exclusive.
    pub fn shared(mut self) -> Self {
        self.mode = Mode::Shared;
        self
    }

    /// Waits up to `timeout` for the lock, then gives up with
    /// [`Error::Timeout`]. Default: no limit.
    ///
    /// The bound is PostgreSQL's `lock_timeout`, set for the lock statement
    /// only (the transaction's or session's own setting is restored once
    /// the lock is held), so the **server** gives up at the deadline: no
    /// cancel request, no round trip, and the waiter leaves the lock's
    /// queue at once. Prefer it to wrapping the future in
    /// `tokio::time::timeout`, which also works (the future is
    /// cancel-safe) but leaves the server waiting until the cancel arrives.
    /// Timeouts beyond PostgreSQL's maximum (about 24.8 days) wait without
    /// limit. Replaces an earlier [`no_wait`](Locking::no_wait).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.wait = Wait::Timeout(timeout);
        self
    }

    /// Takes the lock only if nobody holds it (`pg_try_advisory_*`), else
    /// fails at once with [`Error::Locked`]. Replaces an earlier
    /// [`timeout`](Locking::timeout).
    pub fn no_wait(mut self) -> Self {
        self.wait = Wait::Try;
        self
    }

    /// Takes the lock in a new transaction, which the [`MutexGuard`] owns:
    /// the lock is released when that transaction commits or rolls back.
    ///
    /// Without a [`timeout`](Locking::timeout) the wait has no limit, even
    /// where the session has a `lock_timeout` of its own (`ALTER ROLE ..
    /// SET lock_timeout`). The lock statement is then the lock function
    /// alone, the cheapest to parse. The first time, in a process, that such
    /// a setting ends a wait (one 55P03 in the server's log), the wait
    /// starts again at the back of the lock's queue with a statement that
    /// sets `lock_timeout` for the wait, as every later wait of the process
    /// does. The protected work runs under the session's own setting.
    ///
    /// # Errors
    ///
    /// [`Error::Locked`] with [`no_wait`](Locking::no_wait) when someone
    /// else holds it; [`Error::Timeout`] after the
    /// [`timeout`](Locking::timeout) (SQLSTATE 55P03); [`Error::Deadlock`]
    /// when PostgreSQL detects a deadlock (only possible when the caller
    /// holds other locks); [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the wait runs in a spawned task that owns the
    /// connection; if the caller goes away, the task cancels the waiting
    /// statement on the server (once it was sent) and rolls back, so no lock
    /// is left held or queued.
    pub async fn lock(self, client: &Client) -> Result<MutexGuard> {
        xact::lock(self.lock, client.pool(), self.mode, self.wait).await
    }

    /// Takes the lock inside a transaction the caller already has; it is
    /// released when that transaction ends.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// pg_semaphore::Mutex::new("ledger").locking().lock_in(&mut tx).await?;
    /// sqlx::query("INSERT INTO ledger (amount) VALUES (10)").execute(&mut *tx).await?;
    /// tx.commit().await?; // releases the lock
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`lock`](Locking::lock). After an error the transaction is
    /// aborted: roll it back.
    ///
    /// # Cancel safety
    ///
    /// The statement runs on the caller's connection: if the future is
    /// dropped mid-wait, roll the transaction back (dropping it does), which
    /// also releases the lock if it was granted.
    pub async fn lock_in(self, tx: &mut Transaction<'_, Postgres>) -> Result<()> {
        xact::lock_in(self.lock, tx, self.mode, self.wait).await
    }

    /// Runs `work` under the lock, in the lock's transaction: commits
    /// (releasing the lock) when it returns `Ok`, rolls back when it returns
    /// `Err`.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// use pg_semaphore::Mutex;
    /// let rows = Mutex::new("rebuild-index")
    ///     .locking()
    ///     .with_lock(&client, |conn| {
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
    /// What `work` returns, or the lock's errors (as
    /// [`lock`](Locking::lock)) and a failed commit, converted with
    /// `From<Error>`.
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped, the transaction is rolled back (by the
    /// guard's drop) and the lock released.
    pub async fn with_lock<T, E, F>(self, client: &Client, work: F) -> std::result::Result<T, E>
    where
        F: for<'c> FnOnce(
            &'c mut PgConnection,
        )
            -> Pin<Box<dyn Future<Output = std::result::Result<T, E>> + Send + 'c>>,
        E: From<Error>,
    {
        xact::with_lock(self.lock(client).await?, work).await
    }

    /// Takes a **session-scoped** lock on a dedicated connection, for holds
    /// that must outlive a transaction (a leader, a long job).
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
    /// As [`lock`](Locking::lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Locking::lock): a cancelled wait is
    /// cancelled on the server and the connection closed.
    pub async fn lock_session(self, client: &Client) -> Result<SessionGuard> {
        session::lock(self.lock, client.pool(), self.mode, self.wait).await
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
