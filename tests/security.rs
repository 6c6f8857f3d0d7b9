//! Least privilege: the crate's paths work under roles that hold only the
//! grants the guide documents (docs/guide/operations.md) (an application role and an operator role,
//! no DDL, no superuser, no table writes), and what each must not do is
//! refused.

mod support;

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use pg_semaphore::{
    Error, LostReason, Mutex, Priority, QueueOrder, RateLimiter, RatePolicy, Semaphore,
    admin::{Reaper, SemaphoreInfo},
    audit::{AuditLog, SemaphoreKind},
};
use sqlx::postgres::{PgArguments, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool, Postgres};
use support::roles::{PASSWORD, Roles};
use support::{TestResult, live_slots, raw_claim, token};

/// A well-formed token that is nobody's.
const WRONG_TOKEN: &[u8] = b"not-the-holder!!";

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
    let roles = Roles::documented(&db, &[]).await?;
    let app = roles.pool(&db, "app").await?;

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
        let client =
            pg_semaphore::Client::new(app.clone()).fallback_interval(Duration::from_secs(600));
        let sem = Semaphore::builder("least-privilege", 1)
            .lease(Duration::from_secs(30))
            .build(&client)
            .await?;
        let held = sem
            .acquiring()
            .metadata(serde_json::json!({ "via": "app role" }))
            .try_acquire()
            .await?;
        assert!(sem.try_acquire().await.is_err());
        let waiter = {
            let sem = sem.clone();
            tokio::spawn(async move {
                sem.acquiring()
                    .timeout(Duration::from_secs(30))
                    .acquire()
                    .await
            })
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
        // Several limits at once: claimed, fenced and released together
        // with the application's grants alone.
        let merchant = Semaphore::builder("least-privilege:merchant", 1)
            .build(&client)
            .await?;
        let both = Semaphore::try_acquire_all(&[(&merchant, 1), (&sem, 1)]).await?;
        let mut tx = app.begin().await?;
        both.fence(&mut tx).await?;
        tx.commit().await?;
        both.release().await?;
        let log = AuditLog::new(&app);
        assert_eq!(
            log.history("least-privilege", started..Utc::now())
                .await?
                .len(),
            3
        );
        assert_eq!(sem.summary(started..Utc::now()).await?.completed, 3);
        assert_eq!(pg_semaphore::admin::semaphores(&app).await?.len(), 2);

        // Heartbeats renew (and commit durably) under the same grants.
        let renewed = Semaphore::builder("least-privilege-renewed", 1)
            .lease(Duration::from_millis(600))
            .heartbeat(Duration::from_millis(150))
            .build(&pg_semaphore::Client::new(app.clone()))
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
            .build(
                &pg_semaphore::Client::new(app.clone()).fallback_interval(Duration::from_secs(600)),
            )
            .await?;
        let both = fair
            .acquiring()
            .timeout(Duration::from_secs(30))
            .acquire_many(2)
            .await?;
        let queued = {
            let fair = fair.clone();
            tokio::spawn(async move {
                fair.acquiring()
                    .priority(Priority::Low)
                    .timeout(Duration::from_secs(30))
                    .acquire()
                    .await
            })
        };
        while fair.queue_len().await? == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        both.release().await?;
        queued.await??.release().await?;
        tokio::time::timeout(Duration::from_secs(30), fair.wait_idle()).await??;
        assert_eq!(fair.queue_len().await?, 0);

        // Mutexes need no grants at all.
        let mutex = Mutex::new("least-privilege");
        let guard = mutex
            .locking()
            .timeout(Duration::from_secs(5))
            .lock(&pg_semaphore::Client::new(app.clone()))
            .await?;
        assert!(matches!(
            mutex
                .locking()
                .no_wait()
                .lock(&pg_semaphore::Client::new(app.clone()))
                .await,
            Err(Error::Locked { .. })
        ));
        guard.commit().await?;
        mutex
            .locking()
            .lock_session(&pg_semaphore::Client::new(app.clone()))
            .await?
            .unlock()
            .await?;

        // Rate limiters: check (insert, then update).
        let bucket = RateLimiter::builder("least-privilege", RatePolicy::token_bucket(1000.0, 1))
            .build(&pg_semaphore::Client::new(app.clone()))?;
        let fixed = RateLimiter::builder(
            "least-privilege",
            RatePolicy::fixed_window(1, Duration::from_millis(10)),
        )
        .build(&pg_semaphore::Client::new(app.clone()))?;
        let sliding = RateLimiter::builder(
            "least-privilege",
            RatePolicy::sliding_window(1, Duration::from_millis(10)),
        )
        .build(&pg_semaphore::Client::new(app.clone()))?;
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
async fn the_operator_role_reaps_prunes_resizes_weighs_and_force_releases() -> TestResult {
    let db = support::migrated_db().await;
    let roles = Roles::documented(&db, &[]).await?;
    let app = roles.pool(&db, "app").await?;
    let operator = roles.pool(&db, "op").await?;

    let result = async {
        let short = Semaphore::builder("operated", 1)
            .lease(Duration::from_millis(50))
            .without_heartbeat()
            .build(&pg_semaphore::Client::new(app.clone()))
            .await?;
        std::mem::forget(short.try_acquire().await?);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(pg_semaphore::admin::reap(&operator).await?, 1);

        // Retention (the VACUUM is skipped with a warning).
        let reaper = Reaper::builder()
            .interval(Duration::from_millis(50))
            .retention(Duration::ZERO)
            .rate_limits(Duration::ZERO)
            .spawn(&operator)?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        reaper.shutdown().await;
        assert_eq!(
            pg_semaphore::admin::prune_claims(&operator, Duration::ZERO).await?,
            0,
            "the reaper pruned it all"
        );

        assert_eq!(
            pg_semaphore::admin::set_capacity(&operator, "operated", 2).await?,
            1
        );
        pg_semaphore::admin::configure(&operator, "operated", 3, Duration::from_secs(5)).await?;
        assert_eq!(
            pg_semaphore::admin::set_fairness_weight(&operator, "operated", Some("tenant"), 3)
                .await?,
            1
        );
        let held = short.try_acquire().await?;
        assert!(matches!(
            pg_semaphore::admin::force_release(&operator, held.id()).await?,
            pg_semaphore::admin::ReleaseOutcome::Released { .. }
        ));
        assert!(matches!(
            held.release().await,
            Err(Error::PermitLost {
                reason: LostReason::AlreadyReleased { .. },
                ..
            })
        ));

        let bucket = RateLimiter::builder("operated", RatePolicy::token_bucket(1000.0, 1))
            .build(&pg_semaphore::Client::new(app.clone()))?;
        assert!(bucket.check("k", 1).await?.allowed);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            pg_semaphore::admin::prune_rate_limits(&operator, Duration::ZERO).await?,
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

/// The advisory semaphores `pg_semaphore::admin::semaphores` lists.
async fn advisory_semaphores(pool: &PgPool) -> pg_semaphore::Result<Vec<SemaphoreInfo>> {
    let mut list = pg_semaphore::admin::semaphores(pool).await?;
    list.retain(|s| s.kind == SemaphoreKind::Advisory);
    Ok(list)
}

/// Both roles list advisory semaphores and their holders under the
/// documented grants (the view `pgsemaphore.advisory_holders` included);
/// a role that is not a member of `pg_read_all_stats` sees the pid and the
/// application of another role's sessions, not their client or start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_roles_list_advisory_holders_and_see_what_postgres_shows_them() -> TestResult {
    as_roles(|_db, app, operator| async move {
        let sem = pg_semaphore::AdvisorySemaphore::builder("advisory-listed", 2)
            .audit(false)
            .build(&pg_semaphore::Client::new(app.clone()))
            .await?;
        let permit = sem.try_acquire().await?;
        // The application's own sessions: everything.
        let list = advisory_semaphores(&app).await?;
        assert_eq!(list.len(), 1);
        let mine = &list[0].holders;
        assert_eq!(mine.len(), 1);
        assert_eq!(mine[0].pid, Some(permit.backend_pid()));
        assert!(mine[0].backend_start.is_some(), "{mine:?}");
        // The operator: another role's session.
        let list = advisory_semaphores(&operator).await?;
        let theirs = &list[0].holders;
        assert_eq!(theirs.len(), 1);
        assert_eq!(
            (theirs[0].slot, theirs[0].pid),
            (permit.slot(), Some(permit.backend_pid()))
        );
        assert_eq!(
            theirs[0].application_name.as_deref(),
            Some("pg-semaphore advisory")
        );
        assert_eq!(
            (&theirs[0].client_addr, theirs[0].backend_start),
            (&None, None)
        );
        permit.release().await?;
        assert!(advisory_semaphores(&operator).await?[0].holders.is_empty());
        Ok(())
    })
    .await
}

/// What the application role must not be able to do: write any table
/// directly, run an operator function, or end someone else's claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_role_cannot_write_tables_operate_or_end_others_claims() -> TestResult {
    let db = support::migrated_db().await;
    let roles = Roles::documented(&db, &[]).await?;
    let app = roles.pool(&db, "app").await?;

    let result = async {
        let sem = Semaphore::builder("guarded", 2).build(&pg_semaphore::Client::new(app.clone())).await?;
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
            "UPDATE pgsemaphore.rate_ledger SET tokens = 1000",
            "DELETE FROM pgsemaphore.rate_ledger",
            "INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, tokens, stamp, idle_at) \
             VALUES ('token_bucket', 'l', 'k', 1000000, 1000, now(), now())",
            "SELECT pgsemaphore.reap()",
            "SELECT * FROM pgsemaphore.force_release(1)",
            "SELECT * FROM pgsemaphore.configure('guarded', 100, NULL)",
            "SELECT pgsemaphore.clear_queue('guarded')",
            "SELECT pgsemaphore.set_fair_weight('guarded', 'tenant', 1000)",
            "SELECT pgsemaphore.prune(interval '0', 100)",
            "SELECT * FROM pgsemaphore.prune_rate_limits(interval '0', '', '', '', 100)",
        ] {
            assert!(denied(sqlx::query(sql).execute(&app).await), "allowed: {sql}");
        }
        assert!(matches!(
            pg_semaphore::admin::set_capacity(&app, "guarded", 100).await,
            Err(Error::PermissionDenied {
                access: pg_semaphore::admin::Access::Operator,
                ..
            })
        ));
        assert!(matches!(
            pg_semaphore::admin::reap(&app).await,
            Err(Error::PermissionDenied {
                access: pg_semaphore::admin::Access::Operator,
                ..
            })
        ));

        // Releasing, renewing or fencing someone else's claim without its
        // token changes nothing.
        let (outcome,): (String,) =
            sqlx::query_as("SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], $2)")
                .bind(id)
                .bind(WRONG_TOKEN)
                .fetch_one(&app)
                .await?;
        assert_eq!(outcome, "not_holder");
        let (outcome,): (String,) =
            sqlx::query_as("CALL pgsemaphore.release_then_wake(ARRAY[$1], $2, false)")
                .bind(id)
                .bind(WRONG_TOKEN)
                .fetch_one(&app)
                .await?;
        assert_eq!(outcome, "not_holder");
        let (outcome,): (String,) = sqlx::query_as(
            "SELECT o_outcome FROM pgsemaphore.renew(ARRAY[$1], $2, interval '1 s')",
        )
        .bind(id)
        .bind(WRONG_TOKEN)
        .fetch_one(&app)
        .await?;
        assert_eq!(outcome, "not_holder");
        let (ended,): (i32,) =
            sqlx::query_as("SELECT o_ended FROM pgsemaphore.release_by_token('guarded', $1)")
                .bind(WRONG_TOKEN)
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
    let roles = Roles::documented(&db, &[]).await?;
    let mut admin = PgConnection::connect_with(&db.options).await?;
    admin
        .execute(AssertSqlSafe(format!(
            r#"CREATE SCHEMA evil AUTHORIZATION "{}""#,
            roles.name("app")
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
        .connect_with(
            db.options
                .clone()
                .username(&roles.name("app"))
                .password(PASSWORD),
        )
        .await?;

    let result = async {
        let sem = Semaphore::builder("hijack", 1)
            .lease(Duration::from_secs(60))
            .build(&pg_semaphore::Client::new(app.clone()))
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
            sqlx::query_as("SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], $2)")
                .bind(theirs.id())
                .bind(WRONG_TOKEN)
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
    let roles = Roles::documented(&db, &[]).await?;
    let bouncer = support::pgbouncer::bouncer().await;
    bouncer.add_user(&roles.name("app"), PASSWORD).await?;
    let app = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(
            bouncer
                .options(&db.name)
                .username(&roles.name("app"))
                .password(PASSWORD),
        )
        .await?;

    let result = async {
        let (role,): (String,) = sqlx::query_as("SELECT current_user::text")
            .persistent(false)
            .fetch_one(&app)
            .await?;
        assert_eq!(role, roles.name("app"));
        let sem = Semaphore::builder("bounced-app", 1)
            .lease(Duration::from_millis(900))
            .heartbeat(Duration::from_millis(200))
            .queue(QueueOrder::OldestFirst)
            .build(
                &pg_semaphore::Client::new(app.clone())
                    .transaction_pooling(true)
                    .fallback_interval(Duration::from_millis(100)),
            )
            .await?;
        let held = sem.try_acquire().await?;
        let waiter = {
            let sem = sem.clone();
            tokio::spawn(async move {
                sem.acquiring()
                    .timeout(Duration::from_secs(30))
                    .acquire()
                    .await
            })
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
        let guard = mutex
            .locking()
            .timeout(Duration::from_secs(5))
            .lock(&pg_semaphore::Client::new(app.clone()))
            .await?;
        assert!(matches!(
            mutex
                .locking()
                .no_wait()
                .lock(&pg_semaphore::Client::new(app.clone()))
                .await,
            Err(Error::Locked { .. })
        ));
        guard.commit().await?;

        let bucket = RateLimiter::builder("bounced-app", RatePolicy::token_bucket(1.0, 1))
            .build(&pg_semaphore::Client::new(app.clone()).transaction_pooling(true))?;
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
        .build(&pg_semaphore::Client::new(pool.clone()))
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

// ---------------------------------------------------------------------------
// The guide's list (docs/guide/operations.md) of what the application role can and cannot do: each
// sentence, quoted, above the test that checks it, as the application role
// with the guide's grants, calling the SQL functions directly.
// ---------------------------------------------------------------------------

/// The application's and the operator's pools, with the guide's grants.
async fn app_and_operator(
    db: &support::TestDb,
) -> Result<(Roles, PgPool, PgPool), Box<dyn std::error::Error + Send + Sync>> {
    let roles = Roles::documented(db, &[]).await?;
    let app = roles.pool(db, "app").await?;
    let operator = roles.pool(db, "op").await?;
    Ok((roles, app, operator))
}

/// Runs `body` with the two pools, then drops the roles whatever happened.
/// The database lives until then: a body that ignores its handle (`_db`)
/// drops only a clone (on a `DATABASE_URL` server, dropping the last one
/// drops the database, ending every connection to it).
async fn as_roles<F, Fut>(body: F) -> TestResult
where
    F: FnOnce(Arc<support::MigratedDb>, PgPool, PgPool) -> Fut,
    Fut: std::future::Future<Output = TestResult>,
{
    let db = Arc::new(support::migrated_db().await);
    let (roles, app, operator) = app_and_operator(&db).await?;
    let result = body(db.clone(), app.clone(), operator.clone()).await;
    app.close().await;
    operator.close().await;
    roles.drop_all().await?;
    result
}

/// SQLSTATE and COLUMN of a refused call.
fn refusal<T: std::fmt::Debug>(result: sqlx::Result<T>) -> (String, Option<String>) {
    let error = result.expect_err("refused");
    let db = error.as_database_error().expect("a database error");
    (
        db.code().unwrap_or_default().into_owned(),
        db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .and_then(|e| e.column())
            .map(str::to_owned),
    )
}

/// README: "Create a semaphore that does not exist, but never change the
/// capacity, lease or queue order of one that does."
#[tokio::test]
async fn privileges_open_creates_and_never_changes() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        let open = "SELECT o_capacity, o_default_lease::text, o_created, o_queue_lifo \
                    FROM pgsemaphore.open($1, $2, $3::interval, $4)";
        let created: (i32, String, bool, bool) = sqlx::query_as(open)
            .bind("opened")
            .bind(2)
            .bind("30 s")
            .bind(false)
            .fetch_one(&app)
            .await?;
        assert_eq!(created, (2, "00:00:30".to_owned(), true, false));
        let again: (i32, String, bool, bool) = sqlx::query_as(open)
            .bind("opened")
            .bind(50)
            .bind("1 hour")
            .bind(true)
            .fetch_one(&app)
            .await?;
        assert_eq!(again, (2, "00:00:30".to_owned(), false, false));
        Ok(())
    })
    .await
}

/// README: "Create a family, or a key of a family, that does not exist,
/// but never choose a key's capacity: the operator's rules and tiers give
/// it, and only the operator changes them."
#[tokio::test]
async fn privileges_families_keys_get_the_operators_capacity() -> TestResult {
    as_roles(|_db, app, operator| async move {
        let (capacity, created): (i32, bool) = sqlx::query_as(
            "SELECT o_capacity, o_created FROM pgsemaphore.open_family('tenants', 2, '30 s', '0')",
        )
        .fetch_one(&app)
        .await?;
        assert_eq!((capacity, created), (2, true));
        let (capacity, created): (i32, bool) = sqlx::query_as(
            "SELECT o_capacity, o_created FROM pgsemaphore.open_family('tenants', 900, '1 h', '0')",
        )
        .fetch_one(&app)
        .await?;
        assert_eq!(
            (capacity, created),
            (2, false),
            "an existing family is never changed"
        );
        for sql in [
            "SELECT pgsemaphore.set_family_rule('tenants', 'key', 'k', 500)",
            "SELECT pgsemaphore.set_family_tier('tenants', 'k', 'gold')",
            "SELECT * FROM pgsemaphore.configure_family('tenants', 500, NULL, NULL)",
            "SELECT pgsemaphore.reap_family_keys(10)",
        ] {
            assert!(
                denied(sqlx::query(sql).execute(&app).await),
                "allowed: {sql}"
            );
        }
        sqlx::query("SELECT pgsemaphore.set_family_rule('tenants', 'tier', 'gold', 7)")
            .execute(&operator)
            .await?;
        sqlx::query("SELECT pgsemaphore.set_family_tier('tenants', 'k', 'gold')")
            .execute(&operator)
            .await?;
        let capacity: i32 = sqlx::query_scalar(
            "SELECT o_capacity FROM pgsemaphore.open_family_key('tenants', 'k')",
        )
        .fetch_one(&app)
        .await?;
        assert_eq!(capacity, 7, "the operator's tier rule");
        let changed: i64 =
            sqlx::query_scalar("SELECT pgsemaphore.set_family_rule('tenants', 'key', 'k', 3)")
                .fetch_one(&operator)
                .await?;
        assert_eq!(changed, 1, "the operator's rule reaches the existing key");
        let removed: i64 = sqlx::query_scalar("SELECT pgsemaphore.reap_family_keys(10)")
            .fetch_one(&operator)
            .await?;
        assert_eq!(removed, 1, "the operator reaps the idle key");
        Ok(())
    })
    .await
}

/// README: "Claim slots only within the capacity: every claim counts the
/// held slots under the semaphore's row lock, whatever its arguments."
#[tokio::test]
async fn privileges_claims_stay_within_the_capacity() -> TestResult {
    as_roles(|_db, app, operator| async move {
        sqlx::query("SELECT * FROM pgsemaphore.open('bounded', 4, '90 s')")
            .execute(&app)
            .await?;
        let mut n = 0;
        let mut attempt = |permits: i32, priority: i16, reserve: i32| {
            n += 1;
            sqlx::query_as::<_, (String,)>(
                "SELECT o_status FROM pgsemaphore.claim(p_semaphore => 'bounded', p_holder => 'h', \
                 p_lease => NULL, p_metadata => NULL, p_token => $1, p_permits => $2, \
                 p_priority => $3, p_reserve => $4)",
            )
            .bind(token(&format!("bounded-{n}")))
            .bind(permits)
            .bind(priority)
            .bind(reserve)
        };
        let mut statuses = Vec::new();
        for (permits, priority, reserve) in [
            (2, 1, 0),
            (5, 1, 0),
            (3, 1, 0),
            (1, 0, -3),
            (2, 0, 0),
            (1, 1, 0),
            (100_000, 1, 0),
            (1, 1, 0),
        ] {
            statuses.push(
                match attempt(permits, priority, reserve).fetch_one(&app).await {
                    Ok((status,)) => status,
                    Err(error) => error
                        .as_database_error()
                        .and_then(|e| e.code())
                        .unwrap_or_default()
                        .into_owned(),
                },
            );
            assert!(live_slots(&app, "bounded").await? <= 4, "{statuses:?}");
        }
        assert_eq!(live_slots(&app, "bounded").await?, 4, "{statuses:?}");
        // Lowered below what is held: nothing more until it drains.
        sqlx::query("SELECT * FROM pgsemaphore.configure('bounded', 1, NULL)")
            .execute(&operator)
            .await?;
        let (status,) = attempt(1, 1, 0).fetch_one(&app).await?;
        assert_eq!(status, "full");
        assert_eq!(live_slots(&app, "bounded").await?, 4);
        Ok(())
    })
    .await
}

/// README: "Release, renew or fence only claims whose token it holds; with
/// a wrong token it locks nothing and changes nothing."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_a_wrong_token_locks_and_changes_nothing() -> TestResult {
    as_roles(|db, app, _operator| async move {
        sqlx::query("SELECT * FROM pgsemaphore.open('owned', 2, '90 s')")
            .execute(&app)
            .await?;
        let mine = token("owner");
        let (_, ids) = raw_claim(&app, "owned", &mine).await?;
        let id = ids.expect("claimed")[0];
        let before: (
            Option<chrono::DateTime<chrono::Utc>>,
            chrono::DateTime<chrono::Utc>,
        ) = sqlx::query_as("SELECT completed_at, expires_at FROM pgsemaphore.slots WHERE id = $1")
            .bind(id)
            .fetch_one(&app)
            .await?;

        let mut stranger = app.acquire().await?;
        sqlx::query("BEGIN").execute(&mut *stranger).await?;
        for call in [
            "SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], $2)",
            "SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], $2, true)",
            "SELECT o_outcome FROM pgsemaphore.renew(ARRAY[$1], $2, '1 hour')",
            "SELECT o_outcome FROM pgsemaphore.fence(ARRAY[$1], $2)",
        ] {
            let (outcome,): (String,) = sqlx::query_as(call)
                .bind(id)
                .bind(WRONG_TOKEN)
                .fetch_one(&mut *stranger)
                .await?;
            assert_eq!(outcome, "not_holder", "{call}");
        }
        // The holder, meanwhile, is never blocked by the stranger's open transaction.
        let mut holder = PgConnection::connect_with(
            &db.options
                .clone()
                .username(&app_role(&app).await?)
                .password(PASSWORD),
        )
        .await?;
        sqlx::query("SET lock_timeout = '1s'")
            .execute(&mut holder)
            .await?;
        let (fenced,): (String,) =
            sqlx::query_as("SELECT o_outcome FROM pgsemaphore.fence(ARRAY[$1], $2)")
                .bind(id)
                .bind(&mine)
                .fetch_one(&mut holder)
                .await?;
        assert_eq!(fenced, "held");
        let (renewed,): (String,) =
            sqlx::query_as("SELECT o_outcome FROM pgsemaphore.renew(ARRAY[$1], $2, '90 s')")
                .bind(id)
                .bind(&mine)
                .fetch_one(&mut holder)
                .await?;
        assert_eq!(renewed, "renewed");
        sqlx::query("ROLLBACK").execute(&mut *stranger).await?;
        let after: (
            Option<chrono::DateTime<chrono::Utc>>,
            chrono::DateTime<chrono::Utc>,
        ) = sqlx::query_as("SELECT completed_at, expires_at FROM pgsemaphore.slots WHERE id = $1")
            .bind(id)
            .fetch_one(&app)
            .await?;
        assert_eq!(after.0, before.0, "still live");
        assert!(after.1 >= before.1);
        Ok(())
    })
    .await
}

async fn app_role(app: &PgPool) -> sqlx::Result<String> {
    sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(app)
        .await
}

/// README: "Release, by its token, a claim whose reply it lost, even one
/// still waiting for the semaphore's row: no claim with that token holds a
/// slot afterwards."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_release_by_token_reaches_a_claim_in_flight() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        sqlx::query("SELECT * FROM pgsemaphore.open('lost-reply', 3, '90 s')")
            .execute(&app)
            .await?;
        let lost = token("lost-reply");
        let mut row_holder = app.acquire().await?;
        sqlx::query("BEGIN").execute(&mut *row_holder).await?;
        raw_claim(&mut *row_holder, "lost-reply", &token("row-holder")).await?;
        let in_flight = {
            let (app, lost) = (app.clone(), lost.clone());
            tokio::spawn(async move { raw_claim(&app, "lost-reply", &lost).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let release = {
            let (app, lost) = (app.clone(), lost.clone());
            tokio::spawn(async move {
                sqlx::query_as::<_, (i32, bool)>(
                    "SELECT o_ended, o_wake FROM pgsemaphore.release_by_token('lost-reply', $1)",
                )
                .bind(lost)
                .fetch_one(&app)
                .await
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        sqlx::query("COMMIT").execute(&mut *row_holder).await?;
        release.await??;
        let _ = in_flight.await?;
        let live: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pgsemaphore.live_slots WHERE token_hash = sha256($1::bytea)",
        )
        .bind(&lost)
        .fetch_one(&app)
        .await?;
        assert_eq!(live, 0);
        Ok(())
    })
    .await
}

/// README: "Join, renew and leave only its own places in a queue, and a
/// ticket proves a place only in the queue of its own semaphore."
#[tokio::test]
async fn privileges_queue_places_are_their_owners() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        for name in ["queue-own", "queue-other"] {
            sqlx::query("SELECT * FROM pgsemaphore.open($1, 1, '90 s')")
                .bind(name)
                .execute(&app)
                .await?;
        }
        let enqueue =
            "SELECT o_ticket FROM pgsemaphore.enqueue($1, 1, 1::smallint, 'h', NULL, '10 s', $2)";
        let owner = token("queue-owner");
        let (ticket,): (Option<i64>,) = sqlx::query_as(enqueue)
            .bind("queue-own")
            .bind(&owner)
            .fetch_one(&app)
            .await?;
        let ticket = ticket.expect("queued");
        let expires = || {
            sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
                "SELECT expires_at FROM pgsemaphore.waiters WHERE id = $1",
            )
            .bind(ticket)
        };
        let before = expires().fetch_one(&app).await?;
        // Someone else renews and leaves: nothing happens to the place.
        sqlx::query(
            "SELECT pgsemaphore.keep_waiting('queue-own', '60 s', ARRAY[$1], $2, false, 1)",
        )
        .bind(ticket)
        .bind(WRONG_TOKEN)
        .execute(&app)
        .await?;
        let left: bool = sqlx::query_scalar("SELECT pgsemaphore.leave_queue($1, $2)")
            .bind(ticket)
            .bind(WRONG_TOKEN)
            .fetch_one(&app)
            .await?;
        assert!(!left);
        assert_eq!(expires().fetch_one(&app).await?, before);
        // The ticket proves nothing in another semaphore's queue.
        let (status,): (String,) = sqlx::query_as(
            "SELECT o_status FROM pgsemaphore.claim(p_semaphore => 'queue-other', p_holder => 'h', \
             p_lease => NULL, p_metadata => NULL, p_token => $1, p_ticket => $2, \
             p_ticket_token => $3, p_waiter_lease => '10 s')",
        )
        .bind(token("jump"))
        .bind(ticket)
        .bind(&owner)
        .fetch_one(&app)
        .await?;
        assert_eq!(status, "no_ticket");
        // Its owner renews and leaves.
        sqlx::query(
            "SELECT pgsemaphore.keep_waiting('queue-own', '60 s', ARRAY[$1], $2, false, 1)",
        )
        .bind(ticket)
        .bind(&owner)
        .execute(&app)
        .await?;
        assert!(expires().fetch_one(&app).await? > before);
        let left: bool = sqlx::query_scalar("SELECT pgsemaphore.leave_queue($1, $2)")
            .bind(ticket)
            .bind(&owner)
            .fetch_one(&app)
            .await?;
        assert!(left);
        Ok(())
    })
    .await
}

/// README: "Read every table, which is the audit log: holders, metadata,
/// and the SHA-256 of tokens, never a token."
#[tokio::test]
async fn privileges_every_table_is_readable_and_holds_no_token() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        sqlx::query("SELECT * FROM pgsemaphore.open('readable', 1, '90 s')")
            .execute(&app)
            .await?;
        let mine = token("readable");
        raw_claim(&app, "readable", &mine).await?;
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables WHERE schemaname = 'pgsemaphore'",
        )
        .fetch_all(&app)
        .await?;
        assert!(tables.len() >= 6, "{tables:?}");
        for table in &tables {
            sqlx::query(AssertSqlSafe(format!("SELECT * FROM {table} LIMIT 1")))
                .execute(&app)
                .await
                .map_err(|e| format!("{table}: {e}"))?;
        }
        let (stored, hashed): (Vec<u8>, Vec<u8>) = sqlx::query_as(
            "SELECT token_hash, sha256($1::bytea) FROM pgsemaphore.slots WHERE semaphore = 'readable'",
        )
        .bind(&mine)
        .fetch_one(&app)
        .await?;
        assert_eq!(stored, hashed);
        assert_ne!(stored, mine);
        Ok(())
    })
    .await
}

