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
//! - Errors of the crate's own statements go through
//!   [`ours`](crate::error::ours), the one place that reads "undefined
//!   table" as "migrations not applied"; errors of the caller's statements
//!   never do.
//! - [`seconds`] reads the durations the statements answer as seconds.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::{Query, QueryAs};
use sqlx::{AssertSqlSafe, FromRow, PgConnection, PgPool, Postgres};

use crate::error::{Result, ours};

/// The pool, and how to send statements through it.
#[derive(Debug, Clone)]
pub(crate) struct Db {
    pool: PgPool,
    pooled: bool,
    /// Whether the client's wake-ups can `LISTEN`: not through a
    /// transaction pooler, unless the client was given direct options.
    listens: bool,
}

/// A statement of the crate with its arguments bound (owned values: the
/// statement may run in a spawned task).
pub(crate) type Statement<O> = QueryAs<'static, Postgres, O, PgArguments>;

/// Seconds from PostgreSQL (an `extract(epoch FROM ...)::float8` column) as
/// a `Duration`; negative or non-finite become zero (clock adjustments can
/// make an interval slightly negative).
pub(crate) fn seconds(value: f64) -> Duration {
    Duration::try_from_secs_f64(value).unwrap_or(Duration::ZERO)
}

type ConnFuture<'c, T> = Pin<Box<dyn Future<Output = sqlx::Result<T>> + Send + 'c>>;

impl Db {
    /// `pooled`: the pool connects through a transaction-pooling proxy.
    pub(crate) fn new(pool: &PgPool, pooled: bool) -> Db {
        Db {
            pool: pool.clone(),
            pooled,
            listens: !pooled,
        }
    }

    /// As [`new`](Db::new), for a client that listens on a direct
    /// connection of its own even if the pool is behind a pooler.
    pub(crate) fn listening(mut self, direct: bool) -> Db {
        self.listens |= direct;
        self
    }

    /// Whether the client's wake-ups can `LISTEN` (and processes register
    /// for notifications).
    pub(crate) fn listens(&self) -> bool {
        self.listens
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
    /// hex digits (see [`Token::hex`](crate::token::Token::hex)), never
    /// text. Works the same behind a transaction pooler (one message, one
    /// server connection, no prepared statement).
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
