//! Migrations: idempotent, namespaced, and independent of the application's
//! own sqlx migrations, whether applied from code or with sqlx-cli; a schema
//! applied through the application's own history adopted as it is; the
//! application role's start-up `migrate()` without DDL privileges; a schema
//! migrated by a newer version.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use pg_semaphore::{
    Error, MIGRATIONS_TABLE, MigrationHistory, SCHEMA_VERSION, SchemaError, Semaphore,
};
use sqlx::migrate::Migrator;
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};
use support::TestResult;
use support::roles::Roles;

/// An application's own migrations, in a directory of their own (removed
/// when the returned value is dropped).
fn app_migrations(tag: &str) -> ScratchDir {
    let dir = ScratchDir::new(&format!("app-migrations-{tag}"));
    std::fs::write(
        dir.0.join("1_users.sql"),
        "CREATE TABLE app_users (id bigint PRIMARY KEY, name text NOT NULL);\n",
    )
    .unwrap();
    std::fs::write(
        dir.0.join("2_orders.sql"),
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
    // The schema says which version it is: the one this crate builds.
    // Version 2 changed signatures that version 1's code calls: it, and
    // every version since (3 and 4 only added, 5 added an argument with a
    // default), is compatible with code for version 2 on.
    assert_eq!(schema_version(&db.pool).await, (SCHEMA_VERSION, 2));

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
    let app = Migrator::new(app_migrations("a").0.as_path()).await?;
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
    Migrator::new(app_migrations("cli").0.as_path())
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
    assert!(
        matches!(err, Error::Schema(SchemaError::Missing { .. })),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("pg_semaphore::migrate(&pool)"),
        "{message}"
    );
    assert!(message.contains("sqlx migrate run"), "{message}");

    let audit = pg_semaphore::AuditLog::new(&db.pool)
        .holders("unmigrated")
        .await;
    assert!(matches!(
        audit,
        Err(Error::Schema(SchemaError::Missing { .. }))
    ));
    assert!(matches!(
        pg_semaphore::reap(&db.pool).await,
        Err(Error::Schema(SchemaError::Missing { .. }))
    ));
    Ok(())
}

/// `pgsemaphore.schema_version()`.
async fn schema_version(pool: &PgPool) -> (i32, i32) {
    sqlx::query_as("SELECT o_version, o_compatible_from FROM pgsemaphore.schema_version()")
        .fetch_one(pool)
        .await
        .expect("read the schema version")
}

/// Makes the schema claim another version, as a migration of another
/// version of the crate would (`CREATE OR REPLACE` keeps owner and grants).
async fn pretend_version(pool: &PgPool, version: i32, compatible_from: i32) {
    sqlx::query(AssertSqlSafe(format!(
        "CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
         RETURNS TABLE (o_version integer, o_compatible_from integer)
         LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp
         AS $$ SELECT {version}, {compatible_from} $$"
    )))
    .execute(pool)
    .await
    .expect("replace schema_version()");
}

/// Everything that could be written: our history (its rows, if it exists),
/// and every relation and function in the schema.
async fn snapshot(pool: &PgPool) -> (Option<Vec<String>>, Vec<String>) {
    let history = if has_our_history(pool).await {
        Some(
            sqlx::query_scalar(
                "SELECT concat_ws(' ', version, description, installed_on, success,
                                  encode(checksum, 'hex'), execution_time)
                   FROM pgsemaphore._sqlx_migrations ORDER BY version",
            )
            .fetch_all(pool)
            .await
            .expect("read our history"),
        )
    } else {
        None
    };
    (history, support::catalog::objects(pool).await)
}