/// README: "Check rate limits, and so use up a key's budget."
#[tokio::test]
async fn privileges_rate_limits_are_checked_and_spent() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        let check = "SELECT o_allowed FROM pgsemaphore.fixed_window('budget', 'k', 2, '1 hour', 1)";
        let mut allowed = Vec::new();
        for _ in 0..3 {
            allowed.push(sqlx::query_scalar::<_, bool>(check).fetch_one(&app).await?);
        }
        assert_eq!(allowed, [true, true, false]);
        // Waiting is spending too: a booking takes a later window's budget
        // (1 per hour: the fixed window's next booking is an hour away), but
        // never more than one window ahead, whatever wait is asked for (the
        // sliding window's next room is two windows away, once the first
        // has slid out: refused).
        for (function, max_wait) in [
            ("fixed_window_reserve", "90 minutes"),
            ("sliding_window_reserve", "150 minutes"),
        ] {
            let sliding = function.starts_with("sliding");
            let reserve = format!(
                "SELECT o_allowed, o_wait_us > 0 FROM pgsemaphore.{function}('booked', 'k', 1, '1 hour', 1, '{max_wait}')"
            );
            let mut booked = Vec::new();
            for _ in 0..3 {
                booked.push(
                    sqlx::query_as::<_, (bool, bool)>(AssertSqlSafe(reserve.clone()))
                        .fetch_one(&app)
                        .await?,
                );
            }
            assert_eq!(booked[0], (true, false), "{function}: the first at once");
            assert_eq!(booked[1], (!sliding, true), "{function}: the next later, within one window");
            assert!(!booked[2].0, "{function}: past the longest wait: {booked:?}");
        }
        Ok(())
    })
    .await
}

