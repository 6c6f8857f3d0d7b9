//! The engine of a [`RateLimiter`](super::RateLimiter): what a handle
//! shares ([`Limiter`]: the pool, the name, the policy, fail-open, the
//! in-process lines of waiting acquires), the check and reservation
//! statements of each policy, one SQL function each, and the loop of a
//! waiting acquire.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use sqlx::postgres::types::PgInterval;

use super::{Decision, RatePolicy, SqlLimits, settings};
use crate::Client;
use crate::db::{Db, Statement};
use crate::error::{Error, Result, WaitedFor};
use crate::fail_open::{self, Unchecked};
use crate::metrics::LimiterMetrics;
use crate::outcomes::Counter;
use crate::validate::{self, MAX_RATE_WAIT};

/// Token bucket check: takes `$5` tokens from key `$2` of limiter `$1` if it
/// has them (rate `$3` per second, burst `$4`).
const TOKEN_BUCKET: &str = "SELECT o_allowed, o_remaining, o_retry_after_us \
                            FROM pgsemaphore.token_bucket(p_limiter => $1, p_key => $2, p_rate => $3, \
                                                         p_burst => $4, p_n => $5)";

/// Token bucket reservation: takes `$5` tokens of key `$2` of limiter `$1`
/// (rate `$3` per second, burst `$4`) now, provided they are refilled within
/// `$6`; answers how long to wait before acting.
const TOKEN_BUCKET_RESERVE: &str = "SELECT o_allowed, o_wait_us, o_remaining \
                                    FROM pgsemaphore.token_bucket_reserve(p_limiter => $1, p_key => $2, \
                                        p_rate => $3, p_burst => $4, p_n => $5, p_max_wait => $6)";

/// Fixed window reservation: books `$5` permits of key `$2` of limiter `$1`
/// (limit `$3` per window `$4`) in the first window with room, provided it
/// opens within `$6`; answers how long to wait before acting.
const FIXED_WINDOW_RESERVE: &str = "SELECT o_allowed, o_wait_us, o_remaining \
                                    FROM pgsemaphore.fixed_window_reserve(p_limiter => $1, p_key => $2, \
                                        p_limit => $3, p_window => $4, p_n => $5, p_max_wait => $6)";

/// Sliding window reservation: books `$5` permits of key `$2` of limiter `$1`
/// (limit `$3` per window `$4`) at the earliest instant they fit, provided it
/// is within `$6`; answers how long to wait before acting.
const SLIDING_WINDOW_RESERVE: &str = "SELECT o_allowed, o_wait_us, o_remaining \
                                      FROM pgsemaphore.sliding_window_reserve(p_limiter => $1, p_key => $2, \
                                          p_limit => $3, p_window => $4, p_n => $5, p_max_wait => $6)";

/// Fixed window check: `$5` permits of key `$2` of limiter `$1` (limit `$3` per window `$4`).
const FIXED_WINDOW: &str = "SELECT o_allowed, o_remaining, o_retry_after_us \
                            FROM pgsemaphore.fixed_window(p_limiter => $1, p_key => $2, p_limit => $3, \
                                                         p_window => $4, p_n => $5)";

/// Sliding window check: `$5` permits of key `$2` of limiter `$1` (limit `$3` per window `$4`).
const SLIDING_WINDOW: &str = "SELECT o_allowed, o_remaining, o_retry_after_us \
                              FROM pgsemaphore.sliding_window(p_limiter => $1, p_key => $2, p_limit => $3, \
                                                             p_window => $4, p_n => $5)";

/// What every handle of one limiter shares.
pub(super) struct Limiter {
    pub(super) db: Db,
    pub(super) name: String,
    pub(super) policy: RatePolicy,
    pub(super) fail_open: bool,
    pub(super) metrics: LimiterMetrics,
    /// The limiter's outcome counter (its kind and name) on the client's
    /// tally: the database's decisions, and the acquires that gave up.
    pub(super) outcomes: Counter,
    /// The client's rate limiter `LISTEN` service (its task starts with the
    /// first waiting acquire).
    pub(super) wakeups: Arc<settings::RateWakeups>,
    /// Whether the client can `LISTEN` (not through a transaction pooler
    /// without direct connect options).
    pub(super) listens: bool,
    /// Whether this handle compared its limits with the stored ones
    /// ([`Limiter::note_stored_limits`]).
    pub(super) stored_noted: std::sync::atomic::AtomicBool,
    /// This handle's waiting acquires, in line per key (see
    /// [`Limiter::line`]).
    lines: std::sync::Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>,
}

impl fmt::Debug for Limiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter")
            .field("name", &self.name)
            .field("policy", &self.policy)
            .field("fail_open", &self.fail_open)
            .field("transaction_pooling", &self.db.is_pooled())
            .finish_non_exhaustive()
    }
}

