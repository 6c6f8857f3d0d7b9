//! Pieces of the background work a [`Client`](crate::Client) owns: the
//! poison-tolerant [`lock`] its state is kept under, and the `LISTEN` loop
//! of the semaphores' and the rate limiters' wake-ups ([`listen_loop`]).

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};

/// Back-off after a listener fails to (re)connect.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(500);

/// Locks a mutex, recovering from poisoning: the data kept under these
/// locks stays consistent because no code panics while holding them.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Listens on `channel` on a connection of its own, apart from the
/// application's pool, until its task is aborted: passes each
/// notification's payload to `heard`, and `None` each time notifications
/// may have been missed (on each (re)connection, once `LISTEN` took
/// effect), when anything may have changed. Reconnects after a back-off.
/// `what` names the listener in its logs, `without` says what its waiters
/// do while it cannot listen.
pub(crate) async fn listen_loop(
    options: PgConnectOptions,
    channel: &'static str,
    what: &'static str,
    without: &'static str,
    heard: impl Fn(Option<&str>),
) {
    // A pool of one, used by PgListener to reconnect.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_lazy_with(options);
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(%error, "{what} cannot connect; {without}");
                tokio::time::sleep(RECONNECT_BACKOFF).await;
                continue;
            }
        };
        listener.ignore_pool_close_event(true);
        if let Err(error) = listener.listen(channel).await {
            tracing::warn!(%error, "{what} cannot LISTEN; {without}");
            tokio::time::sleep(RECONNECT_BACKOFF).await;
            continue;
        }
        // Anything changed before LISTEN took effect is looked at now.
        heard(None);
        loop {
            match listener.try_recv().await {
                Ok(Some(notification)) => heard(Some(notification.payload())),
                Ok(None) => {
                    // The connection dropped and was re-established (and
                    // re-LISTENed): notifications in between are lost.
                    tracing::debug!("{what} reconnected");
                    heard(None);
                }
                Err(error) => {
                    tracing::warn!(%error, "{what} lost its connection");
                    tokio::time::sleep(RECONNECT_BACKOFF).await;
                    break;
                }
            }
        }
    }
}
