//! Wake-ups for waiting acquires and `wait_idle`, per client: one `LISTEN`
//! connection, a local order of waiters per semaphore, and a registration
//! that tells releases someone here waits.
//!
//! - **Only when someone waits.** Ending a claim sends a `NOTIFY` only if a
//!   process registered for the semaphore (`pgsemaphore.wakeups`, a row with
//!   a lease): PostgreSQL serialises notifying commits across the whole
//!   instance, so a release nobody waits for must not send one. A process
//!   registers before the claim that precedes its first wait (one round
//!   trip, skipped while a registration is in force) and a *keeper* task
//!   renews the registration, and the leases of the process's queue tickets,
//!   every third of [`WAIT_LEASE`] while anyone here waits on the semaphore.
//!   Why no wake-up is lost: see `pgsemaphore.notify_if_waited` (a check
//!   after the commit that freed slots) and `pgsemaphore.release` (the
//!   release's check inside its own transaction, under a per-semaphore
//!   advisory lock that a registration waits for).
//! - **One claimer per process.** Every waiting acquire takes a place in the
//!   semaphore's local order (priority first, then queued waiters in the
//!   queue's order, then arrival); on each wake-up only the first place claims.
//!   It passes the turn on when it is served and slots are left (or a
//!   wake-up arrived while it claimed), and when it leaves. So a release
//!   costs one claim per process, and a large request at the front is never
//!   overtaken by a smaller one behind it.
//! - **Never a hang.** A ticker wakes each semaphore's waiters every
//!   fallback interval, so a lost notification (listener reconnecting, a
//!   database restart) costs at most one interval; waiters also wake by
//!   themselves when the lease that blocks them ends (the claim says when).
//!   Waiting tasks hold no pooled connection: the listener has its own,
//!   opened outside the application's pool.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::postgres::types::PgInterval;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::background::{self, lock};
use crate::db::Db;
use crate::token::Token;

/// The channel every pg-semaphore notification is sent on; the payload is the
/// semaphore's name.
const CHANNEL: &str = "pgsemaphore";

/// How often the fallback ticker looks for semaphores that are due a re-check.
const TICK: Duration = Duration::from_millis(100);

/// How long a wake-up registration, and a queued waiter's row, outlive the
/// process's last renewal: a crashed waiter holds up a queue, or makes
/// releases notify nobody, for at most this long.
pub(crate) const WAIT_LEASE: Duration = Duration::from_secs(10);

/// Renews a process's registration (unless `$5` is false: behind a
/// transaction pooler, where nothing can listen) for its waiting spell `$6`,
/// and its queue tickets.
const KEEP_WAITING: &str = "SELECT pgsemaphore.keep_waiting(p_semaphore => $1, p_lease => $2, \
                                                         p_tickets => $3, p_token => $4, \
                                                         p_register => $5, p_spell => $6)";

/// The process's last waiter left: its registration (of spell `$3`) goes.
const STOP_WAITING: &str =
    "SELECT pgsemaphore.stop_waiting(p_semaphore => $1, p_token => $2, p_spell => $3)";

/// The wake-up service of one [`Client`](crate::Client). Dropping the last
/// handle stops its tasks.
pub(crate) struct Wakeups {
    options: Arc<PgConnectOptions>,
    entries: Arc<Entries>,
    running: Mutex<Option<Running>>,
}

impl std::fmt::Debug for Wakeups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let running = lock(&self.running).is_some();
        f.debug_struct("Wakeups")
            .field("running", &running)
            .finish_non_exhaustive()
    }
}

struct Running {
    /// The `LISTEN` task; not started behind a transaction pooler.
    listen: Option<JoinHandle<()>>,
    tick: JoinHandle<()>,
}

impl Running {
    fn is_alive(&self) -> bool {
        !self.tick.is_finished() && self.listen.as_ref().is_none_or(|l| !l.is_finished())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.tick.abort();
        if let Some(listen) = &self.listen {
            listen.abort();
        }
    }
}

impl Wakeups {
    /// The service of a client whose own connections use `options`.
    pub(crate) fn new(options: Arc<PgConnectOptions>) -> Wakeups {
        Wakeups {
            options,
            entries: Arc::new(Entries::default()),
            running: Mutex::new(None),
        }
    }

