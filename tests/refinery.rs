//! pg-semaphore's migrations run by refinery on tokio-postgres build exactly
//! the schema that sqlx builds (compared in the catalog), keep their history
//! apart from the application's own refinery history, and follow the
//! `migrations/` directory.

mod support;

use std::path::Path;
use std::time::Duration;

use pg_semaphore::{REFINERY_TABLE, Semaphore};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

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
    let report = pg_semaphore::refinery_migrate(&mut client(&by_refinery).await).await?;
    assert_eq!(
        report.applied_migrations().len(),
        pg_semaphore::migrator().iter().count()
    );

    support::catalog::assert_same(&by_sqlx.pool, &by_refinery.pool).await;

    // The crate works on the refinery-migrated database.
    let sem = Semaphore::builder("after-refinery", 1)
        .lease(Duration::from_secs(60))
        .build(&by_refinery.pool)
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
    pg_semaphore::refinery_migrate(&mut client).await?;
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
        pg_semaphore::refinery_migrations().len()
    );

    // Up to date: nothing more to apply.
    let report = pg_semaphore::refinery_migrate(&mut client).await?;
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
            pg_semaphore::refinery_migrate(&mut client)
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
    let total = pg_semaphore::refinery_migrations().len();
    assert_eq!(applied, [0, 0, 0, total]);
    Semaphore::builder("after-concurrent-refinery", 1)
        .build(&db.pool)
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
    let sqlx: Vec<_> = pg_semaphore::migrator().iter().cloned().collect();
    let refinery = pg_semaphore::refinery_migrations();
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
