//! The audit log: every claim stays in `pgsemaphore.slots` after it ends,
//! and every finished permit of an advisory semaphore gets a row of
//! `pgsemaphore.advisory_claims`. [`AuditLog`] reads them: live holders, a
//! window's history, a summary with hold-time percentiles, and a
//! [`Report`]: the window aggregated by the database at the resolution the
//! caller asks for ([`ReportShape`]), for a semaphore of either kind. How a
//! report is drawn (`pg-semaphore report`'s page, and the resolution it
//! asks for) is the binary's.
//!
//! The statements are built from parts, each written once: which claims of
//! each kind overlap a window (`lease_in_window!`, `advisory_in_window!`);
//! the claims of either kind as one kind of row, which the history lists
//! and the summary counts (`claims_in_window!`); for a report, the claims
//! of one kind as rows `(slot, holder, created_at, ended_at, timed_out_at)`
//! (`lease_claims!`, `advisory_slots!`, `advisory_permits!`), and the
//! aggregation over them, which reads those rows as `k` (`report_cells!`,
//! `report_peaks!`, `report_hold_times!`).

use std::ops::Range;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::QueryAs;
use sqlx::{FromRow, PgPool, Postgres};

use crate::db::{Db, Statement, seconds};
use crate::error::{Error, Result, ours};
use crate::validate;

/// A lease claim of $1 that overlaps the window [$2, $3): claimed before
/// its end, not ended before its start (a live claim has not ended).
macro_rules! lease_in_window {
    () => {
        "semaphore = $1
   AND created_at < $3
   AND coalesce(completed_at, timed_out_at, 'infinity') >= $2"
    };
}

/// An advisory permit of $1 (a row of its log: finished) that overlaps
/// the window [$2, $3).
macro_rules! advisory_in_window {
    () => {
        "semaphore = $1
   AND acquired_at < $3
   AND ended_at >= $2"
    };
}

/// Whether `$1` is a lease semaphore's name: each statement below reads
/// the advisory side only when it is not (a name belongs to one kind; the
/// advisory log may outlive its semaphore). Uncorrelated, so PostgreSQL
/// evaluates it once, before the scan it gates (which it never starts for
/// a lease semaphore).
macro_rules! not_lease {
    () => {
        "NOT EXISTS (SELECT FROM pgsemaphore.semaphores WHERE name = $1)"
    };
}

/// The claims of $1 that overlap the window [$2, $3), of either kind: a
/// lease semaphore's claims, or an advisory semaphore's finished permits,
/// each with its outcome as an `Outcome` names it (an advisory `released`
/// is `completed`, `lost` is `timed_out`) and its hold time (a live
/// claim's, up to now).
macro_rules! claims_in_window {
    () => {
        concat!(
            "
SELECT id, ARRAY[slot] AS slots, holder, metadata, created_at, expires_at,
       coalesce(completed_at, timed_out_at) AS ended_at,
       CASE WHEN completed_at IS NOT NULL THEN 'completed'
            WHEN timed_out_at IS NOT NULL THEN 'timed_out'
            ELSE 'live' END AS outcome,
       extract(epoch FROM coalesce(completed_at, timed_out_at, clock_timestamp()) - created_at)::float8
           AS held_seconds,
       group_id
  FROM pgsemaphore.slots
 WHERE ",
            lease_in_window!(),
            "
UNION ALL
SELECT NULL, slots, holder, metadata, acquired_at, NULL, ended_at,
       CASE outcome WHEN 'released' THEN 'completed' WHEN 'lost' THEN 'timed_out' ELSE outcome END,
       extract(epoch FROM ended_at - acquired_at)::float8,
       NULL
  FROM pgsemaphore.advisory_claims
 WHERE ",
            advisory_in_window!(),
            "
   AND ",
            not_lease!()
        )
    };
}

/// Live holders of one semaphore: a lease semaphore's live claims, oldest
/// first, or an advisory semaphore's held slots (the sessions whose
/// advisory locks they are, from `pg_locks`), by slot.
const HOLDERS: &str = concat!(
    "\
SELECT id, slot, holder, metadata, created_at, expires_at,
       NULL::int4 AS pid, NULL::text AS application_name, NULL::text AS client_addr,
       NULL::timestamptz AS backend_start, NULL::bool AS shared
  FROM pgsemaphore.live_slots
 WHERE semaphore = $1
UNION ALL
SELECT NULL, slot, NULL, NULL, NULL, NULL,
       pid, application_name, host(client_addr), backend_start, mode = 'shared'
  FROM pgsemaphore.advisory_holders
 WHERE semaphore = $1
   AND ",
    not_lease!(),
    "
 ORDER BY created_at, id, slot, pid"
);

/// The claims in the window (`claims_in_window!`): a lease semaphore's in
/// claim order, an advisory one's in the order they were acquired.
const HISTORY: &str = concat!(claims_in_window!(), "\n ORDER BY id, created_at, ended_at");

/// Outcome counts and hold-time percentiles of the claims in the window
/// (those `HISTORY` lists; percentiles over the finished ones), and
/// whether the semaphore is a lease one.
const SUMMARY: &str = concat!(
    "WITH w AS (",
    claims_in_window!(),
    "
)
SELECT EXISTS (SELECT FROM pgsemaphore.semaphores WHERE name = $1) AS lease,
       count(*) FILTER (WHERE outcome = 'completed') AS completed,
       count(*) FILTER (WHERE outcome = 'dropped') AS dropped,
       count(*) FILTER (WHERE outcome = 'timed_out') AS timed_out,
       count(*) FILTER (WHERE outcome = 'live') AS live,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY held_seconds)
           FILTER (WHERE ended_at IS NOT NULL) AS p50,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY held_seconds)
           FILTER (WHERE ended_at IS NOT NULL) AS p95,
       max(held_seconds) FILTER (WHERE ended_at IS NOT NULL) AS max
  FROM w"
);

