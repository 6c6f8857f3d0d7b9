use std::fmt;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use sqlx::postgres::types::PgInterval;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::audit::{AuditLog, Holder, Summary};
use crate::error::{Error, LostReason, Result, fails_open};
use crate::extended::{self, Extensions, Priority};
use crate::lease::Lease;
use crate::listener::Listener;
use crate::validate;

/// The largest capacity a semaphore may have (a CHECK constraint enforces it too).
pub const MAX_CAPACITY: u32 = 100_000;

/// The longest semaphore name, in characters.
pub const MAX_NAME_LEN: usize = 200;

/// The longest holder label, in characters.
pub const MAX_HOLDER_LEN: usize = 1000;

/// The shortest lease a permit may have.
pub const MIN_LEASE: Duration = Duration::from_millis(10);

/// The longest lease a permit may have (366 days).
pub const MAX_LEASE: Duration = Duration::from_secs(366 * 24 * 60 * 60);

/// The default lease: how long a permit is held before a reaper may free it.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(90);

/// The default interval of the fallback re-check that covers a lost notification.
pub const DEFAULT_FALLBACK_INTERVAL: Duration = Duration::from_secs(2);

/// The claim: reaps this semaphore's expired slots and inserts the lowest free
/// slot below capacity, in one round trip. The function body is in
/// `migrations/20261121000001_pg_semaphore_init.sql`.
const CLAIM: &str = "SELECT o_id, o_slot, o_created_at, o_expires_at, o_capacity, o_free \
                     FROM pgsemaphore.claim($1, $2, $3, $4)";

/// Ends a claim and notifies waiters, in one round trip.
const RELEASE: &str = "SELECT o_outcome, o_semaphore, o_at FROM pgsemaphore.release($1)";

/// Creates the semaphore or updates its capacity and default lease.
const CONFIGURE: &str = "SELECT o_capacity FROM pgsemaphore.configure($1, $2, $3)";

/// Checks, inside the caller's transaction, that a claim is live and its lease
/// unexpired, and share-locks its row so that it stays live (a release waits,
/// reapers skip it) until that transaction ends.
const FENCE: &str = "SELECT id, completed_at, timed_out_at, expires_at > clock_timestamp() AS unexpired \
                     FROM pgsemaphore.slots WHERE id = ANY ($1) ORDER BY id FOR SHARE";

/// Free slots right now (expired but unreaped slots count as held).
const AVAILABLE: &str = "SELECT s.capacity - (SELECT count(*)::int FROM pgsemaphore.slots l \
                          WHERE l.semaphore = s.name \
                            AND l.completed_at IS NULL AND l.timed_out_at IS NULL) \
                         FROM pgsemaphore.semaphores s WHERE s.name = $1";

/// A counting semaphore shared by every process that uses the same database.
///
/// At most `capacity` permits of a semaphore are held at once, across all
/// processes and machines: the database enforces it (a partial unique index on
/// live slots, and claims serialised on the semaphore's own row). Each permit
/// is a row in `pgsemaphore.slots` that stays after release as an audit log.
///
/// `Semaphore` is a cheap handle (an [`Arc`] inside): clone it freely.
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use pg_semaphore::{Error, Semaphore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
/// pg_semaphore::migrate(&pool).await?;
/// let sem = Semaphore::builder("payments-api", 4)
///     .lease(Duration::from_secs(90))
///     .build(&pool)
///     .await?;
///
/// match sem.try_acquire().await {
///     Ok(permit) => {
///         // ... call the fragile upstream ...
///         permit.release().await?;
///     }
///     Err(Error::NoSlotsAvailable { .. }) => { /* answer 503 at once */ }
///     Err(other) => return Err(other.into()),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[derive(Clone)]
pub struct Semaphore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) pool: PgPool,
    pub(crate) name: String,
    pub(crate) capacity: u32,
    pub(crate) lease: Duration,
    pub(crate) holder: String,
    pub(crate) fallback: Duration,
    pub(crate) pooled: bool,
    pub(crate) listener: Arc<Listener>,
    /// Reserved capacity and the fair queue (src/extended.rs, src/queue.rs).
    pub(crate) ext: Extensions,
    heartbeat: Heartbeat,
    fail_open: bool,
}

/// How held permits renew their leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Heartbeat {
    /// Every third of the permit's lease.
    Default,
    /// Every given interval.
    Every(Duration),
    /// Not at all: the lease runs out.
    Off,
}

impl Heartbeat {
    /// The renewal interval for a permit whose lease is `lease`.
    fn interval(self, lease: Duration) -> Option<Duration> {
        match self {
            Heartbeat::Default => Some(lease / 3),
            Heartbeat::Every(interval) => Some(interval),
            Heartbeat::Off => None,
        }
    }

