//! The semaphore's engine: the state every handle of a semaphore shares
//! ([`Core`]), the options a claim carries ([`Attempt`]), and every statement
//! that decides admission or ends it: claim, release, renew, fence. Each
//! calls one SQL function whose header (the comment that opens its body)
//! names the invariant it keeps and the concurrent transactions it meets:
//! all in `migrations/20261128010002_pgsemaphore_admission.sql` (the table in `docs/sql-api.md`, checked by `tests/sql_api.rs`; the
//! same headers read in `schema/pgsemaphore.sql`).
//!
//! Nothing here waits or retries; [`wait`](super::wait) does. Every claim is
//! one round trip to `pgsemaphore.claim`, whatever its kind (one permit or
//! several, high or low priority, in the fair queue or not), decoded by one
//! decoder into an [`Admission`]; a claim of several semaphores at once is
//! one round trip to `pgsemaphore.claim_all` (which runs `claim` for each,
//! all or nothing, in the same file),
//! released by `pgsemaphore.release_all_then_wake`.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::types::PgInterval;
use sqlx::{PgConnection, Row};
use tokio::time::Instant;

use crate::db::{Db, Statement};
use crate::error::{self, Error, LostReason, Result};
use crate::metrics::SemaphoreMetrics;
use crate::rate_limit::ClaimRates;
use crate::token::Token;
use crate::validate;

use super::wake::Wakeups;

/// The claim, one round trip. `o_retry_in` and `o_wake`: see the function.
/// Every function is called with named arguments: a parameter added to a
/// function can never shift the others.
const CLAIM: &str = "SELECT o_status, o_ids, o_slots, o_created_at, o_expires_at, o_capacity, \
                            o_free, o_retry_in, o_wake \
                     FROM pgsemaphore.claim(p_semaphore => $1, p_holder => $2, p_lease => $3, \
                                            p_metadata => $4, p_token => $5, p_permits => $6, \
                                            p_priority => $7, p_reserve => $8, p_ticket => $9, \
                                            p_ticket_token => $10, p_waiter_lease => $11)";

/// The multi-limit claim, one round trip: permits of several semaphores at
/// once, all or nothing (`pgsemaphore.claim_all`).
const CLAIM_ALL: &str = "SELECT o_status, o_semaphore, o_ids, o_semaphores, o_slots, o_created_at, \
                                o_expires_at, o_capacity, o_retry_in, o_wake, o_rate_limit \
                         FROM pgsemaphore.claim_all(p_semaphores => $1, p_holder => $2, \
                                                    p_lease => $3, p_metadata => $4, \
                                                    p_token => $5, p_permits => $6)";

/// [`CLAIM_ALL`] that also charges rate limits (one permit each), in the
/// same transaction: admitted only if every semaphore and every limit
/// admit, nothing taken otherwise.
const CLAIM_ALL_RATED: &str = "SELECT o_status, o_semaphore, o_ids, o_semaphores, o_slots, \
                                      o_created_at, o_expires_at, o_capacity, o_retry_in, o_wake, \
                                      o_rate_limit \
                               FROM pgsemaphore.claim_all(p_semaphores => $1, p_holder => $2, \
                                   p_lease => $3, p_metadata => $4, p_token => $5, \
                                   p_permits => $6, p_rate_kinds => $7, p_rate_limiters => $8, \
                                   p_rate_keys => $9, p_rate_rates => $10, p_rate_bursts => $11, \
                                   p_rate_limits => $12, p_rate_windows => $13)";

/// Renews a permit's claims, one round trip.
const RENEW: &str = "SELECT o_id, o_outcome, o_at \
                     FROM pgsemaphore.renew(p_ids => $1, p_token => $2, p_lease => $3)";

/// Share-locks a permit's claims inside the caller's transaction.
const FENCE: &str =
    "SELECT o_id, o_outcome, o_at FROM pgsemaphore.fence(p_ids => $1, p_token => $2)";

/// Ends whatever live claims carry a token whose claim reply was lost
/// (including one still in flight), and says whether to wake waiters after.
const RELEASE_BY_TOKEN: &str = "SELECT o_ended, o_wake \
                                FROM pgsemaphore.release_by_token(p_semaphore => $1, p_token => $2)";

