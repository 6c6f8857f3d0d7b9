//! Rate limiters on PostgreSQL: one type, [`RateLimiter`], whose policy
//! ([`RatePolicy`]) is a value: a token bucket, a fixed window or a sliding
//! window.
//!
//! The state of every key is the newest of its rows in
//! `pgsemaphore.rate_ledger`, created by the key's first check. A check is
//! one call of one SQL function (one round trip) that
//! takes the key's transaction-level advisory lock, reads the key's newest
//! row and the database clock, and decides; when another check holds the
//! lock, a refusal on the row committed so far is final and waits for nobody
//! (admissions only ever take from a key), and a check that may admit waits
//! for the lock and decides again. When it admits it inserts the next state
//! as a new row (a refusal writes nothing; no row is ever
//! updated, so a long transaction elsewhere does not slow it). Concurrent
//! checks from any number of processes queue on the key's lock and never
//! admit more than the limit. Each policy has its SQL function,
//! `pgsemaphore.token_bucket`, `fixed_window` and `sliding_window`; they and
//! their reservations run on one engine, `rate_take`, with the arithmetic of
//! each policy in a pure function (`bucket_step`, `fixed_step`,
//! `sliding_step`), all in
//! `migrations/20261128010006_pgsemaphore_rate_limits.sql`, whose header and
//! function comments state the invariants and the transactions each meets.
//!
//! Every limiter can also wait ([`RateLimiter::acquire`]): one call of its
//! policy's reservation (`token_bucket_reserve`, `fixed_window_reserve` or
//! `sliding_window_reserve`) books
//! the permits at the earliest instant the limit admits them, even ahead of
//! a refill or in a later window, and answers when that is; the caller
//! sleeps until then. A reservation reaches at most `burst / rate` (a
//! window: one window) ahead, so a deeper queue is refused with the instant
//! and tries again then; a handle's waiting acquires of one key wait in line
//! (FIFO, in the process), and only the head reserves, so that those retries
//! are one at a time rather than every waiter's at every instant.
//!
//! A limiter's limits belong to the database (stored on first use): the
//! first check of a limiter stores the
//! limits its handle was built with in `pgsemaphore.rate_limit_settings`,
//! and every later check, of every process, is decided under the stored
//! ones in the same statement, whatever its handle says; only an operator
//! changes them, per limiter or per key (`pg-semaphore limits set`,
//! [`set_rate_limit`](crate::admin::set_rate_limit)). A handle whose limits differ
//! from the stored ones logs one `WARN` per limiter and process naming
//! both. A key's lock held elsewhere for 2 s answers [`Error::Stalled`].
//! Any process may [`pause`](RateLimiter::pause) a key or a whole limiter
//! after an upstream's 429; and a [`LimiterSet`] checks several limits at
//! once, all or none. How (and the wake-ups of waiting acquires when an
//! operator raises a rate or ends a pause): `settings` and `set` below, and
//! the header of `migrations/20261128010006_pgsemaphore_rate_limits.sql`.
//!
//! This module is the face: each method of [`RateLimiter`] is a short
//! delegation to `engine` (the `Limiter` every handle of a limiter shares,
//! and one SQL function per policy and statement, and the clock of a
//! waiting acquire). A policy's limits are checked by the builder, against
//! the bounds in `validate`.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::types::PgInterval;

use crate::Client;
use crate::admin::LimiterKind;
use crate::db::Db;
use crate::error::{Error, Result};
use crate::validate::{self, MAX_RATE, MAX_WINDOW};

mod engine;
mod set;
mod settings;

use engine::Limiter;
pub(crate) use set::ClaimRates;
pub use set::LimiterSet;
pub(crate) use settings::RateWakeups;

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
    /// The limiter's [limit](RatePolicy::limit): a token bucket's burst, a
    /// window's permit limit, as the handle was built (a
    /// limit stored in the database, [`set_rate_limit`](crate::admin::set_rate_limit),
    /// may differ; [`rate_limit_settings`](crate::admin::rate_limit_settings) lists
    /// them).
    pub limit: u32,
    /// `true` when the database could not be reached and the limiter was
    /// built with `fail_open(true)`: the request was admitted without being
    /// counted.
    pub failed_open: bool,
}

