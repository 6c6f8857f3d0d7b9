use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};

/// Marks every expired live slot timed out and notifies its semaphore's waiters.
const REAP: &str = "SELECT pgsemaphore.reap()";

/// Frees every slot, of every semaphore, whose lease has expired: marks it
/// `timed_out_at` (the row stays in the audit log) and wakes waiters.
/// Returns how many slots were reaped.
///
/// Claims already reap their own semaphore before claiming, so a crashed
/// holder never blocks a claimer beyond its lease; a [`Reaper`] (or a cron
/// job calling this) also keeps [`AuditLog::holders`](crate::AuditLog::holders)
/// and waiting acquires in other processes up to date.
///
/// # Errors
///
/// [`Error::MigrationsMissing`], [`Error::Database`].
///
/// # Cancel safety
///
/// One statement: cancelling either reaps or not.
pub async fn reap(pool: &PgPool) -> Result<u64> {
    // Unnamed, in a transaction of its own, so that it also works through PgBouncer.
    let reaped: i64 = on_pool!(pool, true, |conn| {
        sqlx::query_scalar(REAP).persistent(false).fetch_one(conn)
    })
    .await?;
    if reaped > 0 {
        tracing::info!(reaped, "reaped expired pg-semaphore slots");
    }
    Ok(reaped as u64)
}

/// A background task that calls [`reap`] every interval.
///
/// It stops when the handle is dropped (the task is aborted) or, gracefully,
/// on [`shutdown`](Reaper::shutdown). Errors are logged with `tracing` and the
/// task keeps going, so a database restart does not stop it.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// let reaper = pg_semaphore::Reaper::spawn(&pool, Duration::from_secs(10))?;
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

impl Reaper {
    /// Spawns a reaper on the current tokio runtime that reaps at once and then
    /// every `interval`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `interval` is zero.
    ///
    /// # Panics
    ///
    /// Like [`tokio::spawn`], when called outside a tokio runtime.
    pub fn spawn(pool: &PgPool, interval: Duration) -> Result<Reaper> {
        if interval.is_zero() {
            return Err(Error::invalid("interval", "must be greater than zero"));
        }
        let pool = pool.clone();
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = &mut stopped => return,
                    _ = ticker.tick() => {}
                }
                // Finish a reap in progress before honouring shutdown.
                if let Err(error) = reap(&pool).await {
                    tracing::warn!(%error, "pg-semaphore reaper failed; retrying next interval");
                }
            }
        });
        Ok(Reaper {
            task: Some(task),
            stop: Some(stop),
        })
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

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
