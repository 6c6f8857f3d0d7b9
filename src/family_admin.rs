//! The operator's side of semaphore families
//! ([`SemaphoreFamily`](crate::SemaphoreFamily)): list families with their
//! rules, the busiest keys with their holders; change a family's defaults,
//! its rules and its keys' tiers. Every change recomputes the capacity of
//! the family's existing keys in the same transaction (see
//! `migrations/20261128010005_pgsemaphore_families.sql`). Under the
//! guide's grants ([operations](crate::guide::operations#privileges)), listing needs only the application role; changing needs
//! the operator role.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::audit::{Holder, HolderRow};
use crate::db::{Db, Statement, seconds};
use crate::error::{Result, family_not_found};
use crate::validate;

/// Every family with its settings and how many keys exist now.
const FAMILIES: &str = "\
SELECT f.name, f.default_capacity,
       extract(epoch FROM f.default_lease)::float8 AS lease_seconds,
       extract(epoch FROM f.idle_after)::float8 AS idle_seconds,
       f.created_at, f.updated_at,
       (SELECT count(*) FROM pgsemaphore.semaphores s WHERE s.family = f.name) AS keys,
       (SELECT count(*) FROM pgsemaphore.family_tiers t WHERE t.family = f.name) AS tiered
  FROM pgsemaphore.families f
 ORDER BY f.name";

/// Every rule of every family.
const RULES: &str = "\
SELECT r.family, r.kind, r.match, r.capacity
  FROM pgsemaphore.family_rules r
 ORDER BY r.family, r.kind, r.match";

/// The `$2` keys of family `$1` with the most live claims, each with its
/// live claims, in one statement.
const BUSIEST: &str = "\
WITH busy AS (
    SELECT s.name, s.family_key, s.capacity, count(*) AS held
      FROM pgsemaphore.semaphores s
      JOIN pgsemaphore.live_slots l ON l.semaphore = s.name
     WHERE s.family = $1
     GROUP BY s.name, s.family_key, s.capacity
     ORDER BY held DESC, s.family_key
     LIMIT $2
)
SELECT b.family_key, b.capacity, b.held,
       l.id, l.slot, l.holder, l.metadata, l.created_at, l.expires_at
  FROM busy b
  JOIN pgsemaphore.live_slots l ON l.semaphore = b.name
 ORDER BY b.held DESC, b.family_key, l.created_at, l.id";

/// Changes a family's defaults (NULL keeps one) and recomputes its keys.
const CONFIGURE_FAMILY: &str = "\
SELECT o_keys_changed FROM pgsemaphore.configure_family(
    p_family => $1, p_capacity => $2, p_lease => $3, p_idle_after => $4, p_create => false)";

/// Sets or removes a capacity rule and recomputes the keys it may change.
const SET_RULE: &str = "SELECT pgsemaphore.set_family_rule(\
                        p_family => $1, p_kind => $2, p_match => $3, p_capacity => $4)";

/// Puts a key in a tier (or none) and recomputes it.
const SET_TIER: &str =
    "SELECT pgsemaphore.set_family_tier(p_family => $1, p_key => $2, p_tier => $3)";

/// Never on a hot path; unnamed statements, so they work through a
/// transaction pooler too.
fn db(pool: &PgPool) -> Db {
    Db::new(pool, true)
}

/// Runs one of the statements that change a family's keys (the family
/// bound first, then what `bind` adds) and returns how many keys changed.
async fn change_keys(
    pool: &PgPool,
    family: &str,
    sql: &'static str,
    bind: impl FnOnce(Statement<(i64,)>) -> Statement<(i64,)>,
) -> Result<i64> {
    let db = db(pool);
    let query = bind(db.query_as(sql).bind(family.to_owned()));
    let (changed,) = db
        .fetch_one(query)
        .await
        .map_err(|e| family_not_found(e, family))?;
    Ok(changed)
}

/// What a capacity rule of a family matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "snake_case")
)]
pub enum RuleKind {
    /// One key, exactly: wins over every other rule.
    Key,
    /// Every key the operator put in this tier
    /// ([`set_family_tier`]): wins over the family's default.
    Tier,
}

impl RuleKind {
    fn as_sql(self) -> &'static str {
        match self {
            RuleKind::Key => "key",
            RuleKind::Tier => "tier",
        }
    }
}

/// One capacity rule of a family.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct FamilyRule {
    /// A key rule or a tier rule.
    pub kind: RuleKind,
    /// The key, or the tier.
    #[cfg_attr(feature = "serde", serde(rename = "match"))]
    pub matches: String,
    /// The capacity it gives.
    pub capacity: u32,
}

