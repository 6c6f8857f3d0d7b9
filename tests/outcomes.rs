//! The outcome counters: every refusal, timeout and rate decision of a
//! client's primitives is counted, per name and minute, and written by
//! `Client::shutdown` (or the client's writer, every 5 s), exactly once,
//! even when a write fails first; and `pgsemaphore.record_outcomes`, the
//! one writer, refuses every bad argument and writes nothing then.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{TimeDelta, Utc};
use pg_semaphore::admin::{self, OutcomeKind};
use pg_semaphore::{
    AdvisorySemaphore, Client, Error, LimiterSet, RateLimiter, RatePolicy, Semaphore,
    SemaphoreFamily,
};
use sqlx::{AssertSqlSafe, PgPool};
use support::TestResult;

/// Every name's counts of the last ten minutes, summed over the minutes
/// (a test may straddle two): (kind, name) -> (admitted, refused, timed out).
async fn counted(pool: &PgPool) -> TestResult<BTreeMap<(OutcomeKind, String), (u64, u64, u64)>> {
    let now = Utc::now();
    let mut sums = BTreeMap::new();
    for row in admin::outcomes(
        pool,
        now - TimeDelta::minutes(10)..now + TimeDelta::minutes(1),
    )
    .await?
    {
        let sum: &mut (u64, u64, u64) = sums.entry((row.kind, row.name)).or_default();
        sum.0 += row.admitted;
        sum.1 += row.refused;
        sum.2 += row.timed_out;
    }
    Ok(sums)
}

