//! The fair queue: waiters of a semaphore served in arrival order across
//! every process (seed 003's `ConcurrencyLimiter` with `QueueLimit` and
//! `QueueProcessingOrder`).
//!
//! A queued acquire that finds no room inserts a row in `pgsemaphore.waiters`
//! (its *ticket*: the row's id is its place), and from then on only the head
//! of the queue may claim (`pgsemaphore.claim_many` checks it under the
//! semaphore's row lock); every other claim on the semaphore, queued or not,
//! is refused while a waiter is ahead of it. The head is the oldest waiter
//! (or the newest, for [`QueueOrder::NewestFirst`]); high-priority waiters
//! come before low-priority ones.
//!
//! Leaving: a served waiter's row is deleted by its claim; a cancelled one
//! deletes its row (in a spawned task) and notifies the semaphore so the
//! next head looks. A crashed process stops renewing its waiters' rows (the
//! first waiter of each semaphore in a process renews the rows of all of
//! them, one statement every few seconds); a row whose lease has ended is
//! ignored by every claim and deleted by the next queued claim or enqueue.

use std::time::Duration;

use sqlx::postgres::types::PgInterval;
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::semaphore::{ClaimArgs, Inner, Semaphore, SemaphoreBuilder};

/// How long a waiter's row outlives its process's last renewal: a crashed
/// waiter holds up the queue for at most this long.
const WAITER_LEASE: Duration = Duration::from_secs(10);

/// Joins the queue: a ticket, or NULL when the queue is full.
const ENQUEUE: &str = "SELECT pgsemaphore.enqueue($1, $2, $3, $4, $5, $6)";

/// Leaves the queue and tells the semaphore's waiters, so the next head looks.
const LEAVE: &str = "WITH gone AS (DELETE FROM pgsemaphore.waiters WHERE id = $1 RETURNING semaphore) \
                     SELECT pg_notify('pgsemaphore', semaphore) FROM gone";

/// Renews the leases of a process's waiters that are still live: a waiter
/// whose lease ended is gone for everyone else and stays gone (its acquire
/// queues again). Rows are locked in id order, skipping any a claim holds
/// right now, so a renewal never deadlocks with a claim deleting them.
const RENEW: &str = "UPDATE pgsemaphore.waiters w SET expires_at = clock_timestamp() + $2 \
                     FROM (SELECT id FROM pgsemaphore.waiters \
                            WHERE id = ANY ($1) AND expires_at > clock_timestamp() \
                            ORDER BY id FOR UPDATE SKIP LOCKED) live \
                     WHERE w.id = live.id";

/// Live waiters of a semaphore.
const QUEUED: &str = "SELECT count(*) FROM pgsemaphore.waiters \
                      WHERE semaphore = $1 AND expires_at > clock_timestamp()";

/// The order in which a semaphore's queue serves its waiters (.NET's
/// `QueueProcessingOrder`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QueueOrder {
    /// First come, first served (FIFO; the default).
    #[default]
    OldestFirst,
    /// Last come, first served (LIFO): under overload the freshest requests,
    /// whose callers are still there, are served; old ones time out.
    NewestFirst,
}

impl QueueOrder {
    pub(crate) fn is_lifo(self) -> bool {
        self == QueueOrder::NewestFirst
    }

    /// A ticket's place in the local order: smallest first.
    pub(crate) fn place(self, ticket: i64) -> i64 {
        if self.is_lifo() { -ticket } else { ticket }
    }
}

/// A handle's queue settings.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct QueueOptions {
    pub(crate) order: QueueOrder,
    pub(crate) limit: Option<u32>,
}

impl SemaphoreBuilder {
    /// Makes this handle's waiting acquires wait in the semaphore's **fair
    /// queue**, shared by every process, served in `order` (default: no
    /// queue).
    ///
    /// Without a queue a release wakes one waiter per process and the
    /// fastest claim wins. With one, waiters are served strictly in order
    /// ([`QueueOrder::OldestFirst`] or [`QueueOrder::NewestFirst`]),
    /// high-priority ones first, whatever process they are in; and while
    /// anyone is queued, no other claim on the semaphore succeeds:
    /// [`try_acquire`](Semaphore::try_acquire) (on any handle) fails fast with
    /// [`Error::NoSlotsAvailable`] rather than jump the queue. A waiter that
    /// is cancelled leaves the queue at once; one whose process crashes
    /// leaves it within 10 seconds. Every queued handle of a semaphore must
    /// use the same order: a FIFO and a LIFO waiter can each find the other
    /// ahead of it, and wait until one of them gives up.
    ///
    /// Costs: a waiting acquire takes two round trips more than without a
    /// queue (joining and leaving), and each process renews its waiters in
    /// one statement every few seconds. An acquire that finds a free slot
    /// and nobody queued never touches the queue.
    ///
    /// The order belongs to this handle: build every handle of a semaphore
    /// with the same one.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// use pg_semaphore::{QueueOrder, Semaphore};
    /// let sem = Semaphore::builder("exports", 2)
    ///     .queue(QueueOrder::OldestFirst)
    ///     .queue_limit(100)
    ///     .build(&pool)
    ///     .await?;
    /// let permit = sem.acquire().await?; // Err(QueueFull) if 100 are waiting
    /// # Ok(())
    /// # }
    /// ```
    pub fn queue(mut self, order: QueueOrder) -> Self {
        let limit = self.ext.queue.and_then(|q| q.limit);
        self.ext.queue = Some(QueueOptions { order, limit });
        self
    }

