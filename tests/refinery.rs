//! pg-semaphore's migrations run by refinery on tokio-postgres build exactly
//! the schema that sqlx builds (compared in the catalog), keep their history
//! apart from the application's own refinery history, and follow the
//! `migrations/` directory. Each tool adopts an up-to-date schema the other
//! built, writing nothing, and refuses to upgrade one it did not build.

mod support;

use std::path::Path;
use std::time::Duration;

use pg_semaphore::{
    Error, Semaphore,
    schema::{MigrationHistory, REFINERY_TABLE, SCHEMA_VERSION, SchemaError},
};
use sqlx::PgPool;
use support::TestResult;
use support::catalog::objects;

async fn client(db: &support::TestDb) -> tokio_postgres::Client {
    let url = support::server::url_for(&db.name);
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("tokio-postgres connects");
    tokio::spawn(connection);
    client
}

#[tokio::test]
async fn refinery_builds_the_same_schema_as_sqlx() -> TestResult {
    let by_sqlx = support::migrated_db().await;
    let by_refinery = support::empty_db().await;
    let report = pg_semaphore::schema::refinery_migrate(&mut client(&by_refinery).await).await?;
    assert_eq!(
        report.applied_migrations().len(),
        pg_semaphore::schema::migrator().iter().count()
    );

    support::catalog::assert_same(&by_sqlx.pool, &by_refinery.pool).await;

    // The crate works on the refinery-migrated database.
    let sem = Semaphore::builder("after-refinery", 1)
        .lease(Duration::from_secs(60))
        .build(&pg_semaphore::Client::new(by_refinery.pool.clone()))
        .await?;
    let permit = sem.try_acquire().await?;
    assert!(sem.try_acquire().await.is_err());
    permit.release().await?;
    sem.try_acquire().await?.release().await?;
    Ok(())
}

#[tokio::test]
async fn our_refinery_history_lives_beside_the_applications_own() -> TestResult {
    let db = support::empty_db().await;
    let mut client = client(&db).await;
    let app = refinery::Runner::new(&[refinery::Migration::unapplied(
        "V1__app_users",
        "CREATE TABLE app_users (id bigint PRIMARY KEY, name text NOT NULL);",
    )?]);

    // The application's migrations, ours, then the application's again: each
    // runner sees only its own history (else refinery would report ours as
    // applied migrations missing from the application's files).
    app.run_async(&mut client).await?;
    pg_semaphore::schema::refinery_migrate(&mut client).await?;
    let again = app.set_abort_missing(true).run_async(&mut client).await?;
    assert!(again.applied_migrations().is_empty());

    let count = |table: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {table}"
            )))
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(count("public.refinery_schema_history").await, 1);
    assert_eq!(
        count(REFINERY_TABLE).await as usize,
        pg_semaphore::schema::refinery_migrations().len()
    );

    // Up to date: nothing more to apply.
    let report = pg_semaphore::schema::refinery_migrate(&mut client).await?;
    assert!(report.applied_migrations().is_empty());
    Ok(())
}

#[tokio::test]
async fn concurrent_refinery_runs_from_many_processes_succeed() -> TestResult {
    let db = support::empty_db().await;
    let mut runs = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let mut client = client(&db).await;
        runs.spawn(async move {
            pg_semaphore::schema::refinery_migrate(&mut client)
                .await
                .map(|report| report.applied_migrations().len())
        });
    }
    let mut applied = Vec::new();
    while let Some(run) = runs.join_next().await {
        applied.push(run??);
    }
    applied.sort();
    // One run applied everything; the others found it done.
    let total = pg_semaphore::schema::refinery_migrations().len();
    assert_eq!(applied, [0, 0, 0, total]);
    Semaphore::builder("after-concurrent-refinery", 1)
        .build(&pg_semaphore::Client::new(db.pool.clone()))
        .await?;
    Ok(())
}

