//! Migrations: idempotent, namespaced, and independent of the application's
//! own sqlx migrations, whether applied from code or with sqlx-cli; a schema
//! applied through the application's own history adopted as it is; the
//! application role's start-up `migrate()` without DDL privileges; a schema
//! migrated by a newer version; the 0.1 baseline frozen as released, and
//! upgraded from.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use pg_semaphore::{
    Error, Semaphore,
    schema::{MIGRATIONS_TABLE, MigrationHistory, SCHEMA_VERSION, SchemaError},
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
        pg_semaphore::schema::migrator()
            .iter()
            .map(|m| m.version)
            .collect::<Vec<_>>()
    );
}

/// The crate works on this database: a claim and a release.
async fn works(pool: &PgPool) -> TestResult {
    let sem = Semaphore::builder("after-migrate", 1)
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;
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
    // The schema says which version it is: the one this crate builds, the
    // 0.1 baseline, usable by code for version 1 on.
    assert_eq!(schema_version(&db.pool).await, (SCHEMA_VERSION, 1));

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
        .build(&pg_semaphore::Client::new(db.pool.clone()))
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

    let audit = pg_semaphore::audit::AuditLog::new(&db.pool)
        .holders("unmigrated")
        .await;
    assert!(matches!(
        audit,
        Err(Error::Schema(SchemaError::Missing { .. }))
    ));
    assert!(matches!(
        pg_semaphore::admin::reap(&db.pool).await,
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
    expected.extend(pg_semaphore::schema::migrator().iter().map(|m| m.version));
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
    // is older, version 0, which the whole baseline brings up to date): the
    // error says what to apply, and where.
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
            // The files after the version found: here, all of them.
            assert_eq!(pending, &ours);
        }
        other => panic!("expected SchemaOutdated, got {other:?}"),
    }
    let message = err.to_string();
    println!("outdated, own history: {message}");
    assert!(
        message.contains(&format!(
            "apply migrations {} in your own history",
            ours.join(", ")
        )),
        "{message}"
    );
    assert!(message.contains("sqlx migrate run"), "{message}");
    assert_eq!(snapshot(&db.pool).await, before, "nothing written");
    Ok(())
}

/// The guide's three roles (docs/guide/operations.md): the owner (`CREATE` on the database) runs the
/// migrations; the application role, with exactly the guide's grants,
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

        // The owner migrates and grants the guide's privileges.
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
    let strict = pg_semaphore::schema::migrator().run(&mut conn).await;
    conn.close().await?;
    assert!(
        matches!(
            strict,
            Err(sqlx::migrate::MigrateError::VersionMissing(20991231000001))
        ),
        "{strict:?}"
    );
    let mut lenient = pg_semaphore::schema::migrator();
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

/// The 0.1 baseline as released, kept as the fixture the first real
/// upgrade starts from.
fn baseline_0_1() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/migrations-0.1")
}

/// The `.sql` files of `dir`, sorted by name (sqlx's order), with their bytes.
fn sql_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "sql"))
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// A migrator of our own history over the `.sql` files of `dir`, as a
/// release of the crate built from them would run it.
async fn migrator_of(dir: &Path) -> Result<Migrator, sqlx::migrate::MigrateError> {
    let mut migrator = Migrator::new(dir).await?;
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator.create_schema(pg_semaphore::schema::SCHEMA);
    Ok(migrator)
}

/// A released migration is never edited, and none is inserted before it:
/// `migrations/` begins with the 0.1 baseline's files, byte for byte (sqlx
/// and refinery checksum them: an edited one is refused on every database
/// that applied it). A schema change after a release is a new file after
/// them.
#[test]
fn released_migrations_are_never_edited() {
    let released = sql_files(&baseline_0_1());
    assert_eq!(released.len(), 7, "the 0.1 baseline is seven files");
    let current = sql_files(&crate_migrations());
    assert!(
        current.len() >= released.len(),
        "a released file was removed"
    );
    for ((name, bytes), (current_name, current_bytes)) in released.iter().zip(&current) {
        assert_eq!(
            current_name, name,
            "migrations/ must begin with the released files"
        );
        assert!(
            current_bytes == bytes,
            "migrations/{name} differs from the released tests/fixtures/migrations-0.1/{name}: \
             write a new migration instead"
        );
    }
}

/// A database migrated by the 0.1 release, then by this crate's
/// `migrate()`, ends with exactly the schema a fresh database gets (the
/// catalog, comments and privileges included), its history holding every
/// file once.
#[tokio::test]
async fn a_database_migrated_by_0_1_upgrades_to_the_fresh_schema() -> TestResult {
    let fresh = support::migrated_db().await;
    let upgraded = support::empty_db().await;
    migrator_of(&baseline_0_1())
        .await?
        .run(&upgraded.pool)
        .await?;
    assert_eq!(schema_version(&upgraded.pool).await, (1, 1));
    pg_semaphore::migrate(&upgraded.pool).await?;
    assert_eq!(schema_version(&upgraded.pool).await.0, SCHEMA_VERSION);
    support::catalog::assert_same(&fresh.pool, &upgraded.pool).await;
    assert_eq!(
        versions(&upgraded.pool, MIGRATIONS_TABLE).await,
        versions(&fresh.pool, MIGRATIONS_TABLE).await
    );
    works(&upgraded.pool).await
}

/// The baseline's files commit one by one, and only the last defines
/// `schema_version()`: a run stopped between two of them (a crash, a
/// cancelled `migrate()`) leaves objects without a version, which the next
/// `migrate()` recognises by our own history and completes, ending with
/// the fresh schema.
#[tokio::test]
async fn a_baseline_stopped_between_its_files_is_completed_by_the_next_migrate() -> TestResult {
    let fresh = support::migrated_db().await;
    let db = support::empty_db().await;
    let part = ScratchDir::new("baseline-part");
    for (name, bytes) in sql_files(&crate_migrations()).into_iter().take(3) {
        std::fs::write(part.0.join(name), bytes)?;
    }
    migrator_of(&part.0).await?.run(&db.pool).await?;
    assert_eq!(versions(&db.pool, MIGRATIONS_TABLE).await.len(), 3);
    pg_semaphore::migrate(&db.pool).await?;
    support::catalog::assert_same(&fresh.pool, &db.pool).await;
    assert_eq!(
        versions(&db.pool, MIGRATIONS_TABLE).await,
        versions(&fresh.pool, MIGRATIONS_TABLE).await
    );
    works(&db.pool).await
}
