//! The reaper: frees slots whose lease ended ([`reap`]), deletes finished
//! claims past a retention ([`prune_claims`], driven by the history index so that
//! it reads next to nothing when nothing is old enough), and runs both (and
//! rate-limit pruning) in a background task ([`Reaper`]) that stops with its
//! handle. Claims reap their own semaphore anyway, and waiters look again
//! when a lease ends: a reaper frees slots for semaphores nobody is claiming
//! and keeps the audit log bounded. Operator functions: under the
//! [guide's grants](crate::guide::operations#privileges) they need the operator role. Each round the reaper also looks at
//! the database's xmin horizon ([`horizon`](crate::admin::horizon)) and warns when
//! one session, slot or prepared transaction has held it too long. Each
//! [`reap`] also examines the next 1,000 keys of
//! each [semaphore family](crate::SemaphoreFamily) (in turn, so a round's
//! work is bounded however many keys exist) and removes those that nothing
//! references any more (no claim left in the audit log, no waiter) for
//! their family's idle time; a retention ([`ReaperBuilder::retention`])
//! prunes the history that keeps a used key.

use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinHandle;

use crate::db::Db;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::horizon::{self, HorizonHolder};
use crate::metrics;
use crate::validate;

/// Marks every expired live slot timed out and notifies its semaphore's waiters.
const REAP: &str = "SELECT pgsemaphore.reap()";

/// Frees every slot, of every semaphore, whose lease has expired: marks it
/// `timed_out_at` (the row stays in the audit log) and wakes waiters.
/// Returns how many slots were reaped. Also removes the idle keys among
/// the next 1,000 of each [semaphore family](crate::SemaphoreFamily) (not
/// counted).
///
/// Claims already reap their own semaphore before claiming, so a crashed
/// holder never blocks a claimer beyond its lease; a [`Reaper`] (or a cron
/// job calling this) also keeps [`AuditLog::holders`](crate::audit::AuditLog::holders)
/// and waiting acquires in other processes up to date.
///
/// # Errors
///
/// [`Error::Schema`], [`Error::Database`].
///
/// # Cancel safety
///
/// One statement: cancelling either reaps or not.
pub async fn reap(pool: &PgPool) -> Result<u64> {
    // Unnamed, in a transaction of its own, so that it also works through PgBouncer.
    let db = Db::new(pool, true);
    let (reaped,): (i64,) = db.fetch_one(db.query_as(REAP)).await?;
    if reaped > 0 {
        tracing::info!(reaped, "reaped expired pg-semaphore slots");
    }
    metrics::reaped(reaped as u64);
    Ok(reaped as u64)
}

/// Deletes one batch of finished claims older than the cutoff.
const PRUNE: &str = "SELECT pgsemaphore.prune(p_older_than => $1, p_batch => $2)";

/// Reclaims the space of pruned rows now rather than at autovacuum's next
/// visit (by default up to a minute away, while a busy semaphore churns
/// thousands of rows a second). Only the table owner may vacuum it; anyone
/// else gets a warning from PostgreSQL, not an error.
const VACUUM: &str = "VACUUM (SKIP_LOCKED) pgsemaphore.slots";

/// Rows deleted per prune statement: short transactions, even for a backlog.
const PRUNE_BATCH: i32 = 5_000;

/// Deletes finished claims (completed or timed out) that ended more than
/// `older_than` ago, of every semaphore, the advisory semaphores'
/// finished permits (`pgsemaphore.advisory_claims`) that ended as long ago,
/// and the outcome counters' minutes that ended as long ago
/// (`pgsemaphore.outcomes`, [`outcomes`](crate::admin::outcomes)), and
/// returns how many rows of the three. Live claims are never touched. This
/// bounds both audit logs and the counters; a [`Reaper`] with a
/// [`retention`](ReaperBuilder::retention) calls it every round.
///
/// Works in batches of short transactions, oldest claims first, so it can
/// run while claims go on.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// use std::time::Duration;
/// // Keep a week of history.
/// let deleted = pg_semaphore::admin::prune_claims(&pool, Duration::from_secs(7 * 24 * 3600)).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a retention above 100 years,
/// [`Error::Schema`], [`Error::Database`].
///
/// # Cancel safety
///
/// Each batch commits on its own: cancelling keeps the batches already
/// deleted and deletes nothing more.
pub async fn prune_claims(pool: &PgPool, older_than: Duration) -> Result<u64> {
    let interval = validate::age("older_than", older_than)?;
    let mut total = 0u64;
    loop {
        let db = Db::new(pool, true);
        let (deleted,): (i64,) = db
            .fetch_one(db.query_as(PRUNE).bind(interval).bind(PRUNE_BATCH))
            .await?;
        total += deleted.max(0) as u64;
        if deleted < i64::from(PRUNE_BATCH) {
            break;
        }
    }
    if total > 0 {
        tracing::debug!(deleted = total, "pruned finished pg-semaphore claims");
    }
    Ok(total)
}

