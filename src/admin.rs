//! The operator's side: everything an application needs no more than
//! reading rights for, and everything that needs the operator role under
//! the guide's grants ([operations](crate::guide::operations#privileges)). The `pg-semaphore` CLI is built on these;
//! applications can call them too (an admin endpoint, a runbook script).
//!
//! - Semaphores of either kind: [`semaphores`] lists them with their live
//!   holders (the application role may); [`configure`], [`set_capacity`],
//!   [`force_release`], [`clear_queue`], [`set_queue_order`] and
//!   [`set_fairness_weight`] change them.
//! - Families: [`families`], [`busiest_keys`], [`configure_family`],
//!   [`set_family_rule`], [`set_family_tier`].
//! - Rate limiters' stored limits and pauses: [`rate_limiters`] lists the
//!   limiters with their keys, [`rate_limit_settings`] every stored row,
//!   [`set_rate_limit`] and [`clear_rate_limit`] store and forget a
//!   limiter's (or a key's) limits, [`pause_rate_limit`] and
//!   [`resume_rate_limit`] pause and resume; [`prune_rate_limits`] forgets
//!   idle keys.
//! - The outcome counters, what every process's semaphores, families and
//!   rate limiters refused, timed out and admitted, per minute:
//!   [`outcomes`], [`outcomes_of`] (the [`Client`](crate::Client) writes
//!   them).
//! - Housekeeping: [`Reaper`] (a background task doing [`reap`],
//!   [`prune_claims`] and [`prune_rate_limits`] on an interval), and
//!   [`horizon`], the sessions holding back VACUUM.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::PgPool;

use crate::RatePolicy;
use crate::audit::{Holder, HolderRow, SemaphoreKind};
use crate::db::{Db, Statement, seconds};
use crate::error::{Error, Result, semaphore_not_found};
use crate::semaphore::QueueOrder;
use crate::validate;

pub use crate::family_admin::{
    FamilyInfo, FamilyKeyInfo, FamilyRule, RuleKind, busiest_keys, configure_family, families,
    set_family_rule, set_family_tier,
};
pub use crate::horizon::{HorizonHolder, HorizonHolderKind, horizon};
pub use crate::outcomes::{OutcomeCounts, OutcomeKind, outcomes, outcomes_of};
pub use crate::rate_limit::prune_rate_limits;
pub use crate::reaper::{Reaper, ReaperBuilder, prune_claims, reap};

/// Every semaphore of either kind with its live holders, read in one
/// statement (one snapshot): a lease semaphore's live claims (`lease`
/// true), an advisory semaphore's held slots (the sessions whose advisory
/// locks they are, from `pgsemaphore.advisory_holders`: `pg_locks` and
/// `pg_stat_activity` as the statement reads them; `client_addr` as text
/// without its netmask). `as_of` is the database clock at that statement,
/// so ages and remaining leases are computed on the same clock as the
/// leases themselves.
const STATUS: &str = "\
SELECT true AS lease, s.name, s.capacity,
       extract(epoch FROM s.default_lease)::float8 AS lease_seconds,
       s.created_at AS semaphore_created_at, s.updated_at,
       statement_timestamp() AS as_of,
       l.id, l.slot, l.holder, l.metadata, l.created_at, l.expires_at,
       NULL::int4 AS pid, NULL::text AS application_name, NULL::text AS client_addr,
       NULL::timestamptz AS backend_start, NULL::bool AS shared
  FROM pgsemaphore.semaphores s
  LEFT JOIN pgsemaphore.live_slots l ON l.semaphore = s.name
 WHERE s.family IS NULL OR l.id IS NOT NULL
UNION ALL
SELECT false, a.name, a.capacity, NULL, a.created_at, a.updated_at, statement_timestamp(),
       NULL, h.slot, NULL, NULL, NULL, NULL,
       h.pid, h.application_name, host(h.client_addr), h.backend_start, h.mode = 'shared'
  FROM pgsemaphore.advisory_semaphores a
  LEFT JOIN pgsemaphore.advisory_holders h ON h.semaphore = a.name
 ORDER BY name, lease, created_at, id, slot, pid";

/// Ends a claim, whoever holds it.
const FORCE_RELEASE: &str =
    "SELECT o_outcome, o_semaphore, o_at FROM pgsemaphore.force_release(p_id => $1)";

/// Creates a semaphore or sets its capacity, lease and queue order (NULL
/// keeps one; `p_create` false: an unknown name is an error), waking
/// waiters when the capacity grew or the order changed.
const CONFIGURE: &str = "SELECT o_previous_capacity \
                         FROM pgsemaphore.configure(p_name => $1, p_capacity => $2, \
                                                    p_lease => $3, p_create => $4, \
                                                    p_queue_lifo => $5)";

/// Sets an advisory semaphore's capacity.
const CONFIGURE_ADVISORY: &str = "SELECT o_previous_capacity \
                                  FROM pgsemaphore.configure_advisory(p_name => $1, p_capacity => $2)";

/// Removes every waiter of a semaphore's queue.
const CLEAR_QUEUE: &str = "SELECT pgsemaphore.clear_queue(p_semaphore => $1)";

/// Sets (or removes) the weight of a fairness key in a semaphore's queue.
const SET_FAIR_WEIGHT: &str = "SELECT pgsemaphore.set_fair_weight(p_semaphore => $1, p_fair_key => $2, \
                                                                  p_weight => $3)";
/// Every stored rate limit and pause, with the database clock.
const RATE_SETTINGS: &str = "\
SELECT s.kind, s.limiter, nullif(s.key, '') AS key, s.rate, s.burst, s.permit_limit,
       extract(epoch FROM s.window_length)::float8 AS window_seconds,
       s.paused_until, s.updated_at, statement_timestamp() AS as_of
  FROM pgsemaphore.rate_limit_settings s
 ORDER BY s.kind, s.limiter, s.key";

/// Every rate limiter with stored settings or keys: its limiter-wide
/// limits and pause, how many of its keys have a pause of their own in
/// force, and how many keys it has (a scan of the ledger), with the
/// database clock.
const RATE_LIMITERS: &str = "\
WITH limiters AS (
    SELECT s.kind, s.limiter FROM pgsemaphore.rate_limit_settings s
    UNION
    SELECT l.kind, l.limiter FROM pgsemaphore.rate_ledger l
)
SELECT m.kind, m.limiter, w.rate, w.burst, w.permit_limit,
       extract(epoch FROM w.window_length)::float8 AS window_seconds,
       w.paused_until,
       (SELECT count(*) FROM pgsemaphore.rate_limit_settings k
         WHERE k.kind = m.kind AND k.limiter = m.limiter AND k.key <> ''
           AND k.paused_until > statement_timestamp()) AS paused_keys,
       (SELECT count(DISTINCT l.key) FROM pgsemaphore.rate_ledger l
         WHERE l.kind = m.kind AND l.limiter = m.limiter) AS keys,
       statement_timestamp() AS as_of
  FROM limiters m
  LEFT JOIN pgsemaphore.rate_limit_settings w
         ON w.kind = m.kind AND w.limiter = m.limiter AND w.key = ''
 ORDER BY m.limiter, m.kind";

/// Stores a limiter's (`$3` NULL) or a key's limits.
const SET_RATE_LIMIT: &str = "SELECT pgsemaphore.set_rate_limit(p_kind => $1, p_limiter => $2, \
                              p_key => $3, p_rate => $4, p_burst => $5, p_limit => $6, \
                              p_window => $7) IS NULL";

