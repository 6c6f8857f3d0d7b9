//! Session-scoped locks (`pg_advisory_lock`) on a dedicated connection: the
//! lock and unlock statements ([`statement`], [`unlock_statement`]), the
//! [`Session`] task that runs them and holds the lock, and its
//! [`SessionGuard`].
//!
//! Who learns of a dead link, and when:
//! - the holder: the session pings its connection every heartbeat, and a
//!   ping that fails, or does not answer within a heartbeat, loses the lock
//!   ([`SessionGuard::lost`]). A half-open link (a partition, a host gone
//!   without a reset) blocks a ping forever; the bound turns it into a loss
//!   within two heartbeats, instead of the kernel's ~15 minutes;
//! - the server: it would otherwise keep a partitioned session, and its
//!   lock, until its TCP keepalive gives up (hours with Linux defaults). The
//!   session sets `idle_session_timeout` to three heartbeats (at least a
//!   second): pings keep a live session busy, so only a session cut off (or
//!   a frozen process) is ended, and its lock freed. It also sets the
//!   server's TCP keepalives and `tcp_user_timeout` for the connection
//!   ([`dead_man_sql`], shared with the advisory semaphore's sessions).
//!   (sqlx gives no access to the client's socket options: on this side the
//!   ping's bound does that job.)

use std::fmt;
use std::future::Future;

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, Postgres, Row};
use tokio::sync::{mpsc, oneshot, watch};

use crate::dead_man::{self, dead_man_sql};
use crate::detached::{CallerGone, caller_gone, detached};
use crate::error::{Error, LostReason, Result};

use super::cancel::{run_or_cancel, token};
use super::lock::{Lock, Mode, Wait, lock_timeout_ms, run_on};

/// The session-scoped lock statement; also returns the backend's pid. It
/// starts with a unique token so that a wait whose caller has gone can be
/// found and cancelled (simple query protocol: nothing to prepare).
fn statement(mutex: &Lock, mode: Mode, wait: Wait, token: &str) -> String {
    let args = mutex.key_args();
    let shared = match mode {
        Mode::Exclusive => "",
        Mode::Shared => "_shared",
    };
    match lock_timeout_ms(wait) {
        None => format!("{token} SELECT pg_backend_pid(), pg_try_advisory_lock{shared}({args})"),
        Some(ms) => format!(
            "{token} SET lock_timeout = '{ms}ms'; \
             SELECT pg_backend_pid(), pg_advisory_lock{shared}({args}); \
             SET lock_timeout = DEFAULT"
        ),
    }
}

/// Unlocks a session lock.
fn unlock_statement(mutex: &Lock, mode: Mode) -> String {
    let shared = match mode {
        Mode::Exclusive => "",
        Mode::Shared => "_shared",
    };
    format!("SELECT pg_advisory_unlock{shared}({})", mutex.key_args())
}

/// Takes a session lock on a dedicated connection, in a spawned task that
/// then holds it (see [`Session`]).
pub(super) async fn lock(
    mutex: &Lock,
    pool: &PgPool,
    mode: Mode,
    wait: Wait,
) -> Result<SessionGuard> {
    let (mutex, pool) = (mutex.clone(), pool.clone());
    let (commands, inbox) = mpsc::channel(1);
    let (lost_tx, lost) = watch::channel(None);
    let reply = detached(move |mut caller| async move {
        let conn = tokio::select! {
            conn = pool.acquire() => conn?,
            () = caller.wait() => return Err(caller_gone()),
        };
        let session = Session::start(mutex, &pool, conn, mode, wait, &mut caller).await?;
        let pid = session.pid;
        let name = session.mutex.label.clone();
        tokio::spawn(session.hold(inbox, lost_tx));
        Ok((pid, name))
    })
    .await;
    let (pid, name) = reply?;
    Ok(SessionGuard {
        name,
        pid,
        shared: mode == Mode::Shared,
        commands,
        lost,
    })
}

/// The task that holds a session lock: owns the dedicated connection until
/// the guard unlocks or drops, or the connection dies.
struct Session {
    mutex: Lock,
    mode: Mode,
    conn: PgConnection,
    pid: i32,
}

