//! [`Permit`]: one or more held slots of a semaphore, with their lease, the
//! "lost" signal, the fence for protected writes, and the release (explicit,
//! or scheduled by `Drop`).

use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Transaction};

use crate::detached::detached;
use crate::error::{Error, LostReason, Result};
use crate::metrics::Held;
use crate::token::Token;

use super::engine::{self, Admission, Attempt, Claimed, Core, Ended, Several};
use super::lease::Lease;

/// Held slots of a [`Semaphore`](crate::Semaphore): one, or `n` for
/// [`acquire_many`](crate::Semaphore::acquire_many), or the slots of
/// several semaphores claimed together by
/// [`acquire_all`](crate::Semaphore::acquire_all) (one token, one lease,
/// one heartbeat, one release for all of them).
///
/// Release it with [`release`](Permit::release), which reports whether the
/// slots were still held. **Dropping a permit without releasing it schedules
/// the release on the tokio runtime: it is not immediate**, and if no runtime
/// is available (or the process dies) the slots are freed when the lease
/// expires and a reaper or the next claim notices.
///
/// While a permit is held, its [heartbeat](crate::SemaphoreBuilder::heartbeat)
/// renews the lease: a permit leaked with [`std::mem::forget`] (or kept
/// alive by a hung task) therefore holds its slot for as long as the process
/// lives. See [`lost`](Permit::lost) for how a holder learns it lost the slot.
///
/// Each permit carries a secret token (16 random bytes; the database keeps
/// only its SHA-256): only this permit can release, renew or fence its
/// claims; an operator's [`force_release`](crate::admin::force_release) can end them.
///
/// ```no_run
/// # async fn run(sem: pg_semaphore::Semaphore) -> Result<(), Box<dyn std::error::Error>> {
/// let permit = sem.acquire().await?;
/// println!(
///     "claim {} holds slot {} of {:?} since {} (lease granted until {})",
///     permit.id(),   // strictly increasing: a fencing token
///     permit.slot(), // 0..capacity
///     permit.semaphore_name(),
///     permit.acquired_at(),
///     permit.expires_at(),
/// );
/// permit.release().await?; // Err(PermitLost) if it was reaped meanwhile
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[must_use = "dropping a permit releases it in the background at once; hold it while you work"]
pub struct Permit {
    /// The semaphore (of a multi-limit permit: the first in the canonical order).
    core: Arc<Core>,
    /// The other semaphores of a multi-limit permit, in the canonical
    /// order; empty for a permit of one semaphore.
    others: Vec<Arc<Core>>,
    /// (id, slot) of every claim, lowest id first. Empty for an unchecked permit.
    claims: Vec<(i64, u32)>,
    /// The semaphore of each claim of a multi-limit permit, in the order of
    /// `claims`; empty for a permit of one semaphore.
    of: Vec<String>,
    acquired_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    token: Token,
    /// Slots still free right after the claim (a waiter passes its turn on).
    pub(crate) free_after: u32,
    released: bool,
    lease: Lease,
    /// In the held gauge until dropped (one per semaphore); none for an
    /// unchecked permit.
    _held: Vec<Held>,
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("semaphores", &self.semaphore_names())
            .field("id", &self.id())
            .field("slot", &self.slot())
            .field("permits", &self.num_permits())
            .field("acquired_at", &self.acquired_at)
            .field("expires_at", &self.expires_at)
            .field("heartbeat", &self.lease.has_heartbeat())
            .field("unchecked", &self.is_unchecked())
            .finish()
    }
}

impl Permit {
    /// One claim round trip, cancel-safe by construction: it runs in a
    /// spawned task that turns what it claimed into a permit, so that if the
    /// caller has gone by then, the permit is dropped there, which releases it.
    pub(crate) async fn claim(
        core: &Arc<Core>,
        attempt: &Attempt,
        ticket: Option<(i64, Token)>,
    ) -> Result<Admission<Permit>> {
        let (core, attempt) = (core.clone(), attempt.clone());
        detached(move |_| async move {
            let ticket = ticket.as_ref().map(|(id, token)| (*id, token));
            let claim = engine::claim(&core, &attempt, ticket).await?;
            Ok(claim.map(|claimed| {
                let permit = Permit::new(&core, claimed);
                tracing::debug!(semaphore = %core.name, ids = ?permit.ids(), "permit acquired");
                permit
            }))
        })
        .await
    }

