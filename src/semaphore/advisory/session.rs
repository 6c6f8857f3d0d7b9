//! The dedicated connections ("sessions") that hold advisory semaphores'
//! slots: a session-level advisory lock belongs to the backend that took
//! it, so each permit lives on one session, and is released there.
//!
//! Each [`Session`] is a task that owns one connection, outside the
//! application's pool, and runs its commands one at a time: claims,
//! releases, and the shared "waiting" locks of waiters. It knows which
//! slots it holds (an advisory lock is re-entrant: a second claim on the
//! same session must not take a slot it holds again, so each claim sends
//! that list), and it is the permits' lease:
//!
//! - **the holder learns of a dead link**: the session pings every
//!   heartbeat when idle, and bounds every statement; a ping or a
//!   statement that fails, or does not answer within a heartbeat (three for
//!   a statement), loses the session, and every permit on it is told
//!   ([`LostReason::ConnectionLost`]) within about two heartbeats;
//! - **the server frees a cut-off session**: the session sets
//!   `idle_session_timeout` to three heartbeats (and the server's TCP
//!   keepalives): pings keep a live one busy, so only a session whose
//!   client went silent is ended, and its locks freed, a heartbeat after
//!   its holder was told. A killed process's session ends at once (its
//!   socket closes).
//!
//! [`Sessions`] is the set a pool's advisory semaphores share: it opens a
//! new session when every open one is busy, up to a maximum, and sends each
//! claim to the least busy.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection};
use tokio::sync::{mpsc, oneshot, watch};

use crate::db;
use crate::error::{Error, LostReason, Result};
use crate::mutex::session::dead_man_sql;

/// Takes slots; `p_mine`: what this session holds of the semaphore already.
const CLAIM: &str = "SELECT o_status, o_slots, o_capacity, o_at \
                     FROM pgsemaphore.advisory_claim(p_semaphore => $1, p_permits => $2, p_mine => $3)";

/// Ends a permit: unlocks its slots and wakes other sessions' waiters
/// (returns the slots released, negative when it notified).
const RELEASE: &str =
    "SELECT pgsemaphore.advisory_release(p_semaphore => $1, p_key_base => $2, p_slots => $3)";

/// How many times, a millisecond apart, a waiter tries the waiting key
/// before it waits without it (a release holds it for microseconds; a
/// session that holds it longer is not ours to wait for).
const ANNOUNCE_TRIES: u32 = 20;

/// What a claim found.
#[derive(Debug)]
pub(crate) enum ClaimReply {
    Claimed { slots: Vec<u32>, at: DateTime<Utc> },
    Full { capacity: u32 },
    TooMany { capacity: u32 },
}

/// A session's work.
enum Command {
    Claim {
        semaphore: String,
        key_base: i64,
        permits: u32,
        reply: oneshot::Sender<Result<ClaimReply>>,
    },
    Release {
        semaphore: String,
        key_base: i64,
        slots: Vec<u32>,
        reply: Option<oneshot::Sender<Result<()>>>,
    },
    /// Takes the waiting key in shared mode (replies whether it got it).
    Announce {
        key: i64,
        reply: oneshot::Sender<bool>,
    },
    Withdraw {
        key: i64,
    },
}

/// One session, as the permits and waiters on it see it.
#[derive(Debug)]
pub(crate) struct SessionHandle {
    commands: mpsc::UnboundedSender<Command>,
    lost: watch::Receiver<Option<LostReason>>,
    /// Commands sent and not yet run (the session's task counts them
    /// down): the least busy session gets the next claim.
    in_flight: Arc<AtomicUsize>,
    /// The backend holding this session's locks (`pg_locks.pid`).
    pid: i32,
}

impl SessionHandle {
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// Why the session was lost, if it was.
    pub(crate) fn lost_reason(&self) -> Option<LostReason> {
        *self.lost.borrow()
    }

