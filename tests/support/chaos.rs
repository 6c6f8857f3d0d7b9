//! What the tests with worker processes (`tests/torture/`,
//! `tests/failover/`) share: testkit's [`chaos`](testkit::chaos) scaffolding
//! (the processes, the clock, the logs, the sweep), re-exported here, and
//! what knows pg-semaphore: what a release said, as a worker logs it, and
//! a worker's hold of a lease permit, and the slot table as the checkers
//! read it.

use std::collections::HashMap;
use std::future::Future;

use chrono::{DateTime, Utc};
use pg_semaphore::{Error, Permit};

pub use testkit::chaos::*;

/// What a permit's release said, as a worker logs it: `ok`, `lost
/// <reason>`, or `error <error>` (the release could not reach the database).
pub fn release_outcome(result: Result<(), Error>) -> String {
    match result {
        Ok(()) => "ok".to_owned(),
        Err(Error::PermitLost { reason, .. }) => format!("lost {reason:?}"),
        Err(error) => format!("error {}", one_line(&error)),
    }
}

/// A worker's hold of a lease permit, named `key` in its log: works until
/// `done`, then releases it, logging `E <key> <t>` (work stopped) and `R
/// <key> <outcome>` (see [`release_outcome`]); told first that the permit
/// was lost, logs `L <key> <t> <reason>` and stops work.
pub async fn hold(permit: Permit, key: &str, log: &Log, done: impl Future<Output = ()>) {
    tokio::select! {
        () = done => {
            log.line(format!("E {key} {}", now_us()));
            log.line(format!("R {key} {}", release_outcome(permit.release().await)));
        }
        reason = permit.lost() => {
            log.line(format!("L {key} {} {reason:?}", now_us()));
            drop(permit);
        }
    }
}

/// A timestamp in µs since the epoch, the unit of the logs.
pub fn us(at: DateTime<Utc>) -> i64 {
    at.timestamp_micros()
}

/// A row of `pgsemaphore.slots`: one claim.
#[derive(Debug, sqlx::FromRow)]
pub struct SlotRow {
    pub id: i64,
    pub semaphore: String,
    pub slot: i32,
    pub holder: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
    pub timed_out_at: Option<DateTime<Utc>>,
}

impl SlotRow {
    /// When the claim stopped holding its slot (its lease's end if it is
    /// still live), µs.
    pub fn end(&self) -> i64 {
        us(self
            .completed_at
            .or(self.timed_out_at)
            .unwrap_or(self.expires_at))
    }
}

/// Every claim in the slot table, in id order.
pub async fn slot_rows(conn: impl sqlx::PgExecutor<'_>) -> sqlx::Result<Vec<SlotRow>> {
    sqlx::query_as(
        "SELECT id, semaphore, slot, holder, created_at, expires_at, completed_at, timed_out_at \
         FROM pgsemaphore.slots ORDER BY id",
    )
    .fetch_all(conn)
    .await
}

/// For each claim of `rows` (in id order) that a later claim of its slot
/// followed: its id, and when that next claim was created (µs).
pub fn next_on_slot(rows: &[SlotRow]) -> HashMap<i64, i64> {
    let mut next_on_slot: HashMap<i64, i64> = HashMap::new();
    let mut last_on_slot: HashMap<(&str, i32), &SlotRow> = HashMap::new();
    for row in rows {
        if let Some(previous) = last_on_slot.insert((row.semaphore.as_str(), row.slot), row) {
            next_on_slot.insert(previous.id, us(row.created_at));
        }
    }
    next_on_slot
}

/// Asserts that, on the table's own clock, the claims of semaphore `name`
/// in `rows` never numbered more than `capacity` at once, nor held one slot
/// twice (`table` names the table in the messages); returns the most at once.
pub fn assert_within_capacity(rows: &[SlotRow], name: &str, capacity: u32, table: &str) -> usize {
    let mine: Vec<&SlotRow> = rows.iter().filter(|r| r.semaphore == name).collect();
    let max = max_open_at_once(mine.iter().map(|r| (us(r.created_at), r.end())));
    assert!(
        max <= capacity as usize,
        "{name}: {max} claims overlapped in {table}, capacity {capacity}"
    );
    let mut per_slot: HashMap<i32, Vec<(i64, i64)>> = HashMap::new();
    for row in &mine {
        per_slot
            .entry(row.slot)
            .or_default()
            .push((us(row.created_at), row.end()));
    }
    for (slot, intervals) in per_slot {
        assert!(
            max_open_at_once(intervals) <= 1,
            "{name}: slot {slot} was held twice at once in {table}"
        );
    }
    max
}
