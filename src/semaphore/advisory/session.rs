//! The dedicated connections ("sessions") that hold advisory semaphores'
//! slots: a session-level advisory lock belongs to the backend that took
//! it, so each permit lives on one session, and is released there.
//!
//! A [`Session`] owns one connection, outside the application's pool, behind
//! an async mutex: a claim or a release runs its one statement on it in the
//! caller's own task (no hop to another task on the hot path), one at a
//! time. It knows which slots it holds (an advisory lock is re-entrant: a
//! second claim on the same session must not take a slot it holds again, so
//! each claim sends that list), and it is the permits' lease:
//!
//! - **the holder learns of a dead link**: a task pings the session at
//!   every heartbeat unless something answered on it within the last half
//!   heartbeat, and every statement is bounded; a ping that fails or does
//!   not answer within a heartbeat, or a statement that has not answered
//!   half a heartbeat before the server's dead-man switch (below) could
//!   fire, counted from the session's last answer, loses the session, and every permit on it is told ([`LostReason::ConnectionLost`]).
//!   From the last answer before the link went silent, a ping notices it
//!   within two and a half heartbeats (a tick that came less than half a
//!   heartbeat after the answer skips its ping, the next one pings, the
//!   ping times out a heartbeat later), a statement in flight within the
//!   same time (or, below a heartbeat of a third of a second, within the
//!   server's one-second floor less half a heartbeat);
//! - **the server frees a cut-off session**: the session sets
//!   `idle_session_timeout` to three heartbeats, at least a second (and the
//!   server's TCP keepalives): pings keep a live one busy, so only a session
//!   whose client went silent is ended, and its locks freed, three
//!   heartbeats after its last statement, which is after its holders were
//!   told. (Skipping the ping whenever anything answered within a whole
//!   heartbeat, as this did before, let an idle session ping only every
//!   other tick, and a link cut just after a ping was noticed three
//!   heartbeats later: as late as the server freed its slots.) A killed
//!   process's session ends at once (its socket closes).
//!
//! Each session runs in READ COMMITTED whatever the role's or database's
//! default (it sets `default_transaction_isolation` when it connects): the
//! general claim decides on a snapshot taken after its locks, which only
//! READ COMMITTED gives, and the SQL refuses any other level (the
//! one-statement claim checks the capacity epoch after its lock instead,
//! whatever the level). A claim that fails
//! with an error that leaves the session usable gives back, before it
//! answers, any slot of the semaphore the session holds beyond its permits'
//! ([`GIVE_BACK`]): what the session believes it holds and what the server
//! holds for it stay the same.
//!
//! [`Sessions`] is the set a client's advisory semaphores share: a claim goes
//! to an idle session that holds no permit (so that its release does not
//! wait for someone else's claim), a new one is opened when there is none,
//! up to a maximum, and otherwise to the least busy.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::background::lock;
use crate::dead_man::{self, dead_man_after, dead_man_sql};
use crate::error::{self, Error, LostReason, Result};

/// Takes slots; `p_mine`: what this session holds of the semaphore already.
/// Every kind of claim (several permits, a session that holds slots of the
/// semaphore already, a capacity drop pending).
const CLAIM: &str = "SELECT o_status, o_slots, o_capacity, o_at \
                     FROM pgsemaphore.advisory_claim(p_semaphore => $1, p_permits => $2, p_mine => $3)";

