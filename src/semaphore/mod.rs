//! The counting semaphore: its public face. Each public method is a short
//! delegation, straight down:
//!
//! - [`engine`]: the state a handle shares and every admission statement
//!   (claim, release, renew, fence), one SQL function each;
//! - [`wait`]: the wait loops, over the wake-ups of [`wake`];
//! - [`permit`]: [`Permit`] (release, fence, lost, Drop), with its
//!   heartbeat in [`lease`];
//! - [`queue`]: tickets of the fair queue;
//! - [`family`]: [`SemaphoreFamily`], a semaphore per key, each key's
//!   handle an ordinary [`Semaphore`].

pub(crate) mod advisory;
mod engine;
mod family;
mod lease;
mod permit;
mod queue;
mod wait;
pub(crate) mod wake;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use sqlx::postgres::types::PgInterval;
use tokio::time::Instant;

use crate::Client;
use crate::audit::{AuditLog, Holder, Summary};
use crate::error::{self, Error, Result, WaitedFor};
use crate::fail_open::{self, Unchecked};
use crate::metrics::SemaphoreMetrics;
use crate::outcomes::OutcomeKind;
use crate::rate_limit::{ClaimRates, RateLimiter};
use crate::validate;

pub use self::advisory::{
    AdvisoryPermit, AdvisorySemaphore, AdvisorySemaphoreBuilder, DEFAULT_ADVISORY_CONNECTIONS,
};
use self::engine::{Admission, Attempt, Core, Heartbeat, QueueOptions, Several};
pub use self::engine::{Priority, QueueOrder};
pub use self::family::{DEFAULT_IDLE_AFTER, SemaphoreFamily, SemaphoreFamilyBuilder};
pub use self::permit::Permit;

/// The default lease: how long a permit is held without a renewal before
/// the next claim (or a reaper) may free it. Short, so that a crashed
/// holder's slot is free within 10 s with no reaper running; the heartbeat
/// renews a live holder's every third of it (3.3 s). Give a longer lease
/// to ride out a database failover (Patroni takes 30 s or more) or long
/// network stalls: a holder whose renewals fail for most of its lease is
/// told it lost the permit.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// The default interval of the fallback re-check that covers a lost notification.
pub const DEFAULT_FALLBACK_INTERVAL: Duration = Duration::from_secs(2);

/// Opens a semaphore: creates it if it does not exist, and returns the
/// settings in force.
const OPEN: &str = "SELECT o_capacity, o_default_lease, o_created, o_queue_lifo \
                    FROM pgsemaphore.open(p_name => $1, p_capacity => $2, p_lease => $3, \
                                          p_queue_lifo => $4)";

/// Free slots right now (live claims count as held until a reaper or a
/// claim ends them, expired or not).
const AVAILABLE: &str = "SELECT s.capacity - (SELECT count(*)::int FROM pgsemaphore.live_slots l \
                                              WHERE l.semaphore = s.name) \
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
/// use pg_semaphore::{Error, Semaphore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
/// pg_semaphore::migrate(&pool).await?;
/// let client = pg_semaphore::Client::new(pool);
/// let sem = Semaphore::builder("payments-api", 4).build(&client).await?;
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
    core: Arc<Core>,
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let core = &self.core;
        f.debug_struct("Semaphore")
            .field("name", &core.name)
            .field("capacity", &core.capacity)
            .field("lease", &core.lease)
            .field("holder", &core.holder)
            .field("fallback_interval", &core.fallback)
            .field("transaction_pooling", &core.db.is_pooled())
            .field("heartbeat", &core.heartbeat)
            .field("fail_open", &core.fail_open)
            .field("reserved", &core.reserved)
            .field("queue", &core.queue)
            .finish_non_exhaustive()
    }
}

/// Configures a [`Semaphore`]; made by [`Semaphore::builder`].
///
/// The capacity and lease given here are the ones a **new** semaphore is
/// created with. An existing semaphore keeps its own (processes of two
/// versions of an application, in a rolling deploy, never fight over them):
/// change them with [`configure`](crate::admin::configure) or
/// [`set_capacity`](crate::admin::set_capacity), or `pg-semaphore set-capacity`.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// let client = pg_semaphore::Client::new(pool).holder("api-7"); // recorded in the audit log
/// let sem = pg_semaphore::Semaphore::builder("payments-api", 4)
///     .lease(Duration::from_secs(30))          // a crashed holder frees its slot after 30 s
///     .heartbeat(Duration::from_secs(10))      // a live one renews every 10 s
///     .build(&client)
///     .await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `.build(&client).await`"]
pub struct SemaphoreBuilder {
    name: String,
    capacity: u32,
    lease: Duration,
    heartbeat: Heartbeat,
    fail_open: bool,
    reserved: u32,
    queue: Option<QueueOptions>,
}

impl SemaphoreBuilder {
    /// The default lease of a new semaphore: how long a permit is held
    /// before a reaper may free it (default [`DEFAULT_LEASE`], between
    /// [`MIN_LEASE`](crate::limits::MIN_LEASE) and [`MAX_LEASE`](crate::limits::MAX_LEASE)).
    /// Measured on the database clock.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Renews each held permit's lease every `interval` (by default every
    /// third of the lease). The lease must be at least twice the interval.
    ///
    /// A renewal sets the lease to end one full lease after the database's
    /// clock (never earlier than it already did). If renewals fail (database
    /// unreachable) the permit is retried until its lease can no longer be
    /// guaranteed, and then reported lost through [`Permit::lost`]: stop the
    /// protected work then, because the slot may be reaped and claimed by
    /// someone else.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// use std::time::Duration;
    /// let sem = pg_semaphore::Semaphore::builder("exports", 2)
    ///     .lease(Duration::from_secs(30))
    ///     .heartbeat(Duration::from_secs(5))
    ///     .build(&client)
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
    /// down (Stripe's rate limiters "fail open" so that an outage of their
    /// store does not take the site down): use it only where going over the
    /// limit is cheaper than an outage. Only connection failures fail open;
    /// errors that say the database answered (missing migrations, unknown
    /// semaphore, bad input) are still returned. Waiting acquires (`acquire`,
    /// `acquire_many`) never fail open.
    pub fn fail_open(mut self, enabled: bool) -> Self {
        self.fail_open = enabled;
        self
    }

