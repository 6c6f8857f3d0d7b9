//! Every error variant, and bad input: a typed error that says what is wrong,
//! nothing written, no panic.

mod support;

use std::time::Duration;

use pg_semaphore::{
    AdvisorySemaphore, Error, LostReason, Semaphore, SemaphoreBuilder,
    admin::Reaper,
    limits::{MAX_CAPACITY, MAX_LEASE, MIN_LEASE},
};
use sqlx::postgres::{PgDatabaseError, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use support::TestResult;

async fn rows(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM pgsemaphore.semaphores), (SELECT count(*) FROM pgsemaphore.slots)",
    )
    .fetch_one(pool)
    .await
    .expect("count rows")
}

#[tokio::test]
async fn bad_builder_input_is_rejected_before_anything_is_written() -> TestResult {
    let db = support::migrated_db().await;
    let long_name = "n".repeat(201);
    let cases: Vec<(&str, SemaphoreBuilder, &str)> = vec![
        ("capacity 0", Semaphore::builder("s", 0), "capacity"),
        (
            "capacity above the maximum",
            Semaphore::builder("s", MAX_CAPACITY + 1),
            "capacity",
        ),
        (
            "capacity u32::MAX",
            Semaphore::builder("s", u32::MAX),
            "capacity",
        ),
        ("empty name", Semaphore::builder("", 1), "name"),
        (
            "201-character name",
            Semaphore::builder(long_name, 1),
            "name",
        ),
        ("NUL in name", Semaphore::builder("a\0b", 1), "name"),
        (
            "zero lease",
            Semaphore::builder("s", 1).lease(Duration::ZERO),
            "lease",
        ),
        (
            "lease below the minimum",
            Semaphore::builder("s", 1).lease(MIN_LEASE - Duration::from_nanos(1)),
            "lease",
        ),
        (
            "lease above the maximum",
            Semaphore::builder("s", 1).lease(MAX_LEASE + Duration::from_secs(1)),
            "lease",
        ),
        (
            "enormous lease",
            Semaphore::builder("s", 1).lease(Duration::MAX),
            "lease",
        ),
        (
            "zero heartbeat",
            Semaphore::builder("s", 1).heartbeat(Duration::ZERO),
            "heartbeat",
        ),
        (
            "heartbeat above half the lease",
            Semaphore::builder("s", 1)
                .lease(Duration::from_secs(10))
                .heartbeat(Duration::from_secs(6)),
            "lease",
        ),
        (
            "enormous heartbeat",
            Semaphore::builder("s", 1).heartbeat(Duration::MAX),
            "lease",
        ),
    ];
    // The client's settings, checked when something is built on it.
    let clients = [
        (
            "zero fallback interval",
            db.client.clone().fallback_interval(Duration::ZERO),
            "fallback_interval",
        ),
        ("empty holder", db.client.clone().holder(""), "holder"),
        (
            "1001-character holder",
            db.client.clone().holder("h".repeat(1001)),
            "holder",
        ),
        ("NUL in holder", db.client.clone().holder("a\0"), "holder"),
        (
            "zero advisory heartbeat",
            db.client.clone().advisory_heartbeat(Duration::ZERO),
            "advisory_heartbeat",
        ),
        (
            "no advisory connection",
            db.client.clone().advisory_connections(0),
            "advisory_connections",
        ),
    ];
    let cases =
        cases
            .into_iter()
            .map(|(case, builder, expected)| (case, builder, db.client.clone(), expected))
            .chain(clients.into_iter().map(|(case, client, expected)| {
                (case, Semaphore::builder("s", 1), client, expected)
            }));
    for (case, builder, client, expected) in cases {
        let advisory = expected.starts_with("advisory_");
        let built = if advisory {
            AdvisorySemaphore::builder("s-advisory", 1)
                .build(&client)
                .await
                .map(drop)
        } else {
            builder.build(&client).await.map(drop)
        };
        match built {
            Err(err @ Error::InvalidArgument { argument, .. }) => {
                assert_eq!(argument, expected, "{case}");
                assert!(
                    err.to_string()
                        .starts_with(&format!("invalid {expected}: ")),
                    "{case}: {err}"
                );
            }
            other => panic!("{case}: expected InvalidArgument({expected}), got {other:?}"),
        }
    }
    assert_eq!(rows(&db.pool).await, (0, 0), "bad input wrote nothing");
    Ok(())
}

