//! [`Error`], the one error type, with [`SchemaError`] (why pg-semaphore's
//! schema cannot be used), [`LostReason`] (why a permit or a session lock no
//! longer holds) and [`WaitedFor`] (what a wait that timed out waited for);
//! and how a database error reads, in one place:
//!
//! - [`ours`]: an error of one of the crate's own statements, the one place
//!   that reads "undefined table" as "migrations not applied" and a SQL
//!   function's argument check as [`Error::InvalidArgument`]; errors of the
//!   caller's statements never go through it;
//! - [`unreachable`] ([`Error::is_unreachable`]): the database could not be
//!   reached, or the connection died;
//! - [`outcome_unknown`]: a statement may have run without its reply
//!   reaching us;
//! - [`semaphore_not_found`]: the crate's functions' "no such semaphore".

use std::borrow::Cow;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A specialized [`Result`](std::result::Result) for pg-semaphore operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong when using pg-semaphore.
///
/// ```no_run
/// use pg_semaphore::{Error, Semaphore};
///
/// # async fn run(sem: Semaphore) -> Result<u16, Error> {
/// // Map to an HTTP status: busy is 503, a missing schema is a deployment bug.
/// let status = match sem.try_acquire().await {
///     Ok(permit) => {
///         // ... call the upstream ...
///         permit.release().await?;
///         200
///     }
///     Err(Error::NoSlotsAvailable { .. }) => 503,
///     Err(error @ Error::Schema(_)) => panic!("{error}"),
///     Err(error) => return Err(error),
/// };
/// # Ok(status)
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Every slot of the semaphore is held; `try_acquire` fails fast with this
    /// (answer 429 or 503 at once).
    #[error("no slots available: all {capacity} slots of semaphore {semaphore:?} are held")]
    NoSlotsAvailable {
        /// The semaphore's name.
        semaphore: String,
        /// The capacity the database enforced for this claim.
        capacity: u32,
    },

    /// A claim with rate limits ([`Acquiring::rate_limit`](crate::Acquiring::rate_limit))
    /// found every semaphore free but a rate limit refusing: nothing was
    /// claimed and no limit was charged. Answer 429 with `Retry-After:
    /// retry_after`.
    #[error("rate limited by {limiter:?}: it admits again in {retry_after:?}")]
    RateLimited {
        /// The limiter that refused (of several, the one with the longest wait).
        limiter: String,
        /// When it would admit (a pause: when the pause ends).
        retry_after: Duration,
    },

    /// The semaphore's queue of waiters already holds its limit: an acquire
    /// on a handle built with [`queue_limit`](crate::SemaphoreBuilder::queue_limit)
    /// is refused at once instead of waiting (answer 429 or 503).
    #[error("queue full: {limit} waiters are already queued on semaphore {semaphore:?}")]
    QueueFull {
        /// The semaphore's name.
        semaphore: String,
        /// The queue limit that was reached.
        limit: u32,
    },

    /// A wait gave up after its timeout: a semaphore's acquire with
    /// [`Acquiring::timeout`](crate::Acquiring::timeout), or a mutex's lock with
    /// [`Locking::timeout`](crate::Locking::timeout) (PostgreSQL's
    /// `lock_timeout`, SQLSTATE 55P03). Nothing is left held or queued. A
    /// token bucket's `acquire_timeout` returns it at once, without
    /// waiting, when the database says the tokens would come too late.
    #[error("timed out after {timeout:?} waiting for {waited_for}")]
    Timeout {
        /// What was waited for.
        waited_for: WaitedFor,
        /// How long the caller was willing to wait.
        timeout: Duration,
    },

    /// The mutex is held by someone else: a lock with
    /// [`Locking::no_wait`](crate::Locking::no_wait) fails fast with this,
    /// as `try_acquire` does with [`Error::NoSlotsAvailable`].
    #[error("{mutex} is held by someone else")]
    Locked {
        /// The mutex, as [`Mutex::name`](crate::Mutex::name) spells it.
        mutex: String,
    },

    /// PostgreSQL found a deadlock involving this lock wait and aborted it
    /// (SQLSTATE 40P01). The transaction is rolled back; retry it.
    #[error("deadlock detected while waiting for {mutex}; the transaction was rolled back")]
    Deadlock {
        /// The mutex, as [`Mutex::name`](crate::Mutex::name) spells it.
        mutex: String,
    },

    /// A session lock's connection died or stopped answering (terminated,
    /// network failure, database restart): the server has released the lock
    /// or will shortly, and another holder may already have it. Stop the work
    /// it protected.
    #[error("{mutex} was lost: {reason}")]
    LockLost {
        /// The mutex, as [`Mutex::name`](crate::Mutex::name) spells it.
        mutex: String,
        /// Why it was lost.
        reason: LostReason,
    },

    /// An argument was rejected: by the crate before anything was sent, or
    /// by the database's own check (SQLSTATE 22023, which names the
    /// argument; nothing was written).
    #[error("invalid {argument}: {reason}")]
    InvalidArgument {
        /// Which argument (`capacity`, `name`, `lease`, ...).
        argument: &'static str,
        /// What is wrong with it and what is accepted.
        reason: String,
    },

    /// The semaphore has no row in the database (it was deleted after this
    /// handle was built).
    #[error(
        "semaphore {semaphore:?} does not exist: build it with `Semaphore::builder(..).build(&client)`"
    )]
    SemaphoreNotFound {
        /// The semaphore's name.
        semaphore: String,
    },

    /// No semaphore family has this name (an operator function named one
    /// that was never created).
    #[error(
        "semaphore family {family:?} does not exist: build it with `SemaphoreFamily::builder(..).build(&client)`"
    )]
    FamilyNotFound {
        /// The family's name.
        family: String,
    },

    /// A claim (or a queue join, a rate limiter's check, or an operator's
    /// change) waited longer than the database's bound (2 s of
    /// `lock_timeout`, inside `pgsemaphore.claim`, `pgsemaphore.enqueue`,
    /// every rate limiter function and every operator function) for a lock
    /// another transaction holds: the semaphore's row, typically a claim or
    /// an enqueue left uncommitted in an open transaction, or an advisory
    /// key (a rate limiter key's lock, a name's creation key) held by a check
    /// left in an open transaction or by any session that took it with
    /// `pg_advisory_lock`. Nothing was claimed, taken or changed. Waiting
    /// acquires retry through it (one `WARN`) until their timeout; a
    /// fail-fast claim, a plain rate check or an operator's change returns
    /// it: run it again. The culprit shows in `pg_stat_activity` (`idle in
    /// transaction`) and `pg_locks`; `idle_in_transaction_session_timeout`
    /// on the application's role bounds how long one can last.
    #[error(
        "{semaphore:?} waited 2 s for a lock that another transaction holds \
         (a claim, an enqueue or a rate check left uncommitted in an open transaction?): nothing was changed"
    )]
    Stalled {
        /// The semaphore's name (or the rate limiter's, or a set's
        /// limiters', joined by `", "`).
        semaphore: String,
    },

    /// The permit no longer held its slot when it was released: it was reaped
    /// after its lease expired, or released by someone else (an operator).
    ///
    /// This is how a holder learns that others may have used the slot while it
    /// believed it held it.
    #[error("permit {id} of semaphore {semaphore:?} was lost: {reason}")]
    PermitLost {
        /// The semaphore's name.
        semaphore: String,
        /// The permit's id (its fencing token).
        id: i64,
        /// Why the slot was no longer held.
        reason: LostReason,
    },

    /// pg-semaphore's schema cannot be used: it is missing (the migrations
    /// were not applied), applying it failed, or [`migrate`](crate::migrate)
    /// found a schema it may not or cannot bring to this crate's version.
    /// Each [`SchemaError`] says what to do; none is worth a retry.
    #[error(transparent)]
    Schema(#[from] SchemaError),

    /// The role lacks a grant this call needs (SQLSTATE 42501): the
    /// application's part of the schema, or the operator's (an operator's
    /// function called with the application's role, say). The message
    /// names the denied object and the command that gives the grant.
    #[error("{denied}: {}", access_advice(*access))]
    PermissionDenied {
        /// The part of the schema the role needs.
        access: crate::admin::Access,
        /// What PostgreSQL denied ("permission denied for function configure").
        denied: String,
    },

    /// A broken internal invariant of pg-semaphore (a bug: please report
    /// it). Never read as an outage: a fail-open handle does not admit on
    /// it, and a waiting acquire does not retry it.
    #[error("pg-semaphore internal error: {message}")]
    Internal {
        /// What was found broken.
        message: String,
    },

    /// Any other database error (connection refused, pool timeout, an error
    /// of the caller's own statement, ...).
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Why pg-semaphore's schema cannot be used ([`Error::Schema`]): it is
/// missing, applying the migrations failed, or [`migrate`](crate::migrate)
/// (or `refinery_migrate`) found a schema this role may not upgrade, that
/// another tool must upgrade, that is too new for this crate, or that is
/// not pg-semaphore's. Every message says what to do.
///
/// ```no_run
/// use pg_semaphore::{Error, schema::SchemaError};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Error> {
/// match pg_semaphore::migrate(&pool).await {
///     Ok(()) => {}
///     // A deployment problem: say what to do and stop.
///     Err(Error::Schema(SchemaError::TooNew { .. })) => panic!("upgrade pg-semaphore"),
///     Err(error) => return Err(error),
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchemaError {
    /// The database does not have pg-semaphore's schema: one of the crate's
    /// own statements found no such schema, table or function (SQLSTATE
    /// 3F000, 42P01, 42883). Any operation can return it, not only
    /// [`migrate`](crate::migrate).
    #[error(
        "pg-semaphore migrations not applied: run `pg_semaphore::migrate(&pool)` or \
         `sqlx migrate run --source <pg-semaphore>/migrations --config <pg-semaphore>/migrations/sqlx.toml`"
    )]
    Missing {
        /// The database error that revealed it (undefined schema, table or function).
        #[source]
        source: sqlx::Error,
    },

    /// Applying the migrations failed, or sqlx's migrator refused the
    /// recorded history (a migration that failed half-way, or an applied
    /// file that was modified since).
    #[error("applying pg-semaphore migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),

    /// refinery failed to apply the migrations (feature `refinery`).
    #[cfg(feature = "refinery")]
    #[error("applying pg-semaphore migrations with refinery failed: {0}")]
    Refinery(#[from] ::refinery::Error),

    /// The schema must be created or upgraded, and this role may not do it:
    /// the role that owns the schema (or, for a new one, a role with
    /// `CREATE` on the database) must run the migrations. Nothing was written.
    #[error("{}", not_permitted(role, owner.as_deref(), *found, *required))]
    NotPermitted {
        /// The role that tried (`current_user`).
        role: String,
        /// The role that owns pg-semaphore's schema and its objects (the one
        /// to run the migrations as), if the `pgsemaphore` schema exists.
        owner: Option<String>,
        /// The schema version found, if any.
        found: Option<i32>,
        /// The schema version this crate needs.
        required: i32,
    },

    /// The schema is older than this crate needs, and was applied by another
    /// tool than the one called (the application's own migration history,
    /// refinery, or pg-semaphore's own sqlx history): that tool must apply
    /// the missing migrations. Nothing was written.
    #[error("{}", outdated(*found, *required, *history, pending))]
    Outdated {
        /// The schema version found.
        found: i32,
        /// The schema version this crate needs.
        required: i32,
        /// Where the applied migrations are recorded.
        history: MigrationHistory,
        /// The files of pg-semaphore's `migrations/` still to apply, in order.
        pending: Vec<String>,
    },

    /// The schema was migrated by a newer version of pg-semaphore that says
    /// this version can no longer use it (`o_compatible_from` above this
    /// crate's version): upgrade pg-semaphore in this application. Nothing
    /// was written.
    #[error(
        "pg-semaphore's schema is at version {found}, migrated by a newer version of pg-semaphore, \
         and needs code for schema version {compatible_from} or later; this version of the crate \
         supports schema version {supported}: upgrade pg-semaphore in this application"
    )]
    TooNew {
        /// The schema version found.
        found: i32,
        /// The oldest schema version whose code may use that schema.
        compatible_from: i32,
        /// The schema version this crate supports.
        supported: i32,
    },

    /// A schema named `pgsemaphore` exists with objects in it, but not
    /// pg-semaphore's (it has no `pgsemaphore.schema_version()`): the crate
    /// needs that name. Nothing was written.
    #[error(
        "schema pgsemaphore exists and is not empty ({objects} relations and functions), but was \
         not created by pg-semaphore's migrations (it has no pgsemaphore.schema_version()): \
         pg-semaphore needs that schema for itself; move those objects to another schema, or drop \
         it if it is a leftover, then migrate again"
    )]
    Unrecognized {
        /// How many tables, views, sequences and functions the schema holds.
        objects: i64,
    },
}

