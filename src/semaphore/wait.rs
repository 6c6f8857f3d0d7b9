//! Waiting: for permits (`acquire` and friends, every kind of claim) and for
//! a semaphore to have no holders (`wait_idle`). One loop each, over the
//! wake-ups of [`wake`](super::wake).
//!
//! A waiting acquire:
//! 1. takes a place in the semaphore's local order and, if it is first,
//!    claims at once (whether or not the `LISTEN` connection is up yet);
//! 2. refused, registers the process for the semaphore's wake-ups unless a
//!    registration was already in force when it claimed, and then claims
//!    again: a release that committed before the registration sent no
//!    wake-up, but the second claim sees it;
//! 3. a queued acquire (`SemaphoreBuilder::queue`) joins the queue and
//!    claims once more with its ticket;
//! 4. sleeps until a wake-up (a notification, its turn, the fallback tick)
//!    or until the lease that blocks it ends (the claim says when), then
//!    claims again if it is first.
//!
//! Every claim is cancel-safe ([`Permit::claim`]), and so is joining the
//! queue: dropping the future at any point leaves nothing held or queued.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, Result};

use super::engine::{Admission, Attempt, Core, Several};
use super::permit::Permit;
use super::queue::{self, Ticket};
use super::wake::Watch;

/// Whether the semaphore has no live, unexpired claim (NULL when it does not
/// exist), and when its earliest lease ends. A claim whose lease has ended
/// counts as gone (its holder is presumed dead; a reaper or the next claim
/// frees it).
const IDLE: &str = "SELECT NOT EXISTS (SELECT 1 FROM pgsemaphore.live_slots l \
                                       WHERE l.semaphore = s.name AND l.expires_at > clock_timestamp()), \
                           (SELECT min(l.expires_at) - clock_timestamp() FROM pgsemaphore.live_slots l \
                             WHERE l.semaphore = s.name AND l.expires_at > clock_timestamp()) \
                    FROM pgsemaphore.semaphores s WHERE s.name = $1";

/// A waiter that wakes when a lease ends looks a little after it, so that the
/// database's clock has certainly passed it.
const AFTER_LEASE: Duration = Duration::from_millis(2);

/// Arrival order of waiting acquires in this process.
static ARRIVAL: AtomicI64 = AtomicI64::new(0);

/// Waits until `attempt` can claim, then claims.
pub(crate) async fn acquire(core: &Arc<Core>, attempt: &Attempt) -> Result<Permit> {
    // In the waiters gauge until this returns or is dropped.
    let _waiting = core.metrics.waiting();
    let wakeups = &core.wakeups;
    wakeups.start(core.db.listens());
    let mut watch = wakeups.watch(&core.name, core.fallback);
    let rank = attempt.priority.rank();
    watch.take_place((rank, 1, 0, ARRIVAL.fetch_add(1, Ordering::Relaxed)), None);
    let mut ticket: Option<Ticket> = None;
    let mut lease_ends: Option<Instant> = None;
    let mut outage = Outage::new(attempt.ride_out_outages);
    let started = Instant::now();
    loop {
        // Mark wake-ups seen *before* claiming, so a release that lands
        // between a failed claim and the wait still wakes this task.
        watch.seen();
        // A queued claim that has no ticket yet tries once, then queues.
        let joining = core.queue.is_some() && ticket.is_none();
        if joining || watch.is_first() {
            let registered = watch.is_registered(&core.db);
            let claim = Permit::claim(core, attempt, ticket.as_ref().map(Ticket::proof)).await;
            let Some(claim) = outage.ride_out(core, claim).await? else {
                continue;
            };
            match claim {
                Admission::Claimed(permit) => {
                    if let Some(ticket) = ticket {
                        ticket.served();
                    }
                    // Pass the turn on if slots are left, or if a wake-up
                    // landed while this claim ran (its snapshot may not have
                    // seen the release, and the others slept through it).
                    watch.leave(permit.free_after > 0 || watch.has_unseen());
                    tracing::debug!(
                        semaphore = %core.name,
                        waited_ms = started.elapsed().as_millis() as u64,
                        permits = permit.num_permits(),
                        "waiter acquired"
                    );
                    core.metrics.waited(started.elapsed());
                    return Ok(permit);
                }
                Admission::TooMany { capacity } => return Err(too_many(core, attempt, capacity)),
                Admission::NoTicket => {
                    tracing::warn!(
                        semaphore = %core.name,
                        "a queued acquire's waiter lease ended (renewal failed?); queueing again at the back"
                    );
                    if let Some(ticket) = ticket.take() {
                        ticket.served();
                    }
                    lease_ends = None;
                }
                Admission::Full { retry_in, .. } | Admission::Behind { retry_in, .. } => {
                    lease_ends = retry_in.map(|wait| Instant::now() + wait + AFTER_LEASE);
                }
                // A single claim charges no rate limit.
                Admission::RateLimited { retry_in } => {
                    lease_ends = Some(Instant::now() + retry_in);
                }
            }
            // Registered now, claim again: a release that committed before
            // the registration sent no wake-up, but this claim sees it. A
            // registration that failed leaves this waiter to the fallback
            // re-check (and the lease that blocks it).
            if !registered && watch.register(&core.db).await {
                continue;
            }
            if let Some(options) = core.queue
                && ticket.is_none()
            {
                let queued = queue::enqueue(core, attempt, options, wakeups.token()).await;
                let Some(queued) = outage.ride_out(core, queued).await? else {
                    continue;
                };
                let (turn, order) = options.order.place(queued.turn(), queued.id());
                watch.take_place((rank, 0, turn, order), Some(queued.id()));
                ticket = Some(queued);
                // It may be at the head already: look again at once.
                continue;
            }
        }
        match lease_ends {
            Some(at) => {
                tokio::select! {
                    () = watch.changed() => {}
                    () = tokio::time::sleep_until(at) => lease_ends = None,
                }
            }
            None => watch.changed().await,
        }
    }
}