#[tokio::test]
async fn bad_claim_input_is_rejected_before_anything_is_written() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("claims", 1).build(&db.client).await?;
    assert!(matches!(
        sem.acquiring().lease(Duration::ZERO).try_acquire().await,
        Err(Error::InvalidArgument {
            argument: "lease",
            ..
        })
    ));
    assert!(matches!(
        sem.acquiring().lease(Duration::MAX).acquire().await,
        Err(Error::InvalidArgument {
            argument: "lease",
            ..
        })
    ));
    assert!(matches!(
        sem.acquiring()
            .holder("")
            .timeout(Duration::from_secs(1))
            .acquire()
            .await,
        Err(Error::InvalidArgument {
            argument: "holder",
            ..
        })
    ));
    // A claim's own lease must cover two heartbeats too.
    let beating = Semaphore::builder("claims", 1)
        .lease(Duration::from_secs(10))
        .heartbeat(Duration::from_secs(4))
        .build(&db.client)
        .await?;
    assert!(matches!(
        beating
            .acquiring()
            .lease(Duration::from_secs(5))
            .try_acquire()
            .await,
        Err(Error::InvalidArgument {
            argument: "lease",
            ..
        })
    ));
    assert!(matches!(
        Reaper::spawn(&db.pool, Duration::ZERO),
        Err(Error::InvalidArgument {
            argument: "interval",
            ..
        })
    ));
    assert_eq!(rows(&db.pool).await, (1, 0));

    // Enormous wait timeouts are just long waits, never a panic.
    let permit = sem.acquiring().timeout(Duration::MAX).acquire().await?;
    permit.release().await?;
    Ok(())
}

#[tokio::test]
async fn hostile_names_are_data_not_sql() -> TestResult {
    let db = support::migrated_db().await;
    let names = [
        "'; DROP TABLE pgsemaphore.slots; --",
        "\"; DELETE FROM pgsemaphore.semaphores; --",
        "Robert'); DROP TABLE students;--",
        "🚦 semáforo 信号量",
        "\u{202e}rtl\u{0007}bell\ttab\nnewline",
        "%s %n $1 \\x00",
        &"é".repeat(200),
    ];
    for name in names {
        let sem = Semaphore::builder(name, 2)
            .build(&db.client.clone().holder(format!("holder {name}")))
            .await?;
        let permit = sem
            .acquiring()
            .metadata(serde_json::json!({ "name": name }))
            .try_acquire()
            .await?;
        let holders = sem.holders().await?;
        assert_eq!(holders.len(), 1);
        assert_eq!(holders[0].holder, Some(format!("holder {name}")));
        assert_eq!(
            holders[0].metadata,
            Some(serde_json::json!({ "name": name }))
        );
        permit.release().await?;
    }
    assert_eq!(
        rows(&db.pool).await,
        (names.len() as i64, names.len() as i64)
    );
    Ok(())
}

#[tokio::test]
async fn a_deleted_semaphore_is_reported_as_not_found() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("ephemeral", 1).build(&db.client).await?;
    sqlx::query("DELETE FROM pgsemaphore.semaphores WHERE name = 'ephemeral'")
        .execute(&db.pool)
        .await?;
    for result in [sem.try_acquire().await, sem.acquire().await] {
        match result {
            Err(Error::SemaphoreNotFound { semaphore }) => assert_eq!(semaphore, "ephemeral"),
            other => panic!("expected SemaphoreNotFound, got {other:?}"),
        }
    }
    assert!(matches!(
        sem.available_permits().await,
        Err(Error::SemaphoreNotFound { .. })
    ));
    Ok(())
}

