//! The advisory semaphore: a counting semaphore whose slots are
//! session-level advisory locks, so that claiming and releasing write no
//! row and a long transaction elsewhere in the database (a `pg_dump`, a
//! report, an idle-in-transaction session) cannot slow it down.
//!
//! - [`AdvisorySemaphore`] (this module): opening, claims, waits;
//! - [`session`]: the dedicated connections that hold the slots, their
//!   heartbeat and the server's dead-man switch;
//! - [`permit`]: the permit, [`AdvisoryPermit`];
//! - [`audit`]: the insert-only audit log, written in batches off the hot
//!   path.
//!
//! The rules live in SQL (`pgsemaphore.advisory_claim` and
//! `pgsemaphore.advisory_release`, whose bodies state the invariant and
//! what they meet); this module sends one statement per claim or release
//! to a dedicated session, and waits with the lease semaphore's wake-ups
//! (one `LISTEN` connection per process, a local order of waiters).
//!
//! Waiting without a table: a waiting process holds the semaphore's 16
//! waiting keys in shared mode (on one of its sessions) before it claims; a
//! release that can take one of them exclusively knows that no other
//! process waits and sends no `NOTIFY`. Advisory locks are visible to every session
//! the moment they are taken or freed, so there is no snapshot to miss a
//! waiter in (the lease semaphore needs its wake-up gate for that).

mod audit;
mod permit;
mod session;

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::Client;
use crate::background::lock;
use crate::db::Db;
use crate::detached::detached;
use crate::error::{Error, Result, semaphore_not_found};
use crate::metrics::SemaphoreMetrics;
use crate::outcomes::OutcomeKind;
use crate::validate::{self, MAX_CAPACITY};

pub(crate) use self::audit::AuditWriter;
pub use self::permit::AdvisoryPermit;
pub(crate) use self::session::Sessions;
use self::session::{ClaimReply, RowView, Session};
use super::wake::Wakeups;

/// The default most dedicated connections a client's advisory semaphores
/// open to hold slots (they run one statement at a time each).
pub const DEFAULT_ADVISORY_CONNECTIONS: usize = 4;

/// Opens (creates if needed) the semaphore; returns its capacity, whether
/// it was created, and the base of its advisory keys.
const OPEN: &str = "SELECT o_capacity, o_created, o_key_base \
                    FROM pgsemaphore.open_advisory(p_name => $1, p_capacity => $2)";

/// Free slots right now: the capacity less the slots held (from pg_locks;
/// a slot held in shared mode by several sessions counts once).
const AVAILABLE: &str = "SELECT a.capacity - (SELECT count(DISTINCT h.slot)::int FROM pgsemaphore.advisory_holders h \
                                              WHERE h.semaphore = a.name) \
                         FROM pgsemaphore.advisory_semaphores a WHERE a.name = $1";

/// The first of the 16 waiting keys of a semaphore whose keys start at
/// `base` (the comment above `CREATE TABLE pgsemaphore.advisory_semaphores`
/// in `migrations/20261128010001_pgsemaphore_tables.sql`).
fn waiting_keys(base: i64) -> i64 {
    base + 1_048_560
}

