//! Distributed concurrency control on PostgreSQL.
//!
//! Many processes on many machines share one PostgreSQL; pg-semaphore lets them
//! agree that **at most N of them** talk to a fragile upstream at once, with no
//! other infrastructure.
//!
//! This page is the reference's overview; the [`guide`] is the
//! how-to, one chapter per topic: [choosing a primitive](crate::guide::choosing),
//! [per-tenant limits](crate::guide::families),
//! [rate limiting](crate::guide::rate_limiting),
//! [guarantees](crate::guide::guarantees), [operations](crate::guide::operations),
//! [the SQL API](crate::guide::sql_api) and
//! [scaling past one server](crate::guide::scaling).
//!
//! # The client
//!
//! Everything starts from a [`Client`], one per pool: semaphores, families,
//! rate limiters are built on it and mutexes lock through it. It owns the
//! background work they share (the wake-ups' `LISTEN` connections, the
//! advisory semaphores' sessions, the advisory audit writer), starts each on
//! first use, and [`Client::shutdown`] ends them.
//!
//! # The semaphore
//!
//! A [`Semaphore`] has a name and a capacity, stored in
//! `pgsemaphore.semaphores`. Every claim is a row in `pgsemaphore.slots`
//! holding the lowest free slot number below the capacity; a partial unique
//! index over live rows makes it impossible for the database to hand out a
//! slot twice, claims on one semaphore serialise on that semaphore's row
//! only (never a table lock), so different semaphores never wait on each
//! other, and a claim counts as held every live claim it could not reap
//! itself. Every rule lives in a SQL function of the `pgsemaphore` schema,
//! whose contract (arguments, results, the invariant it keeps, the
//! transactions it meets) is the comment that opens its body, in the one
//! migration file of its concept (tables, admission, the queue, the
//! advisory semaphore, families, rate limits, operator functions):
//! `docs/sql-api.md` names that file for each application function. The
//! same headers, and the comments on tables, read in
//! `schema/pgsemaphore.sql` (the whole schema, dumped) and in `psql`'s
//! `\sf` and `\d+`.
//!
//! - [`Semaphore::try_acquire`] fails fast with [`Error::NoSlotsAvailable`]:
//!   answer 429/503 at once.
//! - [`Semaphore::acquire`] waits (bounded by [`Acquiring::timeout`]). Waiting
//!   tasks hold no pooled connection: they sleep until a release anywhere
//!   sends a `NOTIFY` (received by one shared `LISTEN` connection per [`Client`]),
//!   until the lease that blocks them ends, or until a slow fallback
//!   re-check in case a notification is lost. Within a process they are
//!   served in order.
//! - [`Permit::release`] ends the claim (one round trip) and wakes a waiter.
//!   A release sends a `NOTIFY` only when some process registered as
//!   waiting on that semaphore, and only after its own durable commit:
//!   PostgreSQL serialises notifying commits across the instance, so a fleet
//!   that mostly does not wait pays nothing for wake-ups.
//! - [`SemaphoreBuilder::build`] *opens* a semaphore: it creates it if it
//!   does not exist and never changes a stored capacity or lease; an
//!   operator changes them ([`set_capacity`](crate::admin::set_capacity), [`configure`](crate::admin::configure)).
//!
//! # Beyond one permit
//!
//! - [`Semaphore::acquire_many`] and friends hold `n` slots at once, all or
//!   nothing, released together.
//! - [`Semaphore::acquire_all`] and friends hold permits of several
//!   semaphores at once ("100 in total and 5 per merchant"), all or
//!   nothing, without deadlock whatever order callers name them in, and
//!   holding nothing while they wait: one [`Permit`], one release.
//! - [`Acquiring::rate_limit`] charges rate limits in the same claim:
//!   admitted only when the semaphore has room and every limit admits,
//!   nothing taken from either otherwise ([`Error::RateLimited`]).
//! - [`SemaphoreBuilder::reserved`] keeps slots for critical traffic:
//!   [`Priority::Low`] claims succeed only while more than that many are free.
//! - [`SemaphoreBuilder::queue`] serves waiters in order ([`QueueOrder`])
//!   across every process, with an optional
//!   [`queue_limit`](SemaphoreBuilder::queue_limit) ([`Error::QueueFull`]);
//!   waiters of different [fairness keys](Acquiring::fairness_key) take turns.
//! - [`Semaphore::wait_idle`] waits until nobody holds a permit (a
//!   distributed WaitGroup).
//!
//! # Families: a semaphore per key
//!
//! A [`SemaphoreFamily`] gives each key (a tenant, a customer) its own
//! semaphore, created on first use with the capacity the operator's rules
//! give that key: an exact-key rule, else the rule of the key's tier (the
//! operator puts keys in tiers), else the family's default ("each tenant
//! may run 10 at once, premium tenants 50, tenant 7 200").
//! [`set_family_rule`](crate::admin::set_family_rule), [`set_family_tier`](crate::admin::set_family_tier) and [`configure_family`](crate::admin::configure_family) change
//! them at run time, for existing keys too, atomically; the application
//! names keys and never chooses a capacity. A key's semaphore is an
//! ordinary [`Semaphore`] (named `@family/key`), so a claim on a key costs
//! what a named claim costs; the reaper removes keys nothing has referenced
//! for the family's idle time (after their audit history was pruned).
//! [`families`](crate::admin::families) and [`busiest_keys`](crate::admin::busiest_keys) list them.
//!
//! # Crashes and timeouts
//!
//! Each permit has a **lease** measured on the database clock. If its holder
//! dies, the slot stays held until the lease expires; then the next claim on
//! that semaphore, or a [`Reaper`](crate::admin::Reaper) / [`reap`](crate::admin::reap), marks it timed out. A holder
//! that releases after being reaped gets [`Error::PermitLost`]: it learns
//! that someone else may have used its slot. While the holder lives, a
//! heartbeat renews the lease (every third of it by default,
//! [`SemaphoreBuilder::heartbeat`]), so leases can be short and work long;
//! [`Permit::lost`] tells the holder when a renewal found the claim reaped
//! or the lease can no longer be guaranteed, and [`Permit::fence`] checks,
//! inside the transaction of a protected write, that the permit still
//! holds. Claims, renewals and releases are durable even under
//! `synchronous_commit = off`, so a database crash never forgets a holder.
//! Each permit proves its claims with a random token (the database keeps its
//! SHA-256): nobody else can release, renew or fence them, and a claim whose
//! reply was lost is released by its token in the background.
//! Dropping a [`Permit`] without releasing it schedules the release in the
//! background (not immediate). A cancelled acquire never leaks a slot: the
//! claim round trip runs in a spawned task that releases what it claimed if
//! the caller has gone.
//!
//! # The mutex
//!
//! A [`Mutex`] is a PostgreSQL advisory lock, keyed exactly as sqlx's
//! `PgAdvisoryLock` keys names. By default it is transaction-scoped
//! ([`Mutex::lock`]): the [`MutexGuard`] owns the transaction, the protected
//! work commits atomically with the release, and a crashed holder's lock
//! dies with its transaction: nothing to expire, nothing to leak.
//! [`Mutex::locking`] sets a lock's options ([`Locking`]): shared mode, a
//! wait bounded by PostgreSQL's `lock_timeout` ([`Error::Timeout`]) or none
//! at all ([`Error::Locked`] when busy), and the scope; a deadlock is
//! [`Error::Deadlock`]. [`Locking::lock_in`] locks inside the caller's
//! transaction, [`Locking::with_lock`] runs a closure under the lock, and
//! [`Locking::lock_session`] holds a lock across transactions on a dedicated
//! connection, and [`SessionGuard::lost`] tells the holder if that connection
//! dies or stops answering; the server ends a silent session by itself
//! (`idle_session_timeout`), and [`Mutex::idle_timeout`] bounds a
//! transaction-scoped guard's dark client the same way.
//!
//! Which to use: a transaction-scoped mutex for database work that should
//! commit with the release; a session lock for leaders and long jobs; a
//! semaphore of capacity 1 when the hold must not pin a connection, needs an
//! audit trail, or runs behind PgBouncer (see
//! [`Client::transaction_pooling`]).
//!
//! # Rate limiters
//!
//! A [`RateLimiter`] limits how many requests *start* per unit of time, per
//! key (a user, an IP), under its [`RatePolicy`]: a token bucket (Stripe's
//! semantics), a fixed window or a sliding window.
//! Each check is one round trip to a SQL function that locks the key,
//! reads the database clock and returns a [`Decision`] (`allowed`,
//! `remaining`, `retry_after`), so concurrent processes never admit more than
//! the limit. Keys are created on first use; [`prune_rate_limits`](crate::admin::prune_rate_limits) (or a
//! [`Reaper`](crate::admin::Reaper) with [`ReaperBuilder::rate_limits`](crate::admin::ReaperBuilder::rate_limits)) deletes keys at rest. With
//! `fail_open(true)`, an unreachable database admits instead of failing.
//! A limiter's limits belong to the database: its first check stores the
//! limits its handle was built with, every process is decided under the
//! stored ones, read inside the same check, and only an operator changes
//! them, per limiter or per key ([`set_rate_limit`](crate::admin::set_rate_limit); a process whose code
//! says otherwise logs one `WARN`). [`RateLimiter::pause`]
//! holds back a key (or [`pause_all`](RateLimiter::pause_all), a limiter)
//! in every process after an upstream's 429, and a [`LimiterSet`] checks
//! several limits at once, charging all or none.
//! Each limiter can also wait ([`RateLimiter::acquire`]): one round trip
//! reserves the permits at the instant the key will admit them, then the
//! caller sleeps until then.
//!
//! # Audit log
//!
//! Finished claims stay in the slot table with `completed_at` or
//! `timed_out_at`; an advisory semaphore's finished permits are written to
//! its log. [`AuditLog`](crate::audit::AuditLog) reads either kind (its answers say which, as a
//! [`SemaphoreKind`](crate::audit::SemaphoreKind)): live holders, a window's history with outcomes and
//! hold times, a summary with p50/p95 hold time, and a
//! [`Report`](crate::audit::Report) (occupancy against capacity, each slot's use, hold times),
//! aggregated by the database at the resolution the caller asks for
//! ([`ReportShape`](crate::audit::ReportShape)) when the window is busy.
//!
//! # Which primitive when
//!
//! | you need | use |
//! |---|---|
//! | at most N callers of an upstream, across processes | [`Semaphore`] of capacity N |
//! | the same for an HTTP service's requests | [`Semaphore`] + `SemaphoreLayer` (feature `tower`) |
//! | one runner of database work that commits with the release | transaction-scoped [`Mutex`] |
//! | a leader, or an hour-long job, that must not pin a transaction | [`Locking::lock_session`] |
//! | exclusivity without pinning a connection, with an audit trail, or behind PgBouncer | [`Semaphore`] of capacity 1 |
//!
//! On a crash: a mutex is freed at once (the server ends the dead
//! transaction or session); a semaphore slot is freed when its lease expires
//! (or an operator runs [`force_release`](crate::admin::force_release)). On a timeout
//! ([`Acquiring::timeout`], [`Locking::timeout`]): both return
//! [`Error::Timeout`], and nothing is left held or queued.
//!
//! # Operating
//!
//! [`semaphores`](crate::admin::semaphores) lists every semaphore, lease or advisory, with its live
//! holders (an advisory one's: the sessions that hold its slots),
//! [`force_release`](crate::admin::force_release) frees a stuck claim, [`set_capacity`](crate::admin::set_capacity)
//! resizes a semaphore, [`reap`](crate::admin::reap) and [`prune_claims`](crate::admin::prune_claims) clean up,
//! [`AuditLog`](crate::audit::AuditLog) reads history; [`rate_limit_settings`](crate::admin::rate_limit_settings), [`set_rate_limit`](crate::admin::set_rate_limit),
//! [`clear_rate_limit`](crate::admin::clear_rate_limit), [`pause_rate_limit`](crate::admin::pause_rate_limit) and [`resume_rate_limit`](crate::admin::resume_rate_limit)
//! manage rate limiters' stored limits and pauses.
//! The `pg-semaphore` binary (crate `pg-semaphore-cli`) does the same from a shell:
//! `pg-semaphore status`, `audit NAME --last 1h`, `release --id N`, ...
//!
//! # Privileges
//!
//! Every function of the schema runs with its owner's rights and a pinned
//! `search_path`: the application's role needs `EXECUTE` on the
//! application's functions and no write privilege on any table; an operator
//! role gets the operator's functions ([`set_capacity`](crate::admin::set_capacity), [`configure`](crate::admin::configure),
//! [`set_queue_order`](crate::admin::set_queue_order), [`set_fairness_weight`](crate::admin::set_fairness_weight), [`clear_queue`](crate::admin::clear_queue),
//! [`force_release`](crate::admin::force_release), [`reap`](crate::admin::reap), [`prune_claims`](crate::admin::prune_claims), [`configure_family`](crate::admin::configure_family),
//! [`set_family_rule`](crate::admin::set_family_rule), [`set_family_tier`](crate::admin::set_family_tier), [`set_rate_limit`](crate::admin::set_rate_limit),
//! [`clear_rate_limit`](crate::admin::clear_rate_limit), [`resume_rate_limit`](crate::admin::resume_rate_limit)). The guide's [operations](crate::guide::operations#privileges) chapter lists the exact grants, and what the
//! application role can and cannot do with them: the SQL functions are the
//! security boundary, not this crate. They check every argument (a refused
//! one is [`Error::InvalidArgument`], naming it), never lock or change a
//! claim whose token the caller does not hold, and bound how long a
//! transaction left open can hold a semaphore's row ([`Error::Stalled`]).
//!
//! # Migrations
//!
//! Call [`migrate`] at start-up from every process. It reads the schema's
//! version first and writes nothing unless migrations are due and this role
//! may apply them, so it also adopts a schema applied another way: with
//! `sqlx migrate run --source migrations --config migrations/sqlx.toml` or
//! `pg-semaphore migrate` (our history, [`MIGRATIONS_TABLE`](crate::schema::MIGRATIONS_TABLE), apart from
//! the application's own), through the application's own sqlx history (our
//! `.sql` files copied into its `migrations/`), or with `refinery_migrate`
//! (feature `refinery`, history in `pgsemaphore.refinery_schema_history`).
//! A schema it cannot use is an [`Error::Schema`] that says what to do
//! ([`SchemaError::NotPermitted`](crate::schema::SchemaError::NotPermitted), [`SchemaError::Outdated`](crate::schema::SchemaError::Outdated),
//! [`SchemaError::TooNew`](crate::schema::SchemaError::TooNew), ...).
//!
//! # Tracing
//!
//! Events go through `tracing`, once per operation and never per poll:
//! mutex lock timeouts (`mutex` field), deadlocks and granted waits; reap
//! counts (`reaped`); operator actions. The guide's
//! [operations](crate::guide::operations#tracing) chapter lists them.
//!
//! # Features
//!
//! - `serde`: `Serialize` for the data users log or ship: [`SemaphoreInfo`](crate::admin::SemaphoreInfo),
//!   [`Holder`](crate::audit::Holder), [`SemaphoreKind`](crate::audit::SemaphoreKind), [`ClaimRecord`](crate::audit::ClaimRecord), [`Outcome`](crate::audit::Outcome), [`Summary`](crate::audit::Summary), [`Report`](crate::audit::Report) and its parts,
//!   [`ReleaseOutcome`](crate::admin::ReleaseOutcome), [`Decision`], [`FamilyInfo`](crate::admin::FamilyInfo) and [`FamilyKeyInfo`](crate::admin::FamilyKeyInfo). Times are RFC 3339 strings,
//!   durations seconds in fields named `*_seconds`, outcomes `snake_case`:
//!   the shapes `pg-semaphore ... --json` prints.
//! - `tower`: `SemaphoreLayer`, a tower layer that limits a service's
//!   requests in flight (fail fast with 503/429, or wait up to a timeout).
//! - `refinery`: `refinery_migrations`, `refinery_runner`, `refinery_migrate`.
//! - `metrics`: records gauges, counters and histograms through the
//!   [`metrics`](https://docs.rs/metrics) facade, for any recorder
//!   (`metrics-exporter-prometheus`, ...): per semaphore, permits held,
//!   waiters, wait and hold times, acquisitions, refusals, timeouts, lost
//!   permits, fail-open admissions; reaped claims; per mutex, wait time,
//!   timeouts, deadlocks and busy refusals; per rate limiter, decisions.
//!   Labels are bounded (names, never a rate limiter key or a holder).
//!   `describe_metrics()` gives each its help text; the guide's
//!   [operations](crate::guide::operations#metrics) chapter lists them.
//!
//! # Where the names are
//!
//! The root holds what an application reaches for: the [`Client`] they
//! are built on, the primitives ([`Semaphore`], [`SemaphoreFamily`], [`AdvisorySemaphore`], [`Mutex`],
//! [`RateLimiter`] with its [`RatePolicy`], [`LimiterSet`]), their builders
//! and options ([`Acquiring`], [`Locking`]), what they hand out ([`Permit`],
//! [`AdvisoryPermit`], [`MutexGuard`], [`SessionGuard`], [`Decision`]),
//! [`Error`] and [`migrate`]. The rest is in modules:
//!
//! | module | holds |
//! |---|---|
//! | [`admin`] | the operator's functions: listing semaphores and families, capacities, force-release, stored rate limits and pauses, the [`Reaper`](crate::admin::Reaper), the xmin [`horizon`](crate::admin::horizon) |
//! | [`audit`] | the audit log's reader ([`AuditLog`](crate::audit::AuditLog)) and its records, summaries and reports, for both kinds of semaphore ([`SemaphoreKind`](crate::audit::SemaphoreKind)) |
//! | [`limits`] | the bounds every argument is checked against, and the builders' defaults |
//! | [`schema`] | the schema's name and version, sqlx's and refinery's migrators, and [`SchemaError`](crate::schema::SchemaError) |
//! | `tower` | (feature `tower`) `SemaphoreLayer`, a tower layer over a [`Semaphore`] |
//!
//! # Source map
//!
//! Each concept is one module, and each reads downwards: a public face,
//! an engine below it, and one SQL function per decision below that (face →
//! engine → SQL). The rules live in SQL; the Rust decides nothing a hostile
//! client could get around.
//!
//! | module | holds |
//! |---|---|
//! | `semaphore` | the lease semaphore's face ([`Semaphore`], [`SemaphoreBuilder`], [`Acquiring`]) |
//! | `semaphore::engine` | every admission statement (claim, release, renew, fence), one SQL function each |
//! | `semaphore::wait`, `semaphore::wake` | waiting for permits; the per-pool `LISTEN` connection, registrations and fallback re-checks |
//! | `semaphore::permit`, `semaphore::lease` | [`Permit`], its release and fence; its heartbeat and what "lost" means |
//! | `semaphore::queue` | tickets of the fair queue |
//! | `semaphore::family` | [`SemaphoreFamily`]: a semaphore per key, each key's handle cached per process |
//! | `semaphore::advisory` | the advisory semaphore ([`AdvisorySemaphore`], [`AdvisoryPermit`]), its dedicated sessions and audit batches |
//! | `mutex` | [`Mutex`]: transaction-scoped and session-scoped advisory locks |
//! | `rate_limit`, `rate_limit::engine` | [`RateLimiter`] and its [`RatePolicy`]; the state a handle shares and the check and reservation statements of each policy, one SQL function each |
//! | `rate_limit::settings`, `rate_limit::set` | stored limits, pauses and the waiters' `LISTEN` for their changes; [`LimiterSet`], several limits in one check |
//! | `reaper`, `admin`, `family_admin`, `audit`, `horizon` | the operator's side: reaping and pruning, listing and force-releasing, families' rules and busiest keys, the audit log, what holds the xmin horizon |
//! | `migrate`, `refinery` | creating, upgrading and adopting the schema |
//! | `db` | how statements reach PostgreSQL: the pool, unnamed statements behind PgBouncer, batches |
//! | `detached` | cancel safety: a round trip that finishes, or is undone, when its caller goes away |
//! | `validate`, `error` | limits and the checks made before sending; [`Error`] and the reading of the database's errors |
//! | `client`, `background`, `fail_open`, `dead_man`, `token` | the [`Client`] and the background work it owns; the fail-open decision; a dedicated session's heartbeat and dead-man switch; the holder's secret token |
//! | `migrations/*.sql` | the schema, one file per concept, each function defined once: its contract opens its body (`docs/sql-api.md` lists the application's, with the file of each, as a versioned interface for clients in any language) |
//!
//! # Glossary
//!
//! - **permit**: what a caller holds after acquiring: a [`Permit`] (one or
//!   more claims of a lease semaphore, ended together) or an
//!   [`AdvisoryPermit`] (one or more advisory-lock slots).
//! - **claim**: one slot taken by one holder. In a lease semaphore it is
//!   one row of `pgsemaphore.slots`, with a lease, whose id is the *claim
//!   id* ([`Permit::id`]); the SQL functions that take claims are named for
//!   them (`pgsemaphore.claim`, `claim_all`, and `advisory_claim`, whose
//!   claims are advisory locks and write no row). The caller's side is
//!   *acquiring*: [`Semaphore::acquire`] and the [`Acquiring`] options
//!   make one call that takes a permit's claims.
//! - **multi-limit permit**: a [`Permit`] of several semaphores claimed
//!   together by one call of `pgsemaphore.claim_all`
//!   ([`Semaphore::acquire_all`]); its claims form a **group**, whose id
//!   (`group_id` in the audit log) is its first claim's id.
//! - **slot**: one unit of a semaphore's capacity, numbered `0..capacity`;
//!   a live claim (or, in an advisory semaphore, an advisory lock) holds one.
//! - **lease**: how long a claim holds its slot without renewal, on the
//!   database clock; the end a renewal moves, and after which a reaper may
//!   take the slot back.
//! - **holder**: the text a claim records as who holds it (the audit log's
//!   "who"); [`Holder`](crate::audit::Holder) is a live claim as an operator lists it.
//! - **token**: the random secret of one permit (16 to 64 bytes; the
//!   database keeps its SHA-256) without which nobody can release, renew or
//!   fence its claims; a waiting process also has a token of its own for its
//!   registrations.
//! - **heartbeat**: the background renewal of a permit's lease, every third
//!   of it by default.
//! - **fence**: a check, inside the caller's transaction, that a permit's
//!   claims still hold, share-locking them until that transaction ends
//!   ([`Permit::fence`]).
//! - **waiter**: a queued acquire's row in `pgsemaphore.waiters` (also, in
//!   the code, an acquire waiting inside a process).
//! - **ticket**: a waiter's id, which its later claims present to prove
//!   their place in the queue.
//! - **fairness key**: the key (a tenant, say) by which queued waiters take
//!   turns ([`Acquiring::fairness_key`]); its **turn** is its place in that
//!   rotation.
//! - **registration**: a row of `pgsemaphore.wakeups` saying that a process
//!   waits on a semaphore, so that releases send a `NOTIFY`.
//! - **wake-up**: that `NOTIFY` on the channel `pgsemaphore`, payload the
//!   semaphore's name: a hint to claim again, never a grant.
//! - **wake-up gate**: a transaction-scoped advisory lock per semaphore
//!   (class `1885828965`) that a registration takes exclusively and a release
//!   tries in shared mode, so that no release misses a waiter registering
//!   at the same time (`pgsemaphore.gate`).
//! - **spell**: one uninterrupted period in which a process has waiters on
//!   a semaphore, numbered, so that the end of an old spell never removes a
//!   newer spell's registration.
//! - **reaper**: what marks claims whose lease ended as timed out: any claim
//!   on the same semaphore, [`reap`](crate::admin::reap), or the background [`Reaper`](crate::admin::Reaper) (which
//!   also prunes history).
//! - **family**: a [`SemaphoreFamily`]: a name plus a **key** (a tenant)
//!   gives one lease semaphore, named `@family/key`, created on first use
//!   with the capacity the operator's **rules** give the key (its own rule,
//!   else its **tier**'s, else the family's default), removed by the reaper
//!   once nothing references it.
//! - **key base**: the first advisory-lock key of an advisory semaphore
//!   (from a hash of its name); slot `s` is the key `key base + s`.
//! - **stripe**: one of an advisory semaphore's 16 waiting keys (`key base +
//!   1048560 + s % 16` for slot `s`), which every waiter holds in shared mode
//!   and a release tries exclusively to learn whether anyone waits.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use pg_semaphore::Semaphore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
//! pg_semaphore::migrate(&pool).await?;
//! let client = pg_semaphore::Client::new(pool);
//!
//! let sem = Semaphore::builder("payments-api", 4).build(&client).await?;
//! let permit = sem.acquiring().timeout(Duration::from_secs(5)).acquire().await?;
//! println!("holding slot {} (claim #{})", permit.slot(), permit.id());
//! // ... call the upstream ...
//! permit.release().await?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod admin;
pub mod audit;
mod background;
mod client;
#[cfg(feature = "dashboard")]
pub mod dashboard;
mod db;
mod dead_man;
mod detached;
mod error;
mod fail_open;
mod family_admin;
mod horizon;
mod metrics;
mod migrate;
mod mutex;
mod outcomes;
mod rate_limit;
mod reaper;
#[cfg(feature = "refinery")]
mod refinery;
mod semaphore;
#[cfg(feature = "serde")]
mod serialize;
mod token;
#[cfg(feature = "tower")]
pub mod tower;
mod validate;