#[tokio::test]
async fn releasing_a_permit_released_by_someone_else_reports_it() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("forced", 1).build(&db.client).await?;
    let permit = sem.try_acquire().await?;
    // An operator force-releases the claim.
    sqlx::query("SELECT pgsemaphore.force_release(p_id => $1)")
        .bind(permit.id())
        .execute(&db.pool)
        .await?;
    let id = permit.id();
    match permit.release().await {
        Err(err @ Error::PermitLost { .. }) => {
            let Error::PermitLost {
                semaphore,
                id: lost,
                reason,
            } = &err
            else {
                unreachable!()
            };
            assert_eq!((semaphore.as_str(), *lost), ("forced", id));
            assert!(matches!(reason, LostReason::AlreadyReleased { .. }));
            assert!(err.to_string().contains("already released"), "{err}");
        }
        other => panic!("expected PermitLost, got {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn a_server_that_is_down_gives_a_database_error() -> TestResult {
    // Nothing listens on this port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(&format!(
            "postgres://postgres:s3cret@127.0.0.1:{port}/postgres"
        ))?;
    let err = Semaphore::builder("down", 1)
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await
        .expect_err("the server is down");
    assert!(matches!(err, Error::Database(_)), "{err:?}");
    assert!(
        !err.to_string().contains("s3cret"),
        "password leaked: {err}"
    );
    assert!(matches!(
        pg_semaphore::admin::reap(&pool).await,
        Err(Error::Database(_))
    ));
    Ok(())
}

#[tokio::test]
async fn a_non_read_committed_session_is_refused_rather_than_over_admitting() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("isolation", 1).build(&db.client).await?;
    let repeatable = PgPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET default_transaction_isolation = 'repeatable read'")
                    .execute(conn)
                    .await?;
                Ok(())
            })
        })
        .connect_with(db.options.clone())
        .await?;
    let strict = Semaphore::builder("isolation", 1)
        .build(&pg_semaphore::Client::new(repeatable.clone()))
        .await?;
    let err = strict.try_acquire().await.expect_err("must refuse");
    assert!(matches!(err, Error::Database(_)), "{err:?}");
    assert!(err.to_string().contains("READ COMMITTED"), "{err}");
    // A place in the queue too: its turn is read from the queue as
    // committed, which an older snapshot could miss.
    let queued = sqlx::query(
        "SELECT * FROM pgsemaphore.enqueue('isolation', 1, 1::smallint, 'h', NULL, '10 s', \
         'sixteen-byte-tok')",
    )
    .execute(&repeatable)
    .await
    .expect_err("must refuse");
    assert!(queued.to_string().contains("READ COMMITTED"), "{queued}");
    let waiters: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.waiters")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(waiters, 0);
    // The normal pool is unaffected.
    sem.try_acquire().await?.release().await?;
    Ok(())
}