impl Decision {
    /// The database's decision, its `remaining` and retry-after (in
    /// microseconds) as the SQL functions answer them.
    fn new(allowed: bool, remaining: i64, retry_after_us: i64, limit: u32) -> Decision {
        Decision {
            allowed,
            remaining: u32::try_from(remaining.max(0)).unwrap_or(u32::MAX),
            retry_after: Duration::from_micros(retry_after_us.max(0) as u64),
            limit,
            failed_open: false,
        }
    }

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

// ---------------------------------------------------------------------------
// The policy
// ---------------------------------------------------------------------------

/// What a [`RateLimiter`] enforces on each of its keys: its algorithm and
/// limits, a value given to [`RateLimiter::builder`]. Made with
/// [`token_bucket`](Self::token_bucket), [`fixed_window`](Self::fixed_window)
/// or [`sliding_window`](Self::sliding_window) (or as a variant); a
/// limiter's [`policy`](RateLimiter::policy) is matched as a variant.
///
/// The limits are checked when the limiter is built
/// ([`RateLimiterBuilder::build`]). They are stored as the limiter's by its
/// first check; from then on the stored ones apply, in every process
/// ([`set_rate_limit`](crate::admin::set_rate_limit)).
///
/// ```
/// use std::time::Duration;
/// use pg_semaphore::{RatePolicy, admin::LimiterKind};
///
/// // 100 requests per second per key, bursts of up to 500.
/// let api = RatePolicy::token_bucket(100.0, 500);
/// // 1,000 requests per minute per key.
/// let per_minute = RatePolicy::fixed_window(1_000, Duration::from_secs(60));
/// assert_eq!(api.limit(), 500);
/// assert_eq!(per_minute.kind(), LimiterKind::FixedWindow);
/// ```
///
/// An operator stores one for a limiter or a key with
/// [`set_rate_limit`](crate::admin::set_rate_limit), and
/// [`rate_limit_settings`](crate::admin::rate_limit_settings) lists the
/// stored ones as policies.
///
/// With the `serde` feature it serializes as `{"kind": "token_bucket",
/// "rate", "burst"}` or `{"kind": "fixed_window" | "sliding_window",
/// "permit_limit", "window_seconds"}` (`kind` as [`LimiterKind`] names it).
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(tag = "kind", rename_all = "snake_case"))]
#[non_exhaustive]
pub enum RatePolicy {
    /// A token bucket per key, with the semantics of Stripe's request rate
    /// limiter ("Scaling your API with rate limiters").
    ///
    /// Each key has a bucket of up to `burst` tokens that refills
    /// continuously at `rate` tokens per second; a check takes `permits`
    /// tokens if the bucket has them and takes nothing otherwise. A key's
    /// first check finds a full bucket, so a burst of `burst` requests
    /// passes at once, then `rate` per second. Time is the database's
    /// clock.
    TokenBucket {
        /// Tokens added to each key's bucket per second: positive, at most
        /// [`MAX_RATE`](crate::limits::MAX_RATE); may be fractional (`0.5` is one
        /// every two seconds). Stripe's `REPLENISH_RATE`.
        rate: f64,
        /// The bucket's capacity: the most tokens a key can save up and
        /// spend at once (at least 1; refilling it from empty may take at
        /// most [`MAX_WINDOW`](crate::limits::MAX_WINDOW)). Stripe's `CAPACITY`,
        /// .NET's `TokenLimit`.
        burst: u32,
    },
    /// At most `permit_limit` permits per key per window (.NET's
    /// `System.Threading.RateLimiting.FixedWindowRateLimiter`).
    ///
    /// A key's first check starts its first window; the next windows follow
    /// back to back on that key's own grid, so keys do not all reset at the
    /// same instant. Simple and exact within a window, but a burst at the
    /// end of one window and another at the start of the next may pass up
    /// to twice the limit within one window's length:
    /// [`SlidingWindow`](Self::SlidingWindow) smooths that.
    FixedWindow {
        /// Permits granted per key per window (at least 1).
        permit_limit: u32,
        /// The window's length ([`MIN_WINDOW`](crate::limits::MIN_WINDOW) to
        /// [`MAX_WINDOW`](crate::limits::MAX_WINDOW); measured on the database
        /// clock, to the microsecond).
        #[cfg_attr(
            feature = "serde",
            serde(
                rename = "window_seconds",
                serialize_with = "crate::serialize::seconds"
            )
        )]
        window: Duration,
    },
    /// At most about `permit_limit` permits per key in any window's length
    /// (.NET's `SlidingWindowRateLimiter`), as a **weighted previous +
    /// current window**.
    ///
    /// Each key keeps two counters: permits granted in the current window
    /// and in the previous one (windows follow back to back on the key's
    /// own grid, as in a [`FixedWindow`](Self::FixedWindow)). A check
    /// estimates the permits of the last window's length as `previous × (1 −
    /// elapsed / window) + current`, assuming the previous window's permits
    /// were spread evenly over it, and admits when the estimate plus
    /// `permits` stays within the limit. This needs one state per key and
    /// O(1) work per check (the .NET limiter divides the window into
    /// segments instead). Never more than `permit_limit` are granted in one
    /// window of the grid, and a burst right after a boundary is held back
    /// by the previous window's weight, unlike a fixed window; the estimate
    /// is exact only when traffic is even.
    SlidingWindow {
        /// Permits granted per key per window's length (at least 1).
        permit_limit: u32,
        /// The window's length, as for a fixed window.
        #[cfg_attr(
            feature = "serde",
            serde(
                rename = "window_seconds",
                serialize_with = "crate::serialize::seconds"
            )
        )]
        window: Duration,
    },
}

