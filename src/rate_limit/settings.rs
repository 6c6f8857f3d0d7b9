//! Limits stored in the database, pauses, and the wake-ups of waiting
//! acquires when an operator changes either
//! (`migrations/20261128010006_pgsemaphore_rate_limits.sql`, whose header
//! writes down the decisions).
//!
//! - **Stored limits.** `pgsemaphore.rate_limit_settings` holds, per limiter
//!   and optionally per key, a pair (rate and burst, or permit limit and
//!   window): the limiter's is stored by its first check, a key's only by
//!   an operator, who alone changes either. Every
//!   check function reads it in its own statement: the key's pair, else the
//!   limiter's. So a handle's builder values count only at a limiter's
//!   first use, and every process (of any crate version) applies the
//!   stored ones, with no extra round trip per check;
//!   [`Limiter::note_stored_limits`] warns once per limiter and process
//!   when the handle's pair differs.
//! - **Pauses.** [`Limiter::pause`] (the application: an upstream answered
//!   429 with `Retry-After`) refuses a key's, or a whole limiter's, checks
//!   until then in every process; it only ever extends a pause, by at most
//!   [`MAX_PAUSE`](crate::limits::MAX_PAUSE). A waiting acquire sleeps until the
//!   pause ends, then reserves again.
//! - **Wake-ups.** The operator functions (`set_rate_limit`,
//!   `clear_rate_limit`, `resume_rate_limit`) send `NOTIFY pgsemaphore_rate
//!   'kind/limiter'`. One `LISTEN` connection per client, opened by a
//!   handle's first waiting acquire and kept while such a handle lives,
//!   passes them on ([`Subscription`]); a waiter then re-reads what is in
//!   force. The notification is a hint: a waiter that misses one
//!   is admitted at the instant it was told, never earlier than allowed.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::postgres::types::PgInterval;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Limiter, RatePolicy};
use crate::background::{self, lock};
use crate::error::Result;
use crate::validate;

/// The channel the operator functions notify on; the payload is `kind/limiter`.
const CHANNEL: &str = "pgsemaphore_rate";

/// Pauses key `$3` (NULL: every key) of limiter `$2` of kind `$1` for `$4`.
const PAUSE: &str = "SELECT pgsemaphore.pause_rate_limit(p_kind => $1, p_limiter => $2, \
                     p_key => $3, p_for => $4) IS NOT NULL";

/// The stored rate in force for key `$3` of token bucket `$2` (NULL: none).
const RATE_IN_FORCE: &str = "SELECT o_rate FROM pgsemaphore.rate_limit_in_force(p_kind => $1, \
                             p_limiter => $2, p_key => $3)";

/// The limiter's stored pair (key `''`): rate, burst, permit limit, window.
const LIMITER_IN_FORCE: &str = "SELECT o_rate, o_burst, o_limit, o_window \
                                FROM pgsemaphore.rate_limit_in_force(p_kind => $1, p_limiter => $2, p_key => NULL)";

