//! Several limits in one check ([`LimiterSet`]): one call of
//! `pgsemaphore.check_limits` (or, waiting, `check_limits_reserve`), which
//! locks every key in one order for every caller, decides each limit as its
//! kind's check would, and charges all or none (the engine,
//! `pgsemaphore.rate_take_all`, states the invariant and what it meets).

use std::sync::Arc;
use std::time::Duration;

use super::engine::Waiting;
use super::{Decision, Limiter, RateLimiter};
use crate::db::Statement;
use crate::error::{Error, Result, WaitedFor};
use crate::validate::{MAX_LIMITS, MAX_RATE_WAIT};

/// `$8` permits against every limit `i` (kind `$1[i]`, limiter `$2[i]`, key
/// `$3[i]`, with the token bucket's `$4[i]`, `$5[i]` or the window's `$6[i]`,
/// `$7[i]`): all admit and are charged, or none is.
const CHECK_LIMITS: &str = "SELECT o_allowed, o_remaining, o_retry_after_us, o_deciding \
                            FROM pgsemaphore.check_limits(p_kinds => $1, p_limiters => $2, \
                                p_keys => $3, p_rates => $4, p_bursts => $5, p_limits => $6, \
                                p_windows => $7, p_n => $8)";

/// [`CHECK_LIMITS`] that waits: books `$8` permits in every limit at the
/// earliest instant all admit them, provided it is within `$9`; answers how
/// long to wait before acting.
const CHECK_LIMITS_RESERVE: &str = "SELECT o_allowed, o_wait_us, o_remaining, o_deciding \
                                    FROM pgsemaphore.check_limits_reserve(p_kinds => $1, \
                                        p_limiters => $2, p_keys => $3, p_rates => $4, \
                                        p_bursts => $5, p_limits => $6, p_windows => $7, \
                                        p_n => $8, p_max_wait => $9)";

/// Several rate limits checked as one: admitted only if every limit admits,
/// and then charged to every one; refused if any refuses, and then charged
/// to none, with the longest retry-after of the limits that refused.
///
/// For example 100 per second, 1,000 per hour and 10,000 per day on the
/// same key, or a per-key limit and a global one (a limit added with
/// [`with_key`](Self::with_key) always checks that key). One round trip:
/// the database locks the limits' keys in one order for every caller (two
/// sets never deadlock, whatever order they list their limits in) and
/// decides each as its own limiter's check would, so stored limits and
/// pauses apply as in a single [`check`](RateLimiter::check). As there, a
/// check that the keys' committed state refuses is answered without
/// waiting for a key another transaction holds. A set can
/// wait too ([`acquire`](Self::acquire)).
///
/// ```no_run
/// use std::time::Duration;
/// use pg_semaphore::{LimiterSet, RateLimiter, RatePolicy};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// # let client = pg_semaphore::Client::new(pool.clone());
/// let per_second = RateLimiter::builder("api-s", RatePolicy::token_bucket(100.0, 100))
///     .build(&client)?;
/// let day = Duration::from_secs(86_400);
/// let per_day = RateLimiter::builder("api-day", RatePolicy::fixed_window(10_000, day))
///     .build(&client)?;
/// let everyone = RateLimiter::builder("api-all", RatePolicy::token_bucket(5_000.0, 5_000))
///     .build(&client)?;
/// let limits = LimiterSet::new()
///     .with(&per_second)
///     .with(&per_day)
///     .with_key(&everyone, "all");
/// let decision = limits.check("user-42", 1).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
#[must_use = "a limiter set does nothing until checked"]
pub struct LimiterSet {
    limits: Vec<(Arc<Limiter>, Option<String>)>,
}

impl LimiterSet {
    /// An empty set: add limits with [`with`](Self::with) and
    /// [`with_key`](Self::with_key).
    pub fn new() -> LimiterSet {
        LimiterSet::default()
    }