/// Sends a semaphore's wake-up if anyone waits (after the transaction that
/// freed slots committed).
const WAKE: &str = "SELECT pgsemaphore.wake(p_semaphore => $1)";

/// The release, one round trip: `pgsemaphore.release_then_wake` ends the
/// claims in a durable transaction that also asks the semaphore's wake-up
/// gate whether a waiter may be registered (see `pgsemaphore.gate`, so no
/// waiter registering meanwhile is missed); only if one may does it commit
/// and send the wake-up from a transaction of its own. A prepared
/// statement on a direct pool.
const RELEASE: &str =
    "CALL pgsemaphore.release_then_wake(p_ids => $1, p_token => $2, p_lost => $3)";

/// The same for a permit of several semaphores
/// (`pgsemaphore.release_all_then_wake`: a wake-up for each semaphore whose
/// gate says a waiter may be registered).
const RELEASE_ALL: &str =
    "CALL pgsemaphore.release_all_then_wake(p_ids => $1, p_token => $2, p_lost => $3)";

/// The same behind a transaction pooler, where a prepared statement needs an
/// explicit transaction and a procedure that commits cannot run in one: one
/// simple-protocol statement, in one message. Only integers and hex digits
/// are inlined.
fn release_call(ids: &[i64], token: &Token, lost: bool, several: bool) -> String {
    let ids = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let procedure = if several {
        "release_all_then_wake"
    } else {
        "release_then_wake"
    };
    format!(
        "CALL pgsemaphore.{procedure}(p_ids => '{{{ids}}}'::bigint[], \
         p_token => decode('{token}', 'hex'), p_lost => {lost})",
        token = token.hex(),
    )
}

/// Which claims may use the reserved capacity of a semaphore (see
/// [`SemaphoreBuilder::reserved`](crate::SemaphoreBuilder::reserved)).
///
/// ```no_run
/// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), pg_semaphore::Error> {
/// use pg_semaphore::Priority;
/// // Analytics: shed first, leave the reserve to charges.
/// let permit = sem.acquiring().priority(Priority::Low).try_acquire().await?;
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
    pub(crate) fn sql(self) -> i16 {
        match self {
            Priority::High => 1,
            Priority::Low => 0,
        }
    }

    /// Rank in the local order of waiters: high priority first.
    pub(crate) fn rank(self) -> u8 {
        match self {
            Priority::High => 0,
            Priority::Low => 1,
        }
    }
}

/// The order in which a semaphore's fair queue serves its waiters (.NET's
/// `QueueProcessingOrder`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QueueOrder {
    /// First come, first served (FIFO; the default). Waiters of different
    /// [fairness keys](crate::Acquiring::fairness_key) take turns; without keys,
    /// this is arrival order.
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

    pub(crate) fn from_lifo(lifo: bool) -> QueueOrder {
        if lifo {
            QueueOrder::NewestFirst
        } else {
            QueueOrder::OldestFirst
        }
    }

    /// A queued waiter's place in the local order, smallest first, as the
    /// database serves them: FIFO by (turn, ticket), the turn being the
    /// waiter's place in the rotation of fairness keys; LIFO by the newest
    /// ticket, ignoring turns.
    pub(crate) fn place(self, turn: i64, ticket: i64) -> (i64, i64) {
        if self.is_lifo() {
            (0, -ticket)
        } else {
            (turn, ticket)
        }
    }
}

/// A handle's queue settings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct QueueOptions {
    pub(crate) order: QueueOrder,
    pub(crate) limit: Option<u32>,
}

/// How held permits renew their leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heartbeat {
    /// Every third of the permit's lease.
    Default,
    /// Every given interval.
    Every(Duration),
    /// Not at all: the lease runs out.
    Off,
}

impl Heartbeat {
    /// The renewal interval for a permit whose lease is `lease`.
    pub(crate) fn interval(self, lease: Duration) -> Option<Duration> {
        match self {
            Heartbeat::Default => Some(lease / 3),
            Heartbeat::Every(interval) => Some(interval),
            Heartbeat::Off => None,
        }
    }