/// Every function that decides on a snapshot taken after its locks refuses
/// a REPEATABLE READ or SERIALIZABLE transaction the same way: SQLSTATE
/// 0A000, a message that names what was called and the transaction's
/// level, and a hint that says what to do. Nothing is taken or created.
#[tokio::test]
async fn every_refusal_outside_read_committed_is_0a000_naming_the_call() -> TestResult {
    let db = support::migrated_db().await;
    Semaphore::builder("lease", 1).build(&db.client).await?;
    AdvisorySemaphore::builder("advisory", 1)
        .build(&db.client)
        .await?;
    sqlx::query("SELECT * FROM pgsemaphore.open_family('tenants', 2, '10 s', '0')")
        .execute(&db.pool)
        .await?;
    let calls = [
        (
            "SELECT * FROM pgsemaphore.claim('lease', 'h', NULL, NULL, 'sixteen-byte-tok')",
            "pgsemaphore.claim",
        ),
        (
            "SELECT * FROM pgsemaphore.enqueue('lease', 1, 1::smallint, 'h', NULL, '10 s', \
             'sixteen-byte-tok')",
            "pgsemaphore.enqueue",
        ),
        (
            "SELECT * FROM pgsemaphore.open('new-lease', 1, '10 s')",
            "creating a semaphore",
        ),
        (
            "SELECT * FROM pgsemaphore.open_advisory('new-advisory', 1)",
            "creating a semaphore",
        ),
        (
            "SELECT * FROM pgsemaphore.open_family_key('tenants', 'acme')",
            "pgsemaphore.open_family_key",
        ),
        (
            "SELECT * FROM pgsemaphore.advisory_claim('advisory', 1, ARRAY[]::integer[])",
            "pgsemaphore.advisory_claim",
        ),
        (
            "SELECT pgsemaphore.advisory_drained('advisory')",
            "pgsemaphore.advisory_drained",
        ),
        (
            "SELECT pgsemaphore.advisory_rearm('advisory')",
            "pgsemaphore.advisory_rearm",
        ),
        (
            "SELECT * FROM pgsemaphore.configure_advisory('advisory', 2)",
            "pgsemaphore.configure_advisory",
        ),
        (
            "SELECT pgsemaphore.record_outcomes(ARRAY['semaphore'], ARRAY['lease'], \
             ARRAY[0]::bigint[], ARRAY[1]::bigint[], ARRAY[0]::bigint[])",
            "pgsemaphore.record_outcomes",
        ),
        (
            "SELECT * FROM pgsemaphore.token_bucket('api', 'k', 10, 10, 1)",
            "a rate limiter check",
        ),
        (
            "SELECT * FROM pgsemaphore.check_limits(ARRAY['fixed_window'], ARRAY['api'], \
             ARRAY['k'], ARRAY[NULL]::float8[], ARRAY[NULL]::float8[], ARRAY[10]::bigint[], \
             ARRAY['1 s']::interval[], 1)",
            "a rate limiter check",
        ),
    ];
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        for (sql, subject) in calls {
            let mut conn = db.pool.acquire().await?;
            sqlx::query(AssertSqlSafe(format!("BEGIN ISOLATION LEVEL {level}")))
                .execute(&mut *conn)
                .await?;
            let err = sqlx::query(sql).execute(&mut *conn).await.expect_err(sql);
            sqlx::query("ROLLBACK").execute(&mut *conn).await?;
            let pg = err
                .as_database_error()
                .and_then(|e| e.try_downcast_ref::<PgDatabaseError>())
                .unwrap_or_else(|| panic!("{sql}: {err}"));
            assert_eq!(pg.code(), "0A000", "{sql}: {err}");
            assert_eq!(
                pg.message(),
                format!("{subject} needs READ COMMITTED, this transaction is {level}"),
                "{sql}"
            );
            assert!(
                pg.hint().is_some_and(|h| h
                    .starts_with("call it outside the transaction, or in a READ COMMITTED one: ")),
                "{sql}: {:?}",
                pg.hint()
            );
        }
    }
    // Nothing was created or taken.
    let (semaphores, advisory, slots, waiters, ledger): (i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pgsemaphore.semaphores), \
                    (SELECT count(*) FROM pgsemaphore.advisory_semaphores), \
                    (SELECT count(*) FROM pgsemaphore.slots), \
                    (SELECT count(*) FROM pgsemaphore.waiters), \
                    (SELECT count(*) FROM pgsemaphore.rate_ledger)",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(
        (semaphores, advisory, slots, waiters, ledger),
        (1, 1, 0, 0, 0)
    );
    Ok(())
}

#[tokio::test]
async fn mutex_names_and_waits_at_the_edges_never_panic() -> TestResult {
    let db = support::migrated_db().await;
    let other = support::another_pool(&db, 2).await;
    let long = "m".repeat(100_000);
    let names = [
        "",
        long.as_str(),
        "a\0b",
        "'; DROP TABLE pgsemaphore.slots; --",
        "🔒 ключ",
    ];
    for name in names {
        let mutex = pg_semaphore::Mutex::new(name);
        let held = mutex.lock(&db.client).await?;
        // Zero means "do not wait", never PostgreSQL's "wait forever".
        match tokio::time::timeout(
            Duration::from_secs(30),
            mutex
                .locking()
                .timeout(Duration::ZERO)
                .lock(&pg_semaphore::Client::new(other.clone())),
        )
        .await
        {
            Ok(Err(Error::Timeout { .. })) => {}
            other => panic!("{name:?}: expected a prompt Timeout, got {other:?}"),
        }
        assert!(
            matches!(
                mutex
                    .locking()
                    .no_wait()
                    .lock(&pg_semaphore::Client::new(other.clone()))
                    .await,
                Err(Error::Locked { .. })
            ),
            "{name:?}"
        );
        held.commit().await?;
        // An enormous wait is an unbounded one, not an overflow.
        mutex
            .locking()
            .timeout(Duration::MAX)
            .lock(&pg_semaphore::Client::new(other.clone()))
            .await?
            .commit()
            .await?;
    }
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.slots")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(slots, 0);
    Ok(())
}