impl From<sqlx::migrate::MigrateError> for Error {
    fn from(error: sqlx::migrate::MigrateError) -> Self {
        Error::Schema(SchemaError::Migrate(error))
    }
}

#[cfg(feature = "refinery")]
impl From<::refinery::Error> for Error {
    fn from(error: ::refinery::Error) -> Self {
        Error::Schema(SchemaError::Refinery(error))
    }
}

/// Where the migrations that built pg-semaphore's schema are recorded
/// ([`SchemaError::Outdated`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MigrationHistory {
    /// pg-semaphore's own sqlx history, [`MIGRATIONS_TABLE`](crate::schema::MIGRATIONS_TABLE):
    /// applied by [`migrate`](crate::migrate), `pg-semaphore migrate` or
    /// `sqlx migrate run --config <pg-semaphore>/migrations/sqlx.toml`.
    Sqlx,
    /// `pgsemaphore.refinery_schema_history`: applied by `refinery_migrate`.
    Refinery,
    /// Neither: the application applied the files through its own migration
    /// history (or by hand).
    Application,
}

fn not_permitted(role: &str, owner: Option<&str>, found: Option<i32>, required: i32) -> String {
    let how = "run `pg_semaphore::migrate(&pool)` (or `pg-semaphore migrate`)";
    match (owner, found) {
        (_, None) => format!(
            "pg-semaphore's schema is not installed and role {role:?} may not install it (that \
             needs CREATE on the database): {how} once as the role that should own it, then grant \
             this role the application's privileges (docs/guide/operations.md, \"Privileges\")"
        ),
        (Some(owner), Some(found)) => format!(
            "pg-semaphore's schema is at version {found} but this crate needs version {required}, \
             and role {role:?} may not upgrade it: {how} once as role {owner:?}, which owns it, \
             then start this process again"
        ),
        (None, Some(found)) => format!(
            "pg-semaphore's schema is at version {found} but this crate needs version {required}, \
             and role {role:?} may not upgrade it: {how} once as the role that owns it, then \
             start this process again"
        ),
    }
}

