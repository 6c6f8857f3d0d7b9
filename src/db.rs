//! The database layer: how every statement of the crate reaches PostgreSQL.
//!
//! - [`Db`] wraps the application's pool and knows whether it sits behind a
//!   transaction-pooling proxy (PgBouncer's `pool_mode = transaction`): there,
//!   each prepared statement runs unnamed inside `BEGIN`/`COMMIT`, because
//!   sqlx sends Parse/Describe and Bind/Execute as two synced steps that the
//!   proxy may route to different server connections outside a transaction.
//! - [`Db::batch`] sends several statements in one round trip (the simple
//!   query protocol): a durable transaction and, after its commit, a
//!   wake-up in a transaction of its own.
//! - Errors of the crate's own statements go through [`ours`], the one place
//!   that reads "undefined table" as "migrations not applied"; errors of the
//!   caller's statements never do.
//! - [`detached`] runs a round trip in a spawned task so that a caller who
//!   goes away never loses what it did (a claim is released, a queue place
//!   left, a lock wait cancelled): the one "undo if the caller is gone"
//!   used by the semaphore, the queue and the mutex.
//! - [`fails_open`] decides whether an error means the database is
//!   unreachable, for fail-open admission.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::{Query, QueryAs};
use sqlx::{AssertSqlSafe, FromRow, PgConnection, PgPool, Postgres};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::{Error, Result};

/// The pool, and how to send statements through it.
#[derive(Debug, Clone)]
pub(crate) struct Db {
    pool: PgPool,
    pooled: bool,
}

/// A statement of the crate with its arguments bound (owned values: the
/// statement may run in a spawned task).
pub(crate) type Statement<O> = QueryAs<'static, Postgres, O, PgArguments>;

type ConnFuture<'c, T> = Pin<Box<dyn Future<Output = sqlx::Result<T>> + Send + 'c>>;

