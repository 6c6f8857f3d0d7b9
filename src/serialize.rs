//! `Serialize` for the data users log or ship (feature `serde`).
//!
//! One convention for every type: field names as in the struct unless a
//! JSON reader would misread them, times as RFC 3339 strings (chrono's
//! format), durations as seconds (`f64`) in fields whose names end in
//! `_seconds`, outcomes in `snake_case`. The `pg-semaphore` CLI prints these
//! shapes with `--json`. Most types derive `Serialize` with attributes at
//! their fields, which use the helpers here; the three whose fields depend
//! on their kind or that add computed fields ([`Holder`](crate::audit::Holder),
//! [`Summary`](crate::audit::Summary), [`SemaphoreInfo`](crate::admin::SemaphoreInfo))
//! are written out beside their types. This module depends on none of them.

use std::time::Duration;

use chrono::TimeDelta;
use serde::ser::Serializer;

/// A duration as seconds.
pub(crate) fn seconds<S: Serializer>(
    duration: &Duration,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(duration.as_secs_f64())
}

/// An optional duration as seconds, or `null`.
pub(crate) fn opt_seconds<S: Serializer>(
    duration: &Option<Duration>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match duration {
        Some(d) => serializer.serialize_some(&d.as_secs_f64()),
        None => serializer.serialize_none(),
    }
}

/// A signed time difference as seconds (microsecond precision, as stored).
pub(crate) fn delta_seconds(delta: TimeDelta) -> Option<f64> {
    delta.num_microseconds().map(|us| us as f64 / 1e6)
}

/// A time written in RFC 3339, for the tests that pin the JSON of the
/// types.
#[cfg(test)]
pub(crate) fn at(text: &str) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::parse_from_rfc3339(text)
        .unwrap()
        .with_timezone(&chrono::Utc)
}