    /// Checks an explicit interval against a lease: the lease must cover two.
    pub(crate) fn check(self, lease: Duration, argument: &'static str) -> Result<()> {
        let Heartbeat::Every(interval) = self else {
            return Ok(());
        };
        validate::nonzero("heartbeat", interval)?;
        if interval.checked_mul(2).is_none_or(|two| two > lease) {
            return Err(Error::invalid(
                argument,
                format!(
                    "a lease of {lease:?} is shorter than twice the heartbeat interval \
                     {interval:?}: a single late renewal would lose the permit"
                ),
            ));
        }
        Ok(())
    }
}

/// What every handle of one semaphore shares.
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) db: Db,
    pub(crate) name: String,
    /// The capacity stored when the handle was opened (claims always use the
    /// database's current value).
    pub(crate) capacity: u32,
    /// The default lease stored when the handle was opened.
    pub(crate) lease: Duration,
    pub(crate) holder: String,
    pub(crate) fallback: Duration,
    pub(crate) heartbeat: Heartbeat,
    pub(crate) fail_open: bool,
    pub(crate) reserved: u32,
    pub(crate) queue: Option<QueueOptions>,
    /// Wake-ups of the client (one LISTEN connection per client).
    pub(crate) wakeups: Arc<Wakeups>,
    pub(crate) metrics: SemaphoreMetrics,
}

/// One claim's options.
#[derive(Debug, Clone)]
pub(crate) struct Attempt {
    pub(crate) holder: String,
    pub(crate) metadata: Option<serde_json::Value>,
    pub(crate) lease: Option<PgInterval>,
    pub(crate) permits: u32,
    pub(crate) priority: Priority,
    /// The waiter's fairness key in the fair queue (`None`: the shared
    /// default key).
    pub(crate) fairness_key: Option<String>,
    /// Whether a wait retries through a database outage (the default) or
    /// ends with the error (the tower layer's waits: an outage is a 503).
    pub(crate) ride_out_outages: bool,
}

impl Attempt {
    /// The slots this claim could ever use, given the handle's capacity and reserve.
    pub(crate) fn usable(&self, capacity: u32, reserved: u32) -> u32 {
        match self.priority {
            Priority::High => capacity,
            Priority::Low => capacity.saturating_sub(reserved),
        }
    }
}

/// What one claim round trip found; `C` is what was claimed ([`Claimed`],
/// or the permit made of it).
#[derive(Debug)]
pub(crate) enum Admission<C = Claimed> {
    Claimed(C),
    /// Not enough free slots (or the reserve would be touched); look again
    /// after `retry_in` at the latest (a lease ends then).
    Full {
        capacity: u32,
        retry_in: Option<Duration>,
    },
    /// A waiter is ahead in the fair queue.
    Behind {
        capacity: u32,
        retry_in: Option<Duration>,
    },
    /// The caller's queue ticket is gone (its lease ended): queue again.
    NoTicket,
    /// More permits than the database's capacity (and reserve) ever allow.
    TooMany {
        capacity: u32,
    },
    /// Every semaphore admitted, a rate limit of the claim refused; it
    /// admits again after `retry_in`.
    RateLimited {
        retry_in: Duration,
    },
}

impl<C> Admission<C> {
    pub(crate) fn map<D>(self, f: impl FnOnce(C) -> D) -> Admission<D> {
        match self {
            Admission::Claimed(claimed) => Admission::Claimed(f(claimed)),
            Admission::Full { capacity, retry_in } => Admission::Full { capacity, retry_in },
            Admission::Behind { capacity, retry_in } => Admission::Behind { capacity, retry_in },
            Admission::NoTicket => Admission::NoTicket,
            Admission::TooMany { capacity } => Admission::TooMany { capacity },
            Admission::RateLimited { retry_in } => Admission::RateLimited { retry_in },
        }
    }
}

/// Claims made, as the database returned them.
#[derive(Debug)]
pub(crate) struct Claimed {
    /// Lowest id first; a weighted claim has several.
    pub(crate) claims: Vec<(i64, u32)>,
    pub(crate) acquired_at: DateTime<Utc>,
    pub(crate) expires_at: DateTime<Utc>,
    /// Slots still free right after this claim.
    pub(crate) free: u32,
    pub(crate) token: Token,
    /// When the claim was sent (this process's monotonic clock).
    pub(crate) sent: Instant,
    /// The semaphore of each claim, for a claim of several semaphores
    /// (empty for a claim of one).
    pub(crate) semaphores: Vec<String>,
}