    /// Reserves `slots` of the capacity for critical traffic (default 0):
    /// claims with [`Priority::Low`] succeed only while more than `slots`
    /// slots are free; [`Priority::High`] claims (the default) may use them
    /// all, as Stripe's fleet usage load shedder keeps room for critical
    /// requests: analytics is shed before charges are.
    ///
    /// The reserve belongs to this handle and is sent with each of its
    /// low-priority claims: build every handle of a semaphore with the same
    /// value. Must be below the capacity ([`build`](Self::build) returns
    /// [`Error::InvalidArgument`] otherwise).
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// use pg_semaphore::{Priority, Semaphore};
    /// let sem = Semaphore::builder("workers", 10).reserved(2).build(&client).await?;
    /// let report = sem.acquiring().priority(Priority::Low).try_acquire().await; // needs 3 free
    /// let charge = sem.try_acquire().await; // may take the last slot
    /// # Ok(())
    /// # }
    /// ```
    pub fn reserved(mut self, slots: u32) -> Self {
        self.reserved = slots;
        self
    }

    /// Makes this handle's waiting acquires wait in the semaphore's **fair
    /// queue**, shared by every process, served in `order` (default: no
    /// queue).
    ///
    /// Without a queue, waiting acquires are served in order within each
    /// process, and across processes the fastest claim after a release wins.
    /// With one, waiters are served strictly in order
    /// ([`QueueOrder::OldestFirst`] or [`QueueOrder::NewestFirst`]),
    /// high-priority ones first, whatever process they are in (in a FIFO
    /// queue, waiters of different [fairness keys](Acquiring::fairness_key)
    /// take turns); and while
    /// anyone is queued, no other claim on the semaphore succeeds:
    /// [`try_acquire`](Semaphore::try_acquire) (on any handle) fails fast with
    /// [`Error::NoSlotsAvailable`] rather than jump the queue. A waiter that
    /// is cancelled leaves the queue at once; one whose process crashes
    /// leaves it within 10 seconds.
    ///
    /// The order is the semaphore's, stored with it: `order` is the order a
    /// semaphore this builder *creates* gets; an existing semaphore keeps
    /// its own (a `WARN` event says so when it differs), which this handle
    /// then uses, and an operator changes it with
    /// [`set_queue_order`](crate::admin::set_queue_order).
    ///
    /// Costs: a waiting acquire takes two round trips more than without a
    /// queue (joining and leaving), and each process renews its waiters in
    /// one statement every few seconds. An acquire that finds a free slot
    /// and nobody queued never touches the queue.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// use pg_semaphore::{QueueOrder, Semaphore};
    /// let sem = Semaphore::builder("exports", 2)
    ///     .queue(QueueOrder::OldestFirst)
    ///     .queue_limit(100)
    ///     .build(&client)
    ///     .await?;
    /// let permit = sem.acquire().await?; // Err(QueueFull) if 100 are waiting
    /// # Ok(())
    /// # }
    /// ```
    pub fn queue(mut self, order: QueueOrder) -> Self {
        let limit = self.queue.and_then(|q| q.limit);
        self.queue = Some(QueueOptions { order, limit });
        self
    }

    /// Bounds the fair queue (.NET's `QueueLimit`): an acquire that would
    /// wait while `limit` waiters are already queued fails at once with
    /// [`Error::QueueFull`]. Turns the queue on
    /// ([`QueueOrder::OldestFirst`] unless [`queue`](Self::queue) says
    /// otherwise). The limit is checked with the semaphore's row locked, so
    /// it is exact across processes.
    pub fn queue_limit(mut self, limit: u32) -> Self {
        let order = self.queue.map(|q| q.order).unwrap_or_default();
        self.queue = Some(QueueOptions {
            order,
            limit: Some(limit),
        });
        self
    }

