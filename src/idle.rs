//! `wait_idle`: wait until a semaphore has no live holders (seed 004's
//! distributed WaitGroup: `Wait()` on a group whose `Add`/`Done` are claims
//! and releases, in any process).

use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::semaphore::Semaphore;

/// Whether the semaphore has no live, unexpired claim; NULL when it does not
/// exist. A claim whose lease has ended counts as gone (its holder is
/// presumed dead; a reaper or the next claim frees it).
const IDLE: &str = "SELECT NOT EXISTS (SELECT 1 FROM pgsemaphore.slots l \
                     WHERE l.semaphore = s.name \
                       AND l.completed_at IS NULL AND l.timed_out_at IS NULL \
                       AND l.expires_at > clock_timestamp()) \
                    FROM pgsemaphore.semaphores s WHERE s.name = $1";

impl Semaphore {
    /// Waits until the semaphore has no live holders, in any process.
    ///
    /// The distributed counterpart of a WaitGroup's `wait`: start workers
    /// that each hold a permit, then wait for all of them to release. Returns
    /// at once if nobody holds a permit. A holder whose lease has ended
    /// counts as gone.
    ///
    /// Waiting holds no pooled connection: the task re-checks (one round
    /// trip) when a release anywhere notifies this semaphore, or every
    /// [`fallback_interval`](crate::SemaphoreBuilder::fallback_interval) in
    /// case a notification is lost. It never takes a wake-up meant for an
    /// acquire.
    ///
    /// ```no_run
    /// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), pg_semaphore::Error> {
    /// // ... workers in many processes hold permits of `sem` while they work ...
    /// sem.wait_idle().await?;
    /// println!("every worker has finished");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::SemaphoreNotFound`], [`Error::MigrationsMissing`], [`Error::Database`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only reads; dropping the future unregisters it.
    pub async fn wait_idle(&self) -> Result<()> {
        let inner = &self.inner;
        let listener = &inner.listener;
        if !listener.is_ready() {
            listener.start(inner.fallback, !inner.pooled).await;
        }
        let mut watch = listener.watch(&inner.name, inner.fallback);
        loop {
            // Mark wake-ups seen *before* checking, so a release that lands
            // between the check and the wait still wakes this task.
            watch.seen();
            if self.is_idle().await? {
                return Ok(());
            }
            watch.changed().await;
        }
    }

    /// As [`wait_idle`](Self::wait_idle), giving up after `timeout`.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when holders remain after `timeout`; as
    /// [`wait_idle`](Self::wait_idle).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`wait_idle`](Self::wait_idle).
    pub async fn wait_idle_timeout(&self, timeout: Duration) -> Result<()> {
        let Some(deadline) = Instant::now().checked_add(timeout) else {
            return self.wait_idle().await;
        };
        match tokio::time::timeout_at(deadline, self.wait_idle()).await {
            Ok(result) => result,
            Err(_elapsed) => Err(Error::Timeout {
                name: format!("semaphore {:?} to be idle", self.inner.name),
                timeout,
            }),
        }
    }

    async fn is_idle(&self) -> Result<bool> {
        let inner = &self.inner;
        let idle: Option<bool> = on_pool!(inner.pool, inner.pooled, |conn| {
            sqlx::query_scalar(IDLE)
                .bind(&inner.name)
                .persistent(!inner.pooled)
                .fetch_optional(conn)
        })
        .await?;
        idle.ok_or_else(|| Error::SemaphoreNotFound {
            semaphore: inner.name.clone(),
        })
    }
}
