//! Semaphore families: a name plus a key gives one semaphore ("each tenant
//! may run 10 at once, premium tenants 50, and one tenant 200").
//!
//! A key of a family is an ordinary semaphore, named `@family/key`: every
//! claim, wait, release, lease, fence and audit path is the named
//! semaphore's, and a claim on a key is the same single round trip to
//! `pgsemaphore.claim`. What a family adds lives in SQL
//! (`migrations/20261128010005_pgsemaphore_families.sql`, whose header
//! writes the decisions down):
//!
//! - the key's semaphore is created on first use by
//!   `pgsemaphore.open_family_key`, with the capacity the operator's rules
//!   give the key (an exact-key rule, else the rule of the key's tier, else
//!   the family's default) and the family's lease; the application only
//!   names the key and can never choose its capacity;
//! - an operator's rule change ([`set_family_rule`](crate::admin::set_family_rule),
//!   [`set_family_tier`](crate::admin::set_family_tier),
//!   [`configure_family`](crate::admin::configure_family)) recomputes the capacity
//!   of existing keys in its own transaction;
//! - the reaper removes keys nothing references any more.
//!
//! This module caches, per process, the handle of each key it opened, so
//! that the common claim is one round trip. When the reaper removed a key
//! meanwhile, the claim answers "semaphore does not exist"; the family
//! then opens the key again (creating it) and claims again.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use sqlx::postgres::types::PgInterval;

use super::engine::{self, Core, Heartbeat};
use super::wake::Wakeups;
use super::{DEFAULT_LEASE, Permit, Semaphore};
use crate::Client;
use crate::db::Db;
use crate::error::{Error, Result, family_not_found};
use crate::metrics::SemaphoreMetrics;
use crate::outcomes::{Counter, OutcomeKind};
use crate::validate;

/// How long a key of a new family stays after nothing references it any
/// more, by default (see [`SemaphoreFamilyBuilder::idle_after`]).
pub const DEFAULT_IDLE_AFTER: Duration = Duration::from_secs(15 * 60);

/// How many key handles a [`SemaphoreFamily`] keeps per process before it
/// forgets them all (a forgotten key is opened again on its next use: one
/// round trip more).
const KEY_CACHE: usize = 10_000;

/// How many times one acquire opens a key again after finding it removed.
const REOPENS: usize = 3;

/// Opens a family: creates it if it does not exist, returns the settings in force.
const OPEN_FAMILY: &str = "SELECT o_capacity, o_default_lease, o_idle_after, o_created \
                           FROM pgsemaphore.open_family(p_family => $1, p_capacity => $2, \
                                                        p_lease => $3, p_idle_after => $4)";

/// Opens a key of a family: creates its semaphore with the capacity the
/// rules give it if it does not exist.
const OPEN_KEY: &str = "SELECT o_name, o_capacity, o_default_lease \
                        FROM pgsemaphore.open_family_key(p_family => $1, p_key => $2)";

/// A family of semaphores: one per key (a tenant, a customer, an API
/// token), each with the capacity the operator's rules give that key.
///
/// [`key`](Self::key) gives the [`Semaphore`] of a key (created on first
/// use); [`try_acquire`](Self::try_acquire) and [`acquire`](Self::acquire)
/// claim on a key directly. A
/// claim on a key costs what a claim on a named semaphore costs: the handle
/// of each key is cached in the process, and the claim is one round trip.
///
/// Capacities are the operator's, stored in the database and changed at
/// run time ([`set_family_rule`](crate::admin::set_family_rule),
/// [`set_family_tier`](crate::admin::set_family_tier),
/// [`configure_family`](crate::admin::configure_family), or `pg-semaphore rule
/// set`): an exact-key rule wins over the rule of the key's tier, which
/// wins over the family's default. The application names keys and never
/// chooses their capacity.
///
/// Keys nothing references (no claim left in the audit log, no waiter),
/// for the family's [`idle_after`](SemaphoreFamilyBuilder::idle_after), are
/// removed by the reaper ([`reap`](crate::admin::reap), [`Reaper`](crate::admin::Reaper)):
/// the table holds the keys in use. Metrics label a key's semaphore by its
/// family (`semaphore="@family"`), never by its key, and the outcome
/// counters count every key's refusals and timeouts under the family's
/// name (kind `family`).
///
/// `SemaphoreFamily` is a cheap handle (an [`Arc`] inside): clone it freely.
///
/// ```no_run
/// use pg_semaphore::{Error, SemaphoreFamily};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
/// pg_semaphore::migrate(&pool).await?;
/// let client = pg_semaphore::Client::new(pool);
/// let tenants = SemaphoreFamily::builder("tenants", 10).build(&client).await?;
///
/// match tenants.try_acquire("tenant-42").await {
///     Ok(permit) => {
///         // ... call the upstream for tenant 42 ...
///         permit.release().await?;
///     }
///     Err(Error::NoSlotsAvailable { .. }) => { /* 429 for this tenant */ }
///     Err(other) => return Err(other.into()),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[derive(Clone)]
pub struct SemaphoreFamily {
    inner: Arc<Inner>,
}

