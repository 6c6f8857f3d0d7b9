//! Claims beyond the fast path: weighted permits (n slots at once, all or
//! nothing), low-priority claims that leave a reserve free for critical
//! traffic (seed 002's fleet usage load shedder), and claims through the
//! fair queue (`src/queue.rs`). One SQL function does them all,
//! `pgsemaphore.claim_many` in `migrations/20261121000005_pgsemaphore_extensions.sql`.
//!
//! A plain claim (one permit, high priority, no queue) keeps the fast path
//! of `src/semaphore.rs`.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;

use crate::error::{Error, LostReason, Result};
use crate::queue::{self, Ticket};
use crate::semaphore::{Claim, ClaimArgs, Inner, Permit, Semaphore, SemaphoreBuilder};

/// The extended claim, one round trip; see the migration for its statuses.
const CLAIM_MANY: &str = "SELECT o_status, o_ids, o_slots, o_created_at, o_expires_at, o_capacity, o_free \
                          FROM pgsemaphore.claim_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

/// Ends every claim of a weighted permit and notifies waiters, in one round trip.
const RELEASE_MANY: &str = "SELECT o_outcome, o_id, o_at FROM pgsemaphore.release_many($1)";

/// Which claims may use the reserved capacity of a semaphore (see
/// [`SemaphoreBuilder::reserved`]).
///
/// ```no_run
/// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), pg_semaphore::Error> {
/// use pg_semaphore::Priority;
/// // Analytics: shed first, leave the reserve to charges.
/// let permit = sem.claim().priority(Priority::Low).try_acquire().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Priority {
    /// Critical traffic (the default): may use every slot, reserved ones included.
    #[default]
    High,
    /// Traffic to shed first: succeeds only while more than the semaphore's
    /// reserved slots are free, so that the reserve stays for
    /// [`High`](Priority::High) claims.
    Low,
}

impl Priority {
    fn sql(self) -> i16 {
        match self {
            Priority::High => 1,
            Priority::Low => 0,
        }
    }

    /// Rank in the local order: high priority first.
    pub(crate) fn rank(self) -> u8 {
        match self {
            Priority::High => 0,
            Priority::Low => 1,
        }
    }
}

/// A handle's reserved capacity and queue settings.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Extensions {
    pub(crate) reserved: u32,
    pub(crate) queue: Option<queue::QueueOptions>,
}

impl Extensions {
    pub(crate) fn validate(&self, capacity: u32) -> Result<()> {
        if self.reserved >= capacity {
            return Err(Error::invalid(
                "reserved",
                format!(
                    "{} reserved slots leave none to low-priority claims: reserve fewer than the capacity ({capacity})",
                    self.reserved
                ),
            ));
        }
        Ok(())
    }
}

impl SemaphoreBuilder {
    /// Reserves `slots` of the capacity for critical traffic (default 0):
    /// claims with [`Priority::Low`] succeed only while more than `slots`
    /// slots are free; [`Priority::High`] claims (the default) may use them
    /// all. Seed 002's fleet usage load shedder: analytics is shed before
    /// charges are.
    ///
    /// The reserve belongs to this handle and is sent with each of its
    /// low-priority claims: build every handle of a semaphore with the same
    /// value. Must be below the capacity ([`build`](Self::build) returns
    /// [`Error::InvalidArgument`] otherwise).
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// use pg_semaphore::{Priority, Semaphore};
    /// let sem = Semaphore::builder("workers", 10).reserved(2).build(&pool).await?;
    /// let report = sem.claim().priority(Priority::Low).try_acquire().await; // needs 3 free
    /// let charge = sem.try_acquire().await; // may take the last slot
    /// # Ok(())
    /// # }
    /// ```
    pub fn reserved(mut self, slots: u32) -> Self {
        self.ext.reserved = slots;
        self
    }
}