/// Waits until every member of `several` can claim its permits in the same
/// instant, then claims them all (`pgsemaphore.claim_all`, all or nothing).
///
/// Holds nothing while it waits, and takes no place in any semaphore's
/// local order or fair queue: it watches every member, registers for each
/// one's wake-ups (then claims again, as [`acquire`] does), and claims
/// again on a wake-up of any of them (a release, the fallback tick) or when
/// the lease that blocked it ends. The database refuses it while a member
/// has a high-priority waiter queued, so it never overtakes a queue; in
/// exchange it can be overtaken, without bound, by single claims that keep
/// a member full (see the guide's [several limits at once](crate::guide::choosing#several-limits-at-once)).
///
/// A claim with rate limits (`several.rates`) refused by a limit sleeps
/// until the limit would admit, then claims again; if that instant is past
/// `deadline` (the caller's timeout), it returns [`Error::RateLimited`] at
/// once instead of sleeping in vain. `ride_out_outages`: as
/// [`Attempt::ride_out_outages`].
pub(crate) async fn acquire_all(
    several: &Several,
    holder: &str,
    metadata: Option<&serde_json::Value>,
    ride_out_outages: bool,
    deadline: Option<Instant>,
) -> Result<Permit> {
    let lead = several.lead();
    let _waiting: Vec<_> = several
        .members
        .iter()
        .map(|(core, _)| core.metrics.waiting())
        .collect();
    lead.wakeups.start(lead.db.listens());
    let mut watches: Vec<Watch> = several
        .members
        .iter()
        .map(|(core, _)| core.wakeups.watch(&core.name, core.fallback))
        .collect();
    let mut outage = Outage::new(ride_out_outages);
    let started = Instant::now();
    loop {
        watches.iter_mut().for_each(Watch::seen);
        let registered = watches.iter().all(|watch| watch.is_registered(&lead.db));
        let claim = Permit::claim_all(several, holder, metadata).await;
        let Some((claim, refused_by)) = outage.ride_out(lead, claim).await? else {
            continue;
        };
        let lease_ends = match claim {
            Admission::Claimed(permit) => {
                tracing::debug!(
                    semaphores = ?permit.semaphore_names(),
                    waited_ms = started.elapsed().as_millis() as u64,
                    "multi-limit waiter acquired"
                );
                for (core, _) in &several.members {
                    core.metrics.waited(started.elapsed());
                }
                return Ok(permit);
            }
            Admission::TooMany { capacity } => {
                return Err(too_many_of(several, refused_by.as_deref(), capacity));
            }
            // The semaphores had room: the limit's own instant decides,
            // however the semaphores change meanwhile.
            Admission::RateLimited { retry_in } => {
                let at = Instant::now() + retry_in.max(Duration::from_millis(1));
                if deadline.is_some_and(|deadline| at > deadline) {
                    return Err(Error::RateLimited {
                        limiter: refused_by.unwrap_or_default(),
                        retry_after: retry_in,
                    });
                }
                tokio::time::sleep_until(at).await;
                continue;
            }
            // Only a queued claim carries a ticket.
            Admission::NoTicket => None,
            Admission::Full { retry_in, .. } | Admission::Behind { retry_in, .. } => {
                retry_in.map(|wait| Instant::now() + wait + AFTER_LEASE)
            }
        };
        // Registered now, claim again: a release that committed before a
        // registration sent no wake-up, but this claim sees it.
        if !registered {
            let mut wrote = false;
            for watch in &watches {
                if !watch.is_registered(&lead.db) {
                    wrote |= watch.register(&lead.db).await;
                }
            }
            if wrote {
                continue;
            }
        }
        match lease_ends {
            Some(at) => {
                tokio::select! {
                    () = any_changed(&mut watches) => {}
                    () = tokio::time::sleep_until(at) => {}
                }
            }
            None => any_changed(&mut watches).await,
        }
    }
}