/// A semaphore family as stored, listed by [`families`].
///
/// With the `serde` feature: `{"name", "default_capacity",
/// "default_lease_seconds", "idle_after_seconds", "keys", "tiered_keys",
/// "rules", "created_at", "updated_at"}`.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct FamilyInfo {
    /// The family's name.
    pub name: String,
    /// The capacity of a key no rule matches.
    pub default_capacity: u32,
    /// The lease of every key.
    #[cfg_attr(
        feature = "serde",
        serde(
            rename = "default_lease_seconds",
            serialize_with = "crate::serialize::seconds"
        )
    )]
    pub default_lease: Duration,
    /// How long a key nothing references stays before the reaper removes it.
    #[cfg_attr(
        feature = "serde",
        serde(
            rename = "idle_after_seconds",
            serialize_with = "crate::serialize::seconds"
        )
    )]
    pub idle_after: Duration,
    /// How many keys exist now (each a semaphore).
    pub keys: u64,
    /// How many keys the operator put in a tier.
    pub tiered_keys: u64,
    /// Its capacity rules, key rules first.
    pub rules: Vec<FamilyRule>,
    /// When the family was created.
    pub created_at: DateTime<Utc>,
    /// When its defaults last changed.
    pub updated_at: DateTime<Utc>,
}

/// A key of a family with its live claims, listed by [`busiest_keys`].
///
/// With the `serde` feature: `{"key", "capacity", "held", "holders"}`.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct FamilyKeyInfo {
    /// The key.
    pub key: String,
    /// Its capacity now.
    pub capacity: u32,
    /// How many live claims it has.
    pub held: u32,
    /// The live claims, oldest first.
    pub holders: Vec<Holder>,
}

#[derive(sqlx::FromRow)]
struct FamilyRow {
    name: String,
    default_capacity: i32,
    lease_seconds: f64,
    idle_seconds: f64,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    keys: i64,
    tiered: i64,
}

#[derive(sqlx::FromRow)]
struct RuleRow {
    family: String,
    kind: String,
    #[sqlx(rename = "match")]
    matches: String,
    capacity: i32,
}

#[derive(sqlx::FromRow)]
struct BusyRow {
    family_key: String,
    capacity: i32,
    held: i64,
    #[sqlx(flatten)]
    holder: HolderRow,
}