    /// Checks an explicit interval against a lease: the lease must cover two.
    fn check(self, lease: Duration, argument: &'static str) -> Result<()> {
        match self {
            Heartbeat::Every(interval) if interval.is_zero() => {
                Err(Error::invalid("heartbeat", "must be greater than zero"))
            }
            Heartbeat::Every(interval) if interval.checked_mul(2).is_none_or(|two| two > lease) => {
                Err(Error::invalid(
                    argument,
                    format!(
                        "a lease of {lease:?} is shorter than twice the heartbeat interval \
                         {interval:?}: a single late renewal would lose the permit"
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("name", &self.inner.name)
            .field("capacity", &self.inner.capacity)
            .field("lease", &self.inner.lease)
            .field("holder", &self.inner.holder)
            .field("fallback_interval", &self.inner.fallback)
            .field("transaction_pooling", &self.inner.pooled)
            .field("heartbeat", &self.inner.heartbeat)
            .field("fail_open", &self.inner.fail_open)
            .field("reserved", &self.inner.ext.reserved)
            .field("queue", &self.inner.ext.queue)
            .finish_non_exhaustive()
    }
}

/// Configures a [`Semaphore`]; made by [`Semaphore::builder`].
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// let sem = pg_semaphore::Semaphore::builder("payments-api", 4)
///     .lease(Duration::from_secs(30))          // a crashed holder frees its slot after 30 s
///     .heartbeat(Duration::from_secs(10))      // a live one renews every 10 s
///     .holder("api-7")                         // recorded in the audit log
///     .fallback_interval(Duration::from_secs(2))
///     .build(&pool)
///     .await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `.build(&pool).await`"]
pub struct SemaphoreBuilder {
    name: String,
    capacity: u32,
    lease: Duration,
    holder: Option<String>,
    fallback: Duration,
    pooled: bool,
    heartbeat: Heartbeat,
    fail_open: bool,
    pub(crate) ext: Extensions,
}

impl SemaphoreBuilder {
    /// How long a permit is held before a reaper may free it (default
    /// [`DEFAULT_LEASE`], between [`MIN_LEASE`] and [`MAX_LEASE`]). Stored as the
    /// semaphore's default lease. Measured on the database clock.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The holder label recorded with every claim (default: `host:pid`).
    pub fn holder(mut self, holder: impl Into<String>) -> Self {
        self.holder = Some(holder.into());
        self
    }

    /// How often a waiting acquire re-checks even without a notification
    /// (default [`DEFAULT_FALLBACK_INTERVAL`]). It only matters when a
    /// notification is lost; one re-check per semaphore per process and interval.
    pub fn fallback_interval(mut self, interval: Duration) -> Self {
        self.fallback = interval;
        self
    }

    /// Declares that the pool connects through a **transaction-pooling proxy**
    /// such as PgBouncer with `pool_mode = transaction` (default `false`).
    ///
    /// `LISTEN` cannot work there, so waiting acquires re-check every
    /// [`fallback_interval`](Self::fallback_interval) instead of being woken
    /// by notifications (shorten it accordingly). Each statement runs as an
    /// unnamed prepared statement (`persistent(false)`) inside an explicit
    /// transaction, so that sqlx's two extended-protocol steps reach the same
    /// server connection and no statement name collides with another
    /// client's; that costs two extra round trips per claim and release.
    /// Migrations must still run on a direct connection.
    pub fn transaction_pooling(mut self, enabled: bool) -> Self {
        self.pooled = enabled;
        self
    }

    /// Renews each held permit's lease every `interval` (by default every
    /// third of the lease). The lease must be at least twice the interval.
    ///
    /// A renewal sets the lease to end one full lease after the database's
    /// `now()`. If renewals fail (database unreachable) the permit is retried
    /// until its lease can no longer be guaranteed, and then reported lost
    /// through [`Permit::lost`]: stop the protected work then, because the
    /// slot may be reaped and claimed by someone else.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// let sem = pg_semaphore::Semaphore::builder("exports", 2)
    ///     .lease(Duration::from_secs(30))
    ///     .heartbeat(Duration::from_secs(5))
    ///     .build(&pool)
    ///     .await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = Heartbeat::Every(interval);
        self
    }

    /// Turns lease renewal off: every permit's slot is freed by a reaper (or
    /// the next claim) once its lease ends, even while its holder still works.
    /// [`Permit::lost`] still fires when the lease ends.
    pub fn without_heartbeat(mut self) -> Self {
        self.heartbeat = Heartbeat::Off;
        self
    }

    /// **Fail open** (default `false`): when the database cannot be reached,
    /// [`try_acquire`](Semaphore::try_acquire) admits the caller anyway with an
    /// *unchecked* permit ([`Permit::is_unchecked`]) and a `WARN` event,
    /// instead of returning [`Error::Database`].
    ///
    /// This trades the hard limit for availability while the database is
    /// down (seed 002: "fail open so Redis outages don't take down your
    /// site"): use it only where going over the limit is cheaper than an
    /// outage. Only connection failures fail open; errors that say the
    /// database answered (missing migrations, unknown semaphore, bad input)
    /// are still returned. Waiting acquires (`acquire`, `acquire_timeout`)
    /// never fail open.
    pub fn fail_open(mut self, enabled: bool) -> Self {
        self.fail_open = enabled;
        self
    }

    /// Validates the settings and upserts the semaphore's row: a new semaphore
    /// is created; an existing one takes this capacity and lease (new claims
    /// see the new capacity; holders above a reduced capacity keep their slots
    /// until they release).
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidArgument`] for a name that is empty, longer than
    ///   [`MAX_NAME_LEN`] or contains NUL; a capacity of 0 or above
    ///   [`MAX_CAPACITY`]; a lease outside [`MIN_LEASE`]..=[`MAX_LEASE`]; a
    ///   zero fallback interval; a zero heartbeat interval or one above half
    ///   the lease; a bad holder label. Nothing is written.
    /// - [`Error::MigrationsMissing`] when [`migrate`](crate::migrate) was not run.
    /// - [`Error::Database`] for connection and other database errors.
    ///
    /// # Cancel safety
    ///
    /// The upsert is one statement: cancelling either applies it or not.
    pub async fn build(self, pool: &PgPool) -> Result<Semaphore> {
        validate::text("name", &self.name, MAX_NAME_LEN)?;
        if self.capacity == 0 || self.capacity > MAX_CAPACITY {
            return Err(Error::invalid(
                "capacity",
                format!(
                    "{} is out of range: a semaphore has 1 to {MAX_CAPACITY} slots",
                    self.capacity
                ),
            ));
        }
        let lease = lease_interval(self.lease)?;
        if self.fallback.is_zero() {
            return Err(Error::invalid(
                "fallback_interval",
                "must be greater than zero",
            ));
        }
        self.heartbeat.check(self.lease, "lease")?;
        let holder = match self.holder {
            Some(holder) => {
                validate_holder(&holder)?;
                holder
            }
            None => default_holder(),
        };
        self.ext.validate(self.capacity)?;
        let capacity: i32 = on_pool!(pool, self.pooled, |conn| {
            sqlx::query_scalar(CONFIGURE)
                .bind(&self.name)
                .bind(self.capacity as i32)
                .bind(lease)
                .persistent(!self.pooled)
                .fetch_one(conn)
        })
        .await?;
        tracing::debug!(semaphore = %self.name, capacity, "semaphore configured");
        Ok(Semaphore {
            inner: Arc::new(Inner {
                listener: Listener::for_pool(pool),
                pool: pool.clone(),
                name: self.name,
                capacity: self.capacity,
                lease: self.lease,
                holder,
                fallback: self.fallback,
                pooled: self.pooled,
                heartbeat: self.heartbeat,
                fail_open: self.fail_open,
                ext: self.ext,
            }),
        })
    }
}

impl Semaphore {
    /// Starts configuring the semaphore `name` with `capacity` slots.
    ///
    /// Nothing is validated or written until [`SemaphoreBuilder::build`].
    pub fn builder(name: impl Into<String>, capacity: u32) -> SemaphoreBuilder {
        SemaphoreBuilder {
            name: name.into(),
            capacity,
            lease: DEFAULT_LEASE,
            holder: None,
            fallback: DEFAULT_FALLBACK_INTERVAL,
            pooled: false,
            heartbeat: Heartbeat::Default,
            fail_open: false,
            ext: Extensions::default(),
        }
    }

    /// The semaphore's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The capacity this handle configured. Another process may have changed
    /// it since; claims always use the database's current value.
    pub fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    /// The lease given to permits from this handle.
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// The holder label recorded with claims from this handle.
    pub fn holder(&self) -> &str {
        &self.inner.holder
    }

    /// The pool this semaphore uses.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// How many slots are free right now, according to the database.
    ///
    /// Only a snapshot: by the time it returns another process may have
    /// claimed or released. Slots whose lease expired but that were not reaped
    /// yet count as held.
    ///
    /// # Errors
    ///
    /// [`Error::SemaphoreNotFound`], [`Error::MigrationsMissing`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn available_permits(&self) -> Result<u32> {
        let inner = &self.inner;
        let free: Option<i32> = on_pool!(inner.pool, inner.pooled, |conn| {
            sqlx::query_scalar(AVAILABLE)
                .bind(&inner.name)
                .persistent(!inner.pooled)
                .fetch_optional(conn)
        })
        .await?;
        match free {
            Some(free) => Ok(free.max(0) as u32),
            None => Err(self.not_found()),
        }
    }

    /// Starts a claim with per-claim options (metadata, holder label, lease).
    ///
    /// ```no_run
    /// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), Box<dyn std::error::Error>> {
    /// let permit = sem
    ///     .claim()
    ///     .metadata(serde_json::json!({ "request_id": "r-42", "route": "/charge" }))
    ///     .try_acquire()
    ///     .await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    pub fn claim(&self) -> Claim<'_> {
        Claim {
            semaphore: self,
            holder: None,
            metadata: None,
            lease: None,
            permits: 1,
            priority: Priority::default(),
        }
    }

    /// Claims a slot if one is free, or fails at once.
    ///
    /// One round trip: the claim reaps this semaphore's expired slots first.
    ///
    /// # Errors
    ///
    /// - [`Error::NoSlotsAvailable`] when every slot is held: answer 429/503.
    ///   Also while waiters are queued in the semaphore's fair queue (see
    ///   [`SemaphoreBuilder::queue`]), even if a slot is free: a fail-fast
    ///   claim never jumps the queue.
    /// - [`Error::SemaphoreNotFound`], [`Error::MigrationsMissing`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the claim runs in a spawned task, and a claim that
    /// completes after the caller stopped waiting is released at once.
    pub async fn try_acquire(&self) -> Result<Permit> {
        self.claim().try_acquire().await
    }

    /// Waits without limit until a slot is free, then claims it.
    ///
    /// Waiting holds no pooled connection: the task sleeps until a release
    /// anywhere notifies this semaphore (one shared `LISTEN` connection per
    /// pool), with a slow fallback re-check in case a notification is lost.
    ///
    /// # Errors
    ///
    /// [`Error::SemaphoreNotFound`], [`Error::MigrationsMissing`], [`Error::Database`]
    /// (a claim attempt failed; the wait stops).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future at any point never leaves a slot
    /// held (see [`try_acquire`](Self::try_acquire)).
    pub async fn acquire(&self) -> Result<Permit> {
        self.claim().acquire().await
    }

    /// Waits up to `timeout` for a slot, then claims it.
    ///
    /// The timeout bounds the whole call, claim round trips included.
    ///
    /// # Errors
    ///
    /// - [`Error::Timeout`] when no slot could be claimed in time.
    /// - As [`acquire`](Self::acquire).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`acquire`](Self::acquire).
    pub async fn acquire_timeout(&self, timeout: Duration) -> Result<Permit> {
        self.claim().acquire_timeout(timeout).await
    }

    /// Live holders of this semaphore. See [`AuditLog::holders`].
    ///
    /// # Errors
    ///
    /// [`Error::MigrationsMissing`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn holders(&self) -> Result<Vec<Holder>> {
        AuditLog::new(&self.inner.pool)
            .holders(&self.inner.name)
            .await
    }

    /// Summary of this semaphore's claims over a time window. See [`AuditLog::summary`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a window whose end precedes its start,
    /// [`Error::MigrationsMissing`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn summary(&self, window: std::ops::Range<DateTime<Utc>>) -> Result<Summary> {
        AuditLog::new(&self.inner.pool)
            .summary(&self.inner.name, window)
            .await
    }

    fn not_found(&self) -> Error {
        Error::SemaphoreNotFound {
            semaphore: self.inner.name.clone(),
        }
    }
}

/// One claim's options; made by [`Semaphore::claim`].
#[derive(Debug)]
#[must_use = "a claim does nothing until one of its acquire methods is awaited"]
pub struct Claim<'a> {
    semaphore: &'a Semaphore,
    holder: Option<String>,
    metadata: Option<serde_json::Value>,
    lease: Option<Duration>,
    pub(crate) permits: u32,
    pub(crate) priority: Priority,
}