/// Whether `pgsemaphore._sqlx_migrations` exists.
async fn has_our_history(pool: &PgPool) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                         WHERE n.nspname = 'pgsemaphore' AND c.relname = '_sqlx_migrations')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A scratch directory under the system's temporary directory, removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(tag: &str) -> ScratchDir {
        let dir = std::env::temp_dir().join(format!("pgsem-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        ScratchDir(dir)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs sqlx-cli and asserts that it succeeded; returns what it printed.
fn run_sqlx_cli(cli: &Path, dir: &Path, args: &[&str]) -> String {
    let out = Command::new(cli)
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run sqlx-cli");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "sqlx {args:?} failed: {printed}");
    printed
}

/// The most common sqlx workflow: the application copies our `.sql` files
/// into its own `migrations/` and runs plain `sqlx migrate run` (the real
/// sqlx-cli, from the application's directory, with no sqlx.toml). Then
/// `migrate()` at start-up adopts the schema as it is, writing nothing (no
/// `relation "semaphores" already exists`, no empty history of ours left
/// behind), and the crate works. When the crate needs a newer schema, the
/// error says which files to apply in the application's own history.
#[tokio::test]
async fn a_schema_applied_through_the_applications_own_history_is_adopted() -> TestResult {
    let Some(sqlx_cli) = support::require_tool_version("sqlx-cli", "sqlx", "0.9", SQLX_CLI_INSTALL)
    else {
        return Ok(());
    };
    let db = support::empty_db().await;
    let app = ScratchDir::new("own-history");
    let migrations = app.0.join("migrations");
    std::fs::create_dir(&migrations)?;
    std::fs::write(
        migrations.join("1_users.sql"),
        "CREATE TABLE app_users (id bigint PRIMARY KEY, name text NOT NULL);\n",
    )?;
    // `cp <pg-semaphore>/migrations/*.sql migrations/`
    let mut ours = Vec::new();
    for entry in std::fs::read_dir(crate_migrations())? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "sql") {
            std::fs::copy(&path, migrations.join(path.file_name().unwrap()))?;
            ours.push(path.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    ours.sort();
    let url = support::server::url_for(&db.name);
    run_sqlx_cli(
        &sqlx_cli,
        &app.0,
        &["migrate", "run", "--database-url", &url],
    );
    let mut expected = vec![1];
    expected.extend(pg_semaphore::migrator().iter().map(|m| m.version));
    assert_eq!(
        versions(&db.pool, "public._sqlx_migrations").await,
        expected
    );
    assert!(!has_our_history(&db.pool).await);

    // Start-up: adopted, nothing written.
    let before = snapshot(&db.pool).await;
    pg_semaphore::migrate(&db.pool).await?;
    pg_semaphore::migrate(&db.pool).await?;
    assert_eq!(snapshot(&db.pool).await, before);
    assert!(!has_our_history(&db.pool).await, "no empty history of ours");
    works(&db.pool).await?;
    // The application's history is still its own: sqlx-cli has nothing to do.
    run_sqlx_cli(
        &sqlx_cli,
        &app.0,
        &["migrate", "run", "--database-url", &url],
    );
    assert_eq!(
        versions(&db.pool, "public._sqlx_migrations").await,
        expected
    );

    // A later crate version needing a newer schema (faked: the schema says it
    // is older): the error says what to apply, and where.
    pretend_version(&db.pool, SCHEMA_VERSION - 1, SCHEMA_VERSION - 1).await;
    let before = snapshot(&db.pool).await;
    let err = pg_semaphore::migrate(&db.pool)
        .await
        .expect_err("an outdated schema in the application's history");
    match &err {
        Error::Schema(SchemaError::Outdated {
            found,
            required,
            history: MigrationHistory::Application,
            pending,
        }) => {
            assert_eq!((*found, *required), (SCHEMA_VERSION - 1, SCHEMA_VERSION));
            // The files after the version found: the last one.
            assert_eq!(pending, &ours[ours.len() - 1..]);
        }
        other => panic!("expected SchemaOutdated, got {other:?}"),
    }
    let message = err.to_string();
    println!("outdated, own history: {message}");
    assert!(
        message.contains(&format!(
            "apply migrations {} in your own history",
            ours[ours.len() - 1]
        )),
        "{message}"
    );
    assert!(message.contains("sqlx migrate run"), "{message}");
    assert_eq!(snapshot(&db.pool).await, before, "nothing written");
    Ok(())
}

/// The README's three roles: the owner (`CREATE` on the database) runs the
/// migrations; the application role, with exactly the README's grants,
/// calls `migrate()` at start-up like every process. On an up-to-date schema
/// that succeeds with no DDL privilege and writes nothing; on a missing or
/// outdated one it fails naming the role that must run it, writing nothing.
#[tokio::test]
async fn migrate_under_the_application_role_needs_no_ddl_and_names_the_owner() -> TestResult {
    let db = support::empty_db().await;
    let roles = Roles::create(&db, &["owner", "app", "op"]).await?;
    let result = async {
        let (owner, app) = (roles.name("owner"), roles.name("app"));
        sqlx::query(AssertSqlSafe(format!(
            r#"GRANT CREATE ON DATABASE "{}" TO "{owner}""#,
            db.name
        )))
        .execute(&db.pool)
        .await?;
        let app_pool = roles.pool(&db, "app").await?;
        let owner_pool = roles.pool(&db, "owner").await?;

        // No schema yet: the application role may not create it.
        let err = pg_semaphore::migrate(&app_pool)
            .await
            .expect_err("the application role cannot create the schema");
        println!("missing, app role: {err}");
        assert!(
            matches!(&err, Error::Schema(SchemaError::NotPermitted { role, owner: None, found: None, .. }) if *role == app),
            "{err:?}"
        );
        assert!(err.to_string().contains("may not install it"), "{err}");
        let schemas: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = 'pgsemaphore'")
                .fetch_one(&db.pool)
                .await?;
        assert_eq!(schemas, 0, "nothing written");

        // The owner migrates and grants the README's privileges.
        pg_semaphore::migrate(&owner_pool).await?;
        owner_pool
            .execute(AssertSqlSafe(support::documented_grants(&app, &roles.name("op"))))
            .await?;

        // The application role: exactly those grants, no DDL anywhere.
        let (create_db, create_schema): (bool, bool) = sqlx::query_as(
            "SELECT has_database_privilege(current_database(), 'CREATE'),
                    has_schema_privilege('pgsemaphore', 'CREATE')",
        )
        .fetch_one(&app_pool)
        .await?;
        assert!(!create_db && !create_schema);
        let before = snapshot(&db.pool).await;
        pg_semaphore::migrate(&app_pool).await?;
        assert_eq!(snapshot(&db.pool).await, before, "nothing written");
        works(&app_pool).await?;

        // An outdated schema (faked: it says it is older): the application
        // role is told which role must upgrade it.
        pretend_version(&owner_pool, SCHEMA_VERSION - 1, SCHEMA_VERSION - 1).await;
        let before = snapshot(&db.pool).await;
        let err = pg_semaphore::migrate(&app_pool)
            .await
            .expect_err("the application role cannot upgrade the schema");
        println!("outdated, app role: {err}");
        match &err {
            Error::Schema(SchemaError::NotPermitted {
                role,
                owner: Some(named),
                found: Some(found),
                required,
            }) => {
                assert_eq!((role, named), (&app, &owner));
                assert_eq!((*found, *required), (SCHEMA_VERSION - 1, SCHEMA_VERSION));
            }
            other => panic!("expected MigrationNotPermitted, got {other:?}"),
        }
        assert!(err.to_string().contains(&format!("as role {owner:?}")), "{err}");
        assert_eq!(snapshot(&db.pool).await, before, "nothing written");
        app_pool.close().await;
        owner_pool.close().await;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    roles.drop_all().await?;
    result
}

/// An owner without `CREATE` on the database cannot install the schema,
/// even into an empty `pgsemaphore` schema made for it (the baseline
/// migration runs `CREATE SCHEMA IF NOT EXISTS`, which PostgreSQL checks
/// against the database's privilege even when the schema exists): the error
/// says so before anything is written; with the privilege it works.
#[tokio::test]
async fn installing_the_schema_needs_create_on_the_database() -> TestResult {
    let db = support::empty_db().await;
    let roles = Roles::create(&db, &["owner"]).await?;
    let result = async {
        let owner = roles.name("owner");
        sqlx::query(AssertSqlSafe(format!(
            r#"CREATE SCHEMA pgsemaphore AUTHORIZATION "{owner}""#
        )))
        .execute(&db.pool)
        .await?;
        let pool = roles.pool(&db, "owner").await?;
        let before = snapshot(&db.pool).await;
        let err = pg_semaphore::migrate(&pool)
            .await
            .expect_err("no CREATE on the database");
        println!("empty schema, owner without CREATE on the database: {err}");
        assert!(
            matches!(&err, Error::Schema(SchemaError::NotPermitted { role, found: None, .. }) if *role == owner),
            "{err:?}"
        );
        assert!(err.to_string().contains("CREATE on the database"), "{err}");
        assert_eq!(snapshot(&db.pool).await, before, "nothing written");

        sqlx::query(AssertSqlSafe(format!(
            r#"GRANT CREATE ON DATABASE "{}" TO "{owner}""#,
            db.name
        )))
        .execute(&db.pool)
        .await?;
        pg_semaphore::migrate(&pool).await?;
        pg_semaphore::migrate(&pool).await?;
        assert_eq!(schema_version(&pool).await.0, SCHEMA_VERSION);
        works(&pool).await?;
        pool.close().await;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    roles.drop_all().await?;
    result
}

/// A process of an older crate version meets a schema migrated by a newer
/// one (faked: `schema_version()` replaced and a newer migration recorded in
/// the history, as a newer version's migration would). If the newer schema
/// declares itself compatible, `migrate()` succeeds writing nothing (sqlx's
/// migrator would report the unknown applied migration) and the crate works;
/// otherwise a clear error, still writing nothing.
#[tokio::test]
async fn a_schema_migrated_by_a_newer_version_is_used_only_if_compatible() -> TestResult {
    let db = support::migrated_db().await;
    pretend_version(&db.pool, SCHEMA_VERSION + 1, SCHEMA_VERSION).await;
    sqlx::query(
        "INSERT INTO pgsemaphore._sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (20991231000001, 'a newer migration', true, '\\x00', 0)",
    )
    .execute(&db.pool)
    .await?;

    let before = snapshot(&db.pool).await;
    pg_semaphore::migrate(&db.pool).await?;
    assert_eq!(snapshot(&db.pool).await, before, "nothing written");
    works(&db.pool).await?;
    // sqlx's migrator as is refuses the unknown migration; told to ignore it,
    // it has nothing to do (what `sqlx migrate run --ignore-missing` does).
    // (On a connection of its own: sqlx's migrator returns an error without
    // releasing its advisory lock, which a pooled connection would keep.)
    let mut conn = PgConnection::connect_with(&db.options).await?;
    let strict = pg_semaphore::migrator().run(&mut conn).await;
    conn.close().await?;
    assert!(
        matches!(
            strict,
            Err(sqlx::migrate::MigrateError::VersionMissing(20991231000001))
        ),
        "{strict:?}"
    );
    let mut lenient = pg_semaphore::migrator();
    lenient.set_ignore_missing(true);
    lenient.run(&db.pool).await?;
    assert_eq!(snapshot(&db.pool).await, before);

    // A newer schema this version can no longer use.
    pretend_version(&db.pool, SCHEMA_VERSION + 2, SCHEMA_VERSION + 1).await;
    let before = snapshot(&db.pool).await;
    let err = pg_semaphore::migrate(&db.pool)
        .await
        .expect_err("an incompatible newer schema");
    println!("newer, incompatible: {err}");
    match &err {
        Error::Schema(SchemaError::TooNew {
            found,
            compatible_from,
            supported,
        }) => assert_eq!(
            (*found, *compatible_from, *supported),
            (SCHEMA_VERSION + 2, SCHEMA_VERSION + 1, SCHEMA_VERSION)
        ),
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
    assert!(
        err.to_string()
            .contains("upgrade pg-semaphore in this application"),
        "{err}"
    );
    assert_eq!(snapshot(&db.pool).await, before, "nothing written");
    Ok(())
}

/// A `pgsemaphore` schema that pg-semaphore did not create is left alone.
#[tokio::test]
async fn a_foreign_pgsemaphore_schema_is_left_alone() -> TestResult {
    let db = support::empty_db().await;
    sqlx::raw_sql(
        "CREATE SCHEMA pgsemaphore; CREATE TABLE pgsemaphore.semaphores (id int PRIMARY KEY)",
    )
    .execute(&db.pool)
    .await?;
    let before = snapshot(&db.pool).await;
    let err = pg_semaphore::migrate(&db.pool)
        .await
        .expect_err("somebody else's schema");
    println!("foreign: {err}");
    assert!(
        matches!(err, Error::Schema(SchemaError::Unrecognized { objects: 1 })),
        "{err:?}"
    );
    assert_eq!(snapshot(&db.pool).await, before, "nothing written");
    Ok(())
}

/// Version 5 (fairness keys) upgrades a live queue: the waiters queued
/// before it keep their order (their turns follow their ids, per semaphore
/// and priority), the new `enqueue` keeps the grants of the signature it
/// replaces, and a call of the old shape (seven arguments, positional),
/// from a role granted only the old signature, still works and queues
/// behind them.
#[tokio::test]
async fn version_5_keeps_a_live_queues_order_and_the_enqueue_grant() -> TestResult {
    let db = support::empty_db().await;
    let roles = Roles::create(&db, &["app"]).await?;
    let result = async {
        let mut files: Vec<PathBuf> = std::fs::read_dir(crate_migrations())?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        files.retain(|path| path.extension().is_some_and(|ext| ext == "sql"));
        files.sort();
        let (before, upgrade) = files.split_at(4);
        assert!(
            upgrade[0].ends_with("20261127000001_pgsemaphore_fair_keys.sql"),
            "{upgrade:?}"
        );
        for file in before {
            sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(file)?))
                .execute(&db.pool)
                .await?;
        }
        assert_eq!(schema_version(&db.pool).await, (4, 2));
        let app = roles.name("app");
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"GRANT USAGE ON SCHEMA pgsemaphore TO "{app}";
               GRANT SELECT ON ALL TABLES IN SCHEMA pgsemaphore TO "{app}";
               GRANT EXECUTE ON FUNCTION
                   pgsemaphore.enqueue(text, integer, smallint, text, integer, interval, bytea)
                 TO "{app}";"#
        )))
        .execute(&db.pool)
        .await?;
        sqlx::query("SELECT * FROM pgsemaphore.open('upgraded', 1, '90 s')")
            .execute(&db.pool)
            .await?;
        let old_shape = "SELECT o_ticket FROM pgsemaphore.enqueue('upgraded', 1, $1, $2, NULL, \
                         '60 s', $3)";
        // Queued at version 4: high, low, high, high.
        for (holder, priority) in [("w0", 1i16), ("w1", 0), ("w2", 1), ("w3", 1)] {
            let mut token = holder.as_bytes().to_vec();
            token.resize(16, b'.');
            sqlx::query(old_shape)
                .bind(priority)
                .bind(holder)
                .bind(token)
                .execute(&db.pool)
                .await?;
        }

        sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(&upgrade[0])?))
            .execute(&db.pool)
            .await?;
        assert_eq!(schema_version(&db.pool).await, (5, 2));
        let turns: Vec<(String, i64)> = sqlx::query_as(
            "SELECT holder, turn FROM pgsemaphore.waiters ORDER BY priority DESC, turn, id",
        )
        .fetch_all(&db.pool)
        .await?;
        let expected = [("w0", 0), ("w2", 1), ("w3", 2), ("w1", 0)];
        assert_eq!(
            turns,
            expected.map(|(h, t)| (h.to_owned(), t)),
            "the served order is the arrival order, high priority first"
        );
        let (new_granted, old_gone): (bool, bool) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT has_function_privilege('{app}',
                        'pgsemaphore.enqueue(text, integer, smallint, text, integer, interval, bytea, text)',
                        'EXECUTE'),
                    to_regprocedure('pgsemaphore.enqueue(text, integer, smallint, text, integer, interval, bytea)') IS NULL"
        )))
        .fetch_one(&db.pool)
        .await?;
        assert!(new_granted, "the old signature's grant was not carried over");
        assert!(old_gone, "the old signature would make old calls ambiguous");

        // Code built for version 4, under the application role.
        let app_pool = roles.pool(&db, "app").await?;
        let (ticket,): (Option<i64>,) = sqlx::query_as(old_shape)
            .bind(1i16)
            .bind("w4")
            .bind(b"w4-after-upgrade".to_vec())
            .fetch_one(&app_pool)
            .await?;
        app_pool.close().await;
        let (last, turn): (String, i64) = sqlx::query_as(
            "SELECT holder, turn FROM pgsemaphore.waiters WHERE priority = 1
              ORDER BY turn DESC, id DESC LIMIT 1",
        )
        .fetch_one(&db.pool)
        .await?;
        assert!(ticket.is_some());
        assert_eq!((last.as_str(), turn), ("w4", 3), "queued behind the upgraded waiters");
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    roles.drop_all().await?;
    result
}

