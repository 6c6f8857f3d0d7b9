//! The limits on caller input, and their checks, in one place: each limit
//! a constant here (the public ones re-exported at the crate's root), each
//! kind of argument checked by one function here, before anything is sent
//! to the database. The SQL functions check the same limits again: they
//! are the security boundary; these checks give the caller a precise error
//! without a round trip.

use std::ops::{Range, RangeInclusive};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::types::PgInterval;

use crate::error::{Error, Result};

/// The largest capacity a semaphore may have (a CHECK constraint enforces it too).
pub const MAX_CAPACITY: u32 = 100_000;

/// The longest semaphore name, in characters.
pub const MAX_NAME_LEN: usize = 200;

/// The longest holder label, in characters.
pub const MAX_HOLDER_LEN: usize = 1000;

/// The longest fairness key ([`Acquiring::fairness_key`](crate::Acquiring::fairness_key)), in characters.
pub const MAX_FAIRNESS_KEY_LEN: usize = 200;

/// The most semaphores one [`Semaphore::acquire_all`](crate::Semaphore::acquire_all)
/// (or `pgsemaphore.claim_all`) claims together.
pub const MAX_SEMAPHORES_PER_CLAIM: usize = 16;

/// The largest weight of a fairness key ([`set_fairness_weight`](crate::admin::set_fairness_weight)).
pub const MAX_FAIRNESS_WEIGHT: u32 = 1000;
/// The longest semaphore family name ([`SemaphoreFamily`](crate::SemaphoreFamily)),
/// in characters (letters, digits, `_`, `.`, `:`, `-`).
pub const MAX_FAMILY_NAME_LEN: usize = 64;

/// The longest key of a semaphore family, in characters.
pub const MAX_FAMILY_KEY_LEN: usize = 128;

/// The longest tier name of a semaphore family, in characters.
pub const MAX_TIER_LEN: usize = 64;

/// The longest `idle_after` of a semaphore family (366 days).
pub const MAX_IDLE_AFTER: Duration = Duration::from_secs(366 * 24 * 60 * 60);

/// The shortest lease a permit may have.
pub const MIN_LEASE: Duration = Duration::from_millis(10);

/// The longest lease a permit may have (366 days).
pub const MAX_LEASE: Duration = Duration::from_secs(366 * 24 * 60 * 60);

/// The longest rate limiter key (per user, per IP, ...), in characters.
pub const MAX_KEY_LEN: usize = 256;

/// The highest token bucket rate, in tokens per second (far above any real
/// limit; higher rates would overflow the refill arithmetic).
pub const MAX_RATE: f64 = 1e9;

/// The shortest window of a fixed or sliding window
/// [`RatePolicy`](crate::RatePolicy).
pub const MIN_WINDOW: Duration = Duration::from_millis(1);

/// The longest window of a fixed or sliding window
/// [`RatePolicy`](crate::RatePolicy) (366 days), and the longest time a
/// token bucket may take to refill from empty.
pub const MAX_WINDOW: Duration = Duration::from_secs(366 * 24 * 60 * 60);

/// The longest a [`RateLimiter::acquire`](crate::RateLimiter::acquire)
/// reserves ahead (366 days): a wait the key's tokens would take longer to
/// cover is refused, and a longer timeout waits at most this.
pub const MAX_RATE_WAIT: Duration = Duration::from_secs(366 * 24 * 60 * 60);

/// The longest a rate limiter's pause may reach ahead of now (1 hour):
/// [`RateLimiter::pause`](crate::RateLimiter::pause) and its kin pause a key
/// for 1 ms to this long; a longer pause is refused (an upstream's
/// `Retry-After` beyond an hour is better served by an operator).
pub const MAX_PAUSE: Duration = Duration::from_secs(3600);

/// The most limits one [`LimiterSet`](crate::LimiterSet) checks at once.
pub const MAX_LIMITS: usize = 16;