/// What the spawned claim task needs.
#[derive(Clone)]
pub(crate) struct ClaimArgs {
    pub(crate) semaphore: Semaphore,
    pub(crate) holder: String,
    pub(crate) metadata: Option<serde_json::Value>,
    pub(crate) lease: Option<PgInterval>,
    pub(crate) permits: u32,
    pub(crate) priority: Priority,
}

impl<'a> Claim<'a> {
    /// Overrides the holder label for this claim.
    pub fn holder(mut self, holder: impl Into<String>) -> Self {
        self.holder = Some(holder.into());
        self
    }

    /// JSON recorded with the claim in the audit log (request id, route, ...).
    pub fn metadata(mut self, metadata: serde_json::Value) -> Self {
        self.metadata = Some(metadata);
        self
    }

    /// Overrides the lease for this claim.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// As [`Semaphore::try_acquire`], with this claim's options.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::try_acquire`], plus [`Error::InvalidArgument`] for a
    /// bad holder label or lease.
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::try_acquire`].
    pub async fn try_acquire(self) -> Result<Permit> {
        let args = self.into_args()?;
        let inner = &args.semaphore.inner;
        let result = if args.is_extended(false) {
            extended::try_acquire(&args).await
        } else {
            match claim_once(&args).await {
                Ok(Claimed::Permit(permit)) => Ok(permit),
                Ok(Claimed::Full { capacity }) => {
                    tracing::debug!(semaphore = %inner.name, capacity, "no slots available");
                    Err(Error::NoSlotsAvailable {
                        semaphore: inner.name.clone(),
                        capacity,
                    })
                }
                Err(error) => Err(error),
            }
        };
        match result {
            Err(Error::Database(error))
                if inner.fail_open && fails_open(&error, &inner.pool).await =>
            {
                tracing::warn!(
                    semaphore = %inner.name,
                    %error,
                    "database unreachable: admitting without a slot (fail-open)"
                );
                Ok(Permit::unchecked(args.semaphore.clone()))
            }
            other => other,
        }
    }

    /// As [`Semaphore::acquire`], with this claim's options.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::acquire`], plus [`Error::InvalidArgument`] for a bad
    /// holder label or lease.
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::acquire`].
    pub async fn acquire(self) -> Result<Permit> {
        let args = self.into_args()?;
        wait(&args).await
    }

    /// As [`Semaphore::acquire_timeout`], with this claim's options.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::acquire_timeout`], plus [`Error::InvalidArgument`] for
    /// a bad holder label or lease.
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::acquire_timeout`].
    pub async fn acquire_timeout(self, timeout: Duration) -> Result<Permit> {
        let args = self.into_args()?;
        // A deadline too far to represent is no deadline.
        let Some(deadline) = Instant::now().checked_add(timeout) else {
            return wait(&args).await;
        };
        match tokio::time::timeout_at(deadline, wait(&args)).await {
            Ok(result) => result,
            Err(_elapsed) => {
                tracing::debug!(
                    semaphore = %args.semaphore.inner.name,
                    timeout_ms = timeout.as_millis() as u64,
                    "acquire timed out"
                );
                Err(Error::Timeout {
                    name: format!("semaphore {:?}", args.semaphore.inner.name),
                    timeout,
                })
            }
        }
    }

    fn into_args(self) -> Result<ClaimArgs> {
        let holder = match self.holder {
            Some(holder) => {
                validate_holder(&holder)?;
                holder
            }
            None => self.semaphore.inner.holder.clone(),
        };
        let lease = match self.lease {
            Some(lease) => {
                self.semaphore.inner.heartbeat.check(lease, "lease")?;
                Some(lease_interval(lease)?)
            }
            None => None,
        };
        extended::validate(self.semaphore, self.permits, self.priority)?;
        Ok(ClaimArgs {
            semaphore: self.semaphore.clone(),
            holder,
            metadata: self.metadata,
            lease,
            permits: self.permits,
            priority: self.priority,
        })
    }
}

/// Waits for a claim: the fast loop below, or the extended one for weighted,
/// low-priority and queued claims.
async fn wait(args: &ClaimArgs) -> Result<Permit> {
    if args.is_extended(true) {
        extended::wait(args).await
    } else {
        wait_and_claim(args).await
    }
}

enum Claimed {
    Permit(Permit),
    Full { capacity: u32 },
}

/// One claim attempt, cancel-safe by construction: the round trip runs in a
/// spawned task, and if the caller has gone by the time it returns, the
/// permit is released there and then.
async fn claim_once(args: &ClaimArgs) -> Result<Claimed> {
    let args = args.clone();
    detached(
        async move { claim_round_trip(&args).await },
        |claimed| match claimed {
            Claimed::Permit(permit) => Some(permit),
            Claimed::Full { .. } => None,
        },
    )
    .await
}

/// Runs a claim round trip in a spawned task, so that dropping the caller's
/// future never leaves a slot held: if the caller has gone by the time the
/// round trip returns, the permit it claimed (`permit_of`) is released there
/// and then. Shared by every kind of claim.
pub(crate) async fn detached<T: Send + 'static>(
    round_trip: impl Future<Output = Result<T>> + Send + 'static,
    permit_of: fn(T) -> Option<Permit>,
) -> Result<T> {
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let result = round_trip.await;
        if let Err(Ok(unclaimed)) = tx.send(result)
            && let Some(permit) = permit_of(unclaimed)
        {
            tracing::debug!(
                semaphore = %permit.semaphore.inner.name,
                ids = ?permit.ids(),
                "acquire cancelled while claiming; releasing what it claimed"
            );
            if let Err(error) = permit.release().await {
                tracing::warn!(%error, "releasing the slots of a cancelled acquire failed; their lease will free them");
            }
        }
    });
    rx.await.unwrap_or_else(|_| {
        // The task was dropped: its runtime is shutting down.
        Err(Error::Database(sqlx::Error::WorkerCrashed))
    })
}

async fn claim_round_trip(args: &ClaimArgs) -> Result<Claimed> {
    let inner = &args.semaphore.inner;
    let sent = Instant::now();
    let row: ClaimRow = on_pool!(inner.pool, inner.pooled, |conn| {
        sqlx::query_as(CLAIM)
            .bind(&inner.name)
            .bind(&args.holder)
            .bind(args.lease)
            .bind(&args.metadata)
            .persistent(!inner.pooled)
            .fetch_one(conn)
    })
    .await
    .map_err(|error| not_found_or(error, &inner.name))?;
    let capacity = row.capacity.max(0) as u32;
    match (row.id, row.slot, row.created_at, row.expires_at) {
        (Some(id), Some(slot), Some(acquired_at), Some(expires_at)) => {
            tracing::debug!(semaphore = %inner.name, id, slot, "permit acquired");
            Ok(Claimed::Permit(Permit::new(
                args.semaphore.clone(),
                (id, slot as u32),
                Vec::new(),
                acquired_at,
                expires_at,
                row.free.max(0) as u32,
                sent,
            )))
        }
        _ => Ok(Claimed::Full { capacity }),
    }
}

#[derive(sqlx::FromRow)]
struct FenceRow {
    id: i64,
    completed_at: Option<DateTime<Utc>>,
    timed_out_at: Option<DateTime<Utc>>,
    unexpired: bool,
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    #[sqlx(rename = "o_id")]
    id: Option<i64>,
    #[sqlx(rename = "o_slot")]
    slot: Option<i32>,
    #[sqlx(rename = "o_created_at")]
    created_at: Option<DateTime<Utc>>,
    #[sqlx(rename = "o_expires_at")]
    expires_at: Option<DateTime<Utc>>,
    #[sqlx(rename = "o_capacity")]
    capacity: i32,
    #[sqlx(rename = "o_free")]
    free: i32,
}

/// The waiting loop shared by `acquire` and `acquire_timeout`.
async fn wait_and_claim(args: &ClaimArgs) -> Result<Permit> {
    let inner = &args.semaphore.inner;
    let listener = &inner.listener;
    // Fast path: while no LISTEN connection is up, try once before starting one.
    if !listener.is_ready() {
        if let Claimed::Permit(permit) = claim_once(args).await? {
            return Ok(permit);
        }
        // Behind a transaction pooler LISTEN cannot work: the ticker alone wakes waiters.
        listener.start(inner.fallback, !inner.pooled).await;
    }
    let waiter = listener.register(&inner.name, inner.fallback);
    let started = Instant::now();
    loop {
        // Enable the wake-up *before* claiming, so a release that lands
        // between a failed claim and the wait still wakes this task.
        let mut notified = pin!(waiter.entry().notify.notified());
        notified.as_mut().enable();
        match claim_once(args).await {
            Ok(Claimed::Permit(permit)) => {
                if permit.free_after > 0 && waiter.has_company() {
                    // More slots are free than this task takes: pass it on.
                    waiter.entry().notify.notify_one();
                }
                tracing::debug!(
                    semaphore = %inner.name,
                    waited_ms = started.elapsed().as_millis() as u64,
                    "waiter acquired a permit"
                );
                return Ok(permit);
            }
            Ok(Claimed::Full { .. }) => {}
            Err(error) => {
                // Do not swallow a wake-up meant for someone who can use it.
                waiter.entry().notify.notify_one();
                return Err(error);
            }
        }
        notified.await;
    }
}

/// A held slot of a [`Semaphore`].
///
/// Release it with [`release`](Permit::release), which reports whether the
/// slot was still held. **Dropping a permit without releasing it schedules
/// the release on the tokio runtime: it is not immediate**, and if no runtime
/// is available (or the process dies) the slot is freed when its lease
/// expires and a reaper or the next claim notices.
///
/// While a permit is held, its [heartbeat](SemaphoreBuilder::heartbeat)
/// renews the lease: a permit leaked with [`std::mem::forget`] (or kept
/// alive by a hung task) therefore holds its slot for as long as the process
/// lives. See [`lost`](Permit::lost) for how a holder learns it lost the slot.
///
/// ```no_run
/// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), Box<dyn std::error::Error>> {
/// let permit = sem.acquire().await?;
/// println!(
///     "claim {} holds slot {} of {:?} since {} (lease granted until {})",
///     permit.id(),   // strictly increasing: a fencing token
///     permit.slot(), // 0..capacity
///     permit.semaphore().name(),
///     permit.acquired_at(),
///     permit.expires_at(),
/// );
/// permit.release().await?; // Err(PermitLost) if it was reaped meanwhile
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[must_use = "dropping a permit releases it in the background at once; hold it while you work"]
pub struct Permit {
    semaphore: Semaphore,
    id: i64,
    slot: u32,
    acquired_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    pub(crate) free_after: u32,
    released: bool,
    /// Admitted without the database (fail-open): holds no slot.
    unchecked: bool,
    lease: Lease,
    /// A weighted permit's other claims (id, slot), after the first.
    pub(crate) more: Vec<(i64, u32)>,
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("semaphore", &self.semaphore.inner.name)
            .field("id", &self.id)
            .field("slot", &self.slot)
            .field("permits", &(1 + self.more.len()))
            .field("acquired_at", &self.acquired_at)
            .field("expires_at", &self.expires_at)
            .field("heartbeat", &self.lease.has_heartbeat())
            .field("unchecked", &self.unchecked)
            .finish()
    }
}

