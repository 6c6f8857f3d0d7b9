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
