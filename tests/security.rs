//! Least privilege: the crate's runtime paths work under a role that holds
//! only the grants the README documents, with no DDL and no superuser.

mod support;

use std::time::Duration;

use chrono::Utc;
use pg_semaphore::{
    AuditLog, FixedWindow, Mutex, Priority, QueueOrder, Reaper, Semaphore, SlidingWindow,
    TokenBucket,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// The SQL between the README's `grants:begin` and `grants:end` markers.
fn documented_grants(role: &str) -> String {
    let readme = include_str!("../README.md");
    let start = readme
        .find("<!-- grants:begin")
        .expect("README grants marker");
    let end = readme
        .find("<!-- grants:end -->")
        .expect("README grants end marker");
    let block = &readme[start..end];
    let sql = block
        .split("```sql")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a sql block between the grants markers");
    sql.replace(" TO app;", &format!(r#" TO "{role}";"#))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_main_paths_work_with_only_the_documented_grants() -> TestResult {
    let db = support::migrated_db().await; // migrated by the owner
    let role = format!("{}_app", db.name);
    let password = "app-secret-pw";

    let mut admin = PgConnection::connect_with(&db.options).await?;
    admin
        .execute(AssertSqlSafe(format!(
            r#"CREATE ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '{password}'"#
        )))
        .await?;
    admin
        .execute(AssertSqlSafe(documented_grants(&role)))
        .await?;

    let app_options = db.options.clone().username(&role).password(password);
    let app = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(app_options.clone())
        .await?;

    let result = async {
        // Really least privilege: no superuser, and no DDL.
        let (superuser, can_create): (bool, bool) = sqlx::query_as(
            "SELECT rolsuper, has_schema_privilege('pgsemaphore', 'CREATE')
               FROM pg_roles WHERE rolname = current_user",
        )
        .fetch_one(&app)
        .await?;
        assert!(!superuser && !can_create);
        let ddl = sqlx::query("CREATE TABLE pgsemaphore.sneaky (id int)")
            .execute(&app)
            .await;
        assert!(ddl.is_err(), "the role must not be able to run DDL");

        // Semaphores: build, fail fast, wait and be woken, release, audit.
        let started = Utc::now() - chrono::Duration::seconds(1);
        let sem = Semaphore::builder("least-privilege", 1)
            .lease(Duration::from_secs(30))
            .fallback_interval(Duration::from_secs(600))
            .build(&app)
            .await?;
        let held = sem
            .claim()
            .metadata(serde_json::json!({ "via": "app role" }))
            .try_acquire()
            .await?;
        assert!(sem.try_acquire().await.is_err());
        let waiter = {
            let sem = sem.clone();
            tokio::spawn(async move { sem.acquire_timeout(Duration::from_secs(30)).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        held.release().await?;
        let second = waiter.await??; // woken by NOTIFY: the fallback is 10 minutes away
        assert_eq!(sem.available_permits().await?, 0);
        assert_eq!(sem.holders().await?.len(), 1);
        second.release().await?;
        let log = AuditLog::new(&app);
        assert_eq!(
            log.history("least-privilege", started..Utc::now())
                .await?
                .len(),
            2
        );
        assert_eq!(sem.summary(started..Utc::now()).await?.completed, 2);

        // Heartbeats renew (and commit durably) under the same grants.
        let renewed = Semaphore::builder("least-privilege-renewed", 1)
            .lease(Duration::from_millis(600))
            .heartbeat(Duration::from_millis(150))
            .build(&app)
            .await?;
        let busy = renewed.try_acquire().await?;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            !busy.is_lost(),
            "renewals failed under the documented grants"
        );
        busy.release().await?;

        // The extensions: weighted and low-priority claims, the fair queue, wait_idle.
        let fair = Semaphore::builder("least-privilege-fair", 2)
            .reserved(1)
            .queue(QueueOrder::OldestFirst)
            .fallback_interval(Duration::from_secs(600))
            .build(&app)
            .await?;
        let both = fair
            .acquire_many_timeout(2, Duration::from_secs(30))
            .await?;
        let queued = {
            let fair = fair.clone();
            tokio::spawn(async move {
                fair.claim()
                    .priority(Priority::Low)
                    .acquire_timeout(Duration::from_secs(30))
                    .await
            })
        };
        while fair.queue_len().await? == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        both.release().await?;
        queued.await??.release().await?;
        fair.wait_idle_timeout(Duration::from_secs(30)).await?;
        assert_eq!(fair.queue_len().await?, 0);

        // Leases, reaping, retention (the VACUUM is skipped with a warning).
        let short = Semaphore::builder("least-privilege-short", 1)
            .lease(Duration::from_millis(50))
            .without_heartbeat()
            .build(&app)
            .await?;
        std::mem::forget(short.try_acquire().await?);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(pg_semaphore::reap(&app).await?, 1);
        let reaper = Reaper::builder()
            .interval(Duration::from_millis(50))
            .retention(Duration::ZERO)
            .spawn(&app)?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        reaper.shutdown().await;
        assert_eq!(
            pg_semaphore::prune(&app, Duration::ZERO).await?,
            0,
            "the reaper pruned it all"
        );

        // Mutexes need no grants at all.
        let mutex = Mutex::new("least-privilege");
        let guard = mutex.lock_timeout(&app, Duration::from_secs(5)).await?;
        assert!(mutex.try_lock(&app).await?.is_none());
        guard.commit().await?;
        mutex.lock_session(&app, None).await?.unlock().await?;

        // Rate limiters: check (insert, then update), prune.
        let bucket = TokenBucket::builder("least-privilege")
            .rate(1000.0)
            .burst(1)
            .build(&app)?;
        let fixed = FixedWindow::builder("least-privilege")
            .permit_limit(1)
            .window(Duration::from_millis(10))
            .build(&app)?;
        let sliding = SlidingWindow::builder("least-privilege")
            .permit_limit(1)
            .window(Duration::from_millis(10))
            .build(&app)?;
        for _ in 0..2 {
            // The first check inserts the key's row, the second updates it.
            assert!(!bucket.check("k", 1).await?.failed_open);
            assert!(!fixed.check("k", 1).await?.failed_open);
            assert!(!sliding.check("k", 1).await?.failed_open);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            pg_semaphore::prune_rate_limits(&app, Duration::ZERO).await?,
            3
        );
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;

    app.close().await;
    admin
        .execute(AssertSqlSafe(format!(
            r#"DROP OWNED BY "{role}"; DROP ROLE "{role}""#
        )))
        .await?;
    result
}

#[tokio::test]
async fn errors_never_show_the_connection_password() -> TestResult {
    let db = support::migrated_db().await;
    // A role that does not exist, with a password in the options: the
    // connection fails, and the error must not repeat the password.
    let options = db
        .options
        .clone()
        .username("no_such_role_for_pgsem")
        .password("hunter2-very-secret");
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options);
    let err = Semaphore::builder("x", 1)
        .build(&pool)
        .await
        .expect_err("the role does not exist");
    let shown = format!("{err} / {err:?}");
    assert!(!shown.contains("hunter2"), "password leaked: {shown}");
    assert!(
        !format!("{pool:?}").contains("hunter2"),
        "password leaked by the pool's Debug"
    );
    Ok(())
}