impl Permit {
    /// A permit for the claim `(id, slot)` and, if weighted, the claims
    /// `more` made with it (higher ids), in a statement sent at `sent`; starts
    /// renewing their lease if the semaphore has a heartbeat.
    pub(crate) fn new(
        semaphore: Semaphore,
        (id, slot): (i64, u32),
        more: Vec<(i64, u32)>,
        acquired_at: DateTime<Utc>,
        expires_at: DateTime<Utc>,
        free_after: u32,
        sent: Instant,
    ) -> Permit {
        let inner = &semaphore.inner;
        // The lease as the database applied it (the claim's, or the
        // semaphore's default as stored when the claim ran).
        let lease = (expires_at - acquired_at).to_std().unwrap_or(inner.lease);
        let ids = claim_ids(id, &more);
        let lease = Lease::start(inner, ids, sent, lease, inner.heartbeat.interval(lease));
        Permit {
            semaphore,
            id,
            slot,
            acquired_at,
            expires_at,
            free_after,
            released: false,
            unchecked: false,
            lease,
            more,
        }
    }

    /// A permit admitted without the database (fail-open).
    fn unchecked(semaphore: Semaphore) -> Self {
        let now = Utc::now();
        let lease =
            chrono::Duration::from_std(semaphore.inner.lease).unwrap_or(chrono::Duration::MAX);
        Permit {
            id: 0,
            slot: 0,
            acquired_at: now,
            expires_at: now
                .checked_add_signed(lease)
                .unwrap_or(DateTime::<Utc>::MAX_UTC),
            free_after: 0,
            released: false,
            unchecked: true,
            lease: Lease::unchecked(),
            more: Vec::new(),
            semaphore,
        }
    }