impl Limiter {
    /// A limiter's engine; `name` and `policy` are valid.
    pub(super) fn new(
        client: &Client,
        name: String,
        policy: RatePolicy,
        fail_open: bool,
    ) -> Limiter {
        Limiter {
            db: client.db().clone(),
            metrics: LimiterMetrics::new(&name, policy.kind().as_str()),
            outcomes: client.outcome_counter(policy.kind().into(), &name),
            name,
            policy,
            fail_open,
            wakeups: client.rate_wakeups().clone(),
            listens: client.can_listen(),
            stored_noted: std::sync::atomic::AtomicBool::new(false),
            lines: std::sync::Mutex::new(HashMap::new()),
        }
    }
}

impl Limiter {
    /// The checks every request for permits passes before anything is sent.
    pub(super) fn request(&self, key: &str, permits: u32) -> Result<()> {
        validate::key(key)?;
        let limit = self.policy.limit();
        validate::positive("permits", permits.into())?;
        if permits > limit {
            return Err(Error::invalid(
                "permits",
                format!("{permits} is more than the limit of {limit}: it could never be granted"),
            ));
        }
        Ok(())
    }

    /// What a database error becomes: an admitting decision when the limiter
    /// fails open and the database is unreachable, else the error.
    pub(super) async fn failed(&self, error: Error) -> Result<Decision> {
        let error = self.stalled(error);
        let unchecked = Unchecked::Check {
            limiter: &self.name,
            metrics: &self.metrics,
        };
        if fail_open::admits(self.fail_open, &error, self.db.pool(), unchecked).await {
            Ok(Decision::open(self.policy.limit()))
        } else {
            Err(error)
        }
    }

    /// The line of this handle's waiting acquires of `key`: an async mutex
    /// (FIFO) that the head holds while it reserves, and while it sleeps
    /// after a refusal, until it is booked. Lines nobody holds are dropped.
    pub(super) fn line(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(line) = lines.get(key).and_then(Weak::upgrade) {
            return line;
        }
        if lines.len() >= 1024 {
            lines.retain(|_, line| line.strong_count() > 0);
        }
        let line = Arc::new(tokio::sync::Mutex::new(()));
        lines.insert(key.to_owned(), Arc::downgrade(&line));
        line
    }

    /// After the database decided a check: counts the decision, and
    /// compares this handle's limits with the stored ones (once).
    pub(super) async fn decided(&self, allowed: bool) {
        self.metrics.decided(allowed);
        self.note_stored_limits().await;
    }

    /// A waiting acquire's answer when its wait would pass `timeout` (the
    /// longest wait when none): counted as refused in the metrics, as timed
    /// out in the outcome counters.
    pub(super) fn timed_out(&self, key: &str, timeout: Option<Duration>) -> Error {
        self.metrics.decided(false);
        self.outcomes.timed_out();
        Error::Timeout {
            waited_for: WaitedFor::RateLimit {
                limiter: self.name.clone(),
                key: key.to_owned(),
            },
            timeout: timeout.unwrap_or(MAX_RATE_WAIT),
        }
    }

    /// 55P03 from a rate function: the key's lock was held past the
    /// functions' `lock_timeout` (2 s), as [`Error::Stalled`] naming the
    /// limiter; any other error as it is.
    pub(super) fn stalled(&self, error: Error) -> Error {
        if crate::error::sqlstate(&error).as_deref() == Some("55P03") {
            return Error::Stalled {
                semaphore: self.name.clone(),
            };
        }
        error
    }

    /// The statement of one request for `permits` of `key`: the kind's
    /// check, or with `max_wait` its reservation (each answers three
    /// columns: allowed, then remaining and retry-after for a check, wait
    /// and remaining for a reservation).
    fn statement(
        &self,
        key: &str,
        permits: u32,
        max_wait: Option<PgInterval>,
    ) -> Result<Statement<(bool, i64, i64)>> {
        let sql = match (self.policy, max_wait.is_some()) {
            (RatePolicy::TokenBucket { .. }, false) => TOKEN_BUCKET,
            (RatePolicy::TokenBucket { .. }, true) => TOKEN_BUCKET_RESERVE,
            (RatePolicy::FixedWindow { .. }, false) => FIXED_WINDOW,
            (RatePolicy::FixedWindow { .. }, true) => FIXED_WINDOW_RESERVE,
            (RatePolicy::SlidingWindow { .. }, false) => SLIDING_WINDOW,
            (RatePolicy::SlidingWindow { .. }, true) => SLIDING_WINDOW_RESERVE,
        };
        let query = self
            .db
            .query_as(sql)
            .bind(self.name.clone())
            .bind(key.to_owned());
        let query = match self.policy.sql_limits()? {
            SqlLimits::Bucket { rate, burst } => {
                query.bind(rate).bind(burst).bind(f64::from(permits))
            }
            SqlLimits::Window { limit, window } => {
                query.bind(limit).bind(window).bind(i64::from(permits))
            }
        };
        Ok(match max_wait {
            Some(max_wait) => query.bind(max_wait),
            None => query,
        })
    }

    pub(super) async fn check(&self, key: &str, permits: u32) -> Result<Decision> {
        self.request(key, permits)?;
        let query = self.statement(key, permits, None)?;
        match self.db.fetch_one(query).await {
            Ok((allowed, remaining, retry_after_us)) => {
                if allowed {
                    self.outcomes.admitted();
                } else {
                    self.outcomes.refused();
                }
                self.decided(allowed).await;
                Ok(Decision::new(
                    allowed,
                    remaining,
                    retry_after_us,
                    self.policy.limit(),
                ))
            }
            Err(error) => self.failed(error).await,
        }
    }