/// A report's frame: the semaphore's capacity, the transaction's clock (live
/// claims are drawn up to it) and the highest slot held in the window.
const REPORT_SCOPE: &str = concat!(
    "\
SELECT s.capacity, now() AS as_of,
       (SELECT max(slot) FROM pgsemaphore.slots WHERE ",
    lease_in_window!(),
    ") AS max_slot
  FROM pgsemaphore.semaphores s
 WHERE s.name = $1"
);

/// The lease semaphore's claims of $1 that overlap the window [$2, $3), as a
/// report's rows: one per claim (a claim is one slot); `ended_at` null
/// while live.
macro_rules! lease_claims {
    () => {
        concat!(
            "\
SELECT slot, holder, created_at, coalesce(completed_at, timed_out_at) AS ended_at, timed_out_at
  FROM pgsemaphore.slots
 WHERE ",
            lease_in_window!()
        )
    };
}

/// The advisory semaphore's finished permits of $1 that overlap the window
/// [$2, $3), as a report's rows: one per slot of each permit (a permit of
/// n slots holds n of the capacity). A lost permit (its session ended, the
/// server freed its slots) counts as timed out. Live permits are not in
/// the log: nothing here is live.
macro_rules! advisory_slots {
    () => {
        concat!(
            "\
SELECT slot, holder, acquired_at AS created_at, ended_at,
       CASE WHEN outcome = 'lost' THEN ended_at END AS timed_out_at
  FROM pgsemaphore.advisory_claims, unnest(slots) AS slot
 WHERE ",
            advisory_in_window!()
        )
    };
}

/// As `advisory_slots!`, one row per permit: the population of hold times.
macro_rules! advisory_permits {
    () => {
        concat!(
            "\
SELECT holder, acquired_at AS created_at, ended_at,
       CASE WHEN outcome = 'lost' THEN ended_at END AS timed_out_at
  FROM pgsemaphore.advisory_claims
 WHERE ",
            advisory_in_window!()
        )
    };
}

/// A report's cells, over the claims `k`: clipped to the window, as seconds
/// since its start ($2), spread over the buckets of $4 seconds ($5 of them)
/// each one overlaps, and grouped by lane (slot / $6) and bucket. Per cell:
/// slot time held, claims held at some moment of it, claims that timed out
/// in it, claims held at its start, and the holder of the most of them. At
/// most lanes x buckets rows, however many claims.
macro_rules! report_cells {
    () => {
        "
), c AS (
    SELECT slot, holder,
           coalesce(timed_out_at < $3, false) AS timed_out,
           extract(epoch FROM greatest(created_at, $2) - $2)::float8 AS t0,
           extract(epoch FROM least(coalesce(ended_at, now()), $3) - $2)::float8 AS t1
      FROM k
), spread AS (
    SELECT c.*, b
      FROM c, generate_series(least(floor(t0 / $4)::int, $5 - 1),
                              least(ceil(t1 / $4)::int - 1, $5 - 1)) AS b
     WHERE t1 > t0
)
SELECT slot / $6 AS lane, b AS bucket,
       sum(least(t1, (b + 1) * $4) - greatest(t0, b * $4)) AS busy_seconds,
       count(*) AS claims,
       count(*) FILTER (WHERE timed_out AND t1 <= (b + 1) * $4) AS timed_out,
       count(*) FILTER (WHERE t0 <= b * $4) AS at_start,
       mode() WITHIN GROUP (ORDER BY holder) AS top_holder
  FROM spread
 GROUP BY 1, 2
 ORDER BY 1, 2"
    };
}

/// The most claims live at once in each bucket that has a claim start or
/// end, swept over those events (an end sorts before a start at the same
/// instant: a hand-over is not an overlap), over the claims `k`. Same
/// clipping as `report_cells!`.
macro_rules! report_peaks {
    () => {
        "
), c AS (
    SELECT extract(epoch FROM greatest(created_at, $2) - $2)::float8 AS t0,
           extract(epoch FROM least(coalesce(ended_at, now()), $3) - $2)::float8 AS t1
      FROM k
), events AS (
    SELECT t0 AS t, 1 AS delta FROM c
    UNION ALL
    SELECT t1, -1 FROM c
), running AS (
    SELECT t, sum(delta) OVER (ORDER BY t, delta ROWS UNBOUNDED PRECEDING) AS live
      FROM events
)
SELECT least(floor(t / $4)::int, $5 - 1) AS bucket, max(live)::int8 AS peak
  FROM running
 GROUP BY 1"
    };
}

/// Hold times of the finished claims `k` (the population of the summary's
/// percentiles) in $4 equal bins from zero to the longest.
macro_rules! report_hold_times {
    () => {
        "
), held AS (
    SELECT greatest(extract(epoch FROM ended_at - created_at)::float8, 0) AS seconds,
           timed_out_at IS NOT NULL AS timed_out
      FROM k
     WHERE ended_at IS NOT NULL
), top AS (
    SELECT max(seconds) AS longest FROM held
)
SELECT CASE WHEN longest > 0 THEN least(floor(seconds * $4 / longest)::int, $4 - 1) ELSE 0 END
           AS bin,
       longest,
       count(*) FILTER (WHERE NOT timed_out) AS completed,
       count(*) FILTER (WHERE timed_out) AS timed_out
  FROM held, top
 GROUP BY 1, 2
 ORDER BY 1"
    };
}

/// The statements of a report over one kind of semaphore, each bound as
/// `$1` semaphore, `$2` and `$3` the window (see `in_window`).
struct ReportSql {
    /// The capacity, the transaction's clock and the highest slot held in
    /// the window; no row when no semaphore of this kind has the name.
    scope: &'static str,
    /// `$4` bucket seconds, `$5` buckets, `$6` slots per lane.
    cells: &'static str,
    /// `$4` bucket seconds, `$5` buckets.
    peaks: &'static str,
    /// `$4` bins.
    hold_times: &'static str,
}

/// A lease semaphore's report.
const LEASE_REPORT: ReportSql = ReportSql {
    scope: REPORT_SCOPE,
    cells: concat!("WITH k AS (", lease_claims!(), report_cells!()),
    peaks: concat!("WITH k AS (", lease_claims!(), report_peaks!()),
    hold_times: concat!("WITH k AS (", lease_claims!(), report_hold_times!()),
};