    /// The claim's id: unique and strictly increasing across the database
    /// (a `bigint` identity, which never wraps), usable as a fencing token.
    /// A weighted permit (see [`Semaphore::acquire_many`]) holds several
    /// claims made in one statement: this is the lowest of their ids, and it
    /// is still greater than every id of any claim on this semaphore made
    /// before it. `0` for an [unchecked](Self::is_unchecked) permit.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// Whether this permit was admitted without the database because it was
    /// unreachable and the semaphore [fails open](SemaphoreBuilder::fail_open).
    /// Such a permit holds no slot: it is not counted against the capacity,
    /// its [`id`](Self::id) is `0`, [`fence`](Self::fence) refuses it and
    /// [`release`](Self::release) does nothing.
    pub fn is_unchecked(&self) -> bool {
        self.unchecked
    }

    /// Resolves when this permit is lost: a renewal found it reaped or
    /// released by someone else, or its lease can no longer be guaranteed
    /// (renewals failed, or there is no [heartbeat](SemaphoreBuilder::heartbeat)
    /// and the lease ran out). Stop the protected work then: another holder
    /// may be admitted to the slot.
    ///
    /// The signal is an early warning: it fires a tenth of the lease (at
    /// least 20 ms) *before* the lease ends, measured on this process's
    /// monotonic clock from when the claim or last renewal was sent, so an
    /// offset between the hosts' clocks does not matter. It cannot see a
    /// database clock that jumps forward, or time this process spent
    /// suspended, and work that never yields cannot hear it: where a write
    /// must never happen after the permit is lost, [`fence`](Self::fence) it.
    /// Once lost, a permit stays lost.
    ///
    /// ```no_run
    /// # async fn run(permit: pg_semaphore::Permit) -> Result<(), Box<dyn std::error::Error>> {
    /// # async fn do_the_work() {}
    /// tokio::select! {
    ///     () = do_the_work() => permit.release().await?,
    ///     reason = permit.lost() => eprintln!("stopped: permit lost ({reason})"),
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only watches.
    pub async fn lost(&self) -> LostReason {
        self.lease.lost().await
    }