impl Semaphore {
    /// The slots this handle reserves for [`Priority::High`] claims.
    pub fn reserved(&self) -> u32 {
        self.inner.ext.reserved
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
    /// - [`Error::SemaphoreNotFound`], [`Error::MigrationsMissing`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: as [`try_acquire`](Self::try_acquire), a claim that
    /// completes after the caller stopped waiting is released at once.
    pub async fn try_acquire_many(&self, n: u32) -> Result<Permit> {
        self.claim().try_acquire_many(n).await
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
        self.claim().acquire_many(n).await
    }

    /// As [`acquire_many`](Self::acquire_many), giving up after `timeout`.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`]; as [`acquire_many`](Self::acquire_many).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`acquire_many`](Self::acquire_many).
    pub async fn acquire_many_timeout(&self, n: u32, timeout: Duration) -> Result<Permit> {
        self.claim().acquire_many_timeout(n, timeout).await
    }
}

impl Claim<'_> {
    /// The claim's priority (default [`Priority::High`]): a
    /// [`Priority::Low`] claim leaves the semaphore's
    /// [`reserved`](SemaphoreBuilder::reserved) slots free.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
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
    pub async fn try_acquire_many(mut self, n: u32) -> Result<Permit> {
        self.permits = n;
        self.try_acquire().await
    }

