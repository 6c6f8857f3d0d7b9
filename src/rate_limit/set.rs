//! Several limits in one check ([`LimiterSet`]): one call of
//! `pgsemaphore.check_limits`, which checks each limit with its own
//! function, in a canonical order, and charges all or none (its header
//! states the invariant and what it meets).

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::types::PgInterval;

use super::{Decision, FixedWindow, Limiter, Policy, SlidingWindow, TokenBucket};
use crate::error::{Error, Result};
use crate::validate::{self, MAX_LIMITS};

/// `$8` permits against every limit `i` (kind `$1[i]`, limiter `$2[i]`, key
/// `$3[i]`, with the token bucket's `$4[i]`, `$5[i]` or the window's `$6[i]`,
/// `$7[i]`): all admit and are charged, or none is.
const CHECK_LIMITS: &str = "SELECT o_allowed, o_remaining, o_retry_after_us, o_deciding \
                            FROM pgsemaphore.check_limits(p_kinds => $1, p_limiters => $2, \
                                p_keys => $3, p_rates => $4, p_bursts => $5, p_limits => $6, \
                                p_windows => $7, p_n => $8)";

mod sealed {
    /// The limiters a [`LimiterSet`](super::LimiterSet) takes.
    pub trait Sealed {
        /// The shared engine.
        #[allow(private_interfaces)]
        fn limiter(&self) -> &std::sync::Arc<super::Limiter>;
    }
}

/// A rate limiter that a [`LimiterSet`] can check with others:
/// [`TokenBucket`], [`FixedWindow`], [`SlidingWindow`]. Sealed.
pub trait RateLimiter: sealed::Sealed {}

macro_rules! set_member {
    ($limiter:ident) => {
        impl sealed::Sealed for $limiter {
            #[allow(private_interfaces)]
            fn limiter(&self) -> &Arc<Limiter> {
                &self.inner
            }
        }
        impl RateLimiter for $limiter {}
    };
}

set_member!(TokenBucket);
set_member!(FixedWindow);
set_member!(SlidingWindow);

/// Several rate limits checked as one: admitted only if every limit admits,
/// and then charged to every one; refused if any refuses, and then charged
/// to none, with the longest retry-after of the limits that refused.
///
/// For example 100 per second, 1,000 per hour and 10,000 per day on the
/// same key, or a per-key limit and a global one (a limit added with
/// [`with_key`](Self::with_key) always checks that key). One round trip:
/// the database locks the limits' rows in one canonical order (two sets
/// never deadlock, whatever order they list their limits in) and checks
/// each with its own limiter's function, so stored limits and pauses apply
/// as in a single [`check`](TokenBucket::check).
///
/// ```no_run
/// use std::time::Duration;
/// use pg_semaphore::{FixedWindow, LimiterSet, TokenBucket};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// let per_second = TokenBucket::builder("api-s").rate(100.0).burst(100).build(&pool)?;
/// let per_day = FixedWindow::builder("api-day")
///     .permit_limit(10_000)
///     .window(Duration::from_secs(86_400))
///     .build(&pool)?;
/// let everyone = TokenBucket::builder("api-all").rate(5_000.0).burst(5_000).build(&pool)?;
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
    pub fn with(mut self, limiter: &impl RateLimiter) -> LimiterSet {
        self.limits.push((limiter.limiter().clone(), None));
        self
    }

    /// Adds `limiter`, always checked on `key` (a global limit: `"all"`).
    pub fn with_key(mut self, limiter: &impl RateLimiter, key: impl Into<String>) -> LimiterSet {
        self.limits
            .push((limiter.limiter().clone(), Some(key.into())));
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
    ///   [`MAX_LIMITS`](crate::MAX_LIMITS) limits (`limits`), limiters built
    ///   on different pools (`limits`), the same key of the same limiter
    ///   twice (`limits`, from the database), and as each limiter's
    ///   [`check`](TokenBucket::check) for the key and `permits`.
    /// - [`Error::MigrationsMissing`] when the schema is older than version
    ///   9 (no `check_limits`) or missing.
    /// - [`Error::Database`] otherwise, unless every limiter of the set
    ///   fails open (then an unreachable database admits, as `check` does).
    ///
    /// # Cancel safety
    ///
    /// One statement: if cancelled, the check either happened (every limit
    /// charged) or did not.
    pub async fn check(&self, key: &str, permits: u32) -> Result<Decision> {
        let Some((first, _)) = self.limits.first() else {
            return Err(Error::invalid(
                "limits",
                "the set is empty: add limits with `.with(&limiter)`",
            ));
        };
        if self.limits.len() > MAX_LIMITS {
            return Err(Error::invalid(
                "limits",
                format!("{} limits; at most {MAX_LIMITS}", self.limits.len()),
            ));
        }
        let options = first.db.pool().connect_options();
        let mut kinds = Vec::with_capacity(self.limits.len());
        let mut names = Vec::with_capacity(self.limits.len());
        let mut keys = Vec::with_capacity(self.limits.len());
        let mut rates = Vec::with_capacity(self.limits.len());
        let mut bursts = Vec::with_capacity(self.limits.len());
        let mut limits = Vec::with_capacity(self.limits.len());
        let mut windows = Vec::with_capacity(self.limits.len());
        for (limiter, own_key) in &self.limits {
            if !Arc::ptr_eq(&limiter.db.pool().connect_options(), &options) {
                return Err(Error::invalid(
                    "limits",
                    "the limiters of a set must be built on the same pool",
                ));
            }
            let key = own_key.as_deref().unwrap_or(key);
            limiter.request(key, permits)?;
            kinds.push(limiter.policy.kind());
            names.push(limiter.name.clone());
            keys.push(key.to_owned());
            let (rate, burst, limit, window): (_, _, _, Option<PgInterval>) = match limiter.policy {
                Policy::TokenBucket { rate, burst } => {
                    (Some(rate), Some(f64::from(burst)), None, None)
                }
                Policy::FixedWindow { limit, window } | Policy::SlidingWindow { limit, window } => {
                    (
                        None,
                        None,
                        Some(i64::from(limit)),
                        Some(validate::window(window)?),
                    )
                }
            };
            rates.push(rate);
            bursts.push(burst);
            limits.push(limit);
            windows.push(window);
        }
        let db = &first.db;
        let query = db
            .query_as::<(bool, i64, i64, i32)>(CHECK_LIMITS)
            .bind(kinds)
            .bind(names)
            .bind(keys)
            .bind(rates)
            .bind(bursts)
            .bind(limits)
            .bind(windows)
            .bind(i64::from(permits));
        match db.fetch_one(query).await {
            Ok((allowed, remaining, retry_after_us, deciding)) => {
                for (limiter, _) in &self.limits {
                    limiter.metrics.decided(allowed);
                }
                let decider = usize::try_from(deciding - 1)
                    .ok()
                    .and_then(|i| self.limits.get(i))
                    .map_or(first, |(limiter, _)| limiter);
                Ok(Decision {
                    allowed,
                    remaining: u32::try_from(remaining.max(0)).unwrap_or(u32::MAX),
                    retry_after: Duration::from_micros(retry_after_us.max(0) as u64),
                    limit: decider.policy.limit(),
                    failed_open: false,
                })
            }
            Err(error) if self.limits.iter().all(|(l, _)| l.fail_open) => first.failed(error).await,
            Err(error) => Err(error),
        }
    }
}