    /// Stops the ticker and the `LISTEN` task, unless someone in this
    /// process waits: they keep running for the waiters.
    pub(crate) fn stop(&self) {
        let mut running = lock(&self.running);
        if lock(&self.entries.by_semaphore).is_empty() {
            *running = None;
        }
    }

    /// This process's secret for its registrations and queue tickets.
    pub(crate) fn token(&self) -> &Token {
        &self.entries.token
    }

    /// Starts the fallback ticker and, when `listen`, the `LISTEN` task, if
    /// they are not running. Never waits: waiters claim at once, and the
    /// listener wakes them all when it starts listening, so nothing released
    /// before then is missed.
    pub(crate) fn start(&self, listen: bool) {
        let mut running = lock(&self.running);
        // Tasks die with the runtime that spawned them: start afresh then.
        if running.as_ref().is_some_and(|r| !r.is_alive()) {
            *running = None;
        }
        let running = running.get_or_insert_with(|| Running {
            listen: None,
            tick: tokio::spawn(tick(Arc::downgrade(&self.entries))),
        });
        if listen && running.listen.is_none() {
            running.listen = Some(tokio::spawn(listen_loop(
                (*self.options).clone(),
                self.entries.clone(),
            )));
        }
    }

    /// Wakes this process's waiters of `semaphore` now (a release in this
    /// process, which no NOTIFY tells this process about).
    pub(crate) fn wake_local(&self, semaphore: &str) {
        self.entries.wake(semaphore);
    }

    /// Watches `semaphore` (woken on each of its notifications and fallback
    /// ticks) until the guard drops.
    pub(crate) fn watch(&self, semaphore: &str, fallback: Duration) -> Watch {
        self.entries.watch(semaphore, fallback)
    }
}

/// The `LISTEN` loop. Runs until aborted.
async fn listen_loop(options: PgConnectOptions, entries: Arc<Entries>) {
    background::listen_loop(
        options,
        CHANNEL,
        "pg-semaphore listener",
        "waiters fall back to polling",
        |payload| match payload {
            Some(semaphore) => entries.wake(semaphore),
            None => entries.wake_all(),
        },
    )
    .await;
}

/// The fallback ticker: wakes the waiters of each semaphore whose re-check is due.
async fn tick(entries: Weak<Entries>) {
    let mut interval = tokio::time::interval(TICK);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(entries) = entries.upgrade() else {
            return;
        };
        entries.wake_due(Instant::now());
    }
}

/// Local waiters, per semaphore.
struct Entries {
    by_semaphore: Mutex<HashMap<String, Arc<Entry>>>,
    /// This process's secret for its registrations and queue tickets.
    token: Token,
}

impl Default for Entries {
    fn default() -> Self {
        Entries {
            by_semaphore: Mutex::new(HashMap::new()),
            token: Token::new(),
        }
    }
}

/// The waiters of one semaphore in this process.
struct Entry {
    /// Every watch sees a change on each wake-up.
    wake: watch::Sender<()>,
    state: Mutex<EntryState>,
}

struct EntryState {
    /// Watches alive (waiting acquires and wait_idle calls).
    watchers: usize,
    /// This waiting spell (from the first watch to the last): its
    /// registration row says so, so that a late delete of an earlier spell's
    /// row never removes this one.
    spell: i64,
    /// Where the registration was written, to delete it when the spell ends.
    registered_with: Option<Db>,
    /// The local order of waiting acquires, with their queue tickets.
    places: BTreeMap<Place, Option<i64>>,
    fallback: Duration,
    next_check: Instant,
    /// Until when this process's wake-up registration certainly holds.
    registered_until: Option<Instant>,
    /// The task renewing the registration and the tickets.
    keeper: Option<JoinHandle<()>>,
}

impl Entry {
    fn wake(&self) {
        self.wake.send_modify(|()| {});
    }
}