/// Version 6 (a token bucket that waits) only adds
/// `token_bucket_reserve`, granted to whoever may run `token_bucket`: a
/// role granted as version 5's README said reserves after the upgrade
/// without new grants, on a key its plain checks already used; PUBLIC
/// still runs nothing.
#[tokio::test]
async fn version_6_grants_the_reservation_to_token_bucket_callers() -> TestResult {
    let db = support::empty_db().await;
    let roles = Roles::create(&db, &["app"]).await?;
    let result = async {
        let mut files: Vec<PathBuf> = std::fs::read_dir(crate_migrations())?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        files.retain(|path| path.extension().is_some_and(|ext| ext == "sql"));
        files.sort();
        let (before, upgrade) = files.split_at(5);
        assert!(
            upgrade[0].ends_with("20261128000001_pgsemaphore_waiting_bucket.sql"),
            "{upgrade:?}"
        );
        for file in before {
            sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(file)?))
                .execute(&db.pool)
                .await?;
        }
        assert_eq!(schema_version(&db.pool).await, (5, 2));
        let app = roles.name("app");
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"GRANT USAGE ON SCHEMA pgsemaphore TO "{app}";
               GRANT EXECUTE ON FUNCTION
                   pgsemaphore.token_bucket(text, text, double precision, double precision, double precision)
                 TO "{app}";"#
        )))
        .execute(&db.pool)
        .await?;
        let app_pool = roles.pool(&db, "app").await?;
        let check = "SELECT o_allowed FROM pgsemaphore.token_bucket('l', 'k', 0.001, 2, 1)";
        assert!(sqlx::query_scalar::<_, bool>(check).fetch_one(&app_pool).await?);

        sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(&upgrade[0])?))
            .execute(&db.pool)
            .await?;
        assert_eq!(schema_version(&db.pool).await, (6, 2));
        let public: bool = sqlx::query_scalar(
            "SELECT has_function_privilege('public',
                 'pgsemaphore.token_bucket_reserve(text, text, double precision, double precision, double precision, interval)',
                 'EXECUTE')",
        )
        .fetch_one(&db.pool)
        .await?;
        assert!(!public, "PUBLIC may reserve");
        let reserve = "SELECT o_allowed, o_wait_us FROM pgsemaphore.token_bucket_reserve(\
                       'l', 'k', 0.001, 2, 1, '1 s')";
        let (allowed, wait_us): (bool, i64) = sqlx::query_as(reserve).fetch_one(&app_pool).await?;
        assert_eq!((allowed, wait_us), (true, 0), "the key's second token");
        let (allowed, _): (bool, i64) = sqlx::query_as(reserve).fetch_one(&app_pool).await?;
        assert!(!allowed, "the third token is 1,000 s away, not within 1 s");
        app_pool.close().await;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    roles.drop_all().await?;
    result
}

