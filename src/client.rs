//! The [`Client`]: one per pool, the owner of the background work that the
//! primitives built on it share.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use crate::db::Db;
use crate::dead_man::DEFAULT_SESSION_HEARTBEAT;
use crate::error::Result;
use crate::outcomes::{Counter, OutcomeKind, Tally};
use crate::rate_limit::RateWakeups;
use crate::semaphore::advisory::{AuditWriter, DEFAULT_ADVISORY_CONNECTIONS, Sessions};
use crate::semaphore::wake::Wakeups;
use crate::semaphore::{DEFAULT_FALLBACK_INTERVAL, default_holder};
use crate::validate;

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
/// | the advisory semaphores' sessions, which hold their slots | the first advisory claim | up to [`advisory_connections`](Client::advisory_connections) of their own |
/// | the advisory audit writer, a queue written in batches | the first audited advisory semaphore | the pool's |
/// | the outcome counters' writer: every 5 s, what its semaphores and rate limiters refused, timed out and (rate limiters) admitted | the first refusal, timeout or rate decision; it ends when a round finds nothing counted | the pool's |
///
/// [`shutdown`](Client::shutdown) writes what the audit writer and the
/// outcome counters hold and stops the rest; call it before the process
/// exits. Dropping the client and every primitive built on it stops the
/// same work, but writes nothing more: a dropped queue's records, and the
/// counts of the last seconds, are lost.
///
/// The outcome counters are one row per semaphore (a family's keys
/// together), rate limiter and minute in `pgsemaphore.outcomes`, never a
/// row per request: `pg-semaphore status` and `audit --limiter` show them,
/// [`admin::outcomes`](crate::admin::outcomes) reads them. Counting costs a
/// request a mutex and a hash map update; the writer one statement per 5 s
/// (BENCHMARKS.md measures both).
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

/// What the setters of [`Client`] set.
#[derive(Clone)]
struct Settings {
    pooled: bool,
    /// Direct connect options for the client's own connections.
    options: Option<PgConnectOptions>,
    holder: Option<String>,
    fallback: Duration,
    advisory_heartbeat: Duration,
    advisory_connections: usize,
}

