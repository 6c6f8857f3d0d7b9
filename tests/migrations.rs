//! Migrations: idempotent, namespaced, and independent of the application's
//! own sqlx migrations, whether applied from code or with sqlx-cli.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use pg_semaphore::{Error, MIGRATIONS_TABLE, Semaphore};
use sqlx::PgPool;
use sqlx::migrate::Migrator;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// An application's own migrations, in a directory of their own.
fn app_migrations(tag: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("pgsem-app-migrations-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("1_users.sql"),
        "CREATE TABLE app_users (id bigint PRIMARY KEY, name text NOT NULL);\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("2_orders.sql"),
        "CREATE TABLE app_orders (id bigint PRIMARY KEY, user_id bigint REFERENCES app_users);\n",
    )
    .unwrap();
    dir
}

async fn versions(pool: &PgPool, table: &str) -> Vec<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM {table} ORDER BY version"
    )))
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| panic!("read {table}: {e}"))
}

/// The application's history holds its two migrations, ours all of ours.
async fn assert_separate_histories(pool: &PgPool) {
    assert_eq!(versions(pool, "public._sqlx_migrations").await, vec![1, 2]);
    assert_eq!(
        versions(pool, MIGRATIONS_TABLE).await,
        pg_semaphore::migrator()
            .iter()
            .map(|m| m.version)
            .collect::<Vec<_>>()
    );
}

/// The crate works on this database: a claim and a release.
async fn works(pool: &PgPool) -> TestResult {
    let sem = Semaphore::builder("after-migrate", 1).build(pool).await?;
    sem.try_acquire().await?.release().await?;
    Ok(())
}

#[tokio::test]
async fn migrating_twice_is_a_no_op() -> TestResult {
    let db = support::empty_db().await;
    pg_semaphore::migrate(&db.pool).await?;
    let first = versions(&db.pool, MIGRATIONS_TABLE).await;
    pg_semaphore::migrate(&db.pool).await?;
    assert_eq!(versions(&db.pool, MIGRATIONS_TABLE).await, first);
    assert!(!first.is_empty());
    works(&db.pool).await?;

    // Nothing outside our schema: no `public._sqlx_migrations` was created.
    let outside: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE c.relname IN ('_sqlx_migrations', 'semaphores', 'slots') AND n.nspname <> 'pgsemaphore'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(outside, 0);
    Ok(())
}

#[tokio::test]
async fn concurrent_migrations_from_many_processes_succeed() -> TestResult {
    let db = support::empty_db().await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let pool = support::another_pool(&db, 1).await;
        tasks.spawn(async move { pg_semaphore::migrate(&pool).await });
    }
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    works(&db.pool).await
}

#[tokio::test]
async fn our_migrations_live_beside_the_applications_own() -> TestResult {
    // Application first, then us, then the application again.
    let db = support::empty_db().await;
    let app = Migrator::new(app_migrations("a").as_path()).await?;
    app.run(&db.pool).await?;
    pg_semaphore::migrate(&db.pool).await?;
    app.run(&db.pool).await?; // would fail on unknown versions if histories mixed
    assert_separate_histories(&db.pool).await;
    works(&db.pool).await?;

    // Us first, then the application.
    let db = support::empty_db().await;
    pg_semaphore::migrate(&db.pool).await?;
    app.run(&db.pool).await?;
    pg_semaphore::migrate(&db.pool).await?;
    assert_eq!(
        versions(&db.pool, "public._sqlx_migrations").await,
        vec![1, 2]
    );
    works(&db.pool).await
}

fn crate_migrations() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations")
}

/// How to install the sqlx-cli these tests need, for the skip message.
const SQLX_CLI_INSTALL: &str = "cargo install sqlx-cli --version 0.9.0 --locked \
     --no-default-features --features postgres,rustls,sqlx-toml";

/// `sqlx migrate run --source migrations --config migrations/sqlx.toml`, into a
/// database that already has the application's own sqlx migrations, then the
/// crate on top, with the real sqlx-cli 0.9 (skipped, with one line saying how
/// to install it, where it is missing; `bash scripts/test.sh` installs it).
#[tokio::test]
async fn sqlx_cli_applies_the_same_files_into_our_own_history() -> TestResult {
    let Some(sqlx_cli) = support::require_tool_version("sqlx-cli", "sqlx", "0.9", SQLX_CLI_INSTALL)
    else {
        return Ok(());
    };
    let db = support::empty_db().await;
    Migrator::new(app_migrations("cli").as_path())
        .await?
        .run(&db.pool)
        .await?;

    let config = crate_migrations().join("sqlx.toml");
    let config_text = std::fs::read_to_string(&config)?;
    assert!(config_text.contains(&format!("table-name = \"{MIGRATIONS_TABLE}\"")));

    let url = support::server::url_for(&db.name);
    let out = Command::new(sqlx_cli)
        .args(["migrate", "run", "--source"])
        .arg(crate_migrations())
        .arg("--config")
        .arg(&config)
        .args(["--database-url", &url])
        .output()?;
    assert!(
        out.status.success(),
        "sqlx migrate run failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    assert_separate_histories(&db.pool).await;
    // Applied by the CLI, recognised by the crate: migrate() is a no-op, checksums match.
    pg_semaphore::migrate(&db.pool).await?;
    works(&db.pool).await
}

#[tokio::test]
async fn a_database_without_migrations_says_how_to_fix_it() -> TestResult {
    let db = support::empty_db().await;
    let err = Semaphore::builder("unmigrated", 1)
        .build(&db.pool)
        .await
        .expect_err("no schema yet");
    assert!(matches!(err, Error::MigrationsMissing { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("pg_semaphore::migrate(&pool)"),
        "{message}"
    );
    assert!(message.contains("sqlx migrate run"), "{message}");

    let audit = pg_semaphore::AuditLog::new(&db.pool)
        .holders("unmigrated")
        .await;
    assert!(matches!(audit, Err(Error::MigrationsMissing { .. })));
    assert!(matches!(
        pg_semaphore::reap(&db.pool).await,
        Err(Error::MigrationsMissing { .. })
    ));
    Ok(())
}

#[tokio::test]
async fn a_database_migrated_by_a_newer_version_is_reported() -> TestResult {
    let db = support::empty_db().await;
    pg_semaphore::migrate(&db.pool).await?;
    // A future version of the crate applied a migration this one does not know.
    sqlx::query(
        "INSERT INTO pgsemaphore._sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99991231000000, 'from the future', true, '\\x00', 0)",
    )
    .execute(&db.pool)
    .await?;
    let err = pg_semaphore::migrate(&db.pool)
        .await
        .expect_err("an unknown applied migration must be reported");
    assert!(matches!(err, Error::Migrate(_)), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("pg-semaphore migrations"), "{message}");
    assert!(message.contains("99991231000000"), "{message}");
    Ok(())
}
