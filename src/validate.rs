//! Checks on caller input, made before anything is sent to the database.

use std::ops::RangeInclusive;
use std::time::Duration;

use sqlx::postgres::types::PgInterval;

use crate::error::{Error, Result};

/// A label stored as PostgreSQL text: 1 to `max_chars` characters, no NUL
/// (PostgreSQL text cannot store it).
pub(crate) fn text(argument: &'static str, value: &str, max_chars: usize) -> Result<()> {
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
pub(crate) fn interval(
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