/// The common claim, as one plain statement that reads no table: one
/// permit, on a session that holds no slot of the semaphore (so no lock it
/// takes can be one it holds), with no capacity drop pending; what
/// `pgsemaphore.advisory_claim` does in that case, without a PL/pgSQL call
/// (a PL/pgSQL call rebuilds its expressions in every transaction) and
/// without the semaphore's row. The caller passes what it last read of the
/// row ([`RowView`]): `$1` the key base, `$2` the capacity and `$3` the
/// epoch in force. The statement try-locks a slot below that capacity (the
/// innermost subquery, fenced by `OFFSET 0`, runs before the select lists
/// above it), then reads the sequence `pgsemaphore.advisory_epoch`, which
/// is not transactional and which every change of a capacity moves under
/// the row's lock before it commits: if it still reads `$3` (`current`),
/// nothing has changed a capacity since the row was read, and the slot is
/// kept, or NULL means all were taken; if not, the slot is given back (-1)
/// and the caller reads the row again ([`ROW`]) and, if need be, sends
/// [`CLAIM`], which re-reads after its locks and re-arms the epoch. Why an
/// unchanged epoch is safe however old the read of the row was: the
/// sequence's comment in the schema (part 1).
const CLAIM_ONE: &str = "SELECT CASE WHEN t.slot IS NULL THEN NULL \
                                     WHEN t.current THEN t.slot \
                                     WHEN pg_advisory_unlock($1 + t.slot) THEN -1 \
                                     ELSE -1 END AS slot, \
                                t.current, clock_timestamp() AS at \
                         FROM (SELECT s.slot, \
                                      pg_sequence_last_value('pgsemaphore.advisory_epoch') = $3 AS current \
                                 FROM (SELECT (SELECT g.s FROM generate_series(0, $2 - 1) AS g(s) \
                                                WHERE pg_try_advisory_lock($1 + g.s) \
                                                LIMIT 1) AS slot \
                                       OFFSET 0) AS s \
                               OFFSET 0) AS t";

/// What [`CLAIM_ONE`] needs of a semaphore's row: its capacity, the
/// highest capacity a drop is draining (`peak_capacity`) and its epoch.
const ROW: &str = "SELECT capacity, peak_capacity, epoch \
                   FROM pgsemaphore.advisory_semaphores WHERE name = $1";

/// A handle's view of its semaphore's row for [`CLAIM_ONE`], shared by the
/// handle's clones: the capacity and epoch last read, kept only while no
/// drop was pending. Every use checks it against the sequence after its lock,
/// so a stale view costs a round trip, never a slot.
#[derive(Debug, Default)]
pub(crate) struct RowView(Mutex<Option<(i32, i64)>>);

impl RowView {
    fn get(&self) -> Option<(i32, i64)> {
        *lock(&self.0)
    }

    fn set(&self, view: Option<(i32, i64)>) {
        *lock(&self.0) = view;
    }
}

/// After a claim failed with an error (not an outage: the session lives
/// on), the locks of the semaphore's slots this session holds and its
/// permits do not: a claim cancelled or failed between its lock and its
/// answer. `advisory_claim` gives its locks back itself before it raises;
/// the one-statement [`CLAIM_ONE`] cannot, so this gives back whatever the
/// session holds beyond `$2` (the slots of its permits). Returns how many.
const GIVE_BACK: &str = "SELECT count(*) FILTER (WHERE pg_advisory_unlock(k.key))::int \
                         FROM pgsemaphore.advisory_semaphores a \
                         JOIN (SELECT (l.classid::bigint << 32) | l.objid::bigint AS key \
                                 FROM pg_catalog.pg_locks l \
                                WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
                                  AND l.mode = 'ExclusiveLock' \
                                  AND l.pid = pg_catalog.pg_backend_pid()) k \
                           ON k.key >= a.key_base AND k.key < a.key_base + 1048560 \
                        WHERE a.name = $1 AND (k.key - a.key_base)::int <> ALL ($2)";

/// The release of a one-slot permit (see `pgsemaphore.advisory_release_one`).
const RELEASE_ONE: &str =
    "SELECT pgsemaphore.advisory_release_one(p_semaphore => $1, p_key => $2, p_stripe => $3)";

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

/// One session: its connection, and what it holds.
#[derive(Debug)]
pub(crate) struct Session {
    /// `None` once the session is lost (the connection is dropped, which
    /// closes it).
    state: tokio::sync::Mutex<Option<State>>,
    lost: watch::Sender<Option<LostReason>>,
    /// Statements waiting for or running on the connection.
    in_flight: AtomicUsize,
    /// Permits held on this session.
    permits: AtomicUsize,
    /// The backend holding this session's locks (`pg_locks.pid`).
    pid: i32,
    heartbeat: Duration,
}

