use std::ops::Range;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::error::{Error, Result};

/// Live holders of one semaphore, oldest first.
const HOLDERS: &str = "\
SELECT id, slot, holder, metadata, created_at, expires_at
  FROM pgsemaphore.slots
 WHERE semaphore = $1
   AND completed_at IS NULL AND timed_out_at IS NULL
 ORDER BY created_at, id";

/// Claims of one semaphore that overlap the window [$2, $3), in claim order.
const HISTORY: &str = "\
SELECT id, slot, holder, metadata, created_at, expires_at, completed_at, timed_out_at,
       extract(epoch FROM coalesce(completed_at, timed_out_at, clock_timestamp()) - created_at)::float8
           AS held_seconds
  FROM pgsemaphore.slots
 WHERE semaphore = $1
   AND created_at < $3
   AND coalesce(completed_at, timed_out_at, 'infinity') >= $2
 ORDER BY id";

/// Outcome counts and hold-time percentiles of the finished claims in the window.
const SUMMARY: &str = "\
WITH w AS (
    SELECT completed_at, timed_out_at,
           extract(epoch FROM coalesce(completed_at, timed_out_at) - created_at)::float8 AS held
      FROM pgsemaphore.slots
     WHERE semaphore = $1
       AND created_at < $3
       AND coalesce(completed_at, timed_out_at, 'infinity') >= $2
)
SELECT count(*) FILTER (WHERE completed_at IS NOT NULL) AS completed,
       count(*) FILTER (WHERE timed_out_at IS NOT NULL) AS timed_out,
       count(*) FILTER (WHERE completed_at IS NULL AND timed_out_at IS NULL) AS live,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY held) AS p50,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY held) AS p95,
       max(held) AS max
  FROM w";

/// Read-only queries over the slot table, which keeps every claim after it
/// ends: who held what, when, and for how long.
///
/// Each query runs as an unnamed statement in a short transaction of its
/// own, so the audit log also works through a transaction-pooling proxy such
/// as PgBouncer.
///
/// # Example
///
/// ```no_run
/// use chrono::{Duration, Utc};
/// use pg_semaphore::AuditLog;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let log = AuditLog::new(&pool);
/// let now = Utc::now();
/// let summary = log.summary("payments-api", now - Duration::hours(1)..now).await?;
/// println!("{} completed, {} timed out, p95 hold {:?}",
///          summary.completed, summary.timed_out, summary.p95_hold);
/// for claim in log.history("payments-api", now - Duration::minutes(5)..now).await? {
///     println!("#{} slot {} by {}: {:?} for {:?}",
///              claim.id, claim.slot, claim.holder, claim.outcome, claim.held_for);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct AuditLog {
    pool: PgPool,
}

/// A live claim, as listed by [`AuditLog::holders`].
///
/// With the `serde` feature it serializes as `{"id", "slot", "holder",
/// "metadata", "claimed_at", "expires_at"}`, times in RFC 3339.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Holder {
    /// The claim's id (the permit's fencing token).
    pub id: i64,
    /// The slot held.
    pub slot: i32,
    /// The holder label (default `host:pid`).
    pub holder: String,
    /// JSON recorded with the claim.
    pub metadata: Option<serde_json::Value>,
    /// When it was claimed.
    #[cfg_attr(feature = "serde", serde(rename = "claimed_at"))]
    pub created_at: DateTime<Utc>,
    /// When its lease ends.
    pub expires_at: DateTime<Utc>,
}

/// How a claim ended (or that it has not).
///
/// With the `serde` feature: `"completed"`, `"timed_out"` or `"live"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "snake_case")
)]
pub enum Outcome {
    /// Released by its holder.
    Completed,
    /// Reaped after its lease expired.
    TimedOut,
    /// Still held.
    Live,
}

/// One claim in a semaphore's history, as listed by [`AuditLog::history`].
///
/// With the `serde` feature it serializes as `{"id", "slot", "holder",
/// "metadata", "claimed_at", "expires_at", "ended_at", "outcome",
/// "held_seconds"}`: times in RFC 3339 (`ended_at` null while live), the hold
/// time in seconds.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ClaimRecord {
    /// The claim's id (the permit's fencing token).
    pub id: i64,
    /// The slot held.
    pub slot: i32,
    /// The holder label.
    pub holder: String,
    /// JSON recorded with the claim.
    pub metadata: Option<serde_json::Value>,
    /// When it was claimed.
    #[cfg_attr(feature = "serde", serde(rename = "claimed_at"))]
    pub created_at: DateTime<Utc>,
    /// When its lease ends (or ended).
    pub expires_at: DateTime<Utc>,
    /// When it was released or reaped; `None` while live.
    pub ended_at: Option<DateTime<Utc>>,
    /// How it ended.
    pub outcome: Outcome,
    /// How long it was held (until now, for a live claim).
    #[cfg_attr(
        feature = "serde",
        serde(rename = "held_seconds", serialize_with = "crate::serialize::seconds")
    )]
    pub held_for: Duration,
}

