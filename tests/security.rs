//! Least privilege: the crate's paths work under roles that hold only the
//! grants the README documents (an application role and an operator role,
//! no DDL, no superuser, no table writes), and what each must not do is
//! refused.

mod support;

use std::time::Duration;

use chrono::Utc;
use pg_semaphore::{
    AuditLog, Error, FixedWindow, LostReason, Mutex, Priority, QueueOrder, Reaper, Semaphore,
    SlidingWindow, TokenBucket,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Two roles with the README's grants, no superuser, no DDL: the
/// application's and the operator's; dropped with the database.
struct Roles {
    admin: PgConnection,
    app: String,
    operator: String,
}

const PASSWORD: &str = "least-privilege-pw";

impl Roles {
    async fn create(
        db: &support::TestDb,
    ) -> Result<Roles, Box<dyn std::error::Error + Send + Sync>> {
        let app = format!("{}_app", db.name);
        let operator = format!("{}_op", db.name);
        let mut admin = PgConnection::connect_with(&db.options).await?;
        for role in [&app, &operator] {
            admin
                .execute(AssertSqlSafe(format!(
                    r#"CREATE ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '{PASSWORD}'"#
                )))
                .await?;
        }
        admin
            .execute(AssertSqlSafe(support::documented_grants(&app, &operator)))
            .await?;
        Ok(Roles {
            admin,
            app,
            operator,
        })
    }

    async fn pool(&self, db: &support::TestDb, role: &str) -> sqlx::Result<PgPool> {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(db.options.clone().username(role).password(PASSWORD))
            .await
    }

    async fn drop_all(mut self) -> sqlx::Result<()> {
        for role in [&self.app, &self.operator] {
            self.admin
                .execute(AssertSqlSafe(format!(
                    r#"DROP OWNED BY "{role}"; DROP ROLE "{role}""#
                )))
                .await?;
        }
        Ok(())
    }
}

/// SQLSTATE 42501: insufficient privilege.
fn denied<T: std::fmt::Debug>(result: Result<T, sqlx::Error>) -> bool {
    match result {
        Err(error) => error.as_database_error().and_then(|e| e.code()).as_deref() == Some("42501"),
        Ok(value) => panic!("expected permission denied, got {value:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_role_does_everything_an_application_does() -> TestResult {
    let db = support::migrated_db().await; // migrated by the owner
    let roles = Roles::create(&db).await?;
    let app = roles.pool(&db, &roles.app).await?;

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
        let mut tx = app.begin().await?;
        second.fence(&mut tx).await?;
        tx.commit().await?;
        second.release().await?;
        let log = AuditLog::new(&app);
        assert_eq!(
            log.history("least-privilege", started..Utc::now())
                .await?
                .len(),
            2
        );
        assert_eq!(sem.summary(started..Utc::now()).await?.completed, 2);
        assert_eq!(pg_semaphore::semaphores(&app).await?.len(), 1);

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

        // Mutexes need no grants at all.
        let mutex = Mutex::new("least-privilege");
        let guard = mutex.lock_timeout(&app, Duration::from_secs(5)).await?;
        assert!(matches!(
            mutex.try_lock(&app).await,
            Err(Error::Locked { .. })
        ));
        guard.commit().await?;
        mutex.lock_session(&app).await?.unlock().await?;

        // Rate limiters: check (insert, then update).
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
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;

    app.close().await;
    roles.drop_all().await?;
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_role_reaps_prunes_resizes_and_force_releases() -> TestResult {
    let db = support::migrated_db().await;
    let roles = Roles::create(&db).await?;
    let app = roles.pool(&db, &roles.app).await?;
    let operator = roles.pool(&db, &roles.operator).await?;

    let result = async {
        let short = Semaphore::builder("operated", 1)
            .lease(Duration::from_millis(50))
            .without_heartbeat()
            .build(&app)
            .await?;
        std::mem::forget(short.try_acquire().await?);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(pg_semaphore::reap(&operator).await?, 1);

        // Retention (the VACUUM is skipped with a warning).
        let reaper = Reaper::builder()
            .interval(Duration::from_millis(50))
            .retention(Duration::ZERO)
            .rate_limits(Duration::ZERO)
            .spawn(&operator)?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        reaper.shutdown().await;
        assert_eq!(
            pg_semaphore::prune(&operator, Duration::ZERO).await?,
            0,
            "the reaper pruned it all"
        );

        assert_eq!(
            pg_semaphore::set_capacity(&operator, "operated", 2).await?,
            1
        );
        pg_semaphore::configure(&operator, "operated", 3, Duration::from_secs(5)).await?;
        let held = short.try_acquire().await?;
        assert!(matches!(
            pg_semaphore::force_release(&operator, held.id()).await?,
            pg_semaphore::ReleaseOutcome::Released { .. }
        ));
        assert!(matches!(
            held.release().await,
            Err(Error::PermitLost {
                reason: LostReason::AlreadyReleased { .. },
                ..
            })
        ));

        let bucket = TokenBucket::builder("operated")
            .rate(1000.0)
            .burst(1)
            .build(&app)?;
        assert!(bucket.check("k", 1).await?.allowed);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            pg_semaphore::prune_rate_limits(&operator, Duration::ZERO).await?,
            1
        );
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;

    app.close().await;
    operator.close().await;
    roles.drop_all().await?;
    result
}

/// What the application role must not be able to do: write any table
/// directly, run an operator function, or end someone else's claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_role_cannot_write_tables_operate_or_end_others_claims() -> TestResult {
    let db = support::migrated_db().await;
    let roles = Roles::create(&db).await?;
    let app = roles.pool(&db, &roles.app).await?;

    let result = async {
        let sem = Semaphore::builder("guarded", 2).build(&app).await?;
        let theirs = sem.try_acquire().await?;
        let id = theirs.id();

        for sql in [
            "UPDATE pgsemaphore.slots SET completed_at = now()",
            "UPDATE pgsemaphore.slots SET holder = 'forged', metadata = NULL",
            "DELETE FROM pgsemaphore.slots",
            "INSERT INTO pgsemaphore.slots (semaphore, slot, holder, created_at, expires_at) \
             VALUES ('guarded', 1, 'forged', now(), now() + interval '1 hour')",
            "UPDATE pgsemaphore.semaphores SET capacity = 100000",
            "INSERT INTO pgsemaphore.semaphores (name, capacity, default_lease) VALUES ('x', 1, '1 s')",
            "DELETE FROM pgsemaphore.waiters",
            "DELETE FROM pgsemaphore.wakeups",
            "UPDATE pgsemaphore.rate_limits SET tokens = 1000",
            "SELECT pgsemaphore.reap()",
            "SELECT * FROM pgsemaphore.force_release(1)",
            "SELECT * FROM pgsemaphore.configure('guarded', 100, NULL)",
            "SELECT pgsemaphore.prune(interval '0', 100)",
            "SELECT * FROM pgsemaphore.prune_rate_limits(interval '0', '', '', '', 100)",
        ] {
            assert!(denied(sqlx::query(sql).execute(&app).await), "allowed: {sql}");
        }
        assert!(matches!(
            pg_semaphore::set_capacity(&app, "guarded", 100).await,
            Err(Error::Database(_))
        ));
        assert!(matches!(pg_semaphore::reap(&app).await, Err(Error::Database(_))));

        // Releasing, renewing or fencing someone else's claim without its
        // token changes nothing.
        let (outcome,): (String,) =
            sqlx::query_as("SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], '\\x00'::bytea)")
                .bind(id)
                .fetch_one(&app)
                .await?;
        assert_eq!(outcome, "not_holder");
        let (outcome,): (String,) = sqlx::query_as(
            "CALL pgsemaphore.release_then_wake(ARRAY[$1], '\\x00'::bytea, false)",
        )
        .bind(id)
        .fetch_one(&app)
        .await?;
        assert_eq!(outcome, "not_holder");
        let (outcome,): (String,) = sqlx::query_as(
            "SELECT o_outcome FROM pgsemaphore.renew(ARRAY[$1], '\\x00'::bytea, interval '1 s')",
        )
        .bind(id)
        .fetch_one(&app)
        .await?;
        assert_eq!(outcome, "not_holder");
        let ended: i32 = sqlx::query_scalar("SELECT pgsemaphore.release_by_token('guarded', '\\x00')")
            .fetch_one(&app)
            .await?;
        assert_eq!(ended, 0);
        assert_eq!(sem.holders().await?.len(), 1, "the claim is untouched");
        theirs.release().await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;

    app.close().await;
    roles.drop_all().await?;
    result
}

/// The functions pin their `search_path`: objects the role controls, put
/// ahead of pg_catalog in its own search path (a `sha256` that answers what
/// it likes, a `clock_timestamp` from the future, tables named like ours),
/// change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hijacked_search_path_changes_nothing() -> TestResult {
    let db = support::migrated_db().await;
    let roles = Roles::create(&db).await?;
    let mut admin = PgConnection::connect_with(&db.options).await?;
    admin
        .execute(AssertSqlSafe(format!(
            r#"CREATE SCHEMA evil AUTHORIZATION "{}""#,
            roles.app
        )))
        .await?;
    let app = PgPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET search_path = evil, pg_catalog, pgsemaphore")
                    .await?;
                Ok(())
            })
        })
        .connect_with(db.options.clone().username(&roles.app).password(PASSWORD))
        .await?;

    let result = async {
        let sem = Semaphore::builder("hijack", 1)
            .lease(Duration::from_secs(60))
            .build(&app)
            .await?;
        let theirs = sem.try_acquire().await?;
        sqlx::raw_sql(
            "CREATE FUNCTION evil.sha256(bytea) RETURNS bytea LANGUAGE sql
                 AS $$ SELECT token_hash FROM pgsemaphore.slots ORDER BY id DESC LIMIT 1 $$;
             CREATE FUNCTION evil.clock_timestamp() RETURNS timestamptz LANGUAGE sql
                 AS $$ SELECT timestamptz '2999-01-01' $$;
             CREATE TABLE evil.slots (id bigint, semaphore text, token_hash bytea);
             CREATE TABLE evil.live_slots (id bigint, semaphore text, slot int);",
        )
        .execute(&app)
        .await?;
        // With a wrong token, the hijacked sha256 would match the claim.
        let (outcome,): (String,) =
            sqlx::query_as("SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], '\\x00'::bytea)")
                .bind(theirs.id())
                .fetch_one(&app)
                .await?;
        assert_eq!(outcome, "not_holder");
        // A future clock would make every lease look expired and reapable.
        assert!(matches!(
            sem.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
        assert_eq!(sem.holders().await?.len(), 1);
        theirs.release().await?;
        let (live,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM pgsemaphore.slots WHERE completed_at IS NULL AND timed_out_at IS NULL",
        )
        .fetch_one(&mut admin)
        .await?;
        assert_eq!(live, 0);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;

    app.close().await;
    admin.execute("DROP SCHEMA evil CASCADE").await?;
    roles.drop_all().await?;
    result
}

/// The application role's operations through PgBouncer in transaction
/// pooling mode: claims, waits, renewals, fences, releases, the queue,
/// transaction-scoped mutexes and rate limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_role_works_through_pgbouncer() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    let db = support::migrated_db().await;
    let roles = Roles::create(&db).await?;
    let bouncer = support::pgbouncer::bouncer().await;
    bouncer.add_user(&roles.app, PASSWORD).await?;
    let app = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(
            bouncer
                .options(&db.name)
                .username(&roles.app)
                .password(PASSWORD),
        )
        .await?;

    let result = async {
        let (role,): (String,) = sqlx::query_as("SELECT current_user::text")
            .persistent(false)
            .fetch_one(&app)
            .await?;
        assert_eq!(role, roles.app);
        let sem = Semaphore::builder("bounced-app", 1)
            .transaction_pooling(true)
            .lease(Duration::from_millis(900))
            .heartbeat(Duration::from_millis(200))
            .fallback_interval(Duration::from_millis(100))
            .queue(QueueOrder::OldestFirst)
            .build(&app)
            .await?;
        let held = sem.try_acquire().await?;
        let waiter = {
            let sem = sem.clone();
            tokio::spawn(async move { sem.acquire_timeout(Duration::from_secs(30)).await })
        };
        while sem.queue_len().await? == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(1200)).await; // renewals ran
        assert!(!held.is_lost());
        let mut tx = app.begin().await?;
        held.fence(&mut tx).await?;
        tx.commit().await?;
        held.release().await?;
        waiter.await??.release().await?;

        let mutex = Mutex::new("bounced-app");
        let guard = mutex.lock_timeout(&app, Duration::from_secs(5)).await?;
        assert!(matches!(
            mutex.try_lock(&app).await,
            Err(Error::Locked { .. })
        ));
        guard.commit().await?;

        let bucket = TokenBucket::builder("bounced-app")
            .rate(1.0)
            .burst(1)
            .transaction_pooling(true)
            .build(&app)?;
        assert!(bucket.check("k", 1).await?.allowed);
        assert!(!bucket.check("k", 1).await?.allowed);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;

    app.close().await;
    roles.drop_all().await?;
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