    /// Whether this permit is lost (see [`lost`](Self::lost)), without waiting.
    pub fn is_lost(&self) -> bool {
        self.lease.lost_reason().is_some()
    }

    /// The slot number held, in `0..capacity` (a weighted permit's lowest).
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// When the slot was claimed (database clock).
    pub fn acquired_at(&self) -> DateTime<Utc> {
        self.acquired_at
    }

    /// When the lease ended as granted (database clock): from then on a
    /// reaper, or any claim on this semaphore, may free the slot, unless a
    /// [heartbeat](SemaphoreBuilder::heartbeat) has renewed it meanwhile
    /// (renewals move the lease on the database, not this value).
    pub fn expires_at(&self) -> DateTime<Utc> {
        self.expires_at
    }

    /// The semaphore this permit belongs to.
    pub fn semaphore(&self) -> &Semaphore {
        &self.semaphore
    }

    /// Fences a write protected by this permit: checks, inside the caller's
    /// own transaction, that the permit still holds its slot with an unexpired
    /// lease, and keeps it so until that transaction ends (its row is
    /// share-locked: a release waits for the transaction, reapers skip it).
    /// Work committed in that transaction therefore happened while the permit
    /// was held, even if the holder stalled for longer than its lease before
    /// getting there. Keep the fenced transaction short: the heartbeat's
    /// renewals wait for it too, and a fence held longer than the lease
    /// loses the permit once it ends.
    ///
    /// A weighted permit is checked, and kept, by every one of its claims.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool, permit: pg_semaphore::Permit) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// permit.fence(&mut tx).await?; // Err(PermitLost) if the slot was lost meanwhile
    /// sqlx::query("UPDATE accounts SET charged = true WHERE id = 7")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// tx.commit().await?;
    /// permit.release().await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::PermitLost`] when the claim was released or reaped, or its
    /// lease has ended (a reaper may take it at any moment);
    /// [`Error::Database`]. After an error the transaction may be aborted.
    ///
    /// # Cancel safety
    ///
    /// Runs on the caller's transaction: if cancelled, roll it back.
    pub async fn fence(&self, tx: &mut sqlx::Transaction<'_, sqlx::Postgres>) -> Result<()> {
        if self.unchecked {
            return Err(self.lost_error(LostReason::Unchecked));
        }
        let ids = self.ids();
        let rows: Vec<FenceRow> = sqlx::query_as(FENCE)
            .bind(&ids)
            .persistent(!self.semaphore.inner.pooled)
            .fetch_all(&mut **tx)
            .await?;
        for id in &ids {
            let reason = match rows.iter().find(|r| r.id == *id) {
                Some(r) => match (r.completed_at, r.timed_out_at, r.unexpired) {
                    (None, None, true) => continue,
                    (_, Some(at), _) => LostReason::TimedOut { at },
                    (Some(at), None, _) => LostReason::AlreadyReleased { at },
                    (None, None, false) => LostReason::LeaseExpired,
                },
                None => LostReason::Missing,
            };
            return Err(self.lost_error(reason));
        }
        Ok(())
    }