/// Forgets a limiter's (`$3` NULL) or a key's stored limits.
const CLEAR_RATE_LIMIT: &str =
    "SELECT pgsemaphore.clear_rate_limit(p_kind => $1, p_limiter => $2, p_key => $3)";

/// Pauses a limiter (`$3` NULL) or a key for `$4`; returns the pause's end.
const PAUSE_RATE_LIMIT: &str = "SELECT pgsemaphore.pause_rate_limit(p_kind => $1, p_limiter => $2, \
                                p_key => $3, p_for => $4)";

/// Ends a limiter's (`$3` NULL) or a key's pause.
const RESUME_RATE_LIMIT: &str =
    "SELECT pgsemaphore.resume_rate_limit(p_kind => $1, p_limiter => $2, p_key => $3)";

/// Admin statements run unnamed inside a transaction, so they work through
/// a transaction pooler too; they are never on a hot path.
fn db(pool: &PgPool) -> Db {
    Db::new(pool, true)
}

/// A semaphore as stored, with its live holders; listed by [`semaphores`].
/// Its [`kind`](Self::kind) says whether it is a lease
/// [`Semaphore`](crate::Semaphore) or an
/// [`AdvisorySemaphore`](crate::AdvisorySemaphore), and so what its
/// holders are (see [`Holder`]).
///
/// With the `serde` feature it serializes as `{"kind", "name", "capacity",
/// "held", "default_lease_seconds", "created_at", "updated_at", "as_of",
/// "holders"}` (`default_lease_seconds` for a lease semaphore only), each
/// holder as a [`Holder`]; a lease holder adds its `age_seconds`,
/// `lease_left_seconds` (negative once its lease has run out) and
/// `silent_seconds` (its [`silence`](SemaphoreInfo::silence)) at `as_of`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SemaphoreInfo {
    /// The semaphore's kind.
    pub kind: SemaphoreKind,
    /// The semaphore's name.
    pub name: String,
    /// Its capacity: how many slots may be held at once.
    pub capacity: u32,
    /// Lease: the lease given to claims that do not choose their own.
    pub default_lease: Option<Duration>,
    /// When the semaphore was first built.
    pub created_at: DateTime<Utc>,
    /// When its capacity (or lease) last changed.
    pub updated_at: DateTime<Utc>,
    /// The live holders. A lease semaphore's live claims, oldest first:
    /// some may have an expired lease that no reaper or claim has noticed
    /// yet (see [`Holder::expires_at`]). An advisory semaphore's held
    /// slots, lowest first: after a capacity drop there may be more of them
    /// than the capacity, on slots at or above it, until their holders
    /// release (no new claim is admitted meanwhile).
    pub holders: Vec<Holder>,
    /// The database clock when this was read: compare it with a lease
    /// holder's `created_at` (its age) and `expires_at` (its lease left),
    /// an advisory one's `backend_start`.
    pub as_of: DateTime<Utc>,
}

impl SemaphoreInfo {
    /// How many of its slots are held (an advisory slot held by several
    /// sessions in shared mode counts once).
    pub fn held(&self) -> u32 {
        let mut slots: Vec<u32> = self.holders.iter().map(|h| h.slot).collect();
        slots.sort_unstable();
        slots.dedup();
        slots.len() as u32
    }

    /// How long `holder`, a lease holder of this semaphore, had given no
    /// sign of life at [`as_of`](Self::as_of): the time since its lease was
    /// last renewed, or since its claim if it never was. A holder whose
    /// heartbeat runs shows at most about its heartbeat interval (a third
    /// of the lease by default); one whose silence keeps growing past that
    /// has stopped renewing (its process is gone, hung, or cut off from the
    /// database), and its slot is freed when its lease runs out.
    ///
    /// The database keeps each claim's lease end, not its renewals, so this
    /// is `as_of - (expires_at - default_lease)`, at most the claim's age
    /// and at least zero: exact for a claim with the semaphore's default
    /// lease (every claim that does not set its own with
    /// [`Acquiring::lease`](crate::Acquiring::lease)); a claim with a lease
    /// of its own shows less silence than it had if its lease is longer,
    /// more if shorter. `None` for an advisory holder.
    pub fn silence(&self, holder: &Holder) -> Option<Duration> {
        let lease = TimeDelta::from_std(self.default_lease?).ok()?;
        let claimed = holder.created_at?;
        let renewed = holder.expires_at?.checked_sub_signed(lease)?.max(claimed);
        Some((self.as_of - renewed).to_std().unwrap_or(Duration::ZERO))
    }
}

/// Adds `held`, and each lease holder's age and lease left at `as_of`: the
/// database clock, the one leases are measured on.
#[cfg(feature = "serde")]
impl serde::Serialize for SemaphoreInfo {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;

        use crate::serialize::delta_seconds;
        #[derive(serde::Serialize)]
        struct SeenHolder<'a> {
            #[serde(flatten)]
            holder: &'a Holder,
            #[serde(skip_serializing_if = "Option::is_none")]
            age_seconds: Option<Option<f64>>,
            #[serde(skip_serializing_if = "Option::is_none")]
            lease_left_seconds: Option<Option<f64>>,
            #[serde(skip_serializing_if = "Option::is_none")]
            silent_seconds: Option<f64>,
        }
        let holders: Vec<SeenHolder<'_>> = self
            .holders
            .iter()
            .map(|holder| SeenHolder {
                holder,
                age_seconds: holder.created_at.map(|at| delta_seconds(self.as_of - at)),
                lease_left_seconds: holder.expires_at.map(|at| delta_seconds(at - self.as_of)),
                silent_seconds: self.silence(holder).map(|d| d.as_secs_f64()),
            })
            .collect();
        let mut s = serializer.serialize_struct("SemaphoreInfo", 9)?;
        s.serialize_field("kind", &self.kind)?;
        s.serialize_field("name", &self.name)?;
        s.serialize_field("capacity", &self.capacity)?;
        s.serialize_field("held", &self.held())?;
        if let Some(lease) = self.default_lease {
            s.serialize_field("default_lease_seconds", &lease.as_secs_f64())?;
        }
        s.serialize_field("created_at", &self.created_at)?;
        s.serialize_field("updated_at", &self.updated_at)?;
        s.serialize_field("as_of", &self.as_of)?;
        s.serialize_field("holders", &holders)?;
        s.end()
    }
}

/// What [`force_release`] found.
///
/// With the `serde` feature it serializes as `{"outcome": "released",
/// "semaphore", "at"}` (`already_timed_out`, `already_completed`), or
/// `{"outcome": "not_found"}`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(tag = "outcome", rename_all = "snake_case")
)]
#[non_exhaustive]
pub enum ReleaseOutcome {
    /// The claim was live and is now completed; its semaphore's waiters were
    /// woken. Its holder gets [`Error::PermitLost`] when it releases.
    Released {
        /// The claim's semaphore.
        semaphore: String,
        /// When it was completed (database clock).
        at: DateTime<Utc>,
    },
    /// The claim had already been reaped after its lease expired.
    AlreadyTimedOut {
        /// The claim's semaphore.
        semaphore: String,
        /// When it was reaped.
        at: DateTime<Utc>,
    },
    /// The claim had already been released.
    AlreadyCompleted {
        /// The claim's semaphore.
        semaphore: String,
        /// When it was released.
        at: DateTime<Utc>,
    },
    /// No claim has this id (never existed, or pruned).
    NotFound,
}

