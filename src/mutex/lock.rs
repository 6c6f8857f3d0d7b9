//! What both lock scopes share, below them: the lock a
//! [`Mutex`](crate::Mutex) names ([`Lock`]: its key, label, heartbeat, idle
//! bound and metrics), the wait a lock statement makes ([`Wait`]: try,
//! bounded, forever) as PostgreSQL's `lock_timeout`, and the reading of a
//! lock statement's answer: a try's boolean, a refusal ([`Error::Locked`]),
//! a failure (55P03 a timeout, 40P01 a deadlock), a granted wait (one
//! event). The statements themselves are built beside the code that runs
//! them: [`xact`](super::xact) and [`session`](super::session).

use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, Row};

use crate::dead_man::DEFAULT_SESSION_HEARTBEAT;
use crate::error::{Error, Result, WaitedFor};
use crate::metrics::MutexMetrics;

/// The longest `lock_timeout` PostgreSQL accepts (`INT_MAX` milliseconds);
/// longer timeouts mean "wait without limit".
pub(super) const MAX_LOCK_TIMEOUT_MS: u128 = i32::MAX as u128;

/// PostgreSQL's two advisory key spaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Key {
    BigInt(i64),
    IntPair(i32, i32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Exclusive,
    Shared,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wait {
    /// `pg_try_advisory_*`: never waits.
    Try,
    /// Waits up to this long (PostgreSQL's `lock_timeout`).
    Timeout(Duration),
    /// Waits without limit.
    Forever,
}

/// One advisory lock, as a mutex names it.
#[derive(Debug, Clone)]
pub(super) struct Lock {
    pub(super) key: Key,
    /// How the mutex is named in errors and logs.
    pub(super) label: String,
    /// How often a session lock checks that its connection is alive.
    pub(super) heartbeat: Duration,
    /// A transaction-scoped lock's `idle_in_transaction_session_timeout`.
    pub(super) idle_timeout: Option<Duration>,
    pub(super) metrics: MutexMetrics,
}

impl Lock {
    pub(super) fn new(key: Key, label: String) -> Lock {
        Lock {
            key,
            metrics: MutexMetrics::new(&label),
            label,
            heartbeat: DEFAULT_SESSION_HEARTBEAT,
            idle_timeout: None,
        }
    }

    /// The key as SQL arguments: `42` or `7, 1001` (integers: nothing to escape).
    pub(super) fn key_args(&self) -> String {
        match self.key {
            Key::BigInt(k) => format!("{k}::int8"),
            Key::IntPair(a, b) => format!("{a}::int4, {b}::int4"),
        }
    }

    /// The error a lock statement's failure means.
    pub(super) fn lock_error(&self, error: sqlx::Error, wait: Wait) -> Error {
        let code = error.as_database_error().and_then(|e| e.code());
        match (code.as_deref(), wait) {
            (Some("55P03"), Wait::Timeout(timeout)) => {
                tracing::info!(
                    mutex = %self.label,
                    timeout_ms = timeout.as_millis() as u64,
                    "mutex lock timed out"
                );
                self.metrics.timed_out();
                Error::Timeout {
                    waited_for: WaitedFor::Mutex {
                        mutex: self.label.clone(),
                    },
                    timeout,
                }
            }
            (Some("40P01"), _) => {
                tracing::warn!(
                    mutex = %self.label,
                    "deadlock detected waiting for a mutex; its transaction was rolled back"
                );
                self.metrics.deadlock();
                Error::Deadlock {
                    mutex: self.label.clone(),
                }
            }
            _ => Error::Database(error),
        }
    }

    /// A try that found the lock held.
    pub(super) fn locked(&self) -> Error {
        self.metrics.busy();
        Error::Locked {
            mutex: self.label.clone(),
        }
    }

    /// One event per waiting lock granted (never per poll: a wait is one
    /// statement), with how long it waited; the wait time goes to the metrics too.
    pub(super) fn trace_locked(
        &self,
        mode: Mode,
        scope: &'static str,
        started: std::time::Instant,
    ) {
        self.metrics.waited(started.elapsed());
        tracing::debug!(
            mutex = %self.label,
            mode = ?mode,
            scope,
            waited_ms = started.elapsed().as_millis() as u64,
            "mutex locked"
        );
    }
}

/// `lock_timeout` in milliseconds for a waiting lock: `None` for a try-lock,
/// `0` (PostgreSQL's "no limit") for an unbounded or out-of-range wait.
pub(super) fn lock_timeout_ms(wait: Wait) -> Option<u128> {
    match wait {
        Wait::Try => None,
        Wait::Forever => Some(0),
        Wait::Timeout(timeout) => {
            // Round up, and never 0 (which would mean "no limit").
            let ms = timeout.as_nanos().div_ceil(1_000_000).max(1);
            Some(if ms > MAX_LOCK_TIMEOUT_MS { 0 } else { ms })
        }
    }
}

/// The boolean of a try-lock statement (the last column of its row).
pub(super) fn try_result(rows: &[PgRow]) -> Result<bool> {
    let row = rows
        .last()
        .ok_or(Error::Database(sqlx::Error::RowNotFound))?;
    Ok(row.try_get::<bool, _>(row.len() - 1)?)
}

/// Runs the lock statement `sql` on the caller's own connection.
pub(super) async fn run_on(conn: &mut PgConnection, sql: String) -> sqlx::Result<Vec<PgRow>> {
    sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(conn).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_timeouts_round_up_and_never_mean_forever_by_accident() {
        assert_eq!(lock_timeout_ms(Wait::Try), None);
        assert_eq!(lock_timeout_ms(Wait::Forever), Some(0));
        assert_eq!(lock_timeout_ms(Wait::Timeout(Duration::ZERO)), Some(1));
        assert_eq!(
            lock_timeout_ms(Wait::Timeout(Duration::from_micros(1500))),
            Some(2)
        );
        assert_eq!(
            lock_timeout_ms(Wait::Timeout(Duration::from_secs(2))),
            Some(2000)
        );
        assert_eq!(
            lock_timeout_ms(Wait::Timeout(Duration::MAX)),
            Some(0),
            "beyond INT_MAX ms: no limit"
        );
    }

    #[test]
    fn keys_are_inlined_as_typed_integers() {
        let key = |key| Lock::new(key, "mutex".into());
        assert_eq!(key(Key::BigInt(-7)).key_args(), "-7::int8");
        assert_eq!(key(Key::IntPair(1, -2)).key_args(), "1::int4, -2::int4");
    }
}