fn outdated(found: i32, required: i32, history: MigrationHistory, pending: &[String]) -> String {
    let what = format!(
        "pg-semaphore's schema is at version {found} but this crate needs version {required}"
    );
    match history {
        MigrationHistory::Application => format!(
            "{what}, and it was applied through your application's own migration history (there \
             is no pg-semaphore history): apply migrations {} in your own history (copy them from \
             pg-semaphore's migrations/ into your migrations/ and run `sqlx migrate run`)",
            pending.join(", ")
        ),
        MigrationHistory::Sqlx => format!(
            "{what}, and it was applied with sqlx (history in pgsemaphore._sqlx_migrations): \
             upgrade it with `pg_semaphore::migrate(&pool)` or `pg-semaphore migrate`, not with \
             refinery"
        ),
        MigrationHistory::Refinery => format!(
            "{what}, and it was applied with refinery (history in \
             pgsemaphore.refinery_schema_history): upgrade it with \
             `pg_semaphore::schema::refinery_migrate(&mut client)`, not with sqlx"
        ),
    }
}

/// What a wait that timed out ([`Error::Timeout`]) was waiting for.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitedFor {
    /// A permit of this semaphore (an acquire with
    /// [`Acquiring::timeout`](crate::Acquiring::timeout)).
    Permit {
        /// The semaphore's name.
        semaphore: String,
    },
    /// This mutex (a lock with [`Locking::timeout`](crate::Locking::timeout)).
    Mutex {
        /// The mutex, as [`Mutex::name`](crate::Mutex::name) spells it.
        mutex: String,
    },
    /// Permits of this key of a rate limiter
    /// ([`RateLimiter::acquire_timeout`](crate::RateLimiter::acquire_timeout)):
    /// the key's permits would not have been there within the timeout, so
    /// the wait was refused at once, and nothing was taken.
    RateLimit {
        /// The limiter's name.
        limiter: String,
        /// The key.
        key: String,
    },
}