impl RatePolicy {
    /// A [token bucket](Self::TokenBucket) of `burst` tokens per key,
    /// refilled at `rate` tokens per second.
    pub const fn token_bucket(rate: f64, burst: u32) -> RatePolicy {
        RatePolicy::TokenBucket { rate, burst }
    }

    /// A [fixed window](Self::FixedWindow): at most `permit_limit` permits
    /// per key per `window`.
    pub const fn fixed_window(permit_limit: u32, window: Duration) -> RatePolicy {
        RatePolicy::FixedWindow {
            permit_limit,
            window,
        }
    }

    /// A [sliding window](Self::SlidingWindow): at most about
    /// `permit_limit` permits per key in any `window`'s length.
    pub const fn sliding_window(permit_limit: u32, window: Duration) -> RatePolicy {
        RatePolicy::SlidingWindow {
            permit_limit,
            window,
        }
    }

    /// The most permits a key has at once: a token bucket's `burst`, a
    /// window's `permit_limit`. A check or acquire of more could never be
    /// granted.
    pub fn limit(&self) -> u32 {
        match *self {
            RatePolicy::TokenBucket { burst, .. } => burst,
            RatePolicy::FixedWindow { permit_limit, .. }
            | RatePolicy::SlidingWindow { permit_limit, .. } => permit_limit,
        }
    }

    /// The policy's kind, as the database, the operator functions and the
    /// metrics name it (limiters of different kinds never share a name's
    /// state or settings).
    pub fn kind(&self) -> LimiterKind {
        match self {
            RatePolicy::TokenBucket { .. } => LimiterKind::TokenBucket,
            RatePolicy::FixedWindow { .. } => LimiterKind::FixedWindow,
            RatePolicy::SlidingWindow { .. } => LimiterKind::SlidingWindow,
        }
    }