#[tokio::test]
async fn refusals_timeouts_and_rate_decisions_are_counted_exactly() -> TestResult {
    let db = support::migrated_db().await;
    let client = Client::new(db.pool.clone());

    // A lease semaphore: 3 refusals, 2 timeouts; a claim that succeeds
    // counts nothing.
    let api = Semaphore::builder("api", 1).build(&client).await?;
    let held = api.try_acquire().await?;
    for _ in 0..3 {
        assert!(matches!(
            api.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
    }
    for _ in 0..2 {
        let waited = api
            .acquiring()
            .timeout(Duration::from_millis(50))
            .acquire()
            .await;
        assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");
    }

    // An advisory semaphore: 2 refusals.
    let exports = AdvisorySemaphore::builder("exports", 1)
        .audit(false)
        .build(&client)
        .await?;
    let exporting = exports.try_acquire().await?;
    for _ in 0..2 {
        assert!(matches!(
            exports.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
    }

    // A family: its keys count under its name, a multi-limit claim refused
    // by a key too.
    let tenants = SemaphoreFamily::builder("tenants", 1)
        .build(&client)
        .await?;
    let a = tenants.try_acquire("a").await?;
    let b = tenants.try_acquire("b").await?;
    assert!(matches!(
        tenants.try_acquire("a").await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    assert!(matches!(
        tenants.try_acquire("b").await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    let global = Semaphore::builder("global", 10).build(&client).await?;
    let key = tenants.key("a").await?;
    let refused = Semaphore::try_acquire_all(&[(&global, 1), (&key, 1)]).await;
    assert!(
        matches!(refused, Err(Error::NoSlotsAvailable { .. })),
        "{refused:?}"
    );

    // A token bucket of 2: 2 admitted, 1 refused, then an acquire that
    // cannot be admitted within 10 ms times out.
    let partner =
        RateLimiter::builder("partner", RatePolicy::token_bucket(0.01, 2)).build(&client)?;
    for allowed in [true, true, false] {
        assert_eq!(partner.check("k", 1).await?.allowed, allowed);
    }
    let waited = partner
        .acquire_timeout("k", 1, Duration::from_millis(10))
        .await;
    assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");
    // An acquire admitted at once.
    assert!(
        partner
            .acquire_timeout("other", 1, Duration::from_secs(1))
            .await?
            .allowed
    );

    // A set: an admission counts for each limiter, a refusal for the one
    // that decided.
    let day = RateLimiter::builder(
        "per-day",
        RatePolicy::fixed_window(1, Duration::from_secs(86_400)),
    )
    .build(&client)?;
    let set = LimiterSet::new().with(&partner).with(&day);
    assert!(set.check("set-key", 1).await?.allowed);
    assert!(!set.check("set-key", 1).await?.allowed); // per-day is spent; partner has 1 left

    client.shutdown().await?;
    let expected: BTreeMap<(OutcomeKind, String), (u64, u64, u64)> = [
        ((OutcomeKind::Semaphore, "api"), (0, 3, 2)),
        ((OutcomeKind::Advisory, "exports"), (0, 2, 0)),
        ((OutcomeKind::Family, "tenants"), (0, 3, 0)),
        ((OutcomeKind::TokenBucket, "partner"), (4, 1, 1)),
        ((OutcomeKind::FixedWindow, "per-day"), (1, 1, 0)),
    ]
    .into_iter()
    .map(|((kind, name), counts)| ((kind, name.to_owned()), counts))
    .collect();
    assert_eq!(counted(&db.pool).await?, expected);
    // A second shutdown writes nothing more.
    client.shutdown().await?;
    assert_eq!(counted(&db.pool).await?, expected);

    held.release().await?;
    exporting.release().await?;
    a.release().await?;
    b.release().await?;
    Ok(())
}

/// The client's own writer, without a shutdown, within its interval.
#[tokio::test]
async fn the_clients_writer_writes_within_seconds() -> TestResult {
    let db = support::migrated_db().await;
    let client = Client::new(db.pool.clone());
    let sem = Semaphore::builder("busy", 1).build(&client).await?;
    let held = sem.try_acquire().await?;
    assert!(sem.try_acquire().await.is_err());
    let written = support::eventually(Duration::from_secs(15), || async {
        counted(&db.pool)
            .await
            .ok()
            .and_then(|c| c.get(&(OutcomeKind::Semaphore, "busy".to_owned())).copied())
            == Some((0, 1, 0))
    })
    .await;
    assert!(written, "the writer did not write the refusal within 15 s");
    held.release().await?;
    Ok(())
}

/// A write that fails (another transaction holds the minute's row for
/// longer than the function's 2 s `lock_timeout`) keeps its counts, and the
/// next one writes them: nothing lost, nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_keeps_its_counts_for_the_next() -> TestResult {
    let db = support::migrated_db().await;
    // Not across a minute's end: the held row must be the one written.
    let second: f64 = sqlx::query_scalar("SELECT extract(second FROM clock_timestamp())::float8")
        .fetch_one(&db.pool)
        .await?;
    if second > 45.0 {
        tokio::time::sleep(Duration::from_secs_f64(61.0 - second)).await;
    }
    let client = Client::new(db.pool.clone());
    let sem = Semaphore::builder("held", 1).build(&client).await?;
    let permit = sem.try_acquire().await?;
    for _ in 0..5 {
        assert!(sem.try_acquire().await.is_err());
    }
    let mut squatter = db.pool.acquire().await?;
    sqlx::query("BEGIN").execute(&mut *squatter).await?;
    sqlx::query(
        "SELECT pgsemaphore.record_outcomes(ARRAY['semaphore'], ARRAY['held'], \
         ARRAY[0]::bigint[], ARRAY[100]::bigint[], ARRAY[0]::bigint[])",
    )
    .execute(&mut *squatter)
    .await?;
    let failed = client.shutdown().await;
    assert!(failed.is_err(), "{failed:?}");
    // Counted meanwhile: added to what was kept.
    assert!(sem.try_acquire().await.is_err());
    sqlx::query("COMMIT").execute(&mut *squatter).await?;
    client.shutdown().await?;
    assert_eq!(
        counted(&db.pool)
            .await?
            .get(&(OutcomeKind::Semaphore, "held".to_owned())),
        Some(&(0, 106, 0))
    );
    permit.release().await?;
    Ok(())
}

/// Retention: `prune_claims` deletes the minutes that ended more than its
/// `older_than` ago, and keeps the others.
#[tokio::test]
async fn retention_deletes_old_minutes_only() -> TestResult {
    let db = support::migrated_db().await;
    for name in ["old", "new"] {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT pgsemaphore.record_outcomes(ARRAY['family'], ARRAY['{name}'], \
             ARRAY[0]::bigint[], ARRAY[1]::bigint[], ARRAY[0]::bigint[])"
        )))
        .execute(&db.pool)
        .await?;
    }
    sqlx::query(
        "UPDATE pgsemaphore.outcomes SET minute = minute - interval '3 days' WHERE name = 'old'",
    )
    .execute(&db.pool)
    .await?;
    admin::prune_claims(&db.pool, Duration::from_secs(2 * 86_400)).await?;
    let names: Vec<String> = sqlx::query_scalar("SELECT name FROM pgsemaphore.outcomes")
        .fetch_all(&db.pool)
        .await?;
    assert_eq!(names, ["new"]);
    Ok(())
}

/// SQLSTATE and COLUMN of a refused call.
fn refused<T: std::fmt::Debug>(result: sqlx::Result<T>) -> (String, Option<String>) {
    let error = result.expect_err("refused");
    let db = error.as_database_error().expect("a database error");
    (
        db.code().unwrap_or_default().into_owned(),
        db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .and_then(|e| e.column())
            .map(str::to_owned),
    )
}

/// Every bad argument of `record_outcomes` is refused with 22023 naming it,
/// and writes nothing; outside READ COMMITTED the call is refused (0A000).
#[tokio::test]
async fn record_outcomes_refuses_every_bad_argument_and_writes_nothing() -> TestResult {
    let db = support::migrated_db().await;
    let call = |kinds: &str, names: &str, admitted: &str, refused: &str, timed_out: &str| {
        format!(
            "SELECT pgsemaphore.record_outcomes(p_kinds => {kinds}, p_names => {names}, \
             p_admitted => {admitted}, p_refused => {refused}, p_timed_out => {timed_out})"
        )
    };
    let one = "ARRAY[1]::bigint[]";
    let zero = "ARRAY[0]::bigint[]";
    let sem = "ARRAY['semaphore']";
    let name = "ARRAY['a']";
    let many = |n: usize, element: &str| format!("array_fill({element}, ARRAY[{n}])");
    let names_1001 = "(SELECT array_agg('n' || i) FROM generate_series(1, 1001) i)";
    let long = format!("ARRAY['{}']", "x".repeat(201));
    let cases: Vec<(String, &str)> = vec![
        (call("NULL", name, zero, one, zero), "p_kinds"),
        (
            call(
                "'{}'::text[]",
                "'{}'::text[]",
                "'{}'::bigint[]",
                "'{}'::bigint[]",
                "'{}'::bigint[]",
            ),
            "p_kinds",
        ),
        (
            call("ARRAY[NULL]::text[]", name, zero, one, zero),
            "p_kinds",
        ),
        (
            call(
                "ARRAY[['semaphore']]",
                "ARRAY[['a']]",
                "ARRAY[[0]]::bigint[]",
                "ARRAY[[1]]::bigint[]",
                "ARRAY[[0]]::bigint[]",
            ),
            "p_kinds",
        ),
        (
            call(
                &many(1001, "'semaphore'::text"),
                names_1001,
                &many(1001, "0::bigint"),
                &many(1001, "1::bigint"),
                &many(1001, "0::bigint"),
            ),
            "p_kinds",
        ),
        (call("ARRAY['slots']", name, zero, one, zero), "p_kinds"),
        (call("ARRAY['Semaphore']", name, zero, one, zero), "p_kinds"),
        (call(sem, "NULL", zero, one, zero), "p_names"),
        (call(sem, "ARRAY[NULL]::text[]", zero, one, zero), "p_names"),
        (call(sem, "ARRAY['a', 'b']", zero, one, zero), "p_names"),
        (call(sem, "ARRAY['']", zero, one, zero), "p_names"),
        (call(sem, &long, zero, one, zero), "p_names"),
        (
            call(
                "ARRAY['semaphore', 'family', 'semaphore']",
                "ARRAY['a', 'a', 'a']",
                "ARRAY[0, 0, 0]::bigint[]",
                "ARRAY[1, 1, 1]::bigint[]",
                "ARRAY[0, 0, 0]::bigint[]",
            ),
            "p_names",
        ),
        (call(sem, name, "NULL", one, zero), "p_admitted"),
        (
            call(sem, name, "ARRAY[-1]::bigint[]", one, zero),
            "p_admitted",
        ),
        (
            call(sem, name, "ARRAY[0, 0]::bigint[]", one, zero),
            "p_admitted",
        ),
        (
            call(sem, name, zero, "ARRAY[NULL]::bigint[]", zero),
            "p_refused",
        ),
        (
            call(sem, name, zero, "ARRAY[1000000001]::bigint[]", zero),
            "p_refused",
        ),
        (
            call(
                sem,
                name,
                zero,
                "ARRAY[9223372036854775807]::bigint[]",
                zero,
            ),
            "p_refused",
        ),
        (
            call(
                sem,
                name,
                zero,
                "ARRAY[-9223372036854775808]::bigint[]",
                zero,
            ),
            "p_refused",
        ),
        (
            call(sem, name, zero, one, "ARRAY[-1]::bigint[]"),
            "p_timed_out",
        ),
        (call(sem, name, zero, one, "'{}'::bigint[]"), "p_timed_out"),
    ];
    let mut wrong = Vec::new();
    for (sql, column) in &cases {
        let result = sqlx::query(AssertSqlSafe(sql.clone()))
            .execute(&db.pool)
            .await;
        let got = refused(result);
        if got != ("22023".to_owned(), Some((*column).to_owned())) {
            wrong.push(format!("{sql}: {got:?}, expected {column}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Outside READ COMMITTED: refused before anything is written.
    let mut conn = db.pool.acquire().await?;
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *conn)
        .await?;
    let repeatable = sqlx::query(AssertSqlSafe(call(sem, name, zero, one, zero)))
        .execute(&mut *conn)
        .await;
    assert_eq!(refused(repeatable).0, "0A000");
    sqlx::query("ROLLBACK").execute(&mut *conn).await?;
    drop(conn);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.outcomes")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(rows, 0, "a refused call wrote something");
    // Well formed, with a lower bound other than 1 and entries of zeros
    // (written as nothing): only the others are written.
    let written: i32 = sqlx::query_scalar(
        "SELECT pgsemaphore.record_outcomes('[0:2]={token_bucket,family,advisory}'::text[], \
         ARRAY['t', 'f', 'z'], ARRAY[5, 0, 0]::bigint[], ARRAY[1, 2, 0]::bigint[], \
         ARRAY[0, 3, 0]::bigint[])",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(written, 2);
    let expected: BTreeMap<(OutcomeKind, String), (u64, u64, u64)> = [
        ((OutcomeKind::TokenBucket, "t".to_owned()), (5, 1, 0)),
        ((OutcomeKind::Family, "f".to_owned()), (0, 2, 3)),
    ]
    .into_iter()
    .collect();
    assert_eq!(counted(&db.pool).await?, expected);
    Ok(())
}

/// A claim with a rate limit counts the limiter's decision when the
/// semaphore admitted (the limit decided), and nothing for the limiter when
/// the semaphore refused (the limit was never asked).
#[tokio::test]
async fn a_claim_with_a_rate_limit_counts_the_limits_decisions() -> TestResult {
    let db = support::migrated_db().await;
    let client = Client::new(db.pool.clone());
    let upstream = Semaphore::builder("geo", 1).build(&client).await?;
    let per_customer =
        RateLimiter::builder("geo-rate", RatePolicy::token_bucket(0.001, 2)).build(&client)?;
    let claim = || upstream.acquiring().rate_limit(&per_customer, "c1");
    let first = claim().try_acquire().await?; // admitted by both
    assert!(matches!(
        claim().try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    )); // the semaphore refused: the limit was not asked
    first.release().await?;
    claim().try_acquire().await?.release().await?; // admitted by both
    assert!(matches!(
        claim().try_acquire().await,
        Err(Error::RateLimited { .. })
    )); // the limit refused
    client.shutdown().await?;
    let counts = counted(&db.pool).await?;
    assert_eq!(
        counts.get(&(OutcomeKind::Semaphore, "geo".to_owned())),
        Some(&(0, 1, 0))
    );
    assert_eq!(
        counts.get(&(OutcomeKind::TokenBucket, "geo-rate".to_owned())),
        Some(&(2, 1, 0))
    );
    Ok(())
}
