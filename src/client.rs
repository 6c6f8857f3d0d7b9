//! The [`Client`]: one per pool, the owner of the background work that the
//! primitives built on it share.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use crate::db::Db;
use crate::error::Result;
use crate::rate_limit::RateWakeups;
use crate::semaphore::advisory::{AuditWriter, Sessions};
use crate::semaphore::wake::Wakeups;

/// pg-semaphore on one pool: every primitive is built on a client, and the
/// client owns the background work they share.
///
/// Make one per pool when the process starts, clone it freely (a clone is
/// the same client), and build the primitives on it:
/// [`SemaphoreBuilder::build`](crate::SemaphoreBuilder::build),
/// [`SemaphoreFamilyBuilder::build`](crate::SemaphoreFamilyBuilder::build),
/// [`AdvisorySemaphoreBuilder::build`](crate::AdvisorySemaphoreBuilder::build),
/// [`RateLimiterBuilder::build`](crate::RateLimiterBuilder::build) and
/// [`Mutex::lock`](crate::Mutex::lock) take it.
///
/// What it owns, each started on first use, never at construction:
///
/// | background work | started by | connection |
/// |---|---|---|
/// | the semaphores' wake-ups: a `LISTEN` task and a 100 ms ticker | the first waiting acquire | one of its own |
/// | the rate limiters' wake-ups: a `LISTEN` task | the first waiting rate acquire | one of its own |
/// | the advisory semaphores' sessions, which hold their slots | the first advisory claim | up to [`connections`](crate::AdvisorySemaphoreBuilder::connections) of their own |
/// | the advisory audit writer, a queue written in batches | the first audited advisory semaphore | the pool's |
///
/// [`shutdown`](Client::shutdown) writes what the audit writer holds and
/// stops the rest; call it before the process exits. Dropping the client
/// and every primitive built on it stops the same work, but writes nothing
/// more: a dropped queue's records are lost.
///
/// Operator tools take the operator's pool, not a client: the functions of
/// [`admin`](crate::admin), the [`Reaper`](crate::admin::Reaper) and the
/// [`AuditLog`](crate::audit::AuditLog) start no background work the
/// application shares.
///
/// ```no_run
/// use pg_semaphore::{Client, Mutex, RateLimiter, RatePolicy, Semaphore};
///
/// # async fn run(pool: sqlx::PgPool) -> pg_semaphore::Result<()> {
/// let client = Client::new(pool);
/// let api = Semaphore::builder("payments-api", 4).build(&client).await?;
/// let per_customer = RateLimiter::builder("per-customer", RatePolicy::token_bucket(5.0, 10))
///     .build(&client)?;
/// let job = Mutex::new("nightly-report");
///
/// let permit = api.acquire().await?;
/// permit.release().await?;
/// per_customer.check("customer-42", 1).await?;
/// job.lock(&client).await?.commit().await?;
///
/// client.shutdown().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
}

struct Shared {
    db: Db,
    /// How the client's own connections connect: given, or the pool's.
    options: Arc<PgConnectOptions>,
    /// Whether `options` were given (then the wake-ups listen even behind
    /// a transaction pooler).
    direct: bool,
    wakeups: Arc<Wakeups>,
    rate_wakeups: Arc<RateWakeups>,
    sessions: OnceLock<Arc<Sessions>>,
    audit: OnceLock<Arc<AuditWriter>>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("transaction_pooling", &self.shared.db.is_pooled())
            .field("connect_options", &self.shared.direct)
            .field("advisory_sessions", &self.shared.sessions.get().is_some())
            .field("audit_writer", &self.shared.audit.get().is_some())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// The client of `pool`, for a pool that connects to PostgreSQL
    /// directly (see [`transaction_pooling`](Client::transaction_pooling)
    /// otherwise). Starts nothing and connects nowhere.
    pub fn new(pool: PgPool) -> Client {
        Client::with(pool, false, None)
    }

    fn with(pool: PgPool, pooled: bool, options: Option<PgConnectOptions>) -> Client {
        let direct = options.is_some();
        let options = match options {
            Some(options) => Arc::new(options),
            None => pool.connect_options(),
        };
        Client {
            shared: Arc::new(Shared {
                db: Db::new(&pool, pooled).listening(direct),
                wakeups: Arc::new(Wakeups::new(options.clone())),
                rate_wakeups: Arc::new(RateWakeups::new(options.clone())),
                options,
                direct,
                sessions: OnceLock::new(),
                audit: OnceLock::new(),
            }),
        }
    }