impl std::fmt::Display for WaitedFor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitedFor::Permit { semaphore } => write!(f, "a permit of semaphore {semaphore:?}"),
            WaitedFor::Mutex { mutex } => f.write_str(mutex),
            WaitedFor::RateLimit { limiter, key } => {
                write!(f, "key {key:?} of rate limiter {limiter:?}")
            }
        }
    }
}

/// Why a permit or a session lock was found not to hold any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// The lease expired and a reaper (or another claim) marked the slot timed out.
    TimedOut {
        /// When the slot was marked timed out (database clock).
        at: DateTime<Utc>,
    },
    /// The claim had already been completed, not by this permit (for example
    /// by an operator's forced release).
    AlreadyReleased {
        /// When it was completed (database clock).
        at: DateTime<Utc>,
    },
    /// The lease has ended and the slot is about to be reaped: anyone may
    /// claim it as soon as a reaper or a claim notices.
    LeaseExpired,
    /// No claim with this id exists (its audit row was deleted).
    Missing,
    /// The claim belongs to another holder: the secret token this permit
    /// holds does not match it.
    NotHolder,
    /// The permit never held a slot: it was admitted without the database
    /// (fail-open, see [`Permit::is_unchecked`](crate::Permit::is_unchecked)).
    Unchecked,
    /// A session lock's connection died, or stopped answering within its
    /// heartbeat: the server frees the lock when it notices the session is
    /// gone.
    ConnectionLost,
}