    fn lost_error(&self, reason: LostReason) -> Error {
        Error::PermitLost {
            semaphore: self.semaphore.inner.name.clone(),
            id: self.id,
            reason,
        }
    }

    /// Releases the slot (sets `completed_at`) and wakes a waiter, in one round trip.
    ///
    /// # Errors
    ///
    /// - [`Error::PermitLost`] when the slot was no longer held: the lease
    ///   expired and it was reaped, or it was released by someone else. Work
    ///   done since may have overlapped another holder's.
    /// - [`Error::Database`] when the database could not be reached; the slot
    ///   is then freed when its lease expires.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the round trip runs in a spawned task, so the release
    /// happens even if this future is dropped.
    pub async fn release(mut self) -> Result<()> {
        self.released = true;
        self.lease.stop();
        if self.unchecked {
            return Ok(());
        }
        let inner = self.semaphore.inner.clone();
        let (id, acquired_at) = (self.id, self.acquired_at);
        let more = std::mem::take(&mut self.more);
        tokio::spawn(async move { release_claims(&inner, id, more, acquired_at).await })
            .await
            .unwrap_or(Err(Error::Database(sqlx::Error::WorkerCrashed)))
    }
}

/// Releases a permit's claims: one by id, or a weighted permit's together.
async fn release_claims(
    inner: &Inner,
    id: i64,
    more: Vec<(i64, u32)>,
    acquired_at: DateTime<Utc>,
) -> Result<()> {
    if more.is_empty() {
        release_by_id(inner, id, acquired_at).await
    } else {
        extended::release_many(inner, id, &more).await
    }
}