    /// As [`Semaphore::acquire_many`], with this claim's options.
    ///
    /// # Errors
    ///
    /// As [`Claim::try_acquire_many`], waiting instead of
    /// [`Error::NoSlotsAvailable`].
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::acquire_many`].
    pub async fn acquire_many(mut self, n: u32) -> Result<Permit> {
        self.permits = n;
        self.acquire().await
    }

    /// As [`Semaphore::acquire_many_timeout`], with this claim's options.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`]; as [`Claim::acquire_many`].
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::acquire_many`].
    pub async fn acquire_many_timeout(mut self, n: u32, timeout: Duration) -> Result<Permit> {
        self.permits = n;
        self.acquire_timeout(timeout).await
    }
}

impl Permit {
    /// How many slots this permit holds: 1, or `n` for
    /// [`acquire_many(n)`](Semaphore::acquire_many).
    pub fn num_permits(&self) -> u32 {
        1 + self.more.len() as u32
    }

    /// The ids of every claim this permit holds, lowest (= [`id`](Self::id)) first.
    pub fn ids(&self) -> Vec<i64> {
        crate::semaphore::claim_ids(self.id(), &self.more)
    }

    /// Every slot number this permit holds, in the order of [`ids`](Self::ids).
    pub fn slots(&self) -> Vec<u32> {
        std::iter::once(self.slot())
            .chain(self.more.iter().map(|&(_, slot)| slot))
            .collect()
    }
}

impl ClaimArgs {
    pub(crate) fn priority_sql(&self) -> i16 {
        self.priority.sql()
    }

    /// Whether this claim needs `claim_many`: weighted, low priority, or
    /// (when it waits) queued.
    pub(crate) fn is_extended(&self, waiting: bool) -> bool {
        self.permits != 1
            || self.priority == Priority::Low
            || (waiting && self.semaphore.inner.ext.queue.is_some())
    }
}

/// Checks a claim's weight against what the handle's capacity and reserve
/// could ever allow.
pub(crate) fn validate(semaphore: &Semaphore, permits: u32, priority: Priority) -> Result<()> {
    let capacity = semaphore.capacity();
    let usable = match priority {
        Priority::High => capacity,
        Priority::Low => capacity - semaphore.reserved(),
    };
    if permits == 0 {
        return Err(Error::invalid("permits", "must be at least 1"));
    }
    if permits > usable {
        return Err(too_many(semaphore.name(), permits, usable));
    }
    Ok(())
}

fn too_many(semaphore: &str, permits: u32, usable: u32) -> Error {
    Error::invalid(
        "permits",
        format!(
            "{permits} can never be held at once: semaphore {semaphore:?} allows at most {usable} to this claim"
        ),
    )
}

/// What one extended claim attempt found.
enum Outcome {
    Claimed(Permit),
    /// Not enough free slots (or the reserve would be touched).
    Full {
        capacity: u32,
    },
    /// A waiter is ahead in the queue.
    Behind {
        capacity: u32,
    },
    /// The caller's waiter row is gone (its lease ended): queue again.
    NoTicket,
    /// More permits than the database's capacity (and reserve) allow.
    TooMany {
        capacity: u32,
    },
}

#[derive(sqlx::FromRow)]
struct ClaimManyRow {
    #[sqlx(rename = "o_status")]
    status: String,
    #[sqlx(rename = "o_ids")]
    ids: Option<Vec<i64>>,
    #[sqlx(rename = "o_slots")]
    slots: Option<Vec<i32>>,
    #[sqlx(rename = "o_created_at")]
    created_at: Option<DateTime<Utc>>,
    #[sqlx(rename = "o_expires_at")]
    expires_at: Option<DateTime<Utc>>,
    #[sqlx(rename = "o_capacity")]
    capacity: i32,
    #[sqlx(rename = "o_free")]
    free: i32,
}

/// One attempt, cancel-safe by construction as the fast path's: the round
/// trip runs in a spawned task that releases what it claimed if the caller
/// has gone.
async fn claim_many_once(args: &ClaimArgs, ticket: Option<i64>) -> Result<Outcome> {
    let args = args.clone();
    crate::semaphore::detached(
        async move { claim_many_round_trip(&args, ticket).await },
        |outcome| match outcome {
            Outcome::Claimed(permit) => Some(permit),
            _ => None,
        },
    )
    .await
}

async fn claim_many_round_trip(args: &ClaimArgs, ticket: Option<i64>) -> Result<Outcome> {
    let inner = &args.semaphore.inner;
    let (lifo, waiter_lease) = match inner.ext.queue {
        Some(queue) => (queue.order.is_lifo(), queue::waiter_lease()),
        None => (false, queue::waiter_lease()),
    };
    let sent = tokio::time::Instant::now();
    let row: ClaimManyRow = on_pool!(inner.pool, inner.pooled, |conn| {
        sqlx::query_as(CLAIM_MANY)
            .bind(&inner.name)
            .bind(&args.holder)
            .bind(args.lease)
            .bind(&args.metadata)
            .bind(args.permits as i32)
            .bind(args.priority.sql())
            .bind(inner.ext.reserved as i32)
            .bind(ticket)
            .bind(lifo)
            .bind(waiter_lease)
            .persistent(!inner.pooled)
            .fetch_one(conn)
    })
    .await
    .map_err(|error| crate::semaphore::not_found_or(error, &inner.name))?;
    let capacity = row.capacity.max(0) as u32;
    Ok(match (row.status.as_str(), row.ids, row.slots) {
        ("claimed", Some(ids), Some(slots)) => {
            let mut claims = ids
                .into_iter()
                .zip(slots.into_iter().map(|slot| slot.max(0) as u32));
            let (Some(first), Some(acquired_at), Some(expires_at)) =
                (claims.next(), row.created_at, row.expires_at)
            else {
                return Err(Error::Database(sqlx::Error::Protocol(
                    "pgsemaphore.claim_many returned a claim without ids or timestamps".into(),
                )));
            };
            let permit = Permit::new(
                args.semaphore.clone(),
                first,
                claims.collect(),
                acquired_at,
                expires_at,
                row.free.max(0) as u32,
                sent,
            );
            tracing::debug!(semaphore = %inner.name, ids = ?permit.ids(), "permits acquired");
            Outcome::Claimed(permit)
        }
        ("behind", _, _) => Outcome::Behind { capacity },
        ("no_ticket", _, _) => Outcome::NoTicket,
        ("too_many", _, _) => Outcome::TooMany { capacity },
        _ => Outcome::Full { capacity },
    })
}

/// `try_acquire` for an extended claim: one attempt outside the queue.
pub(crate) async fn try_acquire(args: &ClaimArgs) -> Result<Permit> {
    match claim_many_once(args, None).await? {
        Outcome::Claimed(permit) => Ok(permit),
        Outcome::Full { capacity } | Outcome::Behind { capacity } => Err(Error::NoSlotsAvailable {
            semaphore: args.semaphore.name().to_owned(),
            capacity,
        }),
        // Only a queued claim carries a ticket.
        Outcome::NoTicket => Err(Error::NoSlotsAvailable {
            semaphore: args.semaphore.name().to_owned(),
            capacity: args.semaphore.capacity(),
        }),
        Outcome::TooMany { capacity } => Err(refused(args, capacity)),
    }
}

/// The database's capacity (changed since this handle was built) can never
/// admit this claim.
fn refused(args: &ClaimArgs, capacity: u32) -> Error {
    let usable = match args.priority {
        Priority::High => capacity,
        Priority::Low => capacity.saturating_sub(args.semaphore.reserved()),
    };
    too_many(args.semaphore.name(), args.permits, usable)
}

/// Local arrival order of waiting extended claims outside the queue.
static LOCAL_ORDER: AtomicI64 = AtomicI64::new(0);

/// The waiting loop of extended claims.
///
/// Every waiting extended claim of a semaphore in this process holds a
/// place in a local order (queued claims by their database place, then the
/// others by arrival); on each wake-up only the first place claims, so a
/// release costs one round trip per process, and a heavy request at the
/// front is not overtaken locally. Queued claims also hold a database
/// ticket ([`Ticket`]) that the first place renews for the whole process.
pub(crate) async fn wait(args: &ClaimArgs) -> Result<Permit> {
    let inner = &args.semaphore.inner;
    let listener = &inner.listener;
    if !listener.is_ready() {
        // Behind a transaction pooler LISTEN cannot work: the ticker alone wakes waiters.
        listener.start(inner.fallback, !inner.pooled).await;
    }
    let mut watch = listener.watch(&inner.name, inner.fallback);
    let rank = args.priority.rank();
    watch.take_place((rank, 1, LOCAL_ORDER.fetch_add(1, Ordering::Relaxed)), None);
    let queue = inner.ext.queue;
    let mut ticket: Option<Ticket> = None;
    let mut renew_at = Instant::now() + queue::renew_every();
    let started = Instant::now();
    loop {
        // Mark wake-ups seen *before* claiming, so a release that lands
        // between a failed claim and the wait still wakes this task.
        watch.seen();
        // A queued claim that has no ticket yet tries once, then queues.
        let joining = queue.is_some() && ticket.is_none();
        if joining || watch.is_first() {
            match claim_many_once(args, ticket.as_ref().map(Ticket::id)).await? {
                Outcome::Claimed(permit) => {
                    if let Some(ticket) = ticket {
                        ticket.served();
                    }
                    // Pass the turn on if slots are left, or if a release
                    // landed while this claim ran (its snapshot may not
                    // have seen it, and the others slept through it).
                    let wake = permit.free_after > 0 || watch.has_unseen();
                    watch.leave(wake);
                    tracing::debug!(
                        semaphore = %inner.name,
                        waited_ms = started.elapsed().as_millis() as u64,
                        "waiter acquired {} permits",
                        permit.num_permits()
                    );
                    return Ok(permit);
                }
                Outcome::TooMany { capacity } => return Err(refused(args, capacity)),
                Outcome::NoTicket => {
                    tracing::warn!(
                        semaphore = %inner.name,
                        "a queued acquire's waiter lease ended (renewal failed?); queueing again at the back"
                    );
                    if let Some(ticket) = ticket.take() {
                        ticket.served();
                    }
                }
                Outcome::Full { .. } | Outcome::Behind { .. } => {}
            }
            if let Some(options) = queue
                && ticket.is_none()
            {
                let id = queue::enqueue(args, options).await?;
                watch.take_place((rank, 0, options.order.place(id)), Some(id));
                ticket = Some(Ticket::new(args.semaphore.clone(), id));
                renew_at = Instant::now() + queue::renew_every();
                // It may be at the head already: look again at once.
                continue;
            }
        }
        tokio::select! {
            () = watch.changed() => {}
            () = tokio::time::sleep_until(renew_at), if ticket.is_some() => {
                renew_at = Instant::now() + queue::renew_every();
                if watch.is_first() {
                    queue::renew(inner, &watch.local_tickets()).await;
                }
            }
        }
    }
}

/// Releases a weighted permit's claims together, reporting a lost slot as
/// [`Error::PermitLost`] (with the id of a claim that was lost).
pub(crate) async fn release_many(inner: &Inner, id: i64, more: &[(i64, u32)]) -> Result<()> {
    let ids = crate::semaphore::claim_ids(id, more);
    let (outcome, lost_id, at): (String, Option<i64>, Option<DateTime<Utc>>) =
        on_pool!(inner.pool, inner.pooled, |conn| {
            sqlx::query_as(RELEASE_MANY)
                .bind(&ids)
                .persistent(!inner.pooled)
                .fetch_one(conn)
        })
        .await?;
    let reason = match (outcome.as_str(), at) {
        ("released", _) => {
            tracing::debug!(semaphore = %inner.name, ids = ?ids, "permits released");
            return Ok(());
        }
        ("timed_out", Some(at)) => LostReason::TimedOut { at },
        ("completed", Some(at)) => LostReason::AlreadyReleased { at },
        _ => LostReason::Missing,
    };
    Err(Error::PermitLost {
        semaphore: inner.name.clone(),
        id: lost_id.unwrap_or(id),
        reason,
    })
}