    /// Adds `limiter`, checked on the key passed to [`check`](Self::check).
    pub fn with(mut self, limiter: &RateLimiter) -> LimiterSet {
        self.limits.push((limiter.inner.clone(), None));
        self
    }

    /// Adds `limiter`, always checked on `key` (a global limit: `"all"`).
    pub fn with_key(mut self, limiter: &RateLimiter, key: impl Into<String>) -> LimiterSet {
        self.limits.push((limiter.inner.clone(), Some(key.into())));
        self
    }

    /// How many limits the set checks.
    pub fn len(&self) -> usize {
        self.limits.len()
    }

    /// Whether the set has no limit yet.
    pub fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// Asks every limit for `permits` at once, in one round trip: admitted
    /// only if all admit (each is charged), refused if any refuses (none is
    /// charged). The [`Decision`]'s `remaining` is the fewest any limit has
    /// left, `retry_after` the longest of the refusing limits', and `limit`
    /// the limit of the limiter that decided (refused: the refusing one with
    /// the longest retry-after; admitted: the one with the fewest left).
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidArgument`] for an empty set or one of more than
    ///   [`MAX_LIMITS`](crate::limits::MAX_LIMITS) limits (`limits`), limiters built
    ///   on different pools (`limits`), the same key of the same limiter
    ///   twice (`limits`, from the database), and as each limiter's
    ///   [`check`](RateLimiter::check) for the key and `permits`.
    /// - [`Error::Schema`] when the schema is missing.
    /// - [`Error::Stalled`] (naming the set's limiters) when a key's lock
    ///   was held by another transaction for 2 s: nothing was charged.
    /// - [`Error::Database`] otherwise, unless every limiter of the set
    ///   fails open (then an unreachable database admits, as `check` does).
    ///
    /// # Cancel safety
    ///
    /// One statement: if cancelled, the check either happened (every limit
    /// charged) or did not.
    pub async fn check(&self, key: &str, permits: u32) -> Result<Decision> {
        let first = self.first()?;
        let query = self.statement(CHECK_LIMITS, key, permits)?;
        let db = &first.db;
        match db.fetch_one(query).await {
            Ok((allowed, remaining, retry_after_us, deciding)) => {
                // The outcome counters count an admission for every
                // limiter, a refusal for the one that decided.
                if allowed {
                    for (limiter, _) in &self.limits {
                        limiter.outcomes.admitted();
                    }
                } else {
                    self.decider(deciding).0.outcomes.refused();
                }
                for (limiter, _) in &self.limits {
                    limiter.decided(allowed).await;
                }
                Ok(Decision::new(
                    allowed,
                    remaining,
                    retry_after_us,
                    self.decider(deciding).0.policy.limit(),
                ))
            }
            Err(error) if self.fails_open() => first.failed(error).await,
            Err(error) => Err(self.stalled(error)),
        }
    }

    /// Waits until every limit admits `permits` for `key` at the same
    /// instant, then returns the admitting [`Decision`]:
    /// [`acquire_timeout`](Self::acquire_timeout) with the longest wait that
    /// can be booked, [`MAX_RATE_WAIT`](crate::limits::MAX_RATE_WAIT).
    ///
    /// # Errors
    ///
    /// As [`acquire_timeout`](Self::acquire_timeout).
    ///
    /// # Cancel safety
    ///
    /// As [`acquire_timeout`](Self::acquire_timeout).
    pub async fn acquire(&self, key: &str, permits: u32) -> Result<Decision> {
        self.acquire_within(key, permits, None).await
    }

    /// Waits until every limit admits `permits` for `key` at the same
    /// instant, if that takes at most `timeout`, then returns the admitting
    /// [`Decision`]; if it would take longer, returns [`Error::Timeout`] at
    /// once, without waiting and without taking anything.
    ///
    /// Cheaper than `tokio::time::timeout` over [`acquire`](Self::acquire),
    /// as [`RateLimiter::acquire_timeout`] is: a booking beyond `timeout` is
    /// refused in the same round trip, so nothing is booked and then
    /// forfeited, and nobody waits to be told no.
    ///
    /// One round trip per call (`pgsemaphore.check_limits_reserve`): the
    /// database finds the earliest instant at which every limit admits the
    /// permits, books them there in every limit (all or none, as
    /// [`check`](Self::check) charges), and answers when that is; this
    /// process sleeps until then. Each limit counts the admission at that
    /// instant, so acting then never exceeds any of them. While a limit is
    /// paused the call sleeps until the pause ends and books again.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use pg_semaphore::{LimiterSet, RateLimiter, RatePolicy};
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// let per_second = RateLimiter::builder("sms-s", RatePolicy::token_bucket(10.0, 10))
    ///     .build(&client)?;
    /// let day = Duration::from_secs(86_400);
    /// let per_day = RateLimiter::builder("sms-day", RatePolicy::fixed_window(1_000, day))
    ///     .build(&client)?;
    /// let limits = LimiterSet::new().with(&per_second).with(&per_day);
    /// limits.acquire_timeout("tenant-7", 1, Duration::from_secs(30)).await?;
    /// // ... send the message ...
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// - [`Error::Timeout`] (waiting for [`WaitedFor::RateLimit`] naming
    ///   the limiter that decided) at once when the permits would not be
    ///   admitted within `timeout`, or when a key's lock stayed held
    ///   ([`Error::Stalled`], retried) until `timeout`; nothing was booked.
    /// - [`Error::InvalidArgument`] as for [`check`](Self::check).
    /// - [`Error::Schema`] when the schema is missing.
    /// - [`Error::Database`] otherwise, unless every limiter of the set
    ///   fails open (then an unreachable database admits at once).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while the booking's statement is in flight
    /// either books or does not; dropping it while it sleeps **forfeits the
    /// booked permits** in every limit (they stay counted: the limits admit
    /// less, never more).
    pub async fn acquire_timeout(
        &self,
        key: &str,
        permits: u32,
        timeout: Duration,
    ) -> Result<Decision> {
        self.acquire_within(key, permits, Some(timeout)).await
    }

    async fn acquire_within(
        &self,
        key: &str,
        permits: u32,
        timeout: Option<Duration>,
    ) -> Result<Decision> {
        let first = self.first()?;
        let mut waiting = Waiting::new(timeout);
        // In line with this process's other waiting acquires of the key on
        // the first limiter (its own included), as `Limiter::acquire` is.
        let line = first.line(key);
        let Some(head) = waiting.head(&line).await else {
            return Err(self.timed_out(first, key, timeout));
        };
        loop {
            let (left, max_wait) = waiting.left()?;
            let query = self
                .statement(CHECK_LIMITS_RESERVE, key, permits)?
                .bind(max_wait);
            let (allowed, wait_us, remaining, deciding) = match first.db.fetch_one(query).await {
                Ok(reply) => reply,
                Err(error) => match self.stalled(error) {
                    Error::Stalled { .. } if waiting.retry_stalled(&first.name, key) => continue,
                    Error::Stalled { .. } => return Err(self.timed_out(first, key, timeout)),
                    error if self.fails_open() => return first.failed(error).await,
                    error => return Err(error),
                },
            };
            for (limiter, _) in &self.limits {
                limiter.note_stored_limits().await;
            }
            let wait = Duration::from_micros(wait_us.max(0) as u64);
            let (decider, decider_key) = self.decider(deciding);
            if allowed {
                for (limiter, _) in &self.limits {
                    limiter.metrics.decided(true);
                    limiter.outcomes.admitted();
                }
                drop(head);
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
                return Ok(Decision::new(true, remaining, 0, decider.policy.limit()));
            }
            if wait.is_zero() || wait > left {
                return Err(self.timed_out(decider, decider_key.unwrap_or(key), timeout));
            }
            // Refused within the caller's wait: a limit is paused until
            // then (or the limits did not settle on an instant): again then.
            tokio::time::sleep(wait).await;
        }
    }

    /// A waiting acquire's answer when its wait would pass `timeout` (the
    /// longest wait when none), naming `limiter` and its `key`: every limit's
    /// metrics count it as refused, `limiter`'s outcome counter as timed out.
    fn timed_out(&self, limiter: &Limiter, key: &str, timeout: Option<Duration>) -> Error {
        for (other, _) in &self.limits {
            other.metrics.decided(false);
        }
        limiter.outcomes.timed_out();
        Error::Timeout {
            waited_for: WaitedFor::RateLimit {
                limiter: limiter.name.clone(),
                key: key.to_owned(),
            },
            timeout: timeout.unwrap_or(MAX_RATE_WAIT),
        }
    }

    /// The set's first limiter: its pool carries the statement.
    fn first(&self) -> Result<&Arc<Limiter>> {
        let Some((first, _)) = self.limits.first() else {
            return Err(Error::invalid(
                "limits",
                "the set is empty: add limits with `.with(&limiter)`",
            ));
        };
        Ok(first)
    }

    /// 55P03 (a key's lock held past the functions' 2 s `lock_timeout`) as
    /// [`Error::Stalled`] naming the set's limiters; any other error as it is.
    fn stalled(&self, error: Error) -> Error {
        if crate::error::sqlstate(&error).as_deref() == Some("55P03") {
            let names: Vec<&str> = self.limits.iter().map(|(l, _)| l.name.as_str()).collect();
            return Error::Stalled {
                semaphore: names.join(", "),
            };
        }
        error
    }

    /// Whether an unreachable database admits: only if every limiter fails open.
    fn fails_open(&self) -> bool {
        self.limits.iter().all(|(l, _)| l.fail_open)
    }

    /// The limiter that decided (`deciding`, from 1, as the database
    /// answers), and its own key if it has one.
    fn decider(&self, deciding: i32) -> (&Arc<Limiter>, Option<&str>) {
        usize::try_from(deciding - 1)
            .ok()
            .and_then(|i| self.limits.get(i))
            .or_else(|| self.limits.first())
            .map(|(limiter, own_key)| (limiter, own_key.as_deref()))
            .expect("a set is checked only when it has limits")
    }

    /// `sql` (check_limits, or check_limits_reserve without its last
    /// argument) with the set's arrays and `permits` bound.
    fn statement(
        &self,
        sql: &'static str,
        key: &str,
        permits: u32,
    ) -> Result<Statement<(bool, i64, i64, i32)>> {
        let first = self.first()?;
        if self.limits.len() > MAX_LIMITS {
            return Err(Error::invalid(
                "limits",
                format!("{} limits; at most {MAX_LIMITS}", self.limits.len()),
            ));
        }
        let limits = self
            .limits
            .iter()
            .map(|(limiter, own_key)| (limiter, own_key.as_deref().unwrap_or(key)));
        let arrays = LimitArrays::new(limits, permits)?;
        Ok(arrays
            .bind(first.db.query_as::<(bool, i64, i64, i32)>(sql))
            .bind(i64::from(permits)))
    }
}

/// The seven arrays `pgsemaphore.check_limits` (and `claim_all`'s rate
/// limits) take, one element per limit, in the caller's order.
pub(crate) struct LimitArrays {
    kinds: Vec<&'static str>,
    names: Vec<String>,
    keys: Vec<String>,
    rates: Vec<Option<f64>>,
    bursts: Vec<Option<f64>>,
    limits: Vec<Option<i64>>,
    windows: Vec<Option<sqlx::postgres::types::PgInterval>>,
}

impl LimitArrays {
    /// The arrays of `limits` (each limiter with the key it is checked on),
    /// after the checks every request for `permits` passes: at most
    /// [`MAX_LIMITS`] limits, all on one pool, each key valid.
    pub(super) fn new<'a>(
        limits: impl ExactSizeIterator<Item = (&'a Arc<Limiter>, &'a str)>,
        permits: u32,
    ) -> Result<LimitArrays> {
        let count = limits.len();
        if count > MAX_LIMITS {
            return Err(Error::invalid(
                "limits",
                format!("{count} limits; at most {MAX_LIMITS}"),
            ));
        }
        let mut arrays = LimitArrays {
            kinds: Vec::with_capacity(count),
            names: Vec::with_capacity(count),
            keys: Vec::with_capacity(count),
            rates: Vec::with_capacity(count),
            bursts: Vec::with_capacity(count),
            limits: Vec::with_capacity(count),
            windows: Vec::with_capacity(count),
        };
        let mut options = None;
        for (limiter, key) in limits {
            let own = limiter.db.pool().connect_options();
            if !Arc::ptr_eq(options.get_or_insert_with(|| own.clone()), &own) {
                return Err(Error::invalid(
                    "limits",
                    "the limiters of a set must be built on the same pool",
                ));
            }
            limiter.request(key, permits)?;
            arrays.kinds.push(limiter.policy.kind().as_str());
            arrays.names.push(limiter.name.clone());
            arrays.keys.push(key.to_owned());
            let (rate, burst, limit, window) = limiter.policy.sql_limits()?.columns();
            arrays.rates.push(rate);
            arrays.bursts.push(burst);
            arrays.limits.push(limit);
            arrays.windows.push(window);
        }
        Ok(arrays)
    }

    /// `query` with the seven arrays bound as its next seven parameters.
    pub(crate) fn bind<O>(self, query: Statement<O>) -> Statement<O> {
        query
            .bind(self.kinds)
            .bind(self.names)
            .bind(self.keys)
            .bind(self.rates)
            .bind(self.bursts)
            .bind(self.limits)
            .bind(self.windows)
    }
}

/// The rate limits a semaphore claim charges in its own transaction
/// ([`Acquiring::rate_limit`](crate::Acquiring::rate_limit)): one permit of
/// each limiter on its key.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClaimRates {
    limits: Vec<(Arc<Limiter>, String)>,
}

impl ClaimRates {
    pub(crate) fn push(&mut self, limiter: &RateLimiter, key: String) {
        self.limits.push((limiter.inner.clone(), key));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// The arrays of `claim_all`'s `p_rate_*` arguments, after the checks a
    /// check of one permit passes; `pool` is the semaphores' (a claim is one
    /// transaction of one database).
    pub(crate) fn arrays(&self, pool: &sqlx::PgPool) -> Result<LimitArrays> {
        if let Some((limiter, _)) = self.limits.first()
            && !Arc::ptr_eq(
                &limiter.db.pool().connect_options(),
                &pool.connect_options(),
            )
        {
            return Err(Error::invalid(
                "rate_limit",
                format!(
                    "rate limiter {:?} was built on another pool than the semaphores: a claim is one \
                     transaction of one database, so build every handle on the same client",
                    limiter.name
                ),
            ));
        }
        LimitArrays::new(self.limits.iter().map(|(l, key)| (l, key.as_str())), 1)
    }

    /// Counts a claim's decision in the limiters' metrics and outcome
    /// counters: every limit admitted (`refusing` `None`), or limit
    /// `refusing` (from 1) refused. (A claim a semaphore refused never
    /// asked the limits: nothing to count.)
    pub(crate) fn count(&self, refusing: Option<i32>) {
        match refusing {
            None => {
                for (limiter, _) in &self.limits {
                    limiter.metrics.decided(true);
                    limiter.outcomes.admitted();
                }
            }
            Some(index) => {
                let index = usize::try_from(index.saturating_sub(1)).unwrap_or(0);
                if let Some((limiter, _)) = self.limits.get(index) {
                    limiter.metrics.decided(false);
                    limiter.outcomes.refused();
                }
            }
        }
    }

    /// The name of limit `index` (from 1, as the database answers), if any.
    pub(crate) fn name(&self, index: i32) -> Option<&str> {
        let index = usize::try_from(index.checked_sub(1)?).ok()?;
        self.limits
            .get(index)
            .map(|(limiter, _)| limiter.name.as_str())
    }
}