    /// Resolves when the session is lost; never otherwise.
    pub(crate) fn lost(&self) -> impl std::future::Future<Output = LostReason> + Send + 'static {
        let mut lost = self.lost.clone();
        async move {
            let reason = lost.wait_for(Option::is_some).await.map(|reason| *reason);
            match reason {
                Ok(reason) => reason.unwrap_or(LostReason::ConnectionLost),
                // The session task ended without a loss (nothing holds it any more).
                Err(_) => std::future::pending().await,
            }
        }
    }

    /// Claims on this session. Cancel-safe: the session runs the claim
    /// whatever happens to this future, and releases what it claimed if
    /// nobody is there to take the reply.
    pub(crate) async fn claim(
        &self,
        semaphore: &str,
        key_base: i64,
        permits: u32,
    ) -> Result<ClaimReply> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Claim {
            semaphore: semaphore.to_owned(),
            key_base,
            permits,
            reply,
        })?;
        answer.await.unwrap_or_else(|_| Err(lost_session()))
    }

    /// Releases slots on this session and waits for the answer.
    pub(crate) async fn release(
        &self,
        semaphore: &str,
        key_base: i64,
        slots: Vec<u32>,
    ) -> Result<()> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Release {
            semaphore: semaphore.to_owned(),
            key_base,
            slots,
            reply: Some(reply),
        })?;
        answer.await.unwrap_or_else(|_| Err(lost_session()))
    }

    /// Releases slots on this session without waiting (a dropped permit).
    pub(crate) fn release_later(&self, semaphore: &str, key_base: i64, slots: Vec<u32>) {
        let _ = self.send(Command::Release {
            semaphore: semaphore.to_owned(),
            key_base,
            slots,
            reply: None,
        });
    }

    /// Takes the waiting key `key` in shared mode on this session; whether
    /// it got it.
    pub(crate) async fn announce(&self, key: i64) -> bool {
        let (reply, answer) = oneshot::channel();
        if self.send(Command::Announce { key, reply }).is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }

    /// Gives the waiting key back (in the background).
    pub(crate) fn withdraw(&self, key: i64) {
        let _ = self.send(Command::Withdraw { key });
    }

    fn send(&self, command: Command) -> Result<()> {
        if self.lost_reason().is_some() {
            return Err(lost_session());
        }
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.commands.send(command).map_err(|_| {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            lost_session()
        })
    }
}

/// What a command on a lost session returns.
fn lost_session() -> Error {
    Error::Database(sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "the advisory semaphore's session was lost",
    )))
}

/// The sessions a pool's advisory semaphores share.
#[derive(Debug)]
pub(crate) struct Sessions {
    options: PgConnectOptions,
    heartbeat: Duration,
    max: usize,
    open: Mutex<Vec<Arc<SessionHandle>>>,
    /// Held while a session is being opened, so that a burst of claims
    /// opens one at a time.
    opening: tokio::sync::Mutex<()>,
}

/// Session sets by the options `Arc` they were made for.
static REGISTRY: Mutex<Vec<(Arc<PgConnectOptions>, Weak<Sessions>)>> = Mutex::new(Vec::new());

impl Sessions {
    /// The set for connections made with `options` (shared by every
    /// advisory semaphore built with the same options `Arc`: the first sets
    /// the heartbeat and the maximum).
    pub(crate) fn for_options(
        options: Arc<PgConnectOptions>,
        heartbeat: Duration,
        max: usize,
    ) -> Arc<Sessions> {
        let mut registry = lock(&REGISTRY);
        registry.retain(|(_, sessions)| sessions.strong_count() > 0);
        if let Some(sessions) = registry
            .iter()
            .find(|(o, _)| Arc::ptr_eq(o, &options))
            .and_then(|(_, s)| s.upgrade())
        {
            return sessions;
        }
        let sessions = Arc::new(Sessions {
            options: (*options).clone().application_name("pg-semaphore advisory"),
            heartbeat,
            max: max.max(1),
            open: Mutex::new(Vec::new()),
            opening: tokio::sync::Mutex::new(()),
        });
        registry.push((options, Arc::downgrade(&sessions)));
        sessions
    }

    pub(crate) fn heartbeat(&self) -> Duration {
        self.heartbeat
    }

    /// A session for the next command: the least busy one, or a new one
    /// if every open one is busy and the maximum allows.
    pub(crate) async fn pick(&self) -> Result<Arc<SessionHandle>> {
        if let Some(idle) = self.least_busy(true) {
            return Ok(idle);
        }
        let _opening = self.opening.lock().await;
        // Another claim may have opened one meanwhile.
        if let Some(idle) = self.least_busy(true) {
            return Ok(idle);
        }
        if lock(&self.open).len() < self.max {
            match self.connect().await {
                Ok(session) => {
                    lock(&self.open).push(session.clone());
                    return Ok(session);
                }
                // An outage: use a busy session if one is alive.
                Err(error) => return self.least_busy(false).ok_or(error),
            }
        }
        self.least_busy(false)
            .ok_or_else(|| Error::internal("no advisory session is open and none may be opened"))
    }

    /// The open session with the fewest commands in flight (only an idle
    /// one if `idle_only`); drops lost sessions from the set.
    fn least_busy(&self, idle_only: bool) -> Option<Arc<SessionHandle>> {
        let mut open = lock(&self.open);
        open.retain(|s| s.lost_reason().is_none());
        open.iter()
            .min_by_key(|s| s.in_flight.load(Ordering::Relaxed))
            .filter(|s| !idle_only || s.in_flight.load(Ordering::Relaxed) == 0)
            .cloned()
    }