/// An advisory semaphore's report: its finished permits, a lane per slot.
const ADVISORY_REPORT: ReportSql = ReportSql {
    scope: concat!(
        "\
SELECT a.capacity, now() AS as_of,
       (SELECT max(slot) FROM (",
        advisory_slots!(),
        ") k) AS max_slot
  FROM pgsemaphore.advisory_semaphores a
 WHERE a.name = $1"
    ),
    cells: concat!("WITH k AS (", advisory_slots!(), report_cells!()),
    peaks: concat!("WITH k AS (", advisory_slots!(), report_peaks!()),
    hold_times: concat!("WITH k AS (", advisory_permits!(), report_hold_times!()),
};

/// A report's default time buckets: the occupancy series and each lane's cells.
const REPORT_BUCKETS: u32 = 240;
/// A report's default bins of the hold-time histogram.
const REPORT_HOLD_BINS: u32 = 30;
/// The most claims a report lists one by one by default; above, it only
/// aggregates.
const REPORT_MAX_CLAIMS: u64 = 5_000;
/// The most lanes in a report's timeline by default; above, a lane groups
/// several slots.
const REPORT_MAX_LANES: u32 = 100;

/// The resolution of a [`Report`]: how many time buckets and hold-time bins
/// the database aggregates a window into, and how many lanes and listed
/// claims the report may hold at most. Passed to
/// [`AuditLog::report_shaped`]; [`AuditLog::report`] uses the default: 240
/// time buckets, 30 hold-time bins, at most 100 lanes and 5,000 listed
/// claims.
///
/// A report's size is bounded by its shape whatever the traffic: about
/// `lanes x buckets` cells, `buckets` occupancy points, `hold_time_bins`
/// bins, and at most `max_claims` claims.
///
/// ```
/// use pg_semaphore::audit::ReportShape;
/// // A narrow picture: 60 columns, 10 histogram bars, no claim listed.
/// let shape = ReportShape::new().buckets(60).hold_time_bins(10).max_claims(0);
/// assert_ne!(shape, ReportShape::default());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportShape {
    buckets: u32,
    hold_time_bins: u32,
    max_lanes: u32,
    max_claims: u64,
}

impl ReportShape {
    /// The default shape: 240 time buckets, 30 hold-time bins, at most 100
    /// lanes and 5,000 listed claims.
    pub const fn new() -> Self {
        ReportShape {
            buckets: REPORT_BUCKETS,
            hold_time_bins: REPORT_HOLD_BINS,
            max_lanes: REPORT_MAX_LANES,
            max_claims: REPORT_MAX_CLAIMS,
        }
    }

    /// Time buckets across the window (1 to 10,000): the points of the
    /// occupancy series, and the cells of each lane.
    pub const fn buckets(mut self, buckets: u32) -> Self {
        self.buckets = buckets;
        self
    }

    /// Bins of the hold-time histogram (1 to 1,000), from zero to the
    /// longest hold.
    pub const fn hold_time_bins(mut self, bins: u32) -> Self {
        self.hold_time_bins = bins;
        self
    }

    /// The most lanes of the timeline (at least 1): a semaphore with more
    /// slots (capacity, or slots held in the window) groups several slots
    /// per lane, and the report is then aggregated.
    pub const fn max_lanes(mut self, lanes: u32) -> Self {
        self.max_lanes = lanes;
        self
    }

    /// The most claims listed one by one; a window with more is aggregated
    /// (no claim listed).
    pub const fn max_claims(mut self, claims: u64) -> Self {
        self.max_claims = claims;
        self
    }
}

impl Default for ReportShape {
    fn default() -> Self {
        ReportShape::new()
    }
}

/// Read-only queries over the slot table, which keeps every claim after it
/// ends, and over the advisory semaphores' log of finished permits: who
/// held what, when, and for how long.
///
/// Each query takes a semaphore of either kind, lease or advisory (a name
/// belongs to one kind), and says which in its answer's
/// [`SemaphoreKind`]: [`holders`](Self::holders) now,
/// [`history`](Self::history) and [`summary`](Self::summary) of a window,
/// and a [`report`](Self::report).
///
/// Each query runs as an unnamed statement in a short transaction of its
/// own, so the audit log also works through a transaction-pooling proxy such
/// as PgBouncer.
///
/// # Example
///
/// ```no_run
/// use chrono::{Duration, Utc};
/// use pg_semaphore::audit::AuditLog;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let log = AuditLog::new(&pool);
/// let now = Utc::now();
/// let summary = log.summary("payments-api", now - Duration::hours(1)..now).await?;
/// println!("{} completed, {} timed out, p95 hold {:?}",
///          summary.completed, summary.timed_out, summary.p95_hold);
/// for claim in log.history("payments-api", now - Duration::minutes(5)..now).await? {
///     println!("#{:?} slots {:?} by {}: {:?} for {:?}",
///              claim.id, claim.slots, claim.holder, claim.outcome, claim.held_for);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct AuditLog {
    pool: PgPool,
}

/// Which kind of semaphore a [`Holder`], [`ClaimRecord`], [`Summary`],
/// [`SemaphoreInfo`](crate::admin::SemaphoreInfo) or [`Report`] is about: where
/// the two kinds differ, it says which fields are filled.
///
/// With the `serde` feature: `"lease"` or `"advisory"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "snake_case")
)]
#[non_exhaustive]
pub enum SemaphoreKind {
    /// A [`Semaphore`](crate::Semaphore): claims are rows of
    /// `pgsemaphore.slots`.
    Lease,
    /// An [`AdvisorySemaphore`](crate::AdvisorySemaphore): slots are
    /// advisory locks, finished permits rows of
    /// `pgsemaphore.advisory_claims`.
    Advisory,
}

impl SemaphoreKind {
    /// `Lease` when the statement's `lease` column (or a lease-only
    /// column's presence) says so.
    pub(crate) fn lease_if(lease: bool) -> Self {
        if lease {
            SemaphoreKind::Lease
        } else {
            SemaphoreKind::Advisory
        }
    }
}

/// A live holder of a semaphore's slot, as listed by [`AuditLog::holders`]
/// and in [`SemaphoreInfo::holders`](crate::admin::SemaphoreInfo::holders).
///
/// Of a lease semaphore ([`kind`](Self::kind) [`SemaphoreKind::Lease`]): a
/// live claim, with its id, holder label, metadata and lease. Of an
/// advisory semaphore ([`SemaphoreKind::Advisory`]): the session whose
/// advisory lock the slot is, as `pg_locks` and `pg_stat_activity` show
/// it. That session is one of a process's dedicated connections (an
/// [`AdvisoryPermit`](crate::AdvisoryPermit)'s
/// [`backend_pid`](crate::AdvisoryPermit::backend_pid); one session may
/// hold several permits), or any client that took the slot's key with
/// `pg_advisory_lock` (which only makes the semaphore look fuller). An
/// advisory permit's holder label and metadata are not there: they reach
/// `pgsemaphore.advisory_claims` when the permit ends. PostgreSQL shows a
/// session's `client_addr` and `backend_start` only to its own role and to
/// members of `pg_read_all_stats` (or `pg_monitor`): for the sessions of
/// other roles they are `None`; the pid and the application name are
/// always there.
///
/// The fields only one kind has are `Option`s, filled for that kind only.
///
/// With the `serde` feature a lease holder serializes as `{"kind":
/// "lease", "id", "slot", "holder", "metadata", "claimed_at",
/// "expires_at"}`, an advisory one as `{"kind": "advisory", "slot", "pid",
/// "application_name", "client_addr", "backend_start", "shared"}`, times in
/// RFC 3339.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Holder {
    /// The semaphore's kind: which of the fields below are filled.
    pub kind: SemaphoreKind,
    /// The slot held.
    pub slot: u32,
    /// Lease: the claim's id (the permit's fencing token).
    pub id: Option<i64>,
    /// Lease: the holder label (default `host:pid`).
    pub holder: Option<String>,
    /// Lease: JSON recorded with the claim.
    pub metadata: Option<serde_json::Value>,
    /// Lease: when it was claimed.
    pub created_at: Option<DateTime<Utc>>,
    /// Lease: when its lease ends. A claim whose lease has run out stays
    /// listed until a reaper or a claim notices.
    pub expires_at: Option<DateTime<Utc>>,
    /// Advisory: the backend that holds the slot's lock (`pg_locks.pid`);
    /// `SELECT pg_terminate_backend(pid)` frees at once every slot its
    /// session holds (the permits' holders are told). `None` also for a
    /// prepared transaction holding the key, never for a permit.
    pub pid: Option<i32>,
    /// Advisory: the session's `application_name` (`pg-semaphore advisory`
    /// for the crate's own sessions).
    pub application_name: Option<String>,
    /// Advisory: the client's IP address; `None` also over a Unix socket,
    /// or when not visible to this role.
    pub client_addr: Option<String>,
    /// Advisory: when the session connected (not when it took the slot: a
    /// process reuses its sessions for many permits); `None` also when not
    /// visible to this role.
    pub backend_start: Option<DateTime<Utc>>,
    /// Advisory: whether the key is held in shared mode
    /// (`pg_advisory_lock_shared`), which no claim takes: not a permit, but
    /// the slot cannot be claimed while it lasts (several sessions may hold
    /// one slot so, each listed).
    pub shared: Option<bool>,
}