/// The semaphores of a multi-limit claim and the permits of each, in the
/// canonical order (by name, byte order: the order `pgsemaphore.claim_all`
/// locks and returns them in), all on one pool.
#[derive(Debug, Clone)]
pub(crate) struct Several {
    pub(crate) members: Vec<(Arc<Core>, u32)>,
    /// Rate limits the claim charges too (none: a claim of semaphores only).
    pub(crate) rates: ClaimRates,
    /// The claim's lease (`None`: the shortest default lease of the members).
    pub(crate) lease: Option<PgInterval>,
}

impl Several {
    /// The first semaphore in the canonical order: its handle's holder,
    /// heartbeat and pool serve the whole permit.
    pub(crate) fn lead(&self) -> &Arc<Core> {
        &self.members[0].0
    }

    /// As [`refused_on`], naming the semaphore the error is about: the one
    /// an unknown-semaphore error quotes; for a stalled row (whose error
    /// names none), every member, joined by `", "`.
    fn refused_on(&self, error: Error) -> Error {
        if error::sqlstate(&error).as_deref() == Some("55P03") {
            let names: Vec<&str> = self.members.iter().map(|(c, _)| c.name.as_str()).collect();
            return Error::Stalled {
                semaphore: names.join(", "),
            };
        }
        let message = match &error {
            Error::Database(sqlx::Error::Database(db)) => db.message().to_owned(),
            _ => String::new(),
        };
        let named = self
            .members
            .iter()
            .map(|(c, _)| c.name.as_str())
            .find(|name| message.contains(&format!("'{}'", name.replace('\'', "''"))))
            .unwrap_or(&self.lead().name);
        error::semaphore_not_found(error, named)
    }
}

/// The columns of a granted claim, as `pgsemaphore.claim` and
/// `pgsemaphore.claim_all` both answer them (NULL unless granted).
#[derive(sqlx::FromRow)]
struct Granted {
    o_ids: Option<Vec<i64>>,
    o_slots: Option<Vec<i32>>,
    o_created_at: Option<DateTime<Utc>>,
    o_expires_at: Option<DateTime<Utc>>,
}

/// A granted claim's (id, slot) pairs, lowest id first, and when they were
/// claimed and expire.
type Grant = (Vec<(i64, u32)>, DateTime<Utc>, DateTime<Utc>);

impl Granted {
    /// The [`Grant`]; an internal error when `function` answered "claimed"
    /// without it.
    fn claimed(self, function: &str) -> Result<Grant> {
        let (Some(ids), Some(slots), Some(acquired_at), Some(expires_at)) = (
            self.o_ids,
            self.o_slots,
            self.o_created_at,
            self.o_expires_at,
        ) else {
            return Err(without_ids(function));
        };
        let claims = ids
            .into_iter()
            .zip(slots.into_iter().map(|slot| slot.max(0) as u32))
            .collect();
        Ok((claims, acquired_at, expires_at))
    }
}

/// A claim statement answered "claimed" without the claim's columns.
fn without_ids(function: &str) -> Error {
    Error::internal(format!(
        "{function} returned a claim without ids or timestamps"
    ))
}

/// Sends a claim statement and notes when. When it fails with its outcome
/// unknown (it may have committed), `forget` first schedules the undo of
/// whatever it may have claimed; the error is returned as it is.
async fn send_claim<R>(db: &Db, query: Statement<R>, forget: impl FnOnce()) -> Result<(R, Instant)>
where
    R: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin + 'static,
{
    let sent = Instant::now();
    match db.fetch_one(query).await {
        Ok(row) => Ok((row, sent)),
        Err(error) => {
            if error::outcome_unknown(&error) {
                forget();
            }
            Err(error)
        }
    }
}

#[derive(sqlx::FromRow)]
struct ClaimAllRow {
    o_status: String,
    o_semaphore: Option<String>,
    o_semaphores: Option<Vec<String>>,
    #[sqlx(flatten)]
    granted: Granted,
    o_capacity: Option<i32>,
    o_retry_in: Option<PgInterval>,
    o_wake: Vec<String>,
    o_rate_limit: Option<i32>,
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    o_status: String,
    #[sqlx(flatten)]
    granted: Granted,
    o_capacity: i32,
    o_free: i32,
    o_retry_in: Option<PgInterval>,
    o_wake: bool,
}

