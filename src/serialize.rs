//! `Serialize` for the data users log or ship (feature `serde`).
//!
//! One convention for every type: field names as in the struct unless a
//! JSON reader would misread them, times as RFC 3339 strings (chrono's
//! format), durations as seconds (`f64`) in fields whose names end in
//! `_seconds`, outcomes in `snake_case`. The `pg-semaphore` CLI prints these
//! shapes with `--json`. Most types derive `Serialize` with attributes at
//! their fields; the two that add computed fields are written out here.

use std::time::Duration;

use chrono::TimeDelta;
use serde::ser::{Serialize, SerializeStruct, Serializer};

use crate::admin::{AdvisorySemaphoreInfo, SemaphoreInfo};
use crate::audit::{Holder, Summary};

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
fn delta_seconds(delta: TimeDelta) -> Option<f64> {
    delta.num_microseconds().map(|us| us as f64 / 1e6)
}

/// Adds `total`.
impl Serialize for Summary {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
        let mut s = serializer.serialize_struct("Summary", 7)?;
        s.serialize_field("total", &self.total())?;
        s.serialize_field("completed", &self.completed)?;
        s.serialize_field("timed_out", &self.timed_out)?;
        s.serialize_field("live", &self.live)?;
        s.serialize_field("p50_hold_seconds", &secs(self.p50_hold))?;
        s.serialize_field("p95_hold_seconds", &secs(self.p95_hold))?;
        s.serialize_field("max_hold_seconds", &secs(self.max_hold))?;
        s.end()
    }
}

/// Adds `held`, and each holder's age and lease left at `as_of`: the
/// database clock, the one leases are measured on.
impl Serialize for SemaphoreInfo {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(serde::Serialize)]
        struct SeenHolder<'a> {
            #[serde(flatten)]
            holder: &'a Holder,
            age_seconds: Option<f64>,
            lease_left_seconds: Option<f64>,
        }
        let holders: Vec<SeenHolder<'_>> = self
            .holders
            .iter()
            .map(|holder| SeenHolder {
                holder,
                age_seconds: delta_seconds(self.as_of - holder.created_at),
                lease_left_seconds: delta_seconds(holder.expires_at - self.as_of),
            })
            .collect();
        let mut s = serializer.serialize_struct("SemaphoreInfo", 8)?;
        s.serialize_field("name", &self.name)?;
        s.serialize_field("capacity", &self.capacity)?;
        s.serialize_field("held", &self.holders.len())?;
        s.serialize_field("default_lease_seconds", &self.default_lease.as_secs_f64())?;
        s.serialize_field("created_at", &self.created_at)?;
        s.serialize_field("updated_at", &self.updated_at)?;
        s.serialize_field("as_of", &self.as_of)?;
        s.serialize_field("holders", &holders)?;
        s.end()
    }
}