/// A counting semaphore whose slots are **advisory locks**: every process
/// that uses the same database shares at most `capacity` permits, and
/// claiming or releasing one writes nothing.
///
/// The two semaphores, side by side ([`Semaphore`](crate::Semaphore) is the
/// lease semaphore):
///
/// | | `AdvisorySemaphore` | `Semaphore` |
/// |---|---|---|
/// | a permit is | a session-level advisory lock on a dedicated connection | a row in `pgsemaphore.slots`, with a lease |
/// | a claim + release writes | nothing (a refusal is counted in memory, and the counts written every 5 s: the client's [outcome counters](crate::admin::outcomes)) | a row, then makes it dead |
/// | a long transaction in the database (`pg_dump`, a report) | no effect | each claim slows, without bound |
/// | holder crashes | slot free at once (its connection closes) | slot free when its lease ends |
/// | holder's link cut | holder told within 2.5 heartbeats, slot free after 3 | holder told before its lease ends, slot free when it ends |
/// | an operator's `pg_terminate_backend` of its session | slot free at once, holder told within ~2 heartbeats: its work may overlap the next holder's until then | no effect |
/// | database restart or failover | every permit lost, every holder told within ~2 heartbeats (the same overlap) | permits survive (durable rows) |
/// | connections | up to [`advisory_connections`](crate::Client::advisory_connections) dedicated ones per client, held while permits are | none held between round trips |
/// | behind PgBouncer (transaction pooling) | needs a direct URL for its connections ([`Client::connect_options`](crate::Client::connect_options)) | works through it |
/// | audit log | one row per finished permit, written in batches after it ends (`pgsemaphore.advisory_claims`); live holders in `pg_locks` ([`semaphores`](crate::admin::semaphores)) | every claim, live or ended, in `pgsemaphore.slots` |
/// | fence a write into your transaction | no | [`Permit::fence`](crate::Permit::fence) |
///
/// ```no_run
/// use std::time::Duration;
/// use pg_semaphore::{AdvisorySemaphore, Error};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// # let client = pg_semaphore::Client::new(pool.clone());
/// pg_semaphore::migrate(&pool).await?;
/// let sem = AdvisorySemaphore::builder("payments-api", 4).build(&client).await?;
/// match sem.try_acquire().await {
///     Ok(permit) => {
///         // ... call the upstream ...
///         permit.release().await?;
///     }
///     Err(Error::NoSlotsAvailable { .. }) => { /* 503 */ }
///     Err(e) => return Err(e.into()),
/// }
/// // Waiting is cancel-safe: bound it with tokio::time::timeout.
/// let permit = tokio::time::timeout(Duration::from_secs(5), sem.acquire()).await??;
/// permit.release().await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[derive(Clone)]
pub struct AdvisorySemaphore {
    core: Arc<AdvisoryCore>,
}

/// What every handle of one advisory semaphore shares.
pub(crate) struct AdvisoryCore {
    name: String,
    capacity: u32,
    key_base: i64,
    holder: String,
    fallback: Duration,
    /// The application's pool: opening, the audit log, `available_permits`.
    db: Db,
    sessions: Arc<Sessions>,
    wakeups: Arc<Wakeups>,
    audit: Option<Arc<AuditWriter>>,
    metrics: SemaphoreMetrics,
    /// This process's waiting announcement for the semaphore, shared by its
    /// waiters.
    announced: Mutex<Weak<Announcement>>,
    /// What the one-statement claim last read of the semaphore's row.
    row: RowView,
}

impl fmt::Debug for AdvisorySemaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let core = &self.core;
        f.debug_struct("AdvisorySemaphore")
            .field("name", &core.name)
            .field("capacity", &core.capacity)
            .field("holder", &core.holder)
            .field("heartbeat", &core.sessions.heartbeat())
            .field("fallback_interval", &core.fallback)
            .field("audit", &core.audit.is_some())
            .finish_non_exhaustive()
    }
}

/// Configures an [`AdvisorySemaphore`]; made by [`AdvisorySemaphore::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `.build(&client).await`"]
pub struct AdvisorySemaphoreBuilder {
    name: String,
    capacity: u32,
    audit: bool,
}

impl AdvisorySemaphoreBuilder {
    /// Whether finished permits are written to the audit log
    /// (`pgsemaphore.advisory_claims`, default `true`).
    pub fn audit(mut self, enabled: bool) -> Self {
        self.audit = enabled;
        self
    }

