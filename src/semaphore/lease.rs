//! A permit's lease, as its holder sees it: the heartbeat that renews it and
//! the "lost" signal.
//!
//! The holder only trusts its own monotonic clock. A claim or renewal sent at
//! instant `t` makes the database set `expires_at = now() + lease` with a
//! `now()` no earlier than `t`, so, as long as the database's clock runs
//! steadily, the lease is valid until `t + lease` whatever the offset between
//! the two clocks. The holder is told the permit is lost a little *before*
//! that (a tenth of the lease, at least a few milliseconds), so that its work
//! can stop before anyone else can be admitted to the slot.
//!
//! This is an early warning, not a guarantee: a database clock that jumps
//! forward, a holder process suspended (its monotonic clock stops) or work
//! that does not yield can all outrun it. `Permit::fence` is the guarantee.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::error::LostReason;
use crate::token::Token;
use crate::validate;

use super::engine::{self, Core, Ended};

/// Where a held permit stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseState {
    /// Held, certainly until `until` (holder's monotonic clock, margin included).
    Held { until: Instant },
    /// Lost: stop work.
    Lost(LostReason),
}

/// The holder's side of a permit's lease; aborts its heartbeat on drop.
#[derive(Debug)]
pub(crate) struct Lease {
    state: watch::Receiver<LeaseState>,
    /// Kept so the channel stays open when there is no heartbeat task.
    _sender: Option<watch::Sender<LeaseState>>,
    heartbeat: Option<AbortHandle>,
}

/// How early, before the lease certainly ends, the holder is told it is lost:
/// a tenth of the lease, but at least 20 ms (timer resolution and scheduling),
/// and at most half of it.
fn margin(lease: Duration) -> Duration {
    (lease / 10).max(Duration::from_millis(20)).min(lease / 2)
}

/// The instant until which a lease sent at `sent` is certainly held, margin included.
fn held_until(sent: Instant, lease: Duration) -> Instant {
    sent + (lease - margin(lease))
}

impl Lease {
    /// Starts tracking a claim sent at `sent` whose lease is `lease`, renewing
    /// it every `heartbeat` if one is given.
    pub(crate) fn start(
        core: &Arc<Core>,
        ids: Vec<i64>,
        token: Token,
        sent: Instant,
        lease: Duration,
        heartbeat: Option<Duration>,
    ) -> Self {
        let (sender, state) = watch::channel(LeaseState::Held {
            until: held_until(sent, lease),
        });
        match heartbeat {
            Some(interval) if tokio::runtime::Handle::try_current().is_ok() => {
                // Never let the interval come close to the lease, whatever a
                // concurrent reconfiguration did to the lease.
                let interval = interval.min(lease / 2).max(Duration::from_millis(1));
                let task = tokio::spawn(renew_loop(
                    core.clone(),
                    Renewing { ids, token },
                    sent,
                    lease,
                    interval,
                    sender,
                ));
                Lease {
                    state,
                    _sender: None,
                    heartbeat: Some(task.abort_handle()),
                }
            }
            _ => Lease {
                state,
                _sender: Some(sender),
                heartbeat: None,
            },
        }
    }

    /// A lease for a permit that holds no slot (fail-open): never lost, never renewed.
    pub(crate) fn unchecked() -> Self {
        let until = Instant::now() + Duration::from_secs(100 * 365 * 24 * 60 * 60);
        let (sender, state) = watch::channel(LeaseState::Held { until });
        Lease {
            state,
            _sender: Some(sender),
            heartbeat: None,
        }
    }

    /// Whether a heartbeat renews this lease.
    pub(crate) fn has_heartbeat(&self) -> bool {
        self.heartbeat.is_some()
    }

    /// Stops renewing (the permit is being released).
    pub(crate) fn stop(&mut self) {
        if let Some(task) = self.heartbeat.take() {
            task.abort();
        }
    }

    /// The reason the permit is lost, if it is (now).
    pub(crate) fn lost_reason(&self) -> Option<LostReason> {
        match *self.state.borrow() {
            LeaseState::Lost(reason) => Some(reason),
            LeaseState::Held { until } if Instant::now() >= until => Some(LostReason::LeaseExpired),
            LeaseState::Held { .. } => None,
        }
    }