/// The limiters (kind, name, the code's pair) this process has compared
/// with their stored pair: once each, however many handles it builds.
static NOTED: Mutex<BTreeSet<(&'static str, String, String)>> = Mutex::new(BTreeSet::new());

impl Limiter {
    /// Once per limiter and process (per pair the code gives it), after
    /// its first decision: compares the handle's limits with the limiter's
    /// stored pair, which every check applies (the first use of a limiter
    /// stores its caller's pair; only the operator changes it), and says so
    /// with a `WARN` when they differ: a deploy that changed the limits in
    /// code must store them (`set_rate_limit`, `pg-semaphore limits set`).
    /// One extra round trip per limiter and process; the checks themselves
    /// are unchanged.
    pub(super) async fn note_stored_limits(&self) {
        if self.stored_noted.swap(true, Ordering::Relaxed) {
            return;
        }
        let code_pair = format!("{:?}", self.policy);
        let first = NOTED
            .lock()
            .map(|mut noted| {
                noted.insert((self.policy.kind().as_str(), self.name.clone(), code_pair))
            })
            .unwrap_or(true);
        if !first {
            return;
        }
        let query = self
            .db
            .query_as::<(Option<f64>, Option<f64>, Option<i64>, Option<PgInterval>)>(
                LIMITER_IN_FORCE,
            )
            .bind(self.policy.kind().as_str())
            .bind(self.name.clone());
        let (rate, burst, limit, window) = match self.db.fetch_one(query).await {
            Ok(row) => row,
            Err(error) => {
                tracing::debug!(%error, limiter = %self.name, "cannot read the limiter's stored limits");
                return;
            }
        };
        let (code, stored) = match self.policy {
            RatePolicy::TokenBucket {
                rate: own,
                burst: own_burst,
            } => {
                let (Some(rate), Some(burst)) = (rate, burst) else {
                    return;
                };
                if rate == own && burst == f64::from(own_burst) {
                    return;
                }
                (
                    format!("rate {own}/s, burst {own_burst}"),
                    format!("rate {rate}/s, burst {burst}"),
                )
            }
            RatePolicy::FixedWindow {
                permit_limit: own,
                window: own_window,
            }
            | RatePolicy::SlidingWindow {
                permit_limit: own,
                window: own_window,
            } => {
                let (Some(limit), Some(window)) = (limit, window) else {
                    return;
                };
                // (A stored window is microseconds, or days from an
                // operator's '1 day'; never months: at most 366 days.)
                let micros = i64::from(window.days) * 86_400_000_000 + window.microseconds;
                let window = Duration::from_micros(micros.max(0) as u64);
                if limit == i64::from(own) && window == own_window {
                    return;
                }
                (
                    format!("{own} per {own_window:?}"),
                    format!("{limit} per {window:?}"),
                )
            }
        };
        {
            tracing::warn!(
                limiter = %self.name,
                kind = self.policy.kind().as_str(),
                code_limits = %code,
                stored_limits = %stored,
                "rate limiter {:?} is decided under its stored limits ({stored}), not this code's ({code}): \
                 to apply the code's, run `pgsemaphore.set_rate_limit` (or `pg-semaphore limits set`)",
                self.name,
            );
        }
    }

    /// Pauses `key` (`None`: every key) for `duration` from now, on the
    /// database's clock.
    pub(super) async fn pause(&self, key: Option<&str>, duration: Duration) -> Result<()> {
        if let Some(key) = key {
            validate::key(key)?;
        }
        let duration = validate::pause(duration)?;
        let query = self
            .db
            .query_as::<(bool,)>(PAUSE)
            .bind(self.policy.kind().as_str())
            .bind(self.name.clone())
            .bind(key.map(str::to_owned))
            .bind(duration);
        self.db
            .fetch_one(query)
            .await
            .map_err(|e| self.stalled(e))?;
        Ok(())
    }

    /// The rate a token bucket's check of `key` applies now: the stored one,
    /// else this handle's.
    async fn rate_in_force(&self, key: &str, own: f64) -> Result<f64> {
        let query = self
            .db
            .query_as::<(Option<f64>,)>(RATE_IN_FORCE)
            .bind(self.policy.kind().as_str())
            .bind(self.name.clone())
            .bind(key.to_owned());
        Ok(self.db.fetch_one(query).await?.0.unwrap_or(own))
    }

    /// What a waiter hears about: this limiter's notifications.
    pub(super) fn topic(&self) -> String {
        format!("{}/{}", self.policy.kind(), self.name)
    }

    /// Sleeps until a token bucket reservation's instant, `wait` from the
    /// reply, shortened if an operator raises the rate meanwhile.
    ///
    /// `remaining`: the reservation's `o_remaining`, the floor of the level
    /// right after it (so `-remaining` is at least the tokens owed). The
    /// tokens still owed are modelled as `(deadline - now) x rate`, with
    /// the rate first taken as `owed / wait` (at least the rate that timed
    /// the reservation, since `-remaining` overestimates what was owed): at
    /// least what the database still counts owed, which refilled at the old
    /// rate from the decision (before the reply) and, after a change, at the
    /// new rate from the key's last check (before the re-read). On a raised
    /// rate the rest is divided by the new rate; a lower or equal one
    /// changes nothing (a lowered limit applies to later reservations). Not
    /// covered: a rate lowered and then raised again during one wait; the
    /// shortened wait then assumes the model's rate held in between.
    pub(super) async fn sleep_reserved(
        &self,
        key: &str,
        wait: Duration,
        remaining: i64,
        wake: Option<&mut Subscription>,
        own_rate: f64,
    ) {
        let mut deadline = Instant::now() + wait;
        let owed = (-(remaining as f64)).max(0.0);
        let (Some(wake), true) = (wake, owed > 0.0 && !wait.is_zero()) else {
            tokio::time::sleep_until(deadline).await;
            return;
        };
        let mut rate = owed / wait.as_secs_f64();
        let topic = self.topic();
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => return,
                () = wake.changed(&topic) => {}
            }
            let Ok(new_rate) = self.rate_in_force(key, own_rate).await else {
                continue;
            };
            let now = Instant::now();
            if new_rate > rate {
                let owed_now = deadline.saturating_duration_since(now).as_secs_f64() * rate;
                let shorter =
                    now + Duration::from_micros((owed_now / new_rate * 1e6).ceil() as u64);
                deadline = deadline.min(shorter);
                rate = new_rate;
            }
        }
    }
}