/// One claim round trip. `ticket`: the caller's place in the fair queue,
/// with the token it was queued with.
pub(crate) async fn claim(
    core: &Arc<Core>,
    attempt: &Attempt,
    ticket: Option<(i64, &Token)>,
) -> Result<Admission> {
    let token = Token::new();
    // A queued claim renews its ticket's lease; the queue's order is the
    // semaphore's own (stored with it).
    let waiter_lease = ticket.map(|_| super::wake::wait_lease());
    let query = core
        .db
        .query_as::<ClaimRow>(CLAIM)
        .bind(core.name.clone())
        .bind(attempt.holder.clone())
        .bind(attempt.lease)
        .bind(attempt.metadata.clone())
        .bind(token.bytes())
        .bind(attempt.permits as i32)
        .bind(attempt.priority.sql())
        .bind(core.reserved as i32)
        .bind(ticket.map(|(id, _)| id))
        .bind(ticket.map(|(_, ticket_token)| ticket_token.bytes()))
        .bind(waiter_lease);
    let (row, sent) = send_claim(&core.db, query, || {
        forget_claim(core.clone(), token.clone(), attempt.lease);
    })
    .await
    .map_err(|error| refused_on(error, &core.name))?;
    if row.o_wake {
        wake_later(core);
    }
    let capacity = row.o_capacity.max(0) as u32;
    let retry_in = row.o_retry_in.map(|interval| duration_of(&interval));
    Ok(match row.o_status.as_str() {
        "claimed" => {
            let (claims, acquired_at, expires_at) = row.granted.claimed("pgsemaphore.claim")?;
            Admission::Claimed(Claimed {
                claims,
                acquired_at,
                expires_at,
                free: row.o_free.max(0) as u32,
                token,
                sent,
                semaphores: Vec::new(),
            })
        }
        "behind" => Admission::Behind { capacity, retry_in },
        "no_ticket" => Admission::NoTicket,
        "too_many" => Admission::TooMany { capacity },
        _ => Admission::Full { capacity, retry_in },
    })
}

/// One multi-limit claim round trip: every member's permits, or none.
/// Refused, it also names the semaphore that refused (the first, in the
/// canonical order). `holder` and `metadata` as a single claim's; the
/// lease is the shortest default lease of the members.
pub(crate) async fn claim_all(
    several: &Several,
    holder: &str,
    metadata: Option<&serde_json::Value>,
) -> Result<(Admission, Option<String>)> {
    let lead = several.lead();
    let token = Token::new();
    let names: Vec<String> = several
        .members
        .iter()
        .map(|(c, _)| c.name.clone())
        .collect();
    let permits: Vec<i32> = several.members.iter().map(|&(_, n)| n as i32).collect();
    let rates = if several.rates.is_empty() {
        None
    } else {
        Some(several.rates.arrays(lead.db.pool())?)
    };
    let sql = if rates.is_some() {
        CLAIM_ALL_RATED
    } else {
        CLAIM_ALL
    };
    let mut query = lead
        .db
        .query_as::<ClaimAllRow>(sql)
        .bind(names)
        .bind(holder.to_owned())
        .bind(several.lease)
        .bind(metadata.cloned())
        .bind(token.bytes())
        .bind(permits);
    if let Some(rates) = rates {
        query = rates.bind(query);
    }
    let (row, sent) = send_claim(&lead.db, query, || {
        // Each semaphore's release_by_token ends that semaphore's claims
        // with this token, or tombstones the token so that the claim in
        // flight refuses it: whole or nothing either way.
        for (core, _) in &several.members {
            forget_claim(core.clone(), token.clone(), None);
        }
    })
    .await
    .map_err(|error| several.refused_on(error))?;
    for name in &row.o_wake {
        if let Some((core, _)) = several.members.iter().find(|(c, _)| &c.name == name) {
            wake_later(core);
        }
    }
    let capacity = row.o_capacity.unwrap_or(0).max(0) as u32;
    let retry_in = row.o_retry_in.map(|interval| duration_of(&interval));
    let admission = match row.o_status.as_str() {
        "claimed" => {
            let Some(semaphores) = row.o_semaphores else {
                return Err(without_ids("pgsemaphore.claim_all"));
            };
            several.rates.count(None);
            let (claims, acquired_at, expires_at) = row.granted.claimed("pgsemaphore.claim_all")?;
            Admission::Claimed(Claimed {
                claims,
                acquired_at,
                expires_at,
                free: 0,
                token,
                sent,
                semaphores,
            })
        }
        "behind" => Admission::Behind { capacity, retry_in },
        "too_many" => Admission::TooMany { capacity },
        "rate_limited" => {
            several.rates.count(Some(row.o_rate_limit.unwrap_or(1)));
            let limiter = row.o_rate_limit.and_then(|i| several.rates.name(i));
            return Ok((
                Admission::RateLimited {
                    retry_in: retry_in.unwrap_or_default(),
                },
                limiter.map(str::to_owned),
            ));
        }
        _ => Admission::Full { capacity, retry_in },
    };
    Ok((admission, row.o_semaphore))
}