/// Version 8 (several limits at once) adds `claim_all` and `release_all`,
/// granted to whoever may run `claim`, and `release_all_then_wake`, granted
/// to whoever may run `release_then_wake`: a role granted as the README said
/// before the upgrade claims two semaphores at once and releases them after
/// it, without new grants, and claims made before it stay live and
/// ungrouped; PUBLIC still runs nothing.
#[tokio::test]
async fn version_8_grants_the_multi_limit_claim_to_claim_callers() -> TestResult {
    let db = support::empty_db().await;
    let roles = Roles::create(&db, &["app"]).await?;
    let result = async {
        let mut files: Vec<PathBuf> = std::fs::read_dir(crate_migrations())?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        files.retain(|path| path.extension().is_some_and(|ext| ext == "sql"));
        files.sort();
        let upgrade = files
            .iter()
            .position(|path| path.ends_with("20261129000002_pgsemaphore_claim_all.sql"))
            .ok_or("the version 8 migration is missing")?;
        for file in &files[..upgrade] {
            sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(file)?))
                .execute(&db.pool)
                .await?;
        }
        let app = roles.name("app");
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"GRANT USAGE ON SCHEMA pgsemaphore TO "{app}";
               GRANT SELECT ON ALL TABLES IN SCHEMA pgsemaphore TO "{app}";
               GRANT EXECUTE ON FUNCTION
                   pgsemaphore.open(text, integer, interval, boolean),
                   pgsemaphore.claim(text, text, interval, jsonb, bytea, integer, smallint, integer,
                                     bigint, bytea, interval)
                 TO "{app}";
               GRANT EXECUTE ON PROCEDURE
                   pgsemaphore.release_then_wake(bigint[], bytea, boolean, text, bigint, timestamptz)
                 TO "{app}";
               SELECT * FROM pgsemaphore.open('a', 2, '60 s');
               SELECT * FROM pgsemaphore.open('b', 2, '60 s');"#
        )))
        .execute(&db.pool)
        .await?;
        let app_pool = roles.pool(&db, "app").await?;
        let (before,): (String,) = sqlx::query_as(
            "SELECT o_status FROM pgsemaphore.claim('a', 'old', NULL, NULL, 'claimed-before-v8')",
        )
        .fetch_one(&app_pool)
        .await?;
        assert_eq!(before, "claimed");

        sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(&files[upgrade])?))
            .execute(&db.pool)
            .await?;
        assert_eq!(schema_version(&db.pool).await, (8, 2));
        let public: bool = sqlx::query_scalar(
            "SELECT has_function_privilege('public',
                 'pgsemaphore.claim_all(text[], text, interval, jsonb, bytea, integer[])', 'EXECUTE')
                 OR has_function_privilege('public',
                 'pgsemaphore.release_all(bigint[], bytea, boolean)', 'EXECUTE')",
        )
        .fetch_one(&db.pool)
        .await?;
        assert!(!public, "PUBLIC may claim several at once");
        let (status, ids): (String, Option<Vec<i64>>) = sqlx::query_as(
            "SELECT o_status, o_ids FROM pgsemaphore.claim_all(ARRAY['b', 'a'], 'new', NULL, NULL, \
             'claimed-after-v8')",
        )
        .fetch_one(&app_pool)
        .await?;
        assert_eq!(status, "claimed");
        let (outcome,): (String,) = sqlx::query_as(
            "CALL pgsemaphore.release_all_then_wake($1, 'claimed-after-v8', false)",
        )
        .bind(ids.ok_or("claimed without ids")?)
        .fetch_one(&app_pool)
        .await?;
        assert_eq!(outcome, "released");
        app_pool.close().await;
        let (live, grouped): (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(group_id) FROM pgsemaphore.live_slots",
        )
        .fetch_one(&db.pool)
        .await?;
        assert_eq!((live, grouped), (1, 0), "the claim made before the upgrade, ungrouped");
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    roles.drop_all().await?;
    result
}