/// Adds `"kind": "advisory"` (a [`SemaphoreInfo`] has no `kind`, so the
/// two can share a list) and `held`.
impl Serialize for AdvisorySemaphoreInfo {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut s = serializer.serialize_struct("AdvisorySemaphoreInfo", 8)?;
        s.serialize_field("kind", "advisory")?;
        s.serialize_field("name", &self.name)?;
        s.serialize_field("capacity", &self.capacity)?;
        s.serialize_field("held", &self.holders.len())?;
        s.serialize_field("created_at", &self.created_at)?;
        s.serialize_field("updated_at", &self.updated_at)?;
        s.serialize_field("as_of", &self.as_of)?;
        s.serialize_field("holders", &self.holders)?;
        s.end()
    }
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};
    use serde_json::json;

    use super::*;
    use crate::admin::{AdvisoryHolder, ReleaseOutcome};
    use crate::audit::{ClaimRecord, Outcome};
    use crate::rate_limit::Decision;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .with_timezone(&Utc)
    }

    #[test]
    fn a_claim_record_has_the_cli_s_field_names() {
        let claim = ClaimRecord {
            id: 7,
            slot: 2,
            holder: "web-1".into(),
            metadata: Some(json!({ "request": "r-1" })),
            created_at: at("2026-11-21T08:00:00Z"),
            expires_at: at("2026-11-21T08:01:30Z"),
            ended_at: None,
            outcome: Outcome::TimedOut,
            held_for: Duration::from_millis(1500),
        };
        assert_eq!(
            serde_json::to_value(&claim).unwrap(),
            json!({
                "id": 7,
                "slot": 2,
                "holder": "web-1",
                "metadata": { "request": "r-1" },
                "claimed_at": "2026-11-21T08:00:00Z",
                "expires_at": "2026-11-21T08:01:30Z",
                "ended_at": null,
                "outcome": "timed_out",
                "held_seconds": 1.5,
            })
        );
    }

    #[test]
    fn a_semaphore_s_holders_carry_their_age_and_lease_left() {
        let info = SemaphoreInfo {
            name: "payments".into(),
            capacity: 3,
            default_lease: Duration::from_secs(600),
            created_at: at("2026-11-21T07:00:00Z"),
            updated_at: at("2026-11-21T07:00:00Z"),
            holders: vec![Holder {
                id: 1,
                slot: 0,
                holder: "a".into(),
                metadata: None,
                created_at: at("2026-11-21T08:00:00Z"),
                expires_at: at("2026-11-21T08:00:10Z"),
            }],
            as_of: at("2026-11-21T08:00:12.5Z"),
        };
        let value = serde_json::to_value(&info).unwrap();
        assert_eq!(value["held"], 1);
        assert_eq!(value["default_lease_seconds"], 600.0);
        assert_eq!(value["holders"][0]["claimed_at"], "2026-11-21T08:00:00Z");
        assert_eq!(value["holders"][0]["age_seconds"], 12.5);
        assert_eq!(value["holders"][0]["lease_left_seconds"], -2.5);
    }

    #[test]
    fn an_advisory_semaphore_says_its_kind_and_its_holders_sessions() {
        let info = AdvisorySemaphoreInfo {
            name: "exports".into(),
            capacity: 3,
            created_at: at("2026-11-21T07:00:00Z"),
            updated_at: at("2026-11-21T07:30:00Z"),
            holders: vec![
                AdvisoryHolder {
                    slot: 0,
                    pid: Some(4242),
                    application_name: Some("pg-semaphore advisory".into()),
                    client_addr: Some("10.0.0.7".into()),
                    backend_start: Some(at("2026-11-21T07:59:00Z")),
                },
                AdvisoryHolder {
                    slot: 2,
                    pid: Some(4243),
                    application_name: Some("pg-semaphore advisory".into()),
                    client_addr: None,
                    backend_start: None,
                },
            ],
            as_of: at("2026-11-21T08:00:00Z"),
        };
        assert_eq!(
            serde_json::to_value(&info).unwrap(),
            json!({
                "kind": "advisory",
                "name": "exports",
                "capacity": 3,
                "held": 2,
                "created_at": "2026-11-21T07:00:00Z",
                "updated_at": "2026-11-21T07:30:00Z",
                "as_of": "2026-11-21T08:00:00Z",
                "holders": [
                    {
                        "slot": 0,
                        "pid": 4242,
                        "application_name": "pg-semaphore advisory",
                        "client_addr": "10.0.0.7",
                        "backend_start": "2026-11-21T07:59:00Z",
                    },
                    {
                        "slot": 2,
                        "pid": 4243,
                        "application_name": "pg-semaphore advisory",
                        "client_addr": null,
                        "backend_start": null,
                    },
                ],
            })
        );
    }

    #[test]
    fn a_summary_with_nothing_finished_has_null_hold_times() {
        let summary = Summary {
            live: 2,
            ..Summary::default()
        };
        let value = serde_json::to_value(summary).unwrap();
        assert_eq!(value["total"], 2);
        assert_eq!(value["p95_hold_seconds"], serde_json::Value::Null);
    }

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
    fn a_release_outcome_is_tagged() {
        let released = ReleaseOutcome::AlreadyTimedOut {
            semaphore: "s".into(),
            at: at("2026-11-21T08:00:00Z"),
        };
        assert_eq!(
            serde_json::to_value(&released).unwrap(),
            json!({ "outcome": "already_timed_out", "semaphore": "s", "at": "2026-11-21T08:00:00Z" })
        );
        assert_eq!(
            serde_json::to_value(&ReleaseOutcome::NotFound).unwrap(),
            json!({ "outcome": "not_found" })
        );
    }
}