    /// Validates the settings and opens the semaphore: creates it with this
    /// capacity if it does not exist; an existing one keeps its capacity
    /// (the handle reports and uses the stored one).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad name, capacity, holder, a zero
    /// heartbeat, fallback or connection count, or a name that a lease
    /// [`Semaphore`](crate::Semaphore) already has (one name, one kind:
    /// two kinds of the same name would each admit the capacity);
    /// [`Error::Schema`]; [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Opening is one statement: cancelling either creates the semaphore or not.
    pub async fn build(self, client: &Client) -> Result<AdvisorySemaphore> {
        validate::name(&self.name)?;
        validate::capacity(self.capacity)?;
        let fallback = client.fallback()?;
        let holder = client.holder_label()?;
        let sessions = client.sessions()?;
        if !client.can_listen() {
            return Err(Error::invalid(
                "connect_options",
                "behind a transaction pooler, the slots need a direct connection: \
                 give its options with `Client::connect_options`",
            ));
        }
        let db = client.db().clone();
        let query = db
            .query_as::<(i32, bool, i64)>(OPEN)
            .bind(self.name.clone())
            .bind(self.capacity as i32);
        let (capacity, created, key_base) = db
            .fetch_one(query)
            .await
            .map_err(|error| semaphore_not_found(error, &self.name))?;
        if created {
            tracing::debug!(semaphore = %self.name, capacity, "advisory semaphore created");
        } else if capacity as u32 != self.capacity {
            tracing::warn!(
                semaphore = %self.name,
                capacity,
                requested_capacity = self.capacity,
                "advisory semaphore exists with another capacity, which stays in force; \
                 change it with pg_semaphore::admin::set_capacity or `pg-semaphore set-capacity`"
            );
        }
        Ok(AdvisorySemaphore {
            core: Arc::new(AdvisoryCore {
                sessions,
                wakeups: client.wakeups().clone(),
                audit: self.audit.then(|| client.audit_writer()),
                metrics: SemaphoreMetrics::new(&self.name)
                    .counting(client.outcome_counter(OutcomeKind::Advisory, &self.name)),
                capacity: capacity.max(1) as u32,
                key_base,
                holder,
                fallback,
                db,
                announced: Mutex::new(Weak::new()),
                row: RowView::default(),
                name: self.name,
            }),
        })
    }
}

/// Arrival order of waiting acquires in this process.
static ARRIVAL: AtomicI64 = AtomicI64::new(0);

impl AdvisorySemaphore {
    /// Starts configuring the advisory semaphore `name` with `capacity` slots.
    ///
    /// Nothing is validated or written until [`AdvisorySemaphoreBuilder::build`].
    pub fn builder(name: impl Into<String>, capacity: u32) -> AdvisorySemaphoreBuilder {
        AdvisorySemaphoreBuilder {
            name: name.into(),
            capacity,
            audit: true,
        }
    }

    /// The semaphore's name.
    pub fn name(&self) -> &str {
        &self.core.name
    }

    /// The capacity stored when this handle was opened (claims always use
    /// the database's current value).
    pub fn capacity(&self) -> u32 {
        self.core.capacity
    }

    /// The holder label recorded in the audit log.
    pub fn holder(&self) -> &str {
        &self.core.holder
    }

    /// How many slots are free right now (the capacity less the slots held,
    /// from `pg_locks`). Only a snapshot.
    ///
    /// # Errors
    ///
    /// [`Error::SemaphoreNotFound`], [`Error::Schema`], [`Error::Database`].
    pub async fn available_permits(&self) -> Result<u32> {
        let db = &self.core.db;
        let query = db
            .query_as::<(i32,)>(AVAILABLE)
            .bind(self.core.name.clone());
        match db.fetch_optional(query).await? {
            Some((free,)) => Ok(free.max(0) as u32),
            None => Err(Error::SemaphoreNotFound {
                semaphore: self.core.name.clone(),
            }),
        }
    }

    /// Claims a slot if one is free, or fails at once. One round trip on a
    /// dedicated connection; nothing is written.
    ///
    /// # Errors
    ///
    /// [`Error::NoSlotsAvailable`] when every slot is held (answer
    /// 429/503); [`Error::Stalled`] when the claim waited 2 s for a lock on
    /// the semaphore's table (a migration's DDL queued; nothing was taken);
    /// [`Error::SemaphoreNotFound`], [`Error::Schema`],
    /// [`Error::Database`] (the database cannot be reached, or the session
    /// was lost, or a claim failed: it then holds nothing).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the claim runs on its session whatever happens to this
    /// future, and what it claims after the caller left is released there.
    pub async fn try_acquire(&self) -> Result<AdvisoryPermit> {
        self.try_acquire_many(1).await
    }