/// README: "Check rate limits only under the limits stored in the
/// database: the first check of a limiter stores its limits, and no later
/// caller's limits reset or fill another key's window or bucket, nor book
/// it more than one window, or burst / rate, ahead."
#[tokio::test]
async fn privileges_rate_limits_are_the_stored_ones() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        let first = "SELECT o_allowed FROM pgsemaphore.fixed_window('stored-first', 'k', 1, '1 hour', 1)";
        assert!(sqlx::query_scalar::<_, bool>(first).fetch_one(&app).await?);
        // Another caller's limits: a 1 ms window would have rolled the key.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let reset = "SELECT o_allowed FROM pgsemaphore.fixed_window('stored-first', 'k', 1000000, '1 ms', 1)";
        assert!(!sqlx::query_scalar::<_, bool>(reset).fetch_one(&app).await?);
        let fill = "SELECT o_allowed FROM pgsemaphore.token_bucket('stored-bucket', 'k', 1, 1, 1)";
        assert!(sqlx::query_scalar::<_, bool>(fill).fetch_one(&app).await?);
        let refill = "SELECT o_allowed FROM pgsemaphore.token_bucket('stored-bucket', 'k', 1e9, 1e15, 1)";
        assert!(!sqlx::query_scalar::<_, bool>(refill).fetch_one(&app).await?);
        // Bookings: the next window at most, and a bucket's one burst.
        let book = "SELECT o_allowed FROM pgsemaphore.fixed_window_reserve('stored-first', 'k', 1000000, '366 days', 1, '366 days')";
        let mut booked = Vec::new();
        for _ in 0..3 {
            booked.push(sqlx::query_scalar::<_, bool>(book).fetch_one(&app).await?);
        }
        assert_eq!(booked, [true, false, false], "booked beyond one window");
        let reserve = "SELECT o_allowed FROM pgsemaphore.token_bucket_reserve('stored-bucket', 'k', 1e9, 1e15, 1, '366 days')";
        let mut reserved = Vec::new();
        for _ in 0..3 {
            reserved.push(sqlx::query_scalar::<_, bool>(reserve).fetch_one(&app).await?);
        }
        assert_eq!(reserved, [true, false, false], "reserved beyond one burst");
        Ok(())
    })
    .await
}

/// README: "Holding a rate limiter key's advisory lock, which any role may
/// take, or leaving a check in an open transaction, delays that key's
/// checks that could be admitted by at most 2 seconds each, which then fail
/// with SQLSTATE 55P03 (`Error::Stalled`), while waiting acquires keep
/// retrying; checks the key's committed state refuses are answered at once."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_a_held_rate_key_delays_checks_at_most_2_seconds() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        let limiter = RateLimiter::builder("held-key", RatePolicy::token_bucket(10.0, 10))
            .build(&pg_semaphore::Client::new(app.clone()))?;
        assert!(limiter.check("k", 1).await?.allowed);
        let mut holder = app.acquire().await?;
        sqlx::query("SELECT pg_advisory_lock(1885828967, hashtext('token_bucket/held-key/k'))")
            .execute(&mut *holder)
            .await?;
        let stalled = tokio::time::timeout(Duration::from_secs(30), limiter.check("k", 1))
            .await
            .expect("a check waited for a held key without bound");
        assert!(matches!(stalled, Err(Error::Stalled { .. })), "{stalled:?}");
        let waiter = {
            let limiter = limiter.clone();
            tokio::spawn(async move {
                limiter
                    .acquire_timeout("k", 1, Duration::from_secs(30))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(2500)).await;
        sqlx::query("SELECT pg_advisory_unlock_all()")
            .execute(&mut *holder)
            .await?;
        assert!(waiter.await??.allowed, "the waiting acquire did not retry");
        // A check left in an open transaction holds the key the same way.
        let mut open = app.begin().await?;
        sqlx::query("SELECT * FROM pgsemaphore.token_bucket('held-key', 'k', 10, 10, 1)")
            .execute(&mut *open)
            .await?;
        let stalled = tokio::time::timeout(Duration::from_secs(30), limiter.check("k", 1))
            .await
            .expect("a check waited for an open transaction without bound");
        assert!(matches!(stalled, Err(Error::Stalled { .. })), "{stalled:?}");
        open.rollback().await?;
        // An empty key: its checks are refused on the committed state while
        // the lock is held (a check that waited for it would end Stalled:
        // the lock is never let go during the check).
        let empty = RateLimiter::builder("held-empty", RatePolicy::token_bucket(0.001, 1))
            .build(&pg_semaphore::Client::new(app.clone()))?;
        assert!(empty.check("k", 1).await?.allowed);
        sqlx::query("SELECT pg_advisory_lock(1885828967, hashtext('token_bucket/held-empty/k'))")
            .execute(&mut *holder)
            .await?;
        let refused = empty.check("k", 1).await;
        assert!(matches!(&refused, Ok(d) if !d.allowed), "{refused:?}");
        sqlx::query("SELECT pg_advisory_unlock_all()")
            .execute(&mut *holder)
            .await?;
        Ok(())
    })
    .await
}

/// README: "Check several rate limits at once, charged all or none, and
/// read the stored limits and pauses in force, but never store, clear or
/// shorten them."
#[tokio::test]
async fn privileges_limits_are_checked_together_and_never_changed() -> TestResult {
    as_roles(|_db, app, operator| async move {
        let multi = "SELECT o_allowed FROM pgsemaphore.check_limits(
                         ARRAY['fixed_window', 'token_bucket'], ARRAY['day', 'second'], ARRAY['k', 'k'],
                         ARRAY[NULL, 0.001]::float8[], ARRAY[NULL, 1]::float8[],
                         ARRAY[5, NULL]::bigint[], ARRAY['1 day', NULL]::interval[], 1)";
        let mut allowed = Vec::new();
        for _ in 0..2 {
            allowed.push(sqlx::query_scalar::<_, bool>(multi).fetch_one(&app).await?);
        }
        assert_eq!(allowed, [true, false]);
        sqlx::query("SELECT pgsemaphore.set_rate_limit('fixed_window', 'day', NULL, NULL, NULL, 9, '1 day')")
            .execute(&operator)
            .await?;
        let in_force: Option<i64> =
            sqlx::query_scalar("SELECT o_limit FROM pgsemaphore.rate_limit_in_force('fixed_window', 'day', 'k')")
                .fetch_one(&app)
                .await?;
        assert_eq!(in_force, Some(9));
        for sql in [
            "SELECT pgsemaphore.set_rate_limit('fixed_window', 'day', NULL, NULL, NULL, 1000, '1 day')",
            "SELECT pgsemaphore.clear_rate_limit('fixed_window', 'day', NULL)",
            "SELECT pgsemaphore.resume_rate_limit('fixed_window', 'day', NULL)",
        ] {
            assert!(denied(sqlx::query(sql).execute(&app).await), "allowed: {sql}");
        }
        Ok(())
    })
    .await
}