#[derive(sqlx::FromRow)]
struct StatusRow {
    lease: bool,
    name: String,
    capacity: i32,
    lease_seconds: Option<f64>,
    semaphore_created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    as_of: DateTime<Utc>,
    #[sqlx(flatten)]
    holder: HolderRow,
}

/// Every semaphore in the database, lease and advisory, by name, each with
/// its [`kind`](SemaphoreInfo::kind) and its live holders: a lease
/// semaphore's live claims, oldest first; the sessions that hold an
/// advisory semaphore's slots, by slot. A name belongs to one kind only. A
/// key of a [semaphore family](crate::SemaphoreFamily) (named
/// `@family/key`) is listed only while it is held: a family may have a
/// million keys ([`families`] and
/// [`busiest_keys`] list them by family).
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// for sem in pg_semaphore::admin::semaphores(&pool).await? {
///     println!("{} ({:?}): {} of {} held", sem.name, sem.kind, sem.held(), sem.capacity);
///     for h in &sem.holders {
///         match (h.id, &h.holder, h.pid) {
///             (Some(id), Some(holder), _) => println!("  #{id} {holder} on slot {}", h.slot),
///             (_, _, pid) => println!("  slot {} by pid {pid:?}", h.slot),
///         }
///     }
/// }
/// # Ok(())
/// # }
/// ```
///
/// # Privileges
///
/// Reads the semaphores' tables and the view
/// `pgsemaphore.advisory_holders`, which the guide's grants give both the
/// application and the operator role. What a role sees of other roles'
/// sessions is limited: see [`Holder`].
///
/// # Errors
///
/// [`Error::Schema`], [`Error::Database`].
///
/// # Cancel safety
///
/// Read-only: cancel at will.
pub async fn semaphores(pool: &PgPool) -> Result<Vec<SemaphoreInfo>> {
    let db = db(pool);
    let rows: Vec<StatusRow> = db.fetch_all(db.query_as(STATUS)).await?;
    let mut list: Vec<SemaphoreInfo> = Vec::new();
    for row in rows {
        let kind = SemaphoreKind::lease_if(row.lease);
        if list
            .last()
            .is_none_or(|last| last.name != row.name || last.kind != kind)
        {
            list.push(SemaphoreInfo {
                kind,
                name: row.name,
                capacity: row.capacity.max(0) as u32,
                default_lease: row.lease_seconds.map(seconds),
                created_at: row.semaphore_created_at,
                updated_at: row.updated_at,
                holders: Vec::new(),
                as_of: row.as_of,
            });
        }
        if let Some(holder) = row.holder.into_holder() {
            list.last_mut().expect("pushed above").holders.push(holder);
        }
    }
    Ok(list)
}