/// A background task that calls [`reap`] every interval, and
/// [`prune_claims`] too when a retention is set.
///
/// It stops when the handle is dropped (the task is aborted) or, gracefully,
/// on [`shutdown`](Reaper::shutdown). Errors are logged with `tracing` and the
/// task keeps going, so a database restart does not stop it.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// let reaper = pg_semaphore::admin::Reaper::spawn(&pool, Duration::from_secs(10))?;
/// // ... serve ...
/// reaper.shutdown().await;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "the reaper stops when this handle is dropped"]
pub struct Reaper {
    task: Option<JoinHandle<()>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

/// Configures a [`Reaper`]; made by [`Reaper::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `.spawn(&pool)`"]
pub struct ReaperBuilder {
    interval: Duration,
    retention: Option<Duration>,
    rate_limits: Option<Duration>,
    horizon_warning: Option<Duration>,
}

/// How long one holder may hold the xmin horizon before the [`Reaper`] warns
/// (see [`ReaperBuilder::horizon_warning`]).
pub const DEFAULT_HORIZON_WARNING: Duration = Duration::from_secs(300);

impl ReaperBuilder {
    /// How often to reap (default 10 s).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Also delete finished claims that ended more than `retention` ago, each
    /// round (see [`prune_claims`]), then `VACUUM` the slot table so the space is
    /// reused at once (when this role owns the table; otherwise autovacuum
    /// does it later). Default: keep the audit log forever.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Also delete rate limiter keys at rest for `idle_for` or longer, each
    /// round (see [`prune_rate_limits`](crate::admin::prune_rate_limits)). Default:
    /// rate limiter keys are never deleted.
    pub fn rate_limits(mut self, idle_for: Duration) -> Self {
        self.rate_limits = Some(idle_for);
        self
    }

    /// Warn (`tracing` WARN, target `pg_semaphore::reaper`) when one session,
    /// replication slot or prepared transaction has held back VACUUM's xmin
    /// horizon for longer than `after` (default [`DEFAULT_HORIZON_WARNING`],
    /// five minutes): while it does, every row the lease semaphore updates
    /// leaves a version nobody can remove, and it slows down by the minute. The warning names the holder (pid, user,
    /// application, state) and repeats at most once per `after` while the
    /// same holder stays. `None` turns the check off.
    ///
    /// The reaper measures how long a holder has held the horizon itself
    /// (from the rounds that saw it), so the warning works without the
    /// `pg_read_all_stats` role; with it, the server's own start time counts
    /// from the first round. With the `metrics` feature, every round records
    /// `pg_semaphore_horizon_held_seconds` and `pg_semaphore_horizon_age_xids`.
    pub fn horizon_warning(mut self, after: Option<Duration>) -> Self {
        self.horizon_warning = after;
        self
    }

    /// Spawns the reaper on the current tokio runtime; it runs at once and
    /// then every interval.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the interval is zero, or the retention
    /// or the rate limiters' `idle_for` above 100 years.
    ///
    /// # Panics
    ///
    /// Like [`tokio::spawn`], when called outside a tokio runtime.
    pub fn spawn(self, pool: &PgPool) -> Result<Reaper> {
        validate::nonzero("interval", self.interval)?;
        if let Some(retention) = self.retention {
            validate::age("retention", retention)?;
        }
        if let Some(idle_for) = self.rate_limits {
            validate::age("idle_for", idle_for)?;
        }
        Ok(Reaper::start(pool.clone(), self))
    }
}

impl Reaper {
    /// A reaper with options: interval and retention.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
    /// use std::time::Duration;
    /// let reaper = pg_semaphore::admin::Reaper::builder()
    ///     .interval(Duration::from_secs(5))
    ///     .retention(Duration::from_secs(30 * 24 * 3600)) // keep 30 days of history
    ///     .spawn(&pool)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder() -> ReaperBuilder {
        ReaperBuilder {
            interval: Duration::from_secs(10),
            retention: None,
            rate_limits: None,
            horizon_warning: Some(DEFAULT_HORIZON_WARNING),
        }
    }