#[derive(Debug)]
struct State {
    conn: PgConnection,
    /// Slots held, by semaphore.
    held: HashMap<String, Vec<u32>>,
    /// When the connection last answered.
    answered: Instant,
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    o_status: String,
    o_slots: Option<Vec<i32>>,
    o_capacity: i32,
    o_at: Option<DateTime<Utc>>,
}

/// Counts a statement in flight for as long as it lives.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn new(counter: &'a AtomicUsize) -> InFlight<'a> {
        counter.fetch_add(1, Ordering::Relaxed);
        InFlight(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Session {
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// A permit was made on this session.
    pub(crate) fn held(&self) {
        self.permits.fetch_add(1, Ordering::Relaxed);
    }

    /// A permit of this session ended.
    pub(crate) fn freed(&self) {
        self.permits.fetch_sub(1, Ordering::Relaxed);
    }

    /// Why the session was lost, if it was.
    pub(crate) fn lost_reason(&self) -> Option<LostReason> {
        *self.lost.borrow()
    }

    /// Resolves when the session is lost; never otherwise.
    pub(crate) fn lost(&self) -> impl std::future::Future<Output = LostReason> + Send + 'static {
        dead_man::lost(self.lost.subscribe())
    }

    /// Loses the session: every permit on it is told, and the connection is
    /// dropped (closing it: the server frees what it held, if it still can).
    fn lose(&self, state: &mut Option<State>, why: &str) {
        // The notice goes out before the connection closes: when the session
        // gives itself up (a ping that did not answer in time, on a server
        // that is still there), its slots are freed only after its holders
        // were told.
        self.lost.send_replace(Some(LostReason::ConnectionLost));
        if let Some(lost) = state.take() {
            tracing::warn!(
                pid = self.pid,
                %why,
                held = lost.held.values().map(Vec::len).sum::<usize>(),
                "advisory semaphore session lost: its permits are lost"
            );
            drop(lost);
        }
    }

    /// What a statement bounded by `bound` (`what`: "a claim", "a release")
    /// came back with: its value, with the session's state, whose last
    /// answer is now; or, when it did not answer in time or failed because
    /// the link is down, the session is lost, and the error is returned.
    fn answered<'s, T>(
        &self,
        state: &'s mut Option<State>,
        what: &str,
        bound: Duration,
        outcome: std::result::Result<sqlx::Result<T>, tokio::time::error::Elapsed>,
    ) -> Result<(T, &'s mut State)> {
        let value = match outcome {
            Err(_) => {
                self.lose(state, &format!("{what} did not answer within {bound:?}"));
                return Err(lost_session());
            }
            Ok(Err(error)) => {
                if error::unreachable(&error) {
                    self.lose(state, &error.to_string());
                }
                return Err(error::ours(error));
            }
            Ok(Ok(value)) => value,
        };
        let state = state.as_mut().ok_or_else(lost_session)?;
        state.answered = Instant::now();
        Ok((value, state))
    }

    /// Claims on this session: one statement. Not cancel-safe on its own
    /// (a claim whose reply is dropped keeps its slots until they are
    /// released): run it inside [`detached`](crate::detached::detached),
    /// whose value, dropped if the caller has gone, releases them.
    pub(crate) async fn claim(
        &self,
        semaphore: &str,
        key_base: i64,
        view: &RowView,
        permits: u32,
    ) -> Result<ClaimReply> {
        let _in_flight = InFlight::new(&self.in_flight);
        let mut guard = self.state.lock().await;
        let Some(mut state) = guard.as_mut() else {
            return Err(lost_session());
        };
        let bound = self.statement_bound(state);
        let mine: Vec<i32> = state
            .held
            .get(semaphore)
            .map(|slots| slots.iter().map(|&s| s as i32).collect())
            .unwrap_or_default();
        // The common claim, as a plain statement, on the process's view of
        // the row; read again (once) when there is none or it is stale.
        let mut read = false;
        while permits == 1 && mine.is_empty() {
            let Some((capacity, epoch)) = view.get() else {
                if read {
                    // A drop is pending: the general claim counts.
                    break;
                }
                let outcome = tokio::time::timeout(
                    bound,
                    sqlx::query_as::<_, (i32, i32, i64)>(ROW)
                        .bind(semaphore)
                        .fetch_optional(&mut state.conn),
                )
                .await;
                let (row, answered) = self.answered(&mut guard, "a claim", bound, outcome)?;
                state = answered;
                let Some((capacity, peak, epoch)) = row else {
                    return Err(Error::SemaphoreNotFound {
                        semaphore: semaphore.to_owned(),
                    });
                };
                view.set((peak == capacity).then_some((capacity, epoch)));
                read = true;
                continue;
            };
            let query = sqlx::query_as::<_, (Option<i32>, bool, DateTime<Utc>)>(CLAIM_ONE)
                .bind(key_base)
                .bind(capacity)
                .bind(epoch);
            let outcome = tokio::time::timeout(bound, query.fetch_one(&mut state.conn)).await;
            self.give_back_after_error(&mut guard, semaphore, &mine, &outcome)
                .await;
            let ((slot, current, at), answered) =
                self.answered(&mut guard, "a claim", bound, outcome)?;
            state = answered;
            if current {
                let capacity = capacity.max(0) as u32;
                return Ok(match slot {
                    Some(slot) => {
                        let slot = slot.max(0) as u32;
                        state
                            .held
                            .entry(semaphore.to_owned())
                            .or_default()
                            .push(slot);
                        ClaimReply::Claimed {
                            slots: vec![slot],
                            at,
                        }
                    }
                    None => ClaimReply::Full { capacity },
                });
            }
            // A capacity changed since the view was read (or another
            // semaphore's did: the sequence is shared), and the slot was
            // given back: read the row again, or, if that was just done,
            // let the general claim re-read and count (it re-arms the
            // epoch).
            view.set(None);
            if read {
                break;
            }
        }
        let query = sqlx::query_as::<_, ClaimRow>(CLAIM)
            .bind(semaphore)
            .bind(permits as i32)
            .bind(&mine);
        let outcome = tokio::time::timeout(bound, query.fetch_one(&mut state.conn)).await;
        self.give_back_after_error(&mut guard, semaphore, &mine, &outcome)
            .await;
        let (row, state) = self.answered(&mut guard, "a claim", bound, outcome)?;
        let capacity = row.o_capacity.max(0) as u32;
        Ok(match (row.o_status.as_str(), row.o_slots, row.o_at) {
            ("claimed", Some(slots), Some(at)) => {
                let slots: Vec<u32> = slots.into_iter().map(|s| s.max(0) as u32).collect();
                state
                    .held
                    .entry(semaphore.to_owned())
                    .or_default()
                    .extend(slots.iter().copied());
                ClaimReply::Claimed { slots, at }
            }
            ("too_many", _, _) => ClaimReply::TooMany { capacity },
            _ => ClaimReply::Full { capacity },
        })
    }

    /// When a claim failed with an error that leaves the session usable (a
    /// cancellation, a statement timeout, a permission or a bug), gives
    /// back any slot of `semaphore` the session holds beyond `mine` (its
    /// permits' slots) before the error is answered, so that the session's
    /// view (`held`) and the server's agree. If that fails too, the session
    /// is lost (its connection closed: the server frees everything).
    async fn give_back_after_error<T>(
        &self,
        guard: &mut Option<State>,
        semaphore: &str,
        mine: &[i32],
        outcome: &std::result::Result<sqlx::Result<T>, tokio::time::error::Elapsed>,
    ) {
        let Ok(Err(error)) = outcome else {
            return;
        };
        if error::unreachable(error) {
            return;
        }
        let Some(state) = guard.as_mut() else {
            return;
        };
        let done = tokio::time::timeout(
            self.statement_bound(state),
            sqlx::query_scalar::<_, i32>(GIVE_BACK)
                .bind(semaphore)
                .bind(mine)
                .fetch_optional(&mut state.conn),
        )
        .await;
        match done {
            Ok(Ok(given)) => {
                state.answered = Instant::now();
                if let Some(given @ 1..) = given {
                    tracing::warn!(
                        pid = self.pid,
                        semaphore,
                        given,
                        %error,
                        "an advisory claim failed holding slots: given back"
                    );
                }
            }
            Ok(Err(error)) => self.lose(
                guard,
                &format!("giving back a failed claim's slots: {error}"),
            ),
            Err(_) => self.lose(guard, "giving back a failed claim's slots did not answer"),
        }
    }

    /// Unlocks `slots` of `semaphore` on this session: one statement.
    pub(crate) async fn release(
        &self,
        semaphore: &str,
        key_base: i64,
        slots: &[u32],
    ) -> Result<()> {
        let _in_flight = InFlight::new(&self.in_flight);
        let mut guard = self.state.lock().await;
        let Some(state) = guard.as_mut() else {
            return Err(lost_session());
        };
        if let Some(held) = state.held.get_mut(semaphore) {
            for slot in slots {
                if let Some(at) = held.iter().position(|s| s == slot) {
                    held.swap_remove(at);
                }
            }
            if held.is_empty() {
                state.held.remove(semaphore);
            }
        }
        let bound = self.statement_bound(state);
        let query = match slots {
            [slot] => sqlx::query_scalar::<_, i32>(RELEASE_ONE)
                .bind(semaphore)
                .bind(key_base + i64::from(*slot))
                .bind(key_base + 1_048_560 + i64::from(*slot % 16)),
            _ => sqlx::query_scalar::<_, i32>(RELEASE)
                .bind(semaphore)
                .bind(key_base)
                .bind(slots.iter().map(|&s| s as i32).collect::<Vec<i32>>()),
        };
        let outcome = tokio::time::timeout(bound, query.fetch_one(&mut state.conn)).await;
        let (released, _) = self.answered(&mut guard, "a release", bound, outcome)?;
        if released.unsigned_abs() as usize == slots.len() {
            Ok(())
        } else {
            Err(Error::internal(format!(
                "released {released} of {} slots of {semaphore:?}: the session did not \
                 hold the others",
                slots.len()
            )))
        }
    }

    /// Takes the 16 waiting keys from `first` in shared mode on this
    /// session; whether it got every one (if not, it gives back those it
    /// got: a partial announcement would hide nothing from some releases
    /// and mislead others).
    pub(crate) async fn announce(&self, first: i64) -> bool {
        let _in_flight = InFlight::new(&self.in_flight);
        let mut guard = self.state.lock().await;
        let mut missing: Vec<i64> = (first..first + 16).collect();
        for _ in 0..ANNOUNCE_TRIES {
            let Some(state) = guard.as_mut() else {
                return false;
            };
            let got = tokio::time::timeout(
                self.statement_bound(state),
                sqlx::query_scalar::<_, Vec<i64>>(
                    "SELECT coalesce(array_agg(k) FILTER (WHERE pg_try_advisory_lock_shared(k)), '{}') \
                     FROM unnest($1::bigint[]) AS k",
                )
                .bind(&missing)
                .fetch_one(&mut state.conn),
            )
            .await;
            match got {
                Ok(Ok(taken)) => {
                    state.answered = Instant::now();
                    missing.retain(|k| !taken.contains(k));
                    if missing.is_empty() {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Ok(Err(error)) if !error::unreachable(&error) => break,
                Ok(Err(error)) => {
                    self.lose(&mut guard, &error.to_string());
                    return false;
                }
                Err(_) => {
                    self.lose(&mut guard, "announcing a waiter did not answer");
                    return false;
                }
            }
        }
        // Give back what was taken.
        let taken: Vec<i64> = (first..first + 16)
            .filter(|k| !missing.contains(k))
            .collect();
        if let Some(state) = guard.as_mut() {
            let bound = self.statement_bound(state);
            let given_back = tokio::time::timeout(
                bound,
                sqlx::query("SELECT pg_advisory_unlock_shared(k) FROM unnest($1::bigint[]) AS k")
                    .bind(&taken)
                    .execute(&mut state.conn),
            )
            .await;
            // A statement cut off midway leaves the connection unusable: the
            // session is lost; an error it survives changes nothing.
            let _ = self.answered(&mut guard, "giving back waiting keys", bound, given_back);
        }
        false
    }

    /// Gives the 16 waiting keys from `first` back.
    pub(crate) async fn withdraw(&self, first: i64) {
        let _in_flight = InFlight::new(&self.in_flight);
        let mut guard = self.state.lock().await;
        let Some(state) = guard.as_mut() else {
            return;
        };
        let bound = self.statement_bound(state);
        let done = tokio::time::timeout(
            bound,
            sqlx::query("SELECT pg_advisory_unlock_shared(k) FROM generate_series($1::bigint, $1 + 15) AS k")
                .bind(first)
                .execute(&mut state.conn),
        )
        .await;
        // Lost as after any statement; an error the session survives
        // changes nothing.
        let _ = self.answered(&mut guard, "withdrawing a waiter", bound, done);
    }

    /// How long a statement sent now may take before the session is given
    /// up: until half a heartbeat before the server's dead-man switch could
    /// fire, counted from the session's last answer (at least half a
    /// heartbeat). The server frees a silent session's slots
    /// [`dead_man_after`] (three heartbeats, at least a second) after the
    /// last statement it saw, which ended before that answer arrived: if the
    /// statement never reached it, the holder is told first. A bound counted
    /// from the statement's start would not do: a statement sent a
    /// heartbeat after the last ping and lost on the way would be given up
    /// after the server freed the slots.
    fn statement_bound(&self, state: &State) -> Duration {
        (dead_man_after(self.heartbeat) - self.heartbeat / 2)
            .saturating_sub(state.answered.elapsed())
            .max(self.heartbeat / 2)
    }

    /// One heartbeat: unless something answered within the last half
    /// heartbeat, ping (bounded by a heartbeat). Skipped while a statement
    /// runs (it is bounded itself). `false` once the session is lost.
    async fn beat(&self) -> bool {
        let Ok(mut guard) = self.state.try_lock() else {
            return true;
        };
        let Some(state) = guard.as_mut() else {
            return false;
        };
        if state.answered.elapsed() < self.heartbeat / 2 {
            return true;
        }
        match tokio::time::timeout(self.heartbeat, state.conn.ping()).await {
            Ok(Ok(())) => {
                state.answered = Instant::now();
                true
            }
            Ok(Err(error)) => {
                self.lose(&mut guard, &format!("its connection died: {error}"));
                false
            }
            Err(_) => {
                let why = format!("its connection did not answer within {:?}", self.heartbeat);
                self.lose(&mut guard, &why);
                false
            }
        }
    }
}

/// Pings `session` every heartbeat until it is lost or dropped.
async fn heartbeat(session: Weak<Session>, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(session) = session.upgrade() else {
            return;
        };
        if !session.beat().await {
            return;
        }
    }
}