impl Session {
    /// Detaches the connection from the pool (so it can never be handed to
    /// someone else while it holds the lock), sets the server's dead-man
    /// switch, and takes the lock.
    async fn start(
        mutex: Lock,
        pool: &PgPool,
        conn: PoolConnection<Postgres>,
        mode: Mode,
        wait: Wait,
        caller: &mut CallerGone,
    ) -> Result<Session> {
        let mut conn = conn.detach();
        let result = async {
            sqlx::raw_sql(AssertSqlSafe(dead_man_sql(mutex.heartbeat)))
                .execute(&mut conn)
                .await?;
            let token = token();
            let started = std::time::Instant::now();
            let locking = run_on(&mut conn, statement(&mutex, mode, wait, &token));
            let Some(result) = run_or_cancel(pool, locking, &token, caller).await else {
                return Err(caller_gone());
            };
            let rows = match result {
                Ok(rows) => rows,
                Err(error) => return Err(mutex.lock_error(error, wait)),
            };
            let (pid, held) = session_row(rows.first(), wait)?;
            if !held {
                return Err(mutex.locked());
            }
            if wait != Wait::Try {
                mutex.trace_locked(mode, "session", started);
            }
            Ok(pid)
        }
        .await;
        match result {
            Ok(pid) => Ok(Session {
                mutex,
                mode,
                conn,
                pid,
            }),
            Err(error) => {
                if matches!(error, Error::Timeout { .. }) {
                    // lock_timeout can fire just as the lock is granted; a
                    // session lock would then outlive the error. Closing the
                    // session below frees it anyway; unlock to say so.
                    if let Ok(true) =
                        sqlx::query_scalar::<_, bool>(AssertSqlSafe(unlock_statement(&mutex, mode)))
                            .fetch_one(&mut conn)
                            .await
                    {
                        tracing::debug!(mutex = %mutex.label, "lock granted as lock_timeout fired; released");
                    }
                }
                // The session ends: any lock it had is freed.
                let _ = conn.close().await;
                Err(error)
            }
        }
    }

    /// Holds the lock: answers the guard's unlock, pings every heartbeat,
    /// reports a loss. Closing the connection ends the session and frees the
    /// lock on the server.
    async fn hold(
        mut self,
        mut inbox: mpsc::Receiver<oneshot::Sender<Result<()>>>,
        lost: watch::Sender<Option<LostReason>>,
    ) {
        let mut heartbeat = tokio::time::interval(self.mutex.heartbeat);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.tick().await; // the first tick is immediate
        loop {
            tokio::select! {
                command = inbox.recv() => {
                    match command {
                        Some(done) => {
                            let result = self.unlock(&lost).await;
                            let _ = done.send(result);
                        }
                        // The guard was dropped: closing the session frees the lock.
                        None => {
                            let _ = self.conn.close().await;
                        }
                    }
                    return;
                }
                _ = heartbeat.tick() => {
                    if let Err(why) = self.ping().await {
                        tracing::warn!(mutex = %self.mutex.label, %why, "session lock lost");
                        let _ = lost.send(Some(LostReason::ConnectionLost));
                        drop(self.conn);
                        // Answer a later unlock with LockLost; stop when the guard drops.
                        while let Some(done) = inbox.recv().await {
                            let _ = done.send(Err(lost_lock(&self.mutex)));
                        }
                        return;
                    }
                }
            }
        }
    }

    /// One heartbeat: the connection answers within a heartbeat, or the lock
    /// is lost.
    async fn ping(&mut self) -> std::result::Result<(), String> {
        match tokio::time::timeout(self.mutex.heartbeat, self.conn.ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(format!("its connection died: {error}")),
            Err(_) => Err(format!(
                "its connection did not answer within {:?}",
                self.mutex.heartbeat
            )),
        }
    }

    /// Releases the lock and closes the session.
    async fn unlock(mut self, lost: &watch::Sender<Option<LostReason>>) -> Result<()> {
        let unlock =
            sqlx::query_scalar::<_, bool>(AssertSqlSafe(unlock_statement(&self.mutex, self.mode)));
        let result = match tokio::time::timeout(
            self.mutex.heartbeat * 3,
            unlock.fetch_one(&mut self.conn),
        )
        .await
        {
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => Err(lost_lock(&self.mutex)),
            Ok(Err(_)) | Err(_) => {
                let _ = lost.send(Some(LostReason::ConnectionLost));
                tracing::warn!(mutex = %self.mutex.label, "session lock connection failed at unlock");
                Err(lost_lock(&self.mutex))
            }
        };
        let _ = self.conn.close().await;
        result
    }
}