    /// Opens a session: a connection of its own, with the server's
    /// dead-man switch set, and its task.
    async fn connect(&self) -> Result<Arc<SessionHandle>> {
        let mut conn = self.options.connect().await?;
        sqlx::raw_sql(AssertSqlSafe(dead_man_sql(self.heartbeat)))
            .execute(&mut conn)
            .await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await?;
        let (commands, inbox) = mpsc::unbounded_channel();
        let (lost_tx, lost) = watch::channel(None);
        let in_flight = Arc::new(AtomicUsize::new(0));
        let session = Session {
            conn,
            heartbeat: self.heartbeat,
            held: HashMap::new(),
            pid,
            in_flight: in_flight.clone(),
        };
        tokio::spawn(session.run(inbox, lost_tx));
        Ok(Arc::new(SessionHandle {
            commands,
            lost,
            in_flight,
            pid,
        }))
    }
}

/// The task that owns a session's connection.
struct Session {
    conn: PgConnection,
    heartbeat: Duration,
    /// Slots held, by semaphore.
    held: HashMap<String, Vec<u32>>,
    pid: i32,
    /// Shared with the handle: counted up when a command is sent, down
    /// here when it has run.
    in_flight: Arc<AtomicUsize>,
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    o_status: String,
    o_slots: Option<Vec<i32>>,
    o_capacity: i32,
    o_at: Option<DateTime<Utc>>,
}

impl Session {
    /// Runs commands until every handle is gone (then closing the
    /// connection frees whatever it still holds) or the session is lost.
    async fn run(
        mut self,
        mut inbox: mpsc::UnboundedReceiver<Command>,
        lost: watch::Sender<Option<LostReason>>,
    ) {
        let mut heartbeat = tokio::time::interval(self.heartbeat);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.tick().await; // the first tick is immediate
        let why = loop {
            tokio::select! {
                command = inbox.recv() => {
                    let Some(command) = command else {
                        let _ = self.conn.close().await;
                        return;
                    };
                    let result = self.handle(command).await;
                    self.in_flight.fetch_sub(1, Ordering::Relaxed);
                    if let Err(why) = result {
                        break why;
                    }
                    heartbeat.reset();
                }
                _ = heartbeat.tick() => {
                    match tokio::time::timeout(self.heartbeat, self.conn.ping()).await {
                        Ok(Ok(())) => {}
                        Ok(Err(error)) => break format!("its connection died: {error}"),
                        Err(_) => break format!("its connection did not answer within {:?}", self.heartbeat),
                    }
                }
            }
        };
        tracing::warn!(
            pid = self.pid,
            %why,
            held = self.held.values().map(Vec::len).sum::<usize>(),
            "advisory semaphore session lost: its permits are lost"
        );
        let _ = lost.send(Some(LostReason::ConnectionLost));
        drop(self.conn);
        // Answer what is still queued: the session is gone.
        inbox.close();
        while let Some(command) = inbox.recv().await {
            match command {
                Command::Claim { reply, .. } => drop(reply.send(Err(lost_session()))),
                Command::Release {
                    reply: Some(reply), ..
                } => drop(reply.send(Err(lost_session()))),
                Command::Announce { reply, .. } => drop(reply.send(false)),
                Command::Release { reply: None, .. } | Command::Withdraw { .. } => {}
            }
        }
    }