/// What a statement on a lost session returns: an outage, to a waiter.
pub(crate) fn lost_session() -> Error {
    Error::Database(sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "the advisory semaphore's session was lost",
    )))
}

/// The sessions a client's advisory semaphores share.
#[derive(Debug)]
pub(crate) struct Sessions {
    options: PgConnectOptions,
    heartbeat: Duration,
    max: usize,
    open: Mutex<Vec<Arc<Session>>>,
    /// Held while a session is being opened, so that a burst of claims
    /// opens one at a time.
    opening: tokio::sync::Mutex<()>,
}

impl Sessions {
    /// The set for connections made with `options`, each proving it is
    /// alive every `heartbeat`, at most `max` open.
    pub(crate) fn new(options: &PgConnectOptions, heartbeat: Duration, max: usize) -> Sessions {
        Sessions {
            options: options.clone().application_name("pg-semaphore advisory"),
            heartbeat,
            max: max.max(1),
            open: Mutex::new(Vec::new()),
            opening: tokio::sync::Mutex::new(()),
        }
    }

    /// Closes the open sessions that hold no permit and run no statement;
    /// the next claim opens one again.
    pub(crate) fn close_idle(&self) {
        lock(&self.open).retain(|s| {
            s.in_flight.load(Ordering::Relaxed) != 0 || s.permits.load(Ordering::Relaxed) != 0
        });
    }