/// Every semaphore family, by name, with its settings, rules and key count.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// for family in pg_semaphore::admin::families(&pool).await? {
///     println!("{}: {} keys, default {}", family.name, family.keys, family.default_capacity);
///     for rule in &family.rules {
///         println!("  {:?} {} -> {}", rule.kind, rule.matches, rule.capacity);
///     }
/// }
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::Schema`](crate::Error::Schema),
/// [`Error::Database`](crate::Error::Database).
///
/// # Cancel safety
///
/// Read-only: cancel at will.
pub async fn families(pool: &PgPool) -> Result<Vec<FamilyInfo>> {
    let db = db(pool);
    let rows: Vec<FamilyRow> = db.fetch_all(db.query_as(FAMILIES)).await?;
    let rules: Vec<RuleRow> = db.fetch_all(db.query_as(RULES)).await?;
    Ok(rows
        .into_iter()
        .map(|row| FamilyInfo {
            rules: rules
                .iter()
                .filter(|r| r.family == row.name)
                .map(|r| FamilyRule {
                    kind: if r.kind == "key" {
                        RuleKind::Key
                    } else {
                        RuleKind::Tier
                    },
                    matches: r.matches.clone(),
                    capacity: r.capacity.max(0) as u32,
                })
                .collect(),
            name: row.name,
            default_capacity: row.default_capacity.max(0) as u32,
            default_lease: seconds(row.lease_seconds),
            idle_after: seconds(row.idle_seconds),
            keys: row.keys.max(0) as u64,
            tiered_keys: row.tiered.max(0) as u64,
            created_at: row.created_at,
            updated_at: row.updated_at,
        })
        .collect())
}

/// The `limit` keys of `family` with the most live claims (ties by key),
/// each with its live claims: who holds the busiest keys. Keys with no live
/// claim are not listed.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad
/// family name; [`Error::Schema`](crate::Error::Schema),
/// [`Error::Database`](crate::Error::Database). An unknown family has no
/// keys (an empty list).
///
/// # Cancel safety
///
/// Read-only: cancel at will.
pub async fn busiest_keys(pool: &PgPool, family: &str, limit: u32) -> Result<Vec<FamilyKeyInfo>> {
    validate::family(family)?;
    let db = db(pool);
    let query = db
        .query_as::<BusyRow>(BUSIEST)
        .bind(family.to_owned())
        .bind(i64::from(limit));
    let rows: Vec<BusyRow> = db.fetch_all(query).await?;
    let mut list: Vec<FamilyKeyInfo> = Vec::new();
    for row in rows {
        if list.last().is_none_or(|last| last.key != row.family_key) {
            list.push(FamilyKeyInfo {
                key: row.family_key.clone(),
                capacity: row.capacity.max(0) as u32,
                held: row.held.max(0) as u32,
                holders: Vec::new(),
            });
        }
        if let Some(holder) = row.holder.into_holder() {
            list.last_mut().expect("pushed above").holders.push(holder);
        }
    }
    Ok(list)
}

/// Changes an existing family's default capacity, lease and idle time
/// (`None` keeps one), and in the same transaction sets every existing key
/// to the capacity the rules now give it and to the new lease. Returns how
/// many keys changed. A lowered capacity admits no claim above it; holders
/// above it keep their slots until they release (as
/// [`set_capacity`](crate::admin::set_capacity)).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad
/// name, capacity, lease or idle time (nothing is written);
/// [`Error::FamilyNotFound`](crate::Error::FamilyNotFound);
/// [`Error::Schema`](crate::Error::Schema),
/// [`Error::Database`](crate::Error::Database).
///
/// # Cancel safety
///
/// One statement: cancelling either applies the change or not.
pub async fn configure_family(
    pool: &PgPool,
    family: &str,
    capacity: Option<u32>,
    lease: Option<Duration>,
    idle_after: Option<Duration>,
) -> Result<u64> {
    validate::family(family)?;
    if let Some(capacity) = capacity {
        validate::capacity(capacity)?;
    }
    let lease = lease.map(validate::lease).transpose()?;
    let idle_after = idle_after.map(validate::idle_after).transpose()?;
    let changed = change_keys(pool, family, CONFIGURE_FAMILY, |query| {
        query
            .bind(capacity.map(|c| c as i32))
            .bind(lease)
            .bind(idle_after)
    })
    .await?;
    tracing::info!(
        family,
        ?capacity,
        keys_changed = changed,
        "semaphore family configured"
    );
    Ok(changed.max(0) as u64)
}

/// Sets (`Some`) or removes (`None`) the capacity rule of `kind` for
/// `matches` (a key, or a tier) in `family`, and in the same transaction
/// sets the existing keys it concerns to the capacity the rules now give
/// them. Returns how many keys changed. An exact-key rule wins over the
/// rule of the key's tier, which wins over the family's default.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// use pg_semaphore::admin::RuleKind;
/// pg_semaphore::admin::set_family_rule(&pool, "tenants", RuleKind::Tier, "premium", Some(50)).await?;
/// pg_semaphore::admin::set_family_tier(&pool, "tenants", "tenant-42", Some("premium")).await?;
/// pg_semaphore::admin::set_family_rule(&pool, "tenants", RuleKind::Key, "tenant-7", Some(200)).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad
/// name, key, tier or capacity (nothing is written);
/// [`Error::FamilyNotFound`](crate::Error::FamilyNotFound);
/// [`Error::Schema`](crate::Error::Schema),
/// [`Error::Database`](crate::Error::Database).
///
/// # Cancel safety
///
/// One statement: cancelling either applies the change or not.
pub async fn set_family_rule(
    pool: &PgPool,
    family: &str,
    kind: RuleKind,
    matches: &str,
    capacity: Option<u32>,
) -> Result<u64> {
    validate::family(family)?;
    match kind {
        RuleKind::Key => validate::family_key(matches)?,
        RuleKind::Tier => validate::tier(matches)?,
    }
    if let Some(capacity) = capacity {
        validate::capacity(capacity)?;
    }
    let changed = change_keys(pool, family, SET_RULE, |query| {
        query
            .bind(kind.as_sql())
            .bind(matches.to_owned())
            .bind(capacity.map(|c| c as i32))
    })
    .await?;
    tracing::info!(
        family,
        ?kind,
        matches,
        ?capacity,
        keys_changed = changed,
        "semaphore family rule set"
    );
    Ok(changed.max(0) as u64)
}

/// Puts `key` of `family` in `tier` (`None`: in no tier), and in the same
/// transaction sets the key, if it exists, to the capacity the rules now
/// give it. Returns how many keys changed (0 or 1). Tiers are the
/// operator's: the application never chooses its key's tier.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad
/// name, key or tier (nothing is written);
/// [`Error::FamilyNotFound`](crate::Error::FamilyNotFound);
/// [`Error::Schema`](crate::Error::Schema),
/// [`Error::Database`](crate::Error::Database).
///
/// # Cancel safety
///
/// One statement: cancelling either applies the change or not.
pub async fn set_family_tier(
    pool: &PgPool,
    family: &str,
    key: &str,
    tier: Option<&str>,
) -> Result<u64> {
    validate::family(family)?;
    validate::family_key(key)?;
    if let Some(tier) = tier {
        validate::tier(tier)?;
    }
    let changed = change_keys(pool, family, SET_TIER, |query| {
        query.bind(key.to_owned()).bind(tier.map(str::to_owned))
    })
    .await?;
    tracing::info!(
        family,
        key,
        ?tier,
        keys_changed = changed,
        "semaphore family tier set"
    );
    Ok(changed.max(0) as u64)
}