    /// Runs one command; `Err` loses the session (the connection failed or
    /// stopped answering).
    async fn handle(&mut self, command: Command) -> std::result::Result<(), String> {
        let bound = self.heartbeat * 3;
        match command {
            Command::Claim {
                semaphore,
                key_base,
                permits,
                reply,
            } => {
                let mine: Vec<i32> = self
                    .held
                    .get(&semaphore)
                    .map(|slots| slots.iter().map(|&s| s as i32).collect())
                    .unwrap_or_default();
                let query = sqlx::query_as::<_, ClaimRow>(CLAIM)
                    .bind(&semaphore)
                    .bind(permits as i32)
                    .bind(mine);
                let row = match tokio::time::timeout(bound, query.fetch_one(&mut self.conn)).await {
                    Err(_) => {
                        let _ = reply.send(Err(lost_session()));
                        return Err(format!("a claim did not answer within {bound:?}"));
                    }
                    Ok(Err(error)) => {
                        let dead = db::unreachable(&error);
                        let message = error.to_string();
                        let _ = reply.send(Err(db::ours(error)));
                        return if dead { Err(message) } else { Ok(()) };
                    }
                    Ok(Ok(row)) => row,
                };
                let capacity = row.o_capacity.max(0) as u32;
                let answer = match (row.o_status.as_str(), row.o_slots, row.o_at) {
                    ("claimed", Some(slots), Some(at)) => {
                        let slots: Vec<u32> = slots.into_iter().map(|s| s.max(0) as u32).collect();
                        self.held
                            .entry(semaphore.clone())
                            .or_default()
                            .extend(slots.iter().copied());
                        ClaimReply::Claimed { slots, at }
                    }
                    ("too_many", _, _) => ClaimReply::TooMany { capacity },
                    _ => ClaimReply::Full { capacity },
                };
                if let Err(Ok(ClaimReply::Claimed { slots, .. })) = reply.send(Ok(answer)) {
                    // The caller has gone: nobody will release these.
                    tracing::debug!(
                        semaphore,
                        ?slots,
                        "claim answered after its caller left; releasing"
                    );
                    return self
                        .release(&semaphore, key_base, slots, bound)
                        .await
                        .map(drop);
                }
                Ok(())
            }
            Command::Release {
                semaphore,
                key_base,
                slots,
                reply,
            } => {
                let result = self.release(&semaphore, key_base, slots, bound).await;
                let answer = match &result {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(message)) => Err(Error::internal(message.clone())),
                    Err(_) => Err(lost_session()),
                };
                if let Some(reply) = reply {
                    let _ = reply.send(answer);
                }
                result.map(drop)
            }
            Command::Announce { key, reply } => {
                for _ in 0..ANNOUNCE_TRIES {
                    let got = tokio::time::timeout(
                        bound,
                        sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_lock_shared($1)")
                            .bind(key)
                            .fetch_one(&mut self.conn),
                    )
                    .await;
                    match got {
                        Ok(Ok(true)) => {
                            let _ = reply.send(true);
                            return Ok(());
                        }
                        Ok(Ok(false)) => tokio::time::sleep(Duration::from_millis(1)).await,
                        Ok(Err(error)) if !db::unreachable(&error) => break,
                        Ok(Err(error)) => {
                            let _ = reply.send(false);
                            return Err(error.to_string());
                        }
                        Err(_) => {
                            let _ = reply.send(false);
                            return Err(format!(
                                "announcing a waiter did not answer within {bound:?}"
                            ));
                        }
                    }
                }
                let _ = reply.send(false);
                Ok(())
            }
            Command::Withdraw { key } => {
                let done = tokio::time::timeout(
                    bound,
                    sqlx::query("SELECT pg_advisory_unlock_shared($1)")
                        .bind(key)
                        .execute(&mut self.conn),
                )
                .await;
                match done {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(error)) if !db::unreachable(&error) => Ok(()),
                    Ok(Err(error)) => Err(error.to_string()),
                    Err(_) => Err(format!(
                        "withdrawing a waiter did not answer within {bound:?}"
                    )),
                }
            }
        }
    }

    /// Unlocks `slots` of `semaphore` and forgets them. `Err`: the session
    /// is lost; `Ok(Err)`: the database answered with an error (or held
    /// fewer slots than said, which would be a bug).
    async fn release(
        &mut self,
        semaphore: &str,
        key_base: i64,
        slots: Vec<u32>,
        bound: Duration,
    ) -> std::result::Result<std::result::Result<(), String>, String> {
        if let Some(held) = self.held.get_mut(semaphore) {
            for slot in &slots {
                if let Some(at) = held.iter().position(|s| s == slot) {
                    held.swap_remove(at);
                }
            }
            if held.is_empty() {
                self.held.remove(semaphore);
            }
        }
        let ints: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
        let query = sqlx::query_scalar::<_, i32>(RELEASE)
            .bind(semaphore)
            .bind(key_base)
            .bind(ints);
        match tokio::time::timeout(bound, query.fetch_one(&mut self.conn)).await {
            Err(_) => Err(format!("a release did not answer within {bound:?}")),
            Ok(Err(error)) if db::unreachable(&error) => Err(error.to_string()),
            Ok(Err(error)) => Ok(Err(error.to_string())),
            Ok(Ok(released)) if released.unsigned_abs() as usize == slots.len() => Ok(Ok(())),
            Ok(Ok(released)) => Ok(Err(format!(
                "released {released} of {} slots of {semaphore:?}: the session did not hold the others",
                slots.len()
            ))),
        }
    }
}

/// Locks a mutex, recovering from poisoning (no code panics while holding these).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