/// A claim whose reply was lost may have committed: end it by its token in
/// the background, retrying while its lease could still hold the slot, so
/// that a claim nobody knows about does not block a slot for a whole lease.
fn forget_claim(core: Arc<Core>, token: Token, lease: Option<PgInterval>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let lease = lease.map_or(core.lease, |interval| duration_of(&interval));
    runtime.spawn(async move {
        let give_up = Instant::now() + lease;
        let mut backoff = Duration::from_millis(50);
        loop {
            let query = core
                .db
                .query_as::<(i32, bool)>(RELEASE_BY_TOKEN)
                .bind(core.name.clone())
                .bind(token.bytes());
            match core.db.fetch_one(query).await {
                Ok((ended, wake_waiters)) => {
                    if ended > 0 {
                        tracing::info!(
                            semaphore = %core.name,
                            ended,
                            "a claim whose reply was lost had committed; released it"
                        );
                    }
                    if wake_waiters {
                        wake(&core).await;
                    }
                    return;
                }
                Err(error) if Instant::now() + backoff < give_up => {
                    tracing::debug!(semaphore = %core.name, %error, "releasing a claim whose reply was lost failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(error) => {
                    tracing::warn!(
                        semaphore = %core.name, %error,
                        "could not release a claim whose reply was lost; its lease frees the slot"
                    );
                    return;
                }
            }
        }
    });
}

/// Sends the semaphore's wake-up (if anyone waits) in the background.
fn wake_later(core: &Arc<Core>) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let core = core.clone();
        runtime.spawn(async move { wake(&core).await });
    }
}

/// Sends the semaphore's wake-up if anyone waits; failures are logged (a
/// wake-up is a hint: waiters re-check on their own).
pub(crate) async fn wake(core: &Core) {
    let query = core.db.query_as::<(bool,)>(WAKE).bind(core.name.clone());
    if let Err(error) = core.db.fetch_one(query).await {
        tracing::debug!(semaphore = %core.name, %error, "sending a wake-up failed");
    }
}

/// How ending (or checking) a permit's claims went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// Released, renewed or held, as asked.
    Done,
    /// Claim `id` no longer held its slot.
    Lost { id: i64, reason: LostReason },
}

/// The outcome text of `pgsemaphore.release`, `renew` and `fence`.
fn ended(id: i64, outcome: &str, at: Option<DateTime<Utc>>) -> Ended {
    let reason = match (outcome, at) {
        ("released" | "renewed" | "held", _) => return Ended::Done,
        ("timed_out", Some(at)) => LostReason::TimedOut { at },
        ("completed", Some(at)) => LostReason::AlreadyReleased { at },
        ("expired" | "timed_out", _) => LostReason::LeaseExpired,
        ("not_holder", _) => LostReason::NotHolder,
        _ => LostReason::Missing,
    };
    Ended::Lost { id, reason }
}

/// The first lost claim among the rows of a renewal or a fence of `ids`,
/// if any. An id the database did not answer for counts as lost
/// ([`LostReason::Missing`]): a renewal that renewed nothing never reads as
/// success.
fn first_lost(ids: &[i64], rows: Vec<(i64, String, Option<DateTime<Utc>>)>) -> Ended {
    let mut lost = rows
        .iter()
        .map(|(id, outcome, at)| ended(*id, outcome, *at))
        .filter(|e| *e != Ended::Done)
        .chain(
            ids.iter()
                .filter(|id| !rows.iter().any(|(answered, _, _)| answered == *id))
                .map(|&id| Ended::Lost {
                    id,
                    reason: LostReason::Missing,
                }),
        )
        .collect::<Vec<_>>();
    lost.sort_by_key(|e| match e {
        Ended::Lost { id, .. } => *id,
        Ended::Done => i64::MIN,
    });
    lost.into_iter().next().unwrap_or(Ended::Done)
}

