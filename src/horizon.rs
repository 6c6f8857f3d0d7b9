//! What holds back VACUUM on the database's tables: the oldest snapshot or
//! transaction id still needed, and who holds it ([`horizon`]).
//!
//! The lease semaphore updates rows on every call (the rate limiters only
//! insert, and read each key's newest row); the
//! row versions it leaves behind can only be removed once no transaction
//! that might still see them is running. One long query, an `idle in
//! transaction` session, a `pg_dump`, a prepared transaction or a
//! replication slot holds that *xmin horizon* for the whole database, and
//! every claim then walks more dead versions than the last (see the guide,
//! [a held xmin horizon](crate::guide::guarantees#a-held-xmin-horizon)). This module names the culprit; the [`Reaper`](crate::admin::Reaper)
//! warns about it and records it as a metric, and `pg-semaphore doctor`
//! prints it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::db::Db;
use crate::error::Result;

/// The oldest holder of the xmin horizon that governs the current
/// database's tables. Sessions of other databases do not count (PostgreSQL
/// keeps a horizon per database for ordinary tables); a walsender with
/// `hot_standby_feedback` and a physical replication slot count for every
/// database. The caller's own session is left out.
const OLDEST: &str = "
SELECT kind, pid, user_name, application_name, state, since, name,
       xmin::text::bigint AS xmin, age(xmin)::bigint AS age_xids,
       extract(epoch FROM now() - since)::float8 AS held_for_seconds
FROM (
    SELECT 'session' AS kind, a.pid, a.usename::text AS user_name,
           a.application_name, a.state,
           coalesce(a.xact_start, a.query_start) AS since, NULL::text AS name,
           CASE WHEN a.backend_xid IS NULL THEN a.backend_xmin
                WHEN a.backend_xmin IS NULL THEN a.backend_xid
                WHEN age(a.backend_xid) > age(a.backend_xmin) THEN a.backend_xid
                ELSE a.backend_xmin END AS xmin
    FROM pg_stat_activity a
    WHERE a.pid <> pg_backend_pid()
      AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
      -- This database's sessions, and walsenders (no database) feeding back
      -- a standby's horizon. VACUUM's own snapshot holds nothing back.
      AND (a.datname = current_database() OR a.datname IS NULL)
      AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
    UNION ALL
    SELECT 'replication_slot', s.active_pid, NULL, NULL, NULL, NULL,
           s.slot_name::text, s.xmin
    FROM pg_replication_slots s
    WHERE s.xmin IS NOT NULL
      AND (s.database IS NULL OR s.database = current_database())
    UNION ALL
    SELECT 'prepared_transaction', NULL, p.owner::text, NULL, NULL, p.prepared,
           p.gid, p.transaction
    FROM pg_prepared_xacts p
    WHERE p.database = current_database()
) holders
ORDER BY age(xmin) DESC
LIMIT 1";

/// Who holds the xmin horizon: see [`horizon`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "snake_case")
)]
#[non_exhaustive]
pub enum HorizonHolderKind {
    /// A session: a running query, an open transaction (`idle in
    /// transaction`), a `pg_dump`, or a walsender relaying a standby's
    /// `hot_standby_feedback`.
    Session,
    /// A replication slot whose consumer has not caught up.
    ReplicationSlot,
    /// A prepared transaction (`PREPARE TRANSACTION`) never committed or
    /// rolled back.
    PreparedTransaction,
}

/// The oldest holder of the xmin horizon of the current database, as
/// [`horizon`] found it.
///
/// What a role can see of other roles' sessions is limited: without the
/// `pg_read_all_stats` role (or `pg_monitor`), `since`, `held_for` and
/// `state` are `None` for sessions of other roles; the pid, user,
/// application and the xid age are always there.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct HorizonHolder {
    /// A session, a replication slot or a prepared transaction.
    pub kind: HorizonHolderKind,
    /// The session's backend pid (for a slot: its consumer's, when active).
    /// `SELECT pg_terminate_backend(pid)` ends it.
    pub pid: Option<i32>,
    /// The session's or the prepared transaction's role.
    pub user: Option<String>,
    /// The session's `application_name`.
    pub application_name: Option<String>,
    /// The session's state (`active`, `idle in transaction`, ...).
    pub state: Option<String>,
    /// The slot's name, or the prepared transaction's gid.
    pub name: Option<String>,
    /// When its transaction (or query) began, or the transaction was
    /// prepared.
    pub since: Option<DateTime<Utc>>,
    /// How long it has held the horizon so far (`now() - since`).
    #[cfg_attr(
        feature = "serde",
        serde(
            rename = "held_for_seconds",
            serialize_with = "crate::serialize::opt_seconds"
        )
    )]
    pub held_for: Option<Duration>,
    /// The transaction id it holds the horizon at.
    pub xmin: i64,
    /// How many transaction ids began since: the row versions of all of
    /// them that VACUUM cannot remove yet.
    pub age_xids: i64,
}

/// `pid 1234 (application "report", user "etl", idle in transaction)`, or
/// a replication slot's or prepared transaction's name.
impl std::fmt::Display for HorizonHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.kind, &self.name, self.pid) {
            (HorizonHolderKind::ReplicationSlot, Some(name), _) => {
                write!(f, "replication slot {name:?}")?
            }
            (HorizonHolderKind::PreparedTransaction, Some(gid), _) => {
                write!(f, "prepared transaction {gid:?}")?
            }
            (_, _, Some(pid)) => write!(f, "pid {pid}")?,
            _ => f.write_str("an unknown session")?,
        }
        let mut details = Vec::new();
        if let Some(app) = &self.application_name {
            details.push(format!("application {app:?}"));
        }
        if let Some(user) = &self.user {
            details.push(format!("user {user:?}"));
        }
        if let Some(state) = &self.state {
            details.push(state.clone());
        }
        if !details.is_empty() {
            write!(f, " ({})", details.join(", "))?;
        }
        Ok(())
    }
}