/// The embedded list is generated from `migrations/` (build.rs): every file
/// sqlx applies, in sqlx's order, with the very same SQL.
#[test]
fn the_refinery_list_follows_the_migrations_directory() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "sql"))
        .map(|path| {
            let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
            (stem, std::fs::read_to_string(&path).unwrap())
        })
        .collect();
    files.sort();
    let sqlx: Vec<_> = pg_semaphore::schema::migrator().iter().cloned().collect();
    let refinery = pg_semaphore::schema::refinery_migrations();
    assert_eq!(
        refinery.len(),
        files.len(),
        "one refinery migration per file"
    );
    assert_eq!(
        refinery.len(),
        sqlx.len(),
        "one refinery migration per sqlx one"
    );
    for (i, ((stem, sql), (ours, theirs))) in
        files.iter().zip(refinery.iter().zip(&sqlx)).enumerate()
    {
        let (version, description) = stem.split_once('_').unwrap();
        assert_eq!(theirs.version.to_string(), version);
        assert_eq!(ours.version() as usize, i + 1, "{stem}");
        assert_eq!(ours.name(), description, "{stem}");
        assert_eq!(
            ours.sql(),
            Some(sql.as_str()),
            "{stem}: SQL differs from the file"
        );
        assert_eq!(
            theirs.sql.as_str(),
            sql.as_str(),
            "{stem}: sqlx's SQL differs from the file"
        );
    }
}

/// Whether a table of that name exists in the `pgsemaphore` schema.
async fn has_table(pool: &PgPool, table: &str) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                         WHERE n.nspname = 'pgsemaphore' AND c.relname = $1)",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Makes the schema claim an older version than this crate needs, as if a
/// later crate version had added a migration.
async fn pretend_outdated(pool: &PgPool) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
         RETURNS TABLE (o_version integer, o_compatible_from integer)
         LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp
         AS $$ SELECT {0}, {0} $$",
        SCHEMA_VERSION - 1
    )))
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn refinery_and_sqlx_each_adopt_the_schema_the_other_built() -> TestResult {
    // Built with sqlx: refinery finds it up to date, creates no history.
    let by_sqlx = support::migrated_db().await;
    let before = objects(&by_sqlx.pool).await;
    let report = pg_semaphore::schema::refinery_migrate(&mut client(&by_sqlx).await).await?;
    assert!(report.applied_migrations().is_empty());
    assert!(!has_table(&by_sqlx.pool, "refinery_schema_history").await);
    assert_eq!(objects(&by_sqlx.pool).await, before, "nothing written");

    // Built with refinery: migrate() finds it up to date, creates no history.
    let by_refinery = support::empty_db().await;
    pg_semaphore::schema::refinery_migrate(&mut client(&by_refinery).await).await?;
    let before = objects(&by_refinery.pool).await;
    pg_semaphore::migrate(&by_refinery.pool).await?;
    assert!(!has_table(&by_refinery.pool, "_sqlx_migrations").await);
    assert_eq!(objects(&by_refinery.pool).await, before, "nothing written");
    Semaphore::builder("adopted", 1)
        .build(&pg_semaphore::Client::new(by_refinery.pool.clone()))
        .await?
        .try_acquire()
        .await?
        .release()
        .await?;

    // Outdated: each tool says the other must upgrade it, writing nothing.
    pretend_outdated(&by_sqlx.pool).await;
    let before = objects(&by_sqlx.pool).await;
    let err = pg_semaphore::schema::refinery_migrate(&mut client(&by_sqlx).await)
        .await
        .expect_err("refinery does not upgrade sqlx's schema");
    println!("refinery on an outdated sqlx schema: {err}");
    assert!(
        matches!(
            err,
            Error::Schema(SchemaError::Outdated {
                history: MigrationHistory::Sqlx,
                ..
            })
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("pg_semaphore::migrate(&pool)"),
        "{err}"
    );
    assert!(!has_table(&by_sqlx.pool, "refinery_schema_history").await);
    assert_eq!(objects(&by_sqlx.pool).await, before);

    pretend_outdated(&by_refinery.pool).await;
    let err = pg_semaphore::migrate(&by_refinery.pool)
        .await
        .expect_err("sqlx does not upgrade refinery's schema");
    println!("migrate() on an outdated refinery schema: {err}");
    assert!(
        matches!(
            err,
            Error::Schema(SchemaError::Outdated {
                history: MigrationHistory::Refinery,
                ..
            })
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("refinery_migrate"), "{err}");
    assert!(!has_table(&by_refinery.pool, "_sqlx_migrations").await);
    Ok(())
}
