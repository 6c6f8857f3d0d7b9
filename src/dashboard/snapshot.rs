//! What the dashboard shows: one sample of the schema and `pg_locks`,
//! gathered with the [`admin`](crate::admin) reads (the same ones
//! `pg-semaphore status` and `doctor` make) and serialized for the page.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::Result;
use crate::admin::{
    self, FamilyInfo, FamilyKeyInfo, HorizonHolder, MutexHolder, OutcomeCounts, OutcomeKind,
    RateLimiterInfo, SemaphoreInfo,
};
use crate::audit::SemaphoreKind;
use crate::db::Db;

/// How far back the per-minute outcome counters go.
pub(crate) const HISTORY: TimeDelta = TimeDelta::minutes(15);

/// How many of each family's busiest keys the page lists.
const BUSIEST: u32 = 10;

/// The waiters of every semaphore's fair queue, by fairness key: the one
/// read the [`admin`] functions do not make. `pgsemaphore.waiters` is
/// readable by the application role; nothing is locked.
const WAITERS: &str = "SELECT w.semaphore, w.fair_key, count(*)::int8, sum(w.permits)::int8,
                              min(w.enqueued_at)
                         FROM pgsemaphore.waiters w
                        GROUP BY w.semaphore, w.fair_key
                        ORDER BY w.semaphore, w.fair_key NULLS FIRST";

/// One sample, as the page receives it (`snapshot.json`, and each event).
#[derive(Debug, Serialize)]
pub(crate) struct Snapshot {
    /// When the sampler read it (its clock; each part has the database's
    /// `as_of` where it has one).
    sampled_at: DateTime<Utc>,
    /// The window of the per-minute counters.
    since: DateTime<Utc>,
    until: DateTime<Utc>,
    semaphores: Vec<SemaphoreView>,
    families: Vec<FamilyView>,
    limiters: Vec<LimiterView>,
    mutexes: Vec<MutexView>,
    horizon: Option<HorizonHolder>,
    /// How long a horizon holder may hold before `doctor` and the reaper
    /// call it a problem.
    horizon_warning_seconds: f64,
}

#[derive(Debug, Serialize)]
struct SemaphoreView {
    #[serde(flatten)]
    info: SemaphoreInfo,
    /// Waiting in the fair queue (a lease semaphore's), in permits.
    waiting: u64,
    /// The queue by fairness key (`null`: the shared default key).
    waiters: Vec<WaitersView>,
    minutes: Vec<Minute>,
}

#[derive(Debug, Serialize)]
struct WaitersView {
    key: Option<String>,
    waiters: u64,
    permits: u64,
    oldest: Option<DateTime<Utc>>,
}

#[derive(Debug, Serialize)]
struct FamilyView {
    #[serde(flatten)]
    info: FamilyInfo,
    busiest: Vec<FamilyKeyInfo>,
    minutes: Vec<Minute>,
}

#[derive(Debug, Serialize)]
struct LimiterView {
    #[serde(flatten)]
    info: RateLimiterInfo,
    paused: bool,
    minutes: Vec<Minute>,
}

#[derive(Debug, Serialize)]
struct MutexView {
    /// `bigint 123` or `pair 1,2`: the key as `pg_locks` holds it.
    key: String,
    pid: i32,
    granted: bool,
    shared: bool,
    application_name: Option<String>,
    client_addr: Option<String>,
    since: Option<DateTime<Utc>>,
}

/// One minute's counts of one name.
#[derive(Debug, Serialize)]
struct Minute {
    minute: DateTime<Utc>,
    admitted: u64,
    refused: u64,
    timed_out: u64,
}

impl From<MutexHolder> for MutexView {
    fn from(m: MutexHolder) -> Self {
        let key = match m.key {
            sqlx::postgres::PgAdvisoryLockKey::BigInt(k) => format!("bigint {k}"),
            sqlx::postgres::PgAdvisoryLockKey::IntPair(a, b) => format!("pair {a},{b}"),
            other => format!("{other:?}"),
        };
        MutexView {
            key,
            pid: m.pid,
            granted: m.granted,
            shared: m.shared,
            application_name: m.application_name,
            client_addr: m.client_addr,
            since: m.since,
        }
    }
}

