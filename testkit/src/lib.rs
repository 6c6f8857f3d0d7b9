//! pg-semaphore's test tooling, shared by its tests, examples and benchmarks.
//!
//! - [`server`]: finds or starts the PostgreSQL server (`DATABASE_URL`, else a
//!   throwaway server from the local binaries, else a testcontainers
//!   container), and can start more throwaway servers (a durable one for the
//!   benchmarks);
//! - [`TestDb`], [`empty_db`]: a database of its own per test, so tests are
//!   isolated and run in parallel;
//! - [`pgbouncer`]: a PgBouncer in transaction pooling mode in front of it;
//! - [`proxy`]: a TCP proxy whose plug can be pulled, or whose link can be
//!   partitioned and healed;
//! - [`replica`]: a throwaway primary with a streaming standby (synchronous
//!   or asynchronous replication), stopped hard and promoted on demand;
//! - [`router`]: a TCP router whose upstream can be switched to the
//!   promoted standby, as HAProxy's health check does in front of Patroni;
//! - [`require_tool`]: the policy for tests that need an external tool;
//! - [`chaos`]: the scaffolding of the tests that run worker processes and
//!   a chaos driver (torture, failover): the processes, their stop file,
//!   the timestamped logs they write and the sweeps that read them;
//! - [`TestResult`]: what a test returns.
//!
//! This crate does not depend on pg-semaphore (pg-semaphore dev-depends on
//! it): helpers that call the crate live in `tests/support/mod.rs`.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations)]

pub mod chaos;
pub mod pgbouncer;
pub mod proxy;
pub mod replica;
pub mod router;
pub mod server;
mod tools;

pub use tools::{REQUIRE_TOOLS_VAR, find_tool, require_tool, require_tool_version};

use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};

/// Any error, as a test's `?` gives it up.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a test (or a helper that may fail) returns: `Ok`, or any error,
/// which fails the test.
pub type TestResult<T = ()> = Result<T, BoxError>;

/// A fresh database, dropped again when this value is (unless the server is a
/// throwaway one that dies with the test process anyway).
#[derive(Debug)]
pub struct TestDb {
    /// A pool on the database.
    pub pool: PgPool,
    /// The database's name.
    pub name: String,
    /// Connect options for the database.
    pub options: PgConnectOptions,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A new, empty database and a pool of 10 connections on it.
pub async fn empty_db() -> TestDb {
    empty_db_with(10).await
}

/// A new, empty database and a pool of `max_connections` on it.
///
/// # Panics
///
/// When no server can be found or started, or the database cannot be created.
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

/// A connection of its own to `db`, outside its pool.
///
/// # Errors
///
/// When it cannot connect.
pub async fn connect(db: &TestDb) -> sqlx::Result<PgConnection> {
    PgConnection::connect_with(&db.options).await
}

/// Another pool on the same database (another "process").
///
/// # Panics
///
/// When it cannot connect.
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