#[derive(sqlx::FromRow)]
struct Row {
    kind: String,
    pid: Option<i32>,
    user_name: Option<String>,
    application_name: Option<String>,
    state: Option<String>,
    since: Option<DateTime<Utc>>,
    name: Option<String>,
    xmin: i64,
    age_xids: i64,
    held_for_seconds: Option<f64>,
}

/// The oldest holder of the xmin horizon that governs this database's
/// tables (pg-semaphore's among them), or `None` when no other session,
/// slot or prepared transaction holds one.
///
/// Every session running a statement holds the horizon for that statement:
/// a young holder is normal. What matters is `held_for` (or, when it is not
/// visible, an `age_xids` that keeps growing): minutes mean the lease
/// semaphore is slowing down by the second.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// use std::time::Duration;
/// if let Some(h) = pg_semaphore::admin::horizon(&pool).await? {
///     if h.held_for.is_some_and(|d| d > Duration::from_secs(300)) {
///         eprintln!(
///             "VACUUM held back for {:?} by pid {:?} ({:?}, {:?}): {} xids",
///             h.held_for, h.pid, h.application_name, h.state, h.age_xids
///         );
///     }
/// }
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) when the statistics views
/// cannot be read.
///
/// # Cancel safety
///
/// Read-only: cancel at will.
pub async fn horizon(pool: &PgPool) -> Result<Option<HorizonHolder>> {
    let db = Db::new(pool, true);
    let row: Option<Row> = db.fetch_optional(db.query_as(OLDEST)).await?;
    Ok(row.map(|row| HorizonHolder {
        kind: match row.kind.as_str() {
            "replication_slot" => HorizonHolderKind::ReplicationSlot,
            "prepared_transaction" => HorizonHolderKind::PreparedTransaction,
            _ => HorizonHolderKind::Session,
        },
        pid: row.pid,
        user: row.user_name,
        application_name: row.application_name.filter(|a| !a.is_empty()),
        state: row.state,
        name: row.name,
        since: row.since,
        held_for: row
            .held_for_seconds
            .and_then(|s| Duration::try_from_secs_f64(s.max(0.0)).ok()),
        xmin: row.xmin,
        age_xids: row.age_xids,
    }))
}

/// How long the reaper has seen the same holder (pid and xmin) hold the
/// horizon: a lower bound on `held_for` that needs no privilege.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    seen: Option<(Option<i32>, i64, tokio::time::Instant)>,
    warned_at: Option<tokio::time::Instant>,
}

impl Watch {
    /// The holder's age as the server reports it or as watched, whichever is
    /// longer.
    pub(crate) fn observe(&mut self, holder: &HorizonHolder) -> Duration {
        let now = tokio::time::Instant::now();
        let key = (holder.pid, holder.xmin);
        let first = match self.seen {
            Some((pid, xmin, first)) if (pid, xmin) == key => first,
            _ => {
                self.seen = Some((key.0, key.1, now));
                self.warned_at = None;
                now
            }
        };
        holder.held_for.unwrap_or_default().max(now - first)
    }

    /// Whether to warn now: the first time a holder passes the threshold,
    /// then at most once per `every`.
    pub(crate) fn should_warn(&mut self, every: Duration) -> bool {
        let now = tokio::time::Instant::now();
        if self.warned_at.is_some_and(|at| now - at < every) {
            return false;
        }
        self.warned_at = Some(now);
        true
    }

    pub(crate) fn clear(&mut self) {
        self.seen = None;
        self.warned_at = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pid: i32, xmin: i64, held_for: Option<Duration>) -> HorizonHolder {
        HorizonHolder {
            kind: HorizonHolderKind::Session,
            pid: Some(pid),
            user: None,
            application_name: None,
            state: None,
            name: None,
            since: None,
            held_for,
            xmin,
            age_xids: 0,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_watch_measures_a_holder_it_cannot_see_the_start_of() {
        let mut watch = Watch::default();
        assert_eq!(watch.observe(&holder(1, 100, None)), Duration::ZERO);
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(
            watch.observe(&holder(1, 100, None)),
            Duration::from_secs(90)
        );
        // The server's own figure counts when it is longer.
        assert_eq!(
            watch.observe(&holder(1, 100, Some(Duration::from_secs(600)))),
            Duration::from_secs(600)
        );
        // Another xmin (a new transaction of the same session) starts over.
        assert_eq!(watch.observe(&holder(1, 250, None)), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn the_watch_warns_at_most_once_per_period_and_again_for_a_new_holder() {
        let mut watch = Watch::default();
        let every = Duration::from_secs(300);
        watch.observe(&holder(1, 100, None));
        assert!(watch.should_warn(every));
        tokio::time::advance(Duration::from_secs(10)).await;
        watch.observe(&holder(1, 100, None));
        assert!(!watch.should_warn(every));
        tokio::time::advance(every).await;
        watch.observe(&holder(1, 100, None));
        assert!(watch.should_warn(every));
        // A new holder is warned about as soon as it passes the threshold.
        watch.observe(&holder(2, 300, None));
        assert!(watch.should_warn(every));
    }
}
