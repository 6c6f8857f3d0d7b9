//! Rate limiters on PostgreSQL: token bucket, fixed window, sliding window.
//!
//! The state of every key is the newest of its rows in
//! `pgsemaphore.rate_ledger` (schema version 12), created by the key's first
//! check. A check is one call of one SQL function (one round trip) that
//! takes the key's transaction-level advisory lock, reads the key's newest
//! row, reads the database clock, decides, and when it admits inserts the
//! next state as a new row (a refusal writes nothing; no row is ever
//! updated, so a long transaction elsewhere does not slow it). Concurrent
//! checks from any number of processes queue on the key's lock and never
//! admit more than the limit. The functions are `pgsemaphore.token_bucket`,
//! `fixed_window` and `sliding_window`; they and their reservations run on
//! one engine, `rate_take`, with the arithmetic of each kind in a pure
//! function (`bucket_step`, `fixed_step`, `sliding_step`), all in
//! `migrations/20261129000006_pgsemaphore_rate_ledger.sql`, whose header and
//! function comments state the invariants and the transactions each meets.
//!
//! Every limiter can also wait ([`TokenBucket::acquire`],
//! [`FixedWindow::acquire`], [`SlidingWindow::acquire`]): one call of the
//! kind's reservation (`token_bucket_reserve`, schema version 6;
//! `fixed_window_reserve` and `sliding_window_reserve`, version 10) books
//! the permits at the earliest instant the limit admits them, even ahead of
//! a refill or in a later window, and answers when that is; the caller
//! sleeps until then. A reservation reaches at most `burst / rate` (a
//! window: one window) ahead, so a deeper queue is refused with the instant
//! and tries again then; a handle's waiting acquires of one key wait in line
//! (FIFO, in the process), and only the head reserves, so that those retries
//! are one at a time rather than every waiter's at every instant.
//!
//! A limiter's limits belong to the database (schema version 9; stored on
//! first use since version 12): the first check of a limiter stores the
//! limits its handle was built with in `pgsemaphore.rate_limit_settings`,
//! and every later check, of every process, is decided under the stored
//! ones in the same statement, whatever its handle says; only an operator
//! changes them, per limiter or per key (`pg-semaphore limits set`,
//! [`set_rate_limit`](crate::set_rate_limit)). A handle whose limits differ
//! from the stored ones logs one `WARN` per limiter and process naming
//! both. A reservation books at most `burst / rate` (a window: one window)
//! ahead; a key's lock held elsewhere for 2 s answers
//! [`Error::Stalled`]. Any process may
//! [`pause`](TokenBucket::pause) a key or a whole limiter after an
//! upstream's 429; and a [`LimiterSet`] checks several limits at once, all
//! or none. How (and the wake-ups of waiting acquires when an operator
//! raises a rate or ends a pause): `settings` and `set` below, and the
//! header of `migrations/20261129000003_pgsemaphore_limiter_settings.sql`.
//!
//! The three limiters share one engine (`Limiter`: the pool, the name, the
//! policy, fail-open); [`FixedWindow`] and [`SlidingWindow`] share one
//! builder ([`WindowBuilder`]) and one definition of their methods
//! (`window_limiter!`). Their limits and the checks on them are in
//! `validate`.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::types::PgInterval;

use crate::db::{Db, Statement};
use crate::error::{Error, Result, WaitedFor};
use crate::fail_open::{self, Unchecked};
use crate::metrics::LimiterMetrics;
use crate::validate::{self, MAX_RATE, MAX_RATE_WAIT, MAX_WINDOW};

mod set;
mod settings;

pub use set::{LimiterSet, RateLimiter};

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

/// Deletes up to a batch of keys at rest, walking the primary key from a cursor.
const PRUNE: &str = "SELECT o_deleted, o_kind, o_limiter, o_key \
                     FROM pgsemaphore.prune_rate_limits(p_idle_for => $1, p_kind => $2, \
                                                     p_limiter => $3, p_key => $4, p_batch => $5)";

/// Rows looked at per prune statement: short transactions, even for a big table.
const PRUNE_BATCH: i32 = 5_000;

/// The answer of a rate limiter's `check`.
///
/// Map it to HTTP as you like; for example 429 with `Retry-After:
/// retry_after` when refused, and `RateLimit-Remaining: remaining`.
///
/// With the `serde` feature it serializes as `{"allowed", "remaining",
/// "retry_after_seconds", "limit", "failed_open"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
#[must_use = "a rate limit decision does nothing unless `allowed` is acted upon"]
pub struct Decision {
    /// Whether the permits were granted (.NET's `IsAcquired`). When refused,
    /// nothing was taken.
    pub allowed: bool,
    /// Permits (tokens) left for this key right after this decision. 0 when
    /// the decision [failed open](Self::failed_open).
    pub remaining: u32,
    /// When refused: how long until a check of the same size would be
    /// admitted if nothing else happened meanwhile (another caller may take
    /// the permits first). Zero when admitted.
    #[cfg_attr(
        feature = "serde",
        serde(
            rename = "retry_after_seconds",
            serialize_with = "crate::serialize::seconds"
        )
    )]
    pub retry_after: Duration,
    /// The limiter's limit: the burst of a [`TokenBucket`], the permit limit
    /// of a [`FixedWindow`] or [`SlidingWindow`], as the handle was built (a
    /// limit stored in the database, [`set_rate_limit`](crate::set_rate_limit),
    /// may differ; [`rate_limit_settings`](crate::rate_limit_settings) lists
    /// them).
    pub limit: u32,
    /// `true` when the database could not be reached and the limiter was
    /// built with `fail_open(true)`: the request was admitted without being
    /// counted.
    pub failed_open: bool,
}