    /// A waiting acquire: one reservation (one round trip), then a sleep on
    /// this process's clock until the instant the database reserved, counted
    /// from the reply (so never earlier than that instant); a token bucket's
    /// sleep is shortened if an operator raises the stored rate meanwhile (a
    /// window's booking is in a window of the grid, which a raised limit
    /// does not move). A paused key is refused with the pause's end: the
    /// caller sleeps until then (or until an operator ends the pause) and
    /// reserves again. `timeout`: the longest wait the caller accepts
    /// (`None`: the longest that can be reserved).
    pub(super) async fn acquire(
        &self,
        key: &str,
        permits: u32,
        timeout: Option<Duration>,
    ) -> Result<Decision> {
        self.request(key, permits)?;
        let mut waiting = Waiting::new(timeout);
        // Before the reservation, so that a change committed after it is
        // heard. Behind a transaction pooler nothing can listen.
        let mut wake = self.subscribe();
        let topic = self.topic();
        let line = self.line(key);
        let Some(head) = waiting.head(&line).await else {
            return Err(self.timed_out(key, timeout));
        };
        loop {
            let (left, max_wait) = waiting.left()?;
            let query = self.statement(key, permits, Some(max_wait))?;
            let (allowed, wait_us, remaining) = match self.db.fetch_one(query).await {
                Ok(reply) => reply,
                Err(error) => match self.stalled(error) {
                    Error::Stalled { .. } if waiting.retry_stalled(&self.name, key) => continue,
                    Error::Stalled { .. } => return Err(self.timed_out(key, timeout)),
                    error => return self.failed(error).await,
                },
            };
            self.note_stored_limits().await;
            let wait = Duration::from_micros(wait_us.max(0) as u64);
            if allowed {
                self.metrics.decided(true);
                self.outcomes.admitted();
                // Booked: the next waiter in line may book behind it.
                drop(head);
                match self.policy {
                    RatePolicy::TokenBucket { rate, .. } => {
                        self.sleep_reserved(key, wait, remaining, wake.as_mut(), rate)
                            .await;
                    }
                    _ if !wait.is_zero() => tokio::time::sleep(wait).await,
                    _ => {}
                }
                return Ok(Decision::new(true, remaining, 0, self.policy.limit()));
            }
            if wait.is_zero() || wait > left {
                return Err(self.timed_out(key, timeout));
            }
            // Refused within the caller's wait: the key is paused until then.
            match wake.as_mut() {
                Some(wake) => {
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = wake.changed(&topic) => {}
                    }
                }
                None => tokio::time::sleep(wait).await,
            }
        }
    }
}

/// The clock of one waiting acquire, of a limiter or of a set: how long it
/// may still wait, and its retries while a key's lock is stuck.
pub(super) struct Waiting {
    budget: Duration,
    started: tokio::time::Instant,
    stalled_warned: bool,
}

impl Waiting {
    /// `timeout`: the longest wait the caller accepts (`None`, or more
    /// than [`MAX_RATE_WAIT`]: that).
    pub(super) fn new(timeout: Option<Duration>) -> Waiting {
        Waiting {
            budget: timeout.unwrap_or(MAX_RATE_WAIT).min(MAX_RATE_WAIT),
            started: tokio::time::Instant::now(),
            stalled_warned: false,
        }
    }

    /// Waits to be the head of `line` ([`Limiter::line`]), within the wait
    /// (`None` when it runs out first). This process's waiters of a key go
    /// to the database one at a time, in arrival order: a reservation books
    /// at most burst / rate (one window) ahead, so waiters beyond that are
    /// refused with the same instant, and without the line all of them
    /// would come back at once, every one a round trip, again and again. In
    /// line, only the head asks; it leaves the line when it is booked.
    pub(super) async fn head<'a>(
        &self,
        line: &'a tokio::sync::Mutex<()>,
    ) -> Option<tokio::sync::MutexGuard<'a, ()>> {
        tokio::time::timeout(self.budget, line.lock()).await.ok()
    }

    /// What is left of the wait, and that as a reservation's `max_wait`.
    pub(super) fn left(&self) -> Result<(Duration, PgInterval)> {
        let left = self.budget.saturating_sub(self.started.elapsed());
        Ok((left, validate::rate_wait(left)?))
    }

    /// After a reservation answered [`Error::Stalled`] (a key's lock held
    /// past 2 s: a check left in an open transaction, a session holding the
    /// advisory key): whether to try again, within the caller's wait. Warns
    /// once per acquire.
    pub(super) fn retry_stalled(&mut self, limiter: &str, key: &str) -> bool {
        if self.started.elapsed() >= self.budget {
            return false;
        }
        if !self.stalled_warned {
            self.stalled_warned = true;
            tracing::warn!(
                limiter,
                key,
                "a rate limiter key's lock is held by a stuck transaction; retrying until it is free or the wait times out"
            );
        }
        true
    }
}