/// Each kind's fields, and `kind`.
#[cfg(feature = "serde")]
impl serde::Serialize for Holder {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let mut s = serializer.serialize_struct("Holder", 7)?;
        s.serialize_field("kind", &self.kind)?;
        match self.kind {
            SemaphoreKind::Lease => {
                s.serialize_field("id", &self.id)?;
                s.serialize_field("slot", &self.slot)?;
                s.serialize_field("holder", &self.holder)?;
                s.serialize_field("metadata", &self.metadata)?;
                s.serialize_field("claimed_at", &self.created_at)?;
                s.serialize_field("expires_at", &self.expires_at)?;
            }
            SemaphoreKind::Advisory => {
                s.serialize_field("slot", &self.slot)?;
                s.serialize_field("pid", &self.pid)?;
                s.serialize_field("application_name", &self.application_name)?;
                s.serialize_field("client_addr", &self.client_addr)?;
                s.serialize_field("backend_start", &self.backend_start)?;
                s.serialize_field("shared", &self.shared.unwrap_or(false))?;
            }
        }
        s.end()
    }
}

/// How a claim or permit ended (or that it has not).
///
/// With the `serde` feature: `"completed"`, `"dropped"`, `"timed_out"` or
/// `"live"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "snake_case")
)]
#[non_exhaustive]
pub enum Outcome {
    /// Released by its holder. Lease: by
    /// [`Permit::release`](crate::Permit::release) or its `Drop` (the slot
    /// table does not tell them apart). Advisory: by
    /// [`AdvisoryPermit::release`](crate::AdvisoryPermit::release).
    Completed,
    /// Advisory only: released by the permit's `Drop`.
    Dropped,
    /// Ended without its holder. Lease: reaped after its lease expired.
    /// Advisory: lost, its session ended or stopped answering and the
    /// server freed its slots (what the CLI prints as `lost`).
    TimedOut,
    /// Lease only: still held (an advisory semaphore's log holds finished
    /// permits only).
    Live,
}

/// One claim in a semaphore's history, as listed by [`AuditLog::history`]:
/// a lease semaphore's claim, or an advisory semaphore's finished permit.
///
/// What differs by [`kind`](Self::kind): a lease claim holds one slot, has
/// an id and a lease, and may be live. An advisory permit may hold several
/// slots, has no claim id (its fencing is its session, not a token) and no
/// lease, and is only ever finished: the audit writer appends it after it
/// ends, in batches (about every half second), so live permits are not
/// here; their slots are in [`semaphores`](crate::admin::semaphores) and
/// `pg-semaphore status`. A permit whose process died before its row was
/// written is missing.
///
/// With the `serde` feature it serializes as `{"kind", "id", "slots",
/// "holder", "metadata", "claimed_at", "expires_at", "ended_at",
/// "outcome", "held_seconds", "group_id"}`, the fields a kind does not fill
/// (`id`, `expires_at`, `group_id`) left out: times in RFC 3339 (`ended_at`
/// null while live), the hold time in seconds.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ClaimRecord {
    /// The semaphore's kind: which of the fields below are filled.
    pub kind: SemaphoreKind,
    /// Lease: the claim's id (the permit's fencing token).
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub id: Option<i64>,
    /// The slots held, lowest first: one for a lease claim.
    pub slots: Vec<u32>,
    /// The holder label.
    pub holder: String,
    /// JSON recorded with the claim.
    pub metadata: Option<serde_json::Value>,
    /// When it was claimed (the database clock).
    #[cfg_attr(feature = "serde", serde(rename = "claimed_at"))]
    pub created_at: DateTime<Utc>,
    /// Lease: when its lease ends (or ended).
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub expires_at: Option<DateTime<Utc>>,
    /// When it was released, reaped or lost; `None` while live.
    pub ended_at: Option<DateTime<Utc>>,
    /// How it ended.
    pub outcome: Outcome,
    /// How long it was held (until now, for a live claim).
    #[cfg_attr(
        feature = "serde",
        serde(rename = "held_seconds", serialize_with = "crate::serialize::seconds")
    )]
    pub held_for: Duration,
    /// Lease: for a claim made together with claims of other semaphores by
    /// one [`Semaphore::acquire_all`](crate::Semaphore::acquire_all) (or
    /// `pgsemaphore.claim_all`), the id of the first claim of that group,
    /// shared by all of them (look it up in the other semaphores' history).
    /// `None` for a claim of one semaphore. Serialized only when set.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub group_id: Option<i64>,
}

/// Counts and hold times of a semaphore's claims over a window, from
/// [`AuditLog::summary`]: a lease semaphore's claims, or an advisory
/// semaphore's finished permits (see [`ClaimRecord`]). Each count is of
/// the claims with that [`Outcome`]; hold-time percentiles are over the
/// finished ones.
///
/// With the `serde` feature it serializes as `{"kind", "total",
/// "completed", "dropped", "timed_out", "live", "p50_hold_seconds",
/// "p95_hold_seconds", "max_hold_seconds"}` (`dropped` for an advisory
/// semaphore only, `live` for a lease one only), hold times in seconds
/// (null when none finished).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Summary {
    /// The semaphore's kind: which of the counts below are filled.
    pub kind: SemaphoreKind,
    /// Released by their holder ([`Outcome::Completed`]).
    pub completed: u64,
    /// Advisory: released by their `Drop` ([`Outcome::Dropped`]).
    pub dropped: Option<u64>,
    /// Ended without their holder: a lease reaped, an advisory permit lost
    /// ([`Outcome::TimedOut`]).
    pub timed_out: u64,
    /// Lease: still held ([`Outcome::Live`]).
    pub live: Option<u64>,
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
        self.completed + self.dropped.unwrap_or(0) + self.timed_out + self.live.unwrap_or(0)
    }
}

/// Adds `total`; leaves out the count the kind does not fill.
#[cfg(feature = "serde")]
impl serde::Serialize for Summary {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
        let mut s = serializer.serialize_struct("Summary", 8)?;
        s.serialize_field("kind", &self.kind)?;
        s.serialize_field("total", &self.total())?;
        s.serialize_field("completed", &self.completed)?;
        if let Some(dropped) = self.dropped {
            s.serialize_field("dropped", &dropped)?;
        }
        s.serialize_field("timed_out", &self.timed_out)?;
        if let Some(live) = self.live {
            s.serialize_field("live", &live)?;
        }
        s.serialize_field("p50_hold_seconds", &secs(self.p50_hold))?;
        s.serialize_field("p95_hold_seconds", &secs(self.p95_hold))?;
        s.serialize_field("max_hold_seconds", &secs(self.max_hold))?;
        s.end()
    }
}