impl std::fmt::Display for LostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TimedOut { at } => write!(f, "its lease expired and it was reaped at {at}"),
            Self::AlreadyReleased { at } => write!(f, "it was already released at {at}"),
            Self::LeaseExpired => f.write_str("its lease has expired"),
            Self::Missing => f.write_str("no such claim exists"),
            Self::NotHolder => f.write_str("it belongs to another holder"),
            Self::Unchecked => {
                f.write_str("it was admitted without the database (fail-open) and holds no slot")
            }
            Self::ConnectionLost => f.write_str("its connection died or stopped answering"),
        }
    }
}

impl Error {
    /// Whether the error only means "busy": no slot was free, a rate limit
    /// refused a claim, the queue was full, a mutex was held, a wait timed out, or the semaphore's row was
    /// held by a stuck transaction for longer than the bound
    /// ([`Error::Stalled`]).
    ///
    /// Handy for mapping to HTTP 429/503 while treating everything else as a failure.
    ///
    /// ```no_run
    /// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), pg_semaphore::Error> {
    /// use std::time::Duration;
    /// match sem.acquiring().timeout(Duration::from_secs(2)).acquire().await {
    ///     Ok(permit) => permit.release().await?,
    ///     Err(e) if e.is_busy() => println!("busy: try again later"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn is_busy(&self) -> bool {
        matches!(
            self,
            Error::NoSlotsAvailable { .. }
                | Error::RateLimited { .. }
                | Error::QueueFull { .. }
                | Error::Locked { .. }
                | Error::Timeout { .. }
                | Error::Stalled { .. }
        )
    }

    /// Whether the error means the database could not be reached or the
    /// connection died (as opposed to an answer from the database): I/O, TLS
    /// and protocol failures, a closed pool, SQLSTATE class 08 (connection
    /// exception) and 57P01-57P05 (server shutting down, starting up,
    /// session ended). Neither a pool timeout nor 53300 (too many
    /// connections) counts: both can mean a server that is only busy.
    pub fn is_unreachable(&self) -> bool {
        match self {
            Error::Database(error) => unreachable(error),
            _ => false,
        }
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Error::Internal {
            message: message.into(),
        }
    }

    pub(crate) fn invalid(argument: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            argument,
            reason: reason.into(),
        }
    }
}