/// Version 10 (windows that wait) adds `fixed_window_reserve` and
/// `sliding_window_reserve`, granted to whoever may run `fixed_window`: a
/// role granted as version 6's README said books after the upgrade without
/// new grants, on a key its plain checks already used (the booking counts
/// them); the internal `*_book` functions stay the owner's; PUBLIC still
/// runs nothing.
#[tokio::test]
async fn version_10_grants_the_window_reservations_to_window_callers() -> TestResult {
    let db = support::empty_db().await;
    let roles = Roles::create(&db, &["app"]).await?;
    let result = async {
        let mut files: Vec<PathBuf> = std::fs::read_dir(crate_migrations())?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        files.retain(|path| path.extension().is_some_and(|ext| ext == "sql"));
        files.sort();
        let upgrade = files
            .iter()
            .position(|f| f.ends_with("20261129000004_pgsemaphore_limiter_ledger.sql"))
            .expect("the version 10 migration");
        for file in &files[..upgrade] {
            sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(file)?))
                .execute(&db.pool)
                .await?;
        }
        let app = roles.name("app");
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"GRANT USAGE ON SCHEMA pgsemaphore TO "{app}";
               GRANT EXECUTE ON FUNCTION
                   pgsemaphore.fixed_window(text, text, bigint, interval, bigint),
                   pgsemaphore.sliding_window(text, text, bigint, interval, bigint)
                 TO "{app}";"#
        )))
        .execute(&db.pool)
        .await?;
        let app_pool = roles.pool(&db, "app").await?;
        let check = "SELECT o_allowed FROM pgsemaphore.fixed_window('l', 'k', 2, '1 hour', 1)";
        assert!(sqlx::query_scalar::<_, bool>(check).fetch_one(&app_pool).await?);

        sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(&files[upgrade])?))
            .execute(&db.pool)
            .await?;
        assert_eq!(schema_version(&db.pool).await, (10, 2));
        for function in ["fixed_window_reserve", "sliding_window_reserve", "fixed_window_book"] {
            let public: bool = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT has_function_privilege('public',
                     'pgsemaphore.{function}(text, text, bigint, interval, bigint, interval)', 'EXECUTE')"
            )))
            .fetch_one(&db.pool)
            .await?;
            assert!(!public, "PUBLIC may run {function}");
        }
        let book: bool = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT has_function_privilege('{app}',
                 'pgsemaphore.fixed_window_book(text, text, bigint, interval, bigint, interval)', 'EXECUTE')"
        )))
        .fetch_one(&db.pool)
        .await?;
        assert!(!book, "the application may run the internal fixed_window_book");
        let reserve = "SELECT o_allowed, o_wait_us FROM pgsemaphore.fixed_window_reserve(\
                       'l', 'k', 2, '1 hour', 1, '1 s')";
        let (allowed, wait_us): (bool, i64) = sqlx::query_as(reserve).fetch_one(&app_pool).await?;
        assert_eq!((allowed, wait_us), (true, 0), "the window's second permit");
        let (allowed, _): (bool, i64) = sqlx::query_as(reserve).fetch_one(&app_pool).await?;
        assert!(!allowed, "the third is in the next window, an hour away, not within 1 s");
        let sliding = "SELECT o_allowed FROM pgsemaphore.sliding_window_reserve(\
                       'l', 'k', 2, '1 hour', 1, '1 s')";
        assert!(sqlx::query_scalar::<_, bool>(sliding).fetch_one(&app_pool).await?);
        app_pool.close().await;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    roles.drop_all().await?;
    result
}