/// One semaphore's claims over a window, aggregated by the database at
/// the resolution of a [`ReportShape`], from [`AuditLog::report`] or
/// [`AuditLog::report_shaped`] (`pg-semaphore report` draws one).
///
/// Its size is bounded by the shape whatever the traffic: the claims are
/// listed one by one only when the window holds at most the shape's
/// `max_claims` and the semaphore at most its `max_lanes` slots (5,000 and
/// 100 by default); otherwise [`aggregated`](Self::aggregated) is set,
/// `claims` is empty, and the timeline is told by [`cells`](Self::cells)
/// alone (computed by the database, one row per lane and time bucket). The
/// occupancy series, the cells and the hold-time histogram are always
/// there. Everything is read in one `REPEATABLE READ` snapshot, so the
/// parts agree.
///
/// # An advisory semaphore's report
///
/// [`kind`](Self::kind) is [`SemaphoreKind::Advisory`], and the report is
/// drawn from its audit log, which holds finished permits only: the
/// picture ends at the last permit that finished (and was written, about
/// every half second); live holders are in [`semaphores`](crate::admin::semaphores).
/// Its permits are listed in [`claims`](Self::claims); a permit of n slots
/// counts n in the occupancy and the lanes, one in the counts and hold
/// times. The [`summary`](Self::summary) is the advisory one (released,
/// dropped, lost); the cells and the hold-time bins count a released or
/// dropped permit as `completed`, a lost one as `timed_out`.
///
/// With the `serde` feature it serializes with the field names below,
/// durations as seconds (`bucket_seconds`, `busy_seconds`, ...).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Report {
    /// The semaphore's name.
    pub semaphore: String,
    /// Its kind: a lease or an advisory semaphore.
    pub kind: SemaphoreKind,
    /// Its capacity now (it may have been changed during the window).
    pub capacity: u32,
    /// The window's start.
    pub since: DateTime<Utc>,
    /// The window's end.
    pub until: DateTime<Utc>,
    /// The database clock when the report was read: live claims are held
    /// up to here.
    pub as_of: DateTime<Utc>,
    /// The window's counts per outcome and hold-time percentiles, as
    /// [`AuditLog::summary`] gives them.
    pub summary: Summary,
    /// Every claim (an advisory semaphore's: finished permit) held at some
    /// moment of the window, in claim order, as [`AuditLog::history`];
    /// empty when [`aggregated`](Self::aggregated).
    pub claims: Vec<ClaimRecord>,
    /// Whether the claims were too many (or the slots too many) to list,
    /// so that only the aggregates describe them.
    pub aggregated: bool,
    /// How many slots a lane of the timeline stands for (1 unless the
    /// semaphore has more slots than the shape's `max_lanes`, 100 by
    /// default).
    pub slots_per_lane: u32,
    /// Lanes in the timeline: enough for the capacity and every slot held.
    pub lanes: u32,
    /// The length of a time bucket: the window divided by the number of
    /// [`occupancy`](Self::occupancy) buckets.
    #[cfg_attr(
        feature = "serde",
        serde(
            rename = "bucket_seconds",
            serialize_with = "crate::serialize::seconds"
        )
    )]
    pub bucket_width: Duration,
    /// Claims held per time bucket, over the whole window.
    pub occupancy: Vec<OccupancyBucket>,
    /// Each lane's use per time bucket, for the buckets where it was used,
    /// by lane then bucket.
    pub cells: Vec<SlotBucket>,
    /// Hold times of the finished claims: equal bins from zero to the
    /// longest; empty when none finished.
    pub hold_times: Vec<HoldTimeBin>,
}

/// Claims held during one time bucket of a [`Report`].
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct OccupancyBucket {
    /// When the bucket starts (it lasts [`Report::bucket_width`]).
    pub start: DateTime<Utc>,
    /// Claims held on average over the bucket (slot time held / its length).
    pub mean: f64,
    /// The most claims held at one instant of the bucket.
    pub peak: u32,
}

/// One lane's use during one time bucket of a [`Report`].
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct SlotBucket {
    /// The lane: slots `lane * slots_per_lane` up to, not including,
    /// `(lane + 1) * slots_per_lane`.
    pub lane: u32,
    /// The time bucket: an index into [`Report::occupancy`].
    pub bucket: u32,
    /// Slot time held in the bucket, summed over the lane's slots (at most
    /// `bucket_width * slots_per_lane`).
    #[cfg_attr(
        feature = "serde",
        serde(rename = "busy_seconds", serialize_with = "crate::serialize::seconds")
    )]
    pub busy: Duration,
    /// Claims held at some moment of the bucket.
    pub claims: u64,
    /// Claims that timed out (were reaped) during the bucket.
    pub timed_out: u64,
    /// The holder label of the most of those claims.
    pub top_holder: String,
}

/// One bin of a [`Report`]'s hold-time histogram.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct HoldTimeBin {
    /// The bin's start.
    #[cfg_attr(
        feature = "serde",
        serde(rename = "from_seconds", serialize_with = "crate::serialize::seconds")
    )]
    pub from: Duration,
    /// The bin's end (included in the last bin only).
    #[cfg_attr(
        feature = "serde",
        serde(rename = "to_seconds", serialize_with = "crate::serialize::seconds")
    )]
    pub to: Duration,
    /// Claims released by their holder after a hold in the bin.
    pub completed: u64,
    /// Claims reaped after a hold in the bin.
    pub timed_out: u64,
}

#[derive(sqlx::FromRow)]
struct ScopeRow {
    capacity: i32,
    as_of: DateTime<Utc>,
    max_slot: Option<i32>,
}

#[derive(sqlx::FromRow)]
struct CellRow {
    lane: i32,
    bucket: i32,
    busy_seconds: f64,
    claims: i64,
    timed_out: i64,
    at_start: i64,
    top_holder: String,
}

#[derive(sqlx::FromRow)]
struct HoldTimeRow {
    bin: i32,
    longest: f64,
    completed: i64,
    timed_out: i64,
}

/// A live holder as a statement lists it: a lease claim's columns (`id`
/// set), or an advisory slot's session's; a statement may leave out the
/// other kind's columns, and a `LEFT JOIN` may leave all of them NULL (no
/// holder: `slot` NULL).
#[derive(sqlx::FromRow)]
pub(crate) struct HolderRow {
    #[sqlx(default)]
    id: Option<i64>,
    #[sqlx(default)]
    slot: Option<i32>,
    #[sqlx(default)]
    holder: Option<String>,
    #[sqlx(default)]
    metadata: Option<serde_json::Value>,
    #[sqlx(default)]
    created_at: Option<DateTime<Utc>>,
    #[sqlx(default)]
    expires_at: Option<DateTime<Utc>>,
    #[sqlx(default)]
    pid: Option<i32>,
    #[sqlx(default)]
    application_name: Option<String>,
    #[sqlx(default)]
    client_addr: Option<String>,
    #[sqlx(default)]
    backend_start: Option<DateTime<Utc>>,
    #[sqlx(default)]
    shared: Option<bool>,
}