    pub(crate) fn heartbeat(&self) -> Duration {
        self.heartbeat
    }

    /// A session for the next claim: an idle one that holds no permit, else
    /// a new one if the maximum allows, else the least busy (fewest
    /// statements in flight, then fewest permits held).
    pub(crate) async fn pick(&self) -> Result<Arc<Session>> {
        if let Some(free) = self.least_busy(true) {
            return Ok(free);
        }
        if lock(&self.open).len() >= self.max
            && let Some(busy) = self.least_busy(false)
        {
            return Ok(busy);
        }
        let _opening = self.opening.lock().await;
        // Another claim may have opened one meanwhile.
        if let Some(free) = self.least_busy(true) {
            return Ok(free);
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
        self.least_busy(false).ok_or_else(lost_session)
    }

    /// The open session with the fewest statements in flight, then the
    /// fewest permits (only one with neither if `free_only`); drops lost
    /// sessions from the set.
    fn least_busy(&self, free_only: bool) -> Option<Arc<Session>> {
        let mut open = lock(&self.open);
        open.retain(|s| s.lost_reason().is_none());
        let load = |s: &Arc<Session>| {
            (
                s.in_flight.load(Ordering::Relaxed),
                s.permits.load(Ordering::Relaxed),
            )
        };
        open.iter()
            .min_by_key(|s| load(s))
            .filter(|s| !free_only || load(s) == (0, 0))
            .cloned()
    }

    /// Opens a session: a connection of its own, with the server's
    /// dead-man switch set, and its heartbeat.
    async fn connect(&self) -> Result<Arc<Session>> {
        let mut conn = self.options.connect().await?;
        // READ COMMITTED whatever the role's or database's default says:
        // a claim needs a snapshot taken after its locks (see
        // `pgsemaphore.advisory_claim`), and refuses any other level. A
        // claim waits for no row or advisory lock; what is left, the
        // table's relation lock (queued behind a migration's DDL, say), is
        // bounded as the lease semaphore's functions bound theirs (55P03:
        // `Error::Stalled`, retried by waiting acquires): at 2 s, or a
        // quarter heartbeat if that is shorter, so that the server answers
        // before the statement's own bound (at least half a heartbeat)
        // gives the session up.
        let lock_timeout = (self.heartbeat / 4)
            .min(Duration::from_secs(2))
            .as_millis()
            .max(1);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "{}; SET default_transaction_isolation = 'read committed'; \
             SET lock_timeout = '{lock_timeout}ms'",
            dead_man_sql(self.heartbeat)
        )))
        .execute(&mut conn)
        .await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await?;
        let session = Arc::new(Session {
            state: tokio::sync::Mutex::new(Some(State {
                conn,
                held: HashMap::new(),
                answered: Instant::now(),
            })),
            lost: watch::Sender::new(None),
            in_flight: AtomicUsize::new(0),
            permits: AtomicUsize::new(0),
            pid,
            heartbeat: self.heartbeat,
        });
        tokio::spawn(heartbeat(Arc::downgrade(&session), self.heartbeat));
        Ok(session)
    }
}

#[cfg(test)]
mod tests {
    use super::CLAIM_ONE;

    /// The statement without its comments, in single spaces.
    fn normalized(sql: &str) -> String {
        sql.lines()
            .map(|line| line.split("--").next().unwrap_or(""))
            .flat_map(str::split_whitespace)
            .collect::<Vec<_>>()
            .join(" ")
            .trim_end_matches(';')
            .to_owned()
    }

    /// docs/sql-api.md shows the one-statement claim as the crate sends it
    /// (tests/security.rs attacks that block): the two must stay one
    /// statement, apart from the clock the crate reads with it.
    #[test]
    fn the_sql_api_shows_the_claim_the_crate_sends() {
        let doc = include_str!("../../../docs/sql-api.md");
        let start = doc
            .find("```sql\n-- $1 key_base, $2 capacity, $3 epoch")
            .expect("docs/sql-api.md shows the one-statement claim");
        let block = &doc[start + "```sql".len()..];
        let block = &block[..block.find("```").expect("the block ends")];
        let sent = CLAIM_ONE.replace(", clock_timestamp() AS at", "");
        assert_eq!(normalized(block), normalized(&sent));
    }
}
