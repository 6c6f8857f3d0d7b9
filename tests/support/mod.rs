//! Test harness: every test gets a database of its own on the server that
//! `server.rs` finds or starts, so tests are isolated and run in parallel.
#![allow(dead_code)]

pub mod catalog;
pub mod pgbouncer;
pub mod proxy;
pub mod server;

use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};

/// A fresh database, dropped again when this value is (unless the server is a
/// throwaway one that dies with the test process anyway).
#[derive(Debug)]
pub struct TestDb {
    pub pool: PgPool,
    pub name: String,
    pub options: PgConnectOptions,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A new, empty database and a pool of 10 connections on it.
pub async fn empty_db() -> TestDb {
    empty_db_with(10).await
}

/// A new, empty database and a pool of `max_connections` on it.
pub async fn empty_db_with(max_connections: u32) -> TestDb {
    // Finding or starting the server blocks (initdb, pg_ctl, testcontainers'
    // blocking runner): keep it off the runtime's threads.
    let server = match tokio::task::spawn_blocking(server::server).await {
        Ok(server) => server,
        Err(error) => std::panic::resume_unwind(error.into_panic()),
    };
    let name = format!(
        "pgsem_test_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let mut admin = connect_admin(&server.options).await;
    admin
        .execute(AssertSqlSafe(format!(
            r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
        )))
        .await
        .expect("drop a leftover test database");
    admin
        .execute(AssertSqlSafe(format!(
            r#"CREATE DATABASE "{name}" TEMPLATE template0"#
        )))
        .await
        .unwrap_or_else(|e| panic!("create test database on {}: {e}", server.description));
    let _ = admin.close().await;
    let options = server.options.clone().database(&name);
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options.clone())
        .await
        .expect("connect to the test database");
    TestDb {
        pool,
        name,
        options,
    }
}

/// A new database with pg-semaphore's migrations applied.
pub async fn migrated_db() -> TestDb {
    let db = empty_db().await;
    pg_semaphore::migrate(&db.pool).await.expect("migrate");
    db
}

/// Another pool on the same database (another "process").
pub async fn another_pool(db: &TestDb, max_connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(db.options.clone())
        .await
        .expect("connect a second pool")
}

async fn connect_admin(options: &PgConnectOptions) -> PgConnection {
    // A freshly started server may still be finishing its start-up.
    let mut last = None;
    for _ in 0..50 {
        match PgConnection::connect_with(options).await {
            Ok(conn) => return conn,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    panic!("cannot connect to the test server: {last:?}")
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if server::server().throwaway {
            return;
        }
        // Drop the database on a server we do not own. Drop cannot await, so
        // use a thread with a runtime of its own.
        let name = self.name.clone();
        let options = server::server().options.clone();
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(mut admin) = PgConnection::connect_with(&options).await {
                    let _ = admin
                        .execute(AssertSqlSafe(format!(
                            r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
                        )))
                        .await;
                }
            });
        })
        .join();
    }
}

/// The most claims of `semaphore` that overlapped at any instant, swept over
/// the audit log's own timestamps (a claim ending as another starts is a
/// hand-over, not an overlap). Claims must have ended.
pub async fn max_overlap(pool: &PgPool, semaphore: &str) -> sqlx::Result<i64> {
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