impl HolderRow {
    /// The holder, unless the row has none; a lease claim when it has an id.
    pub(crate) fn into_holder(self) -> Option<Holder> {
        let slot = self.slot?.max(0) as u32;
        let lease = self.id.is_some();
        Some(Holder {
            kind: SemaphoreKind::lease_if(lease),
            slot,
            id: self.id,
            holder: self.holder,
            metadata: self.metadata,
            created_at: self.created_at,
            expires_at: self.expires_at,
            pid: self.pid,
            application_name: self.application_name,
            client_addr: self.client_addr,
            backend_start: self.backend_start,
            shared: if lease {
                None
            } else {
                Some(self.shared.unwrap_or(false))
            },
        })
    }
}

/// A row of `HISTORY`: a lease claim (`id` set) or an advisory permit.
#[derive(sqlx::FromRow)]
struct HistoryRow {
    id: Option<i64>,
    slots: Vec<i32>,
    holder: String,
    metadata: Option<serde_json::Value>,
    created_at: DateTime<Utc>,
    expires_at: Option<DateTime<Utc>>,
    ended_at: Option<DateTime<Utc>>,
    outcome: String,
    held_seconds: f64,
    group_id: Option<i64>,
}

/// The row of `SUMMARY`.
#[derive(sqlx::FromRow)]
struct SummaryRow {
    lease: bool,
    completed: i64,
    dropped: i64,
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

    /// Reads run unnamed inside a transaction, so they work through a
    /// transaction pooler too.
    fn db(&self) -> Db {
        Db::new(&self.pool, true)
    }

    /// The live holders of `semaphore`: a lease semaphore's live claims,
    /// oldest first, or the sessions that hold an advisory semaphore's
    /// slots, by slot (see [`Holder`]). A name no semaphore has gives an
    /// empty list.
    ///
    /// # Errors
    ///
    /// [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn holders(&self, semaphore: &str) -> Result<Vec<Holder>> {
        let db = self.db();
        let rows: Vec<HolderRow> = db
            .fetch_all(db.query_as(HOLDERS).bind(semaphore.to_owned()))
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(HolderRow::into_holder)
            .collect())
    }

    /// Every claim of `semaphore` that was held at some point of `window`
    /// (claimed before its end, not ended before its start): a lease
    /// semaphore's claims in claim order, or an advisory semaphore's
    /// finished permits in the order they were acquired (see
    /// [`ClaimRecord`]). A name no semaphore has gives an empty list.
    ///
    /// An advisory semaphore's log holds finished permits only, written by
    /// each holder's process in batches after they end: a permit that ended
    /// within the last second may not be here yet, and a live one is not;
    /// [`holders`](Self::holders) lists who holds a slot now.
    ///
    /// ```no_run
    /// use chrono::{Duration, Utc};
    /// use pg_semaphore::audit::AuditLog;
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let now = Utc::now();
    /// for permit in AuditLog::new(&pool)
    ///     .history("exports", now - Duration::minutes(5)..now)
    ///     .await?
    /// {
    ///     println!("{:?} slots {:?} by {}: {:?} for {:?}",
    ///              permit.kind, permit.slots, permit.holder, permit.outcome, permit.held_for);
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the window ends before it starts;
    /// [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn history(
        &self,
        semaphore: &str,
        window: Range<DateTime<Utc>>,
    ) -> Result<Vec<ClaimRecord>> {
        let db = self.db();
        let rows: Vec<HistoryRow> = db
            .fetch_all(windowed(&db, HISTORY, semaphore, &window)?)
            .await?;
        Ok(rows.into_iter().map(ClaimRecord::from).collect())
    }

    /// Counts per outcome and hold-time percentiles (p50, p95, max) of the
    /// claims of `semaphore` that overlap `window`: the claims
    /// [`history`](Self::history) lists. Percentiles are over finished
    /// claims only. The summary's [`kind`](Summary::kind) is
    /// [`SemaphoreKind::Lease`] for a lease semaphore, else
    /// [`SemaphoreKind::Advisory`] (also for a name no semaphore has, whose
    /// counts are zero: an advisory semaphore's log may outlive it).
    ///
    /// ```no_run
    /// use chrono::{Duration, Utc};
    /// use pg_semaphore::audit::AuditLog;
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let now = Utc::now();
    /// let summary = AuditLog::new(&pool)
    ///     .summary("exports", now - Duration::hours(1)..now)
    ///     .await?;
    /// println!("{} permits, {} lost, p95 hold {:?}",
    ///          summary.total(), summary.timed_out, summary.p95_hold);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the window ends before it starts;
    /// [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn summary(&self, semaphore: &str, window: Range<DateTime<Utc>>) -> Result<Summary> {
        let db = self.db();
        let row: SummaryRow = db
            .fetch_one(windowed(&db, SUMMARY, semaphore, &window)?)
            .await?;
        Ok(Summary::from(row))
    }
}

