//! [`AdvisoryPermit`]: slots of an advisory semaphore, held as advisory
//! locks by one of the process's dedicated sessions.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Utc};

use crate::detached::detached;
use crate::error::{Error, LostReason, Result};
use crate::metrics::Held;

use super::AdvisoryCore;
use super::audit::{Ending, Record};
use super::session::Session;

/// Held slots of an [`AdvisorySemaphore`](crate::AdvisorySemaphore): one,
/// or `n` for [`acquire_many`](crate::AdvisorySemaphore::acquire_many).
///
/// The slots are session-level advisory locks held by one of this
/// process's dedicated connections: nothing was written to claim them, and
/// nothing is written to release them. Release with
/// [`release`](AdvisoryPermit::release). **Dropping a permit releases it in
/// the background: not immediate.** If the process dies, its connections
/// close and the server frees the slots at once; if its link is cut, the
/// server ends the session (and frees the slots) after three
/// [heartbeats](crate::Client::advisory_heartbeat) of silence,
/// and the holder is told ([`lost`](AdvisoryPermit::lost)) within about
/// two, first.
///
/// ```no_run
/// # async fn run(sem: pg_semaphore::AdvisorySemaphore) -> Result<(), Box<dyn std::error::Error>> {
/// let permit = sem.acquire().await?;
/// tokio::select! {
///     () = async { /* ... call the upstream ... */ } => permit.release().await?,
///     reason = permit.lost() => eprintln!("stopped: permit lost ({reason})"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[must_use = "dropping a permit releases it in the background at once; hold it while you work"]
pub struct AdvisoryPermit {
    core: Arc<AdvisoryCore>,
    session: Arc<Session>,
    slots: Vec<u32>,
    acquired_at: DateTime<Utc>,
    /// When it was acquired on this process's monotonic clock (the audit
    /// log's `ended_at` is `acquired_at` plus the hold measured here).
    since: Instant,
    metadata: Option<serde_json::Value>,
    released: bool,
    _held: Held,
}

impl fmt::Debug for AdvisoryPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdvisoryPermit")
            .field("semaphore", &self.core.name)
            .field("slots", &self.slots)
            .field("acquired_at", &self.acquired_at)
            .field("backend_pid", &self.session.pid())
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl AdvisoryPermit {
    pub(super) fn new(
        core: &Arc<AdvisoryCore>,
        session: Arc<Session>,
        slots: Vec<u32>,
        acquired_at: DateTime<Utc>,
        metadata: Option<serde_json::Value>,
    ) -> AdvisoryPermit {
        session.held();
        AdvisoryPermit {
            _held: core.metrics.acquired(slots.len()),
            core: core.clone(),
            session,
            slots,
            acquired_at,
            since: Instant::now(),
            metadata,
            released: false,
        }
    }

    /// The slot held, in `0..capacity` (a weighted permit's lowest).
    pub fn slot(&self) -> u32 {
        self.slots.first().copied().unwrap_or(0)
    }

    /// Every slot this permit holds, lowest first.
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }

    /// How many slots this permit holds.
    pub fn num_permits(&self) -> u32 {
        self.slots.len() as u32
    }

    /// The name of the semaphore this permit belongs to.
    pub fn semaphore_name(&self) -> &str {
        &self.core.name
    }

    /// When the slots were claimed (database clock).
    pub fn acquired_at(&self) -> DateTime<Utc> {
        self.acquired_at
    }

    /// The PostgreSQL backend that holds the slots' locks (`pg_locks.pid`).
    pub fn backend_pid(&self) -> i32 {
        self.session.pid()
    }

    /// Whether the permit is known to be lost: its session's connection
    /// died or stopped answering. Checked every heartbeat; `false` does not
    /// prove the slots are still held.
    pub fn is_lost(&self) -> bool {
        self.session.lost_reason().is_some()
    }

    /// Resolves when the permit is lost ([`LostReason::ConnectionLost`]):
    /// its session's connection died (a database restart or failover, the
    /// backend terminated) or stopped answering within a heartbeat (a
    /// partition), told within two and a half heartbeats, before the server
    /// frees the slots (three). Never resolves otherwise. The future is
    /// `'static`: hand it to the task doing the protected work.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only watches.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.session.lost()
    }

    /// Releases the slots (unlocks them on their session, one round trip)
    /// and wakes waiters of other processes if any wait.
    ///
    /// # Errors
    ///
    /// [`Error::PermitLost`] ([`LostReason::ConnectionLost`]) when the
    /// session was lost: the server has freed the slots, or will within
    /// three heartbeats, and someone else may hold them by now.
    /// [`Error::Database`] for another error of the release statement.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the session runs the release whatever happens to this
    /// future.
    pub async fn release(mut self) -> Result<()> {
        self.released = true;
        self.session.freed();
        let slots = std::mem::take(&mut self.slots);
        let (core, session, freed) = (self.core.clone(), self.session.clone(), slots.clone());
        let result = detached(move |_| async move {
            let result = session.release(&core.name, core.key_base, &freed).await;
            core.wakeups.wake_local(&core.name);
            result
        })
        .await;
        let lost = self.session.lost_reason();
        self.audit(slots, lost, Ending::Released);
        match (result, lost) {
            (_, Some(reason)) => {
                self.core.metrics.lost(reason);
                Err(self.lost_error(reason))
            }
            (Ok(()), None) => Ok(()),
            (Err(error), None) => Err(error),
        }
    }

    fn lost_error(&self, reason: LostReason) -> Error {
        Error::PermitLost {
            semaphore: self.core.name.clone(),
            id: 0,
            reason,
        }
    }

    /// Records the permit's end in the audit log: [`Ending::Lost`] when its
    /// session was `lost`, else `ending`.
    fn audit(&self, slots: Vec<u32>, lost: Option<LostReason>, ending: Ending) {
        let ending = if lost.is_some() { Ending::Lost } else { ending };
        if let Some(writer) = &self.core.audit {
            let held = chrono::Duration::from_std(self.since.elapsed()).unwrap_or_default();
            writer.record(Record {
                semaphore: self.core.name.clone(),
                slots,
                holder: self.core.holder.clone(),
                metadata: self.metadata.clone(),
                acquired_at: self.acquired_at,
                ended_at: self.acquired_at + held,
                ending,
            });
        }
    }
}

impl Drop for AdvisoryPermit {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.session.freed();
        let slots = std::mem::take(&mut self.slots);
        let lost = self.session.lost_reason();
        match (lost, tokio::runtime::Handle::try_current()) {
            (Some(reason), _) => self.core.metrics.lost(reason),
            // Wake this process's waiters once the slots are free.
            (None, Ok(runtime)) => {
                let (core, session, freed) =
                    (self.core.clone(), self.session.clone(), slots.clone());
                runtime.spawn(async move {
                    if let Err(error) = session.release(&core.name, core.key_base, &freed).await {
                        tracing::debug!(semaphore = %core.name, %error, "background release of a dropped advisory permit failed");
                    }
                    core.wakeups.wake_local(&core.name);
                });
            }
            // No runtime: the slots stay held until the session ends.
            (None, Err(_)) => tracing::warn!(
                semaphore = %self.core.name,
                "advisory permit dropped outside a tokio runtime: its slots are freed when its session ends"
            ),
        }
        self.audit(slots, lost, Ending::Dropped);
    }
}