/// Counts and hold times of a semaphore's claims over a window, from
/// [`AuditLog::summary`].
///
/// With the `serde` feature it serializes as `{"total", "completed",
/// "timed_out", "live", "p50_hold_seconds", "p95_hold_seconds",
/// "max_hold_seconds"}`, hold times in seconds (null when none finished).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct Summary {
    /// Claims released by their holder.
    pub completed: u64,
    /// Claims reaped after their lease expired.
    pub timed_out: u64,
    /// Claims still held.
    pub live: u64,
    /// Median hold time of the finished claims; `None` when none finished.
    pub p50_hold: Option<Duration>,
    /// 95th percentile hold time of the finished claims.
    pub p95_hold: Option<Duration>,
    /// Longest hold time of the finished claims.
    pub max_hold: Option<Duration>,
}

impl Summary {
    /// All claims counted.
    pub fn total(&self) -> u64 {
        self.completed + self.timed_out + self.live
    }
}

#[derive(sqlx::FromRow)]
struct HistoryRow {
    id: i64,
    slot: i32,
    holder: String,
    metadata: Option<serde_json::Value>,
    created_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    completed_at: Option<DateTime<Utc>>,
    timed_out_at: Option<DateTime<Utc>>,
    held_seconds: f64,
}

#[derive(sqlx::FromRow)]
struct SummaryRow {
    completed: i64,
    timed_out: i64,
    live: i64,
    p50: Option<f64>,
    p95: Option<f64>,
    max: Option<f64>,
}

impl AuditLog {
    /// An audit log reader on `pool`.
    pub fn new(pool: &PgPool) -> Self {
        AuditLog { pool: pool.clone() }
    }

    /// The live claims of `semaphore`, oldest first.
    ///
    /// # Errors
    ///
    /// [`Error::MigrationsMissing`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn holders(&self, semaphore: &str) -> Result<Vec<Holder>> {
        Ok(on_pool!(self.pool, true, |conn| {
            sqlx::query_as(HOLDERS)
                .bind(semaphore)
                .persistent(false)
                .fetch_all(conn)
        })
        .await?)
    }

    /// Every claim of `semaphore` that was held at some point of `window`
    /// (claimed before its end, not ended before its start), in claim order.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the window ends before it starts;
    /// [`Error::MigrationsMissing`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn history(
        &self,
        semaphore: &str,
        window: Range<DateTime<Utc>>,
    ) -> Result<Vec<ClaimRecord>> {
        check_window(&window)?;
        let rows: Vec<HistoryRow> = on_pool!(self.pool, true, |conn| {
            sqlx::query_as(HISTORY)
                .bind(semaphore)
                .bind(window.start)
                .bind(window.end)
                .persistent(false)
                .fetch_all(conn)
        })
        .await?;
        Ok(rows
            .into_iter()
            .map(|row| {
                let (outcome, ended_at) = match (row.completed_at, row.timed_out_at) {
                    (Some(at), _) => (Outcome::Completed, Some(at)),
                    (None, Some(at)) => (Outcome::TimedOut, Some(at)),
                    (None, None) => (Outcome::Live, None),
                };
                ClaimRecord {
                    id: row.id,
                    slot: row.slot,
                    holder: row.holder,
                    metadata: row.metadata,
                    created_at: row.created_at,
                    expires_at: row.expires_at,
                    ended_at,
                    outcome,
                    held_for: seconds(row.held_seconds),
                }
            })
            .collect())
    }

    /// Counts per outcome and hold-time percentiles (p50, p95, max) of the
    /// claims of `semaphore` that overlap `window`. Percentiles are over
    /// finished claims only.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the window ends before it starts;
    /// [`Error::MigrationsMissing`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn summary(&self, semaphore: &str, window: Range<DateTime<Utc>>) -> Result<Summary> {
        check_window(&window)?;
        let row: SummaryRow = on_pool!(self.pool, true, |conn| {
            sqlx::query_as(SUMMARY)
                .bind(semaphore)
                .bind(window.start)
                .bind(window.end)
                .persistent(false)
                .fetch_one(conn)
        })
        .await?;
        Ok(Summary {
            completed: row.completed as u64,
            timed_out: row.timed_out as u64,
            live: row.live as u64,
            p50_hold: row.p50.map(seconds),
            p95_hold: row.p95.map(seconds),
            max_hold: row.max.map(seconds),
        })
    }
}

fn check_window(window: &Range<DateTime<Utc>>) -> Result<()> {
    if window.end < window.start {
        return Err(Error::invalid(
            "window",
            format!("ends ({}) before it starts ({})", window.end, window.start),
        ));
    }
    Ok(())
}

/// Seconds from PostgreSQL as a `Duration`; negative or non-finite become zero
/// (clock adjustments can make an interval slightly negative).
fn seconds(value: f64) -> Duration {
    Duration::try_from_secs_f64(value).unwrap_or(Duration::ZERO)
}