impl Entries {
    fn watch(self: &Arc<Self>, semaphore: &str, fallback: Duration) -> Watch {
        let mut map = lock(&self.by_semaphore);
        let entry = map
            .entry(semaphore.to_owned())
            .or_insert_with(|| {
                Arc::new(Entry {
                    wake: watch::Sender::new(()),
                    state: Mutex::new(EntryState {
                        watchers: 0,
                        spell: spell(),
                        registered_with: None,
                        places: BTreeMap::new(),
                        fallback,
                        next_check: Instant::now() + fallback,
                        registered_until: None,
                        keeper: None,
                    }),
                })
            })
            .clone();
        {
            let mut state = lock(&entry.state);
            state.watchers += 1;
            if fallback < state.fallback {
                state.fallback = fallback;
                state.next_check = state.next_check.min(Instant::now() + fallback);
            }
        }
        Watch {
            entries: self.clone(),
            semaphore: semaphore.to_owned(),
            rx: entry.wake.subscribe(),
            entry,
            place: None,
        }
    }

    /// A notification for `semaphore` arrived.
    fn wake(&self, semaphore: &str) {
        if let Some(entry) = lock(&self.by_semaphore).get(semaphore) {
            // Notifications are flowing: the fallback re-check can wait.
            let mut state = lock(&entry.state);
            state.next_check = Instant::now() + state.fallback;
            drop(state);
            entry.wake();
        }
    }

    fn wake_all(&self) {
        for entry in lock(&self.by_semaphore).values() {
            entry.wake();
        }
    }

    fn wake_due(&self, now: Instant) {
        for entry in lock(&self.by_semaphore).values() {
            let mut state = lock(&entry.state);
            if state.next_check <= now {
                state.next_check = now + state.fallback;
                drop(state);
                entry.wake();
            }
        }
    }
}

/// A place in the local order of waiting acquires, smallest first:
/// (priority rank, 0 if queued in the database else 1, then the queue's
/// order: turn and ticket as [`QueueOrder::place`](super::QueueOrder) gives
/// them, or 0 and arrival for a waiter outside the queue). As in the
/// database, a waiter outside the queue only yields to queued waiters of at
/// least its own priority.
pub(crate) type Place = (u8, u8, i64, i64);

/// A registered watch on one semaphore. Dropping it gives up its place
/// (waking the next one if it was first) and unregisters.
pub(crate) struct Watch {
    entries: Arc<Entries>,
    semaphore: String,
    entry: Arc<Entry>,
    rx: watch::Receiver<()>,
    place: Option<Place>,
}

impl Watch {
    /// Marks every wake-up so far as seen: call before checking, then
    /// [`changed`](Self::changed) returns at the next wake-up after it.
    pub(crate) fn seen(&mut self) {
        self.rx.borrow_and_update();
    }

    /// Waits for a wake-up not yet [`seen`](Self::seen).
    pub(crate) async fn changed(&mut self) {
        // The sender lives as long as `self.entry`: this never fails.
        let _ = self.rx.changed().await;
    }

    /// Whether a wake-up arrived since the last [`seen`](Self::seen).
    pub(crate) fn has_unseen(&self) -> bool {
        self.rx.has_changed().unwrap_or(false)
    }

    /// Takes (or moves to) `place` in the local order; `ticket` is the
    /// database waiter id it stands for, if any.
    pub(crate) fn take_place(&mut self, place: Place, ticket: Option<i64>) {
        let mut state = lock(&self.entry.state);
        if let Some(old) = self.place.take() {
            state.places.remove(&old);
        }
        state.places.insert(place, ticket);
        self.place = Some(place);
    }

    /// Whether this watch holds the first place in the local order.
    pub(crate) fn is_first(&self) -> bool {
        let state = lock(&self.entry.state);
        self.place.is_some() && state.places.keys().next() == self.place.as_ref()
    }

    /// Gives up the place; if it was first and `wake`, the next one is woken
    /// to take over.
    pub(crate) fn leave(&mut self, wake: bool) {
        if let Some(place) = self.place.take() {
            let mut state = lock(&self.entry.state);
            let was_first = state.places.keys().next() == Some(&place);
            state.places.remove(&place);
            if wake && was_first && !state.places.is_empty() {
                drop(state);
                self.entry.wake();
            }
        }
    }