    /// Claims `n` slots at once if that many are free (all or nothing), or
    /// fails at once.
    ///
    /// # Errors
    ///
    /// As [`try_acquire`](Self::try_acquire); [`Error::InvalidArgument`] for
    /// `n` = 0 or more than the capacity.
    ///
    /// # Cancel safety
    ///
    /// As [`try_acquire`](Self::try_acquire).
    pub async fn try_acquire_many(&self, n: u32) -> Result<AdvisoryPermit> {
        self.check_permits(n)?;
        match claim(&self.core, n).await? {
            Claim::Claimed(permit) => Ok(permit),
            Claim::Full { capacity } => {
                self.core.metrics.no_slots();
                Err(Error::NoSlotsAvailable {
                    semaphore: self.core.name.clone(),
                    capacity,
                })
            }
            Claim::TooMany { capacity } => Err(self.too_many(n, capacity)),
        }
    }

    /// Waits without limit until a slot is free, then claims it. Waiting
    /// tasks hold no connection of the pool; they are woken by a release
    /// (a `NOTIFY` from another process, directly in this one), or by the
    /// fallback re-check. Within a process, waiters are served in order.
    ///
    /// # Errors
    ///
    /// [`Error::SemaphoreNotFound`], [`Error::Schema`],
    /// [`Error::InvalidArgument`] when the capacity shrank below the permits
    /// asked for; neither an outage nor a stalled claim
    /// ([`Error::Stalled`]) ends the wait (it retries).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: nothing is left held or announced. Bound the wait with
    /// `tokio::time::timeout` around it (there is no `acquire_timeout`: it
    /// would do the same).
    pub async fn acquire(&self) -> Result<AdvisoryPermit> {
        self.acquire_many(1).await
    }

    /// Waits without limit until `n` slots are free, then claims them all
    /// at once; never holds some while waiting for the rest.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire); [`Error::InvalidArgument`] for `n` = 0
    /// or more than the capacity.
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_many(&self, n: u32) -> Result<AdvisoryPermit> {
        self.check_permits(n)?;
        wait(&self.core, n).await
    }

    fn check_permits(&self, n: u32) -> Result<()> {
        if n == 0 || n > MAX_CAPACITY {
            return Err(Error::invalid(
                "permits",
                format!("{n} is out of range: 1 to {MAX_CAPACITY}"),
            ));
        }
        Ok(())
    }

    fn too_many(&self, n: u32, capacity: u32) -> Error {
        Error::invalid(
            "permits",
            format!(
                "{n} can never be held at once: advisory semaphore {:?} has {capacity} slots",
                self.core.name
            ),
        )
    }
}

/// What one claim found.
enum Claim {
    Claimed(AdvisoryPermit),
    Full { capacity: u32 },
    TooMany { capacity: u32 },
}

/// One claim round trip on a session, cancel-safe by construction: it runs
/// in the caller's task, and if the caller has gone before it finished, the
/// rest runs in a spawned task and the permit it made is dropped there,
/// which releases it.
async fn claim(core: &Arc<AdvisoryCore>, n: u32) -> Result<Claim> {
    let core = core.clone();
    detached(move |_| async move {
        let session = core.sessions.pick().await?;
        let reply = session
            .claim(&core.name, core.key_base, &core.row, n)
            .await
            .map_err(|error| {
                // The session's lock_timeout (2 s) ran out: nothing was taken.
                if crate::error::sqlstate(&error).as_deref() == Some("55P03") {
                    return Error::Stalled {
                        semaphore: core.name.clone(),
                    };
                }
                semaphore_not_found(error, &core.name)
            })?;
        Ok(match reply {
            ClaimReply::Claimed { slots, at } => {
                tracing::debug!(semaphore = %core.name, ?slots, "advisory permit acquired");
                Claim::Claimed(AdvisoryPermit::new(&core, session, slots, at, None))
            }
            ClaimReply::Full { capacity } => Claim::Full { capacity },
            ClaimReply::TooMany { capacity } => Claim::TooMany { capacity },
        })
    })
    .await
}