impl Db {
    /// `pooled`: the pool connects through a transaction-pooling proxy.
    pub(crate) fn new(pool: &PgPool, pooled: bool) -> Db {
        Db {
            pool: pool.clone(),
            pooled,
        }
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub(crate) fn is_pooled(&self) -> bool {
        self.pooled
    }

    /// A statement of the crate, as a prepared statement: named (cached per
    /// connection) on a direct pool, unnamed behind a transaction pooler.
    pub(crate) fn query_as<O>(&self, sql: &'static str) -> Statement<O>
    where
        O: for<'r> FromRow<'r, PgRow>,
    {
        sqlx::query_as(sql).persistent(!self.pooled)
    }

    /// As [`query_as`](Self::query_as), for a statement whose rows are not read.
    pub(crate) fn query(&self, sql: &'static str) -> Query<'static, Postgres, PgArguments> {
        sqlx::query(sql).persistent(!self.pooled)
    }

    /// Runs `statement` on a connection of the pool (in a transaction of
    /// its own behind a transaction pooler).
    async fn on_conn<T: Send>(
        &self,
        statement: impl for<'c> FnOnce(&'c mut PgConnection) -> ConnFuture<'c, T>,
    ) -> Result<T> {
        let result = async {
            if self.pooled {
                let mut tx = self.pool.begin().await?;
                let value = statement(&mut tx).await?;
                tx.commit().await?;
                Ok(value)
            } else {
                let mut conn = self.pool.acquire().await?;
                statement(&mut conn).await
            }
        };
        result.await.map_err(ours)
    }

    /// The one row of a statement of the crate.
    pub(crate) async fn fetch_one<O>(&self, query: Statement<O>) -> Result<O>
    where
        O: for<'r> FromRow<'r, PgRow> + Send + Unpin + 'static,
    {
        self.on_conn(move |conn| Box::pin(query.fetch_one(conn)))
            .await
    }

    /// The row, if any, of a statement of the crate.
    pub(crate) async fn fetch_optional<O>(&self, query: Statement<O>) -> Result<Option<O>>
    where
        O: for<'r> FromRow<'r, PgRow> + Send + Unpin + 'static,
    {
        self.on_conn(move |conn| Box::pin(query.fetch_optional(conn)))
            .await
    }

    /// Every row of a statement of the crate.
    pub(crate) async fn fetch_all<O>(&self, query: Statement<O>) -> Result<Vec<O>>
    where
        O: for<'r> FromRow<'r, PgRow> + Send + Unpin + 'static,
    {
        self.on_conn(move |conn| Box::pin(query.fetch_all(conn)))
            .await
    }

    /// Runs a statement of the crate; returns the rows it affected.
    pub(crate) async fn execute(
        &self,
        query: Query<'static, Postgres, PgArguments>,
    ) -> Result<u64> {
        self.on_conn(move |conn| {
            Box::pin(async move { Ok(query.execute(conn).await?.rows_affected()) })
        })
        .await
    }

    /// Sends `sql`, several statements, in **one round trip** (the simple
    /// query protocol), and returns the rows of all of them in order. The
    /// statements may open and commit transactions of their own; an error
    /// stops the rest. No parameters: the caller inlines only integers and
    /// hex digits (see [`hex`]), never text. Works the same behind a
    /// transaction pooler (one message, one server connection, no prepared
    /// statement).
    pub(crate) async fn batch(&self, sql: String) -> Result<Vec<PgRow>> {
        let mut conn = self.pool.acquire().await.map_err(ours)?;
        let result = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut *conn)
            .await;
        if result.is_err() {
            // A failed statement inside an explicit BEGIN leaves the
            // transaction aborted: end it before the connection goes back.
            let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
        }
        result.map_err(ours)
    }
}

/// Maps an error of one of the crate's own statements: an undefined schema,
/// table or function (3F000, 42P01, 42883) means the migrations were not
/// applied; 22023 raised by a function's argument check (`pgsemaphore.refuse`,
/// which names the argument in the error's COLUMN field) is an
/// [`Error::InvalidArgument`]. Statements the application runs (in a mutex
/// guard's transaction, say) never go through here.
pub(crate) fn ours(error: sqlx::Error) -> Error {
    let Some(database) = error.as_database_error() else {
        return Error::Database(error);
    };
    match database.code().as_deref() {
        Some("3F000" | "42P01" | "42883") => Error::MigrationsMissing { source: error },
        Some("22023") => {
            let column = database
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .and_then(|e| e.column());
            match column.map(argument_name) {
                Some(argument) => {
                    let message = database.message();
                    // "invalid p_permits: 1 to 100000, got 0" -> "1 to 100000, got 0"
                    let reason = message.split_once(": ").map_or(message, |(_, r)| r);
                    Error::invalid(argument, reason)
                }
                None => Error::Database(error),
            }
        }
        _ => Error::Database(error),
    }
}

/// The crate's name for an argument of a SQL function, as
/// [`Error::InvalidArgument`] reports it.
fn argument_name(column: &str) -> &'static str {
    match column {
        "p_name" | "p_semaphore" => "name",
        "p_capacity" => "capacity",
        "p_lease" => "lease",
        "p_holder" => "holder",
        "p_metadata" => "metadata",
        "p_token" | "p_ticket_token" => "token",
        "p_permits" | "p_n" => "permits",
        "p_priority" => "priority",
        "p_reserve" => "reserved",
        "p_ids" => "ids",
        "p_ticket" | "p_tickets" => "ticket",
        "p_waiter_lease" => "waiter_lease",
        "p_fair_key" => "fairness_key",
        "p_limit" => "limit",
        "p_limiter" => "limiter",
        "p_key" => "key",
        "p_rate" => "rate",
        "p_burst" => "burst",
        "p_window" => "window",
        "p_older_than" => "older_than",
        "p_idle_for" => "idle_for",
        "p_batch" => "batch",
        "p_id" => "id",
        _ => "argument",
    }
}

/// Lowercase hex digits of `bytes`, for `decode('..', 'hex')` in a batch.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

/// A holder's secret: 16 random bytes, sent with its claims; the database
/// keeps only their SHA-256, and only a caller that knows them may release,
/// renew or fence those claims.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Token([u8; 16]);

impl Token {
    pub(crate) fn new() -> Token {
        let mut bytes = [0; 16];
        if getrandom::fill(&mut bytes).is_err() {
            // No OS randomness (a sandbox without getrandom): fall back to
            // the hasher's per-process random keys, still unguessable from
            // another process.
            use std::hash::{BuildHasher, Hasher};
            for chunk in bytes.chunks_mut(8) {
                let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
                hasher.write_u128(Instant::now().elapsed().as_nanos());
                chunk.copy_from_slice(&hasher.finish().to_le_bytes());
            }
        }
        Token(bytes)
    }

    pub(crate) fn bytes(&self) -> Vec<u8> {
        self.0.to_vec()
    }

    pub(crate) fn hex(&self) -> String {
        hex(&self.0)
    }