/// README: "Pausing a rate limiter, or any of its keys, refuses every
/// process's checks of it for at most an hour past its last pause; only an
/// operator ends a pause early (`pg_semaphore::admin::resume_rate_limit`,
/// `pg-semaphore limits resume`)."
#[tokio::test]
async fn privileges_a_pause_lasts_at_most_an_hour_and_only_the_operator_ends_it() -> TestResult {
    as_roles(|_db, app, operator| async move {
        let pause = |length: &'static str| {
            sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(AssertSqlSafe(format!(
                "SELECT pgsemaphore.pause_rate_limit('token_bucket', 'upstream', NULL, '{length}')"
            )))
        };
        let until = pause("1 hour").fetch_one(&app).await?;
        // A shorter pause does not shorten it; a longer one is refused.
        assert_eq!(pause("1 s").fetch_one(&app).await?, until);
        assert_eq!(
            refusal(pause("2 hours").fetch_one(&app).await),
            ("22023".to_owned(), Some("p_for".to_owned()))
        );
        let check = "SELECT o_allowed FROM pgsemaphore.token_bucket('upstream', 'k', 1, 1, 1)";
        assert!(!sqlx::query_scalar::<_, bool>(check).fetch_one(&app).await?);
        assert!(denied(
            sqlx::query("SELECT pgsemaphore.resume_rate_limit('token_bucket', 'upstream', NULL)")
                .execute(&app)
                .await
        ));
        let resumed: bool = sqlx::query_scalar(
            "SELECT pgsemaphore.resume_rate_limit('token_bucket', 'upstream', NULL)",
        )
        .fetch_one(&operator)
        .await?;
        assert!(resumed);
        assert!(sqlx::query_scalar::<_, bool>(check).fetch_one(&app).await?);
        Ok(())
    })
    .await
}

/// README: "Write any table directly."
#[tokio::test]
async fn privileges_no_table_is_writable() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables WHERE schemaname = 'pgsemaphore'",
        )
        .fetch_all(&app)
        .await?;
        for table in &tables {
            let column: String = sqlx::query_scalar(
                "SELECT quote_ident(attname) FROM pg_attribute
                  WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped
                    AND attidentity = '' AND attgenerated = ''
                  ORDER BY attnum LIMIT 1",
            )
            .bind(table)
            .fetch_one(&app)
            .await?;
            for sql in [
                format!("DELETE FROM {table}"),
                format!("UPDATE {table} SET {column} = {column}"),
                format!("INSERT INTO {table} DEFAULT VALUES"),
                format!("TRUNCATE {table}"),
            ] {
                assert!(
                    denied(sqlx::query(AssertSqlSafe(sql.clone())).execute(&app).await),
                    "allowed: {sql}"
                );
            }
        }
        Ok(())
    })
    .await
}

/// README: "Write rows of the advisory semaphores' audit log, which records
/// what holders reported: only of advisory semaphores that exist, with
/// distinct slots below the highest capacity the semaphore has had, an end
/// neither before its start nor in the future, at most 64 kB of metadata
/// each and at most 1,000 rows a call; the operator's retention prunes
/// them." A role with no grants writes none.
#[tokio::test]
async fn privileges_the_advisory_audit_log_takes_only_what_a_holder_could_report() -> TestResult {
    as_roles(|db, app, operator| async move {
        sqlx::query("SELECT * FROM pgsemaphore.open_advisory('audited', 4)")
            .execute(&app)
            .await?;
        // The test writes its entries as JSON objects; this statement hands
        // them to the function as the arrays a holder's writer sends.
        let log = "SELECT pgsemaphore.advisory_log(
                       coalesce(array_agg(j.e->>'semaphore' ORDER BY j.n), '{}'),
                       coalesce(array_agg(j.e->>'holder' ORDER BY j.n), '{}'),
                       coalesce(array_agg(jsonb_array_length(j.e->'slots') ORDER BY j.n), '{}'),
                       coalesce((SELECT array_agg(s.v::int ORDER BY k.n, s.o)
                                   FROM jsonb_array_elements($1) WITH ORDINALITY AS k(e, n),
                                        jsonb_array_elements_text(k.e->'slots') WITH ORDINALITY AS s(v, o)), '{}'),
                       coalesce(array_agg(nullif(j.e->'metadata', 'null') ORDER BY j.n), '{}'),
                       coalesce(array_agg((j.e->>'acquired_at')::timestamptz ORDER BY j.n), '{}'),
                       coalesce(array_agg((j.e->>'ended_at')::timestamptz ORDER BY j.n), '{}'),
                       coalesce(array_agg(j.e->>'outcome' ORDER BY j.n), '{}'))
                     FROM jsonb_array_elements($1) WITH ORDINALITY AS j(e, n)";
        let entry = |changes: serde_json::Value| {
            let mut entry = serde_json::json!({
                "semaphore": "audited", "slots": [0, 3], "holder": "worker-1",
                "metadata": {"job": 7},
                "acquired_at": (Utc::now() - chrono::Duration::seconds(5)).to_rfc3339(),
                "ended_at": Utc::now().to_rfc3339(), "outcome": "released",
            });
            for (key, value) in changes.as_object().unwrap() {
                entry[key] = value.clone();
            }
            entry
        };
        let rows = || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pgsemaphore.advisory_claims")
                .fetch_one(&db.pool)
                .await
        };
        // What a holder reports is written, each permit with its own slots.
        let written: i32 = sqlx::query_scalar(log)
            .bind(serde_json::json!([
                entry(serde_json::json!({})),
                entry(serde_json::json!({"slots": [2], "metadata": null}))
            ]))
            .fetch_one(&app)
            .await?;
        assert_eq!((written, rows().await?), (2, 2));
        let slots: Vec<Vec<i32>> = sqlx::query_scalar(
            "SELECT slots FROM pgsemaphore.advisory_claims ORDER BY cardinality(slots) DESC",
        )
        .fetch_all(&db.pool)
        .await?;
        assert_eq!(slots, [vec![0, 3], vec![2]]);

        // What no holder could report is refused, the whole batch with it,
        // naming the argument and the entry.
        let in_an_hour = (Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
        let an_hour_ago = (Utc::now() - chrono::Duration::hours(1)).to_rfc3339();
        let big = "x".repeat(70_000);
        for (forged, what, argument) in [
            (
                serde_json::json!({"semaphore": "nobody-made-it"}),
                "a semaphore that does not exist",
                "p_semaphores",
            ),
            (
                serde_json::json!({"slots": [99999, -5]}),
                "slots outside the capacity",
                "p_slots",
            ),
            (
                serde_json::json!({"slots": [4]}),
                "a slot at the capacity",
                "p_slots",
            ),
            (
                serde_json::json!({"slots": [0, 4]}),
                "one of several slots at the capacity",
                "p_slots",
            ),
            (
                serde_json::json!({"slots": [1, 1]}),
                "a slot twice",
                "p_slots",
            ),
            (
                serde_json::json!({"holder": ""}),
                "an empty holder",
                "p_holders",
            ),
            (
                serde_json::json!({"ended_at": an_hour_ago}),
                "an end before the start",
                "p_ended_at",
            ),
            (
                serde_json::json!({"ended_at": in_an_hour}),
                "an end in the future",
                "p_ended_at",
            ),
            (
                serde_json::json!({"metadata": {"blob": big}}),
                "more than 64 kB of metadata",
                "p_metadata",
            ),
            (
                serde_json::json!({"outcome": "stolen"}),
                "an outcome no holder reports",
                "p_outcomes",
            ),
        ] {
            let batch = serde_json::json!([entry(serde_json::json!({})), entry(forged)]);
            let result = sqlx::query_scalar::<_, i32>(log)
                .bind(batch)
                .fetch_one(&app)
                .await;
            let message = result.as_ref().err().map(ToString::to_string);
            assert_eq!(
                refusal(result),
                ("22023".to_owned(), Some(argument.to_owned())),
                "{what} was accepted"
            );
            let message = message.unwrap_or_default();
            assert!(
                message.contains("entry 2:"),
                "{what}: the refusal names the wrong entry: {message}"
            );
            assert_eq!(rows().await?, 2, "{what}: a refused batch wrote rows");
        }

        // Arrays that do not line up are refused before any entry is read.
        let now = Utc::now();
        let earlier = now - chrono::Duration::seconds(5);
        let shaped = |counts: Vec<i32>, slots: Vec<i32>, holders: Vec<&'static str>| {
            sqlx::query_scalar::<_, i32>(
                "SELECT pgsemaphore.advisory_log($1, $2, $3, $4, $5, $6, $7, $8)",
            )
            .bind(vec!["audited", "audited"])
            .bind(holders)
            .bind(counts)
            .bind(slots)
            .bind(vec![None::<serde_json::Value>, None])
            .bind(vec![earlier, earlier])
            .bind(vec![now, now])
            .bind(vec!["released", "released"])
        };
        for (query, what, argument) in [
            (
                shaped(vec![1, 0], vec![1], vec!["w", "w"]),
                "a permit of no slot",
                "p_slots",
            ),
            (
                shaped(vec![2, -1], vec![1], vec!["w", "w"]),
                "a negative count that evens out the slots",
                "p_slots",
            ),
            (
                shaped(vec![1, 1], vec![1, 2, 3], vec!["w", "w"]),
                "more slots than the counts say",
                "p_slots",
            ),
            (
                shaped(vec![1, 1], vec![1, 2], vec!["w"]),
                "a holder missing",
                "p_holders",
            ),
        ] {
            assert_eq!(
                refusal(query.fetch_one(&app).await),
                ("22023".to_owned(), Some(argument.to_owned())),
                "{what} was accepted"
            );
            assert_eq!(rows().await?, 2, "{what}: a refused batch wrote rows");
        }
        let too_many: Vec<_> = (0..1001).map(|_| entry(serde_json::json!({}))).collect();
        let result = sqlx::query_scalar::<_, i32>(log)
            .bind(serde_json::Value::Array(too_many))
            .fetch_one(&app)
            .await;
        assert_eq!(
            refusal(result),
            ("22023".to_owned(), Some("p_semaphores".to_owned()))
        );
        assert_eq!(rows().await?, 2);

        // A row of a permit held before a capacity drop is still accepted
        // once the drop is over: its slot lies below the highest capacity.
        sqlx::query("SELECT * FROM pgsemaphore.configure_advisory('audited', 2)")
            .execute(&operator)
            .await?;
        sqlx::query("SELECT pgsemaphore.advisory_drained('audited')")
            .execute(&app)
            .await?;
        let peak: i32 = sqlx::query_scalar(
            "SELECT peak_capacity FROM pgsemaphore.advisory_semaphores WHERE name = 'audited'",
        )
        .fetch_one(&app)
        .await?;
        assert_eq!(peak, 2, "the drop is over");
        sqlx::query(log)
            .bind(serde_json::json!([entry(
                serde_json::json!({"slots": [3]})
            )]))
            .execute(&app)
            .await?;
        assert_eq!(rows().await?, 3);

        // A role with no grants writes nothing.
        let nobody = extra_role(&db, "none", "").await?;
        let result = sqlx::query(log)
            .bind(serde_json::json!([entry(serde_json::json!({}))]))
            .execute(&nobody)
            .await;
        drop_extra_role(&db, "none", nobody).await?;
        assert!(denied(result), "a role with no grants wrote the audit log");
        assert_eq!(rows().await?, 3);

        // The operator's retention prunes the log (the application cannot).
        assert!(denied(
            sqlx::query("SELECT pgsemaphore.prune('0', 100)")
                .execute(&app)
                .await
        ));
        pg_semaphore::admin::prune_claims(&operator, Duration::ZERO).await?;
        assert_eq!(rows().await?, 0, "prune_claims left advisory rows");
        Ok(())
    })
    .await
}