/// Claim metadata with a NUL character anywhere (a string, a key, nested)
/// cannot be stored as `jsonb`: refused as `InvalidArgument` before anything
/// is sent, on every way to claim, and nothing is written.
#[tokio::test]
async fn metadata_with_nul_is_an_invalid_argument_and_writes_nothing() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("metadata", 2).build(&db.client).await?;
    let bad = [
        serde_json::json!({ "request_id": "r-\u{0}42" }),
        serde_json::json!({ "k\u{0}ey": 1 }),
        serde_json::json!({ "deep": [{ "x": ["\u{0}"] }] }),
        serde_json::json!("\u{0}"),
    ];
    for metadata in bad {
        let results = [
            sem.acquiring()
                .metadata(metadata.clone())
                .try_acquire()
                .await,
            sem.acquiring().metadata(metadata.clone()).acquire().await,
            sem.acquiring()
                .metadata(metadata.clone())
                .timeout(Duration::from_secs(1))
                .acquire()
                .await,
        ];
        for result in results {
            match result {
                Err(
                    error @ Error::InvalidArgument {
                        argument: "metadata",
                        ..
                    },
                ) => assert!(error.to_string().contains("\\u0000"), "{error}"),
                other => panic!("{metadata}: expected InvalidArgument, got {other:?}"),
            }
        }
        match sem
            .acquiring()
            .metadata(metadata.clone())
            .acquire_many(2)
            .await
        {
            Err(Error::InvalidArgument {
                argument: "metadata",
                ..
            }) => {}
            other => panic!("{metadata}: expected InvalidArgument, got {other:?}"),
        }
    }
    assert_eq!(rows(&db.pool).await, (1, 0), "no claim written");
    // The same semaphore still takes clean metadata.
    sem.acquiring()
        .metadata(serde_json::json!({ "request_id": "r-42" }))
        .try_acquire()
        .await?
        .release()
        .await?;
    Ok(())
}

/// Only the crate's own statements read "undefined table/function/schema" as
/// missing migrations: a mistyped name in the caller's own SQL, run inside
/// `Mutex::with_lock` or on a `MutexGuard`, is the database's error as it is.
#[tokio::test]
async fn a_mistyped_name_in_the_callers_sql_is_a_database_error() -> TestResult {
    let db = support::migrated_db().await;
    let mutex = pg_semaphore::Mutex::new("callers-sql");
    let mistakes = [
        ("SELECT * FROM no_such_table", "42P01"),
        ("SELECT no_such_function()", "42883"),
        ("SELECT no_such_schema.f()", "3F000"),
        ("INSERT INTO pgsemaphore.no_such_table VALUES (1)", "42P01"),
    ];
    fn check(sql: &str, code: &str, error: &Error) {
        match error {
            Error::Database(inner) => assert_eq!(
                inner.as_database_error().and_then(|e| e.code()).as_deref(),
                Some(code),
                "{sql}: {inner}"
            ),
            other => panic!("{sql}: expected Error::Database, got {other:?}"),
        }
        assert!(!error.to_string().contains("migrations"), "{sql}: {error}");
    }
    for (sql, code) in mistakes {
        // The closure's error type is the crate's: `?` converts sqlx's error.
        let result: Result<(), Error> = mutex
            .locking()
            .with_lock(&db.client, |conn| {
                Box::pin(async move {
                    sqlx::query(sql).execute(&mut *conn).await?;
                    Ok(())
                })
            })
            .await;
        check(sql, code, &result.expect_err("the statement fails"));

        let mut guard = mutex.lock(&db.client).await?;
        let error = sqlx::query(sql)
            .execute(&mut *guard)
            .await
            .map_err(Error::from)
            .expect_err("the statement fails");
        check(sql, code, &error);
        guard.rollback().await?;
    }
    // The lock was released every time.
    mutex
        .locking()
        .no_wait()
        .lock(&db.client)
        .await?
        .commit()
        .await?;
    Ok(())
}