/// The longest age a cleanup accepts (100 years): a retention, the
/// `older_than` of finished claims, the `idle_for` of rate limiter keys.
const MAX_AGE: Duration = Duration::from_secs(100 * 366 * 24 * 60 * 60);

/// A semaphore's (or a rate limiter's) name.
pub(crate) fn name(name: &str) -> Result<()> {
    text("name", name, MAX_NAME_LEN)
}

/// The semaphores of a multi-limit claim: 1 to [`MAX_SEMAPHORES_PER_CLAIM`]
/// distinct names, each with 1 to [`MAX_CAPACITY`] permits.
pub(crate) fn several<'a>(members: impl ExactSizeIterator<Item = (&'a str, u32)>) -> Result<()> {
    let count = members.len();
    if count == 0 || count > MAX_SEMAPHORES_PER_CLAIM {
        return Err(Error::invalid(
            "semaphores",
            format!("{count} semaphores: a claim takes 1 to {MAX_SEMAPHORES_PER_CLAIM}"),
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for (name, permits) in members {
        if !seen.insert(name) {
            return Err(Error::invalid(
                "semaphores",
                format!(
                    "semaphore {name:?} named twice: name it once, with the sum of its permits"
                ),
            ));
        }
        if permits == 0 || permits > MAX_CAPACITY {
            return Err(Error::invalid(
                "permits",
                format!("{permits} permits of {name:?}: each count is 1 to {MAX_CAPACITY}"),
            ));
        }
    }
    Ok(())
}

/// A holder label.
pub(crate) fn holder(holder: &str) -> Result<()> {
    text("holder", holder, MAX_HOLDER_LEN)
}

/// A fairness key: 1 to [`MAX_FAIRNESS_KEY_LEN`] characters, no NUL.
pub(crate) fn fairness_key(key: &str) -> Result<()> {
    text("fairness_key", key, MAX_FAIRNESS_KEY_LEN)
}

/// A fairness key's weight: 1 to [`MAX_FAIRNESS_WEIGHT`].
pub(crate) fn fairness_weight(weight: u32) -> Result<()> {
    if (1..=MAX_FAIRNESS_WEIGHT).contains(&weight) {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            argument: "weight",
            reason: format!("must be 1 to {MAX_FAIRNESS_WEIGHT}, got {weight}"),
        })
    }
}

/// A rate limiter key.
pub(crate) fn key(key: &str) -> Result<()> {
    text("key", key, MAX_KEY_LEN)
}

/// A family's name: 1 to [`MAX_FAMILY_NAME_LEN`] characters of
/// `A-Z a-z 0-9 _ . : -` (no `/`: a key's semaphore is named
/// `@family/key`, and that name must say where the family ends).
pub(crate) fn family(family: &str) -> Result<()> {
    text("family", family, MAX_FAMILY_NAME_LEN)?;
    if let Some(c) = family
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')))
    {
        return Err(Error::invalid(
            "family",
            format!(
                "contains {c:?}: a family name has only letters, digits, '_', '.', ':' and '-'"
            ),
        ));
    }
    Ok(())
}

/// A key of a family: 1 to [`MAX_FAMILY_KEY_LEN`] characters, no NUL.
pub(crate) fn family_key(key: &str) -> Result<()> {
    text("key", key, MAX_FAMILY_KEY_LEN)
}

/// A tier of a family: 1 to [`MAX_TIER_LEN`] characters, no NUL.
pub(crate) fn tier(tier: &str) -> Result<()> {
    text("tier", tier, MAX_TIER_LEN)
}

/// A family's `idle_after`, zero to [`MAX_IDLE_AFTER`], as an SQL interval.
pub(crate) fn idle_after(idle_after: Duration) -> Result<PgInterval> {
    interval("idle_after", idle_after, Duration::ZERO..=MAX_IDLE_AFTER)
}

/// A semaphore's capacity: 1 to [`MAX_CAPACITY`].
pub(crate) fn capacity(capacity: u32) -> Result<()> {
    if capacity == 0 || capacity > MAX_CAPACITY {
        return Err(Error::invalid(
            "capacity",
            format!("{capacity} is out of range: a semaphore has 1 to {MAX_CAPACITY} slots"),
        ));
    }
    Ok(())
}

/// A semaphore's reserve ([`SemaphoreBuilder::reserved`](crate::SemaphoreBuilder::reserved)):
/// below its capacity, so that low-priority claims have a slot.
pub(crate) fn reserve(reserved: u32, capacity: u32) -> Result<()> {
    if reserved >= capacity {
        return Err(Error::invalid(
            "reserved",
            format!(
                "{reserved} reserved slots leave none to low-priority claims: reserve fewer than the capacity ({capacity})"
            ),
        ));
    }
    Ok(())
}

/// A lease, [`MIN_LEASE`] to [`MAX_LEASE`], as an SQL interval.
pub(crate) fn lease(lease: Duration) -> Result<PgInterval> {
    interval("lease", lease, MIN_LEASE..=MAX_LEASE)
}

/// A rate limiter's window, [`MIN_WINDOW`] to [`MAX_WINDOW`], as an SQL
/// interval.
/// A span of time to read (an audit window, the outcome counters' minutes):
/// it may be empty, never reversed.
pub(crate) fn time_range(window: &Range<DateTime<Utc>>) -> Result<()> {
    if window.end < window.start {
        return Err(Error::invalid(
            "window",
            format!("ends ({}) before it starts ({})", window.end, window.start),
        ));
    }
    Ok(())
}

pub(crate) fn window(window: Duration) -> Result<PgInterval> {
    interval("window", window, MIN_WINDOW..=MAX_WINDOW)
}

/// The longest a token bucket reservation may wait, as an SQL interval: the
/// caller's timeout, at most [`MAX_RATE_WAIT`] (a longer one cannot be
/// reserved anyway).
pub(crate) fn rate_wait(timeout: Duration) -> Result<PgInterval> {
    interval(
        "timeout",
        timeout.min(MAX_RATE_WAIT),
        Duration::ZERO..=MAX_RATE_WAIT,
    )
}

/// A rate limiter's pause, 1 ms to [`MAX_PAUSE`], as an SQL interval.
pub(crate) fn pause(pause: Duration) -> Result<PgInterval> {
    interval("duration", pause, Duration::from_millis(1)..=MAX_PAUSE)
}

/// An age for a cleanup (a retention, an idle time), zero to 100 years, as
/// an SQL interval.
pub(crate) fn age(argument: &'static str, age: Duration) -> Result<PgInterval> {
    interval(argument, age, Duration::ZERO..=MAX_AGE)
}

/// A [`ReportShape`](crate::audit::ReportShape): 1 to 10,000 time buckets, 1 to
/// 1,000 hold-time bins (a report holds about lanes x buckets cells), at
/// least one lane.
pub(crate) fn report_shape(buckets: u32, hold_time_bins: u32, max_lanes: u32) -> Result<()> {
    for (argument, value, max) in [
        ("buckets", buckets, 10_000),
        ("hold_time_bins", hold_time_bins, 1_000),
        ("max_lanes", max_lanes, u32::MAX),
    ] {
        if value == 0 || value > max {
            return Err(Error::invalid(
                argument,
                format!("{value} is out of range: 1 to {max}"),
            ));
        }
    }
    Ok(())
}

/// A count that must be at least 1 (permits, a limit, a burst, connections).
pub(crate) fn positive(argument: &'static str, count: u64) -> Result<()> {
    if count == 0 {
        return Err(Error::invalid(argument, "must be at least 1"));
    }
    Ok(())
}

/// An interval that must not be zero (a heartbeat, a fallback re-check, a
/// reaper's round).
pub(crate) fn nonzero(argument: &'static str, interval: Duration) -> Result<()> {
    if interval.is_zero() {
        return Err(Error::invalid(argument, "must be greater than zero"));
    }
    Ok(())
}

/// A label stored as PostgreSQL text: 1 to `max_chars` characters, no NUL
/// (PostgreSQL text cannot store it).
fn text(argument: &'static str, value: &str, max_chars: usize) -> Result<()> {
    let chars = value.chars().count();
    if chars == 0 {
        return Err(Error::invalid(argument, "must not be empty"));
    }
    if chars > max_chars {
        return Err(Error::invalid(
            argument,
            format!("is {chars} characters long; at most {max_chars} are allowed"),
        ));
    }
    if value.contains('\0') {
        return Err(Error::invalid(
            argument,
            "must not contain NUL characters (PostgreSQL text cannot store them)",
        ));
    }
    Ok(())
}

/// A duration within `range`, as an SQL interval.
fn interval(
    argument: &'static str,
    value: Duration,
    range: RangeInclusive<Duration>,
) -> Result<PgInterval> {
    if !range.contains(&value) {
        return Err(Error::invalid(
            argument,
            format!(
                "{value:?} is out of range: {:?} to {:?}",
                range.start(),
                range.end()
            ),
        ));
    }
    Ok(PgInterval {
        months: 0,
        days: 0,
        // Every range used here ends well below i64::MAX microseconds
        // (100 years is about 3.2e15).
        microseconds: value.as_micros() as i64,
    })
}

/// JSON stored as `jsonb`: no NUL character in any string or key
/// (PostgreSQL text cannot store it, and would refuse the whole claim).
pub(crate) fn json(argument: &'static str, value: &serde_json::Value) -> Result<()> {
    fn has_nul(value: &serde_json::Value) -> bool {
        match value {
            serde_json::Value::String(s) => s.contains('\0'),
            serde_json::Value::Array(items) => items.iter().any(has_nul),
            serde_json::Value::Object(map) => map
                .iter()
                .any(|(key, value)| key.contains('\0') || has_nul(value)),
            _ => false,
        }
    }
    if has_nul(value) {
        return Err(Error::invalid(
            argument,
            "must not contain NUL characters (\\u0000) in any string or key: \
             PostgreSQL jsonb cannot store them",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_needs_one_to_max_characters_and_no_nul() {
        assert!(text("name", "a", 3).is_ok());
        assert!(text("name", "äöü", 3).is_ok(), "characters, not bytes");
        for bad in ["", "abcd", "a\0b"] {
            assert!(matches!(
                text("name", bad, 3),
                Err(Error::InvalidArgument {
                    argument: "name",
                    ..
                })
            ));
        }
    }

    #[test]
    fn intervals_outside_the_range_name_the_argument() {
        let range = Duration::from_millis(10)..=Duration::from_secs(60);
        let one = interval("lease", Duration::from_secs(1), range.clone()).unwrap();
        assert_eq!(one.microseconds, 1_000_000);
        for bad in [Duration::ZERO, Duration::from_secs(61), Duration::MAX] {
            assert!(matches!(
                interval("lease", bad, range.clone()),
                Err(Error::InvalidArgument {
                    argument: "lease",
                    ..
                })
            ));
        }
    }

    #[test]
    fn json_with_nul_anywhere_is_refused() {
        let fine = serde_json::json!({ "route": "/charge", "ids": [1, "two"] });
        assert!(json("metadata", &fine).is_ok());
        for bad in [
            serde_json::json!("a\u{0}b"),
            serde_json::json!({ "k\u{0}": 1 }),
            serde_json::json!({ "deep": [{ "x": "\u{0}" }] }),
        ] {
            assert!(matches!(
                json("metadata", &bad),
                Err(Error::InvalidArgument {
                    argument: "metadata",
                    ..
                })
            ));
        }
    }
}