/// README: "Any role, even one without grants, can hold a name's creation
/// key (`pg_advisory_lock(1885828966, hashtext(name))`): it delays the
/// creation of a lease semaphore of that name by at most 2 seconds, which
/// then fails with SQLSTATE 55P03 (`Error::Stalled`) having created
/// nothing, and the opening of an existing one not at all." (The advisory
/// semaphore's creation too, here; its own sentence is tested by
/// `privileges_foreign_holds_of_advisory_keys_are_listed_and_counted`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_a_held_creation_key_delays_only_creation_by_at_most_the_bound() -> TestResult {
    as_roles(|db, app, _operator| async move {
        let nobody = extra_role(&db, "none", "").await?;
        let outcome = async {
            // The creation key of a name (class 1885828966, the name's
            // hashtext), held by a role with no grants.
            let mut squatter = nobody.acquire().await?;
            sqlx::query("SELECT pg_advisory_lock(1885828966, hashtext($1))")
                .bind("squatted")
                .execute(&mut *squatter)
                .await?;
            for advisory in [false, true] {
                let started = std::time::Instant::now();
                let build = async {
                    if advisory {
                        pg_semaphore::AdvisorySemaphore::builder("squatted", 2)
                            .build(&pg_semaphore::Client::new(app.clone()))
                            .await
                            .map(drop)
                    } else {
                        Semaphore::builder("squatted", 2).build(&pg_semaphore::Client::new(app.clone())).await.map(drop)
                    }
                };
                let built = tokio::time::timeout(Duration::from_secs(10), build)
                    .await
                    .expect("opening waited on the key without bound");
                let waited = started.elapsed();
                assert!(matches!(built, Err(Error::Stalled { .. })), "{built:?}");
                assert!(
                    waited >= Duration::from_millis(1900) && waited < Duration::from_secs(4),
                    "{waited:?}"
                );
            }
            let created: i64 = sqlx::query_scalar(
                "SELECT (SELECT count(*) FROM pgsemaphore.semaphores WHERE name = 'squatted')
                      + (SELECT count(*) FROM pgsemaphore.advisory_semaphores WHERE name = 'squatted')",
            )
            .fetch_one(&app)
            .await?;
            assert_eq!(created, 0, "a stalled open created its semaphore");
            sqlx::query("SELECT pg_advisory_unlock(1885828966, hashtext($1))")
                .bind("squatted")
                .execute(&mut *squatter)
                .await?;
            Semaphore::builder("squatted", 2).build(&pg_semaphore::Client::new(app.clone())).await?;
            // An existing semaphore opens at once while its key is held.
            sqlx::query("SELECT pg_advisory_lock(1885828966, hashtext($1))")
                .bind("squatted")
                .execute(&mut *squatter)
                .await?;
            let opened = tokio::time::timeout(
                Duration::from_millis(1500),
                Semaphore::builder("squatted", 2).build(&pg_semaphore::Client::new(app.clone())),
            )
            .await;
            assert!(matches!(opened, Ok(Ok(_))), "{opened:?}");
            TestResult::Ok(())
        }
        .await;
        drop_extra_role(&db, "none", nobody).await?;
        outcome
    })
    .await
}

/// The baseline's privileges, routine by routine: PUBLIC runs none, and
/// with the guide's grants the application runs exactly the application
/// functions (claim_all, release_all and release_all_then_wake beside
/// claim; every reservation beside its check; open_family and
/// open_family_key beside open), the operator exactly the operator
/// functions (the families', fair weights and the rate limits' among them),
/// and neither an internal helper (the windows' bookings, the families'
/// recomputation). What the migrations of the upgrades from the 0.1
/// histories granted, pinned on the schema as it is now.
#[tokio::test]
async fn privileges_each_routine_runs_for_exactly_its_documented_roles() -> TestResult {
    as_roles(|db, app, operator| async move {
        let routines = "SELECT p.oid::regprocedure::text FROM pg_proc p
                          JOIN pg_namespace n ON n.oid = p.pronamespace
                         WHERE n.nspname = 'pgsemaphore' AND has_function_privilege(p.oid, 'EXECUTE')";
        let public: Vec<String> = sqlx::query_scalar(
            "SELECT p.oid::regprocedure::text FROM pg_proc p
               JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname = 'pgsemaphore' AND has_function_privilege('public', p.oid, 'EXECUTE')",
        )
        .fetch_all(&db.pool)
        .await?;
        assert_eq!(public, Vec::<String>::new(), "PUBLIC runs these");
        let mut application = [
            "schema_version()",
            "open(text,integer,interval,boolean)",
            "claim(text,text,interval,jsonb,bytea,integer,smallint,integer,bigint,bytea,interval)",
            "release(bigint[],bytea,boolean)",
            "claim_all(text[],text,interval,jsonb,bytea,integer[],text[],text[],text[],double precision[],double precision[],bigint[],interval[])",
            "release_all(bigint[],bytea,boolean)",
            "release_by_token(text,bytea)",
            "renew(bigint[],bytea,interval)",
            "fence(bigint[],bytea)",
            "enqueue(text,integer,smallint,text,integer,interval,bytea,text)",
            "leave_queue(bigint,bytea)",
            "keep_waiting(text,interval,bigint[],bytea,boolean,bigint)",
            "stop_waiting(text,bytea,bigint)",
            "wake(text)",
            "wake_claimed(bigint)",
            "release_then_wake(bigint[],bytea,boolean,text,bigint,timestamp with time zone)",
            "release_all_then_wake(bigint[],bytea,boolean,text,bigint,timestamp with time zone)",
            "token_bucket(text,text,double precision,double precision,double precision)",
            "token_bucket_reserve(text,text,double precision,double precision,double precision,interval)",
            "fixed_window(text,text,bigint,interval,bigint)",
            "sliding_window(text,text,bigint,interval,bigint)",
            "fixed_window_reserve(text,text,bigint,interval,bigint,interval)",
            "sliding_window_reserve(text,text,bigint,interval,bigint,interval)",
            "check_limits(text[],text[],text[],double precision[],double precision[],bigint[],interval[],bigint)",
            "check_limits_reserve(text[],text[],text[],double precision[],double precision[],bigint[],interval[],bigint,interval)",
            "pause_rate_limit(text,text,text,interval)",
            "rate_limit_in_force(text,text,text)",
            "open_advisory(text,integer)",
            "advisory_claim(text,integer,integer[])",
            "advisory_release(text,bigint,integer[])",
            "advisory_release_one(text,bigint,bigint)",
            "advisory_drained(text)",
            "advisory_rearm(text)",
            "advisory_log(text[],text[],integer[],integer[],jsonb[],timestamp with time zone[],timestamp with time zone[],text[])",
            "open_family(text,integer,interval,interval)",
            "open_family_key(text,text)",
            "record_outcomes(text[],text[],bigint[],bigint[],bigint[])",
        ]
        .map(|f| format!("pgsemaphore.{f}"));
        application.sort();
        let mut operators = [
            "schema_version()",
            "configure(text,integer,interval,boolean,boolean)",
            "force_release(bigint)",
            "clear_queue(text)",
            "reap()",
            "prune(interval,integer)",
            "prune_rate_limits(interval,text,text,text,integer)",
            "configure_advisory(text,integer)",
            "set_fair_weight(text,text,integer)",
            "set_rate_limit(text,text,text,double precision,double precision,bigint,interval)",
            "clear_rate_limit(text,text,text)",
            "resume_rate_limit(text,text,text)",
            "pause_rate_limit(text,text,text,interval)",
            "configure_family(text,integer,interval,interval,boolean)",
            "set_family_rule(text,text,text,integer)",
            "set_family_tier(text,text,text)",
            "reap_family_keys(integer)",
        ]
        .map(|f| format!("pgsemaphore.{f}"));
        operators.sort();
        let mut app_runs: Vec<String> = sqlx::query_scalar(routines).fetch_all(&app).await?;
        app_runs.sort();
        assert_eq!(app_runs, application, "the application's routines");
        let mut operator_runs: Vec<String> =
            sqlx::query_scalar(routines).fetch_all(&operator).await?;
        operator_runs.sort();
        assert_eq!(operator_runs, operators, "the operator's routines");
        Ok(())
    })
    .await
}

/// README: "Run the operator functions or the internal helpers."
#[tokio::test]
async fn privileges_operator_functions_and_helpers_are_refused() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        // Every routine of the schema the application was not granted.
        let refused: Vec<String> = sqlx::query_scalar(
            "SELECT p.oid::regprocedure::text FROM pg_proc p
               JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname = 'pgsemaphore'
                AND NOT has_function_privilege(p.oid, 'EXECUTE')
              ORDER BY 1",
        )
        .fetch_all(&app)
        .await?;
        for expected in [
            "pgsemaphore.configure(text,integer,interval,boolean,boolean)",
            "pgsemaphore.force_release(bigint)",
            "pgsemaphore.clear_queue(text)",
            "pgsemaphore.set_fair_weight(text,text,integer)",
            "pgsemaphore.reap()",
            "pgsemaphore.prune(interval,integer)",
            "pgsemaphore.gate(text)",
            "pgsemaphore.token_bucket_unchecked(text,text,double precision,double precision,double precision)",
            "pgsemaphore.prune_unchecked(interval,integer)",
            "pgsemaphore.prune_advisory_claims(interval,integer)",
            "pgsemaphore.prune_outcomes(interval,integer)",
            "pgsemaphore.notify_if_waited(text)",
            "pgsemaphore.fixed_window_book(text,text,bigint,interval,bigint,interval)",
            "pgsemaphore.sliding_window_book(text,text,bigint,interval,bigint,interval)",
            "pgsemaphore.fixed_window_unchecked(text,text,bigint,interval,bigint)",
            "pgsemaphore.configure_family(text,integer,interval,interval,boolean)",
            "pgsemaphore.set_family_rule(text,text,text,integer)",
            "pgsemaphore.set_family_tier(text,text,text)",
            "pgsemaphore.reap_family_keys(integer)",
            "pgsemaphore.family_recompute(text,text)",
            "pgsemaphore.family_capacity(text,text,integer)",
        ] {
            assert!(refused.iter().any(|r| r == expected), "{expected} is executable: {refused:?}");
        }
        // Calling them proves it, not only the catalog.
        for sql in [
            "SELECT pgsemaphore.gate('x')",
            "SELECT pgsemaphore.refuse('p_x', 'no')",
            "SELECT * FROM pgsemaphore.token_bucket_unchecked('l', 'k', 1, 1, 1)",
            "SELECT pgsemaphore.prune_unchecked('0', 1)",
            "SELECT pgsemaphore.prune_advisory_claims('0', 1)",
            "SELECT pgsemaphore.prune_outcomes('0', 1)",
            "SELECT pgsemaphore.clear_queue('x')",
            "SELECT * FROM pgsemaphore.fixed_window_book('l', 'k', 1, '1 s', 1, '1 s')",
            "SELECT * FROM pgsemaphore.sliding_window_book('l', 'k', 1, '1 s', 1, '1 s')",
        ] {
            assert!(denied(sqlx::query(sql).execute(&app).await), "allowed: {sql}");
        }
        Ok(())
    })
    .await
}

/// README: "Pass an argument outside its documented range: every function
/// refuses it with SQLSTATE 22023 and the argument's name in the error's
/// COLUMN field." (Every argument of every function: tests/hostile.rs.)
#[tokio::test]
async fn privileges_arguments_out_of_range_are_refused() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        sqlx::query("SELECT * FROM pgsemaphore.open('ranged', 2, '90 s')")
            .execute(&app)
            .await?;
        for (sql, column) in [
            ("SELECT * FROM pgsemaphore.claim('ranged', 'h', NULL, NULL, $1, p_permits => -1)", "p_permits"),
            ("SELECT * FROM pgsemaphore.claim('ranged', 'h', NULL, NULL, $1, p_reserve => -1)", "p_reserve"),
            ("SELECT * FROM pgsemaphore.release(ARRAY[NULL::bigint], $1)", "p_ids"),
            ("SELECT * FROM pgsemaphore.renew(ARRAY[1], $1, '-1 s')", "p_lease"),
            ("SELECT * FROM pgsemaphore.enqueue('ranged', 1, 1::smallint, 'h', NULL, '1 year', $1)", "p_waiter_lease"),
            ("SELECT * FROM pgsemaphore.enqueue('ranged', 1, 1::smallint, 'h', NULL, '10 s', $1, '')", "p_fair_key"),
            ("SELECT * FROM pgsemaphore.claim('ranged', 'h', NULL, NULL, NULL)", "p_token"),
        ] {
            let result = sqlx::query(sql).bind(token("ranged")).execute(&app).await;
            assert_eq!(refusal(result), ("22023".to_owned(), Some(column.to_owned())), "{sql}");
        }
        Ok(())
    })
    .await
}

