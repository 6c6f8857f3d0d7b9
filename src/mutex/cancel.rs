//! Cancelling a lock wait whose caller has gone.
//!
//! A lock statement starts with a unique token (a comment: fixed text and
//! hex digits, nothing to escape, inlined so the statement runs on the
//! simple protocol, which also works through PgBouncer). When the caller
//! goes away mid-wait, the task that owns the connection cancels the
//! statement from a connection of its own (the pool may be exhausted by the
//! very waits being abandoned) with `pg_cancel_backend` on the backend whose
//! `pg_stat_activity.query` starts with the token: only that statement
//! matches, and its connection belongs to the task, so nothing else is ever
//! cancelled.
//!
//! Cancelling starts only once the statement was sent: a wait abandoned
//! while still queued for a pool connection has nothing to cancel. Attempts
//! back off (50 ms doubling to 2 s), because a statement can stay invisible
//! (`track_activities = off`, another role's view) and each attempt opens a
//! connection. Without a cancel the wait still ends (granted, timed out);
//! what it returns is then dropped, which rolls back.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

use crate::detached::CallerGone;

/// The first pause between cancel attempts; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

/// The longest pause between cancel attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// A unique marker for one lock statement: a comment with only hex digits.
pub(super) fn token() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!(
        "/* pgsemaphore lock {:x}.{:x}.{:x} */",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        nanos
    )
}

/// Cancels the running statement that starts with `token`.
fn cancel_sql(token: &str) -> String {
    format!(
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
         WHERE state = 'active' AND pid <> pg_backend_pid() AND starts_with(query, '{token}')"
    )
}

/// Runs `statement` (already sent, or about to be on its first poll); if the
/// caller goes away first, cancels it on the server, lets it end, and
/// returns `None` (what it produced is dropped: a transaction rolls back).
pub(super) async fn run_or_cancel<F, R>(
    pool: &PgPool,
    statement: F,
    token: &str,
    caller: &mut CallerGone,
) -> Option<sqlx::Result<R>>
where
    F: Future<Output = sqlx::Result<R>>,
{
    let mut statement = pin!(statement);
    tokio::select! {
        biased;
        result = &mut statement => return Some(result),
        () = caller.wait() => {}
    }
    let mut backoff = FIRST_BACKOFF;
    loop {
        if let Err(error) = cancel(pool, token).await {
            tracing::debug!(%error, "could not cancel an abandoned lock wait; retrying");
        }
        tokio::select! {
            _ = &mut statement => return None,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One cancel attempt, on a connection of its own.
async fn cancel(pool: &PgPool, token: &str) -> sqlx::Result<()> {
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await?;
    let result = sqlx::raw_sql(AssertSqlSafe(cancel_sql(token)))
        .execute(&mut conn)
        .await;
    let _ = conn.close().await;
    result.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_unique_comments_of_hex_digits() {
        let (a, b) = (token(), token());
        assert_ne!(a, b);
        let inner = a
            .strip_prefix("/* pgsemaphore lock ")
            .and_then(|t| t.strip_suffix(" */"))
            .expect("a comment");
        assert!(inner.chars().all(|c| c.is_ascii_hexdigit() || c == '.'));
    }

    #[test]
    fn the_cancel_matches_only_the_statement_with_the_token() {
        let sql = cancel_sql("/* pgsemaphore lock 1.2.3 */");
        assert!(sql.contains("starts_with(query, '/* pgsemaphore lock 1.2.3 */')"));
        assert!(sql.contains("pid <> pg_backend_pid()"));
    }
}