/// Reads one snapshot: a handful of statements, each a read the
/// application role may make (see the guide's operations chapter).
pub(crate) async fn sample(pool: &PgPool) -> Result<Snapshot> {
    let until = Utc::now();
    let since = until - HISTORY;
    let semaphores = admin::semaphores(pool).await?;
    let families = admin::families(pool).await?;
    let limiters = admin::rate_limiters(pool).await?;
    let mutexes = admin::mutexes(pool).await?;
    let horizon = admin::horizon(pool).await?;
    let mut minutes: HashMap<(OutcomeKind, String), Vec<Minute>> = HashMap::new();
    for row in admin::outcomes(pool, since..until).await? {
        let OutcomeCounts {
            kind,
            name,
            minute,
            admitted,
            refused,
            timed_out,
            ..
        } = row;
        minutes.entry((kind, name)).or_default().push(Minute {
            minute,
            admitted,
            refused,
            timed_out,
        });
    }
    let db = Db::new(pool, true);
    type WaitRow = (String, Option<String>, i64, i64, Option<DateTime<Utc>>);
    let mut waiters: HashMap<String, Vec<WaitersView>> = HashMap::new();
    for (semaphore, key, count, permits, oldest) in
        db.fetch_all(db.query_as::<WaitRow>(WAITERS)).await?
    {
        waiters.entry(semaphore).or_default().push(WaitersView {
            key,
            waiters: count.max(0) as u64,
            permits: permits.max(0) as u64,
            oldest,
        });
    }
    let mut take = |kind: OutcomeKind, name: &str| {
        minutes.remove(&(kind, name.to_owned())).unwrap_or_default()
    };
    let semaphores = semaphores
        .into_iter()
        .map(|info| {
            let kind = match info.kind {
                SemaphoreKind::Advisory => OutcomeKind::Advisory,
                _ => OutcomeKind::Semaphore,
            };
            let minutes = take(kind, &info.name);
            let waiters = match info.kind {
                SemaphoreKind::Lease => waiters.remove(&info.name).unwrap_or_default(),
                _ => Vec::new(),
            };
            SemaphoreView {
                waiting: waiters.iter().map(|w| w.permits).sum(),
                waiters,
                minutes,
                info,
            }
        })
        .collect();
    let mut family_views = Vec::with_capacity(families.len());
    for info in families {
        let busiest = admin::busiest_keys(pool, &info.name, BUSIEST).await?;
        family_views.push(FamilyView {
            minutes: take(OutcomeKind::Family, &info.name),
            busiest,
            info,
        });
    }
    let limiters = limiters
        .into_iter()
        .map(|info| LimiterView {
            minutes: take(info.kind.into(), &info.name),
            paused: info.is_paused(),
            info,
        })
        .collect();
    Ok(Snapshot {
        sampled_at: Utc::now(),
        since,
        until,
        semaphores,
        families: family_views,
        limiters,
        mutexes: mutexes.into_iter().map(MutexView::from).collect(),
        horizon,
        horizon_warning_seconds: crate::limits::DEFAULT_HORIZON_WARNING.as_secs_f64(),
    })
}

/// What the page receives: the last good snapshot, and whether the
/// database answered the last sample (`error`), since when it has not.
#[derive(Debug, Serialize)]
pub(crate) struct Frame<'a> {
    #[serde(flatten)]
    pub(crate) snapshot: Option<&'a Snapshot>,
    pub(crate) error: Option<Outage<'a>>,
    /// How often the sampler samples.
    pub(crate) interval_seconds: f64,
}

/// A sample that failed, and since when they have.
#[derive(Debug, Serialize)]
pub(crate) struct Outage<'a> {
    pub(crate) message: &'a str,
    pub(crate) since: DateTime<Utc>,
}

pub(crate) fn frame(
    snapshot: Option<&Snapshot>,
    error: Option<(&str, DateTime<Utc>)>,
    interval: Duration,
) -> String {
    let frame = Frame {
        snapshot,
        error: error.map(|(message, since)| Outage { message, since }),
        interval_seconds: interval.as_secs_f64(),
    };
    serde_json::to_string(&frame).unwrap_or_else(|e| {
        serde_json::json!({
            "error": {"message": format!("cannot serialize the snapshot: {e}"), "since": Utc::now()},
            "interval_seconds": interval.as_secs_f64(),
        })
        .to_string()
    })
}
