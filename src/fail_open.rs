//! Fail-open admission, decided in one place: whether a handle built with
//! `fail_open(true)` admits a caller without the database, and how that is
//! told (one `WARN` event, one count in the handle's metrics).
//!
//! Only an unreachable database fails open ([`admits`]); an error the
//! database answered with (missing migrations, an unknown semaphore, bad
//! input) never does, nor does a pool that is only busy. The callers are
//! [`Acquiring::try_acquire_many`](crate::Acquiring::try_acquire_many) (an
//! unchecked permit), `SemaphoreLayer` (a request served without a permit)
//! and the rate limiters' `check` (a decision that counted nothing).

use std::time::Duration;

use sqlx::PgPool;

use crate::error::{Error, unreachable};
use crate::metrics::{LimiterMetrics, SemaphoreMetrics};

/// What is admitted without the database, as its `WARN` event and its
/// metrics name it.
pub(crate) enum Unchecked<'a> {
    /// A semaphore's fail-fast claim: an unchecked permit.
    Permit {
        semaphore: &'a str,
        metrics: &'a SemaphoreMetrics,
    },
    /// A request `SemaphoreLayer` serves without a permit.
    #[cfg(feature = "tower")]
    Request {
        semaphore: &'a str,
        metrics: &'a SemaphoreMetrics,
    },
    /// A rate limiter's check: a decision that counted nothing.
    Check {
        limiter: &'a str,
        metrics: &'a LimiterMetrics,
    },
}

/// Whether a handle that fails open (`enabled`) admits after `error`: only
/// when the database is unreachable. When it does, says so (`unchecked`'s
/// `WARN` event and metrics); the caller then admits.
pub(crate) async fn admits(
    enabled: bool,
    error: &Error,
    pool: &PgPool,
    unchecked: Unchecked<'_>,
) -> bool {
    if !enabled || !unreachable_now(error, pool).await {
        return false;
    }
    let (semaphore, metrics, admitted) = match unchecked {
        Unchecked::Check { limiter, metrics } => {
            tracing::warn!(
                limiter = %limiter,
                %error,
                "rate limiter failing open: the database is unreachable, request admitted uncounted"
            );
            metrics.failed_open();
            return true;
        }
        Unchecked::Permit { semaphore, metrics } => (
            semaphore,
            metrics,
            "database unreachable: admitting without a slot (fail-open)",
        ),
        #[cfg(feature = "tower")]
        Unchecked::Request { semaphore, metrics } => (
            semaphore,
            metrics,
            "cannot use the semaphore: serving the request without a limit",
        ),
    };
    tracing::warn!(semaphore = %semaphore, %error, "{admitted}");
    metrics.failed_open();
    true
}

/// Whether `error` means the database is unreachable, for fail-open
/// admission. A pool timeout is ambiguous: a pool that is only busy must
/// not fail open (that would lift the limit exactly when it matters), so
/// unless the pool holds no connection at all, one direct connection attempt
/// decides, and only a refusal (not a slow or "too many connections" answer,
/// signs of a server that is up but loaded) counts.
async fn unreachable_now(error: &Error, pool: &PgPool) -> bool {
    let Error::Database(error) = error else {
        return false;
    };
    if unreachable(error) {
        return true;
    }
    if !matches!(error, sqlx::Error::PoolTimedOut) {
        return false;
    }
    if pool.size() == 0 {
        return true;
    }
    let options = pool.connect_options();
    let attempt = sqlx::ConnectOptions::connect(&*options);
    match tokio::time::timeout(Duration::from_secs(2), attempt).await {
        Ok(Ok(conn)) => {
            let _ = sqlx::Connection::close(conn).await;
            false
        }
        Ok(Err(error)) => unreachable(&error),
        Err(_timed_out) => false,
    }
}