    /// One multi-limit claim round trip (`pgsemaphore.claim_all`),
    /// cancel-safe as [`claim`](Self::claim). Refused, it names the
    /// semaphore that refused.
    pub(crate) async fn claim_all(
        several: &Several,
        holder: &str,
        metadata: Option<&serde_json::Value>,
    ) -> Result<(Admission<Permit>, Option<String>)> {
        let (several, holder, metadata) = (several.clone(), holder.to_owned(), metadata.cloned());
        detached(move |_| async move {
            let (claim, refused_by) =
                engine::claim_all(&several, &holder, metadata.as_ref()).await?;
            let claim = claim.map(|claimed| {
                let mut permit = Permit::new(several.lead(), claimed);
                permit.others = several.members[1..]
                    .iter()
                    .map(|(core, _)| core.clone())
                    .collect();
                permit._held = permit.held_by_semaphore();
                tracing::debug!(semaphores = ?permit.semaphore_names(), ids = ?permit.ids(), "multi-limit permit acquired");
                permit
            });
            Ok((claim, refused_by))
        })
        .await
    }

    /// The held-gauge guards of a multi-limit permit: one per semaphore,
    /// counting its claims.
    fn held_by_semaphore(&self) -> Vec<Held> {
        std::iter::once(&self.core)
            .chain(&self.others)
            .map(|core| {
                let count = self.of.iter().filter(|name| **name == core.name).count();
                core.metrics.acquired(count)
            })
            .collect()
    }

    /// A permit for claims the database just made; starts renewing their
    /// lease if the semaphore has a heartbeat.
    fn new(core: &Arc<Core>, claimed: Claimed) -> Permit {
        // The lease as the database applied it (the claim's, or the
        // semaphore's default as stored when the claim ran).
        let lease = (claimed.expires_at - claimed.acquired_at)
            .to_std()
            .unwrap_or(core.lease);
        let ids = claimed.claims.iter().map(|&(id, _)| id).collect();
        let lease = Lease::start(
            core,
            ids,
            claimed.token.clone(),
            claimed.sent,
            lease,
            core.heartbeat.interval(lease),
        );
        let held = if claimed.semaphores.is_empty() {
            vec![core.metrics.acquired(claimed.claims.len())]
        } else {
            Vec::new()
        };
        Permit {
            core: core.clone(),
            others: Vec::new(),
            _held: held,
            of: claimed.semaphores,
            claims: claimed.claims,
            acquired_at: claimed.acquired_at,
            expires_at: claimed.expires_at,
            token: claimed.token,
            free_after: claimed.free,
            released: false,
            lease,
        }
    }

    /// A permit admitted without the database (fail-open): holds no slot.
    pub(crate) fn unchecked(core: &Arc<Core>) -> Permit {
        let now = Utc::now();
        let lease = chrono::Duration::from_std(core.lease).unwrap_or(chrono::Duration::MAX);
        Permit {
            core: core.clone(),
            others: Vec::new(),
            of: Vec::new(),
            claims: Vec::new(),
            acquired_at: now,
            expires_at: now
                .checked_add_signed(lease)
                .unwrap_or(DateTime::<Utc>::MAX_UTC),
            token: Token::new(),
            free_after: 0,
            released: false,
            lease: Lease::unchecked(),
            _held: Vec::new(),
        }
    }

    /// The claim's id: unique and strictly increasing across the database
    /// (a `bigint` identity, which never wraps), usable as a fencing token.
    /// Not across a failover to an *asynchronous* standby, which may not have
    /// seen the latest ids and hands them out again (see the guide's
    /// [high availability](crate::guide::guarantees#high-availability)); with synchronous replication it stays one.
    /// A weighted permit holds several claims made in one statement: this is
    /// the lowest of their ids, and it is still greater than every id of any
    /// claim on this semaphore made before it. A
    /// [multi-limit](crate::Semaphore::acquire_all) permit's claims were
    /// made one semaphore after the other: each id is a fencing token on its
    /// own semaphore only, and this one (the first semaphore's) is not one
    /// on the others, whose earlier claims may hold larger ids. `0` for an
    /// [unchecked](Self::is_unchecked) permit.
    pub fn id(&self) -> i64 {
        self.claims.first().map_or(0, |&(id, _)| id)
    }

    /// The ids of every claim this permit holds, lowest (= [`id`](Self::id)) first.
    pub fn ids(&self) -> Vec<i64> {
        self.claims.iter().map(|&(id, _)| id).collect()
    }

    /// The slot number held, in `0..capacity` (a weighted permit's first claim's).
    pub fn slot(&self) -> u32 {
        self.claims.first().map_or(0, |&(_, slot)| slot)
    }

    /// Every slot number this permit holds, in the order of [`ids`](Self::ids).
    pub fn slots(&self) -> Vec<u32> {
        self.claims.iter().map(|&(_, slot)| slot).collect()
    }