struct Shared {
    settings: Settings,
    db: Db,
    /// How the client's own connections connect: given, or the pool's.
    options: Arc<PgConnectOptions>,
    wakeups: Arc<Wakeups>,
    rate_wakeups: Arc<RateWakeups>,
    sessions: OnceLock<Arc<Sessions>>,
    audit: OnceLock<Arc<AuditWriter>>,
    outcomes: Arc<Tally>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("transaction_pooling", &self.shared.settings.pooled)
            .field("connect_options", &self.shared.settings.options.is_some())
            .field("holder", &self.shared.settings.holder)
            .field("fallback_interval", &self.shared.settings.fallback)
            .field(
                "advisory_heartbeat",
                &self.shared.settings.advisory_heartbeat,
            )
            .field(
                "advisory_connections",
                &self.shared.settings.advisory_connections,
            )
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
        Client::with(
            pool,
            Settings {
                pooled: false,
                options: None,
                holder: None,
                fallback: DEFAULT_FALLBACK_INTERVAL,
                advisory_heartbeat: DEFAULT_SESSION_HEARTBEAT,
                advisory_connections: DEFAULT_ADVISORY_CONNECTIONS,
            },
        )
    }

    fn with(pool: PgPool, settings: Settings) -> Client {
        let direct = settings.options.is_some();
        let options = match &settings.options {
            Some(options) => Arc::new(options.clone()),
            None => pool.connect_options(),
        };
        let db = Db::new(&pool, settings.pooled).listening(direct);
        Client {
            shared: Arc::new(Shared {
                outcomes: Arc::new(Tally::new(&db)),
                db,
                wakeups: Arc::new(Wakeups::new(options.clone())),
                rate_wakeups: Arc::new(RateWakeups::new(options.clone())),
                options,
                settings,
                sessions: OnceLock::new(),
                audit: OnceLock::new(),
            }),
        }
    }

    /// A new client of the same pool with one setting changed.
    fn set(self, change: impl FnOnce(&mut Settings)) -> Client {
        let mut settings = self.shared.settings.clone();
        change(&mut settings);
        Client::with(self.shared.db.pool().clone(), settings)
    }

    /// Declares that the pool connects through a **transaction-pooling
    /// proxy** such as PgBouncer with `pool_mode = transaction` (default
    /// `false`). Every statement sent through the pool then runs unnamed
    /// inside an explicit transaction, since the proxy may route the steps
    /// of a prepared statement to different server connections. Nothing
    /// can `LISTEN` through such a proxy: waiters poll (every
    /// [`fallback_interval`](Client::fallback_interval)),
    /// unless [`connect_options`](Client::connect_options) give a direct
    /// connection. Advisory semaphores need those options.
    ///
    /// Set it (and `connect_options`) before building anything on the
    /// client: each returns a new client, which shares nothing with the old.
    #[must_use = "returns a new client"]
    pub fn transaction_pooling(self, enabled: bool) -> Client {
        self.set(|s| s.pooled = enabled)
    }

    /// Connects the client's own connections (the wake-ups' `LISTEN`
    /// connections, the advisory semaphores' sessions) with these options
    /// instead of the pool's: behind a transaction pooler, give a direct
    /// URL here, since listening and a session-level lock need a session of
    /// their own.
    #[must_use = "returns a new client"]
    pub fn connect_options(self, options: PgConnectOptions) -> Client {
        self.set(|s| s.options = Some(options))
    }

    /// The holder label recorded with every claim and advisory permit of
    /// what is built on the client (default: `host:pid`): the audit log's
    /// and `pg-semaphore status`'s "who". One acquire may give its own
    /// ([`Acquiring::holder`](crate::Acquiring::holder)). Checked when a
    /// primitive is built ([`Error::InvalidArgument`](crate::Error::InvalidArgument)
    /// `holder`: at most [`MAX_HOLDER_LEN`](crate::limits::MAX_HOLDER_LEN)
    /// characters, no NUL).
    #[must_use = "returns a new client"]
    pub fn holder(self, holder: impl Into<String>) -> Client {
        let holder = holder.into();
        self.set(|s| s.holder = Some(holder))
    }

    /// How often a waiting acquire re-checks even without a wake-up
    /// (default [`DEFAULT_FALLBACK_INTERVAL`](crate::limits::DEFAULT_FALLBACK_INTERVAL)).
    /// It matters when a notification is lost, and behind a transaction
    /// pooler, where nothing listens and waiters poll at this interval:
    /// shorten it there. One re-check per semaphore per process and
    /// interval. Checked when a primitive is built (not zero).
    #[must_use = "returns a new client"]
    pub fn fallback_interval(self, interval: Duration) -> Client {
        self.set(|s| s.fallback = interval)
    }

    /// How often each advisory semaphore session proves it is alive
    /// (default [`DEFAULT_SESSION_HEARTBEAT`](crate::limits::DEFAULT_SESSION_HEARTBEAT),
    /// 1 s). A permit is told it is lost within two and a half heartbeats of
    /// its link going silent; the server ends a silent session, freeing its
    /// slots, after three (at least a second: the floor the dead-man switch
    /// keeps). Checked when an advisory semaphore is built (not zero).
    #[must_use = "returns a new client"]
    pub fn advisory_heartbeat(self, heartbeat: Duration) -> Client {
        self.set(|s| s.advisory_heartbeat = heartbeat)
    }

    /// The most sessions (dedicated connections) the advisory semaphores
    /// open to hold slots (default
    /// [`DEFAULT_ADVISORY_CONNECTIONS`](crate::limits::DEFAULT_ADVISORY_CONNECTIONS)).
    /// Each runs one statement at a time and holds any number of permits; a
    /// new one is opened only when every open one is busy. Checked when an
    /// advisory semaphore is built (not zero).
    #[must_use = "returns a new client"]
    pub fn advisory_connections(self, connections: usize) -> Client {
        self.set(|s| s.advisory_connections = connections)
    }

    /// The pool the client sends its statements through.
    pub fn pool(&self) -> &PgPool {
        self.shared.db.pool()
    }

    /// Writes the advisory audit records still queued and the outcome
    /// counts not written yet, then stops the client's background work:
    /// the `LISTEN` tasks and the ticker stop, and the advisory sessions
    /// that hold no permit close (the outcome counters' writer ends at its
    /// next round, having nothing left). Call it when the process is done
    /// with pg-semaphore, after the last permit was released.
    ///
    /// The client stays usable: a primitive used afterwards starts the work
    /// it needs again. An acquire still waiting keeps the semaphores'
    /// wake-ups running (they stop with the client then); a permit still
    /// held keeps its session.
    ///
    /// # Errors
    ///
    /// The error that kept the audit writer from writing its queue, or
    /// the outcome counters from being written (the records and counts are
    /// kept, and retried while the client lives):
    /// [`Error::Database`](crate::Error::Database) (say, the database is
    /// unreachable, or another transaction held a counter's row for 2 s)
    /// or [`Error::Schema`](crate::Error::Schema).
    ///
    /// # Cancel safety
    ///
    /// Cancelling it stops waiting for the audit writer and the outcome
    /// counters' write, which go on writing; nothing else is left half
    /// done.
    pub async fn shutdown(&self) -> Result<()> {
        let written = match self.shared.audit.get() {
            Some(writer) => writer.flush().await,
            None => Ok(()),
        };
        let counted = self.shared.outcomes.flush().await;
        let written = written.and(counted);
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

    /// The holder label, checked: the one set, or `host:pid`.
    pub(crate) fn holder_label(&self) -> Result<String> {
        match &self.shared.settings.holder {
            Some(holder) => {
                validate::holder(holder)?;
                Ok(holder.clone())
            }
            None => Ok(default_holder()),
        }
    }

    /// The fallback re-check interval, checked.
    pub(crate) fn fallback(&self) -> Result<Duration> {
        let fallback = self.shared.settings.fallback;
        validate::nonzero("fallback_interval", fallback)?;
        Ok(fallback)
    }

    /// The advisory sessions (their settings checked), made by the first
    /// advisory semaphore built on the client.
    pub(crate) fn sessions(&self) -> Result<Arc<Sessions>> {
        let settings = &self.shared.settings;
        validate::nonzero("advisory_heartbeat", settings.advisory_heartbeat)?;
        validate::positive("advisory_connections", settings.advisory_connections as u64)?;
        Ok(self
            .shared
            .sessions
            .get_or_init(|| {
                Arc::new(Sessions::new(
                    &self.shared.options,
                    settings.advisory_heartbeat,
                    settings.advisory_connections,
                ))
            })
            .clone())
    }

    /// The outcome counter of `kind` `name` on the client's tally.
    pub(crate) fn outcome_counter(&self, kind: OutcomeKind, name: &str) -> Counter {
        self.shared.outcomes.counter(kind, name)
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