    /// Validates the settings and opens the semaphore: creates it with this
    /// capacity and lease if it does not exist. An existing semaphore keeps
    /// its capacity and lease (a `WARN` event says so when they differ from
    /// this builder's); the handle reports and uses the stored ones.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidArgument`] for a name that is empty, longer than
    ///   [`MAX_NAME_LEN`](crate::limits::MAX_NAME_LEN) or contains NUL; a capacity
    ///   of 0 or above [`MAX_CAPACITY`](crate::limits::MAX_CAPACITY); a lease
    ///   outside [`MIN_LEASE`](crate::limits::MIN_LEASE)..=[`MAX_LEASE`](crate::limits::MAX_LEASE);
    ///   a zero fallback interval; a zero heartbeat interval or one above half
    ///   the lease; a reserve not below the capacity; a bad holder label.
    ///   Nothing is written.
    /// - [`Error::Schema`] when [`migrate`](crate::migrate) was not run.
    /// - [`Error::Database`] for connection and other database errors.
    ///
    /// # Cancel safety
    ///
    /// Opening is one statement: cancelling either creates the semaphore or not.
    pub async fn build(self, client: &Client) -> Result<Semaphore> {
        validate::name(&self.name)?;
        validate::capacity(self.capacity)?;
        let lease = validate::lease(self.lease)?;
        let fallback = client.fallback()?;
        self.heartbeat.check(self.lease, "lease")?;
        let holder = client.holder_label()?;
        validate::reserve(self.reserved, self.capacity)?;
        let db = client.db().clone();
        let requested_order = self.queue.map(|q| q.order).unwrap_or_default();
        let query = db
            .query_as::<(i32, PgInterval, bool, bool)>(OPEN)
            .bind(self.name.clone())
            .bind(self.capacity as i32)
            .bind(lease)
            .bind(requested_order.is_lifo());
        let (capacity, stored_lease, created, lifo) = db
            .fetch_one(query)
            .await
            .map_err(|error| error::semaphore_not_found(error, &self.name))?;
        // The queue's order is the semaphore's: the stored one is in force.
        let stored_order = QueueOrder::from_lifo(lifo);
        let queue = self.queue.map(|q| QueueOptions {
            order: stored_order,
            ..q
        });
        if !created && self.queue.is_some() && stored_order != requested_order {
            tracing::warn!(
                semaphore = %self.name,
                order = ?stored_order,
                requested_order = ?requested_order,
                "semaphore's queue order differs from this handle's, and stays in force; \
                 change it with pg_semaphore::admin::set_queue_order"
            );
        }
        let capacity = capacity.max(1) as u32;
        let stored_lease = engine::duration_of(&stored_lease);
        if created {
            tracing::debug!(semaphore = %self.name, capacity, "semaphore created");
        } else if capacity != self.capacity || stored_lease != self.lease {
            tracing::warn!(
                semaphore = %self.name,
                capacity,
                lease_ms = stored_lease.as_millis() as u64,
                requested_capacity = self.capacity,
                requested_lease_ms = self.lease.as_millis() as u64,
                "semaphore exists with other settings, which stay in force; \
                 change them with pg_semaphore::admin::configure or `pg-semaphore set-capacity`"
            );
        }
        self.heartbeat.check(stored_lease, "lease")?;
        validate::reserve(self.reserved, capacity)?;
        Ok(Semaphore {
            core: Arc::new(Core {
                wakeups: client.wakeups().clone(),
                metrics: SemaphoreMetrics::new(&self.name)
                    .counting(client.outcome_counter(OutcomeKind::Semaphore, &self.name)),
                db,
                name: self.name,
                capacity,
                lease: stored_lease,
                holder,
                fallback,
                heartbeat: self.heartbeat,
                fail_open: self.fail_open,
                reserved: self.reserved,
                queue,
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
            heartbeat: Heartbeat::Default,
            fail_open: false,
            reserved: 0,
            queue: None,
        }
    }

    /// The semaphore's name.
    pub fn name(&self) -> &str {
        &self.core.name
    }

    /// The capacity stored when this handle was opened. An operator may
    /// have changed it since; claims always use the database's current value.
    pub fn capacity(&self) -> u32 {
        self.core.capacity
    }

    /// The default lease stored when this handle was opened (permits from
    /// this handle get it, unless a claim sets its own).
    pub fn lease(&self) -> Duration {
        self.core.lease
    }

    /// The holder label recorded with claims from this handle.
    pub fn holder(&self) -> &str {
        &self.core.holder
    }

    /// The pool this semaphore uses.
    pub fn pool(&self) -> &PgPool {
        self.core.db.pool()
    }

    /// The semaphore's metrics (for `SemaphoreLayer`'s own fail-open).
    #[cfg_attr(not(feature = "tower"), allow(dead_code))]
    pub(crate) fn metrics(&self) -> &SemaphoreMetrics {
        &self.core.metrics
    }

    /// The slots this handle reserves for [`Priority::High`] claims.
    pub fn reserved(&self) -> u32 {
        self.core.reserved
    }

    /// The semaphore's queue order, as stored when this handle was opened,
    /// if this handle's acquires wait in the fair queue.
    pub fn queue_order(&self) -> Option<QueueOrder> {
        self.core.queue.map(|q| q.order)
    }

    /// How many slots are free right now, according to the database.
    ///
    /// Only a snapshot: by the time it returns another process may have
    /// claimed or released. Slots whose lease expired but that were not reaped
    /// yet count as held.
    ///
    /// # Errors
    ///
    /// [`Error::SemaphoreNotFound`], [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn available_permits(&self) -> Result<u32> {
        let core = &self.core;
        let query = core
            .db
            .query_as::<(i32,)>(AVAILABLE)
            .bind(core.name.clone());
        match core.db.fetch_optional(query).await? {
            Some((free,)) => Ok(free.max(0) as u32),
            None => Err(Error::SemaphoreNotFound {
                semaphore: core.name.clone(),
            }),
        }
    }

    /// How many waiters are queued on this semaphore right now, across every
    /// process (crashed waiters whose lease has ended do not count).
    ///
    /// # Errors
    ///
    /// [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn queue_len(&self) -> Result<u32> {
        queue::queue_len(&self.core).await
    }

    /// Starts an acquire with options of its own (metadata, holder label,
    /// lease, priority, fairness key, timeout), as
    /// [`Mutex::locking`](crate::Mutex::locking) starts a lock's.
    ///
    /// ```no_run
    /// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), Box<dyn std::error::Error>> {
    /// let permit = sem
    ///     .acquiring()
    ///     .metadata(serde_json::json!({ "request_id": "r-42", "route": "/charge" }))
    ///     .try_acquire()
    ///     .await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    pub fn acquiring(&self) -> Acquiring<'_> {
        Acquiring {
            semaphore: self,
            holder: None,
            metadata: None,
            lease: None,
            priority: Priority::default(),
            fairness_key: None,
            timeout: None,
            ride_out_outages: true,
            rates: ClaimRates::default(),
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
    /// - [`Error::Stalled`] when another transaction held the semaphore's
    ///   row for longer than 2 s (a claim left uncommitted): nothing was
    ///   claimed; answer 503 as for a full semaphore, and find the culprit.
    /// - [`Error::InvalidArgument`] when the database refused an argument
    ///   (metadata over 64 kB, ...).
    /// - [`Error::SemaphoreNotFound`], [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the claim runs in a spawned task, and a claim that
    /// completes after the caller stopped waiting is released at once.
    pub async fn try_acquire(&self) -> Result<Permit> {
        self.acquiring().try_acquire().await
    }

    /// Waits without limit until a slot is free, then claims it.
    ///
    /// Waiting holds no pooled connection: the task sleeps until a release
    /// anywhere wakes this semaphore (one shared `LISTEN` connection per
    /// pool), until the lease that blocks it ends, or until a slow fallback
    /// re-check in case a notification is lost. Within a process, waiting
    /// acquires are served in order.
    ///
    /// An outage (a database restart, a failover, a partition, an exhausted
    /// pool) or a stall ([`Error::Stalled`]: the semaphore's row held by a
    /// stuck transaction) does not end the wait: the claim is retried, with
    /// a pause that grows to the fallback interval and one `WARN` per
    /// outage, until the database answers again (bound it with
    /// [`Acquiring::timeout`]).
    ///
    /// # Errors
    ///
    /// [`Error::SemaphoreNotFound`], [`Error::Schema`],
    /// [`Error::Database`] for an error the database answered (the wait
    /// stops).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future at any point never leaves a slot
    /// held (see [`try_acquire`](Self::try_acquire)).
    pub async fn acquire(&self) -> Result<Permit> {
        self.acquiring().acquire().await
    }

    /// Claims `n` slots at once if that many are free, or fails at once:
    /// all or nothing, released together by one [`Permit::release`].
    ///
    /// One round trip, the `n` claims inserted in one statement under the
    /// semaphore's row lock; the database's hard limit covers each of them.
    ///
    /// ```no_run
    /// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), pg_semaphore::Error> {
    /// // A heavy job counts for three.
    /// let permit = sem.try_acquire_many(3).await?;
    /// assert_eq!(permit.num_permits(), 3);
    /// permit.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidArgument`] for `n` = 0 or more than the capacity
    ///   (it could never succeed).
    /// - [`Error::NoSlotsAvailable`] when fewer than `n` slots are free, or
    ///   waiters are queued on the semaphore (see [`SemaphoreBuilder::queue`]).
    /// - [`Error::Stalled`], as for [`try_acquire`](Self::try_acquire).
    /// - [`Error::SemaphoreNotFound`], [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: as [`try_acquire`](Self::try_acquire), a claim that
    /// completes after the caller stopped waiting is released at once.
    pub async fn try_acquire_many(&self, n: u32) -> Result<Permit> {
        self.acquiring().try_acquire_many(n).await
    }

    /// Waits without limit until `n` slots are free, then claims them all at
    /// once. Never holds some while waiting for the rest.
    ///
    /// Within a process, waiting acquires of a semaphore are served in
    /// order: a large request at the front is not overtaken by smaller ones
    /// behind it (as with `tokio::sync::Semaphore`). Across processes, build
    /// with [`SemaphoreBuilder::queue`] for the same guarantee.
    ///
    /// # Errors
    ///
    /// As [`try_acquire_many`](Self::try_acquire_many), except that a full
    /// semaphore is waited for; [`Error::QueueFull`] with a queue limit.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future never leaves a slot held, and gives
    /// up its place in the queue.
    pub async fn acquire_many(&self, n: u32) -> Result<Permit> {
        self.acquiring().acquire_many(n).await
    }

    /// Claims permits of **several semaphores at once**, all or nothing,
    /// without waiting: `n` permits of each `(semaphore, n)`, in one round
    /// trip and one transaction (`pgsemaphore.claim_all`). Either every
    /// semaphore admits its permits or none is claimed.
    ///
    /// For limits that hold together: "at most 100 calls to the payment API
    /// in total, and at most 5 per merchant". The semaphores may be named in
    /// any order: the database claims them in one canonical order (by
    /// name), so two callers naming them in opposite orders never deadlock.
    /// The [`Permit`] holds every claim, with one token, one lease (the
    /// shortest default lease of the semaphores), one heartbeat (the first
    /// semaphore's, in byte order of the names) and one release; each of
    /// its [`ids`](Permit::ids) is a fencing token on its own semaphore,
    /// and the audit log links the claims (`group_id`,
    /// [`ClaimRecord::group_id`](crate::audit::ClaimRecord::group_id)).
    ///
    /// A multi-limit claim is of high priority, takes no place in a fair
    /// queue, and is refused while any of its semaphores has a
    /// high-priority waiter queued; it never fails open, and the holder
    /// label is the first semaphore's handle's.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// use pg_semaphore::Semaphore;
    /// let global = Semaphore::builder("payments-api", 100).build(&client).await?;
    /// let merchant = Semaphore::builder("payments-api:merchant-42", 5).build(&client).await?;
    /// let permit = Semaphore::try_acquire_all(&[(&global, 1), (&merchant, 1)]).await?;
    /// // ... call the payment API for merchant 42 ...
    /// permit.release().await?; // both at once
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// - [`Error::NoSlotsAvailable`] naming the first semaphore (in the
    ///   canonical order) that could not admit its permits; nothing is held.
    /// - [`Error::InvalidArgument`] for no semaphore or more than
    ///   [`MAX_SEMAPHORES_PER_CLAIM`](crate::limits::MAX_SEMAPHORES_PER_CLAIM), a
    ///   semaphore named twice (argument `semaphores`), a count of 0 or more
    ///   than a semaphore's capacity (`permits`), or handles built on
    ///   different clients (`semaphores`). Nothing is sent.
    /// - [`Error::SemaphoreNotFound`], [`Error::Stalled`] (naming every
    ///   semaphore of the claim), [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a claim that completes after the caller stopped waiting
    /// is released at once, all of it.
    pub async fn try_acquire_all(semaphores: &[(&Semaphore, u32)]) -> Result<Permit> {
        let several = several(semaphores)?;
        let claim = Permit::claim_all(&several, &several.lead().holder, None).await?;
        refusal_of_all(&several, claim)
    }

    /// Waits without limit until every `(semaphore, n)` can admit its `n`
    /// permits at the same instant, then claims them all at once, as
    /// [`try_acquire_all`](Self::try_acquire_all) does.
    ///
    /// Holds nothing while it waits: holding the global permit while waiting
    /// for the per-merchant one would starve everyone else. The waiter
    /// claims again whenever any of the semaphores is released (its
    /// wake-up), when the lease that refused it ends, or at the fallback
    /// re-check. It takes no place in any process's order or fair queue:
    /// while one of its semaphores has waiters queued it waits for them, and
    /// under a steady stream of single claims that keep one of its
    /// semaphores full it may wait long (it wins only an instant when every
    /// semaphore has room). Bound it with `tokio::time::timeout`:
    ///
    /// ```no_run
    /// # async fn run(a: pg_semaphore::Semaphore, b: pg_semaphore::Semaphore) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use pg_semaphore::Semaphore;
    /// // The future is cancel-safe: a timeout around it leaves nothing held.
    /// let permit = tokio::time::timeout(
    ///     Duration::from_secs(10),
    ///     Semaphore::acquire_all(&[(&a, 1), (&b, 1)]),
    /// )
    /// .await??;
    /// permit.release().await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`try_acquire_all`](Self::try_acquire_all), except that full
    /// semaphores are waited for. Database outages are ridden out, as
    /// [`acquire`](Self::acquire) does.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future never leaves a slot held, and
    /// unregisters its wake-ups; so `tokio::time::timeout` around it bounds
    /// the wait (there is no `acquire_all_timeout`: it would do the same,
    /// in this process).
    pub async fn acquire_all(semaphores: &[(&Semaphore, u32)]) -> Result<Permit> {
        let several = several(semaphores)?;
        wait::acquire_all(&several, &several.lead().holder, None, true, None).await
    }

    /// Waits until the semaphore has no live holders, in any process.
    ///
    /// The distributed counterpart of a WaitGroup's `Wait` (as in Go's
    /// `sync.WaitGroup`, across processes): start workers that each hold a
    /// permit, then wait for all of them to release. Returns at once if
    /// nobody holds a permit. A holder whose lease has ended counts as gone.
    ///
    /// Waiting holds no pooled connection: the task re-checks (one round
    /// trip) when a release anywhere wakes this semaphore, when the earliest
    /// lease ends, or every
    /// [`fallback_interval`](crate::Client::fallback_interval) in case a
    /// notification is lost.
    ///
    /// ```no_run
    /// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), pg_semaphore::Error> {
    /// // ... workers in many processes hold permits of `sem` while they work ...
    /// sem.wait_idle().await?;
    /// println!("every worker has finished");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::SemaphoreNotFound`], [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only reads; dropping the future unregisters it. Bound
    /// the wait with `tokio::time::timeout` around it (there is no
    /// `wait_idle_timeout`: it would do the same).
    pub async fn wait_idle(&self) -> Result<()> {
        wait::idle(&self.core).await
    }

    /// Live holders of this semaphore. See [`AuditLog::holders`].
    ///
    /// # Errors
    ///
    /// [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn holders(&self) -> Result<Vec<Holder>> {
        AuditLog::new(self.pool()).holders(&self.core.name).await
    }

    /// Summary of this semaphore's claims over a time window. See [`AuditLog::summary`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a window whose end precedes its start,
    /// [`Error::Schema`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn summary(&self, window: std::ops::Range<DateTime<Utc>>) -> Result<Summary> {
        AuditLog::new(self.pool())
            .summary(&self.core.name, window)
            .await
    }
}