    /// How many slots this permit holds: 1, or `n` for
    /// [`acquire_many(n)`](crate::Semaphore::acquire_many).
    pub fn num_permits(&self) -> u32 {
        self.claims.len().max(1) as u32
    }

    /// The name of the semaphore this permit belongs to (of a
    /// [multi-limit](crate::Semaphore::acquire_all) permit: the first of
    /// [`semaphore_names`](Self::semaphore_names)).
    pub fn semaphore_name(&self) -> &str {
        &self.core.name
    }

    /// The names of every semaphore this permit holds slots of: one, or,
    /// for a [multi-limit](crate::Semaphore::acquire_all) permit, each
    /// semaphore it claimed, in byte order of their names (the order the
    /// database claimed them in, and the order of [`ids`](Self::ids):
    /// the first semaphore's claims first).
    pub fn semaphore_names(&self) -> Vec<&str> {
        std::iter::once(self.core.name.as_str())
            .chain(self.others.iter().map(|core| core.name.as_str()))
            .collect()
    }

    /// Whether this permit spans several semaphores (a multi-limit permit).
    fn is_several(&self) -> bool {
        !self.others.is_empty()
    }

    /// Records a lost permit in every semaphore's metrics.
    fn count_lost(&self, reason: LostReason) {
        for core in std::iter::once(&self.core).chain(&self.others) {
            core.metrics.lost(reason);
        }
    }

    /// When the slot was claimed (database clock).
    pub fn acquired_at(&self) -> DateTime<Utc> {
        self.acquired_at
    }

    /// When the lease ended as granted (database clock): from then on a
    /// reaper, or any claim on this semaphore, may free the slot, unless a
    /// [heartbeat](crate::SemaphoreBuilder::heartbeat) has renewed it
    /// meanwhile (renewals move the lease on the database, not this value).
    pub fn expires_at(&self) -> DateTime<Utc> {
        self.expires_at
    }

    /// Whether this permit was admitted without the database because it was
    /// unreachable and the semaphore [fails open](crate::SemaphoreBuilder::fail_open).
    /// Such a permit holds no slot: it is not counted against the capacity,
    /// its [`id`](Self::id) is `0`, [`fence`](Self::fence) refuses it and
    /// [`release`](Self::release) does nothing.
    pub fn is_unchecked(&self) -> bool {
        self.claims.is_empty()
    }

    /// Resolves when this permit is lost: a renewal found it reaped or
    /// released by someone else, or its lease can no longer be guaranteed
    /// (renewals failed, or there is no [heartbeat](crate::SemaphoreBuilder::heartbeat)
    /// and the lease ran out). Stop the protected work then: another holder
    /// may be admitted to the slot.
    ///
    /// The signal is an early warning: it fires a tenth of the lease (at
    /// least 20 ms) *before* the lease ends, measured on this process's
    /// monotonic clock from when the claim or last renewal was sent, so an
    /// offset between the hosts' clocks does not matter. It cannot see a
    /// database clock that jumps forward, or time this process spent
    /// suspended, and work that never yields cannot hear it: where a write
    /// must never happen after the permit is lost, [`fence`](Self::fence) it.
    /// Once lost, a permit stays lost, and [`release`](Self::release) reports
    /// it ([`Error::PermitLost`]) and records its claims as timed out.
    ///
    /// ```no_run
    /// # async fn run(permit: pg_semaphore::Permit) -> Result<(), Box<dyn std::error::Error>> {
    /// # async fn do_the_work() {}
    /// tokio::select! {
    ///     () = do_the_work() => permit.release().await?,
    ///     reason = permit.lost() => eprintln!("stopped: permit lost ({reason})"),
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only watches.
    pub async fn lost(&self) -> LostReason {
        self.lease.lost().await
    }

    /// Whether this permit is lost (see [`lost`](Self::lost)), without waiting.
    pub fn is_lost(&self) -> bool {
        self.lease.lost_reason().is_some()
    }