struct Inner {
    db: Db,
    name: String,
    capacity: u32,
    lease: Duration,
    idle_after: Duration,
    holder: String,
    fallback: Duration,
    heartbeat: Heartbeat,
    wakeups: Arc<Wakeups>,
    /// Every key's refusals and timeouts count here, under the family's name.
    outcomes: Counter,
    /// The handles of the keys this process opened.
    keys: StdMutex<HashMap<String, Semaphore>>,
}

impl fmt::Debug for SemaphoreFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("SemaphoreFamily")
            .field("name", &inner.name)
            .field("capacity", &inner.capacity)
            .field("lease", &inner.lease)
            .field("idle_after", &inner.idle_after)
            .field("holder", &inner.holder)
            .field("transaction_pooling", &inner.db.is_pooled())
            .finish_non_exhaustive()
    }
}

/// Configures a [`SemaphoreFamily`]; made by [`SemaphoreFamily::builder`].
///
/// The default capacity, lease and idle time given here are the ones a
/// **new** family is created with; an existing family keeps its own (an
/// operator changes them with [`configure_family`](crate::admin::configure_family)).
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `.build(&client).await`"]
pub struct SemaphoreFamilyBuilder {
    name: String,
    capacity: u32,
    lease: Duration,
    idle_after: Duration,
    heartbeat: Heartbeat,
}

impl SemaphoreFamilyBuilder {
    /// The default lease of a new family's keys (default [`DEFAULT_LEASE`]),
    /// as [`SemaphoreBuilder::lease`](crate::SemaphoreBuilder::lease).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long a key of a new family stays once nothing references it
    /// (default [`DEFAULT_IDLE_AFTER`], at most
    /// [`MAX_IDLE_AFTER`](crate::limits::MAX_IDLE_AFTER)): the reaper removes a key
    /// whose claims have all been pruned from the audit log
    /// ([`prune_claims`](crate::admin::prune_claims)), with no waiter, and created
    /// or last changed at least this long ago.
    pub fn idle_after(mut self, idle_after: Duration) -> Self {
        self.idle_after = idle_after;
        self
    }

