//! Wake-ups for waiting acquires: one `LISTEN` connection per pool, shared by
//! every waiting task of every semaphore built on that pool.
//!
//! A release (or reap, or capacity increase) runs `pg_notify('pgsemaphore', name)`.
//! The listener task wakes *one* local waiter of that semaphore per
//! notification (tokio's `Notify::notify_one`, FIFO); a waiter that claims and
//! sees more free slots passes the baton on. A ticker wakes one waiter per
//! semaphore every `fallback` interval, so a lost notification (listener
//! reconnecting, database restart) costs at most one interval, never a hang.
//! Waiting tasks hold no pooled connection: only the listener's own
//! connection, opened outside the application's pool.
//!
//! A *watch* ([`Listener::watch`]) is the other kind of registration: it is
//! woken on every notification of its semaphore (and by the same fallback
//! ticker), never consuming the wake-one of acquirers. `wait_idle` uses it,
//! and so do extended acquires (weighted, low priority, queued), which keep a
//! local order: only the first of them in this process claims when woken.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The channel every pg-semaphore notification is sent on; the payload is the
/// semaphore's name.
pub(crate) const CHANNEL: &str = "pgsemaphore";

/// How often the fallback ticker looks for semaphores that are due a re-check.
const TICK: Duration = Duration::from_millis(100);

/// Back-off after the listener fails to (re)connect.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(500);

/// Listeners by pool (the pool's connect-options `Arc` identifies it).
static REGISTRY: Mutex<Vec<(Arc<PgConnectOptions>, Weak<Listener>)>> = Mutex::new(Vec::new());

/// The wake-up service of one pool. Dropping the last handle stops its tasks
/// (`Running` aborts them on drop) and closes its connection.
pub(crate) struct Listener {
    options: Arc<PgConnectOptions>,
    waiters: Arc<Waiters>,
    state: Mutex<Option<Running>>,
}

struct Running {
    /// The `LISTEN` task; not started for semaphores behind a transaction pooler.
    listen: Option<JoinHandle<()>>,
    tick: JoinHandle<()>,
    ready: watch::Receiver<bool>,
    ready_tx: Option<watch::Sender<bool>>,
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

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let running = self.state.lock().map(|s| s.is_some()).unwrap_or(false);
        f.debug_struct("Listener")
            .field("running", &running)
            .finish_non_exhaustive()
    }
}

impl Listener {
    /// The listener shared by every semaphore built on `pool`.
    pub(crate) fn for_pool(pool: &PgPool) -> Arc<Listener> {
        let options = pool.connect_options();
        let mut registry = lock(&REGISTRY);
        registry.retain(|(_, listener)| listener.strong_count() > 0);
        if let Some(listener) = registry
            .iter()
            .find(|(o, _)| Arc::ptr_eq(o, &options))
            .and_then(|(_, l)| l.upgrade())
        {
            return listener;
        }
        let listener = Arc::new(Listener {
            options: options.clone(),
            waiters: Arc::new(Waiters::default()),
            state: Mutex::new(None),
        });
        registry.push((options, Arc::downgrade(&listener)));
        listener
    }

    /// Whether the `LISTEN` connection is established.
    pub(crate) fn is_ready(&self) -> bool {
        lock(&self.state).as_ref().is_some_and(|running| {
            running.is_alive() && running.listen.is_some() && *running.ready.borrow()
        })
    }

    /// Starts the fallback ticker and, when `listen`, the `LISTEN` task, and
    /// waits until it listens, for at most `patience`. A listener that cannot
    /// connect leaves waiters to the fallback re-check, so this never fails.
    pub(crate) async fn start(&self, patience: Duration, listen: bool) {
        let ready = {
            let mut state = lock(&self.state);
            // Tasks die with the runtime that spawned them: start afresh then.
            if state.as_ref().is_some_and(|running| !running.is_alive()) {
                *state = None;
            }
            let running = state.get_or_insert_with(|| {
                let (ready_tx, ready) = watch::channel(false);
                Running {
                    listen: None,
                    tick: tokio::spawn(tick(Arc::downgrade(&self.waiters))),
                    ready,
                    ready_tx: Some(ready_tx),
                }
            });
            if listen
                && running.listen.is_none()
                && let Some(ready_tx) = running.ready_tx.take()
            {
                running.listen = Some(tokio::spawn(listen_loop(
                    (*self.options).clone(),
                    self.waiters.clone(),
                    ready_tx,
                )));
            }
            listen.then(|| running.ready.clone())
        };
        if let Some(mut ready) = ready {
            let _ = tokio::time::timeout(patience, ready.wait_for(|ready| *ready)).await;
        }
    }

    /// Registers a waiter for `semaphore`; the registration ends when the guard drops.
    pub(crate) fn register(&self, semaphore: &str, fallback: Duration) -> WaiterGuard {
        self.waiters.register(semaphore, fallback)
    }