    /// Spawns a reaper on the current tokio runtime that reaps at once and then
    /// every `interval`, keeping the audit log forever. Shortcut for
    /// `Reaper::builder().interval(interval).spawn(pool)`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `interval` is zero.
    ///
    /// # Panics
    ///
    /// Like [`tokio::spawn`], when called outside a tokio runtime.
    pub fn spawn(pool: &PgPool, interval: Duration) -> Result<Reaper> {
        Reaper::builder().interval(interval).spawn(pool)
    }

    fn start(pool: PgPool, options: ReaperBuilder) -> Reaper {
        let ReaperBuilder {
            interval,
            retention,
            rate_limits,
            horizon_warning,
        } = options;
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        // Every event of the background reaper (counts, errors) comes with its settings.
        let span = tracing::info_span!(
            "pg_semaphore.reaper",
            interval_ms = interval.as_millis() as u64,
            retention_s = retention.map(|r| r.as_secs()),
        );
        let task = tokio::spawn(tracing::Instrument::instrument(
            async move {
                let mut watch = horizon::Watch::default();
                let mut ticker = tokio::time::interval(interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = &mut stopped => return,
                        _ = ticker.tick() => {}
                    }
                    // Finish a round in progress before honouring shutdown.
                    if let Err(error) = reap(&pool).await {
                        tracing::warn!(%error, "pg-semaphore reaper failed; retrying next interval");
                    }
                    if let Some(retention) = retention {
                        match prune_claims(&pool, retention).await {
                            Ok(0) => {}
                            Ok(_) => {
                                // Outside a transaction: VACUUM cannot run in one.
                                if let Err(error) = sqlx::raw_sql(VACUUM).execute(&pool).await {
                                    tracing::debug!(%error, "vacuuming pgsemaphore.slots after pruning failed");
                                }
                            }
                            Err(error) => {
                                tracing::warn!(%error, "pg-semaphore prune failed; retrying next interval")
                            }
                        }
                    }
                    if let Some(idle_for) = rate_limits
                        && let Err(error) = crate::admin::prune_rate_limits(&pool, idle_for).await
                    {
                        tracing::warn!(%error, "pruning rate limiter keys failed; retrying next interval");
                    }
                    watch_horizon(&pool, &mut watch, horizon_warning).await;
                }
            },
            span,
        ));
        Reaper {
            task: Some(task),
            stop: Some(stop),
        }
    }

    /// Stops the reaper after the reap in progress, if any, and waits for it.
    ///
    /// # Cancel safety
    ///
    /// If cancelled, the reaper still stops once its reap in progress ends.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

/// One round's look at the xmin horizon: the metrics, and a warning when
/// the same holder has held it longer than `warn_after`.
async fn watch_horizon(pool: &PgPool, watch: &mut horizon::Watch, warn_after: Option<Duration>) {
    let holder = match horizon::horizon(pool).await {
        Ok(holder) => holder,
        Err(error) => {
            tracing::debug!(%error, "reading the xmin horizon failed");
            return;
        }
    };
    let Some(holder) = holder else {
        watch.clear();
        metrics::horizon(Duration::ZERO, 0);
        return;
    };
    let held_for = watch.observe(&holder);
    metrics::horizon(held_for, holder.age_xids);
    if let Some(after) = warn_after
        && held_for >= after
        && watch.should_warn(after)
    {
        warn_horizon(&holder, held_for);
    }
}

fn warn_horizon(holder: &HorizonHolder, held_for: Duration) {
    tracing::warn!(
        kind = ?holder.kind,
        pid = holder.pid,
        user = holder.user.as_deref(),
        application = holder.application_name.as_deref(),
        state = holder.state.as_deref(),
        name = holder.name.as_deref(),
        held_for_s = held_for.as_secs(),
        age_xids = holder.age_xids,
        "VACUUM has been held back for {} s by {}: the lease semaphore slows down until it \
         ends (pg-semaphore doctor names it; see the guide, docs/guide/guarantees.md, \"A held xmin horizon\")",
        held_for.as_secs(),
        holder,
    );
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