/// This process's announcement that it waits on a semaphore: the 16
/// waiting keys from `key`, held in shared mode on one session; given back
/// when the last local waiter drops its handle.
struct Announcement {
    session: Arc<Session>,
    key: i64,
}

impl Drop for Announcement {
    fn drop(&mut self) {
        let (session, key) = (self.session.clone(), self.key);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { session.withdraw(key).await });
        }
    }
}

/// The process's announcement for `core`'s semaphore, taken if there is
/// none alive. `None`: it could not be taken (waiters then rely on the
/// fallback re-check). Cancel-safe: an announcement taken after the caller
/// left is given back.
async fn announce(core: &Arc<AdvisoryCore>) -> Option<Arc<Announcement>> {
    if let Some(current) = lock(&core.announced).upgrade()
        && current.session.lost_reason().is_none()
    {
        return Some(current);
    }
    let key = waiting_keys(core.key_base);
    let sessions = core.sessions.clone();
    let taken = detached(move |_| async move {
        let session = sessions.pick().await?;
        Ok(session
            .announce(key)
            .await
            .then(|| Arc::new(Announcement { session, key })))
    })
    .await;
    let announcement = taken.ok().flatten()?;
    let mut slot = lock(&core.announced);
    match slot.upgrade() {
        // Another waiter announced meanwhile: keep one (ours is given back).
        Some(other) if other.session.lost_reason().is_none() => Some(other),
        _ => {
            *slot = Arc::downgrade(&announcement);
            Some(announcement)
        }
    }
}

/// Waits until `n` slots can be claimed, then claims them.
async fn wait(core: &Arc<AdvisoryCore>, n: u32) -> Result<AdvisoryPermit> {
    let _waiting = core.metrics.waiting();
    let started = Instant::now();
    core.wakeups.start(true);
    let mut watch = core.wakeups.watch(&core.name, core.fallback);
    watch.take_place((0, 1, 0, ARRIVAL.fetch_add(1, Ordering::Relaxed)), None);
    let mut announcement: Option<Arc<Announcement>> = None;
    let mut pause: Option<Duration> = None;
    loop {
        watch.seen();
        if watch.is_first() {
            // Announce before the claim: a release that does not see the
            // announcement came before it, and this claim sees its slot.
            if announcement
                .as_ref()
                .is_none_or(|a| a.session.lost_reason().is_some())
            {
                announcement = announce(core).await;
            }
            match claim(core, n).await {
                Ok(Claim::Claimed(permit)) => {
                    // Whoever is next here tries too: slots may be left.
                    watch.leave(true);
                    core.metrics.waited(started.elapsed());
                    return Ok(permit);
                }
                Ok(Claim::TooMany { capacity }) => {
                    return Err(Error::invalid(
                        "permits",
                        format!(
                            "{n} can never be held at once: advisory semaphore {:?} has {capacity} slots",
                            core.name
                        ),
                    ));
                }
                Ok(Claim::Full { .. }) => pause = None,
                // The claim waited its lock_timeout for a lock (the table's,
                // behind a migration): nothing taken, and no release will
                // say when the table is free: try again shortly.
                Err(Error::Stalled { .. }) => {
                    pause = None;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(error) if error.is_unreachable() => {
                    // An outage: retry, pausing longer each time.
                    let next = pause.map_or(Duration::from_millis(50), |p| {
                        (p * 2).min(core.fallback.max(Duration::from_millis(50)))
                    });
                    if pause.is_none() {
                        tracing::warn!(semaphore = %core.name, %error, "database unreachable while waiting; retrying until it is back or the wait times out");
                    }
                    pause = Some(next);
                    tokio::time::sleep(next).await;
                    continue;
                }
                Err(error) => return Err(error),
            }
        }
        watch.changed().await;
    }
}