    /// Registers a watch on `semaphore`, woken on every notification; the
    /// registration ends when the guard drops.
    pub(crate) fn watch(&self, semaphore: &str, fallback: Duration) -> WatchGuard {
        self.waiters.watch(semaphore, fallback)
    }
}

/// The `LISTEN` loop. Runs until aborted.
async fn listen_loop(options: PgConnectOptions, waiters: Arc<Waiters>, ready: watch::Sender<bool>) {
    // A pool of one, apart from the application's pool, used by PgListener to reconnect.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_lazy_with(options);
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(%error, "pg-semaphore listener cannot connect; waiters fall back to polling");
                tokio::time::sleep(RECONNECT_BACKOFF).await;
                continue;
            }
        };
        listener.ignore_pool_close_event(true);
        if let Err(error) = listener.listen(CHANNEL).await {
            tracing::warn!(%error, "pg-semaphore listener cannot LISTEN; waiters fall back to polling");
            tokio::time::sleep(RECONNECT_BACKOFF).await;
            continue;
        }
        let _ = ready.send(true);
        // Anything released before LISTEN took effect is re-checked now.
        waiters.wake_all_semaphores();
        loop {
            match listener.try_recv().await {
                Ok(Some(notification)) => waiters.wake_one(notification.payload()),
                Ok(None) => {
                    // The connection dropped and was re-established (and
                    // re-LISTENed): notifications in between are lost.
                    tracing::debug!("pg-semaphore listener reconnected");
                    waiters.wake_all_semaphores();
                }
                Err(error) => {
                    tracing::warn!(%error, "pg-semaphore listener lost its connection");
                    let _ = ready.send(false);
                    tokio::time::sleep(RECONNECT_BACKOFF).await;
                    break;
                }
            }
        }
    }
}

/// The fallback ticker: wakes one waiter of each semaphore whose re-check is due.
async fn tick(waiters: Weak<Waiters>) {
    let mut interval = tokio::time::interval(TICK);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(waiters) = waiters.upgrade() else {
            return;
        };
        waiters.wake_due(Instant::now());
    }
}

/// Local waiters, per semaphore.
#[derive(Default)]
struct Waiters {
    by_semaphore: Mutex<HashMap<String, Arc<Entry>>>,
    watched: Mutex<HashMap<String, Arc<Watched>>>,
}

/// The waiters of one semaphore in this process.
pub(crate) struct Entry {
    pub(crate) notify: Notify,
    state: Mutex<EntryState>,
}

struct EntryState {
    waiting: usize,
    fallback: Duration,
    next_check: Instant,
}

impl Waiters {
    fn register(self: &Arc<Self>, semaphore: &str, fallback: Duration) -> WaiterGuard {
        let mut map = lock(&self.by_semaphore);
        let entry = map
            .entry(semaphore.to_owned())
            .or_insert_with(|| {
                Arc::new(Entry {
                    notify: Notify::new(),
                    state: Mutex::new(EntryState {
                        waiting: 0,
                        fallback,
                        next_check: Instant::now() + fallback,
                    }),
                })
            })
            .clone();
        {
            let mut state = lock(&entry.state);
            state.waiting += 1;
            if fallback < state.fallback {
                state.fallback = fallback;
                state.next_check = state.next_check.min(Instant::now() + fallback);
            }
        }
        WaiterGuard {
            waiters: self.clone(),
            semaphore: semaphore.to_owned(),
            entry,
        }
    }

    fn wake_one(&self, semaphore: &str) {
        if let Some(watched) = lock(&self.watched).get(semaphore) {
            let mut state = lock(&watched.state);
            state.next_check = Instant::now() + state.fallback;
            drop(state);
            watched.wake();
        }
        if let Some(entry) = lock(&self.by_semaphore).get(semaphore) {
            // Notifications are flowing: the fallback re-check can wait.
            let mut state = lock(&entry.state);
            state.next_check = Instant::now() + state.fallback;
            drop(state);
            entry.notify.notify_one();
        }
    }

    fn wake_all_semaphores(&self) {
        for entry in lock(&self.by_semaphore).values() {
            entry.notify.notify_one();
        }
        for watched in lock(&self.watched).values() {
            watched.wake();
        }
    }

    fn wake_due(&self, now: Instant) {
        for entry in lock(&self.by_semaphore).values() {
            let mut state = lock(&entry.state);
            if state.next_check <= now {
                state.next_check = now + state.fallback;
                entry.notify.notify_one();
            }
        }
        for watched in lock(&self.watched).values() {
            let mut state = lock(&watched.state);
            if state.next_check <= now {
                state.next_check = now + state.fallback;
                drop(state);
                watched.wake();
            }
        }
    }