/// Ends the claim `id` now, whoever holds it: for an operator freeing a
/// slot held by a stuck or vanished process without waiting for its lease.
/// Waiters are woken as by a normal release. The holder, if still running,
/// learns it on its own release ([`Error::PermitLost`]) or
/// [`Permit::fence`](crate::Permit::fence); until then it may still be
/// working, so another claimer can overlap with it. Prefer waiting for the
/// lease unless the holder is known to be gone.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// use pg_semaphore::admin::ReleaseOutcome;
/// match pg_semaphore::admin::force_release(&pool, 42).await? {
///     ReleaseOutcome::Released { semaphore, .. } => println!("freed a slot of {semaphore}"),
///     ReleaseOutcome::NotFound => println!("no claim #42"),
///     other => println!("nothing to do: {other:?}"),
/// }
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::Schema`], [`Error::Database`]. A claim that had
/// already ended, or does not exist, is an [`Ok`] outcome.
///
/// # Cancel safety
///
/// One statement: cancelling either releases or not.
pub async fn force_release(pool: &PgPool, id: i64) -> Result<ReleaseOutcome> {
    let db = db(pool);
    let (outcome, semaphore, at): (String, Option<String>, Option<DateTime<Utc>>) =
        db.fetch_one(db.query_as(FORCE_RELEASE).bind(id)).await?;
    Ok(match (outcome.as_str(), semaphore, at) {
        ("released", Some(semaphore), Some(at)) => {
            tracing::info!(semaphore, id, "claim force-released");
            ReleaseOutcome::Released { semaphore, at }
        }
        ("timed_out", Some(semaphore), Some(at)) => {
            ReleaseOutcome::AlreadyTimedOut { semaphore, at }
        }
        ("completed", Some(semaphore), Some(at)) => {
            ReleaseOutcome::AlreadyCompleted { semaphore, at }
        }
        _ => ReleaseOutcome::NotFound,
    })
}

/// Changes the capacity of an existing semaphore, a lease
/// [`Semaphore`](crate::Semaphore) (keeping its default lease) or an
/// [`AdvisorySemaphore`](crate::AdvisorySemaphore), and returns the previous
/// capacity. Growing it wakes waiters at once; shrinking it lets holders
/// above the new capacity keep their slots until they release (new claims
/// see the new capacity, and count those holders until they are gone).
///
/// Processes that open the semaphore with another capacity do not change
/// it back: [`SemaphoreBuilder::build`](crate::SemaphoreBuilder::build)
/// only creates a semaphore that does not exist.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// let previous = pg_semaphore::admin::set_capacity(&pool, "payments-api", 8).await?;
/// println!("payments-api: {previous} -> 8");
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a capacity of 0 or above
/// [`MAX_CAPACITY`](crate::limits::MAX_CAPACITY) or a bad name (nothing is
/// written); [`Error::SemaphoreNotFound`] when no semaphore has this name;
/// [`Error::Stalled`] when an advisory semaphore's row stayed locked by
/// another transaction for 2 s (nothing was changed; retry);
/// [`Error::Schema`], [`Error::Database`].
///
/// # Cancel safety
///
/// One statement: cancelling either applies the change or not.
pub async fn set_capacity(pool: &PgPool, name: &str, capacity: u32) -> Result<u32> {
    validate::name(name)?;
    validate::capacity(capacity)?;
    let previous = match run_configure(pool, name, Some(capacity), None, None, false).await {
        Ok(previous) => previous.unwrap_or(capacity),
        // Not a lease semaphore: an advisory one, perhaps.
        Err(Error::SemaphoreNotFound { .. }) => {
            let db = db(pool);
            let query = db
                .query_as::<(i32,)>(CONFIGURE_ADVISORY)
                .bind(name.to_owned())
                .bind(capacity as i32);
            let (previous,) = db.fetch_one(query).await.map_err(|error| {
                // The semaphore's row stayed locked past the function's
                // lock_timeout (2 s): an advisory_drained or another change
                // left in an open transaction. Nothing was changed.
                if crate::error::sqlstate(&error).as_deref() == Some("55P03") {
                    return Error::Stalled {
                        semaphore: name.to_owned(),
                    };
                }
                semaphore_not_found(error, name)
            })?;
            previous.max(0) as u32
        }
        Err(error) => return Err(error),
    };
    tracing::info!(
        semaphore = name,
        previous,
        capacity,
        "semaphore capacity set"
    );
    Ok(previous)
}

/// Creates the semaphore `name` with this capacity and default lease, or
/// changes an existing one's; returns the previous capacity (`None` when it
/// was created). The operator's counterpart of
/// [`SemaphoreBuilder::build`](crate::SemaphoreBuilder::build), which never
/// changes an existing semaphore. Growing the capacity wakes waiters at once;
/// holders above a reduced one keep their slots until they release. The new
/// lease applies to claims made from now on (and to handles opened from now
/// on; a handle keeps the lease it read when it was opened).
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// use std::time::Duration;
/// pg_semaphore::admin::configure(&pool, "payments-api", 8, Duration::from_secs(60)).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad name, capacity or lease (nothing is
/// written); [`Error::Schema`], [`Error::Database`].
///
/// # Cancel safety
///
/// One statement: cancelling either applies the change or not.
pub async fn configure(
    pool: &PgPool,
    name: &str,
    capacity: u32,
    lease: Duration,
) -> Result<Option<u32>> {
    validate::name(name)?;
    validate::capacity(capacity)?;
    validate::lease(lease)?;
    let previous = run_configure(pool, name, Some(capacity), Some(lease), None, true).await?;
    tracing::info!(
        semaphore = name,
        previous,
        capacity,
        lease_ms = lease.as_millis() as u64,
        "semaphore configured"
    );
    Ok(previous)
}

/// Sets the order in which the semaphore's fair queue serves its waiters
/// (see [`SemaphoreBuilder::queue`](crate::SemaphoreBuilder::queue)): the
/// order is the semaphore's, and claims use the new one at once (handles
/// opened before order their own process's waiters by the old one until
/// they are opened again). Wakes the semaphore's waiters.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// use pg_semaphore::QueueOrder;
/// pg_semaphore::admin::set_queue_order(&pool, "exports", QueueOrder::NewestFirst).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad name; [`Error::SemaphoreNotFound`];
/// [`Error::Schema`], [`Error::Database`].
///
/// # Cancel safety
///
/// One statement: cancelling either applies the change or not.
pub async fn set_queue_order(pool: &PgPool, name: &str, order: QueueOrder) -> Result<()> {
    validate::name(name)?;
    run_configure(pool, name, None, None, Some(order), false).await?;
    tracing::info!(semaphore = name, ?order, "semaphore queue order set");
    Ok(())
}

/// Removes every waiter from the semaphore's fair queue and wakes the
/// semaphore's waiters; returns how many it removed. For a queue that a
/// waiter blocks (a process that keeps renewing its place but never
/// claims): waiting acquires of live processes notice at their next claim
/// and queue again, at the back.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// let removed = pg_semaphore::admin::clear_queue(&pool, "exports").await?;
/// println!("removed {removed} waiters");
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad name; [`Error::SemaphoreNotFound`];
/// [`Error::Schema`], [`Error::Database`].
///
/// # Cancel safety
///
/// One statement: cancelling either clears the queue or not.
pub async fn clear_queue(pool: &PgPool, name: &str) -> Result<u64> {
    validate::name(name)?;
    let db = db(pool);
    let query = db.query_as::<(i64,)>(CLEAR_QUEUE).bind(name.to_owned());
    let (removed,) = db
        .fetch_one(query)
        .await
        .map_err(|error| semaphore_not_found(error, name))?;
    tracing::info!(semaphore = name, removed, "semaphore queue cleared");
    Ok(removed.max(0) as u64)
}

/// Sets the weight of fairness key `key` (`None`: the shared default key,
/// the waiters that carry no key) in the semaphore's fair queue: how many
/// of its waiters one turn of the rotation between keys serves; returns the
/// previous weight. Every key has weight 1 until an operator sets one, and
/// a weight of 1 removes the setting. Waiters queued after the change are
/// placed by the new weight; those already queued keep their place. The
/// rule is [`Acquiring::fairness_key`](crate::Acquiring::fairness_key)'s: with
/// weight `w`, a key has at most `w` waiters in each turn, so with keys A
/// (weight 3) and B (weight 1) both busy, grants go A, A, A, B, A, A, A,
/// B, ...
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// // The paying tenant gets three grants for every one of each other tenant.
/// pg_semaphore::admin::set_fairness_weight(&pool, "exports", Some("tenant-42"), 3).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a weight of 0 or above
/// [`MAX_FAIRNESS_WEIGHT`](crate::limits::MAX_FAIRNESS_WEIGHT), a bad name or key (nothing is written);
/// [`Error::SemaphoreNotFound`] when no lease semaphore has this name;
/// [`Error::Schema`], [`Error::Database`].
///
/// # Cancel safety
///
/// One statement: cancelling either applies the change or not.
pub async fn set_fairness_weight(
    pool: &PgPool,
    name: &str,
    key: Option<&str>,
    weight: u32,
) -> Result<u32> {
    validate::name(name)?;
    if let Some(key) = key {
        validate::fairness_key(key)?;
    }
    validate::fairness_weight(weight)?;
    let db = db(pool);
    let query = db
        .query_as::<(i32,)>(SET_FAIR_WEIGHT)
        .bind(name.to_owned())
        .bind(key.map(str::to_owned))
        .bind(weight as i32);
    let (previous,) = db
        .fetch_one(query)
        .await
        .map_err(|error| semaphore_not_found(error, name))?;
    tracing::info!(
        semaphore = name,
        fairness_key = key,
        previous,
        weight,
        "fairness key weight set"
    );
    Ok(previous.max(1) as u32)
}

async fn run_configure(
    pool: &PgPool,
    name: &str,
    capacity: Option<u32>,
    lease: Option<Duration>,
    order: Option<QueueOrder>,
    create: bool,
) -> Result<Option<u32>> {
    let lease = match lease {
        Some(lease) => Some(validate::lease(lease)?),
        None => None,
    };
    let db = db(pool);
    let query = db
        .query_as::<(Option<i32>,)>(CONFIGURE)
        .bind(name.to_owned())
        .bind(capacity.map(|c| c as i32))
        .bind(lease)
        .bind(create)
        .bind(order.map(QueueOrder::is_lifo));
    let (previous,) = db
        .fetch_one(query)
        .await
        .map_err(|error| semaphore_not_found(error, name))?;
    Ok(previous.map(|p| p.max(0) as u32))
}

/// A rate limiter's kind: which [`RatePolicy`] it enforces, as
/// [`RatePolicy::kind`] says. A limiter is named by its kind and its name
/// (limiters of different kinds never share a name's state or settings),
/// so the operator functions that take no policy ([`clear_rate_limit`],
/// [`pause_rate_limit`], [`resume_rate_limit`]) take a kind, and a
/// [`RateLimitSetting`] that stores no limits (a pause) still says it.
///
/// With the `serde` feature it serializes as `"token_bucket"`,
/// `"fixed_window"`, `"sliding_window"`, the names it parses from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum LimiterKind {
    /// A [`RatePolicy::TokenBucket`].
    TokenBucket,
    /// A [`RatePolicy::FixedWindow`].
    FixedWindow,
    /// A [`RatePolicy::SlidingWindow`].
    SlidingWindow,
}

impl LimiterKind {
    /// The kind's name in the database: `token_bucket`, `fixed_window`,
    /// `sliding_window`.
    pub fn as_str(self) -> &'static str {
        match self {
            LimiterKind::TokenBucket => "token_bucket",
            LimiterKind::FixedWindow => "fixed_window",
            LimiterKind::SlidingWindow => "sliding_window",
        }
    }
}

impl std::fmt::Display for LimiterKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LimiterKind {
    type Err = Error;

    /// Parses `token_bucket`, `fixed_window`, `sliding_window` (also with
    /// `-` for `_`).
    fn from_str(text: &str) -> Result<LimiterKind> {
        match text.replace('-', "_").as_str() {
            "token_bucket" => Ok(LimiterKind::TokenBucket),
            "fixed_window" => Ok(LimiterKind::FixedWindow),
            "sliding_window" => Ok(LimiterKind::SlidingWindow),
            _ => Err(Error::invalid(
                "kind",
                format!("{text:?}: token_bucket, fixed_window or sliding_window"),
            )),
        }
    }
}

/// A rate limiter's (or one key's) stored limits and pause, listed by
/// [`rate_limit_settings`].
///
/// With the `serde` feature it serializes as `{"kind", "limiter", "key",
/// "limit", "paused_until", "updated_at", "as_of"}`, `limit` being the
/// stored [`policy`](Self::policy) (`{"kind", "rate", "burst"}` or `{"kind",
/// "permit_limit", "window_seconds"}`) or `null`.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct RateLimitSetting {
    /// The limiter's kind (also when no limits are stored, a row that only
    /// pauses).
    pub kind: LimiterKind,
    /// The limiter's name.
    pub limiter: String,
    /// The key this row overrides; `None`: every key of the limiter.
    pub key: Option<String>,
    /// The stored limits, a policy of this row's `kind`; `None`: the code's
    /// (or, for a key, the limiter's).
    #[cfg_attr(feature = "serde", serde(rename = "limit"))]
    pub policy: Option<RatePolicy>,
    /// Checks are refused until then (if it is after `as_of`).
    pub paused_until: Option<DateTime<Utc>>,
    /// When the row last changed.
    pub updated_at: DateTime<Utc>,
    /// The database clock when this was read.
    pub as_of: DateTime<Utc>,
}