impl Decision {
    fn open(limit: u32) -> Decision {
        Decision {
            allowed: true,
            remaining: 0,
            retry_after: Duration::ZERO,
            limit,
            failed_open: true,
        }
    }
}

/// What a limiter enforces; the parameters of its SQL function.
#[derive(Debug, Clone, Copy)]
enum Policy {
    TokenBucket { rate: f64, burst: u32 },
    FixedWindow { limit: u32, window: Duration },
    SlidingWindow { limit: u32, window: Duration },
}

impl Policy {
    fn limit(self) -> u32 {
        match self {
            Policy::TokenBucket { burst, .. } => burst,
            Policy::FixedWindow { limit, .. } | Policy::SlidingWindow { limit, .. } => limit,
        }
    }

    /// The limiter's kind, as the metrics label it.
    fn kind(self) -> &'static str {
        match self {
            Policy::TokenBucket { .. } => "token_bucket",
            Policy::FixedWindow { .. } => "fixed_window",
            Policy::SlidingWindow { .. } => "sliding_window",
        }
    }
}

/// The engine shared by the three limiters.
struct Limiter {
    db: Db,
    name: String,
    policy: Policy,
    fail_open: bool,
    metrics: LimiterMetrics,
    /// The pool's rate limiter `LISTEN` service, from this handle's first
    /// waiting acquire for as long as the handle lives (so that waiting
    /// acquires do not each open and close a connection).
    wakeups: std::sync::OnceLock<Arc<settings::RateWakeups>>,
    /// Whether this handle compared its limits with the stored ones
    /// ([`Limiter::note_stored_limits`]).
    stored_noted: std::sync::atomic::AtomicBool,
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

/// The settings every limiter builder has.
#[derive(Debug, Clone)]
struct Common {
    name: String,
    fail_open: bool,
    pooled: bool,
}

impl Common {
    fn new(name: String) -> Common {
        Common {
            name,
            fail_open: false,
            pooled: false,
        }
    }