impl AuditLog {
    /// `semaphore`'s claims over `window`, in the default
    /// [`ReportShape`], for a lease or an advisory semaphore (an advisory
    /// one's from its log of finished permits: see [`Report`]): the claims
    /// themselves when they are few, occupancy
    /// per time bucket against the capacity, each slot's use per bucket, a
    /// hold-time histogram and the summary. See [`Report`] for what is
    /// aggregated when: the aggregation runs in the database, so a window
    /// of millions of claims takes no more memory here than one of
    /// thousands.
    ///
    /// ```no_run
    /// use chrono::{Duration, Utc};
    /// use pg_semaphore::audit::AuditLog;
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let now = Utc::now();
    /// let report = AuditLog::new(&pool)
    ///     .report("payments-api", now - Duration::hours(1)..now)
    ///     .await?;
    /// let saturated = report.occupancy.iter().filter(|b| b.peak >= report.capacity).count();
    /// println!("{saturated} of {} buckets reached the capacity", report.occupancy.len());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the window is empty or ends before it
    /// starts; [`Error::SemaphoreNotFound`] when no semaphore has this name;
    /// [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn report(&self, semaphore: &str, window: Range<DateTime<Utc>>) -> Result<Report> {
        self.report_shaped(semaphore, window, ReportShape::default())
            .await
    }

    /// As [`report`](Self::report), at the resolution of `shape`: as many
    /// time buckets and hold-time bins as it asks for, at most its lanes
    /// and listed claims.
    ///
    /// ```no_run
    /// use chrono::{Duration, Utc};
    /// use pg_semaphore::audit::{AuditLog, ReportShape};
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let now = Utc::now();
    /// let shape = ReportShape::new().buckets(60);
    /// let report = AuditLog::new(&pool)
    ///     .report_shaped("payments-api", now - Duration::hours(1)..now, shape)
    ///     .await?;
    /// assert_eq!(report.occupancy.len(), 60);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`report`](Self::report), and [`Error::InvalidArgument`] for a
    /// shape out of range (`buckets`, `hold_time_bins`, `max_lanes`).
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn report_shaped(
        &self,
        semaphore: &str,
        window: Range<DateTime<Utc>>,
        shape: ReportShape,
    ) -> Result<Report> {
        validate::report_shape(shape.buckets, shape.hold_time_bins, shape.max_lanes)?;
        validate::time_range(&window)?;
        let micros = (window.end - window.start)
            .num_microseconds()
            .filter(|&us| us > 0)
            .ok_or_else(|| {
                Error::invalid(
                    "window",
                    "must last at least a microsecond and less than 290,000 years",
                )
            })?;
        let bucket_seconds = micros as f64 / 1e6 / f64::from(shape.buckets);
        // One snapshot for every part, so that they agree. Unnamed statements
        // in a transaction: works through PgBouncer.
        let mut tx = self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .await
            .map_err(ours)?;
        let mut kind = SemaphoreKind::Lease;
        let mut scope: Option<ScopeRow> = in_window(LEASE_REPORT.scope, semaphore, &window)
            .fetch_optional(&mut *tx)
            .await
            .map_err(ours)?;
        if scope.is_none() {
            kind = SemaphoreKind::Advisory;
            scope = in_window(ADVISORY_REPORT.scope, semaphore, &window)
                .fetch_optional(&mut *tx)
                .await
                .map_err(ours)?;
        }
        let Some(scope) = scope else {
            return Err(Error::SemaphoreNotFound {
                semaphore: semaphore.to_owned(),
            });
        };
        let sql = match kind {
            SemaphoreKind::Lease => &LEASE_REPORT,
            SemaphoreKind::Advisory => &ADVISORY_REPORT,
        };
        let capacity = scope.capacity.max(0) as u32;
        let slots = capacity.max(scope.max_slot.map_or(0, |s| s.max(0) as u32 + 1));
        let slots_per_lane = slots.div_ceil(shape.max_lanes).max(1);
        let lanes = slots.div_ceil(slots_per_lane);

        // The same statements as `summary` and `history`, which read the
        // kind the scope found.
        let summary = Summary::from(
            in_window::<SummaryRow>(SUMMARY, semaphore, &window)
                .fetch_one(&mut *tx)
                .await
                .map_err(ours)?,
        );
        // The count comes from the same snapshot as the claims: exact.
        let aggregated = summary.total() > shape.max_claims || slots_per_lane > 1;
        let mut claims = Vec::new();
        if !aggregated {
            let rows: Vec<HistoryRow> = in_window(HISTORY, semaphore, &window)
                .fetch_all(&mut *tx)
                .await
                .map_err(ours)?;
            claims = rows.into_iter().map(ClaimRecord::from).collect();
        }
        let cells: Vec<CellRow> = in_window(sql.cells, semaphore, &window)
            .bind(bucket_seconds)
            .bind(shape.buckets as i32)
            .bind(slots_per_lane as i32)
            .fetch_all(&mut *tx)
            .await
            .map_err(ours)?;
        let peaks: Vec<(i32, i64)> = in_window(sql.peaks, semaphore, &window)
            .bind(bucket_seconds)
            .bind(shape.buckets as i32)
            .fetch_all(&mut *tx)
            .await
            .map_err(ours)?;
        let hold_times: Vec<HoldTimeRow> = in_window(sql.hold_times, semaphore, &window)
            .bind(shape.hold_time_bins as i32)
            .fetch_all(&mut *tx)
            .await
            .map_err(ours)?;
        tx.commit().await.map_err(ours)?;

        Ok(Report {
            semaphore: semaphore.to_owned(),
            kind,
            capacity,
            since: window.start,
            until: window.end,
            as_of: scope.as_of,
            summary,
            claims,
            aggregated,
            slots_per_lane,
            lanes,
            bucket_width: seconds(bucket_seconds),
            occupancy: occupancy(window.start, bucket_seconds, shape.buckets, &cells, &peaks),
            cells: cells.into_iter().map(SlotBucket::from).collect(),
            hold_times: hold_time_bins(shape.hold_time_bins, &hold_times),
        })
    }
}

/// A report's statement over `semaphore`'s claims in `window` (`$1`, `$2`,
/// `$3`; the rest are bound by the caller), unnamed: a report's reads share
/// one transaction, which may run through PgBouncer.
fn in_window<'q, O>(
    sql: &'static str,
    semaphore: &'q str,
    window: &Range<DateTime<Utc>>,
) -> QueryAs<'q, Postgres, O, PgArguments>
where
    O: for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_as(sql)
        .persistent(false)
        .bind(semaphore)
        .bind(window.start)
        .bind(window.end)
}

/// The occupancy series: a bucket's mean from the slot time held in it; its
/// peak from the sweep over the claims that started or ended in it, or the
/// claims held at its start if more (or if none started or ended in it).
fn occupancy(
    since: DateTime<Utc>,
    bucket_seconds: f64,
    buckets: u32,
    cells: &[CellRow],
    peaks: &[(i32, i64)],
) -> Vec<OccupancyBucket> {
    let buckets = buckets as usize;
    let index = |bucket: i32| usize::try_from(bucket).ok().filter(|&b| b < buckets);
    let mut busy = vec![0.0; buckets];
    let mut peak = vec![0_i64; buckets];
    for cell in cells {
        if let Some(b) = index(cell.bucket) {
            busy[b] += cell.busy_seconds;
            peak[b] += cell.at_start;
        }
    }
    for &(bucket, live) in peaks {
        if let Some(b) = index(bucket) {
            peak[b] = peak[b].max(live);
        }
    }
    (0..buckets)
        .map(|b| OccupancyBucket {
            start: since + TimeDelta::microseconds((b as f64 * bucket_seconds * 1e6) as i64),
            mean: busy[b] / bucket_seconds,
            peak: peak[b].clamp(0, i64::from(u32::MAX)) as u32,
        })
        .collect()
}

/// Every one of the `count` bins from zero to the longest hold, empty ones
/// included.
fn hold_time_bins(count: u32, rows: &[HoldTimeRow]) -> Vec<HoldTimeBin> {
    let Some(longest) = rows.first().map(|row| row.longest) else {
        return Vec::new();
    };
    let width = longest / f64::from(count);
    let mut bins: Vec<HoldTimeBin> = (0..count)
        .map(|i| HoldTimeBin {
            from: seconds(width * f64::from(i)),
            to: seconds(width * f64::from(i + 1)),
            completed: 0,
            timed_out: 0,
        })
        .collect();
    for row in rows {
        if let Some(bin) = usize::try_from(row.bin).ok().and_then(|i| bins.get_mut(i)) {
            bin.completed += row.completed as u64;
            bin.timed_out += row.timed_out as u64;
        }
    }
    bins
}

impl From<CellRow> for SlotBucket {
    fn from(row: CellRow) -> Self {
        SlotBucket {
            lane: row.lane.max(0) as u32,
            bucket: row.bucket.max(0) as u32,
            busy: seconds(row.busy_seconds),
            claims: row.claims as u64,
            timed_out: row.timed_out as u64,
            top_holder: row.top_holder,
        }
    }
}