/// What an unlock answers once the session has lost its lock.
fn lost_lock(mutex: &Lock) -> Error {
    Error::LockLost {
        mutex: mutex.label.clone(),
        reason: LostReason::ConnectionLost,
    }
}

/// `(pid, held)` from a session lock statement's row.
fn session_row(row: Option<&PgRow>, wait: Wait) -> Result<(i32, bool)> {
    let row = row.ok_or(Error::Database(sqlx::Error::RowNotFound))?;
    let pid: i32 = row.try_get(0)?;
    let held = match wait {
        Wait::Try => row.try_get(1)?,
        _ => true,
    };
    Ok((pid, held))
}

/// A session-scoped lock on a dedicated connection; made by
/// [`Locking::lock_session`](crate::Locking::lock_session).
///
/// Release it with [`unlock`](SessionGuard::unlock). **Dropping the guard
/// closes its connection in the background** (not immediate), and the server
/// frees the lock when the session ends. Watch [`lost`](SessionGuard::lost)
/// to learn that the connection died and the lock is gone.
#[must_use = "the lock is released (its connection closed) when the guard is dropped"]
pub struct SessionGuard {
    name: String,
    pid: i32,
    shared: bool,
    commands: mpsc::Sender<oneshot::Sender<Result<()>>>,
    lost: watch::Receiver<Option<LostReason>>,
}

impl fmt::Debug for SessionGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionGuard")
            .field("mutex", &self.name)
            .field("shared", &self.shared)
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

    /// Whether this is a shared (reader) lock.
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// Whether the lock is known to be lost (its connection died or stopped
    /// answering). Checked every heartbeat; `false` does not prove the lock
    /// is still held.
    pub fn is_lost(&self) -> bool {
        self.lost.borrow().is_some()
    }

    /// Resolves when the lock is lost because its connection died (server
    /// restart, `pg_terminate_backend`, network failure) or stopped
    /// answering, detected within about two
    /// [`heartbeat`](crate::Mutex::heartbeat)s, with the reason
    /// ([`LostReason::ConnectionLost`]). Never resolves otherwise. The
    /// future is `'static`: hand it to the task doing the protected work.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool, long_job: impl std::future::Future<Output = ()>) -> Result<(), pg_semaphore::Error> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// let leader = pg_semaphore::Mutex::new("leader").locking().lock_session(&client).await?;
    /// tokio::select! {
    ///     () = long_job => leader.unlock().await?,
    ///     reason = leader.lost() => eprintln!("lost leadership ({reason}): stopping"),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        dead_man::lost(self.lost.clone())
    }

    /// Releases the lock and closes the connection.
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] when the connection had died or does not answer
    /// (the lock is or will be free, and someone else may have held it since).
    ///
    /// # Cancel safety
    ///
    /// If cancelled, the connection is closed and the lock freed anyway.
    pub async fn unlock(self) -> Result<()> {
        let (done, result) = oneshot::channel();
        let lost = Error::LockLost {
            mutex: self.name.clone(),
            reason: LostReason::ConnectionLost,
        };
        if self.commands.send(done).await.is_err() {
            return Err(lost);
        }
        result.await.unwrap_or(Err(lost))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mutex::lock::Key;

    #[test]
    fn session_statements_return_the_backend_pid() {
        let mutex = Lock::new(Key::IntPair(1, 2), "mutex key (1, 2)".into());
        assert_eq!(
            statement(&mutex, Mode::Exclusive, Wait::Try, "/* t */"),
            "/* t */ SELECT pg_backend_pid(), pg_try_advisory_lock(1::int4, 2::int4)"
        );
        assert!(
            statement(&mutex, Mode::Exclusive, Wait::Forever, "/* t */")
                .contains("SET lock_timeout = '0ms'")
        );
        assert!(
            statement(&mutex, Mode::Shared, Wait::Forever, "/* t */")
                .contains("pg_advisory_lock_shared(1::int4, 2::int4)")
        );
        assert_eq!(
            unlock_statement(&mutex, Mode::Exclusive),
            "SELECT pg_advisory_unlock(1::int4, 2::int4)"
        );
        assert_eq!(
            unlock_statement(&mutex, Mode::Shared),
            "SELECT pg_advisory_unlock_shared(1::int4, 2::int4)"
        );
    }
}