    fn build(self, pool: &PgPool, policy: Policy) -> Result<Arc<Limiter>> {
        validate::name(&self.name)?;
        Ok(Arc::new(Limiter {
            db: Db::new(pool, self.pooled),
            metrics: LimiterMetrics::new(&self.name, policy.kind()),
            name: self.name,
            policy,
            fail_open: self.fail_open,
            wakeups: std::sync::OnceLock::new(),
            stored_noted: std::sync::atomic::AtomicBool::new(false),
            lines: std::sync::Mutex::new(HashMap::new()),
        }))
    }
}

impl Limiter {
    /// The checks every request for permits passes before anything is sent.
    fn request(&self, key: &str, permits: u32) -> Result<()> {
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
    async fn failed(&self, error: Error) -> Result<Decision> {
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

    /// 55P03 from a rate function: the key's lock was held past the
    /// functions' `lock_timeout` (2 s), as [`Error::Stalled`] naming the
    /// limiter; any other error as it is.
    /// The line of this handle's waiting acquires of `key`: an async mutex
    /// (FIFO) that the head holds while it reserves, and while it sleeps
    /// after a refusal, until it is booked. Lines nobody holds are dropped.
    pub(crate) fn line(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
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

    /// A waiting acquire's answer when its wait would pass `timeout` (the
    /// longest wait when none): counted as refused.
    pub(crate) fn timed_out(&self, key: &str, timeout: Option<Duration>) -> Error {
        self.metrics.decided(false);
        Error::Timeout {
            waited_for: WaitedFor::RateLimit {
                limiter: self.name.clone(),
                key: key.to_owned(),
            },
            timeout: timeout.unwrap_or(MAX_RATE_WAIT),
        }
    }

    fn stalled(&self, error: Error) -> Error {
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
            (Policy::TokenBucket { .. }, false) => TOKEN_BUCKET,
            (Policy::TokenBucket { .. }, true) => TOKEN_BUCKET_RESERVE,
            (Policy::FixedWindow { .. }, false) => FIXED_WINDOW,
            (Policy::FixedWindow { .. }, true) => FIXED_WINDOW_RESERVE,
            (Policy::SlidingWindow { .. }, false) => SLIDING_WINDOW,
            (Policy::SlidingWindow { .. }, true) => SLIDING_WINDOW_RESERVE,
        };
        let query = self
            .db
            .query_as(sql)
            .bind(self.name.clone())
            .bind(key.to_owned());
        let query = match self.policy {
            Policy::TokenBucket { rate, burst } => query
                .bind(rate)
                .bind(f64::from(burst))
                .bind(f64::from(permits)),
            Policy::FixedWindow { limit, window } | Policy::SlidingWindow { limit, window } => {
                query
                    .bind(i64::from(limit))
                    .bind(validate::window(window)?)
                    .bind(i64::from(permits))
            }
        };
        Ok(match max_wait {
            Some(max_wait) => query.bind(max_wait),
            None => query,
        })
    }

    async fn check(&self, key: &str, permits: u32) -> Result<Decision> {
        self.request(key, permits)?;
        let limit = self.policy.limit();
        let db = &self.db;
        let query = self.statement(key, permits, None)?;
        match db.fetch_one(query).await {
            Ok((allowed, remaining, retry_after_us)) => {
                self.metrics.decided(allowed);
                self.note_stored_limits().await;
                Ok(Decision {
                    allowed,
                    remaining: u32::try_from(remaining.max(0)).unwrap_or(u32::MAX),
                    retry_after: Duration::from_micros(retry_after_us.max(0) as u64),
                    limit,
                    failed_open: false,
                })
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
    async fn acquire(
        &self,
        key: &str,
        permits: u32,
        timeout: Option<Duration>,
    ) -> Result<Decision> {
        self.request(key, permits)?;
        let limit = self.policy.limit();
        let budget = timeout.unwrap_or(MAX_RATE_WAIT).min(MAX_RATE_WAIT);
        let started = tokio::time::Instant::now();
        // Before the reservation, so that a change committed after it is
        // heard. Behind a transaction pooler nothing can listen.
        let mut wake = self.subscribe();
        let topic = self.topic();
        let mut stalled_warned = false;
        // This process's waiters of the key go to the database one at a
        // time, in arrival order: a reservation books at most burst / rate
        // (one window) ahead, so waiters beyond that are refused with the
        // same instant, and without the line all of them would come back at
        // once, every one a round trip, again and again. In line, only the
        // head asks; it leaves the line when it is booked.
        let line = self.line(key);
        let Ok(head) = tokio::time::timeout(budget, line.lock()).await else {
            return Err(self.timed_out(key, timeout));
        };
        loop {
            let left = budget.saturating_sub(started.elapsed());
            let max_wait = validate::rate_wait(left)?;
            let db = &self.db;
            let query = self.statement(key, permits, Some(max_wait))?;
            let (allowed, wait_us, remaining) = match db.fetch_one(query).await {
                Ok(reply) => reply,
                Err(error) => match self.stalled(error) {
                    // The key's lock held past 2 s (a check left in an open
                    // transaction, a session holding the advisory key):
                    // again, within the caller's wait.
                    Error::Stalled { .. } if started.elapsed() < budget => {
                        if !stalled_warned {
                            stalled_warned = true;
                            tracing::warn!(
                                limiter = %self.name,
                                key,
                                "the rate limiter key's lock is held by a stuck transaction; retrying until it is free or the wait times out"
                            );
                        }
                        continue;
                    }
                    Error::Stalled { .. } => {
                        return Err(self.timed_out(key, timeout));
                    }
                    error => return self.failed(error).await,
                },
            };
            self.note_stored_limits().await;
            let wait = Duration::from_micros(wait_us.max(0) as u64);
            if allowed {
                self.metrics.decided(true);
                // Booked: the next waiter in line may book behind it.
                drop(head);
                match self.policy {
                    Policy::TokenBucket { rate, .. } => {
                        self.sleep_reserved(key, wait, remaining, wake.as_mut(), rate)
                            .await;
                    }
                    _ if !wait.is_zero() => tokio::time::sleep(wait).await,
                    _ => {}
                }
                return Ok(Decision {
                    allowed: true,
                    remaining: u32::try_from(remaining.max(0)).unwrap_or(u32::MAX),
                    retry_after: Duration::ZERO,
                    limit,
                    failed_open: false,
                });
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

fn window_policy(window: Option<Duration>, limit: Option<u32>) -> Result<(u32, Duration)> {
    let limit = match limit {
        Some(0) => return Err(Error::invalid("permit_limit", "must be at least 1")),
        Some(limit) => limit,
        None => {
            return Err(Error::invalid(
                "permit_limit",
                "not set: call `.permit_limit(n)`",
            ));
        }
    };
    let Some(window) = window else {
        return Err(Error::invalid(
            "window",
            "not set: call `.window(duration)`",
        ));
    };
    validate::window(window)?;
    Ok((limit, window))
}

macro_rules! common_builder_methods {
    () => {
        /// Admit requests when the database cannot be reached (default
        /// `false`: `check` returns the error).
        ///
        /// Stripe's advice: a rate limiter should not make its store a hard
        /// dependency of every request. With `fail_open(true)`, a check
        /// that fails because the database is unreachable (connection
        /// refused or lost, pool timed out or closed, server shutting down,
        /// too many connections) returns an admitting [`Decision`] with
        /// [`failed_open`](Decision::failed_open) set, and logs a
        /// `tracing::warn!` event: alert on it. Other errors (invalid input,
        /// missing migrations, any other database error) are still
        /// returned. How long a check waits for a connection is the pool's
        /// `acquire_timeout`.
        pub fn fail_open(mut self, enabled: bool) -> Self {
            self.common.fail_open = enabled;
            self
        }

        /// Declares that the pool connects through a transaction-pooling
        /// proxy such as PgBouncer with `pool_mode = transaction` (default
        /// `false`): each check then runs as an unnamed statement inside an
        /// explicit transaction (two extra round trips), as
        /// [`SemaphoreBuilder::transaction_pooling`](crate::SemaphoreBuilder::transaction_pooling)
        /// explains.
        pub fn transaction_pooling(mut self, enabled: bool) -> Self {
            self.common.pooled = enabled;
            self
        }
    };
}

macro_rules! common_limiter_methods {
    ($what:literal) => {
        /// The limiter's name: keys of limiters with different names (or of
        /// different kinds) never share state.
        pub fn name(&self) -> &str {
            &self.inner.name
        }

        /// The pool this limiter uses.
        pub fn pool(&self) -> &PgPool {
            self.inner.db.pool()
        }

        #[doc = concat!("Asks for `permits` ", $what, " for `key` (a user, an IP, a route, ...), in one round trip.")]
        ///
        /// The key's state is created by its first check. Refused checks take
        /// nothing. Use `permits = 1` per request, or a weight for costlier ones.
        ///
        /// # Errors
        ///
        /// - [`Error::InvalidArgument`] for a key that is empty, longer than
        ///   [`MAX_KEY_LEN`](crate::MAX_KEY_LEN) characters or contains NUL,
        ///   and for `permits` of 0 or above the limit (it could never be
        ///   granted). Nothing is sent.
        /// - [`Error::MigrationsMissing`] when [`migrate`](crate::migrate) was not run.
        /// - [`Error::Stalled`] (naming the limiter) when the key's lock was
        ///   held by another transaction for 2 s (a check left in an open
        ///   transaction, or a session holding the key's advisory lock):
        ///   nothing was taken.
        /// - [`Error::Database`] for connection and other database errors,
        ///   unless the limiter fails open (see `fail_open` on its builder).
        ///
        /// # Cancel safety
        ///
        /// One statement: if cancelled, the check either happened (its
        /// permits are taken) or did not.
        pub async fn check(&self, key: &str, permits: u32) -> Result<Decision> {
            self.inner.check(key, permits).await
        }

        /// Pauses `key` for `duration` from now (on the database's clock), in
        /// every process: its checks are refused with a `retry_after` until
        /// then, taking nothing, and waiting acquires sleep until then. For an
        /// upstream that answered 429 with `Retry-After`. A pause is only ever
        /// extended: a shorter one than the pause in force changes nothing (an
        /// operator ends one early: `pg-semaphore limits resume`,
        /// [`resume_rate_limit`](crate::resume_rate_limit)).
        ///
        /// ```no_run
        /// # use std::time::Duration;
        /// # async fn run(limiter: pg_semaphore::TokenBucket) -> Result<(), pg_semaphore::Error> {
        /// // The upstream answered 429 with Retry-After: 30.
        /// limiter.pause("tenant-7", Duration::from_secs(30)).await?;
        /// # Ok(())
        /// # }
        /// ```
        ///
        /// # Errors
        ///
        /// - [`Error::InvalidArgument`] for a bad key (as `check`) and a
        ///   `duration` below 1 ms or above [`MAX_PAUSE`](crate::MAX_PAUSE).
        /// - [`Error::MigrationsMissing`] before schema version 9;
        ///   [`Error::Database`] otherwise (a pause never fails open).
        ///
        /// # Cancel safety
        ///
        /// One statement: if cancelled, the pause was stored or was not.
        pub async fn pause(&self, key: &str, duration: Duration) -> Result<()> {
            self.inner.pause(Some(key), duration).await
        }

        /// Pauses every key of this limiter for `duration`, as
        /// [`pause`](Self::pause) pauses one (an upstream's 429 that is not
        /// about one key).
        ///
        /// # Errors
        ///
        /// As [`pause`](Self::pause).
        ///
        /// # Cancel safety
        ///
        /// As [`pause`](Self::pause).
        pub async fn pause_all(&self, duration: Duration) -> Result<()> {
            self.inner.pause(None, duration).await
        }
    };
}

/// What [`FixedWindow`] and [`SlidingWindow`] have in common, written once
/// for both: the same settings and accessors, each its own SQL function
/// (its [`Policy`] variant, named as the type). A macro rather than a
/// generic type, so that each stays a type of its own with its own docs.
macro_rules! window_limiter {
    ($limiter:ident, $kind:literal, $per:literal, $sql:literal, $books:literal) => {
        impl $limiter {
            #[doc = concat!("Starts configuring the ", $kind, " limiter `name`: set")]
            /// [`permit_limit`](WindowBuilder::permit_limit) and
            /// [`window`](WindowBuilder::window).
            pub fn builder(name: impl Into<String>) -> WindowBuilder<$limiter> {
                WindowBuilder::new(name.into())
            }

            #[doc = concat!("Permits per key per ", $per, ".")]
            pub fn permit_limit(&self) -> u32 {
                self.inner.policy.limit()
            }

            /// The window's length.
            pub fn window(&self) -> Duration {
                match self.inner.policy {
                    Policy::$limiter { window, .. } => window,
                    _ => unreachable!(concat!(
                        "a ",
                        stringify!($limiter),
                        " always has a ",
                        $kind,
                        " policy"
                    )),
                }
            }

            common_limiter_methods!("permits");

            /// Waits until `key`'s window admits `permits` permits, then
            /// returns the admitting [`Decision`]:
            /// [`acquire_timeout`](Self::acquire_timeout) with the longest
            /// wait that can be reserved, [`MAX_RATE_WAIT`](crate::MAX_RATE_WAIT).
            ///
            /// # Errors
            ///
            /// As [`acquire_timeout`](Self::acquire_timeout); [`Error::Timeout`]
            /// only when the permits could not be admitted within
            /// [`MAX_RATE_WAIT`](crate::MAX_RATE_WAIT).
            ///
            /// # Cancel safety
            ///
            /// As [`acquire_timeout`](Self::acquire_timeout): dropping the
            /// future after the reservation forfeits the booked permits.
            pub async fn acquire(&self, key: &str, permits: u32) -> Result<Decision> {
                self.inner.acquire(key, permits, None).await
            }

            #[doc = concat!("Waits until `key`'s ", $kind, " admits `permits` permits, if that")]
            /// takes at most `timeout`, then returns the admitting
            /// [`Decision`]; if it would take longer, returns
            /// [`Error::Timeout`] at once, without waiting and without taking
            /// anything.
            ///
            #[doc = concat!("One round trip per call, however many wait on the key: a *reservation* (`pgsemaphore.", $sql, "_reserve`)")]
            #[doc = $books]
            /// and the database answers when that is; this process then
            /// sleeps until that instant, counted from the reply on its own
            /// clock, so it is admitted no earlier than the database allows
            /// (later by the reply's latency). Waiters are admitted in the
            /// order they reserved, with no polling and no stampede on the
            /// key's lock when a window opens, and never more than
            /// [`permit_limit`](Self::permit_limit) permits in one window of
            /// the key's grid, plain [`check`](Self::check)s included. A
            /// `check` is refused while permits are booked in a window that
            /// has not opened yet: reservations are served first.
            ///
            /// A timeout above [`MAX_RATE_WAIT`](crate::MAX_RATE_WAIT) waits
            /// at most that. With `fail_open`, an unreachable database
            /// admits at once, as [`check`](Self::check) does.
            ///
            /// ```no_run
            /// use std::time::Duration;
            #[doc = concat!("use pg_semaphore::", stringify!($limiter), ";")]
            ///
            /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
            /// // At most 100 exports per minute per tenant; wait for room up to 5 minutes.
            #[doc = concat!("let exports = ", stringify!($limiter), "::builder(\"exports\")")]
            ///     .permit_limit(100)
            ///     .window(Duration::from_secs(60))
            ///     .build(&pool)?;
            /// exports.acquire_timeout("tenant-7", 1, Duration::from_secs(300)).await?;
            /// // ... export ...
            /// # Ok(())
            /// # }
            /// ```
            ///
            /// # Errors
            ///
            /// - [`Error::Timeout`] (waiting for [`WaitedFor::RateLimit`]) at
            ///   once when the permits would not be admitted within
            ///   `timeout`, or when the key's lock stayed held
            ///   ([`Error::Stalled`], retried) until `timeout`; nothing was
            ///   taken.
            /// - [`Error::InvalidArgument`], [`Error::MigrationsMissing`] and
            ///   [`Error::Database`] as for [`check`](Self::check) (a schema
            #[doc = concat!("  older than version 10 has no `", $sql, "_reserve`:")]
            ///   [`Error::MigrationsMissing`]).
            ///
            /// # Cancel safety
            ///
            /// Dropping the future while the reservation's statement is in
            /// flight either books or does not; dropping it after the
            /// reservation, while it sleeps, **forfeits the booked permits**:
            /// they stay counted in their window, so the key admits less than
            /// its limit there, never more. (They are not given back: a
            /// booking later in the queue was placed behind them, and
            /// returning permits would need a second round trip that a
            /// cancelled future cannot make.)
            pub async fn acquire_timeout(
                &self,
                key: &str,
                permits: u32,
                timeout: Duration,
            ) -> Result<Decision> {
                self.inner.acquire(key, permits, Some(timeout)).await
            }
        }

        impl WindowLimiter for $limiter {
            fn policy(limit: u32, window: Duration) -> Policy {
                Policy::$limiter { limit, window }
            }

            fn wrap(inner: Arc<Limiter>) -> Self {
                $limiter { inner }
            }
        }
    };
}

// ---------------------------------------------------------------------------
// Token bucket
// ---------------------------------------------------------------------------

/// A token bucket per key, with the semantics of Stripe's request rate
/// limiter ("Scaling your API with rate limiters").
///
/// Each key has a bucket of up to `burst` tokens that refills continuously at
/// `rate` tokens per second; a check takes `permits` tokens if the bucket has
/// them and takes nothing otherwise. A key's first check finds a full bucket,
/// so a burst of `burst` requests passes at once, then `rate` per second.
/// Time is the database's clock, read after the key's lock is taken.
///
/// A cheap handle (an [`Arc`] inside): clone it freely. The rate and burst
/// it is built with are stored as the limiter's by its first check; from
/// then on the stored ones apply, in every process, whatever a handle says,
/// and only an operator changes them, for the limiter or for one key
/// ([`set_rate_limit`](crate::set_rate_limit)). A handle built with other
/// limits logs one `WARN` naming both pairs.
///
/// ```no_run
/// use pg_semaphore::TokenBucket;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// // 100 requests per second per user, bursts of up to 500.
/// let limiter = TokenBucket::builder("api").rate(100.0).burst(500).build(&pool)?;
/// let decision = limiter.check("user-42", 1).await?;
/// if !decision.allowed {
///     // answer 429 with Retry-After: decision.retry_after
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct TokenBucket {
    inner: Arc<Limiter>,
}

/// Configures a [`TokenBucket`]; made by [`TokenBucket::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `.build(&pool)`"]
pub struct TokenBucketBuilder {
    common: Common,
    rate: Option<f64>,
    burst: Option<u32>,
}

impl TokenBucketBuilder {
    /// Tokens added to each key's bucket per second (required; may be
    /// fractional: `0.5` is one every two seconds). Stripe's `REPLENISH_RATE`.
    pub fn rate(mut self, tokens_per_second: f64) -> Self {
        self.rate = Some(tokens_per_second);
        self
    }

    /// The bucket's capacity: the most tokens a key can save up and spend at
    /// once (required, at least 1). Stripe's `CAPACITY`, .NET's `TokenLimit`.
    pub fn burst(mut self, tokens: u32) -> Self {
        self.burst = Some(tokens);
        self
    }

    common_builder_methods!();

    /// Validates the settings. Nothing is written: each key's state is created
    /// by its first check.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a name that is empty, longer than
    /// [`MAX_NAME_LEN`](crate::MAX_NAME_LEN) or contains NUL; a rate or a
    /// burst not set; a rate that is not a positive finite number or is above
    /// [`MAX_RATE`](crate::MAX_RATE); a burst of 0; a bucket that would take
    /// longer than [`MAX_WINDOW`](crate::MAX_WINDOW) to refill from empty.
    pub fn build(self, pool: &PgPool) -> Result<TokenBucket> {
        let Some(rate) = self.rate else {
            return Err(Error::invalid(
                "rate",
                "not set: call `.rate(tokens_per_second)`",
            ));
        };
        if !(rate.is_finite() && rate > 0.0) {
            return Err(Error::invalid(
                "rate",
                format!("{rate} is not a positive number of tokens per second"),
            ));
        }
        if rate > MAX_RATE {
            return Err(Error::invalid(
                "rate",
                format!("{rate} tokens per second is above the maximum, {MAX_RATE}"),
            ));
        }
        let burst = match self.burst {
            Some(0) => return Err(Error::invalid("burst", "must be at least 1")),
            Some(burst) => burst,
            None => return Err(Error::invalid("burst", "not set: call `.burst(tokens)`")),
        };
        let refill = f64::from(burst) / rate;
        if refill > MAX_WINDOW.as_secs_f64() {
            return Err(Error::invalid(
                "rate",
                format!(
                    "refilling {burst} tokens at {rate} per second takes {refill:.0} s; \
                     at most {} s is allowed",
                    MAX_WINDOW.as_secs()
                ),
            ));
        }
        let inner = self
            .common
            .build(pool, Policy::TokenBucket { rate, burst })?;
        Ok(TokenBucket { inner })
    }
}

impl TokenBucket {
    /// Starts configuring the token bucket limiter `name`: set
    /// [`rate`](TokenBucketBuilder::rate) and [`burst`](TokenBucketBuilder::burst).
    pub fn builder(name: impl Into<String>) -> TokenBucketBuilder {
        TokenBucketBuilder {
            common: Common::new(name.into()),
            rate: None,
            burst: None,
        }
    }

    /// Tokens added per second.
    pub fn rate(&self) -> f64 {
        match self.inner.policy {
            Policy::TokenBucket { rate, .. } => rate,
            _ => unreachable!("a TokenBucket always has a token bucket policy"),
        }
    }

    /// The bucket's capacity.
    pub fn burst(&self) -> u32 {
        self.inner.policy.limit()
    }

    common_limiter_methods!("tokens");

    /// Waits until `key`'s bucket admits `permits` tokens, then returns the
    /// admitting [`Decision`]: [`acquire_timeout`](Self::acquire_timeout)
    /// with the longest wait that can be reserved,
    /// [`MAX_RATE_WAIT`](crate::MAX_RATE_WAIT).
    ///
    /// ```no_run
    /// use pg_semaphore::TokenBucket;
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// // Call a partner's API at most 10 times per second, from every process.
    /// let partner = TokenBucket::builder("partner-api").rate(10.0).burst(10).build(&pool)?;
    /// partner.acquire("all", 1).await?;
    /// // ... call it ...
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`acquire_timeout`](Self::acquire_timeout); [`Error::Timeout`]
    /// only when the key owes more than [`MAX_RATE_WAIT`](crate::MAX_RATE_WAIT)
    /// of tokens.
    ///
    /// # Cancel safety
    ///
    /// As [`acquire_timeout`](Self::acquire_timeout): dropping the future
    /// after the reservation forfeits the reserved tokens.
    pub async fn acquire(&self, key: &str, permits: u32) -> Result<Decision> {
        self.inner.acquire(key, permits, None).await
    }

    /// Waits until `key`'s bucket admits `permits` tokens, if that takes at
    /// most `timeout`, then returns the admitting [`Decision`]; if it would
    /// take longer, returns [`Error::Timeout`] at once, without waiting and
    /// without taking anything.
    ///
    /// One round trip per call, however many wait on the key: a
    /// *reservation* (`pgsemaphore.token_bucket_reserve`, as GCRA and
    /// Stripe's limiter do it) takes the tokens now, even those not refilled
    /// yet (the key's level goes below zero), and the database answers
    /// when they will have been refilled; this process then sleeps until
    /// that instant, counted from the reply on its own clock, so it is
    /// admitted no earlier than the database allows (later by the reply's
    /// latency). Waiters are admitted in the order they reserved, at the
    /// bucket's rate, with no polling and no stampede on the key's lock when
    /// tokens come back; over any interval of length `d` a key admits at most
    /// `burst + rate × d` tokens, plain [`check`](Self::check)s included. A
    /// `check` is refused while reservations are outstanding: reservations
    /// are served first.
    ///
    /// The wait is fixed when the tokens are reserved, with one exception:
    /// when an operator raises the stored rate
    /// ([`set_rate_limit`](crate::set_rate_limit)), waiters are told (a
    /// `NOTIFY`, heard by one `LISTEN` connection per pool, opened by a
    /// handle's first `acquire` and kept while the handle lives; none with
    /// [`transaction_pooling`](TokenBucketBuilder::transaction_pooling)),
    /// re-read the rate and shorten their wait to what the tokens
    /// still owed take at the new rate. A handle built with a higher rate
    /// does not shorten anyone's wait, and a lowered rate applies to later
    /// reservations only. While the key (or the limiter) is
    /// [paused](Self::pause), the reservation is refused until the pause
    /// ends: a waiter sleeps until then (woken early if an operator ends the
    /// pause) and reserves again, within its timeout; a pause that ends
    /// after the timeout returns [`Error::Timeout`] at once. A timeout above
    /// [`MAX_RATE_WAIT`](crate::MAX_RATE_WAIT) waits at most that.
    ///
    /// With [`fail_open`](TokenBucketBuilder::fail_open), an unreachable
    /// database admits at once, as [`check`](Self::check) does.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use pg_semaphore::{Error, TokenBucket};
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// let sends = TokenBucket::builder("emails").rate(5.0).burst(20).build(&pool)?;
    /// match sends.acquire_timeout("tenant-7", 1, Duration::from_secs(2)).await {
    ///     Ok(_admitted) => { /* send it */ }
    ///     Err(Error::Timeout { .. }) => { /* more than 2 s away: queue it for later */ }
    ///     Err(error) => return Err(error),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// - [`Error::Timeout`] (waiting for [`WaitedFor::RateLimit`]) at once
    ///   when the tokens would not be there within `timeout`, or the key is
    ///   paused beyond it, or when the key's lock stayed held
    ///   ([`Error::Stalled`], retried) until `timeout`; nothing was taken.
    /// - [`Error::InvalidArgument`], [`Error::MigrationsMissing`] and
    ///   [`Error::Database`] as for [`check`](Self::check) (a schema older
    ///   than version 6 has no `token_bucket_reserve`:
    ///   [`Error::MigrationsMissing`]).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while the reservation's statement is in flight
    /// either reserves or does not; dropping it after the reservation, while
    /// it sleeps, **forfeits the reserved tokens**: they stay taken, so the
    /// key admits less than its limit for that while, never more. (Giving
    /// them back is not safe: later reservations were timed behind them.)
    pub async fn acquire_timeout(
        &self,
        key: &str,
        permits: u32,
        timeout: Duration,
    ) -> Result<Decision> {
        self.inner.acquire(key, permits, Some(timeout)).await
    }
}

// ---------------------------------------------------------------------------
// Fixed window
// ---------------------------------------------------------------------------

/// At most `permit_limit` permits per key per window (.NET's
/// `System.Threading.RateLimiting.FixedWindowRateLimiter`).
///
/// A key's first check starts its first window; the next windows follow back
/// to back on that key's own grid, so keys do not all reset at the same
/// instant. Simple and exact within a window, but a burst at the end of one
/// window and another at the start of the next may pass up to twice the
/// limit within one window's length: [`SlidingWindow`] smooths that.
///
/// ```no_run
/// use std::time::Duration;
/// use pg_semaphore::FixedWindow;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// // 1,000 requests per minute per API key.
/// let limiter = FixedWindow::builder("per-minute")
///     .permit_limit(1_000)
///     .window(Duration::from_secs(60))
///     .build(&pool)?;
/// let decision = limiter.check("key-abc", 1).await?;
/// println!("{} left this minute", decision.remaining);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct FixedWindow {
    inner: Arc<Limiter>,
}

window_limiter!(
    FixedWindow,
    "fixed window",
    "window",
    "fixed_window",
    "books the permits in the first window of the key's grid that has room for them (the one open now, else a later one),"
);

// ---------------------------------------------------------------------------
// Sliding window
// ---------------------------------------------------------------------------

/// At most about `permit_limit` permits per key in any window's length
/// (.NET's `SlidingWindowRateLimiter`), as a **weighted previous +
/// current window**.
///
/// Each key keeps two counters: permits granted in the current window and in
/// the previous one (windows follow back to back on the key's own grid, as in
/// [`FixedWindow`]). A check estimates the permits of the last window's length
/// as `previous × (1 − elapsed / window) + current`, assuming the previous
/// window's permits were spread evenly over it, and admits when the estimate
/// plus `permits` stays within the limit. This needs one state per key and O(1)
/// work per check (the .NET limiter divides the window into segments
/// instead). Never more than `permit_limit` are granted in one window of the
/// grid, and a burst right after a boundary is held back by the previous
/// window's weight, unlike [`FixedWindow`]; the estimate is exact only when
/// traffic is even.
///
/// ```no_run
/// use std::time::Duration;
/// use pg_semaphore::SlidingWindow;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// // About 10 logins per IP per 10 minutes, without a reset burst.
/// let limiter = SlidingWindow::builder("logins")
///     .permit_limit(10)
///     .window(Duration::from_secs(600))
///     .build(&pool)?;
/// let decision = limiter.check("203.0.113.7", 1).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct SlidingWindow {
    inner: Arc<Limiter>,
}

window_limiter!(
    SlidingWindow,
    "sliding window",
    "window's length",
    "sliding_window",
    "books the permits at the earliest instant the weighted estimate admits them (now, later in this window once enough of the previous one has slid out, or in a later window),"
);

// ---------------------------------------------------------------------------
// The windows' builder
// ---------------------------------------------------------------------------

/// Configures a [`FixedWindow`] or a [`SlidingWindow`] (the same settings);
/// made by [`FixedWindow::builder`] or [`SlidingWindow::builder`].
#[must_use = "a builder does nothing until `.build(&pool)`"]
pub struct WindowBuilder<L> {
    common: Common,
    limit: Option<u32>,
    window: Option<Duration>,
    kind: std::marker::PhantomData<fn() -> L>,
}

impl<L> fmt::Debug for WindowBuilder<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WindowBuilder")
            .field("common", &self.common)
            .field("limit", &self.limit)
            .field("window", &self.window)
            .finish()
    }
}

impl<L> Clone for WindowBuilder<L> {
    fn clone(&self) -> Self {
        WindowBuilder {
            common: self.common.clone(),
            limit: self.limit,
            window: self.window,
            kind: std::marker::PhantomData,
        }
    }
}

/// The limiters a [`WindowBuilder`] builds.
trait WindowLimiter: Sized {
    fn policy(limit: u32, window: Duration) -> Policy;
    fn wrap(inner: Arc<Limiter>) -> Self;
}

impl<L> WindowBuilder<L> {
    fn new(name: String) -> Self {
        WindowBuilder {
            common: Common::new(name),
            limit: None,
            window: None,
            kind: std::marker::PhantomData,
        }
    }

    /// Permits granted per key per window (required, at least 1).
    pub fn permit_limit(mut self, permits: u32) -> Self {
        self.limit = Some(permits);
        self
    }

    /// The window's length (required, [`MIN_WINDOW`](crate::MIN_WINDOW) to
    /// [`MAX_WINDOW`](crate::MAX_WINDOW); measured on the database clock, to
    /// the microsecond).
    pub fn window(mut self, window: Duration) -> Self {
        self.window = Some(window);
        self
    }

    common_builder_methods!();
}

#[allow(private_bounds)]
impl<L: WindowLimiter> WindowBuilder<L> {
    /// Validates the settings. Nothing is written: each key's state is created
    /// by its first check.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad name, a permit limit of 0 or not
    /// set, a window not set or outside
    /// [`MIN_WINDOW`](crate::MIN_WINDOW)..=[`MAX_WINDOW`](crate::MAX_WINDOW).
    pub fn build(self, pool: &PgPool) -> Result<L> {
        let (limit, window) = window_policy(self.window, self.limit)?;
        Ok(L::wrap(self.common.build(pool, L::policy(limit, window))?))
    }
}

// ---------------------------------------------------------------------------
// Cleanup
// ---------------------------------------------------------------------------

/// Deletes the state of rate limiter keys that have been **at rest** for at
/// least `idle_for`, of every limiter, and returns how many keys it deleted.
///
/// A key is at rest once its state no longer limits anyone: its token bucket
/// is full again, or every window that counted one of its permits has ended.
/// Deleting such a key never admits more (its next check starts afresh: a
/// full bucket, or windows counted from that check, which may fall later
/// than the deleted key's would have), so `idle_for` may be zero; a longer one keeps
/// recently active keys' rows around to save their re-insertion. Keys still
/// limited are never deleted.
///
/// Call it from a cron job, or let a [`Reaper`](crate::Reaper) do it every
/// round with [`ReaperBuilder::rate_limits`](crate::ReaperBuilder::rate_limits).
/// It walks the table in batches of short transactions and skips keys being
/// checked at that moment, so it can run while checks go on.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// use std::time::Duration;
/// let deleted = pg_semaphore::prune_rate_limits(&pool, Duration::from_secs(3600)).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for `idle_for` above 100 years,
/// [`Error::MigrationsMissing`], [`Error::Database`].
///
/// # Cancel safety
///
/// Each batch commits on its own: cancelling keeps the batches already
/// deleted and deletes nothing more.
pub async fn prune_rate_limits(pool: &PgPool, idle_for: Duration) -> Result<u64> {
    let idle_for = validate::age("idle_for", idle_for)?;
    // The cursor: the last row looked at; the empty strings sort before every row.
    let mut cursor = (String::new(), String::new(), String::new());
    let mut total = 0u64;
    loop {
        let db = Db::new(pool, true);
        let query = db
            .query_as::<(i64, Option<String>, Option<String>, Option<String>)>(PRUNE)
            .bind(idle_for)
            .bind(cursor.0.clone())
            .bind(cursor.1.clone())
            .bind(cursor.2.clone())
            .bind(PRUNE_BATCH);
        let (deleted, kind, limiter, key) = db.fetch_one(query).await?;
        total += deleted.max(0) as u64;
        match (kind, limiter, key) {
            (Some(kind), Some(limiter), Some(key)) => cursor = (kind, limiter, key),
            _ => break,
        }
    }
    if total > 0 {
        tracing::debug!(deleted = total, "pruned idle rate limiter keys");
    }
    Ok(total)
}

#[cfg(all(test, feature = "serde"))]
mod serialize_tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_decision_gives_retry_after_in_seconds() {
        let decision = Decision {
            allowed: false,
            remaining: 0,
            retry_after: Duration::from_millis(250),
            limit: 10,
            failed_open: false,
        };
        assert_eq!(
            serde_json::to_value(decision).unwrap(),
            json!({
                "allowed": false,
                "remaining": 0,
                "retry_after_seconds": 0.25,
                "limit": 10,
                "failed_open": false,
            })
        );
    }
}