/// README: "Holding a semaphore's row in an open transaction delays every
/// other claim of that semaphore, and every operator change of it, by at
/// most 2 seconds each, which then fails with SQLSTATE 55P03
/// (`Error::Stalled`), while waiting acquires keep retrying."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_a_held_row_delays_claims_by_at_most_the_bound() -> TestResult {
    as_roles(|_db, app, operator| async move {
        let sem = Semaphore::builder("held-row", 2)
            .build(&pg_semaphore::Client::new(app.clone()))
            .await?;
        let mut squatter = app.acquire().await?;
        sqlx::query("BEGIN").execute(&mut *squatter).await?;
        sqlx::query(
            "SELECT * FROM pgsemaphore.enqueue('held-row', 1, 1::smallint, 'h', NULL, '10 s', $1)",
        )
        .bind(token("squatter"))
        .execute(&mut *squatter)
        .await?;
        let started = std::time::Instant::now();
        let refused = raw_claim(&app, "held-row", &token("other")).await;
        let waited = started.elapsed();
        assert_eq!(refusal(refused).0, "55P03");
        assert!(
            waited >= Duration::from_millis(1900) && waited < Duration::from_secs(4),
            "{waited:?}"
        );
        assert!(matches!(
            sem.try_acquire().await,
            Err(Error::Stalled { .. })
        ));
        // The operator's changes wait as long, and change nothing.
        let started = std::time::Instant::now();
        let resized = pg_semaphore::admin::set_capacity(&operator, "held-row", 5).await;
        let waited = started.elapsed();
        assert!(matches!(resized, Err(Error::Stalled { .. })), "{resized:?}");
        assert!(waited < Duration::from_secs(4), "{waited:?}");
        let cleared = pg_semaphore::admin::clear_queue(&operator, "held-row").await;
        assert!(matches!(cleared, Err(Error::Stalled { .. })), "{cleared:?}");
        let waiter = {
            let sem = sem.clone();
            tokio::spawn(async move {
                sem.acquiring()
                    .timeout(Duration::from_secs(20))
                    .acquire()
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert!(!waiter.is_finished());
        sqlx::query("ROLLBACK").execute(&mut *squatter).await?;
        waiter.await??.release().await?;
        Ok(())
    })
    .await
}

/// README: "A queue place that it keeps renewing without claiming blocks
/// the queue until an operator clears it (`pg_semaphore::admin::clear_queue`,
/// `pg-semaphore clear-queue`), and a place it stops renewing ends within
/// 60 seconds."
#[tokio::test]
async fn privileges_a_squatted_queue_is_cleared_and_places_end() -> TestResult {
    as_roles(|_db, app, operator| async move {
        let sem = Semaphore::builder("squatted", 1).build(&pg_semaphore::Client::new(app.clone())).await?;
        let enqueue = "SELECT o_ticket FROM pgsemaphore.enqueue('squatted', 1, 1::smallint, 'h', NULL, $1::interval, $2)";
        let too_long = sqlx::query(enqueue).bind("61 s").bind(token("squatter")).execute(&app).await;
        assert_eq!(refusal(too_long), ("22023".to_owned(), Some("p_waiter_lease".to_owned())));
        sqlx::query(enqueue).bind("60 s").bind(token("squatter")).execute(&app).await?;
        assert!(matches!(sem.try_acquire().await, Err(Error::NoSlotsAvailable { .. })));
        assert_eq!(pg_semaphore::admin::clear_queue(&operator, "squatted").await?, 1);
        sem.try_acquire().await?.release().await?;
        // A place nobody renews ends with its lease.
        sqlx::query(enqueue).bind("1 s").bind(token("gone")).execute(&app).await?;
        assert!(matches!(sem.try_acquire().await, Err(Error::NoSlotsAvailable { .. })));
        tokio::time::sleep(Duration::from_millis(1200)).await;
        sem.try_acquire().await?.release().await?;
        Ok(())
    })
    .await
}

/// README: "Holding a semaphore's wake-up gate makes releases send spare
/// wake-ups, or makes registrations fail so that waiters poll, and never
/// admits too many."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_a_held_gate_costs_wakeups_never_the_limit() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        let sem = Semaphore::builder("gated", 1)
            .build(
                &pg_semaphore::Client::new(app.clone())
                    .fallback_interval(Duration::from_millis(300)),
            )
            .await?;
        for mode in ["pg_advisory_lock", "pg_advisory_lock_shared"] {
            let mut squatter = app.acquire().await?;
            sqlx::query(AssertSqlSafe(format!(
                "SELECT {mode}(1885828965, hashtext('gated'))"
            )))
            .execute(&mut *squatter)
            .await?;
            let held = sem.try_acquire().await?;
            // Each waiter, once served, checks the limit and releases.
            let waiters: Vec<_> = (0..3)
                .map(|_| {
                    let (sem, app) = (sem.clone(), app.clone());
                    tokio::spawn(async move {
                        let permit = sem
                            .acquiring()
                            .timeout(Duration::from_secs(20))
                            .acquire()
                            .await?;
                        let live = live_slots(&app, "gated").await?;
                        permit.release().await?;
                        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(live)
                    })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(300)).await;
            let started = std::time::Instant::now();
            held.release().await?;
            assert!(
                started.elapsed() < Duration::from_secs(1),
                "{mode}: the release waited"
            );
            for waiter in waiters {
                assert_eq!(waiter.await??, 1, "{mode}");
            }
            sqlx::query(AssertSqlSafe(format!(
                "SELECT {}(1885828965, hashtext('gated'))",
                mode.replace("lock", "unlock")
            )))
            .execute(&mut *squatter)
            .await?;
        }
        Ok(())
    })
    .await
}

/// Every sentence of the list in docs/guide/operations.md ("What the
/// application role can and cannot do") has a test above, quoted in its doc
/// comment after `README: ` (where the list used to live): a sentence added
/// without one fails here.
#[test]
fn every_sentence_of_the_privileges_list_has_a_test() {
    fn words(text: &str) -> String {
        text.split_whitespace().collect::<Vec<_>>().join(" ")
    }
    let guide = include_str!("../docs/guide/operations.md");
    let start = guide.find("<!-- privileges:begin -->").expect("marker");
    let end = guide.find("<!-- privileges:end -->").expect("marker");
    let sentences: Vec<String> = guide[start..end]
        .lines()
        .filter_map(|line| line.strip_prefix("- "))
        .map(words)
        .collect();
    assert!(sentences.len() >= 12, "{sentences:?}");
    let source = include_str!("security.rs");
    let quoted: String = words(
        &source
            .lines()
            .filter_map(|line| line.trim_start().strip_prefix("///"))
            .collect::<Vec<_>>()
            .join(" "),
    );
    for sentence in sentences {
        assert!(
            quoted.contains(&format!("README: \"{sentence}\"")),
            "no test quotes the sentence {sentence:?} of docs/guide/operations.md"
        );
    }
}

/// README: "Hold slots of an advisory semaphore only as advisory locks of
/// its own sessions: it cannot free or take over another session's slots,
/// and it cannot end a capacity drop while a holder above the capacity
/// remains."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_advisory_slots_belong_to_their_sessions() -> TestResult {
    as_roles(|_db, app, operator| async move {
        let sem = pg_semaphore::AdvisorySemaphore::builder("advisory-owned", 2)
            .audit(false)
            .build(&pg_semaphore::Client::new(app.clone()))
            .await?;
        let low = sem.try_acquire().await?;
        let high = sem.try_acquire().await?;
        let base: i64 = sqlx::query_scalar(
            "SELECT key_base FROM pgsemaphore.advisory_semaphores WHERE name = 'advisory-owned'",
        )
        .fetch_one(&app)
        .await?;
        let mut stranger = app.acquire().await?;
        let released: i32 = sqlx::query_scalar(
            "SELECT pgsemaphore.advisory_release('advisory-owned', $1, ARRAY[0, 1])",
        )
        .bind(base)
        .fetch_one(&mut *stranger)
        .await?;
        assert_eq!(released, 0, "a stranger's session released someone's slots");
        let unlocked: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
            .bind(base)
            .fetch_one(&mut *stranger)
            .await?;
        assert!(!unlocked);
        assert_eq!(sem.available_permits().await?, 0);
        // A drop to 1 with both slots held: ending it early is refused.
        pg_semaphore::admin::set_capacity(&operator, "advisory-owned", 1).await?;
        low.release().await?;
        let drained: bool =
            sqlx::query_scalar("SELECT pgsemaphore.advisory_drained('advisory-owned')")
                .fetch_one(&mut *stranger)
                .await?;
        assert!(
            !drained,
            "a drop was ended while a holder above the capacity remained"
        );
        assert!(matches!(
            sem.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
        high.release().await?;
        sem.try_acquire().await?.release().await?;
        Ok(())
    })
    .await
}

/// README: "Taking an advisory semaphore's keys with advisory locks of its
/// own makes that semaphore look fuller, and a client that skips the claim
/// exceeds the limit only by itself, as any client that does not use a
/// semaphore does."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_foreign_advisory_locks_only_fill_the_semaphore() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        let sem = pg_semaphore::AdvisorySemaphore::builder("advisory-squatted", 2)
            .audit(false)
            .build(&pg_semaphore::Client::new(app.clone()))
            .await?;
        let base: i64 = sqlx::query_scalar(
            "SELECT key_base FROM pgsemaphore.advisory_semaphores WHERE name = 'advisory-squatted'",
        )
        .fetch_one(&app)
        .await?;
        let mut squatter = app.acquire().await?;
        sqlx::query("SELECT pg_advisory_lock($1), pg_advisory_lock($1 + 1)")
            .bind(base)
            .execute(&mut *squatter)
            .await?;
        assert!(matches!(
            sem.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
        sqlx::query("SELECT pg_advisory_unlock($1 + 1)")
            .bind(base)
            .execute(&mut *squatter)
            .await?;
        let permit = sem.try_acquire().await?;
        assert_eq!(permit.slot(), 1);
        assert!(matches!(
            sem.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
        permit.release().await?;
        sqlx::query("SELECT pg_advisory_unlock_all()")
            .execute(&mut *squatter)
            .await?;
        Ok(())
    })
    .await
}

/// A role with no grants at all (LOGIN only: what PUBLIC may, such as
/// `pg_advisory_lock`), plus `grants` (`{role}` stands for its name), and
/// a pool on it. [`drop_extra_role`] drops it.
async fn extra_role(db: &support::TestDb, suffix: &str, grants: &str) -> TestResult<PgPool> {
    let role = format!("{}_{suffix}", db.name);
    let mut admin = PgConnection::connect_with(&db.options).await?;
    admin
        .execute(AssertSqlSafe(format!(
            r#"CREATE ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '{PASSWORD}'"#
        )))
        .await?;
    if !grants.is_empty() {
        admin
            .execute(AssertSqlSafe(
                grants.replace("{role}", &format!(r#""{role}""#)),
            ))
            .await?;
    }
    Ok(PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.options.clone().username(&role).password(PASSWORD))
        .await?)
}

async fn drop_extra_role(db: &support::TestDb, suffix: &str, pool: PgPool) -> TestResult {
    pool.close().await;
    let role = format!("{}_{suffix}", db.name);
    let mut admin = PgConnection::connect_with(&db.options).await?;
    admin
        .execute(AssertSqlSafe(format!(
            r#"DROP OWNED BY "{role}"; DROP ROLE "{role}""#
        )))
        .await?;
    Ok(())
}

/// The advisory locks a session holds (granted, any mode, any key).
async fn advisory_locks_held(conn: &mut PgConnection) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
         AND pid = pg_backend_pid()",
    )
    .fetch_one(conn)
    .await
}

/// The exclusive holders of an advisory semaphore's keys, from pg_locks
/// (every key of it, not only those below its peak).
async fn exclusive_holders(pool: &PgPool, semaphore: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pgsemaphore.advisory_semaphores a JOIN pg_locks l \
            ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ExclusiveLock' \
           AND ((l.classid::bigint << 32) | l.objid::bigint) BETWEEN a.key_base AND a.key_base + 1048559 \
         WHERE a.name = $1",
    )
    .bind(semaphore)
    .fetch_one(pool)
    .await
}

/// The crate's one-statement claim of one slot (`CLAIM_ONE`), as any
/// client may send it, from docs/sql-api.md (a unit test of the crate keeps
/// that block the statement it sends): on a view of the row (`$1` key base,
/// `$2` capacity, `$3` epoch, read by [`row_view`] earlier); the slot, -1
/// when given back (and whether the epoch was current).
fn fast_claim_sql() -> String {
    let doc = include_str!("../docs/sql-api.md");
    let start = doc
        .find("```sql\n-- $1 key_base, $2 capacity, $3 epoch")
        .expect("docs/sql-api.md shows the one-statement claim");
    let block = &doc[start + "```sql".len()..];
    block[..block.find("```").expect("the block ends")].to_owned()
}

/// A process's view of a semaphore's row, as the crate reads it for
/// [`fast_claim_sql`]: key base, capacity, epoch.
async fn row_view(pool: &PgPool, semaphore: &str) -> sqlx::Result<(i64, i32, i64)> {
    sqlx::query_as(
        "SELECT key_base, capacity, epoch FROM pgsemaphore.advisory_semaphores WHERE name = $1",
    )
    .bind(semaphore)
    .fetch_one(pool)
    .await
}

/// [`fast_claim_sql`] on `view`.
fn fast_claim(
    view: (i64, i32, i64),
) -> sqlx::query::QueryScalar<'static, Postgres, Option<i32>, PgArguments> {
    sqlx::query_scalar(AssertSqlSafe(fast_claim_sql()))
        .bind(view.0)
        .bind(view.1)
        .bind(view.2)
}