    /// Fences a write protected by this permit: checks, inside the caller's
    /// own transaction, that the permit still holds its slots with an
    /// unexpired lease, and keeps it so until that transaction ends (its rows
    /// are share-locked: a release waits for the transaction, and reapers and
    /// claims skip the rows and count them as held). Work committed in that
    /// transaction therefore happened while the permit was held, even if the
    /// holder stalled for longer than its lease before getting there. Keep
    /// the fenced transaction short: the heartbeat's renewals wait for it
    /// too, and a fence held past the lease loses the permit once it ends. To
    /// bound a fenced transaction whose client goes dark (a network
    /// partition), set `idle_in_transaction_session_timeout` on it.
    ///
    /// A weighted permit is checked, and kept, by every one of its claims.
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool, permit: pg_semaphore::Permit) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// permit.fence(&mut tx).await?; // Err(PermitLost) if the slot was lost meanwhile
    /// sqlx::query("UPDATE accounts SET charged = true WHERE id = 7")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// tx.commit().await?;
    /// permit.release().await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::PermitLost`] when a claim was released or reaped, or its
    /// lease has ended (a reaper may take it once this transaction ends);
    /// [`Error::Database`]. After an error the transaction may be aborted.
    ///
    /// # Cancel safety
    ///
    /// Runs on the caller's transaction: if cancelled, roll it back.
    pub async fn fence(&self, tx: &mut Transaction<'_, Postgres>) -> Result<()> {
        if self.is_unchecked() {
            return Err(self.lost_error(self.id(), LostReason::Unchecked));
        }
        match engine::fence(tx, self.core.db.is_pooled(), &self.ids(), &self.token).await? {
            Ended::Done => Ok(()),
            Ended::Lost { id, reason } => Err(self.lost_error(id, reason)),
        }
    }

    /// Releases the slots (sets `completed_at`) and wakes a waiter if one is
    /// registered, in one round trip.
    ///
    /// # Errors
    ///
    /// - [`Error::PermitLost`] when the slots were no longer held: the lease
    ///   expired (whether or not a reaper got there first), it was released
    ///   by someone else, or [`lost`](Self::lost) had already fired. Work done
    ///   since may have overlapped another holder's. The claims are ended
    ///   either way, recorded as timed out.
    /// - [`Error::Database`] when the database could not be reached; the slots
    ///   are then freed when the lease expires.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the round trip runs in a spawned task, so the release
    /// happens even if this future is dropped.
    pub async fn release(mut self) -> Result<()> {
        self.released = true;
        self.lease.stop();
        if self.is_unchecked() {
            return Ok(());
        }
        let lost = self.lease.lost_reason();
        let core = self.core.clone();
        let (ids, token, acquired_at) = (self.ids(), self.token.clone(), self.acquired_at);
        let several = self.is_several();
        let ended = detached(move |_| async move {
            let (ended, at) = engine::release(&core, &ids, &token, lost.is_some(), several).await?;
            if let (Ended::Done, Some(at)) = (ended, at) {
                // Both ends on the database clock.
                let held_ms = (at - acquired_at).num_milliseconds();
                tracing::debug!(semaphore = %core.name, ids = ?ids, held_ms, "permit released");
            }
            Ok(ended)
        })
        .await?;
        if let Some(reason) = lost_at_end(ended, lost) {
            self.count_lost(reason);
        }
        match (ended, lost) {
            (Ended::Done, None) => Ok(()),
            (Ended::Lost { id, reason }, _) => Err(self.lost_error(id, reason)),
            (Ended::Done, Some(reason)) => Err(self.lost_error(self.id(), reason)),
        }
    }

    fn lost_error(&self, id: i64, reason: LostReason) -> Error {
        Error::PermitLost {
            semaphore: self.core.name.clone(),
            id,
            reason,
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.released || self.is_unchecked() {
            return;
        }
        let lost = self.lease.lost_reason();
        self.lease.stop();
        let core = self.core.clone();
        let others = self.others.clone();
        let (ids, token) = (self.ids(), self.token.clone());
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let several = !others.is_empty();
                    match engine::release(&core, &ids, &token, lost.is_some(), several).await {
                        Ok((ended, _)) => {
                            if let Some(reason) = lost_at_end(ended, lost) {
                                for core in std::iter::once(&core).chain(&others) {
                                    core.metrics.lost(reason);
                                }
                            }
                            tracing::debug!(semaphore = %core.name, ids = ?ids, "dropped permit released");
                        }
                        Err(error) => tracing::warn!(
                            semaphore = %core.name, ids = ?ids, %error,
                            "background release of a dropped permit failed; its lease frees the slot"
                        ),
                    }
                });
            }
            Err(_) => tracing::warn!(
                semaphore = %self.core.name,
                id = self.id(),
                "permit dropped outside a tokio runtime: its slot is freed when the lease expires"
            ),
        }
    }
}

/// Why a permit that just ended was lost, if it was: the release's verdict,
/// else what its holder had been told. Counted once per permit.
fn lost_at_end(ended: Ended, told: Option<LostReason>) -> Option<LostReason> {
    match ended {
        Ended::Lost { reason, .. } => Some(reason),
        Ended::Done => told,
    }
}