/// Resolves at the next wake-up of any of `watches`.
async fn any_changed(watches: &mut [Watch]) {
    let mut changes: Vec<_> = watches
        .iter_mut()
        .map(|watch| Box::pin(watch.changed()))
        .collect();
    std::future::poll_fn(|cx| {
        for change in &mut changes {
            if change.as_mut().poll(cx).is_ready() {
                return std::task::Poll::Ready(());
            }
        }
        std::task::Poll::Pending
    })
    .await;
}

/// A member's capacity (changed since its handle was built) can never
/// admit its permits.
pub(crate) fn too_many_of(several: &Several, semaphore: Option<&str>, capacity: u32) -> Error {
    let permits = several
        .members
        .iter()
        .find(|(core, _)| Some(core.name.as_str()) == semaphore)
        .map_or(0, |&(_, permits)| permits);
    Error::invalid(
        "permits",
        format!(
            "{permits} can never be held at once: semaphore {:?} allows at most {capacity}",
            semaphore.unwrap_or_default()
        ),
    )
}

/// How a wait rides out an outage (a database restart, a failover, a
/// partition) or a stall (the semaphore's row held by a stuck transaction,
/// [`Error::Stalled`]): a round trip that could not reach the database,
/// found the pool exhausted, or stalled, is retried after a pause that grows from 50 ms to the
/// fallback interval, until it gets through or the caller's timeout ends;
/// one WARN per outage. An answer from the database (an error of the
/// statement) still ends the wait.
struct Outage {
    /// `false`: errors end the wait at once.
    enabled: bool,
    pause: Option<Duration>,
}

impl Outage {
    fn new(enabled: bool) -> Outage {
        Outage {
            enabled,
            pause: None,
        }
    }

    /// `Ok(Some(value))` on success (the outage, if any, is over);
    /// `Ok(None)` after pausing on an outage (look again); `Err` otherwise.
    async fn ride_out<T>(&mut self, core: &Core, result: Result<T>) -> Result<Option<T>> {
        match result {
            Ok(value) => {
                if self.pause.take().is_some() {
                    tracing::info!(semaphore = %core.name, "database reachable again; the wait goes on");
                }
                Ok(Some(value))
            }
            Err(error)
                if self.enabled
                    && (error.is_unreachable()
                        || matches!(
                            error,
                            Error::Database(sqlx::Error::PoolTimedOut) | Error::Stalled { .. }
                        )) =>
            {
                let pause = match self.pause {
                    None => {
                        if matches!(error, Error::Stalled { .. }) {
                            tracing::warn!(
                                semaphore = %core.name, %error,
                                "the semaphore's row is held by a stuck transaction; retrying until it is free or the wait times out"
                            );
                        } else {
                            tracing::warn!(
                                semaphore = %core.name, %error,
                                "database unreachable while waiting; retrying until it is back or the wait times out"
                            );
                        }
                        Duration::from_millis(50)
                    }
                    Some(pause) => (pause * 2).min(core.fallback.max(Duration::from_millis(50))),
                };
                self.pause = Some(pause);
                tokio::time::sleep(pause).await;
                Ok(None)
            }
            Err(error) => Err(error),
        }
    }
}

/// The database's capacity (changed since the handle was built) can never
/// admit this claim.
pub(crate) fn too_many(core: &Core, attempt: &Attempt, capacity: u32) -> Error {
    let usable = attempt.usable(capacity, core.reserved);
    Error::invalid(
        "permits",
        format!(
            "{} can never be held at once: semaphore {:?} allows at most {usable} to this claim",
            attempt.permits, core.name
        ),
    )
}

/// Waits until the semaphore has no live, unexpired claim.
pub(crate) async fn idle(core: &Arc<Core>) -> Result<()> {
    let wakeups = &core.wakeups;
    wakeups.start(core.db.listens());
    let mut watch = wakeups.watch(&core.name, core.fallback);
    let mut outage = Outage::new(true);
    loop {
        watch.seen();
        let registered = watch.is_registered(&core.db);
        let query = core
            .db
            .query_as::<(bool, Option<sqlx::postgres::types::PgInterval>)>(IDLE)
            .bind(core.name.clone());
        let idle = core.db.fetch_optional(query).await;
        let Some(idle) = outage.ride_out(core, idle).await? else {
            continue;
        };
        match idle {
            None => {
                return Err(Error::SemaphoreNotFound {
                    semaphore: core.name.clone(),
                });
            }
            Some((true, _)) => return Ok(()),
            Some((false, ends)) => {
                if !registered && watch.register(&core.db).await {
                    continue;
                }
                match ends {
                    Some(ends) => {
                        let at = Instant::now() + super::engine::duration_of(&ends) + AFTER_LEASE;
                        tokio::select! {
                            () = watch.changed() => {}
                            () = tokio::time::sleep_until(at) => {}
                        }
                    }
                    None => watch.changed().await,
                }
            }
        }
    }
}