/// Maps an error of one of the crate's own statements: an undefined schema,
/// table or function (3F000, 42P01, 42883) means the migrations were not
/// applied ([`SchemaError::Missing`]); 22023 raised by a function's argument check (`pgsemaphore.refuse`,
/// which names the argument in the error's COLUMN field) is an
/// [`Error::InvalidArgument`]. Statements the application runs (in a mutex
/// guard's transaction, say) never go through here.
pub(crate) fn ours(error: sqlx::Error) -> Error {
    let Some(database) = error.as_database_error() else {
        return Error::Database(error);
    };
    match database.code().as_deref() {
        Some("3F000" | "42P01" | "42883") => Error::Schema(SchemaError::Missing { source: error }),
        // Not the owner's own functions (grant_access, regrant): their
        // caller must be the owner, which no grant changes.
        Some("42501")
            if database.message().starts_with("permission denied for ")
                && !database.message().ends_with("grant_access")
                && !database.message().ends_with("regrant") =>
        {
            let denied = database.message().to_owned();
            Error::PermissionDenied {
                access: crate::admin::Access::needed_for(&denied),
                denied,
            }
        }
        Some("22023") => {
            let column = database
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .and_then(|e| e.column());
            match column.map(argument_name) {
                Some(argument) => {
                    let message = database.message();
                    // "invalid p_permits: 1 to 100000, got 0" -> "1 to 100000, got 0"
                    let reason = message.split_once(": ").map_or(message, |(_, r)| r);
                    Error::invalid(argument, reason)
                }
                None => Error::Database(error),
            }
        }
        _ => Error::Database(error),
    }
}

/// What a role lacking `access` should run, for [`Error::PermissionDenied`].
fn access_advice(access: crate::admin::Access) -> String {
    let which = match access {
        crate::admin::Access::Application => "this role lacks the application's grants",
        crate::admin::Access::Operator => {
            "this is an operator's function, and this role lacks the operator's grants"
        }
    };
    format!(
        "{which}: as the role that ran the migrations, run `pg-semaphore grant --{access} <role>` \
         (or SELECT pgsemaphore.grant_access('<role>', '{access}'))"
    )
}

