//! Parsing what an operator types: durations (`90s`, `1h30m`), times (RFC
//! 3339, `now`, or a duration ago) and the time window they make.

use std::ops::Range;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::render::{human, rfc3339};

/// Parses `500ms`, `90s`, `15m`, `1h30m`, `7d`, `2w`: one or more
/// number-unit pairs.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || {
        format!(
            "invalid duration {text:?}: use a number and a unit (ms, s, m, h, d, w), e.g. 90s, 15m, 1h30m, 7d"
        )
    };
    let text = text.trim();
    if text.is_empty() {
        return Err(invalid());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(invalid)?;
        if digits == 0 {
            return Err(invalid());
        }
        let number: u64 = rest[..digits].parse().map_err(|_| invalid())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit_secs: u64 = match &rest[..unit_len] {
            "ms" => {
                total = total
                    .checked_add(Duration::from_millis(number))
                    .ok_or_else(invalid)?;
                rest = &rest[unit_len..];
                continue;
            }
            "s" | "sec" | "secs" => 1,
            "m" | "min" | "mins" => 60,
            "h" | "hour" | "hours" => 3600,
            "d" | "day" | "days" => 86_400,
            "w" | "week" | "weeks" => 7 * 86_400,
            _ => return Err(invalid()),
        };
        let secs = number.checked_mul(unit_secs).ok_or_else(invalid)?;
        total = total
            .checked_add(Duration::from_secs(secs))
            .ok_or_else(invalid)?;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// Parses an RFC 3339 time, `now`, or a duration meaning that long ago.
pub(crate) fn parse_time(text: &str) -> Result<DateTime<Utc>, String> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("now") {
        return Ok(Utc::now());
    }
    if let Ok(at) = DateTime::parse_from_rfc3339(text) {
        return Ok(at.with_timezone(&Utc));
    }
    match parse_duration(text) {
        Ok(ago) => TimeDelta::from_std(ago)
            .ok()
            .and_then(|ago| Utc::now().checked_sub_signed(ago))
            .ok_or_else(|| format!("{text:?} is too long ago")),
        Err(_) => Err(format!(
            "invalid time {text:?}: use an RFC 3339 time (2026-11-21T08:00:00Z), \
             a duration ago (2h, 1d) or `now`"
        )),
    }
}

/// The window `--last`, or `--since` and `--until`, describe at `now`: the
/// last `last`, else `since..until` where `until` defaults to `now` and
/// `since` to an hour before `until`. The message says what is wrong.
pub(crate) fn window(
    last: Option<Duration>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> Result<Range<DateTime<Utc>>, String> {
    let (since, until) = match last {
        Some(last) => {
            let delta =
                TimeDelta::from_std(last).map_err(|_| format!("{} is too long", human(last)))?;
            let since = now
                .checked_sub_signed(delta)
                .ok_or_else(|| format!("--last {} reaches before year 1", human(last)))?;
            (since, now)
        }
        None => {
            let until = until.unwrap_or(now);
            (since.unwrap_or(until - TimeDelta::hours(1)), until)
        }
    };
    if until < since {
        return Err(format!(
            "the window ends ({}) before it starts ({})",
            rfc3339(until),
            rfc3339(since)
        ));
    }
    Ok(since..until)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("2w"), Ok(Duration::from_secs(14 * 86_400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in ["", "h", "10", "10x", "-5m", "1.5h", "99999999999999999999w"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
        // Each term fits, their sum does not.
        for bad in ["18446744073709551615s1000ms", "1w18446744073709551615s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn times_parse() {
        assert_eq!(
            parse_time("2026-11-21T08:00:00Z").unwrap(),
            DateTime::parse_from_rfc3339("2026-11-21T08:00:00+00:00").unwrap()
        );
        let before = Utc::now();
        let ago = parse_time("2h").unwrap();
        let after = Utc::now();
        let two_hours = TimeDelta::hours(2);
        assert!(before - two_hours <= ago && ago <= after - two_hours);
        assert!(parse_time("yesterday").is_err());
    }

    #[test]
    fn windows_default_to_the_last_hour() {
        let now = parse_time("2026-11-21T09:00:00Z").unwrap();
        let at = |t: &str| parse_time(t).unwrap();
        let hour_ago = at("2026-11-21T08:00:00Z");
        assert_eq!(window(None, None, None, now), Ok(hour_ago..now));
        assert_eq!(
            window(Some(Duration::from_secs(900)), None, None, now),
            Ok(at("2026-11-21T08:45:00Z")..now)
        );
        assert_eq!(
            window(None, None, Some(hour_ago), now),
            Ok(at("2026-11-21T07:00:00Z")..hour_ago)
        );
        let ends_first = window(None, Some(now), Some(hour_ago), now).unwrap_err();
        assert!(ends_first.contains("before it starts"), "{ends_first}");
        let too_long = window(Some(Duration::from_secs(u64::MAX)), None, None, now).unwrap_err();
        assert!(too_long.contains("too long"), "{too_long}");
    }
}