    /// Bounds the fair queue (.NET's `QueueLimit`): an acquire that would
    /// wait while `limit` waiters are already queued fails at once with
    /// [`Error::QueueFull`]. Turns the queue on
    /// ([`QueueOrder::OldestFirst`] unless [`queue`](Self::queue) says
    /// otherwise). The limit is checked with the semaphore's row locked, so
    /// it is exact across processes.
    pub fn queue_limit(mut self, limit: u32) -> Self {
        let order = self.ext.queue.map(|q| q.order).unwrap_or_default();
        self.ext.queue = Some(QueueOptions {
            order,
            limit: Some(limit),
        });
        self
    }
}

impl Semaphore {
    /// This handle's queue order, if its acquires wait in the fair queue.
    pub fn queue_order(&self) -> Option<QueueOrder> {
        self.inner.ext.queue.map(|q| q.order)
    }

    /// How many waiters are queued on this semaphore right now, across every
    /// process (crashed waiters whose lease has ended do not count).
    ///
    /// # Errors
    ///
    /// [`Error::MigrationsMissing`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Read-only: cancel at will.
    pub async fn queue_len(&self) -> Result<u32> {
        let inner = &self.inner;
        let queued: i64 = on_pool!(inner.pool, inner.pooled, |conn| {
            sqlx::query_scalar(QUEUED)
                .bind(&inner.name)
                .persistent(!inner.pooled)
                .fetch_one(conn)
        })
        .await?;
        Ok(queued.max(0) as u32)
    }
}

pub(crate) fn waiter_lease() -> PgInterval {
    PgInterval {
        months: 0,
        days: 0,
        microseconds: WAITER_LEASE.as_micros() as i64,
    }
}

/// How often the first waiter of a process renews its process's waiters.
pub(crate) fn renew_every() -> Duration {
    WAITER_LEASE / 3
}

/// Joins the queue, cancel-safe: the round trip runs in a spawned task that
/// leaves the queue again if the caller has gone.
pub(crate) async fn enqueue(args: &ClaimArgs, options: QueueOptions) -> Result<i64> {
    let (tx, rx) = oneshot::channel();
    let task_args = args.clone();
    tokio::spawn(async move {
        let result = enqueue_round_trip(&task_args, options).await;
        if let Err(Ok(id)) = tx.send(result) {
            Ticket::new(task_args.semaphore.clone(), id);
        }
    });
    rx.await
        .unwrap_or(Err(Error::Database(sqlx::Error::WorkerCrashed)))
}

async fn enqueue_round_trip(args: &ClaimArgs, options: QueueOptions) -> Result<i64> {
    let inner = &args.semaphore.inner;
    let limit = options.limit.map(|l| l.min(i32::MAX as u32) as i32);
    let ticket: Option<i64> = on_pool!(inner.pool, inner.pooled, |conn| {
        sqlx::query_scalar(ENQUEUE)
            .bind(&inner.name)
            .bind(args.permits as i32)
            .bind(args.priority_sql())
            .bind(&args.holder)
            .bind(limit)
            .bind(waiter_lease())
            .persistent(!inner.pooled)
            .fetch_one(conn)
    })
    .await
    .map_err(|error| crate::semaphore::not_found_or(error, &inner.name))?;
    match ticket {
        Some(id) => {
            tracing::debug!(semaphore = %inner.name, ticket = id, "queued");
            Ok(id)
        }
        None => Err(Error::QueueFull {
            semaphore: inner.name.clone(),
            limit: options.limit.unwrap_or(0),
        }),
    }
}

/// Renews the waiter rows `ids` of this process; a failure is logged (the
/// rows then expire and their waiters queue again).
pub(crate) async fn renew(inner: &Inner, ids: &[i64]) {
    if ids.is_empty() {
        return;
    }
    let result = on_pool!(inner.pool, inner.pooled, |conn| {
        sqlx::query(RENEW)
            .bind(ids)
            .bind(waiter_lease())
            .persistent(!inner.pooled)
            .execute(conn)
    })
    .await;
    if let Err(error) = result {
        tracing::warn!(semaphore = %inner.name, %error, "renewing queued waiters failed");
    }
}

/// A place in the database queue. Dropping it leaves the queue (in a
/// spawned task), unless its claim was served.
pub(crate) struct Ticket {
    semaphore: Semaphore,
    id: i64,
    armed: bool,
}

impl Ticket {
    pub(crate) fn new(semaphore: Semaphore, id: i64) -> Ticket {
        Ticket {
            semaphore,
            id,
            armed: true,
        }
    }

    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// The claim deleted the row itself: nothing to leave.
    pub(crate) fn served(mut self) {
        self.armed = false;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let inner = self.semaphore.inner.clone();
        let id = self.id;
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(semaphore = %inner.name, ticket = id, "waiter dropped outside a runtime; its lease ends its place");
            return;
        };
        handle.spawn(async move {
            let result = on_pool!(inner.pool, inner.pooled, |conn| {
                sqlx::query(LEAVE)
                    .bind(id)
                    .persistent(!inner.pooled)
                    .execute(conn)
            })
            .await;
            match result {
                Ok(_) => tracing::debug!(semaphore = %inner.name, ticket = id, "left the queue"),
                Err(error) => tracing::warn!(
                    semaphore = %inner.name, ticket = id, %error,
                    "leaving the queue failed; the waiter's lease ends its place"
                ),
            }
        });
    }
}