/// The crate's name for an argument of a SQL function, as
/// [`Error::InvalidArgument`] reports it.
fn argument_name(column: &str) -> &'static str {
    match column {
        "p_name" | "p_semaphore" => "name",
        "p_semaphores" => "semaphores",
        "p_capacity" => "capacity",
        "p_lease" => "lease",
        "p_holder" => "holder",
        "p_metadata" => "metadata",
        "p_token" | "p_ticket_token" => "token",
        "p_permits" | "p_n" => "permits",
        "p_priority" => "priority",
        "p_reserve" => "reserved",
        "p_ids" => "ids",
        "p_ticket" | "p_tickets" => "ticket",
        "p_waiter_lease" => "waiter_lease",
        "p_fair_key" => "fairness_key",
        "p_limit" => "limit",
        "p_limiter" => "limiter",
        "p_kinds" | "p_limiters" | "p_keys" | "p_rates" | "p_bursts" | "p_limits" | "p_windows" => {
            "limits"
        }
        "p_kind" => "kind",
        "p_for" => "duration",
        "p_key" => "key",
        "p_rate" => "rate",
        "p_burst" => "burst",
        "p_window" => "window",
        "p_older_than" => "older_than",
        "p_idle_for" => "idle_for",
        "p_batch" => "batch",
        "p_id" => "id",
        "p_family" => "family",
        "p_idle_after" => "idle_after",
        "p_match" => "match",
        "p_tier" => "tier",
        _ => "argument",
    }
}

/// See [`Error::is_unreachable`].
pub(crate) fn unreachable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolClosed => true,
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|code| code.starts_with("08") || code.starts_with("57P")),
        _ => false,
    }
}

/// Whether a statement that failed with `error` may still have run on the
/// server: the connection broke after it was sent, so its reply (and commit
/// status) is unknown. A pool timeout never sent anything; an error answer
/// from the server means it did not commit.
pub(crate) fn outcome_unknown(error: &Error) -> bool {
    match error {
        Error::Database(sqlx::Error::Database(_) | sqlx::Error::PoolTimedOut) => false,
        Error::Database(error) => unreachable(error),
        _ => false,
    }
}

/// The SQLSTATE of an error the database answered with, if it is one.
pub(crate) fn sqlstate(error: &Error) -> Option<Cow<'_, str>> {
    match error {
        Error::Database(error) => error.as_database_error().and_then(|e| e.code()),
        _ => None,
    }
}

/// P0002 (no_data_found) for a family no family has, as
/// [`Error::FamilyNotFound`]; any other error as [`not_found`] does.
pub(crate) fn family_not_found(error: Error, family: &str) -> Error {
    not_found(error, family, |family| Error::FamilyNotFound { family })
}

/// P0002 (no_data_found), which the crate's functions raise for a name no
/// semaphore has, as [`Error::SemaphoreNotFound`]; any other error as
/// [`not_found`] does.
pub(crate) fn semaphore_not_found(error: Error, semaphore: &str) -> Error {
    not_found(error, semaphore, |semaphore| Error::SemaphoreNotFound {
        semaphore,
    })
}

/// P0002 (no_data_found) for `name` as `missing` makes it; 55P03 as
/// [`Error::Stalled`] on `name`; any other error as it is.
fn not_found(error: Error, name: &str, missing: impl FnOnce(String) -> Error) -> Error {
    match sqlstate(&error).as_deref() {
        Some("P0002") => missing(name.to_owned()),
        // A row held past lock_timeout (2 s) by another transaction.
        Some("55P03") => Error::Stalled {
            semaphore: name.to_owned(),
        },
        _ => error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_undefined_objects_of_our_statements_mean_missing_migrations() {
        assert!(matches!(ours(sqlx::Error::RowNotFound), Error::Database(_)));
        assert!(matches!(
            ours(sqlx::Error::PoolTimedOut),
            Error::Database(_)
        ));
    }

    #[test]
    fn sql_argument_names_map_to_the_crates() {
        assert_eq!(argument_name("p_permits"), "permits");
        assert_eq!(argument_name("p_token"), "token");
        assert_eq!(argument_name("p_semaphore"), "name");
        assert_eq!(argument_name("p_something_new"), "argument");
    }

    #[test]
    fn a_pool_timeout_never_leaves_an_unknown_outcome() {
        assert!(!outcome_unknown(&Error::Database(
            sqlx::Error::PoolTimedOut
        )));
        assert!(outcome_unknown(&Error::Database(sqlx::Error::Io(
            std::io::Error::from(std::io::ErrorKind::ConnectionReset)
        ))));
    }
}