/// The rate limiters' `LISTEN` service of one [`Client`](crate::Client):
/// its task starts with the first waiting acquire.
pub(crate) struct RateWakeups {
    sender: broadcast::Sender<Arc<str>>,
    options: Arc<PgConnectOptions>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for RateWakeups {
    fn drop(&mut self) {
        if let Some(task) = lock(&self.task).take() {
            task.abort();
        }
    }
}

impl RateWakeups {
    pub(crate) fn new(options: Arc<PgConnectOptions>) -> RateWakeups {
        RateWakeups {
            sender: broadcast::channel(256).0,
            options,
            task: Mutex::new(None),
        }
    }

    /// Stops the `LISTEN` task (a waiter's next wait starts it again).
    pub(crate) fn stop(&self) {
        if let Some(task) = lock(&self.task).take() {
            task.abort();
        }
    }
}

/// A waiter's ear: the notifications of every limiter of its pool, and an
/// empty one each time the listener (re)starts listening (anything changed
/// before then is re-read).
pub(super) struct Subscription {
    _service: Arc<RateWakeups>,
    receiver: broadcast::Receiver<Arc<str>>,
}

impl Subscription {
    /// Returns once a notification about `topic` (or a (re)connection, or a
    /// burst that overflowed the buffer) arrives; never if the service is gone.
    pub(super) async fn changed(&mut self, topic: &str) {
        loop {
            match self.receiver.recv().await {
                Ok(payload) if payload.is_empty() || &*payload == topic => return,
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => return,
                Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
            }
        }
    }
}

impl Limiter {
    /// Subscribes to the client's rate limiter notifications, starting its
    /// listener if none runs. Call it before the statement whose outcome a
    /// change could alter: a change committed after that statement is
    /// heard. `None` behind a transaction pooler, where nothing can listen.
    pub(super) fn subscribe(&self) -> Option<Subscription> {
        if !self.listens {
            return None;
        }
        let service = self.wakeups.clone();
        let receiver = service.sender.subscribe();
        {
            let mut task = lock(&service.task);
            // Tasks die with the runtime that spawned them: start afresh then.
            if task.as_ref().is_none_or(JoinHandle::is_finished) {
                *task = Some(tokio::spawn(listen_loop(
                    (*service.options).clone(),
                    service.sender.clone(),
                )));
            }
        }
        Some(Subscription {
            _service: service,
            receiver,
        })
    }
}

/// The `LISTEN` loop. Runs until aborted.
async fn listen_loop(options: PgConnectOptions, sender: broadcast::Sender<Arc<str>>) {
    background::listen_loop(
        options,
        CHANNEL,
        "pg-semaphore rate listener",
        "waiters sleep their full wait",
        |payload| {
            let _ = sender.send(Arc::from(payload.unwrap_or("")));
        },
    )
    .await;
}
