//! A dedicated session's liveness, shared by the session-scoped mutex
//! ([`Locking::lock_session`](crate::Locking::lock_session)) and the advisory
//! semaphore's sessions: how often a session proves it is alive by default
//! ([`DEFAULT_SESSION_HEARTBEAT`]), the server-side dead-man switch that
//! ends a session, freeing its advisory locks, once it goes silent, and how
//! a holder awaits the loss of its session ([`lost`]).

use std::time::Duration;

use tokio::sync::watch;

use crate::error::LostReason;

/// The default interval at which a dedicated session (a session lock's, or
/// one holding an advisory semaphore's slots) proves its connection is
/// alive; the server ends a session silent for three of them.
pub const DEFAULT_SESSION_HEARTBEAT: Duration = Duration::from_secs(1);

/// How long the server lets a dedicated session with this heartbeat stay
/// silent before it ends it (see [`dead_man_sql`]).
pub(crate) fn dead_man_after(heartbeat: Duration) -> Duration {
    (heartbeat * 3).max(Duration::from_secs(1))
}

/// The server-side dead-man switch of a dedicated session, for a heartbeat
/// of `heartbeat`: the session ends after three silent heartbeats (at least
/// a second), and the server's keepalives probe a silent peer at that pace.
pub(crate) fn dead_man_sql(heartbeat: Duration) -> String {
    let idle_ms = dead_man_after(heartbeat).as_millis();
    let keepalive_s = (idle_ms / 1000).max(1);
    format!(
        "SET idle_session_timeout = '{idle_ms}ms'; \
         SET tcp_keepalives_idle = {keepalive_s}; \
         SET tcp_keepalives_interval = {keepalive_s}; \
         SET tcp_keepalives_count = 3; \
         SET tcp_user_timeout = {idle_ms}"
    )
}

/// Resolves when `loss` says the session is lost, with why; never if its
/// sender goes away without a loss (the lock was released, or nothing holds
/// the session any more). `'static`: a holder hands it to the task doing the
/// protected work.
pub(crate) async fn lost(mut loss: watch::Receiver<Option<LostReason>>) -> LostReason {
    let reason = loss.wait_for(Option::is_some).await.map(|reason| *reason);
    match reason {
        Ok(reason) => reason.unwrap_or(LostReason::ConnectionLost),
        Err(_) => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dead_man_switch_follows_the_heartbeat() {
        let sql = dead_man_sql(Duration::from_secs(2));
        assert!(sql.contains("idle_session_timeout = '6000ms'"));
        assert!(sql.contains("tcp_keepalives_idle = 6"));
        assert!(sql.contains("tcp_user_timeout = 6000"));
        let fast = dead_man_sql(Duration::from_millis(10));
        assert!(
            fast.contains("idle_session_timeout = '1000ms'"),
            "at least a second"
        );
        assert!(fast.contains("tcp_keepalives_idle = 1"));
    }
}