impl RateLimitSetting {
    /// Whether checks are refused now (at `as_of`) by this row's pause.
    pub fn is_paused(&self) -> bool {
        self.paused_until.is_some_and(|until| until > self.as_of)
    }
}

type SettingRow = (
    String,
    String,
    Option<String>,
    Option<f64>,
    Option<f64>,
    Option<i64>,
    Option<f64>,
    Option<DateTime<Utc>>,
    DateTime<Utc>,
    DateTime<Utc>,
);

/// Every rate limiter's stored limits and pauses (one row per limiter or
/// key that has either), by kind, limiter and key (the limiter's own row
/// first).
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// for setting in pg_semaphore::admin::rate_limit_settings(&pool).await? {
///     println!("{} {} {:?}: {:?}", setting.kind, setting.limiter, setting.key, setting.policy);
/// }
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::Schema`], [`Error::Database`].
///
/// # Cancel safety
///
/// Reads only.
pub async fn rate_limit_settings(pool: &PgPool) -> Result<Vec<RateLimitSetting>> {
    let db = db(pool);
    let rows = db
        .fetch_all(db.query_as::<SettingRow>(RATE_SETTINGS))
        .await?;
    Ok(rows
        .into_iter()
        .filter_map(|row| {
            let (
                kind,
                limiter,
                key,
                rate,
                burst,
                permit_limit,
                window,
                paused_until,
                updated_at,
                as_of,
            ) = row;
            let kind: LimiterKind = kind.parse().ok()?;
            let policy = stored_policy(kind, rate, burst, permit_limit, window);
            Some(RateLimitSetting {
                kind,
                limiter,
                key,
                policy,
                paused_until,
                updated_at,
                as_of,
            })
        })
        .collect())
}

/// A stored pair of limits as the policy of its kind (`None`: no pair).
fn stored_policy(
    kind: LimiterKind,
    rate: Option<f64>,
    burst: Option<f64>,
    permit_limit: Option<i64>,
    window: Option<f64>,
) -> Option<RatePolicy> {
    let permits = |limit: i64| u32::try_from(limit).unwrap_or(u32::MAX);
    match (kind, rate, burst, permit_limit, window) {
        (LimiterKind::TokenBucket, Some(rate), Some(burst), ..) => {
            Some(RatePolicy::token_bucket(rate, burst as u32))
        }
        (LimiterKind::FixedWindow, .., Some(limit), Some(window)) => {
            Some(RatePolicy::fixed_window(permits(limit), seconds(window)))
        }
        (LimiterKind::SlidingWindow, .., Some(limit), Some(window)) => {
            Some(RatePolicy::sliding_window(permits(limit), seconds(window)))
        }
        _ => None,
    }
}

/// A rate limiter as the database knows it, listed by [`rate_limiters`]:
/// its limiter-wide stored limits and pause, and how many keys it has.
///
/// With the `serde` feature it serializes as `{"kind", "name", "limit",
/// "paused_until", "paused_keys", "keys", "as_of"}`, `limit` as in
/// [`RateLimitSetting`].
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct RateLimiterInfo {
    /// The limiter's kind (with its name, what names it).
    pub kind: LimiterKind,
    /// The limiter's name.
    pub name: String,
    /// The limits stored for every key of it (its first check stores its
    /// code's; an operator changes them); `None`: none stored (its next
    /// check stores its code's). Keys may have their own
    /// ([`rate_limit_settings`]).
    #[cfg_attr(feature = "serde", serde(rename = "limit"))]
    pub policy: Option<RatePolicy>,
    /// The end of the pause of every key of it, if one was set (in force
    /// while after `as_of`: [`is_paused`](Self::is_paused)).
    pub paused_until: Option<DateTime<Utc>>,
    /// How many of its keys have a pause of their own in force.
    pub paused_keys: u64,
    /// How many keys it has a state for (`pgsemaphore.rate_limits`; a key
    /// at rest stays until [`prune_rate_limits`] removes it).
    pub keys: u64,
    /// The database clock when this was read.
    pub as_of: DateTime<Utc>,
}

impl RateLimiterInfo {
    /// Whether every key of the limiter is paused now (at `as_of`).
    pub fn is_paused(&self) -> bool {
        self.paused_until.is_some_and(|until| until > self.as_of)
    }
}

/// Every rate limiter that has stored limits, a pause or keys, by name
/// (then kind): its limiter-wide limits and pause, how many keys are paused
/// on their own and how many keys it has, read in one statement (a scan of
/// the ledger, `pgsemaphore.rate_ledger`, to count the keys: an operator's
/// read, not for a hot path). `pg-semaphore status` prints them beside
/// their [`outcomes`].
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// for limiter in pg_semaphore::admin::rate_limiters(&pool).await? {
///     println!("{} {}: {} keys, paused: {}", limiter.kind, limiter.name, limiter.keys, limiter.is_paused());
/// }
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::Schema`], [`Error::Database`].
///
/// # Cancel safety
///
/// Read-only: cancel at will.
pub async fn rate_limiters(pool: &PgPool) -> Result<Vec<RateLimiterInfo>> {
    type Row = (
        String,
        String,
        Option<f64>,
        Option<f64>,
        Option<i64>,
        Option<f64>,
        Option<DateTime<Utc>>,
        i64,
        i64,
        DateTime<Utc>,
    );
    let db = db(pool);
    let rows = db.fetch_all(db.query_as::<Row>(RATE_LIMITERS)).await?;
    Ok(rows
        .into_iter()
        .filter_map(
            |(
                kind,
                name,
                rate,
                burst,
                permit_limit,
                window,
                paused_until,
                paused_keys,
                keys,
                as_of,
            )| {
                let kind: LimiterKind = kind.parse().ok()?;
                Some(RateLimiterInfo {
                    kind,
                    name,
                    policy: stored_policy(kind, rate, burst, permit_limit, window),
                    paused_until,
                    paused_keys: paused_keys.max(0) as u64,
                    keys: keys.max(0) as u64,
                    as_of,
                })
            },
        )
        .collect())
}

/// The checks a target of a setting passes: a limiter's name, a key.
fn rate_target(limiter: &str, key: Option<&str>) -> Result<()> {
    validate::name(limiter)?;
    if let Some(key) = key {
        validate::key(key)?;
    }
    Ok(())
}

/// Stores `policy` for the rate limiter `limiter` of its kind
/// ([`RatePolicy::kind`]) (`key` `None`) or for its key `key` (an override,
/// which beats the limiter's): every check, in every process, applies it
/// instead of the policy its handle was built with, from the key's next
/// check on. A lowered burst caps a key's saved tokens; a window's new
/// limit counts the permits already granted in the current window. Waiting
/// token bucket acquires are told, and shorten their wait if the rate was
/// raised.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// use pg_semaphore::RatePolicy;
/// // The partner raised our quota: 50 per second, bursts of 100, from now on, everywhere.
/// let policy = RatePolicy::token_bucket(50.0, 100);
/// pg_semaphore::admin::set_rate_limit(&pool, "partner-api", None, policy).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad name or key, and limits a builder
/// would refuse (a rate that is not positive or above
/// [`MAX_RATE`](crate::limits::MAX_RATE), a burst or permit limit of 0, a
/// window outside
/// [`MIN_WINDOW`](crate::limits::MIN_WINDOW)..=[`MAX_WINDOW`](crate::limits::MAX_WINDOW); a
/// bucket refilled in more than 366 days: `p_burst`, from the database);
/// [`Error::Schema`]; [`Error::Stalled`]
/// when an application's pause or a limiter's first check left in an open
/// transaction held the limiter's settings row for 2 s (nothing stored);
/// [`Error::Database`] (the operator's grants).
///
/// # Cancel safety
///
/// One statement: cancelling either stores the limits or not.
pub async fn set_rate_limit(
    pool: &PgPool,
    limiter: &str,
    key: Option<&str>,
    policy: RatePolicy,
) -> Result<()> {
    let kind = policy.kind();
    // The statement's one column (`IS NULL` of a void function) says nothing.
    let _: bool = rate_setting(pool, SET_RATE_LIMIT, kind, limiter, key, |query| {
        check_limits(policy)?;
        // A window's length is checked here (`window`).
        let (rate, burst, permit_limit, window) = policy.sql_limits()?.columns();
        Ok(query.bind(rate).bind(burst).bind(permit_limit).bind(window))
    })
    .await?;
    tracing::info!(
        kind = kind.as_str(),
        limiter,
        key,
        ?policy,
        "rate limit stored"
    );
    Ok(())
}

/// The checks of [`set_rate_limit`]'s limits that a builder makes too,
/// but for the window's length ([`RatePolicy::sql_limits`]).
fn check_limits(policy: RatePolicy) -> Result<()> {
    if let RatePolicy::TokenBucket { rate, burst } = policy {
        if !(rate.is_finite() && rate > 0.0 && rate <= crate::limits::MAX_RATE) {
            return Err(Error::invalid(
                "rate",
                format!("{rate}: above 0, at most {}", crate::limits::MAX_RATE),
            ));
        }
        validate::positive("burst", burst.into())
    } else {
        validate::positive("permit_limit", policy.limit().into())
    }
}

/// Forgets the stored limits of `limiter` (`key` `None`) or of its key
/// `key`: a key's checks apply the limiter's stored limits again; a
/// limiter's next check is a first use again and stores its handle's
/// limits. A pause stays. Returns whether limits were
/// stored.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad name or key,
/// [`Error::Schema`], [`Error::Stalled`] (the limiter's
/// settings row held by an open transaction for 2 s), [`Error::Database`].
///
/// # Cancel safety
///
/// One statement: cancelling either forgets the limits or not.
pub async fn clear_rate_limit(
    pool: &PgPool,
    kind: LimiterKind,
    limiter: &str,
    key: Option<&str>,
) -> Result<bool> {
    rate_setting(pool, CLEAR_RATE_LIMIT, kind, limiter, key, Ok).await
}

/// Runs `sql`, a rate settings function of `(kind, limiter, key)` and of
/// the arguments `more` checks and binds after them, once the limiter's
/// name and the key are checked; answers its one column.
async fn rate_setting<T>(
    pool: &PgPool,
    sql: &'static str,
    kind: LimiterKind,
    limiter: &str,
    key: Option<&str>,
    more: impl FnOnce(Statement<(T,)>) -> Result<Statement<(T,)>>,
) -> Result<T>
where
    (T,): for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin + 'static,
{
    rate_target(limiter, key)?;
    let db = db(pool);
    let query = more(
        db.query_as::<(T,)>(sql)
            .bind(kind.as_str())
            .bind(limiter.to_owned())
            .bind(key.map(str::to_owned)),
    )?;
    Ok(db
        .fetch_one(query)
        .await
        .map_err(|e| rate_settings_stalled(e, limiter))?
        .0)
}

/// 55P03 from a rate settings function: the limiter's settings row was held
/// by another transaction for the functions' `lock_timeout` (2 s), as
/// [`Error::Stalled`] naming the limiter; any other error as it is.
fn rate_settings_stalled(error: Error, limiter: &str) -> Error {
    if crate::error::sqlstate(&error).as_deref() == Some("55P03") {
        return Error::Stalled {
            semaphore: limiter.to_owned(),
        };
    }
    error
}

/// Pauses `limiter` (`key` `None`: every key) or its key `key` for
/// `duration`, as [`RateLimiter::pause`](crate::RateLimiter::pause) does
/// from an application (never shortens a pause in force); returns when the
/// pause in force ends.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad name or key, a `duration` below 1 ms
/// or above [`MAX_PAUSE`](crate::limits::MAX_PAUSE); [`Error::Schema`],
/// [`Error::Stalled`] (the settings row held by an open transaction for 2
/// s), [`Error::Database`].
///
/// # Cancel safety
///
/// One statement: cancelling either pauses or not.
pub async fn pause_rate_limit(
    pool: &PgPool,
    kind: LimiterKind,
    limiter: &str,
    key: Option<&str>,
    duration: Duration,
) -> Result<DateTime<Utc>> {
    rate_setting(pool, PAUSE_RATE_LIMIT, kind, limiter, key, |query| {
        Ok(query.bind(validate::pause(duration)?))
    })
    .await
}

/// Ends the pause of `limiter` (`key` `None`) or of its key `key` now,
/// whoever set it; waiting acquires are told and reserve at once. Returns
/// whether a pause was running.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad name or key,
/// [`Error::Schema`], [`Error::Database`] (the operator's grants).
///
/// # Cancel safety
///
/// One statement: cancelling either resumes or not.
pub async fn resume_rate_limit(
    pool: &PgPool,
    kind: LimiterKind,
    limiter: &str,
    key: Option<&str>,
) -> Result<bool> {
    rate_setting(pool, RESUME_RATE_LIMIT, kind, limiter, key, Ok).await
}

/// One advisory lock held, or waited for, in this database that is not an
/// advisory semaphore's slot: a [`Mutex`](crate::Mutex)'s (or any other
/// advisory lock), as `pg_locks` shows it ([`mutexes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MutexHolder {
    /// The lock's key, as [`Mutex::key`](crate::Mutex::key) gives it: match
    /// it against `Mutex::new(name).key()` to name it.
    pub key: sqlx::postgres::PgAdvisoryLockKey,
    /// The backend holding (or waiting for) it.
    pub pid: i32,
    /// Held (`true`), or waited for.
    pub granted: bool,
    /// Shared (`pg_advisory_*_shared`), else exclusive.
    pub shared: bool,
    /// The backend's `application_name` (visible for other roles' sessions
    /// only to a role with `pg_read_all_stats`).
    pub application_name: Option<String>,
    /// The backend's client address.
    pub client_addr: Option<String>,
    /// Since when: the start of the backend's transaction (a
    /// transaction-scoped lock is at most as old), else of its current
    /// state (a session lock held by an idle session).
    pub since: Option<DateTime<Utc>>,
}

/// Every advisory lock in this database that is not an advisory
/// semaphore's slot, held or waited for: the mutexes' holders and waiters,
/// from `pg_locks` (one statement; nothing is locked). `pg-semaphore status`
/// prints them.
///
/// # Errors
///
/// [`Error::Schema`], [`Error::Database`].
pub async fn mutexes(pool: &PgPool) -> Result<Vec<MutexHolder>> {
    type Row = (
        i16,
        i64,
        i64,
        i32,
        bool,
        bool,
        Option<String>,
        Option<String>,
        Option<DateTime<Utc>>,
    );
    let db = db(pool);
    let query = db.query_as::<Row>(
        "SELECT l.objsubid::int2, l.classid::int8, l.objid::int8, l.pid, l.granted,
                l.mode = 'ShareLock', p.application_name, p.client_addr::text,
                coalesce(p.xact_start, p.state_change)
           FROM pg_catalog.pg_locks l
           LEFT JOIN pg_catalog.pg_stat_activity p ON p.pid = l.pid
          WHERE l.locktype = 'advisory'
            AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                               WHERE d.datname = pg_catalog.current_database())
            AND NOT (l.objsubid = 1 AND EXISTS (
                    SELECT 1 FROM pgsemaphore.advisory_semaphores a
                     WHERE ((l.classid::int8 << 32) | l.objid::int8) >= a.key_base
                       AND ((l.classid::int8 << 32) | l.objid::int8) < a.key_base + a.peak_capacity))
          ORDER BY l.objsubid, l.classid, l.objid, l.granted DESC, l.pid",
    );
    let rows = db.fetch_all(query).await?;
    Ok(rows
        .into_iter()
        .map(
            |(subid, high, low, pid, granted, shared, application_name, client_addr, since)| {
                let key = if subid == 2 {
                    sqlx::postgres::PgAdvisoryLockKey::IntPair(
                        high as u32 as i32,
                        low as u32 as i32,
                    )
                } else {
                    sqlx::postgres::PgAdvisoryLockKey::BigInt((high << 32) | low)
                };
                MutexHolder {
                    key,
                    pid,
                    granted,
                    shared,
                    application_name,
                    client_addr,
                    since,
                }
            },
        )
        .collect())
}