/// Ends a permit's claims (and wakes waiters, if any, after the commit), in
/// one round trip. `lost`: the holder was already told the permit is lost,
/// so the claims are recorded as timed out, never as completed. `several`:
/// the claims belong to several semaphores (a multi-limit permit). Returns
/// how it went and, when released, when (database clock).
pub(crate) async fn release(
    core: &Core,
    ids: &[i64],
    token: &Token,
    lost: bool,
    several: bool,
) -> Result<(Ended, Option<DateTime<Utc>>)> {
    let (outcome, id, at): (String, Option<i64>, Option<DateTime<Utc>>) = if core.db.is_pooled() {
        let rows = core
            .db
            .batch(release_call(ids, token, lost, several))
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| Error::internal("pgsemaphore.release_then_wake returned no row"))?;
        (
            row.try_get("o_outcome")?,
            row.try_get("o_id")?,
            row.try_get("o_at")?,
        )
    } else {
        let query = core
            .db
            .query_as(if several { RELEASE_ALL } else { RELEASE })
            .bind(ids.to_vec())
            .bind(token.bytes())
            .bind(lost);
        core.db.fetch_one(query).await?
    };
    Ok((ended(id.unwrap_or(ids[0]), &outcome, at), at))
}

/// Renews a permit's claims to end `lease` from now (never earlier than
/// they do), in one round trip.
pub(crate) async fn renew(
    core: &Core,
    ids: &[i64],
    token: &Token,
    lease: PgInterval,
) -> Result<Ended> {
    let query = core
        .db
        .query_as::<(i64, String, Option<DateTime<Utc>>)>(RENEW)
        .bind(ids.to_vec())
        .bind(token.bytes())
        .bind(lease);
    Ok(first_lost(ids, core.db.fetch_all(query).await?))
}

/// Fences a permit's claims inside the caller's transaction.
pub(crate) async fn fence(
    conn: &mut PgConnection,
    pooled: bool,
    ids: &[i64],
    token: &Token,
) -> Result<Ended> {
    let rows: Vec<(i64, String, Option<DateTime<Utc>>)> = sqlx::query_as(FENCE)
        .bind(ids)
        .bind(token.bytes())
        .persistent(!pooled)
        .fetch_all(conn)
        .await
        .map_err(error::ours)?;
    Ok(first_lost(ids, rows))
}

/// What the claim and enqueue refuse with: P0002 (no_data_found) for an
/// unknown semaphore, 55P03 (lock_not_available) when the semaphore's row
/// stayed locked past the functions' `lock_timeout`.
pub(crate) fn refused_on(error: Error, semaphore: &str) -> Error {
    if error::sqlstate(&error).as_deref() == Some("55P03") {
        return Error::Stalled {
            semaphore: semaphore.to_owned(),
        };
    }
    error::semaphore_not_found(error, semaphore)
}