    /// The checks of [`RateLimiterBuilder::build`].
    fn validate(self) -> Result<()> {
        if let RatePolicy::TokenBucket { rate, burst } = self {
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
            if burst == 0 {
                return Err(Error::invalid("burst", "must be at least 1"));
            }
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
        } else if self.limit() == 0 {
            return Err(Error::invalid("permit_limit", "must be at least 1"));
        }
        // A window's length.
        self.sql_limits().map(drop)
    }

    /// The policy's limits as its SQL functions take them.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a window outside
    /// [`MIN_WINDOW`](crate::limits::MIN_WINDOW)..=[`MAX_WINDOW`].
    pub(crate) fn sql_limits(self) -> Result<SqlLimits> {
        Ok(match self {
            RatePolicy::TokenBucket { rate, burst } => SqlLimits::Bucket {
                rate,
                burst: f64::from(burst),
            },
            RatePolicy::FixedWindow {
                permit_limit,
                window,
            }
            | RatePolicy::SlidingWindow {
                permit_limit,
                window,
            } => SqlLimits::Window {
                limit: i64::from(permit_limit),
                window: validate::window(window)?,
            },
        })
    }
}

/// A [`RatePolicy`]'s limits as its SQL functions take them (`p_rate`,
/// `p_burst`, or `p_limit`, `p_window`).
#[derive(Debug)]
pub(crate) enum SqlLimits {
    /// A token bucket's rate (tokens per second) and burst.
    Bucket { rate: f64, burst: f64 },
    /// A window's permit limit and length.
    Window { limit: i64, window: PgInterval },
}

impl SqlLimits {
    /// As the functions that take either kind's limits take them: `rate`,
    /// `burst`, `limit`, `window`, the other kind's two NULL.
    pub(crate) fn columns(self) -> (Option<f64>, Option<f64>, Option<i64>, Option<PgInterval>) {
        match self {
            SqlLimits::Bucket { rate, burst } => (Some(rate), Some(burst), None, None),
            SqlLimits::Window { limit, window } => (None, None, Some(limit), Some(window)),
        }
    }
}

// ---------------------------------------------------------------------------
// The limiter
// ---------------------------------------------------------------------------

/// A rate limiter: at most so many permits per key (a user, an IP, a
/// route, ...) over time, as its [`RatePolicy`] says, counted in the
/// database for every process.
///
/// A cheap handle (an [`Arc`] inside): clone it freely. The limits it is
/// built with are stored as the limiter's by its first check; from then on
/// the stored ones apply, in every process, whatever a handle says, and
/// only an operator changes them, for the limiter or for one key
/// ([`set_rate_limit`](crate::admin::set_rate_limit)). A handle built with other
/// limits logs one `WARN` naming both.
///
/// ```no_run
/// use std::time::Duration;
/// use pg_semaphore::{RateLimiter, RatePolicy};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// # let client = pg_semaphore::Client::new(pool.clone());
/// // 100 requests per second per user, bursts of up to 500.
/// let limiter = RateLimiter::builder("api", RatePolicy::token_bucket(100.0, 500)).build(&client)?;
/// let decision = limiter.check("user-42", 1).await?;
/// if !decision.allowed {
///     // answer 429 with Retry-After: decision.retry_after
/// }
///
/// // About 10 logins per IP per 10 minutes, without a reset burst.
/// let policy = RatePolicy::sliding_window(10, Duration::from_secs(600));
/// let logins = RateLimiter::builder("logins", policy).build(&client)?;
/// let decision = logins.check("203.0.113.7", 1).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RateLimiter {
    inner: Arc<Limiter>,
}

/// Configures a [`RateLimiter`]; made by [`RateLimiter::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `.build(&client)`"]
pub struct RateLimiterBuilder {
    name: String,
    policy: RatePolicy,
    fail_open: bool,
}