/// One acquire's options; made by [`Semaphore::acquiring`].
#[derive(Debug)]
#[must_use = "does nothing until one of its acquire methods is awaited"]
pub struct Acquiring<'a> {
    semaphore: &'a Semaphore,
    holder: Option<String>,
    metadata: Option<serde_json::Value>,
    lease: Option<Duration>,
    priority: Priority,
    fairness_key: Option<String>,
    timeout: Option<Duration>,
    ride_out_outages: bool,
    rates: ClaimRates,
}

impl Acquiring<'_> {
    /// A wait with this claim ends with the error when the database cannot be
    /// reached, instead of retrying through the outage (the tower layer: an
    /// outage is answered at once).
    #[cfg(feature = "tower")]
    pub(crate) fn fail_on_outage(mut self) -> Self {
        self.ride_out_outages = false;
        self
    }

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

    /// The claim's priority (default [`Priority::High`]): a
    /// [`Priority::Low`] claim leaves the semaphore's
    /// [`reserved`](SemaphoreBuilder::reserved) slots free.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// The claim's **fairness key** in the semaphore's fair queue (a
    /// tenant, a customer, a job kind; default: none, the one shared
    /// default key), 1 to [`MAX_FAIRNESS_KEY_LEN`](crate::limits::MAX_FAIRNESS_KEY_LEN) characters.
    ///
    /// In a FIFO queue ([`QueueOrder::OldestFirst`]), waiters of different
    /// fairness keys take turns: a key with one waiter is served within one
    /// turn of the rotation, however many waiters another key has; within a
    /// key, arrival order; priority first. If one tenant queued 10,000 jobs,
    /// a tenant that then queues one job is served after at most one job of
    /// each other key waiting, not after all 10,000. Waiters without a key
    /// share the default key, so with no keys at all the queue is plain
    /// arrival order. Keys are the caller's word: a tenant that spreads its
    /// jobs over many keys gets many turns.
    ///
    /// The key orders waiters only: it is stored with this claim's place in
    /// the queue, never with the permit. It has nothing to order, and is
    /// ignored, where the claim never queues: on a handle built without
    /// [`queue`](SemaphoreBuilder::queue), by
    /// [`try_acquire`](Self::try_acquire) and
    /// [`try_acquire_many`](Self::try_acquire_many), and by an acquire that
    /// finds a free slot and nobody queued. A LIFO queue
    /// ([`QueueOrder::NewestFirst`]) serves the newest waiter first and
    /// ignores keys. The key is still checked in every case.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// # let client = pg_semaphore::Client::new(pool.clone());
    /// use pg_semaphore::{QueueOrder, Semaphore};
    /// let sem = Semaphore::builder("exports", 2)
    ///     .queue(QueueOrder::OldestFirst)
    ///     .build(&client)
    ///     .await?;
    /// let permit = sem.acquiring().fairness_key("tenant-7").acquire().await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// A key that is empty, longer than [`MAX_FAIRNESS_KEY_LEN`](crate::limits::MAX_FAIRNESS_KEY_LEN) or contains
    /// NUL makes the acquire fail with [`Error::InvalidArgument`] (argument
    /// `fairness_key`) before anything is sent.
    pub fn fairness_key(mut self, key: impl Into<String>) -> Self {
        self.fairness_key = Some(key.into());
        self
    }

    /// Bounds a waiting [`acquire`](Self::acquire) or
    /// [`acquire_many`](Self::acquire_many): after `timeout` it gives up
    /// with [`Error::Timeout`] (waiting for a permit of this semaphore),
    /// leaving nothing held or queued. The timeout bounds the whole call,
    /// claim round trips included. Default: no limit. The fail-fast
    /// [`try_acquire`](Self::try_acquire) never waits and ignores it.
    ///
    /// The deadline is kept in this process (a semaphore's waiters are not
    /// PostgreSQL lock waits), so it does what `tokio::time::timeout` around
    /// the cancel-safe acquire does, at the same cost. It stays an option
    /// for its answer: an [`Error::Timeout`] naming the semaphore, which
    /// [`Error::is_busy`] counts as busy (as it does the mutex's timeouts),
    /// the `pg_semaphore_timeouts_total` metric counts, and the tower
    /// layer's `wait` answers with 503 (a `tokio::time::timeout` drops the
    /// future, which cannot tell a timeout from any other cancellation).
    ///
    /// ```no_run
    /// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), pg_semaphore::Error> {
    /// use std::time::Duration;
    /// match sem.acquiring().timeout(Duration::from_secs(5)).acquire().await {
    ///     Ok(permit) => permit.release().await?,
    ///     Err(e) if e.is_busy() => println!("still full after 5 s: answer 503"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Also takes one permit of `limiter` for `key`, in the same claim and
    /// the same transaction: the request is admitted only when the
    /// semaphore has room **and** the rate limit admits it, and takes
    /// nothing from either otherwise. Call it again for more limits (up to
    /// [`MAX_LIMITS`](crate::limits::MAX_LIMITS)).
    ///
    /// A concurrency limit checked before a rate limit would hold its slot
    /// while the rate check refuses (and a rate check first would spend a
    /// permit on a request the semaphore then refuses); here neither can
    /// happen. A refusal by the rate limit is [`Error::RateLimited`], with
    /// the limiter's name and its retry-after; a waiting
    /// [`acquire`](Self::acquire) sleeps until then and claims again, or,
    /// when that is past its [`timeout`](Self::timeout), returns
    /// [`Error::RateLimited`] at once.
    ///
    /// ```no_run
    /// # async fn run(client: pg_semaphore::Client) -> Result<(), Box<dyn std::error::Error>> {
    /// use pg_semaphore::{Error, RateLimiter, RatePolicy, Semaphore};
    /// let upstream = Semaphore::builder("geocoder", 8).build(&client).await?;
    /// // The upstream's contract: 8 at once, and 20 calls per second per customer.
    /// let per_customer =
    ///     RateLimiter::builder("geocoder-rate", RatePolicy::token_bucket(20.0, 20)).build(&client)?;
    /// match upstream.acquiring().rate_limit(&per_customer, "customer-7").try_acquire().await {
    ///     Ok(permit) => {
    ///         // ... call the geocoder ...
    ///         permit.release().await?;
    ///     }
    ///     Err(Error::RateLimited { retry_after, .. }) => println!("429, retry in {retry_after:?}"),
    ///     Err(e) if e.is_busy() => println!("503: 8 calls in flight"),
    ///     Err(e) => return Err(e.into()),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Such a claim runs as a [multi-limit claim](Semaphore::try_acquire_all)
    /// does (`pgsemaphore.claim_all`): of high priority, outside the fair
    /// queue (a [`fairness_key`](Self::fairness_key) or [`Priority::Low`]
    /// with it is [`Error::InvalidArgument`]), never failing open. The
    /// limiters must be built on the semaphore's [`Client`](crate::Client).
    /// An acquire cancelled after its claim committed releases the slots at
    /// once, as any acquire does; its rate permits stay spent (a limit
    /// admits less, never more).
    pub fn rate_limit(mut self, limiter: &RateLimiter, key: impl Into<String>) -> Self {
        self.rates.push(limiter, key.into());
        self
    }

    /// As [`Semaphore::try_acquire`], with this claim's options.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::try_acquire`], plus [`Error::InvalidArgument`] for a
    /// bad holder label, lease, metadata (NUL characters) or fairness key.
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::try_acquire`].
    pub async fn try_acquire(self) -> Result<Permit> {
        self.try_acquire_many(1).await
    }

    /// As [`Semaphore::acquire`], with this claim's options.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::acquire`], plus [`Error::InvalidArgument`] for a bad
    /// holder label, lease, metadata or fairness key, and
    /// [`Error::Timeout`] after this claim's [`timeout`](Self::timeout).
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::acquire`].
    pub async fn acquire(self) -> Result<Permit> {
        self.acquire_many(1).await
    }

    /// As [`Semaphore::try_acquire_many`], with this claim's options.
    ///
    /// # Errors
    ///
    /// As [`Semaphore::try_acquire_many`]; [`Error::InvalidArgument`] also
    /// for a low-priority `n` above the capacity minus the reserve.
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::try_acquire_many`].
    pub async fn try_acquire_many(self, n: u32) -> Result<Permit> {
        if !self.rates.is_empty() {
            let (several, attempt) = self.rated(n)?;
            let claim =
                Permit::claim_all(&several, &attempt.holder, attempt.metadata.as_ref()).await?;
            return refusal_of_all(&several, claim);
        }
        let core = &self.semaphore.core;
        let attempt = self.attempt(n)?;
        let refused = |capacity| {
            core.metrics.no_slots();
            Error::NoSlotsAvailable {
                semaphore: core.name.clone(),
                capacity,
            }
        };
        let result = match Permit::claim(core, &attempt, None).await {
            Ok(Admission::Claimed(permit)) => Ok(permit),
            Ok(Admission::Full { capacity, .. } | Admission::Behind { capacity, .. }) => {
                tracing::debug!(semaphore = %core.name, capacity, "no slots available");
                Err(refused(capacity))
            }
            // Only a queued claim carries a ticket; a single claim charges
            // no rate limit.
            Ok(Admission::NoTicket | Admission::RateLimited { .. }) => Err(refused(core.capacity)),
            Ok(Admission::TooMany { capacity }) => Err(wait::too_many(core, &attempt, capacity)),
            Err(error) => Err(error),
        };
        let unchecked = Unchecked::Permit {
            semaphore: &core.name,
            metrics: &core.metrics,
        };
        match result {
            Err(error)
                if fail_open::admits(core.fail_open, &error, core.db.pool(), unchecked).await =>
            {
                Ok(Permit::unchecked(core))
            }
            other => other,
        }
    }

    /// As [`Semaphore::acquire_many`], with this claim's options.
    ///
    /// # Errors
    ///
    /// As [`Acquiring::try_acquire_many`], waiting instead of
    /// [`Error::NoSlotsAvailable`]; [`Error::Timeout`] after this claim's
    /// [`timeout`](Self::timeout).
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::acquire_many`].
    pub async fn acquire_many(self, n: u32) -> Result<Permit> {
        let core = &self.semaphore.core;
        let timeout = self.timeout;
        if !self.rates.is_empty() {
            let (several, attempt) = self.rated(n)?;
            let deadline = timeout.and_then(|timeout| Instant::now().checked_add(timeout));
            let wait = wait::acquire_all(
                &several,
                &attempt.holder,
                attempt.metadata.as_ref(),
                attempt.ride_out_outages,
                deadline,
            );
            let Some(timeout) = timeout else {
                return wait.await;
            };
            let waited_for = WaitedFor::Permit {
                semaphore: core.name.clone(),
            };
            let result = with_timeout(timeout, waited_for, wait).await;
            if let Err(Error::Timeout { .. }) = result {
                core.metrics.timed_out();
            }
            return result;
        }
        let attempt = self.attempt(n)?;
        let Some(timeout) = timeout else {
            return wait::acquire(core, &attempt).await;
        };
        let waited_for = WaitedFor::Permit {
            semaphore: core.name.clone(),
        };
        let result = with_timeout(timeout, waited_for, wait::acquire(core, &attempt)).await;
        if let Err(Error::Timeout { .. }) = result {
            core.metrics.timed_out();
        }
        result
    }

    /// A claim with rate limits: `permits` of this semaphore and one permit
    /// of each limit, as one multi-limit claim, with this claim's checked
    /// options (its holder, lease and metadata).
    fn rated(mut self, permits: u32) -> Result<(Several, Attempt)> {
        if self.fairness_key.is_some() || self.priority == Priority::Low {
            return Err(Error::invalid(
                "rate_limit",
                "a claim with rate limits is of high priority and takes no place in the fair \
                 queue: drop its fairness_key and Priority::Low",
            ));
        }
        let rates = std::mem::take(&mut self.rates);
        let semaphore = self.semaphore;
        let attempt = self.attempt(permits)?;
        let mut several = several(&[(semaphore, permits)])?;
        several.rates = rates;
        several.lease = attempt.lease;
        Ok((several, attempt))
    }

    /// Validates the options for a claim of `permits` slots.
    fn attempt(self, permits: u32) -> Result<Attempt> {
        let core = &self.semaphore.core;
        let holder = match self.holder {
            Some(holder) => {
                validate::holder(&holder)?;
                holder
            }
            None => core.holder.clone(),
        };
        let lease = match self.lease {
            Some(lease) => {
                core.heartbeat.check(lease, "lease")?;
                Some(validate::lease(lease)?)
            }
            None => None,
        };
        if let Some(metadata) = &self.metadata {
            validate::json("metadata", metadata)?;
        }
        if let Some(key) = &self.fairness_key {
            validate::fairness_key(key)?;
        }
        let attempt = Attempt {
            holder,
            metadata: self.metadata,
            lease,
            permits,
            priority: self.priority,
            fairness_key: self.fairness_key,
            ride_out_outages: self.ride_out_outages,
        };
        validate::positive("permits", permits.into())?;
        if permits > attempt.usable(core.capacity, core.reserved) {
            return Err(wait::too_many(core, &attempt, core.capacity));
        }
        Ok(attempt)
    }
}

/// One permit of each of `semaphores` and of each rate limit of `rates`,
/// in one claim: at once (`wait` `None`) or waiting up to `wait` (the tower
/// layer's claims; an outage ends the wait at once).
#[cfg(feature = "tower")]
pub(crate) async fn acquire_with_rates(
    semaphores: &[&Semaphore],
    rates: ClaimRates,
    wait: Option<Duration>,
) -> Result<Permit> {
    let members: Vec<(&Semaphore, u32)> = semaphores.iter().map(|s| (*s, 1)).collect();
    let mut several = several(&members)?;
    several.rates = rates;
    let holder = several.lead().holder.clone();
    let Some(timeout) = wait else {
        let claim = Permit::claim_all(&several, &holder, None).await?;
        return refusal_of_all(&several, claim);
    };
    let waited_for = WaitedFor::Permit {
        semaphore: semaphores
            .last()
            .map(|s| s.name().to_owned())
            .unwrap_or_default(),
    };
    with_timeout(
        timeout,
        waited_for,
        wait::acquire_all(
            &several,
            &holder,
            None,
            false,
            Instant::now().checked_add(timeout),
        ),
    )
    .await
}

/// A multi-limit claim's answer as a fail-fast acquire returns it: the
/// permit, or the refusal naming what refused.
fn refusal_of_all(
    several: &Several,
    (claim, refused_by): (Admission<Permit>, Option<String>),
) -> Result<Permit> {
    let lead = several.lead();
    match claim {
        Admission::Claimed(permit) => Ok(permit),
        Admission::TooMany { capacity } => {
            Err(wait::too_many_of(several, refused_by.as_deref(), capacity))
        }
        Admission::Full { capacity, .. } | Admission::Behind { capacity, .. } => {
            let semaphore = refused_by.unwrap_or_else(|| lead.name.clone());
            if let Some((core, _)) = several.members.iter().find(|(c, _)| c.name == semaphore) {
                core.metrics.no_slots();
            }
            Err(Error::NoSlotsAvailable {
                semaphore,
                capacity,
            })
        }
        Admission::RateLimited { retry_in } => Err(Error::RateLimited {
            limiter: refused_by.unwrap_or_default(),
            retry_after: retry_in,
        }),
        Admission::NoTicket => Err(Error::NoSlotsAvailable {
            semaphore: lead.name.clone(),
            capacity: lead.capacity,
        }),
    }
}

/// Validates a multi-limit claim's members and puts them in the canonical
/// order (byte order of the names, as `pgsemaphore.claim_all` locks them).
fn several(semaphores: &[(&Semaphore, u32)]) -> Result<Several> {
    validate::several(
        semaphores
            .iter()
            .map(|(semaphore, permits)| (semaphore.core.name.as_str(), *permits)),
    )?;
    let mut members: Vec<(Arc<Core>, u32)> = semaphores
        .iter()
        .map(|(semaphore, permits)| (semaphore.core.clone(), *permits))
        .collect();
    members.sort_by(|(a, _), (b, _)| a.name.cmp(&b.name));
    let lead = &members[0].0;
    if let Some((other, _)) = members
        .iter()
        .find(|(core, _)| !Arc::ptr_eq(&core.wakeups, &lead.wakeups))
    {
        return Err(Error::invalid(
            "semaphores",
            format!(
                "semaphores {:?} and {:?} were built on different clients: a multi-limit claim is one \
                 transaction of one database, so build every handle on the same client",
                lead.name, other.name
            ),
        ));
    }
    if let Some((core, permits)) = members
        .iter()
        .find(|(core, permits)| *permits > core.capacity)
    {
        return Err(Error::invalid(
            "permits",
            format!(
                "{permits} can never be held at once: semaphore {:?} allows at most {}",
                core.name, core.capacity
            ),
        ));
    }
    Ok(Several {
        members,
        rates: ClaimRates::default(),
        lease: None,
    })
}

/// Runs `wait`, giving up with [`Error::Timeout`] after `timeout` (a deadline
/// too far to represent is no deadline).
async fn with_timeout<T>(
    timeout: Duration,
    waited_for: WaitedFor,
    wait: impl Future<Output = Result<T>>,
) -> Result<T> {
    let Some(deadline) = Instant::now().checked_add(timeout) else {
        return wait.await;
    };
    match tokio::time::timeout_at(deadline, wait).await {
        Ok(result) => result,
        Err(_elapsed) => {
            tracing::debug!(
                waited_for = %waited_for,
                timeout_ms = timeout.as_millis() as u64,
                "wait timed out"
            );
            Err(Error::Timeout {
                waited_for,
                timeout,
            })
        }
    }
}

/// `host:pid`, the default holder label.
pub(crate) fn default_holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_owned());
    format!("{host}:{}", std::process::id())
}