#[cfg(feature = "metrics")]
pub use self::metrics::describe_metrics;
pub use client::Client;
pub use error::{Error, LostReason, Result, WaitedFor};
pub use migrate::migrate;
pub use mutex::{Locking, Mutex, MutexGuard, SessionGuard};
pub use rate_limit::{Decision, LimiterSet, RateLimiter, RateLimiterBuilder, RatePolicy};
pub use semaphore::{
    Acquiring, AdvisoryPermit, AdvisorySemaphore, AdvisorySemaphoreBuilder, Permit, Priority,
    QueueOrder, Semaphore, SemaphoreBuilder, SemaphoreFamily, SemaphoreFamilyBuilder,
};
/// The advisory lock key type, re-exported from sqlx for [`Mutex::with_key`].
pub use sqlx::postgres::PgAdvisoryLockKey;

/// The bounds every argument is checked against (in Rust for a precise
/// error, and again by the SQL functions, which are the security boundary),
/// and the defaults of the builders' settings.
pub mod limits {
    pub use crate::dead_man::DEFAULT_SESSION_HEARTBEAT;
    pub use crate::reaper::DEFAULT_HORIZON_WARNING;
    pub use crate::semaphore::{
        DEFAULT_ADVISORY_CONNECTIONS, DEFAULT_FALLBACK_INTERVAL, DEFAULT_IDLE_AFTER, DEFAULT_LEASE,
    };
    pub use crate::validate::{
        MAX_CAPACITY, MAX_FAIRNESS_KEY_LEN, MAX_FAIRNESS_WEIGHT, MAX_FAMILY_KEY_LEN,
        MAX_FAMILY_NAME_LEN, MAX_HOLDER_LEN, MAX_IDLE_AFTER, MAX_KEY_LEN, MAX_LEASE, MAX_LIMITS,
        MAX_NAME_LEN, MAX_PAUSE, MAX_RATE, MAX_RATE_WAIT, MAX_SEMAPHORES_PER_CLAIM, MAX_TIER_LEN,
        MAX_WINDOW, MIN_LEASE, MIN_WINDOW,
    };
}