impl RateLimiterBuilder {
    /// Admit requests when the database cannot be reached (default
    /// `false`: `check` returns the error).
    ///
    /// Stripe's advice: a rate limiter should not make its store a hard
    /// dependency of every request. With `fail_open(true)`, a check that
    /// fails because the database is unreachable (connection refused or
    /// lost, pool timed out or closed, server shutting down, too many
    /// connections) returns an admitting [`Decision`] with
    /// [`failed_open`](Decision::failed_open) set, and logs a
    /// `tracing::warn!` event: alert on it. Other errors (invalid input,
    /// missing migrations, any other database error) are still returned.
    /// How long a check waits for a connection is the pool's
    /// `acquire_timeout`.
    pub fn fail_open(mut self, enabled: bool) -> Self {
        self.fail_open = enabled;
        self
    }

    /// Validates the settings. Nothing is written: each key's state is
    /// created by its first check.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a name that is empty, longer than
    /// [`MAX_NAME_LEN`](crate::limits::MAX_NAME_LEN) or contains NUL; a token
    /// bucket's rate that is not a positive finite number or is above
    /// [`MAX_RATE`](crate::limits::MAX_RATE) (`rate`), a burst of 0 (`burst`), a
    /// bucket that would take longer than [`MAX_WINDOW`](crate::limits::MAX_WINDOW)
    /// to refill from empty (`rate`); a window's permit limit of 0
    /// (`permit_limit`), a window outside
    /// [`MIN_WINDOW`](crate::limits::MIN_WINDOW)..=[`MAX_WINDOW`](crate::limits::MAX_WINDOW)
    /// (`window`).
    pub fn build(self, client: &Client) -> Result<RateLimiter> {
        validate::name(&self.name)?;
        self.policy.validate()?;
        Ok(RateLimiter {
            inner: Arc::new(Limiter::new(client, self.name, self.policy, self.fail_open)),
        })
    }
}

impl RateLimiter {
    /// Starts configuring the rate limiter `name`, enforcing `policy` on
    /// each of its keys.
    pub fn builder(name: impl Into<String>, policy: RatePolicy) -> RateLimiterBuilder {
        RateLimiterBuilder {
            name: name.into(),
            policy,
            fail_open: false,
        }
    }

    /// The limiter's name: keys of limiters with different names (or of
    /// different kinds) never share state.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The pool this limiter uses.
    pub fn pool(&self) -> &PgPool {
        self.inner.db.pool()
    }

    /// The policy this handle was built with (the limits in force are the
    /// stored ones: [`rate_limit_settings`](crate::admin::rate_limit_settings)).
    pub fn policy(&self) -> RatePolicy {
        self.inner.policy
    }

    /// Asks for `permits` for `key` (a user, an IP, a route, ...), in one
    /// round trip: tokens of a token bucket, permits of a window.
    ///
    /// The key's state is created by its first check. Refused checks take
    /// nothing. Use `permits = 1` per request, or a weight for costlier ones.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidArgument`] for a key that is empty, longer than
    ///   [`MAX_KEY_LEN`](crate::limits::MAX_KEY_LEN) characters or contains NUL,
    ///   and for `permits` of 0 or above the [limit](RatePolicy::limit) (it
    ///   could never be granted). Nothing is sent.
    /// - [`Error::Schema`] when [`migrate`](crate::migrate) was not run.
    /// - [`Error::Stalled`] (naming the limiter) when the key's lock was
    ///   held by another transaction for 2 s (a check left in an open
    ///   transaction, or a session holding the key's advisory lock):
    ///   nothing was taken.
    /// - [`Error::Database`] for connection and other database errors,
    ///   unless the limiter [fails open](RateLimiterBuilder::fail_open).
    ///
    /// # Cancel safety
    ///
    /// One statement: if cancelled, the check either happened (its
    /// permits are taken) or did not.
    pub async fn check(&self, key: &str, permits: u32) -> Result<Decision> {
        self.inner.check(key, permits).await
    }