/// A lease as the database computed it.
pub(crate) fn duration_of(interval: &PgInterval) -> Duration {
    // Leases and waits are microseconds only (no months or days are produced).
    let micros = interval.microseconds + interval.days as i64 * 86_400_000_000;
    Duration::from_micros(micros.max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_decode_to_lost_reasons() {
        let at = Utc::now();
        assert_eq!(ended(1, "released", None), Ended::Done);
        assert_eq!(ended(1, "renewed", Some(at)), Ended::Done);
        assert_eq!(ended(1, "held", None), Ended::Done);
        assert_eq!(
            ended(2, "timed_out", Some(at)),
            Ended::Lost {
                id: 2,
                reason: LostReason::TimedOut { at }
            }
        );
        assert_eq!(
            ended(2, "completed", Some(at)),
            Ended::Lost {
                id: 2,
                reason: LostReason::AlreadyReleased { at }
            }
        );
        assert_eq!(
            ended(3, "expired", None),
            Ended::Lost {
                id: 3,
                reason: LostReason::LeaseExpired
            }
        );
        assert_eq!(
            ended(3, "not_holder", None),
            Ended::Lost {
                id: 3,
                reason: LostReason::NotHolder
            }
        );
        assert_eq!(
            ended(4, "missing", None),
            Ended::Lost {
                id: 4,
                reason: LostReason::Missing
            }
        );
    }

    #[test]
    fn the_first_lost_claim_of_a_permit_is_reported() {
        let rows = vec![
            (1, "renewed".to_owned(), None),
            (2, "completed".to_owned(), Some(Utc::now())),
            (3, "missing".to_owned(), None),
        ];
        assert!(matches!(
            first_lost(&[1, 2, 3], rows),
            Ended::Lost { id: 2, .. }
        ));
        let renewed = vec![(1, "renewed".to_owned(), None)];
        assert_eq!(first_lost(&[1], renewed), Ended::Done);
    }

    #[test]
    fn an_id_the_database_did_not_answer_for_is_lost() {
        assert_eq!(
            first_lost(&[7], Vec::new()),
            Ended::Lost {
                id: 7,
                reason: LostReason::Missing
            },
            "a renewal that renewed nothing is not a success"
        );
        let rows = vec![(8, "renewed".to_owned(), None)];
        assert!(matches!(
            first_lost(&[7, 8], rows),
            Ended::Lost { id: 7, .. }
        ));
    }

    #[test]
    fn the_pooled_release_inlines_only_integers_and_hex() {
        let token = Token::from_bytes([0xab; 16]);
        let sql = release_call(&[7, 9], &token, true, false);
        assert_eq!(
            sql,
            "CALL pgsemaphore.release_then_wake(p_ids => '{7,9}'::bigint[], \
             p_token => decode('abababababababababababababababab', 'hex'), p_lost => true)"
        );
        assert_eq!(format!("{token:?}"), "Token(..)", "never printed");
    }

    #[test]
    fn heartbeats_must_fit_twice_in_the_lease() {
        let lease = Duration::from_secs(30);
        assert_eq!(
            Heartbeat::Default.interval(lease),
            Some(Duration::from_secs(10))
        );
        assert_eq!(Heartbeat::Off.interval(lease), None);
        assert!(
            Heartbeat::Every(Duration::from_secs(15))
                .check(lease, "lease")
                .is_ok()
        );
        assert!(
            Heartbeat::Every(Duration::from_secs(16))
                .check(lease, "lease")
                .is_err()
        );
        assert!(
            Heartbeat::Every(Duration::ZERO)
                .check(lease, "lease")
                .is_err()
        );
        assert!(
            Heartbeat::Every(Duration::MAX)
                .check(lease, "lease")
                .is_err()
        );
    }

    #[test]
    fn low_priority_claims_leave_the_reserve() {
        let attempt = |priority| Attempt {
            holder: "h".into(),
            metadata: None,
            lease: None,
            permits: 1,
            priority,
            fairness_key: None,
            ride_out_outages: true,
        };
        assert_eq!(attempt(Priority::High).usable(10, 3), 10);
        assert_eq!(attempt(Priority::Low).usable(10, 3), 7);
        assert_eq!(attempt(Priority::Low).usable(2, 5), 0);
    }

    #[test]
    fn queue_places_follow_the_order() {
        let fifo = QueueOrder::OldestFirst;
        assert!(fifo.place(0, 1) < fifo.place(0, 2));
        assert!(
            fifo.place(0, 1001) < fifo.place(1, 2),
            "an earlier turn first, whatever its ticket"
        );
        let lifo = QueueOrder::NewestFirst;
        assert!(lifo.place(0, 2) < lifo.place(0, 1));
        assert!(lifo.place(5, 2) < lifo.place(0, 1), "LIFO ignores turns");
    }

    #[test]
    fn intervals_convert_to_durations() {
        let interval = PgInterval {
            months: 0,
            days: 1,
            microseconds: 1_500_000,
        };
        assert_eq!(
            duration_of(&interval),
            Duration::from_micros(86_401_500_000)
        );
        let negative = PgInterval {
            months: 0,
            days: 0,
            microseconds: -5,
        };
        assert_eq!(duration_of(&negative), Duration::ZERO);
    }
}