    fn watch(self: &Arc<Self>, semaphore: &str, fallback: Duration) -> WatchGuard {
        let mut map = lock(&self.watched);
        let watched = map
            .entry(semaphore.to_owned())
            .or_insert_with(|| {
                Arc::new(Watched {
                    wake: watch::Sender::new(()),
                    state: Mutex::new(EntryState {
                        waiting: 0,
                        fallback,
                        next_check: Instant::now() + fallback,
                    }),
                    places: Mutex::new(BTreeMap::new()),
                })
            })
            .clone();
        {
            let mut state = lock(&watched.state);
            state.waiting += 1;
            if fallback < state.fallback {
                state.fallback = fallback;
                state.next_check = state.next_check.min(Instant::now() + fallback);
            }
        }
        WatchGuard {
            waiters: self.clone(),
            semaphore: semaphore.to_owned(),
            rx: watched.wake.subscribe(),
            watched,
            place: None,
        }
    }
}

/// The watches of one semaphore in this process.
struct Watched {
    /// Every receiver sees a change on each wake-up.
    wake: watch::Sender<()>,
    state: Mutex<EntryState>,
    /// The local order of extended acquires: only the first one claims.
    places: Mutex<BTreeMap<Place, Option<i64>>>,
}

impl Watched {
    fn wake(&self) {
        self.wake.send_modify(|()| {});
    }
}

/// A place in the local order of extended acquires, smallest first:
/// (priority rank, 0 if queued in the database else 1, order). As in the
/// database, a waiter outside the queue only yields to queued waiters of at
/// least its own priority.
pub(crate) type Place = (u8, u8, i64);

/// A registered watch. Dropping it unregisters (and gives up its place).
pub(crate) struct WatchGuard {
    waiters: Arc<Waiters>,
    semaphore: String,
    watched: Arc<Watched>,
    rx: watch::Receiver<()>,
    place: Option<Place>,
}

impl WatchGuard {
    /// Marks every wake-up so far as seen: call before checking, then
    /// [`changed`](Self::changed) returns at the next wake-up after it.
    pub(crate) fn seen(&mut self) {
        self.rx.borrow_and_update();
    }

    /// Waits for a wake-up not yet [`seen`](Self::seen).
    pub(crate) async fn changed(&mut self) {
        // The sender lives as long as `self.watched`: this never fails.
        let _ = self.rx.changed().await;
    }

    /// Takes (or moves to) `place` in the local order; `ticket` is the
    /// database waiter id it stands for, if any.
    pub(crate) fn take_place(&mut self, place: Place, ticket: Option<i64>) {
        let mut places = lock(&self.watched.places);
        if let Some(old) = self.place.take() {
            places.remove(&old);
        }
        places.insert(place, ticket);
        self.place = Some(place);
    }

    /// Whether this watch holds the first place in the local order.
    pub(crate) fn is_first(&self) -> bool {
        let places = lock(&self.watched.places);
        self.place.is_some() && places.keys().next() == self.place.as_ref()
    }

    /// The database waiter ids of every place in the local order.
    pub(crate) fn local_tickets(&self) -> Vec<i64> {
        lock(&self.watched.places)
            .values()
            .flatten()
            .copied()
            .collect()
    }

    /// Whether a wake-up arrived since the last [`seen`](Self::seen).
    pub(crate) fn has_unseen(&self) -> bool {
        self.rx.has_changed().unwrap_or(false)
    }

    /// Gives up the place; if it was first and `wake`, the next one is woken
    /// to take over.
    pub(crate) fn leave(&mut self, wake: bool) {
        if let Some(place) = self.place.take() {
            let mut places = lock(&self.watched.places);
            let was_first = places.keys().next() == Some(&place);
            places.remove(&place);
            if wake && was_first && !places.is_empty() {
                drop(places);
                self.watched.wake();
            }
        }
    }
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.leave(true);
        let mut map = lock(&self.waiters.watched);
        let mut state = lock(&self.watched.state);
        state.waiting -= 1;
        if state.waiting == 0 {
            drop(state);
            map.remove(&self.semaphore);
        }
    }
}

/// A registered waiter. Dropping it unregisters.
pub(crate) struct WaiterGuard {
    waiters: Arc<Waiters>,
    semaphore: String,
    entry: Arc<Entry>,
}

impl WaiterGuard {
    pub(crate) fn entry(&self) -> &Entry {
        &self.entry
    }

    /// Whether another local task waits on the same semaphore.
    pub(crate) fn has_company(&self) -> bool {
        lock(&self.entry.state).waiting > 1
    }
}

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        let mut map = lock(&self.waiters.by_semaphore);
        let mut state = lock(&self.entry.state);
        state.waiting -= 1;
        if state.waiting == 0 {
            drop(state);
            map.remove(&self.semaphore);
        }
    }
}

/// Locks a mutex, recovering from poisoning: the data here stays consistent
/// because no code panics while holding these locks.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