/// The schema and its migrations: where the objects live ([`SCHEMA`](crate::schema::SCHEMA)),
/// the version this crate needs ([`SCHEMA_VERSION`](crate::schema::SCHEMA_VERSION)), sqlx's
/// [`migrator`](crate::schema::migrator) over the same files [`migrate`] applies,
/// refinery's (feature `refinery`), and the errors that say why a schema
/// cannot be used ([`SchemaError`](crate::schema::SchemaError), inside [`Error::Schema`]).
pub mod schema {
    pub use crate::error::{MigrationHistory, SchemaError};
    pub use crate::migrate::{MIGRATIONS_TABLE, SCHEMA, SCHEMA_VERSION, migrator};
    #[cfg(feature = "refinery")]
    pub use crate::refinery::{
        REFINERY_TABLE, refinery_migrate, refinery_migrations, refinery_runner,
    };
}

pub mod guide {
    //! The guide, chapter by chapter. The README is the front door (what
    //! pg-semaphore is, a quick start, which primitive for which need);
    //! these chapters hold the rest. Each is a Markdown file under
    //! `docs/guide/` in the repository, and every Rust example in it is
    //! compiled as a doctest.
    //!
    //! | chapter | what it covers |
    //! |---|---|
    //! | [`choosing`] | the [`Client`](crate::Client); the two semaphores (leases in a table, or advisory locks), weighted permits, several limits at once, reserved capacity, the fair queue, `wait_idle`; the [`Mutex`](crate::Mutex) and which lock to use when; the tower layer; the API at a glance, errors and limits |
    //! | [`families`] | per-tenant limits: a semaphore per key, capacities by the operator's rules |
    //! | [`rate_limiting`] | the [`RateLimiter`](crate::RateLimiter): token bucket, fixed and sliding window, waiting, stored limits, pauses, several limits at once |
    //! | [`guarantees`] | what holds on a crash, a timeout, a partition, a failover, and while a long transaction holds the xmin horizon; what was measured |
    //! | [`operations`] | deploying, Cargo features, migrating, roles and grants, PgBouncer, the reaper and the operator's functions, the CLI and its report, tracing, metrics |
    //! | [`sql_api`] | the SQL functions as a versioned interface, for services in other languages |
    //! | [`scaling`] | what one server was measured to do, and what going past one server would take (on paper) |

    #[doc = include_str!("../docs/guide/choosing.md")]
    pub mod choosing {}
    #[doc = include_str!("../docs/guide/families.md")]
    pub mod families {}
    #[doc = include_str!("../docs/guide/rate_limiting.md")]
    pub mod rate_limiting {}
    #[doc = include_str!("../docs/guide/guarantees.md")]
    pub mod guarantees {}
    #[doc = include_str!("../docs/guide/operations.md")]
    pub mod operations {}
    #[doc = include_str!("../docs/guide/sql_api.md")]
    pub mod sql_api {}
    #[doc = include_str!("../docs/guide/scaling.md")]
    pub mod scaling {}
}

/// Compiles the README's Rust examples as doctests, so they stay true to the API.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