/// A part of the schema a role can be given ([`grant_access`]): what an
/// application needs, or what an operator needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Access {
    /// Building, claiming, releasing, waiting, checking rate limits; reading
    /// the schema's tables (the audit log, status).
    Application,
    /// The operator's functions: capacities, force-release, reaping and
    /// pruning, families' rules, stored rate limits and pauses; reading the
    /// schema's tables.
    Operator,
}

/// The operator's routines: `grant_access`'s operator part, less what the
/// application's part has too.
pub(crate) const OPERATOR_ROUTINES: &[&str] = &[
    "configure",
    "force_release",
    "clear_queue",
    "reap",
    "prune",
    "prune_rate_limits",
    "configure_advisory",
    "set_fair_weight",
    "set_rate_limit",
    "clear_rate_limit",
    "resume_rate_limit",
    "configure_family",
    "set_family_rule",
    "set_family_tier",
    "reap_family_keys",
];

impl Access {
    /// The part a role lacks when PostgreSQL said `denied` ("permission
    /// denied for function configure"): the operator's for an operator's
    /// routine, else the application's.
    pub(crate) fn needed_for(denied: &str) -> Access {
        let routine = denied.rsplit(['.', ' ']).next().unwrap_or_default();
        let of_routine = denied.contains(" function ") || denied.contains(" procedure ");
        if of_routine && OPERATOR_ROUTINES.contains(&routine) {
            Access::Operator
        } else {
            Access::Application
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Access::Application => "application",
            Access::Operator => "operator",
        }
    }
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Gives `role` one part of the schema in one call: `USAGE` on it,
/// `SELECT` on its tables, `EXECUTE` on exactly the routines of that part
/// (`pgsemaphore.grant_access`). The role is recorded, and a later upgrade
/// of the schema gives it what the upgrade adds: nothing to re-run. Run it
/// with a pool of the role that ran the migrations (the schema's owner).
/// Idempotent. Returns how many routines it granted. The CLI's
/// `pg-semaphore grant --application ROLE` does the same.
///
/// ```no_run
/// use pg_semaphore::admin::{Access, grant_access};
///
/// # async fn run(owner: sqlx::PgPool) -> pg_semaphore::Result<()> {
/// grant_access(&owner, "app", Access::Application).await?;
/// grant_access(&owner, "ops", Access::Operator).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] (`role`) for an empty name, a role that does
/// not exist, or the schema's owner itself; [`Error::Database`] (SQLSTATE
/// 42501, "only the owner of schema pgsemaphore ... can grant access") when
/// this pool's role is not the schema's owner: nothing was granted;
/// [`Error::Schema`]; [`Error::Database`].
///
/// # Cancel safety
///
/// One statement: cancelling grants all or nothing.
pub async fn grant_access(pool: &PgPool, role: &str, access: Access) -> Result<u32> {
    if role.is_empty() || role.contains('\0') {
        return Err(Error::invalid(
            "role",
            "a role's name, not empty, without NUL",
        ));
    }
    let db = db(pool);
    let exists = db
        .query_as::<(Option<String>,)>("SELECT to_regrole(quote_ident($1))::text")
        .bind(role.to_owned());
    if db.fetch_one(exists).await?.0.is_none() {
        return Err(Error::invalid("role", format!("no role named {role:?}")));
    }
    let query = db
        .query_as::<(i32,)>(
            "SELECT pgsemaphore.grant_access(p_role => quote_ident($1)::regrole, p_part => $2)",
        )
        .bind(role.to_owned())
        .bind(access.as_str());
    match db.fetch_one(query).await {
        Ok((granted,)) => Ok(granted.max(0) as u32),
        Err(Error::Database(error))
            if error.as_database_error().and_then(|e| e.code()).as_deref() == Some("22023") =>
        {
            let reason = error
                .as_database_error()
                .map(|e| e.message().to_owned())
                .unwrap_or_default();
            Err(Error::invalid("role", reason))
        }
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod access_tests {
    use super::{Access, OPERATOR_ROUTINES};

    /// The routines of `grant_access`'s `part` array in the migration.
    fn granted(part: &str) -> Vec<String> {
        let sql = include_str!("../migrations/20261128010007_pgsemaphore_operator.sql");
        let body = &sql[sql
            .find("CREATE FUNCTION pgsemaphore.grant_access")
            .expect("defined")..];
        let array = match part {
            "application" => body.split("WHEN 'application' THEN ARRAY[").nth(1),
            _ => body.split("ELSE ARRAY[").nth(1),
        };
        array
            .and_then(|a| a.split("]\n").next())
            .expect("the part's array")
            .split("'pgsemaphore.")
            .skip(1)
            .map(|routine| routine.split('(').next().unwrap_or_default().to_owned())
            .collect()
    }

    #[test]
    fn the_operator_routines_are_the_operator_part_less_the_applications() {
        let application = granted("application");
        let mut operator_only: Vec<String> = granted("operator")
            .into_iter()
            .filter(|r| !application.contains(r))
            .collect();
        let mut listed: Vec<String> = OPERATOR_ROUTINES.iter().map(|r| r.to_string()).collect();
        operator_only.sort();
        listed.sort();
        assert!(application.len() > 30, "{application:?}");
        assert_eq!(operator_only, listed);
    }

    #[test]
    fn a_denied_routine_names_the_part_it_belongs_to() {
        for (denied, access) in [
            ("permission denied for function configure", Access::Operator),
            (
                "permission denied for function reap_family_keys",
                Access::Operator,
            ),
            ("permission denied for function claim", Access::Application),
            (
                "permission denied for procedure release_then_wake",
                Access::Application,
            ),
            (
                "permission denied for schema pgsemaphore",
                Access::Application,
            ),
            ("permission denied for table slots", Access::Application),
        ] {
            assert_eq!(Access::needed_for(denied), access, "{denied}");
        }
    }
}

#[cfg(all(test, feature = "serde"))]
mod serialize_tests {
    use serde_json::json;

    use super::*;
    use crate::serialize::at;

    fn lease_holder(created_at: &str, expires_at: &str) -> Holder {
        Holder {
            kind: SemaphoreKind::Lease,
            slot: 0,
            id: Some(1),
            holder: Some("a".into()),
            metadata: None,
            created_at: Some(at(created_at)),
            expires_at: Some(at(expires_at)),
            pid: None,
            application_name: None,
            client_addr: None,
            backend_start: None,
            shared: None,
        }
    }

    fn advisory_holder(slot: u32, pid: i32, visible: bool) -> Holder {
        Holder {
            kind: SemaphoreKind::Advisory,
            slot,
            id: None,
            holder: None,
            metadata: None,
            created_at: None,
            expires_at: None,
            pid: Some(pid),
            application_name: Some("pg-semaphore advisory".into()),
            client_addr: visible.then(|| "10.0.0.7".into()),
            backend_start: visible.then(|| at("2026-11-21T07:59:00Z")),
            shared: Some(false),
        }
    }

    #[test]
    fn a_semaphore_s_holders_carry_their_age_and_lease_left() {
        let info = SemaphoreInfo {
            kind: SemaphoreKind::Lease,
            name: "payments".into(),
            capacity: 3,
            default_lease: Some(Duration::from_secs(600)),
            created_at: at("2026-11-21T07:00:00Z"),
            updated_at: at("2026-11-21T07:00:00Z"),
            holders: vec![lease_holder("2026-11-21T08:00:00Z", "2026-11-21T08:00:10Z")],
            as_of: at("2026-11-21T08:00:12.5Z"),
        };
        let value = serde_json::to_value(&info).unwrap();
        assert_eq!(value["kind"], "lease");
        assert_eq!(value["held"], 1);
        assert_eq!(value["default_lease_seconds"], 600.0);
        assert_eq!(
            value["holders"][0],
            json!({
                "kind": "lease",
                "id": 1,
                "slot": 0,
                "holder": "a",
                "metadata": null,
                "claimed_at": "2026-11-21T08:00:00Z",
                "expires_at": "2026-11-21T08:00:10Z",
                "age_seconds": 12.5,
                "lease_left_seconds": -2.5,
                "silent_seconds": 12.5,
            })
        );
    }

    #[test]
    fn a_lease_holder_s_silence_is_the_time_since_its_last_renewal() {
        let info = SemaphoreInfo {
            kind: SemaphoreKind::Lease,
            name: "payments".into(),
            capacity: 3,
            default_lease: Some(Duration::from_secs(600)),
            created_at: at("2026-11-21T07:00:00Z"),
            updated_at: at("2026-11-21T07:00:00Z"),
            holders: Vec::new(),
            as_of: at("2026-11-21T08:00:12.5Z"),
        };
        let silence = |expires_at: &str| {
            info.silence(&lease_holder("2026-11-21T08:00:00Z", expires_at))
                .map(|d| d.as_secs_f64())
        };
        // Renewed at 08:00:05: its lease ends one default lease after that.
        assert_eq!(silence("2026-11-21T08:10:05Z"), Some(7.5));
        // Never renewed: silent since its claim.
        assert_eq!(silence("2026-11-21T08:10:00Z"), Some(12.5));
        // A shorter lease of its own: never more than its age.
        assert_eq!(silence("2026-11-21T08:00:10Z"), Some(12.5));
        // A longer lease of its own, just renewed: never less than zero.
        assert_eq!(silence("2026-11-21T09:00:12Z"), Some(0.0));
        assert_eq!(info.silence(&advisory_holder(0, 4242, true)), None);
    }

    #[test]
    fn an_advisory_semaphore_says_its_kind_and_its_holders_sessions() {
        let info = SemaphoreInfo {
            kind: SemaphoreKind::Advisory,
            name: "exports".into(),
            capacity: 3,
            default_lease: None,
            created_at: at("2026-11-21T07:00:00Z"),
            updated_at: at("2026-11-21T07:30:00Z"),
            holders: vec![
                advisory_holder(0, 4242, true),
                advisory_holder(2, 4243, false),
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
                        "kind": "advisory",
                        "slot": 0,
                        "pid": 4242,
                        "application_name": "pg-semaphore advisory",
                        "client_addr": "10.0.0.7",
                        "backend_start": "2026-11-21T07:59:00Z",
                        "shared": false,
                    },
                    {
                        "kind": "advisory",
                        "slot": 2,
                        "pid": 4243,
                        "application_name": "pg-semaphore advisory",
                        "client_addr": null,
                        "backend_start": null,
                        "shared": false,
                    },
                ],
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

    #[test]
    fn a_rate_limit_setting_gives_its_policy_as_limit() {
        let setting = |policy| RateLimitSetting {
            kind: LimiterKind::SlidingWindow,
            limiter: "api".into(),
            key: None,
            policy,
            paused_until: None,
            updated_at: at("2026-11-21T08:00:00Z"),
            as_of: at("2026-11-21T08:00:01Z"),
        };
        let policy = RatePolicy::sliding_window(100, Duration::from_secs(60));
        assert_eq!(
            serde_json::to_value(setting(Some(policy))).unwrap(),
            json!({
                "kind": "sliding_window",
                "limiter": "api",
                "key": null,
                "limit": {"kind": "sliding_window", "permit_limit": 100, "window_seconds": 60.0},
                "paused_until": null,
                "updated_at": "2026-11-21T08:00:00Z",
                "as_of": "2026-11-21T08:00:01Z",
            })
        );
        assert_eq!(
            serde_json::to_value(setting(None)).unwrap()["limit"],
            json!(null)
        );
    }
}