/// README: "Claim slots of an advisory semaphore only within a capacity
/// known after taking the locks: `advisory_claim` runs only in READ
/// COMMITTED and re-reads the capacity after its locks, and the
/// one-statement claim keeps its slot only if the capacity epoch (the
/// sequence `pgsemaphore.advisory_epoch`, which every capacity change
/// moves) still reads, after its lock, the value its process last read of
/// the row. A claim whose snapshot, or whose view of the row, predates a
/// capacity drop is refused or gives its slots back, and a claim that
/// fails after taking locks gives them back before it answers."
/// (Issue 32, attack 2: a REPEATABLE READ claim whose snapshot predates a
/// drop 4 -> 2, admitted on slot 2 after the drain, would make 3 holders
/// on capacity 2.) Also as a role with no grants, and as one granted the
/// claim but not `advisory_drained`, whose claim fails after its locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_advisory_claims_never_admit_above_a_lowered_capacity() -> TestResult {
    as_roles(|db, app, operator| async move {
        sqlx::query("SELECT * FROM pgsemaphore.open_advisory('adv-drop', 4)")
            .execute(&app)
            .await?;
        let mut holder = app.acquire().await?;
        let (status,): (String,) =
            sqlx::query_as("SELECT o_status FROM pgsemaphore.advisory_claim('adv-drop', 2, '{}')")
                .fetch_one(&mut *holder)
                .await?;
        assert_eq!(status, "claimed");
        // A snapshot taken before the drop and its drain.
        let mut stale = app.acquire().await?;
        sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *stale)
            .await?;
        let seen: i32 = sqlx::query_scalar(
            "SELECT capacity FROM pgsemaphore.advisory_semaphores WHERE name = 'adv-drop'",
        )
        .fetch_one(&mut *stale)
        .await?;
        assert_eq!(seen, 4);
        pg_semaphore::admin::set_capacity(&operator, "adv-drop", 2).await?;
        let drained: bool = sqlx::query_scalar("SELECT pgsemaphore.advisory_drained('adv-drop')")
            .fetch_one(&app)
            .await?;
        assert!(drained, "nothing above the new capacity is held");
        let claim = sqlx::query_as::<_, (String, Option<Vec<i32>>)>(
            "SELECT o_status, o_slots FROM pgsemaphore.advisory_claim('adv-drop', 1, '{}')",
        )
        .fetch_one(&mut *stale)
        .await;
        assert_eq!(refusal(claim).0, "0A000");
        sqlx::query("ROLLBACK").execute(&mut *stale).await?;
        assert_eq!(advisory_locks_held(&mut stale).await?, 0);
        assert_eq!(exclusive_holders(&app, "adv-drop").await?, 2);

        // The one-statement claim on a view of the row read before a drop
        // 2 -> 1, on a free slot (and in a REPEATABLE READ transaction begun
        // before the drop: the claim reads no table, so its level does not
        // matter): the capacity epoch moved after the view was read, so it
        // gives the slot back (-1) and holds nothing; kept, it would make 2
        // holders on capacity 1.
        let sem = pg_semaphore::AdvisorySemaphore::builder("adv-drop-rr", 2)
            .audit(false)
            .build(&pg_semaphore::Client::new(app.clone()))
            .await?;
        let view = row_view(&app, "adv-drop-rr").await?;
        assert_eq!(view.1, 2);
        // The crate's handle reads its own view now, before the drop.
        sem.try_acquire().await?.release().await?;
        let mut first = app.acquire().await?;
        let slot = fast_claim(view).fetch_one(&mut *first).await?;
        assert_eq!(slot, Some(0));
        sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *stale)
            .await?;
        let seen: i32 = sqlx::query_scalar(
            "SELECT capacity FROM pgsemaphore.advisory_semaphores WHERE name = 'adv-drop-rr'",
        )
        .fetch_one(&mut *stale)
        .await?;
        assert_eq!(seen, 2);
        pg_semaphore::admin::set_capacity(&operator, "adv-drop-rr", 1).await?;
        let drained: bool = sqlx::query_scalar("SELECT pgsemaphore.advisory_drained('adv-drop-rr')")
            .fetch_one(&app)
            .await?;
        assert!(drained, "nothing above the new capacity is held");
        let fast = fast_claim(view).fetch_one(&mut *stale).await?;
        assert_eq!(fast, Some(-1), "a fast claim kept a slot above a lowered capacity");
        sqlx::query("ROLLBACK").execute(&mut *stale).await?;
        assert_eq!(advisory_locks_held(&mut stale).await?, 0);
        let fast = fast_claim(view).fetch_one(&mut *stale).await?;
        assert_eq!(fast, Some(-1), "the same view, in READ COMMITTED");
        assert_eq!(advisory_locks_held(&mut stale).await?, 0);
        assert_eq!(exclusive_holders(&app, "adv-drop-rr").await?, 1);
        // The crate's own claim, whose view is also from before the drop,
        // reads the row again and finds the semaphore full.
        assert!(matches!(
            sem.try_acquire().await,
            Err(pg_semaphore::Error::NoSlotsAvailable { .. })
        ));
        sqlx::query("SELECT pg_advisory_unlock_all()")
            .execute(&mut *first)
            .await?;
        drop(first);

        // The crate's own sessions claim in READ COMMITTED whatever the
        // role's default isolation says.
        let mut admin = PgConnection::connect_with(&db.options).await?;
        let app_role = app_role(&app).await?;
        admin
            .execute(AssertSqlSafe(format!(
                r#"ALTER ROLE "{app_role}" SET default_transaction_isolation = 'repeatable read'"#
            )))
            .await?;
        let permit = sem.try_acquire().await;
        admin
            .execute(AssertSqlSafe(format!(
                r#"ALTER ROLE "{app_role}" RESET default_transaction_isolation"#
            )))
            .await?;
        permit?.release().await?;

        // A role without grants claims nothing, and holds nothing after.
        let bare = extra_role(&db, "bare", "").await?;
        let mut conn = bare.acquire().await?;
        let refused = sqlx::query("SELECT o_status FROM pgsemaphore.advisory_claim('adv-drop', 1, '{}')")
            .execute(&mut *conn)
            .await;
        assert!(denied(refused));
        let refused = fast_claim(row_view(&app, "adv-drop").await?)
            .fetch_one(&mut *conn)
            .await;
        assert!(denied(refused));
        assert_eq!(advisory_locks_held(&mut conn).await?, 0);
        drop(conn);
        drop_extra_role(&db, "bare", bare).await?;

        // A claim that fails after its locks (here: it may not run
        // advisory_drained, which it calls when a drop is over) gives them
        // back before it answers.
        sqlx::query("SELECT * FROM pgsemaphore.open_advisory('adv-fail', 3)")
            .execute(&app)
            .await?;
        pg_semaphore::admin::set_capacity(&operator, "adv-fail", 2).await?;
        let partial = extra_role(
            &db,
            "partial",
            "GRANT USAGE ON SCHEMA pgsemaphore TO {role}; \
             GRANT SELECT ON pgsemaphore.advisory_semaphores TO {role}; \
             GRANT EXECUTE ON FUNCTION pgsemaphore.advisory_claim(text, integer, integer[]) TO {role};",
        )
        .await?;
        let mut conn = partial.acquire().await?;
        let failed = sqlx::query("SELECT o_status FROM pgsemaphore.advisory_claim('adv-fail', 1, '{}')")
            .execute(&mut *conn)
            .await;
        assert!(denied(failed));
        assert_eq!(
            advisory_locks_held(&mut conn).await?,
            0,
            "a failed claim kept the slots it had locked"
        );
        drop(conn);
        drop_extra_role(&db, "partial", partial).await?;
        drop(holder);
        Ok(())
    })
    .await
}

/// `advisory_rearm` from the application role, with hostile arguments: NULL
/// is refused (22023, `p_semaphore`), and so is REPEATABLE READ (0A000); a
/// name that does not exist, or whose epoch is current, writes nothing.
/// After an operator's change of another semaphore moved the shared
/// sequence, the one-statement claim gives its slot back until the row is
/// re-armed; the call writes once, and what it writes is the value the
/// sequence reads, never anything of the caller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_rearm_writes_only_the_sequences_value_once_per_move() -> TestResult {
    as_roles(|_db, app, operator| async move {
        for name in ["rearm-a", "rearm-b"] {
            sqlx::query("SELECT * FROM pgsemaphore.open_advisory($1, 2)")
                .bind(name)
                .execute(&app)
                .await?;
        }
        let rearm = |name: Option<&'static str>| {
            sqlx::query_scalar::<_, bool>("SELECT pgsemaphore.advisory_rearm($1)").bind(name)
        };
        let armed = || {
            sqlx::query_scalar::<_, bool>(
                "SELECT epoch = pg_sequence_last_value('pgsemaphore.advisory_epoch') \
                   FROM pgsemaphore.advisory_semaphores WHERE name = 'rearm-a'",
            )
        };
        assert_eq!(
            refusal(rearm(None).fetch_one(&app).await),
            ("22023".to_owned(), Some("p_semaphore".to_owned()))
        );
        assert!(!rearm(Some("no-such-semaphore")).fetch_one(&app).await?);
        assert!(
            !rearm(Some("rearm-a")).fetch_one(&app).await?,
            "its epoch is current"
        );

        pg_semaphore::admin::set_capacity(&operator, "rearm-b", 3).await?;
        assert!(!armed().fetch_one(&app).await?);
        let mut conn = app.acquire().await?;
        let fast = fast_claim(row_view(&app, "rearm-a").await?)
            .fetch_one(&mut *conn)
            .await?;
        assert_eq!(
            fast,
            Some(-1),
            "the epoch is behind: the slot is given back"
        );
        assert_eq!(advisory_locks_held(&mut conn).await?, 0);

        sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *conn)
            .await?;
        assert_eq!(
            refusal(rearm(Some("rearm-a")).fetch_one(&mut *conn).await).0,
            "0A000"
        );
        sqlx::query("ROLLBACK").execute(&mut *conn).await?;
        assert!(!armed().fetch_one(&app).await?, "a refused call wrote");

        assert!(
            rearm(Some("rearm-a")).fetch_one(&app).await?,
            "behind: written"
        );
        assert!(armed().fetch_one(&app).await?);
        assert!(
            !rearm(Some("rearm-a")).fetch_one(&app).await?,
            "written once per move"
        );
        let fast = fast_claim(row_view(&app, "rearm-a").await?)
            .fetch_one(&mut *conn)
            .await?;
        assert_eq!(fast, Some(0), "re-armed: the slot is kept");
        sqlx::query("SELECT pg_advisory_unlock_all()")
            .execute(&mut *conn)
            .await?;
        Ok(())
    })
    .await
}