    #[cfg(test)]
    pub(crate) fn from_bytes(bytes: [u8; 16]) -> Token {
        Token(bytes)
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

/// Resolves when the caller of a [`detached`] round trip has gone (its
/// future was dropped).
pub(crate) struct CallerGone(oneshot::Receiver<Infallible>);

impl CallerGone {
    pub(crate) async fn wait(&mut self) {
        // Nothing is ever sent: this returns when the sender is dropped.
        let _ = (&mut self.0).await;
    }
}

/// Runs `round_trip` and returns its result, cancel-safe by construction:
/// it is polled in the caller's task (no spawn, no thread hop on the common
/// path), and if the caller's future is dropped before it finished, the rest
/// of the round trip is handed to a spawned task, which finishes it and
/// drops what it produced: values that hold something (a
/// [`Permit`](crate::Permit), a queue ticket, a mutex guard) give it back in
/// their `Drop`. The round trip can watch [`CallerGone`] to stop early (a
/// lock wait cancels its statement on the server).
pub(crate) fn detached<T, F>(round_trip: impl FnOnce(CallerGone) -> F) -> Detached<T>
where
    T: Send + 'static,
    F: Future<Output = Result<T>> + Send + 'static,
{
    let (alive, gone) = oneshot::channel::<Infallible>();
    Detached {
        work: Some(Box::pin(round_trip(CallerGone(gone)))),
        alive: Some(alive),
    }
}

/// A round trip in flight; see [`detached`].
pub(crate) struct Detached<T: Send + 'static> {
    work: Option<Pin<Box<dyn Future<Output = Result<T>> + Send>>>,
    /// Dropped when the caller goes away: [`CallerGone`] resolves.
    alive: Option<oneshot::Sender<Infallible>>,
}

impl<T: Send + 'static> Future for Detached<T> {
    type Output = Result<T>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<T>> {
        let Some(work) = self.work.as_mut() else {
            return std::task::Poll::Ready(Err(caller_gone()));
        };
        let result = std::task::ready!(work.as_mut().poll(cx));
        self.work = None;
        std::task::Poll::Ready(result)
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else {
            return;
        };
        drop(self.alive.take());
        match tokio::runtime::Handle::try_current() {
            // What it produces is dropped there, which undoes it.
            Ok(runtime) => drop(runtime.spawn(async move { drop(work.await) })),
            Err(_) => tracing::debug!("a round trip was abandoned outside a tokio runtime"),
        }
    }
}

/// What a round trip returns when its caller has gone: nobody ever sees it.
pub(crate) fn caller_gone() -> Error {
    Error::internal("the caller of this round trip has gone")
}

/// Whether a fail-open handle may admit after `error`: the database is
/// unreachable. A pool timeout is ambiguous: a pool that is only busy must
/// not fail open (that would lift the limit exactly when it matters), so
/// unless the pool holds no connection at all, one direct connection attempt
/// decides, and only a refusal (not a slow or "too many connections" answer,
/// signs of a server that is up but loaded) counts.
pub(crate) async fn fails_open(error: &Error, pool: &PgPool) -> bool {
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

/// See [`Error::is_unreachable`].
pub(crate) fn unreachable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolClosed => true,
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|code| code.starts_with("08") || code.starts_with("57P")),
        _ => false,
    }
}

/// Whether a statement that failed with `error` may still have run on the
/// server: the connection broke after it was sent, so its reply (and commit
/// status) is unknown. A pool timeout never sent anything; an error answer
/// from the server means it did not commit.
pub(crate) fn outcome_unknown(error: &Error) -> bool {
    match error {
        Error::Database(sqlx::Error::Database(_) | sqlx::Error::PoolTimedOut) => false,
        Error::Database(error) => unreachable(error),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_and_never_printed() {
        assert_ne!(Token::new(), Token::new());
        assert_eq!(format!("{:?}", Token::new()), "Token(..)");
    }

    #[test]
    fn hex_is_lowercase_and_padded() {
        assert_eq!(hex(&[0x00, 0x0f, 0xab, 0xff]), "000fabff");
        assert_eq!(hex(&[]), "");
    }

    #[test]
    fn only_undefined_objects_of_our_statements_mean_missing_migrations() {
        assert!(matches!(ours(sqlx::Error::RowNotFound), Error::Database(_)));
        assert!(matches!(
            ours(sqlx::Error::PoolTimedOut),
            Error::Database(_)
        ));
    }

    #[test]
    fn an_internal_error_is_never_an_outage() {
        let error = Error::internal("pgsemaphore.claim returned a claim without ids");
        assert!(!error.is_unreachable());
        assert!(!outcome_unknown(&error));
        assert!(!error.is_busy());
        assert!(!outcome_unknown(&caller_gone()));
    }

    #[test]
    fn sql_argument_names_map_to_the_crates() {
        assert_eq!(argument_name("p_permits"), "permits");
        assert_eq!(argument_name("p_token"), "token");
        assert_eq!(argument_name("p_semaphore"), "name");
        assert_eq!(argument_name("p_fair_key"), "fairness_key");
        assert_eq!(argument_name("p_something_new"), "argument");
    }

    #[test]
    fn a_pool_timeout_never_leaves_an_unknown_outcome() {
        assert!(!outcome_unknown(&Error::Database(
            sqlx::Error::PoolTimedOut
        )));
        assert!(outcome_unknown(&Error::Database(sqlx::Error::Io(
            std::io::Error::from(std::io::ErrorKind::ConnectionReset)
        ))));
    }
}