    /// As [`SemaphoreBuilder::heartbeat`](crate::SemaphoreBuilder::heartbeat).
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = Heartbeat::Every(interval);
        self
    }

    /// As [`SemaphoreBuilder::without_heartbeat`](crate::SemaphoreBuilder::without_heartbeat).
    pub fn without_heartbeat(mut self) -> Self {
        self.heartbeat = Heartbeat::Off;
        self
    }

    /// Validates the settings and opens the family: creates it with this
    /// default capacity, lease and idle time if it does not exist. An
    /// existing family keeps its settings (a `WARN` event says so when they
    /// differ from this builder's).
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidArgument`] for a name that is empty, longer than
    ///   [`MAX_FAMILY_NAME_LEN`](crate::limits::MAX_FAMILY_NAME_LEN) or has a
    ///   character other than letters, digits, `_`, `.`, `:`, `-`; a
    ///   capacity, lease, idle time, holder, fallback or heartbeat out of
    ///   range. Nothing is written.
    /// - [`Error::Schema`] when [`migrate`](crate::migrate) was not run.
    /// - [`Error::Database`] for connection and other database errors.
    ///
    /// # Cancel safety
    ///
    /// Opening is one statement: cancelling either creates the family or not.
    pub async fn build(self, client: &Client) -> Result<SemaphoreFamily> {
        validate::family(&self.name)?;
        validate::capacity(self.capacity)?;
        let lease = validate::lease(self.lease)?;
        let idle_after = validate::idle_after(self.idle_after)?;
        let fallback = client.fallback()?;
        self.heartbeat.check(self.lease, "lease")?;
        let holder = client.holder_label()?;
        let db = client.db().clone();
        let query = db
            .query_as::<(i32, PgInterval, PgInterval, bool)>(OPEN_FAMILY)
            .bind(self.name.clone())
            .bind(self.capacity as i32)
            .bind(lease)
            .bind(idle_after);
        let (capacity, stored_lease, stored_idle, created) = db
            .fetch_one(query)
            .await
            .map_err(|error| crate::error::family_not_found(error, &self.name))?;
        let capacity = capacity.max(1) as u32;
        let stored_lease = engine::duration_of(&stored_lease);
        let stored_idle = engine::duration_of(&stored_idle);
        if created {
            tracing::debug!(family = %self.name, capacity, "semaphore family created");
        } else if capacity != self.capacity || stored_lease != self.lease {
            tracing::warn!(
                family = %self.name,
                capacity,
                lease_ms = stored_lease.as_millis() as u64,
                requested_capacity = self.capacity,
                requested_lease_ms = self.lease.as_millis() as u64,
                "semaphore family exists with other settings, which stay in force; \
                 change them with pg_semaphore::admin::configure_family"
            );
        }
        self.heartbeat.check(stored_lease, "lease")?;
        let outcomes = client.outcome_counter(OutcomeKind::Family, &self.name);
        Ok(SemaphoreFamily {
            inner: Arc::new(Inner {
                outcomes,
                db,
                name: self.name,
                capacity,
                lease: stored_lease,
                idle_after: stored_idle,
                holder,
                fallback,
                heartbeat: self.heartbeat,
                wakeups: client.wakeups().clone(),
                keys: StdMutex::new(HashMap::new()),
            }),
        })
    }
}

impl SemaphoreFamily {
    /// Starts configuring the family `name` whose keys have `capacity`
    /// slots unless a rule says otherwise.
    ///
    /// Nothing is validated or written until [`SemaphoreFamilyBuilder::build`].
    pub fn builder(name: impl Into<String>, capacity: u32) -> SemaphoreFamilyBuilder {
        SemaphoreFamilyBuilder {
            name: name.into(),
            capacity,
            lease: DEFAULT_LEASE,
            idle_after: DEFAULT_IDLE_AFTER,
            heartbeat: Heartbeat::Default,
        }
    }

    /// The family's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The pool the family's statements use.
    #[cfg(feature = "tower")]
    pub(crate) fn pool(&self) -> &sqlx::PgPool {
        self.inner.db.pool()
    }

    /// The family's default capacity when this handle was opened (a key's
    /// own is [`Semaphore::capacity`] of [`key`](Self::key)).
    pub fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    /// The family's default lease when this handle was opened.
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// The family's idle time when this handle was opened.
    pub fn idle_after(&self) -> Duration {
        self.inner.idle_after
    }

    /// The name of the semaphore of `key`: `@family/key`.
    pub fn semaphore_name(&self, key: &str) -> String {
        format!("@{}/{key}", self.inner.name)
    }

    /// The semaphore of `key`: this process's handle if it has one, else
    /// the key opened (one round trip), created with the capacity the rules
    /// give it if it does not exist.
    ///
    /// A handle outlives nothing: if the reaper removes the key (nothing
    /// referenced it for the family's idle time), a claim on the handle
    /// returns [`Error::SemaphoreNotFound`]; the family's own
    /// [`try_acquire`](Self::try_acquire) and friends open it again and
    /// retry.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidArgument`] for a key that is empty, longer than
    ///   [`MAX_FAMILY_KEY_LEN`](crate::limits::MAX_FAMILY_KEY_LEN) or contains NUL,
    ///   or whose semaphore name a named semaphore has.
    /// - [`Error::FamilyNotFound`], [`Error::Schema`],
    ///   [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Opening is one statement: cancel at will.
    pub async fn key(&self, key: &str) -> Result<Semaphore> {
        validate::family_key(key)?;
        if let Some(sem) = self.cached(key) {
            return Ok(sem);
        }
        self.open(key).await
    }

    /// [`Semaphore::try_acquire`] on the semaphore of `key`.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::try_acquire`], and as [`key`](Self::key).
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::try_acquire`].
    pub async fn try_acquire(&self, key: &str) -> Result<Permit> {
        self.with_key(key, |sem| async move { sem.try_acquire().await })
            .await
    }

    /// [`Semaphore::acquire`] on the semaphore of `key`.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::acquire`], and as [`key`](Self::key).
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::acquire`]. Bound the wait with `tokio::time::timeout`
    /// around it: that bounds the whole call, reopening a removed key
    /// included (there is no `acquire_timeout`: it would do the same).
    pub async fn acquire(&self, key: &str) -> Result<Permit> {
        self.with_key(key, |sem| async move { sem.acquire().await })
            .await
    }

    /// Runs `op` on the key's semaphore; when the key was removed
    /// ([`Error::SemaphoreNotFound`]), forgets the handle, opens the key
    /// again and runs `op` again, a few times at most.
    pub(crate) async fn with_key<F, Fut>(&self, key: &str, op: F) -> Result<Permit>
    where
        F: Fn(Semaphore) -> Fut,
        Fut: Future<Output = Result<Permit>>,
    {
        let mut sem = self.key(key).await?;
        let mut reopens = 0;
        loop {
            match op(sem).await {
                Err(Error::SemaphoreNotFound { .. }) if reopens < REOPENS => {
                    reopens += 1;
                    tracing::debug!(family = %self.inner.name, "family key removed meanwhile: opening it again");
                    self.forget(key);
                    sem = self.open(key).await?;
                }
                other => return other,
            }
        }
    }

    fn cached(&self, key: &str) -> Option<Semaphore> {
        let keys = self.inner.keys.lock().unwrap_or_else(|e| e.into_inner());
        keys.get(key).cloned()
    }

    fn forget(&self, key: &str) {
        let mut keys = self.inner.keys.lock().unwrap_or_else(|e| e.into_inner());
        keys.remove(key);
    }

    /// Opens the key (one round trip) and caches its handle.
    async fn open(&self, key: &str) -> Result<Semaphore> {
        let inner = &self.inner;
        let db = &inner.db;
        let query = db
            .query_as::<(String, i32, PgInterval)>(OPEN_KEY)
            .bind(inner.name.clone())
            .bind(key.to_owned());
        let (name, capacity, lease) = db
            .fetch_one(query)
            .await
            .map_err(|e| family_not_found(e, &inner.name))?;
        let lease = engine::duration_of(&lease);
        inner.heartbeat.check(lease, "lease")?;
        let sem = Semaphore {
            core: Arc::new(Core {
                db: db.clone(),
                metrics: SemaphoreMetrics::new(&format!("@{}", inner.name))
                    .counting(inner.outcomes.clone()),
                name,
                capacity: capacity.max(1) as u32,
                lease,
                holder: inner.holder.clone(),
                fallback: inner.fallback,
                heartbeat: inner.heartbeat,
                fail_open: false,
                reserved: 0,
                queue: None,
                wakeups: Arc::clone(&inner.wakeups),
            }),
        };
        let mut keys = inner.keys.lock().unwrap_or_else(|e| e.into_inner());
        if keys.len() >= KEY_CACHE {
            keys.clear();
        }
        keys.insert(key.to_owned(), sem.clone());
        Ok(sem)
    }
}