    /// Whether a wake-up registration of this process certainly covers the
    /// semaphore now (always, behind a transaction pooler, where there is
    /// nothing to register for: the fallback re-check wakes waiters there).
    pub(crate) fn is_registered(&self, db: &Db) -> bool {
        !db.listens()
            || lock(&self.entry.state)
                .registered_until
                .is_some_and(|until| Instant::now() < until)
    }

    /// Registers this process for the semaphore's wake-ups (one round trip)
    /// and makes sure a keeper renews the registration and the process's
    /// queue tickets while anyone here waits. Returns whether the
    /// registration was written. A failure is logged: waiters then rely on
    /// the fallback re-check until the keeper gets through (a registration
    /// waits for the semaphore's wake-up gate, and gives up after the
    /// function's `lock_timeout` if someone holds it).
    pub(crate) async fn register(&self, db: &Db) -> bool {
        let token = &self.entries.token;
        let registered = keep_waiting(db, &self.semaphore, &self.entry, token).await;
        let mut state = lock(&self.entry.state);
        if state.keeper.as_ref().is_none_or(|k| k.is_finished()) {
            state.keeper = Some(tokio::spawn(keeper(
                db.clone(),
                self.semaphore.clone(),
                Arc::downgrade(&self.entry),
                token.clone(),
            )));
        }
        registered
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.leave(true);
        let mut map = lock(&self.entries.by_semaphore);
        let mut state = lock(&self.entry.state);
        state.watchers -= 1;
        if state.watchers == 0 {
            if let Some(keeper) = state.keeper.take() {
                keeper.abort();
            }
            if let Some(db) = state.registered_with.take() {
                stop_waiting(
                    db,
                    self.semaphore.clone(),
                    self.entries.token.clone(),
                    state.spell,
                );
            }
            drop(state);
            // Only if the map still holds this entry (not a newer one).
            if map
                .get(&self.semaphore)
                .is_some_and(|e| Arc::ptr_eq(e, &self.entry))
            {
                map.remove(&self.semaphore);
            }
        }
    }
}

/// One renewal: the registration (unless behind a transaction pooler) and
/// the leases of the queue tickets of every local place. Returns whether a
/// registration was written.
async fn keep_waiting(db: &Db, semaphore: &str, entry: &Entry, token: &Token) -> bool {
    let (tickets, spell) = {
        let state = lock(&entry.state);
        let tickets: Vec<i64> = state.places.values().flatten().copied().collect();
        (tickets, state.spell)
    };
    let register = db.listens();
    let sent = Instant::now();
    let query = db
        .query(KEEP_WAITING)
        .bind(semaphore.to_owned())
        .bind(wait_lease())
        .bind(tickets)
        .bind(token.bytes())
        .bind(register)
        .bind(spell);
    match db.execute(query).await {
        Ok(_) => {
            if register {
                // The row ends at least two thirds of the lease after the
                // send (it is rewritten only when it would end sooner); less
                // a second for the clocks' drift.
                let until = sent + WAIT_LEASE * 2 / 3 - Duration::from_secs(1);
                let mut state = lock(&entry.state);
                state.registered_until = Some(until);
                if state.watchers > 0 {
                    state.registered_with = Some(db.clone());
                } else {
                    // The spell ended while this was in flight: undo it.
                    stop_waiting(db.clone(), semaphore.to_owned(), token.clone(), state.spell);
                }
            }
            register
        }
        Err(error) => {
            tracing::debug!(semaphore, %error, "renewing the wake-up registration failed");
            false
        }
    }
}

/// Deletes a spell's registration in the background (a failure is logged:
/// the row's lease ends it).
fn stop_waiting(db: Db, semaphore: String, token: Token, spell: i64) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let query = db
            .query(STOP_WAITING)
            .bind(semaphore.clone())
            .bind(token.bytes())
            .bind(spell);
        if let Err(error) = db.execute(query).await {
            tracing::debug!(semaphore, %error, "removing the wake-up registration failed; its lease ends it");
        }
    });
}

/// A random id for a waiting spell.
fn spell() -> i64 {
    let mut bytes = [0; 8];
    let _ = getrandom::fill(&mut bytes);
    i64::from_le_bytes(bytes)
}