/// The ids of a permit's claims: the first, then those of a weighted
/// permit's other claims.
pub(crate) fn claim_ids(id: i64, more: &[(i64, u32)]) -> Vec<i64> {
    std::iter::once(id)
        .chain(more.iter().map(|&(id, _)| id))
        .collect()
}

/// Releases a claim by id, reporting a lost slot as [`Error::PermitLost`].
async fn release_by_id(inner: &Inner, id: i64, acquired_at: DateTime<Utc>) -> Result<()> {
    let semaphore = inner.name.as_str();
    let (outcome, _, at): (String, Option<String>, Option<DateTime<Utc>>) =
        on_pool!(inner.pool, inner.pooled, |conn| {
            sqlx::query_as(RELEASE)
                .bind(id)
                .persistent(!inner.pooled)
                .fetch_one(conn)
        })
        .await?;
    let reason = match (outcome.as_str(), at) {
        ("released", at) => {
            // Both ends on the database clock.
            let held_ms = at.map(|at| (at - acquired_at).num_milliseconds());
            tracing::debug!(semaphore, id, held_ms, "permit released");
            return Ok(());
        }
        ("timed_out", Some(at)) => LostReason::TimedOut { at },
        ("completed", Some(at)) => LostReason::AlreadyReleased { at },
        _ => LostReason::Missing,
    };
    Err(Error::PermitLost {
        semaphore: semaphore.to_owned(),
        id,
        reason,
    })
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.released || self.unchecked {
            return;
        }
        let inner = self.semaphore.inner.clone();
        let (id, acquired_at) = (self.id, self.acquired_at);
        let more = std::mem::take(&mut self.more);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    if let Err(error) = release_claims(&inner, id, more, acquired_at).await {
                        tracing::warn!(semaphore = %inner.name, id, %error, "background release of a dropped permit failed");
                    }
                });
            }
            Err(_) => tracing::warn!(
                semaphore = %self.semaphore.inner.name,
                id,
                "permit dropped outside a tokio runtime: its slot is freed when the lease expires"
            ),
        }
    }
}

pub(crate) fn not_found_or(error: sqlx::Error, semaphore: &str) -> Error {
    // P0002 no_data_found: raised by pgsemaphore.claim for an unknown semaphore.
    let code = error.as_database_error().and_then(|e| e.code());
    if code.as_deref() == Some("P0002") {
        Error::SemaphoreNotFound {
            semaphore: semaphore.to_owned(),
        }
    } else {
        error.into()
    }
}

fn validate_holder(holder: &str) -> Result<()> {
    validate::text("holder", holder, MAX_HOLDER_LEN)
}

fn lease_interval(lease: Duration) -> Result<PgInterval> {
    validate::interval("lease", lease, MIN_LEASE..=MAX_LEASE)
}

/// `host:pid`, the default holder label.
fn default_holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_owned());
    format!("{host}:{}", std::process::id())
}
