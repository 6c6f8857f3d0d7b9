//! Test harness: every test gets a database of its own on the server that
//! the testkit (`testkit/`, crate `pg-semaphore-testkit`) finds or starts, so
//! tests are isolated and run in parallel.
//!
//! The testkit holds the server harness, PgBouncer and the TCP proxy, and
//! does not depend on pg-semaphore; this module re-exports it under the names
//! the tests use (`support::empty_db`, `support::server::url_for`, ...) and
//! adds what calls pg-semaphore or reads its schema. A helper that two test
//! files need lives here (or in the testkit), never in both files. The
//! CLI's tests (`cli/tests/support/mod.rs`) include this module too.
#![allow(dead_code, unused_imports)]

pub mod catalog;
pub mod chaos;
pub mod roles;

pub use testkit::{
    BoxError, TestDb, TestResult, another_pool, connect, empty_db, empty_db_with, pgbouncer, proxy,
    require_tool, require_tool_version, server,
};

use sqlx::PgPool;

/// A test database with pg-semaphore's migrations applied, and the
/// [`Client`](pg_semaphore::Client) of its pool (the [`TestDb`]'s fields
/// read through it: `db.pool`, `db.options`, `db.name`).
#[derive(Debug)]
pub struct MigratedDb {
    /// The database.
    pub db: TestDb,
    /// The client of `db.pool`.
    pub client: pg_semaphore::Client,
}

impl std::ops::Deref for MigratedDb {
    type Target = TestDb;

    fn deref(&self) -> &TestDb {
        &self.db
    }
}

/// A new database with pg-semaphore's migrations applied, and its client.
pub async fn migrated_db() -> MigratedDb {
    let db = empty_db().await;
    pg_semaphore::migrate(&db.pool).await.expect("migrate");
    let client = pg_semaphore::Client::new(db.pool.clone());
    MigratedDb { db, client }
}

/// A session of `options`' database, named `application`, that opens a
/// transaction, takes a transaction id and goes idle: it holds that
/// database's xmin horizon until it ends. Returns it and its pid.
pub async fn idle_in_transaction(
    options: &sqlx::postgres::PgConnectOptions,
    application: &str,
) -> sqlx::Result<(sqlx::PgConnection, i32)> {
    use sqlx::Connection;
    let mut conn =
        sqlx::PgConnection::connect_with(&options.clone().application_name(application)).await?;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await?;
    sqlx::raw_sql("BEGIN; SELECT pg_current_xact_id();")
        .execute(&mut conn)
        .await?;
    Ok((conn, pid))
}

/// The most claims of `semaphore` that overlapped at any instant, swept over
/// the audit log's own timestamps (a claim ending as another starts is a
/// hand-over, not an overlap). Claims must have ended.
pub async fn max_concurrent_claims(pool: &PgPool, semaphore: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "WITH events AS (
             SELECT created_at AS at, 1 AS delta FROM pgsemaphore.slots WHERE semaphore = $1
             UNION ALL
             SELECT completed_at, -1 FROM pgsemaphore.slots WHERE semaphore = $1
         )
         SELECT max(running) FROM (
             SELECT sum(delta) OVER (ORDER BY at, delta ROWS UNBOUNDED PRECEDING) AS running FROM events
         ) r",
    )
    .bind(semaphore)
    .fetch_one(pool)
    .await
}

/// How many claims of `semaphore` are live in the slot table (neither
/// completed nor timed out; an expired one not yet reaped counts).
pub async fn live_rows(pool: &PgPool, semaphore: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pgsemaphore.slots \
         WHERE semaphore = $1 AND completed_at IS NULL AND timed_out_at IS NULL",
    )
    .bind(semaphore)
    .fetch_one(pool)
    .await
    .expect("count live rows")
}

/// How many claims of `semaphore` the `pgsemaphore.live_slots` view shows
/// (the view an application role reads; the same rows as [`live_rows`]).
pub async fn live_slots(pool: &PgPool, semaphore: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.live_slots WHERE semaphore = $1")
        .bind(semaphore)
        .fetch_one(pool)
        .await
}

/// Polls `check` every 20 ms until it holds (`true`) or `within` passes (`false`).
pub async fn eventually<F, Fut>(within: std::time::Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Whether, within 5 s, the advisory semaphore `semaphore` has `rows` rows
/// in its audit log (the audit writer appends finished permits in batches).
pub async fn advisory_rows_logged(pool: &PgPool, semaphore: &str, rows: i64) -> bool {
    eventually(std::time::Duration::from_secs(5), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pgsemaphore.advisory_claims WHERE semaphore = $1",
        )
        .bind(semaphore)
        .fetch_one(pool)
        .await
        .unwrap_or(0)
            == rows
    })
    .await
}

/// The SQL between the `grants:begin` and `grants:end` markers of the
/// guide's operations chapter (docs/guide/operations.md, "Privileges"), for
/// the roles `app` and `operator` (tests/security.rs and
/// tests/migrations.rs run exactly what the guide documents).
pub fn documented_grants(app: &str, operator: &str) -> String {
    let guide = include_str!("../../docs/guide/operations.md");
    let start = guide
        .find("<!-- grants:begin")
        .expect("docs/guide/operations.md grants marker");
    let end = guide
        .find("<!-- grants:end -->")
        .expect("docs/guide/operations.md grants end marker");
    let sql = guide[start..end]
        .split("```sql")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a sql block between the grants markers");
    sql.replace("grant_access('app',", &format!("grant_access('{app}',"))
        .replace(
            "grant_access('operator',",
            &format!("grant_access('{operator}',"),
        )
}

/// A claim made straight through the SQL function with a known holder
/// token, so that a test can renew or fence it on a connection of its own
/// (a permit keeps its token to itself). Returns the claim's id.
pub async fn claim_with_token(
    conn: impl sqlx::PgExecutor<'_>,
    semaphore: &str,
    lease: &str,
    token: &[u8],
) -> sqlx::Result<i64> {
    let (status, ids): (String, Option<Vec<i64>>) = sqlx::query_as(
        "SELECT o_status, o_ids FROM pgsemaphore.claim(p_semaphore => $1, p_holder => 'test', p_lease => $2::interval, p_metadata => NULL, p_token => $3)",
    )
    .bind(semaphore)
    .bind(lease)
    .bind(token)
    .fetch_one(conn)
    .await?;
    assert_eq!(status, "claimed");
    Ok(ids.expect("claimed")[0])
}

/// A 16-byte holder token of the given tag.
pub fn token(tag: &str) -> Vec<u8> {
    let mut bytes = tag.as_bytes().to_vec();
    bytes.resize(16, b'.');
    bytes.truncate(16);
    bytes
}

/// A claim on `semaphore` with `token`, straight through the SQL function
/// (holder `h`, the semaphore's lease): its outcome as the function answers
/// it, status and ids.
pub async fn raw_claim(
    conn: impl sqlx::PgExecutor<'_>,
    semaphore: &str,
    token: &[u8],
) -> sqlx::Result<(String, Option<Vec<i64>>)> {
    sqlx::query_as(
        "SELECT o_status, o_ids FROM pgsemaphore.claim(p_semaphore => $1, p_holder => 'h', \
         p_lease => NULL, p_metadata => NULL, p_token => $2)",
    )
    .bind(semaphore)
    .bind(token)
    .fetch_one(conn)
    .await
}