/// Renews every third of [`WAIT_LEASE`] while the entry has watchers.
async fn keeper(db: Db, semaphore: String, entry: Weak<Entry>, token: Token) {
    loop {
        tokio::time::sleep(WAIT_LEASE / 3).await;
        let Some(entry) = entry.upgrade() else {
            return;
        };
        if lock(&entry.state).watchers == 0 {
            return;
        }
        keep_waiting(&db, &semaphore, &entry, &token).await;
    }
}

/// [`WAIT_LEASE`] as an interval.
pub(crate) fn wait_lease() -> PgInterval {
    PgInterval {
        months: 0,
        days: 0,
        microseconds: WAIT_LEASE.as_micros() as i64,
    }
}

#[cfg(test)]
mod tests {
    use super::super::QueueOrder;
    use super::*;

    /// `N` waiters of one semaphore, in a fresh listener's entries.
    fn waiters<const N: usize>() -> [Watch; N] {
        let entries = Arc::new(Entries::default());
        std::array::from_fn(|_| entries.watch("s", Duration::from_secs(1)))
    }

    #[tokio::test]
    async fn only_the_first_place_claims_and_leaving_passes_the_turn() {
        let [mut heavy, mut light] = waiters();
        heavy.take_place((0, 1, 0, 1), None);
        light.take_place((0, 1, 0, 2), None);
        assert!(heavy.is_first() && !light.is_first());

        light.seen();
        heavy.leave(true);
        assert!(light.is_first());
        assert!(light.has_unseen(), "the next in line is woken");
    }

    #[tokio::test]
    async fn queued_and_high_priority_places_come_first() {
        let [mut low_queued, mut high_plain, mut high_queued] = waiters();
        low_queued.take_place((1, 0, 0, 1), Some(1));
        high_plain.take_place((0, 1, 0, 2), None);
        assert!(high_plain.is_first());
        high_queued.take_place((0, 0, 0, 5), Some(5));
        assert!(high_queued.is_first());
        drop(high_queued);
        assert!(high_plain.is_first());
        drop(high_plain);
        assert!(low_queued.is_first());
    }

    #[tokio::test]
    async fn queued_places_follow_the_database_order_of_turns() {
        // Key A queued tickets 1 and 2 (turns 0 and 1), then key B ticket 3,
        // at the head's turn: the database serves 1, 3, 2, and so must the
        // local order, or ticket 2 would claim (and be refused) while 3,
        // the next head, never claims.
        let [mut a_head, mut a_next, mut b] = waiters();
        let place = |turn, ticket| {
            let (turn, order) = QueueOrder::OldestFirst.place(turn, ticket);
            (0, 0, turn, order)
        };
        a_head.take_place(place(0, 1), Some(1));
        a_next.take_place(place(1, 2), Some(2));
        b.take_place(place(0, 3), Some(3));
        assert!(a_head.is_first());
        a_head.leave(true);
        assert!(b.is_first(), "the other key's waiter is next");
        b.leave(true);
        assert!(a_next.is_first());
    }

    #[tokio::test]
    async fn a_semaphores_entry_lives_while_it_is_watched() {
        let entries = Arc::new(Entries::default());
        let a = entries.watch("s", Duration::from_secs(5));
        let b = entries.watch("s", Duration::from_secs(1));
        assert_eq!(
            lock(&a.entry.state).fallback,
            Duration::from_secs(1),
            "the shortest fallback wins"
        );
        drop(a);
        assert!(lock(&entries.by_semaphore).contains_key("s"));
        drop(b);
        assert!(!lock(&entries.by_semaphore).contains_key("s"));
    }

    #[tokio::test(start_paused = true)]
    async fn the_fallback_tick_wakes_due_semaphores_only() {
        let entries = Arc::new(Entries::default());
        let mut fast = entries.watch("fast", Duration::from_millis(200));
        let mut slow = entries.watch("slow", Duration::from_secs(60));
        fast.seen();
        slow.seen();
        tokio::time::advance(Duration::from_millis(250)).await;
        entries.wake_due(Instant::now());
        assert!(fast.has_unseen());
        assert!(!slow.has_unseen());
        entries.wake("slow");
        assert!(slow.has_unseen(), "a notification wakes it");
    }
}