    /// Resolves when the permit is lost.
    pub(crate) async fn lost(&self) -> LostReason {
        let mut state = self.state.clone();
        loop {
            let current = *state.borrow_and_update();
            let until = match current {
                LeaseState::Lost(reason) => return reason,
                LeaseState::Held { until } => until,
            };
            tokio::select! {
                changed = state.changed() => {
                    if changed.is_err() {
                        // The heartbeat stopped without a verdict (the permit
                        // is being released): only the deadline is left.
                        let last = *state.borrow();
                        return match last {
                            LeaseState::Lost(reason) => reason,
                            LeaseState::Held { until } => {
                                tokio::time::sleep_until(until).await;
                                LostReason::LeaseExpired
                            }
                        };
                    }
                }
                () = tokio::time::sleep_until(until) => {
                    if *state.borrow() == current {
                        return LostReason::LeaseExpired;
                    }
                }
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The claims a heartbeat renews, and the token that proves them.
struct Renewing {
    ids: Vec<i64>,
    token: Token,
}

/// The heartbeat: renews every `interval` until the permit is released (the
/// task is aborted) or lost. A failed renewal is retried quickly until the
/// lease certainly ends; then the permit is lost.
async fn renew_loop(
    core: Arc<Core>,
    renewing: Renewing,
    sent: Instant,
    lease: Duration,
    interval: Duration,
    state: watch::Sender<LeaseState>,
) {
    let ids = &renewing.ids;
    let lease_pg = match validate::lease(lease) {
        Ok(lease_pg) => lease_pg,
        // The lease came from the database, which accepted it: cannot happen.
        Err(_) => return,
    };
    let retry = (interval / 4).clamp(Duration::from_millis(1), Duration::from_secs(1));
    let mut until = match *state.borrow() {
        LeaseState::Held { until } => until,
        LeaseState::Lost(_) => return,
    };
    let mut next = sent + interval;
    let mut failures = 0u32;
    loop {
        if next >= until {
            // No attempt left before the deadline.
            tokio::time::sleep_until(until).await;
            lose(&core, ids, &state, LostReason::LeaseExpired);
            return;
        }
        tokio::time::sleep_until(next).await;
        let sent = Instant::now();
        let renewal = engine::renew(&core, ids, &renewing.token, lease_pg);
        match tokio::time::timeout_at(until, renewal).await {
            Ok(Ok(Ended::Done)) => {
                // "Lost" is final: a renewal that returns after the deadline
                // (this task ran late) must not revive a permit whose holder
                // may already have been told to stop.
                let renewed = held_until(sent, lease);
                let extended = state.send_if_modified(|current| match *current {
                    LeaseState::Held { until: old } if Instant::now() < old => {
                        *current = LeaseState::Held { until: renewed };
                        true
                    }
                    _ => false,
                });
                if !extended {
                    lose(&core, ids, &state, LostReason::LeaseExpired);
                    return;
                }
                until = renewed;
                next = sent + interval;
                failures = 0;
            }
            Ok(Ok(Ended::Lost { reason, .. })) => {
                lose(&core, ids, &state, reason);
                return;
            }
            Ok(Err(error)) => {
                // Once per outage at WARN; the retries at DEBUG.
                let id = ids.first().copied().unwrap_or_default();
                if failures == 0 {
                    tracing::warn!(semaphore = %core.name, id, %error, "lease renewal failed; retrying until the lease ends");
                } else {
                    tracing::debug!(semaphore = %core.name, id, %error, failures, "lease renewal failed again");
                }
                failures = failures.saturating_add(1);
                next = Instant::now() + retry;
            }
            Err(_deadline) => {
                lose(&core, ids, &state, LostReason::LeaseExpired);
                return;
            }
        }
    }
}

fn lose(core: &Core, ids: &[i64], state: &watch::Sender<LeaseState>, reason: LostReason) {
    tracing::warn!(
        semaphore = %core.name,
        id = ids.first().copied().unwrap_or_default(),
        %reason,
        "permit lost; its holder must stop the work it protects"
    );
    state.send_replace(LeaseState::Lost(reason));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_is_a_tenth_at_least_20_ms_at_most_half() {
        assert_eq!(margin(Duration::from_secs(90)), Duration::from_secs(9));
        assert_eq!(
            margin(Duration::from_millis(100)),
            Duration::from_millis(20)
        );
        assert_eq!(margin(Duration::from_millis(30)), Duration::from_millis(15));
    }

    #[test]
    fn a_lease_is_held_until_its_end_minus_the_margin() {
        let sent = Instant::now();
        assert_eq!(
            held_until(sent, Duration::from_secs(10)),
            sent + Duration::from_secs(9)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_heartbeat_a_lease_is_lost_at_its_deadline() {
        let lease = Lease::unchecked();
        assert_eq!(lease.lost_reason(), None);
        let (sender, state) = watch::channel(LeaseState::Held {
            until: Instant::now() + Duration::from_secs(1),
        });
        let lease = Lease {
            state,
            _sender: Some(sender),
            heartbeat: None,
        };
        assert_eq!(lease.lost_reason(), None);
        assert_eq!(lease.lost().await, LostReason::LeaseExpired);
        assert_eq!(lease.lost_reason(), Some(LostReason::LeaseExpired));
    }
}