/// Version 7 (semaphore families) grants `open_family` and
/// `open_family_key` to whoever may run `open`, and the families' operator
/// functions to whoever may run `configure`: roles granted as version 6's
/// README said use families after the upgrade without new grants; PUBLIC
/// still runs nothing. A semaphore named with a leading `@` before the
/// upgrade keeps working; a new one is refused.
#[tokio::test]
async fn version_7_grants_families_to_open_and_configure_callers() -> TestResult {
    let db = support::empty_db().await;
    let roles = Roles::create(&db, &["app", "op"]).await?;
    let result = async {
        let mut files: Vec<PathBuf> = std::fs::read_dir(crate_migrations())?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        files.retain(|path| path.extension().is_some_and(|ext| ext == "sql"));
        files.sort();
        let (before, upgrade) = files.split_at(6);
        assert!(
            upgrade[0].ends_with("20261129000001_pgsemaphore_families.sql"),
            "{upgrade:?}"
        );
        for file in before {
            sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(file)?))
                .execute(&db.pool)
                .await?;
        }
        assert_eq!(schema_version(&db.pool).await, (6, 2));
        let (app, op) = (roles.name("app"), roles.name("op"));
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"GRANT USAGE ON SCHEMA pgsemaphore TO "{app}", "{op}";
               GRANT SELECT ON ALL TABLES IN SCHEMA pgsemaphore TO "{app}";
               GRANT EXECUTE ON FUNCTION pgsemaphore.open(text, integer, interval, boolean) TO "{app}";
               GRANT EXECUTE ON FUNCTION
                   pgsemaphore.configure(text, integer, interval, boolean, boolean) TO "{op}";"#
        )))
        .execute(&db.pool)
        .await?;
        sqlx::query("SELECT * FROM pgsemaphore.open('@legacy', 3, '10 s')")
            .execute(&db.pool)
            .await?;

        sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(&upgrade[0])?))
            .execute(&db.pool)
            .await?;
        assert_eq!(schema_version(&db.pool).await, (7, 2));
        let public: bool = sqlx::query_scalar(
            "SELECT has_function_privilege('public', 'pgsemaphore.open_family_key(text, text)', 'EXECUTE')
                 OR has_function_privilege('public', 'pgsemaphore.set_family_rule(text, text, text, integer)', 'EXECUTE')",
        )
        .fetch_one(&db.pool)
        .await?;
        assert!(!public, "PUBLIC may use families");
        let app_pool = roles.pool(&db, "app").await?;
        let op_pool = roles.pool(&db, "op").await?;
        sqlx::query("SELECT * FROM pgsemaphore.open_family('tenants', 2, '10 s', '0')")
            .execute(&app_pool)
            .await?;
        sqlx::query("SELECT pgsemaphore.set_family_rule('tenants', 'key', 't-1', 5)")
            .execute(&op_pool)
            .await?;
        let capacity: i32 =
            sqlx::query_scalar("SELECT o_capacity FROM pgsemaphore.open_family_key('tenants', 't-1')")
                .fetch_one(&app_pool)
                .await?;
        assert_eq!(capacity, 5);
        let rules: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pgsemaphore.families JOIN pgsemaphore.family_rules ON family = name",
        )
        .fetch_one(&app_pool)
        .await?;
        assert_eq!(rules, 1, "a role that read the tables reads the families' too");
        let (capacity, created): (i32, bool) =
            sqlx::query_as("SELECT o_capacity, o_created FROM pgsemaphore.open('@legacy', 1, '10 s')")
                .fetch_one(&app_pool)
                .await?;
        assert_eq!((capacity, created), (3, false), "the old '@' semaphore keeps working");
        let refused = sqlx::query("SELECT * FROM pgsemaphore.open('@new', 1, '10 s')")
            .execute(&app_pool)
            .await;
        let code = refused
            .err()
            .and_then(|e| e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned()));
        assert_eq!(code.as_deref(), Some("22023"));
        app_pool.close().await;
        op_pool.close().await;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    roles.drop_all().await?;
    result
}