    /// Declares that the pool connects through a **transaction-pooling
    /// proxy** such as PgBouncer with `pool_mode = transaction` (default
    /// `false`). Every statement sent through the pool then runs unnamed
    /// inside an explicit transaction, since the proxy may route the steps
    /// of a prepared statement to different server connections. Nothing
    /// can `LISTEN` through such a proxy: waiters poll (every
    /// [`fallback_interval`](crate::SemaphoreBuilder::fallback_interval)),
    /// unless [`connect_options`](Client::connect_options) give a direct
    /// connection. Advisory semaphores need those options.
    ///
    /// Set it (and `connect_options`) before building anything on the
    /// client: each returns a new client, which shares nothing with the old.
    #[must_use = "returns a new client"]
    pub fn transaction_pooling(self, enabled: bool) -> Client {
        let options = self.shared.direct.then(|| (*self.shared.options).clone());
        Client::with(self.shared.db.pool().clone(), enabled, options)
    }

    /// Connects the client's own connections (the wake-ups' `LISTEN`
    /// connections, the advisory semaphores' sessions) with these options
    /// instead of the pool's: behind a transaction pooler, give a direct
    /// URL here, since listening and a session-level lock need a session of
    /// their own.
    #[must_use = "returns a new client"]
    pub fn connect_options(self, options: PgConnectOptions) -> Client {
        let pooled = self.shared.db.is_pooled();
        Client::with(self.shared.db.pool().clone(), pooled, Some(options))
    }

    /// The pool the client sends its statements through.
    pub fn pool(&self) -> &PgPool {
        self.shared.db.pool()
    }

    /// Writes the advisory audit records still queued, then stops the
    /// client's background work: the `LISTEN` tasks and the ticker stop,
    /// and the advisory sessions that hold no permit close. Call it when
    /// the process is done with pg-semaphore, after the last permit was
    /// released.
    ///
    /// The client stays usable: a primitive used afterwards starts the work
    /// it needs again. An acquire still waiting keeps the semaphores'
    /// wake-ups running (they stop with the client then); a permit still
    /// held keeps its session.
    ///
    /// # Errors
    ///
    /// The error that kept the audit writer from writing its queue (the
    /// records stay queued, and are retried while the client lives):
    /// [`Error::Database`](crate::Error::Database) (say, the database is
    /// unreachable) or [`Error::Schema`](crate::Error::Schema).
    ///
    /// # Cancel safety
    ///
    /// Cancelling it stops waiting for the audit writer, which goes on
    /// writing; nothing else is left half done.
    pub async fn shutdown(&self) -> Result<()> {
        let written = match self.shared.audit.get() {
            Some(writer) => writer.flush().await,
            None => Ok(()),
        };
        self.shared.wakeups.stop();
        self.shared.rate_wakeups.stop();
        if let Some(sessions) = self.shared.sessions.get() {
            sessions.close_idle();
        }
        written
    }

    pub(crate) fn db(&self) -> &Db {
        &self.shared.db
    }

    /// Whether the wake-ups may `LISTEN`, and the advisory semaphores open
    /// sessions: on a direct pool, or with direct connect options.
    pub(crate) fn can_listen(&self) -> bool {
        self.shared.db.listens()
    }

    pub(crate) fn wakeups(&self) -> &Arc<Wakeups> {
        &self.shared.wakeups
    }

    pub(crate) fn rate_wakeups(&self) -> &Arc<RateWakeups> {
        &self.shared.rate_wakeups
    }

    /// The advisory sessions, made by the first advisory semaphore built on
    /// the client (its heartbeat and maximum count hold for all).
    pub(crate) fn sessions(&self, heartbeat: Duration, max: usize) -> Arc<Sessions> {
        self.shared
            .sessions
            .get_or_init(|| Arc::new(Sessions::new(&self.shared.options, heartbeat, max)))
            .clone()
    }

    /// The advisory audit writer, started by the first audited advisory
    /// semaphore.
    pub(crate) fn audit_writer(&self) -> Arc<AuditWriter> {
        self.shared
            .audit
            .get_or_init(|| Arc::new(AuditWriter::new(&self.shared.db)))
            .clone()
    }
}