impl From<HistoryRow> for ClaimRecord {
    fn from(row: HistoryRow) -> Self {
        let outcome = match row.outcome.as_str() {
            "completed" => Outcome::Completed,
            "dropped" => Outcome::Dropped,
            "timed_out" => Outcome::TimedOut,
            _ => Outcome::Live,
        };
        ClaimRecord {
            kind: SemaphoreKind::lease_if(row.id.is_some()),
            id: row.id,
            slots: row.slots.into_iter().map(|s| s.max(0) as u32).collect(),
            holder: row.holder,
            metadata: row.metadata,
            created_at: row.created_at,
            expires_at: row.expires_at,
            ended_at: row.ended_at,
            outcome,
            held_for: seconds(row.held_seconds),
            group_id: row.group_id,
        }
    }
}

impl From<SummaryRow> for Summary {
    fn from(row: SummaryRow) -> Self {
        let count = |n: i64| n.max(0) as u64;
        Summary {
            kind: SemaphoreKind::lease_if(row.lease),
            completed: count(row.completed),
            dropped: (!row.lease).then(|| count(row.dropped)),
            timed_out: count(row.timed_out),
            live: row.lease.then(|| count(row.live)),
            p50_hold: row.p50.map(seconds),
            p95_hold: row.p95.map(seconds),
            max_hold: row.max.map(seconds),
        }
    }
}

/// `sql`, bound as `$1` `semaphore` and `$2`, `$3` the window, once the
/// window is checked.
fn windowed<O>(
    db: &Db,
    sql: &'static str,
    semaphore: &str,
    window: &Range<DateTime<Utc>>,
) -> Result<Statement<O>>
where
    O: for<'r> FromRow<'r, PgRow>,
{
    validate::time_range(window)?;
    Ok(db
        .query_as(sql)
        .bind(semaphore.to_owned())
        .bind(window.start)
        .bind(window.end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(bucket: i32, busy_seconds: f64, at_start: i64) -> CellRow {
        CellRow {
            lane: 0,
            bucket,
            busy_seconds,
            claims: 1,
            timed_out: 0,
            at_start,
            top_holder: "h".into(),
        }
    }

    #[test]
    fn occupancy_peaks_count_claims_held_across_a_bucket() {
        let since = Utc::now();
        // Bucket 0: two lanes, one claim each held half of it, and a
        // moment with two held. Bucket 3: two claims held through it, no
        // start or end in it.
        let cells = [
            cell(0, 1.0, 0),
            cell(0, 1.0, 1),
            cell(3, 2.0, 1),
            cell(3, 2.0, 1),
        ];
        let buckets = occupancy(since, 2.0, REPORT_BUCKETS, &cells, &[(0, 2)]);
        assert_eq!(buckets.len(), REPORT_BUCKETS as usize);
        assert_eq!((buckets[0].mean, buckets[0].peak), (1.0, 2));
        assert_eq!((buckets[1].mean, buckets[1].peak), (0.0, 0));
        assert_eq!((buckets[3].mean, buckets[3].peak), (2.0, 2));
        assert_eq!(buckets[3].start, since + TimeDelta::seconds(6));
    }

    #[test]
    fn hold_times_fill_every_bin_up_to_the_longest() {
        let row = |bin, completed, timed_out| HoldTimeRow {
            bin,
            longest: 3.0,
            completed,
            timed_out,
        };
        let bins = hold_time_bins(REPORT_HOLD_BINS, &[row(0, 2, 0), row(29, 0, 1)]);
        assert_eq!(bins.len(), REPORT_HOLD_BINS as usize);
        assert_eq!(bins[0].completed, 2);
        assert_eq!(bins[29].timed_out, 1);
        assert_eq!(bins[29].to, Duration::from_secs(3));
        assert_eq!(
            bins.iter().map(|b| b.completed + b.timed_out).sum::<u64>(),
            3
        );
        assert!(hold_time_bins(REPORT_HOLD_BINS, &[]).is_empty());
    }
}

#[cfg(all(test, feature = "serde"))]
mod serialize_tests {
    use serde_json::json;

    use super::*;
    use crate::serialize::at;

    #[test]
    fn a_claim_record_has_the_cli_s_field_names() {
        let claim = ClaimRecord {
            kind: SemaphoreKind::Lease,
            id: Some(7),
            slots: vec![2],
            holder: "web-1".into(),
            metadata: Some(json!({ "request": "r-1" })),
            created_at: at("2026-11-21T08:00:00Z"),
            expires_at: Some(at("2026-11-21T08:01:30Z")),
            ended_at: None,
            outcome: Outcome::TimedOut,
            held_for: Duration::from_millis(1500),
            group_id: None,
        };
        assert_eq!(
            serde_json::to_value(&claim).unwrap(),
            json!({
                "kind": "lease",
                "id": 7,
                "slots": [2],
                "holder": "web-1",
                "metadata": { "request": "r-1" },
                "claimed_at": "2026-11-21T08:00:00Z",
                "expires_at": "2026-11-21T08:01:30Z",
                "ended_at": null,
                "outcome": "timed_out",
                "held_seconds": 1.5,
            })
        );
        // A claim of a multi-limit permit names its group.
        let grouped = ClaimRecord {
            group_id: Some(5),
            ..claim.clone()
        };
        assert_eq!(
            serde_json::to_value(&grouped).unwrap()["group_id"],
            json!(5)
        );
        // An advisory permit has neither an id nor a lease.
        let permit = ClaimRecord {
            kind: SemaphoreKind::Advisory,
            id: None,
            slots: vec![0, 1],
            expires_at: None,
            ended_at: Some(at("2026-11-21T08:00:01.5Z")),
            outcome: Outcome::Dropped,
            ..claim
        };
        let value = serde_json::to_value(&permit).unwrap();
        let mut keys: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "claimed_at",
                "ended_at",
                "held_seconds",
                "holder",
                "kind",
                "metadata",
                "outcome",
                "slots"
            ]
        );
        assert_eq!(value["outcome"], "dropped");
    }

    #[test]
    fn a_summary_says_its_kind_and_only_the_counts_it_fills() {
        let lease = Summary {
            kind: SemaphoreKind::Lease,
            completed: 0,
            dropped: None,
            timed_out: 0,
            live: Some(2),
            p50_hold: None,
            p95_hold: None,
            max_hold: None,
        };
        let value = serde_json::to_value(lease).unwrap();
        assert_eq!(value["kind"], "lease");
        assert_eq!(value["total"], 2);
        assert_eq!(value["p95_hold_seconds"], serde_json::Value::Null);
        assert_eq!(value.get("dropped"), None);
        let advisory = Summary {
            kind: SemaphoreKind::Advisory,
            completed: 1,
            dropped: Some(2),
            timed_out: 3,
            live: None,
            ..lease
        };
        let value = serde_json::to_value(advisory).unwrap();
        assert_eq!(
            (value["total"].as_u64(), value["dropped"].as_u64()),
            (Some(6), Some(2))
        );
        assert_eq!(value.get("live"), None);
    }
}