/// README: "Calling `advisory_drained` in an open transaction delays no
/// advisory claim, and delays the operator's `configure_advisory` by at
/// most 2 seconds, which then fails with SQLSTATE 55P03
/// (`Error::Stalled`)."
/// (Issue 32, attack 5: the honest claim must not wait without bound, nor
/// keep its slot when cancelled; nor may `configure_advisory` wait without
/// bound.) A role without
/// grants can neither call it nor lock the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_an_open_drain_delays_no_advisory_claim_and_the_operator_by_at_most_the_bound()
-> TestResult {
    as_roles(|db, app, operator| async move {
        let sem = pg_semaphore::AdvisorySemaphore::builder("adv-open", 3)
            .audit(false)
            .build(&pg_semaphore::Client::new(app.clone()))
            .await?;
        let low = sem.try_acquire().await?;
        let middle = sem.try_acquire().await?;
        let high = sem.try_acquire().await?;
        assert_eq!((low.slot(), middle.slot(), high.slot()), (0, 1, 2));
        pg_semaphore::admin::set_capacity(&operator, "adv-open", 2).await?;
        // The drop is pending (slot 2 is held): the drain in an open
        // transaction says so, and holds the semaphore's row.
        let mut squatter = app.acquire().await?;
        sqlx::query("BEGIN").execute(&mut *squatter).await?;
        let drained: bool = sqlx::query_scalar("SELECT pgsemaphore.advisory_drained('adv-open')")
            .fetch_one(&mut *squatter)
            .await?;
        assert!(!drained);
        high.release().await?;
        middle.release().await?;
        // The honest claim counts, finds the drop over, and does not wait
        // for the row (its drain is left to a later claim). The 10 s here
        // is not the bound: a claim that waited for the row would wait until cancelled.
        let permit = tokio::time::timeout(Duration::from_secs(10), sem.try_acquire())
            .await
            .map_err(|_| "an advisory claim waited for an open advisory_drained")??;
        assert_eq!(permit.slot(), 1);
        assert_eq!(exclusive_holders(&app, "adv-open").await?, 2);
        assert!(matches!(
            sem.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
        // The operator waits at most lock_timeout.
        let started = std::time::Instant::now();
        let changed = tokio::time::timeout(
            Duration::from_secs(10),
            pg_semaphore::admin::set_capacity(&operator, "adv-open", 3),
        )
        .await
        .map_err(|_| "configure_advisory waited for an open advisory_drained")?;
        let waited = started.elapsed();
        assert!(matches!(changed, Err(Error::Stalled { .. })), "{changed:?}");
        assert!(
            waited >= Duration::from_millis(1900) && waited < Duration::from_secs(4),
            "{waited:?}"
        );
        sqlx::query("ROLLBACK").execute(&mut *squatter).await?;
        assert_eq!(
            pg_semaphore::admin::set_capacity(&operator, "adv-open", 3).await?,
            2
        );

        // A role without grants cannot hold the row.
        let bare = extra_role(&db, "bare", "").await?;
        let mut conn = bare.acquire().await?;
        sqlx::query("BEGIN").execute(&mut *conn).await?;
        assert!(denied(
            sqlx::query("SELECT pgsemaphore.advisory_drained('adv-open')")
                .execute(&mut *conn)
                .await
        ));
        sqlx::query("ROLLBACK").execute(&mut *conn).await?;
        assert!(denied(
            sqlx::query("SELECT 1 FROM pgsemaphore.advisory_semaphores FOR UPDATE")
                .execute(&mut *conn)
                .await
        ));
        drop(conn);
        drop_extra_role(&db, "bare", bare).await?;
        permit.release().await?;
        low.release().await?;
        Ok(())
    })
    .await
}

/// README: "Any role, even one without grants, can hold an advisory
/// semaphore's keys with `pg_advisory_lock` or `pg_advisory_lock_shared`:
/// each key it holds makes the semaphore look one slot fuller and is
/// listed in `pgsemaphore.advisory_holders` (`mode` exclusive or shared),
/// and a claim's work stays bounded by the capacity in force, never by the
/// capacity before a drop. Holding a name's creation key
/// (`pg_advisory_lock(1885828966, hashtext(name))`) delays the creation of
/// an advisory semaphore of that name by at most 2 seconds (SQLSTATE
/// 55P03), and the opening of an existing one not at all."
/// (Issue 32: a shared hold must not block claims unlisted, and after a
/// drop from 100,000 to 2 with a key held above, no claim may walk all
/// 100,000 slots. How long a claim takes is measured in BENCHMARKS.md, not here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_foreign_holds_of_advisory_keys_are_listed_and_counted() -> TestResult {
    as_roles(|db, app, operator| async move {
        let sem = pg_semaphore::AdvisorySemaphore::builder("adv-wide", 100_000)
            .audit(false)
            .build(&pg_semaphore::Client::new(app.clone()))
            .await?;
        pg_semaphore::admin::set_capacity(&operator, "adv-wide", 2).await?;
        let base: i64 = sqlx::query_scalar(
            "SELECT key_base FROM pgsemaphore.advisory_semaphores WHERE name = 'adv-wide'",
        )
        .fetch_one(&app)
        .await?;
        let bare = extra_role(&db, "bare", "").await?;
        let mut squatter = bare.acquire().await?;
        sqlx::query("SELECT pg_advisory_lock_shared($1), pg_advisory_lock_shared($1 + 99999)")
            .bind(base)
            .execute(&mut *squatter)
            .await?;
        let listed: Vec<(i32, String)> = sqlx::query_as(
            "SELECT slot, mode FROM pgsemaphore.advisory_holders \
              WHERE semaphore = 'adv-wide' ORDER BY slot",
        )
        .fetch_all(&app)
        .await?;
        assert_eq!(
            listed,
            [(0, "shared".to_owned()), (99_999, "shared".to_owned())]
        );
        let info = advisory_semaphores(&app).await?;
        let wide = info.iter().find(|s| s.name == "adv-wide").expect("listed");
        assert_eq!(wide.held(), 2);
        assert!(
            wide.holders.iter().all(|h| h.shared == Some(true)),
            "{wide:?}"
        );
        // Two keys held of a capacity of 2: full, and the claim holds
        // nothing after.
        assert!(matches!(
            sem.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
        assert_eq!(sem.available_permits().await?, 0);
        sqlx::query("SELECT pg_advisory_unlock_shared($1)")
            .bind(base)
            .execute(&mut *squatter)
            .await?;
        // One key above the new capacity still held: counted.
        let permit = sem.try_acquire().await?;
        assert_eq!(permit.slot(), 0);
        assert!(matches!(
            sem.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
        assert_eq!(exclusive_holders(&app, "adv-wide").await?, 1);
        sqlx::query("SELECT pg_advisory_unlock_all()")
            .execute(&mut *squatter)
            .await?;
        // The key above is gone: the next claim ends the drop.
        let second = sem.try_acquire().await?;
        let peak: i32 = sqlx::query_scalar(
            "SELECT peak_capacity FROM pgsemaphore.advisory_semaphores WHERE name = 'adv-wide'",
        )
        .fetch_one(&app)
        .await?;
        assert_eq!(peak, 2);
        // The creation key of a name, held by the role without grants.
        sqlx::query(
            "SELECT pg_advisory_lock(1885828966, hashtext('adv-wide')), \
                    pg_advisory_lock(1885828966, hashtext('adv-unborn'))",
        )
        .execute(&mut *squatter)
        .await?;
        let reopened = tokio::time::timeout(
            Duration::from_secs(10),
            pg_semaphore::AdvisorySemaphore::builder("adv-wide", 2)
                .audit(false)
                .build(&pg_semaphore::Client::new(app.clone())),
        )
        .await
        .map_err(|_| "opening an existing advisory semaphore waited for its creation key")?;
        reopened?;
        let started = std::time::Instant::now();
        let created = tokio::time::timeout(
            Duration::from_secs(10),
            sqlx::query("SELECT * FROM pgsemaphore.open_advisory('adv-unborn', 1)").execute(&app),
        )
        .await
        .map_err(|_| "creating an advisory semaphore waited for its creation key without bound")?;
        let waited = started.elapsed();
        assert_eq!(refusal(created).0, "55P03");
        assert!(
            waited >= Duration::from_millis(1900) && waited < Duration::from_secs(4),
            "{waited:?}"
        );
        drop(squatter);
        drop_extra_role(&db, "bare", bare).await?;
        second.release().await?;
        permit.release().await?;
        Ok(())
    })
    .await
}

/// One call of `pgsemaphore.record_outcomes` adding `refused` refusals to
/// semaphore `name`.
fn record_refusals(name: &str, refused: i64) -> String {
    format!(
        "SELECT pgsemaphore.record_outcomes(ARRAY['semaphore'], ARRAY['{name}'], \
         ARRAY[0]::bigint[], ARRAY[{refused}]::bigint[], ARRAY[0]::bigint[])"
    )
}

/// README: "Add to the outcome counters (`record_outcomes`), which record
/// what applications reported: to any name of the six kinds, at most 1,000
/// rows and 1,000,000,000 per count a call, only ever adding to the current
/// minute's counts, never setting, lowering or deleting any; the operator's
/// retention prunes them." The operator and a role without grants cannot
/// report at all.
#[tokio::test]
async fn privileges_outcome_counters_are_only_added_to() -> TestResult {
    as_roles(|db, app, operator| async move {
        let counted = |pool: PgPool| async move {
            sqlx::query_as::<_, (String, i64, bool)>(
                "SELECT name, refused, minute = date_bin('1 minute', now(), timestamptz '2000-01-01Z') \
                   FROM pgsemaphore.outcomes ORDER BY name",
            )
            .fetch_all(&pool)
            .await
        };
        for refused in [3, 4] {
            sqlx::query(AssertSqlSafe(record_refusals("counted", refused)))
                .execute(&app)
                .await?;
        }
        // Any name: nothing checks that a semaphore has it.
        sqlx::query(AssertSqlSafe(record_refusals("made-up", 1)))
            .execute(&app)
            .await?;
        let before = counted(app.clone()).await?;
        assert_eq!(
            before,
            [("counted".to_owned(), 7, true), ("made-up".to_owned(), 1, true)]
        );
        // Nothing lowers a count: negative, oversized and NULL counts,
        // unknown kinds, too many rows are refused, writing nothing.
        let thousand_and_one = "SELECT pgsemaphore.record_outcomes(\
            array_fill('semaphore'::text, ARRAY[1001]), \
            (SELECT array_agg('s' || i) FROM generate_series(1, 1001) i), \
            array_fill(0::bigint, ARRAY[1001]), array_fill(1::bigint, ARRAY[1001]), \
            array_fill(0::bigint, ARRAY[1001]))";
        for (sql, column) in [
            (record_refusals("counted", -7), "p_refused"),
            (record_refusals("counted", 1_000_000_001), "p_refused"),
            (record_refusals("counted", i64::MAX), "p_refused"),
            (
                "SELECT pgsemaphore.record_outcomes(ARRAY['semaphore'], ARRAY['counted'], \
                 ARRAY[NULL]::bigint[], ARRAY[1]::bigint[], ARRAY[0]::bigint[])"
                    .to_owned(),
                "p_admitted",
            ),
            (
                "SELECT pgsemaphore.record_outcomes(ARRAY['slots'], ARRAY['counted'], \
                 ARRAY[0]::bigint[], ARRAY[1]::bigint[], ARRAY[0]::bigint[])"
                    .to_owned(),
                "p_kinds",
            ),
            (thousand_and_one.to_owned(), "p_kinds"),
        ] {
            let result = sqlx::query(AssertSqlSafe(sql.clone())).execute(&app).await;
            assert_eq!(refusal(result), ("22023".to_owned(), Some(column.to_owned())), "{sql}");
        }
        for sql in [
            "UPDATE pgsemaphore.outcomes SET refused = 0",
            "DELETE FROM pgsemaphore.outcomes",
            "INSERT INTO pgsemaphore.outcomes (kind, name, minute) VALUES ('semaphore', 'x', now())",
        ] {
            assert!(denied(sqlx::query(sql).execute(&app).await), "allowed: {sql}");
        }
        assert_eq!(counted(app.clone()).await?, before);
        // The operator reads them and prunes them, but does not report.
        assert_eq!(counted(operator.clone()).await?, before);
        assert!(denied(
            sqlx::query(AssertSqlSafe(record_refusals("counted", 1)))
                .execute(&operator)
                .await
        ));
        let bare = extra_role(&db, "bare", "GRANT USAGE ON SCHEMA pgsemaphore TO {role};").await?;
        assert!(denied(
            sqlx::query(AssertSqlSafe(record_refusals("counted", 1)))
                .execute(&bare)
                .await
        ));
        drop_extra_role(&db, "bare", bare).await?;
        // The retention: once a minute has ended more than `older_than` ago.
        sqlx::query("UPDATE pgsemaphore.outcomes SET minute = minute - interval '2 hours' WHERE name = 'made-up'")
            .execute(&db.pool)
            .await?;
        pg_semaphore::admin::prune_claims(&operator, Duration::from_secs(3600)).await?;
        assert_eq!(
            counted(app.clone()).await?,
            [("counted".to_owned(), 7, true)]
        );
        Ok(())
    })
    .await
}

/// README: "Adding to the outcome counters in an open transaction delays
/// every process's report of the same rows by at most 2 seconds, which then
/// fails with SQLSTATE 55P03 and is tried again later with the counts
/// kept." (The crate's side, keeping and retrying: tests/outcomes.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileges_an_open_report_delays_the_same_rows_at_most_the_bound() -> TestResult {
    as_roles(|_db, app, _operator| async move {
        let mut squatter = app.acquire().await?;
        sqlx::query("BEGIN").execute(&mut *squatter).await?;
        sqlx::query(AssertSqlSafe(record_refusals("held", 1)))
            .execute(&mut *squatter)
            .await?;
        // Another row is not delayed.
        let started = std::time::Instant::now();
        sqlx::query(AssertSqlSafe(record_refusals("other", 1)))
            .execute(&app)
            .await?;
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "{:?}",
            started.elapsed()
        );
        // The held one waits lock_timeout, then 55P03, writing nothing.
        let started = std::time::Instant::now();
        let held = tokio::time::timeout(
            Duration::from_secs(10),
            sqlx::query(AssertSqlSafe(record_refusals("held", 5))).execute(&app),
        )
        .await
        .map_err(|_| "record_outcomes waited without bound")?;
        let waited = started.elapsed();
        assert_eq!(refusal(held).0, "55P03");
        assert!(
            waited >= Duration::from_millis(1900) && waited < Duration::from_secs(4),
            "{waited:?}"
        );
        sqlx::query("COMMIT").execute(&mut *squatter).await?;
        sqlx::query(AssertSqlSafe(record_refusals("held", 5)))
            .execute(&app)
            .await?;
        let held: i64 = sqlx::query_scalar(
            "SELECT sum(refused)::int8 FROM pgsemaphore.outcomes WHERE name = 'held'",
        )
        .fetch_one(&app)
        .await?;
        assert_eq!(held, 6);
        Ok(())
    })
    .await
}
