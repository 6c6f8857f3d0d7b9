//! The fair queue: waiters of a semaphore served in order across every
//! process (.NET's `ConcurrencyLimiter` with `QueueLimit` and
//! `QueueProcessingOrder`), fairness keys taking turns.
//!
//! A queued acquire that finds no room inserts a row in `pgsemaphore.waiters`
//! (its *ticket*: the row's id, and its *turn*), and from then on only the
//! head of the queue may claim (`pgsemaphore.claim` checks it under the
//! semaphore's row lock); every other claim on the semaphore, queued or not,
//! is refused while a waiter is ahead of it. High-priority waiters come
//! before low-priority ones; then a FIFO queue serves the smallest turn,
//! then the oldest ticket, and a LIFO one
//! ([`QueueOrder::NewestFirst`](super::QueueOrder)) the newest ticket.
//!
//! Turns make waiters of different fairness keys
//! ([`Acquiring::fairness_key`](super::Acquiring::fairness_key)) take turns: a
//! waiter's turn, fixed by `pgsemaphore.enqueue`, is one more than its
//! key's last queued turn, but never below the head's, so a key with one
//! waiter is served within one turn of the rotation however many waiters
//! another key has; a key the operator gave weight `w`
//! ([`set_fairness_weight`](crate::admin::set_fairness_weight)) has up to `w`
//! waiters in each turn. Without keys, turns follow arrival order. This
//! process's waiters take their local places in the same order
//! ([`QueueOrder::place`](super::QueueOrder)), so the one that claims on a
//! wake-up is the one the database would serve first.
//!
//! Leaving: a served waiter's row is deleted by its claim; a cancelled one
//! deletes its row (in a spawned task) and wakes the semaphore's waiters so
//! the next head looks. A crashed process stops renewing its waiters' rows
//! (the keeper of [`wake`](super::wake) renews every local ticket); a row
//! whose lease has ended is ignored by every claim, deleted by the next claim
//! or enqueue that sees it (which wakes the waiters behind it), and waiters
//! behind it look again when its lease ends.

use std::sync::Arc;

use crate::detached::detached;
use crate::error::{Error, Result};
use crate::token::Token;

use super::engine::{self, Attempt, Core, QueueOptions};
use super::wake::wait_lease;

/// Joins the queue: a ticket and its turn (NULLs when the queue is full),
/// and whether dead waiters were removed.
const ENQUEUE: &str = "SELECT o_ticket, o_turn, o_wake \
                       FROM pgsemaphore.enqueue(p_semaphore => $1, p_permits => $2, \
                                                p_priority => $3, p_holder => $4, p_limit => $5, \
                                                p_waiter_lease => $6, p_token => $7, \
                                                p_fair_key => $8)";

/// Leaves the queue and wakes the semaphore's waiters, so the next head looks.
const LEAVE: &str = "SELECT pgsemaphore.leave_queue(p_ticket => $1, p_token => $2)";

/// Live waiters of a semaphore.
const QUEUED: &str = "SELECT count(*) FROM pgsemaphore.waiters \
                      WHERE semaphore = $1 AND expires_at > clock_timestamp()";

/// Joins the queue, cancel-safe: if the caller has gone by the time the
/// round trip returns, the ticket is dropped there, which leaves the queue.
pub(crate) async fn enqueue(
    core: &Arc<Core>,
    attempt: &Attempt,
    options: QueueOptions,
    token: &Token,
) -> Result<Ticket> {
    let (core, attempt, token) = (core.clone(), attempt.clone(), token.clone());
    detached(move |_| async move {
        let limit = options.limit.map(|l| l.min(i32::MAX as u32) as i32);
        let query = core
            .db
            .query_as::<(Option<i64>, Option<i64>, bool)>(ENQUEUE)
            .bind(core.name.clone())
            .bind(attempt.permits as i32)
            .bind(attempt.priority.sql())
            .bind(attempt.holder.clone())
            .bind(limit)
            .bind(wait_lease())
            .bind(token.bytes())
            .bind(attempt.fairness_key.clone());
        let (ticket, turn, wake) = core
            .db
            .fetch_one(query)
            .await
            .map_err(|error| engine::refused_on(error, &core.name))?;
        if wake {
            engine::wake(&core).await;
        }
        match ticket {
            Some(id) => {
                let turn = turn.unwrap_or_default();
                tracing::debug!(semaphore = %core.name, ticket = id, turn, "queued");
                Ok(Ticket {
                    core,
                    id,
                    turn,
                    token,
                    armed: true,
                })
            }
            None => {
                core.metrics.queue_full();
                Err(Error::QueueFull {
                    semaphore: core.name.clone(),
                    limit: options.limit.unwrap_or(0),
                })
            }
        }
    })
    .await
}

/// How many live waiters are queued on the semaphore.
pub(crate) async fn queue_len(core: &Core) -> Result<u32> {
    let query = core.db.query_as::<(i64,)>(QUEUED).bind(core.name.clone());
    let (queued,) = core.db.fetch_one(query).await?;
    Ok(queued.clamp(0, u32::MAX as i64) as u32)
}

/// A place in the database queue. Dropping it leaves the queue (in a
/// spawned task), unless its claim was served.
pub(crate) struct Ticket {
    core: Arc<Core>,
    id: i64,
    /// Its place in the rotation of fairness keys (see the module doc).
    turn: i64,
    token: Token,
    armed: bool,
}

impl Ticket {
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    pub(crate) fn turn(&self) -> i64 {
        self.turn
    }

    /// What a claim through the queue proves its place with.
    pub(crate) fn proof(&self) -> (i64, Token) {
        (self.id, self.token.clone())
    }

    /// The claim deleted the row itself (or it is gone): nothing to leave.
    pub(crate) fn served(mut self) {
        self.armed = false;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (core, id, token) = (self.core.clone(), self.id, self.token.clone());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(semaphore = %core.name, ticket = id, "waiter dropped outside a runtime; its lease ends its place");
            return;
        };
        runtime.spawn(async move {
            let query = core
                .db
                .query_as::<(bool,)>(LEAVE)
                .bind(id)
                .bind(token.bytes());
            match core.db.fetch_one(query).await {
                Ok(_) => tracing::debug!(semaphore = %core.name, ticket = id, "left the queue"),
                Err(error) => tracing::warn!(
                    semaphore = %core.name, ticket = id, %error,
                    "leaving the queue failed; the waiter's lease ends its place"
                ),
            }
        });
    }
}