    /// Waits until `key` admits `permits`, then returns the admitting
    /// [`Decision`]: [`acquire_timeout`](Self::acquire_timeout) with the
    /// longest wait that can be reserved,
    /// [`MAX_RATE_WAIT`](crate::limits::MAX_RATE_WAIT).
    ///
    /// ```no_run
    /// use pg_semaphore::{RateLimiter, RatePolicy};
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// // Call a partner's API at most 10 times per second, from every process.
    /// let partner = RateLimiter::builder("partner-api", RatePolicy::token_bucket(10.0, 10))
    ///     .build(&client)?;
    /// partner.acquire("all", 1).await?;
    /// // ... call it ...
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`acquire_timeout`](Self::acquire_timeout); [`Error::Timeout`]
    /// only when the permits could not be admitted within
    /// [`MAX_RATE_WAIT`](crate::limits::MAX_RATE_WAIT).
    ///
    /// # Cancel safety
    ///
    /// As [`acquire_timeout`](Self::acquire_timeout): dropping the future
    /// while it waits in this process's line for the key, or while the
    /// reservation's statement is in flight, takes nothing or books (one
    /// statement); dropping it after the reservation, while it sleeps,
    /// forfeits the booked permits (the key admits less, never more).
    pub async fn acquire(&self, key: &str, permits: u32) -> Result<Decision> {
        self.inner.acquire(key, permits, None).await
    }

    /// Waits until `key` admits `permits`, if that takes at most `timeout`,
    /// then returns the admitting [`Decision`]; if it would take longer,
    /// returns [`Error::Timeout`] at once, without waiting and without
    /// taking anything.
    ///
    /// Kept beside [`acquire`](Self::acquire) because it is cheaper than
    /// `tokio::time::timeout(timeout, limiter.acquire(key, permits))`: that
    /// books the permits up to [`MAX_RATE_WAIT`](crate::limits::MAX_RATE_WAIT)
    /// ahead and then sleeps, so when the timeout fires the caller has
    /// waited all of `timeout` for nothing, and the dropped future forfeits
    /// the permits it booked (the key admits less for that while). This
    /// method tells the database the longest wait it accepts, and a booking
    /// further ahead is refused in the same round trip: nothing is taken and
    /// nobody waits.
    ///
    /// One round trip per call, however many wait on the key: a
    /// *reservation* (the policy's `pgsemaphore.*_reserve` function) books
    /// the permits at the earliest instant the policy admits them (a token
    /// bucket takes the tokens now, even those not refilled yet, as GCRA and
    /// Stripe's limiter do; a fixed window books them in the first window of
    /// the key's grid that has room; a sliding window at the earliest
    /// instant the weighted estimate admits them), and the database answers
    /// when that is; this process then sleeps until that instant, counted
    /// from the reply on its own clock, so it is admitted no earlier than
    /// the database allows (later by the reply's latency). Waiters are
    /// admitted in the order they reserved, with no polling and no stampede
    /// on the key's lock when permits come back; never more than the policy
    /// allows (over any interval of length `d` a token bucket's key admits
    /// at most `burst + rate × d` tokens; a window's key at most
    /// `permit_limit` in one window of its grid), plain
    /// [`check`](Self::check)s included. A `check` is refused while
    /// reservations are outstanding: reservations are served first.
    ///
    /// The wait is fixed when the permits are booked, with one exception:
    /// when an operator raises a token bucket's stored rate
    /// ([`set_rate_limit`](crate::admin::set_rate_limit)), waiters are told (a
    /// `NOTIFY`, heard by one `LISTEN` connection per client, opened by its
    /// first waiting `acquire`; none behind a transaction pooler without
    /// direct [`connect_options`](crate::Client::connect_options)),
    /// re-read the rate and shorten their wait to what the tokens still
    /// owed take at the new rate. A handle built with a higher rate does not
    /// shorten anyone's wait, and a lowered limit applies to later
    /// reservations only. While the key (or the limiter) is
    /// [paused](Self::pause), the reservation is refused until the pause
    /// ends: a waiter sleeps until then (woken early if an operator ends
    /// the pause) and reserves again, within its timeout; a pause that ends
    /// after the timeout returns [`Error::Timeout`] at once. A timeout
    /// above [`MAX_RATE_WAIT`](crate::limits::MAX_RATE_WAIT) waits at most that.
    ///
    /// With [`fail_open`](RateLimiterBuilder::fail_open), an unreachable
    /// database admits at once, as [`check`](Self::check) does.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use pg_semaphore::{Error, RateLimiter, RatePolicy};
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// let sends = RateLimiter::builder("emails", RatePolicy::token_bucket(5.0, 20)).build(&client)?;
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
    /// - [`Error::Timeout`] (waiting for
    ///   [`WaitedFor::RateLimit`](crate::WaitedFor::RateLimit)) at once
    ///   when the permits would not be admitted within `timeout`, or the key
    ///   is paused beyond it, or when the key's lock stayed held
    ///   ([`Error::Stalled`], retried) until `timeout`; nothing was taken.
    /// - [`Error::InvalidArgument`], [`Error::Schema`] and
    ///   [`Error::Database`] as for [`check`](Self::check).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while it waits in this process's line for the
    /// key takes nothing; while the reservation's statement is in flight it
    /// either books or does not; dropping it after the reservation, while
    /// it sleeps, **forfeits the booked permits**: they stay taken, so the
    /// key admits less than its limit for that while, never more. (Giving
    /// them back is not safe: later reservations were timed behind them,
    /// and it would need a second round trip that a cancelled future cannot
    /// make.)
    pub async fn acquire_timeout(
        &self,
        key: &str,
        permits: u32,
        timeout: Duration,
    ) -> Result<Decision> {
        self.inner.acquire(key, permits, Some(timeout)).await
    }

    /// Pauses `key` for `duration` from now (on the database's clock), in
    /// every process: its checks are refused with a `retry_after` until
    /// then, taking nothing, and waiting acquires sleep until then. For an
    /// upstream that answered 429 with `Retry-After`. A pause is only ever
    /// extended: a shorter one than the pause in force changes nothing (an
    /// operator ends one early: `pg-semaphore limits resume`,
    /// [`resume_rate_limit`](crate::admin::resume_rate_limit)).
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # async fn run(limiter: pg_semaphore::RateLimiter) -> Result<(), pg_semaphore::Error> {
    /// // The upstream answered 429 with Retry-After: 30.
    /// limiter.pause("tenant-7", Duration::from_secs(30)).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidArgument`] for a bad key (as `check`) and a
    ///   `duration` below 1 ms or above [`MAX_PAUSE`](crate::limits::MAX_PAUSE).
    /// - [`Error::Stalled`] when the limiter's settings row was held by
    ///   another transaction for 2 s; [`Error::Schema`] when the schema is
    ///   missing; [`Error::Database`] otherwise (a pause never
    ///   fails open).
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
/// Call it from a cron job, or let a [`Reaper`](crate::admin::Reaper) do it every
/// round with [`ReaperBuilder::rate_limits`](crate::admin::ReaperBuilder::rate_limits).
/// It walks the table in batches of short transactions and skips keys being
/// checked at that moment, so it can run while checks go on.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// use std::time::Duration;
/// let deleted = pg_semaphore::admin::prune_rate_limits(&pool, Duration::from_secs(3600)).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for `idle_for` above 100 years,
/// [`Error::Schema`], [`Error::Database`].
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

    #[test]
    fn a_policy_says_its_kind_and_gives_windows_in_seconds() {
        assert_eq!(
            serde_json::to_value(RatePolicy::token_bucket(2.5, 5)).unwrap(),
            json!({"kind": "token_bucket", "rate": 2.5, "burst": 5})
        );
        assert_eq!(
            serde_json::to_value(RatePolicy::fixed_window(10, Duration::from_millis(1500)))
                .unwrap(),
            json!({"kind": "fixed_window", "permit_limit": 10, "window_seconds": 1.5})
        );
        assert_eq!(
            serde_json::to_value(RatePolicy::sliding_window(3, Duration::from_secs(60))).unwrap(),
            json!({"kind": "sliding_window", "permit_limit": 3, "window_seconds": 60.0})
        );
    }
}
