//! The rate limiters' ledger, on a real PostgreSQL: a
//! key's state is the newest of its rows in `pgsemaphore.rate_ledger`, each
//! admission appends one, a refusal writes nothing, and checks of one key
//! are serialised by a transaction-level advisory lock.
//!
//! What a user relies on, each pinned here with two connections, one paused
//! inside a transaction (an open `BEGIN`), the other acting, and lock waits
//! observed in `pg_stat_activity` rather than slept for: a check in an open
//! transaction holds back the other checks of its key, and only of its key,
//! until it ends (a commit charges, a rollback charges nothing); every check
//! refuses to run under REPEATABLE READ or SERIALIZABLE, whose snapshot
//! could miss the previous holder's row; a key keeps a bounded number of
//! rows whatever its traffic; pruning deletes keys at rest, trims a live key
//! to its state without changing it, never waits for a check in an open
//! transaction and loses none; and the hard limit holds while another
//! session holds the xmin horizon.
//!
//! Refill over a test's run is negligible where counts must be exact (a rate
//! of one token per thousand seconds, windows of an hour); the tests that
//! need a key at rest sleep for its bucket to refill or its window to end.
//! Hostile arguments (NULLs, empty names, negative permits) are pinned for
//! every check function in tests/hostile.rs.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use pg_semaphore::{RateLimiter, RatePolicy};
use sqlx::{PgConnection, PgExecutor, PgPool};
use support::{TestResult, connect};
use tokio::task::JoinHandle;
use tokio::time::{sleep, timeout};

const HOUR: Duration = Duration::from_secs(3600);

/// How long a test waits for a lock wait to show, or for a waiter to finish.
const PATIENCE: Duration = Duration::from_secs(10);

/// The three limiter kinds, checked straight through their SQL functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bucket,
    Fixed,
    Sliding,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Bucket, Kind::Fixed, Kind::Sliding];

    /// The kind as the ledger names it.
    fn name(self) -> &'static str {
        match self {
            Kind::Bucket => "token_bucket",
            Kind::Fixed => "fixed_window",
            Kind::Sliding => "sliding_window",
        }
    }

    /// One permit of limiter `$1`, key `$2`, admitting `$3` per key during a
    /// test (a rate of 0.001 per second, windows of an hour): `(o_allowed,
    /// o_remaining)`.
    fn check_sql(self) -> &'static str {
        match self {
            Kind::Bucket => {
                "SELECT o_allowed, o_remaining \
                   FROM pgsemaphore.token_bucket($1, $2, 0.001, $3::float8, 1)"
            }
            Kind::Fixed => {
                "SELECT o_allowed, o_remaining \
                   FROM pgsemaphore.fixed_window($1, $2, $3, '1 hour', 1)"
            }
            Kind::Sliding => {
                "SELECT o_allowed, o_remaining \
                   FROM pgsemaphore.sliding_window($1, $2, $3, '1 hour', 1)"
            }
        }
    }
}

/// One permit of `kind`'s key `key` of limiter `limiter`, `limit` per key:
/// `(allowed, remaining)`.
async fn check(
    conn: impl PgExecutor<'_>,
    kind: Kind,
    limiter: &str,
    key: &str,
    limit: i64,
) -> sqlx::Result<(bool, i64)> {
    sqlx::query_as(kind.check_sql())
        .bind(limiter)
        .bind(key)
        .bind(limit)
        .fetch_one(conn)
        .await
}

/// The same on a connection of its own, spawned: it may wait for a lock.
/// Hands the connection back with the answer.
fn spawn_check(
    mut conn: PgConnection,
    kind: Kind,
    limiter: &str,
    key: &str,
    limit: i64,
) -> JoinHandle<(PgConnection, sqlx::Result<(bool, i64)>)> {
    let (limiter, key) = (limiter.to_owned(), key.to_owned());
    tokio::spawn(async move {
        let outcome = check(&mut conn, kind, &limiter, &key, limit).await;
        (conn, outcome)
    })
}

/// A spawned check's answer, within [`PATIENCE`].
async fn answer(
    task: JoinHandle<(PgConnection, sqlx::Result<(bool, i64)>)>,
) -> Result<(PgConnection, (bool, i64)), support::BoxError> {
    let (conn, outcome) = timeout(PATIENCE, task).await??;
    Ok((conn, outcome?))
}

async fn backend_pid(conn: &mut PgConnection) -> sqlx::Result<i32> {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
}

/// Whether, within [`PATIENCE`], backend `waiter` waits for a lock that
/// backend `holder` holds (`pg_stat_activity` and `pg_blocking_pids`).
async fn waits_for(observer: &PgPool, waiter: i32, holder: i32) -> bool {
    support::eventually(PATIENCE, || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
                             WHERE pid = $1 AND wait_event_type = 'Lock' \
                               AND $2 = ANY (pg_blocking_pids($1)))",
        )
        .bind(waiter)
        .bind(holder)
        .fetch_one(observer)
        .await
        .unwrap_or(false)
    })
    .await
}

/// How many rows of a key the ledger keeps.
async fn ledger_rows(pool: &PgPool, kind: &str, limiter: &str, key: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pgsemaphore.rate_ledger WHERE kind = $1 AND limiter = $2 AND key = $3",
    )
    .bind(kind)
    .bind(limiter)
    .bind(key)
    .fetch_one(pool)
    .await
}

/// A key's row of the `pgsemaphore.rate_limits` view: its state.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
struct State {
    tokens: Option<f64>,
    hits: Option<i64>,
    previous_hits: Option<i64>,
    stamp: DateTime<Utc>,
    idle_at: DateTime<Utc>,
}

/// The key's rows in the view (one, or none for a key without state).
async fn view_rows(
    pool: &PgPool,
    kind: &str,
    limiter: &str,
    key: &str,
) -> sqlx::Result<Vec<State>> {
    sqlx::query_as(
        "SELECT tokens, hits, previous_hits, stamp, idle_at FROM pgsemaphore.rate_limits \
          WHERE kind = $1 AND limiter = $2 AND key = $3",
    )
    .bind(kind)
    .bind(limiter)
    .bind(key)
    .fetch_all(pool)
    .await
}

/// The SQLSTATE of a failed statement.
fn sqlstate<T: std::fmt::Debug>(result: sqlx::Result<T>) -> Option<String> {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(error) => error
            .as_database_error()
            .and_then(|e| e.code())
            .map(|c| c.into_owned()),
    }
}

/// How an open transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Commit,
    Rollback,
}

/// Interleaving: a check admitted inside an open transaction, then a check
/// of the same key from another connection. The second waits for the
/// first's transaction (its lock wait is observed), then decides on what it
/// left: refused after a COMMIT (the open check took the last permit),
/// admitted after a ROLLBACK (nothing was charged). For every kind, on a
/// fresh key (the open check creates its state) and on a key with state
/// (the open check appends to it).
#[tokio::test]
async fn a_check_in_an_open_transaction_holds_back_its_key_until_it_ends() -> TestResult {
    let db = support::migrated_db().await;
    let mut holder = connect(&db).await?;
    let holder_pid = backend_pid(&mut holder).await?;
    let mut waiter = connect(&db).await?;
    let waiter_pid = backend_pid(&mut waiter).await?;
    for kind in Kind::ALL {
        for prior in [0, 1] {
            for end in [End::Commit, End::Rollback] {
                let case = format!("{kind:?}, {prior} before, {end:?}");
                let limiter = format!("open-{}-{prior}-{end:?}", kind.name());
                // One permit left for the open transaction's check.
                let limit = prior + 1;
                for _ in 0..prior {
                    assert!(
                        check(&db.pool, kind, &limiter, "k", limit).await?.0,
                        "{case}"
                    );
                }
                sqlx::raw_sql("BEGIN").execute(&mut holder).await?;
                let (allowed, remaining) = check(&mut holder, kind, &limiter, "k", limit).await?;
                assert_eq!((allowed, remaining), (true, 0), "{case}: the open check");

                let task = spawn_check(waiter, kind, &limiter, "k", limit);
                assert!(
                    waits_for(&db.pool, waiter_pid, holder_pid).await,
                    "{case}: the second check never waited for the open transaction"
                );
                assert!(!task.is_finished(), "{case}");
                let ending = match end {
                    End::Commit => "COMMIT",
                    End::Rollback => "ROLLBACK",
                };
                sqlx::raw_sql(ending).execute(&mut holder).await?;
                let (conn, (allowed, _)) = answer(task).await?;
                waiter = conn;
                assert_eq!(
                    allowed,
                    end == End::Rollback,
                    "{case}: the waiting check decided on the wrong state"
                );
                // Either way the key's last permit is now taken, once.
                assert!(
                    !check(&db.pool, kind, &limiter, "k", limit).await?.0,
                    "{case}: a permit too many"
                );
                assert_eq!(
                    ledger_rows(&db.pool, kind.name(), &limiter, "k").await?,
                    limit,
                    "{case}: one ledger row per admission, none per refusal or rollback"
                );
            }
        }
    }
    Ok(())
}

/// Interleaving: a check in an open transaction, then checks of other keys
/// (another key, the same key of another limiter, the same names of another
/// kind): none waits, and each is admitted.
#[tokio::test]
async fn a_check_in_an_open_transaction_holds_back_no_other_key() -> TestResult {
    let db = support::migrated_db().await;
    // The limiters' first uses, committed: they store the pairs. (A first
    // use left open would hold the limiter's settings row it inserted, and
    // another key's first check would wait for it, at most 2 s: 55P03.)
    for (kind, limiter) in [
        (Kind::Bucket, "busy"),
        (Kind::Bucket, "other-limiter"),
        (Kind::Fixed, "busy"),
        (Kind::Sliding, "busy"),
    ] {
        assert!(check(&db.pool, kind, limiter, "first", 1).await?.0);
    }
    let mut holder = connect(&db).await?;
    sqlx::raw_sql("BEGIN").execute(&mut holder).await?;
    assert!(check(&mut holder, Kind::Bucket, "busy", "k", 1).await?.0);
    let others = [
        (Kind::Bucket, "busy", "other-key"),
        (Kind::Bucket, "other-limiter", "k"),
        (Kind::Fixed, "busy", "k"),
        (Kind::Sliding, "busy", "k"),
    ];
    for (kind, limiter, key) in others {
        let (allowed, remaining) = timeout(PATIENCE, check(&db.pool, kind, limiter, key, 1))
            .await
            .unwrap_or_else(|_| panic!("{kind:?} {limiter}/{key} waited for another key"))?;
        assert_eq!((allowed, remaining), (true, 0), "{kind:?} {limiter}/{key}");
    }
    sqlx::raw_sql("COMMIT").execute(&mut holder).await?;
    assert!(!check(&db.pool, Kind::Bucket, "busy", "k", 1).await?.0);
    Ok(())
}

/// Every check function (the three checks, their reservations, and the
/// multi-limit check and its reservation,
/// `check_limits_reserve`), with a capacity of 2 (bucket: burst 2, windows:
/// 2 per hour), asking for both permits of key `$1`: `(o_allowed,
/// o_remaining)`.
const CHECKS: [(&str, &str); 8] = [
    (
        "token_bucket",
        "SELECT o_allowed, o_remaining FROM pgsemaphore.token_bucket('iso', $1, 0.001, 2, 2)",
    ),
    (
        "fixed_window",
        "SELECT o_allowed, o_remaining FROM pgsemaphore.fixed_window('iso', $1, 2, '1 hour', 2)",
    ),
    (
        "sliding_window",
        "SELECT o_allowed, o_remaining FROM pgsemaphore.sliding_window('iso', $1, 2, '1 hour', 2)",
    ),
    (
        "token_bucket_reserve",
        "SELECT o_allowed, o_remaining \
           FROM pgsemaphore.token_bucket_reserve('iso', $1, 0.001, 2, 2, '1 s')",
    ),
    (
        "fixed_window_reserve",
        "SELECT o_allowed, o_remaining \
           FROM pgsemaphore.fixed_window_reserve('iso', $1, 2, '1 hour', 2, '1 s')",
    ),
    (
        "sliding_window_reserve",
        "SELECT o_allowed, o_remaining \
           FROM pgsemaphore.sliding_window_reserve('iso', $1, 2, '1 hour', 2, '1 s')",
    ),
    (
        "check_limits",
        "SELECT o_allowed, o_remaining FROM pgsemaphore.check_limits(\
             ARRAY['token_bucket', 'fixed_window'], ARRAY['iso', 'iso'], ARRAY[$1, $1], \
             ARRAY[0.001, NULL]::float8[], ARRAY[2, NULL]::float8[], \
             ARRAY[NULL, 2]::bigint[], ARRAY[NULL, '1 hour']::interval[], 2)",
    ),
    (
        "check_limits_reserve",
        "SELECT o_allowed, o_remaining FROM pgsemaphore.check_limits_reserve(\
             ARRAY['token_bucket', 'fixed_window'], ARRAY['iso', 'iso'], ARRAY[$1, $1], \
             ARRAY[0.001, NULL]::float8[], ARRAY[2, NULL]::float8[], \
             ARRAY[NULL, 2]::bigint[], ARRAY[NULL, '1 hour']::interval[], 2, '1 s')",
    ),
];

/// Every check function refuses to run in a REPEATABLE READ or
/// SERIALIZABLE transaction (SQLSTATE 0A000), whose snapshot could not see
/// the previous holder's row: in an explicit transaction, and in a single
/// statement of a session whose default isolation is SERIALIZABLE. Nothing
/// is charged: the key has no state, and a READ COMMITTED check afterwards
/// is admitted at full capacity.
#[tokio::test]
async fn every_check_refuses_a_snapshot_older_than_its_statement() -> TestResult {
    let db = support::migrated_db().await;
    let mut conn = connect(&db).await?;
    let mut serializable_by_default = connect(&db).await?;
    sqlx::raw_sql("SET default_transaction_isolation = 'serializable'")
        .execute(&mut serializable_by_default)
        .await?;
    for (function, sql) in CHECKS {
        for level in ["REPEATABLE READ", "SERIALIZABLE"] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "BEGIN ISOLATION LEVEL {level}"
            )))
            .execute(&mut conn)
            .await?;
            let outcome = sqlx::query_as::<_, (bool, i64)>(sql)
                .bind(function)
                .fetch_one(&mut conn)
                .await;
            assert_eq!(
                sqlstate(outcome).as_deref(),
                Some("0A000"),
                "{function} in {level}"
            );
            sqlx::raw_sql("ROLLBACK").execute(&mut conn).await?;
        }
        let outcome = sqlx::query_as::<_, (bool, i64)>(sql)
            .bind(function)
            .fetch_one(&mut serializable_by_default)
            .await;
        assert_eq!(
            sqlstate(outcome).as_deref(),
            Some("0A000"),
            "{function} in a session whose default isolation is SERIALIZABLE"
        );
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.rate_ledger WHERE key = $1")
                .bind(function)
                .fetch_one(&db.pool)
                .await?;
        assert_eq!(left, 0, "{function}: a refused call wrote the ledger");
        let admitted: (bool, i64) = sqlx::query_as(sql)
            .bind(function)
            .fetch_one(&db.pool)
            .await?;
        assert_eq!(
            admitted,
            (true, 0),
            "{function}: READ COMMITTED, both permits of a key nothing was charged to"
        );
    }
    Ok(())
}

/// A key keeps a bounded number of rows whatever its traffic: 1,000
/// admitted checks of one key leave at most 34 of its rows in the ledger
/// (and never more along the way), and the view shows one row, its state.
#[tokio::test]
async fn a_key_keeps_a_bounded_number_of_rows() -> TestResult {
    const CHECKS: u32 = 1_000;
    const BOUND: i64 = 34;
    let db = support::migrated_db().await;
    let fixed = RateLimiter::builder("busy", RatePolicy::fixed_window(10 * CHECKS, HOUR))
        .build(&db.client)?;
    let bucket = RateLimiter::builder("busy", RatePolicy::token_bucket(0.001, 10 * CHECKS))
        .build(&db.client)?;
    let sliding = RateLimiter::builder("busy", RatePolicy::sliding_window(10 * CHECKS, HOUR))
        .build(&db.client)?;
    for kind in Kind::ALL {
        let mut most = 0;
        for i in 1..=CHECKS {
            let decision = match kind {
                Kind::Bucket => bucket.check("k", 1).await?,
                Kind::Fixed => fixed.check("k", 1).await?,
                Kind::Sliding => sliding.check("k", 1).await?,
            };
            assert!(decision.allowed, "{kind:?}: check {i} refused");
            if i % 4 == 0 {
                most = most.max(ledger_rows(&db.pool, kind.name(), "busy", "k").await?);
            }
        }
        let rows = ledger_rows(&db.pool, kind.name(), "busy", "k").await?;
        assert!(
            rows <= BOUND && most <= BOUND,
            "{kind:?}: {rows} rows after {CHECKS} checks, {most} at most along the way"
        );
        let state = view_rows(&db.pool, kind.name(), "busy", "k").await?;
        assert_eq!(state.len(), 1, "{kind:?}: {state:?}");
        match kind {
            Kind::Fixed | Kind::Sliding => {
                assert_eq!(state[0].hits, Some(i64::from(CHECKS)), "{kind:?}")
            }
            Kind::Bucket => assert_eq!(
                state[0].tokens.map(f64::floor),
                Some(f64::from(9 * CHECKS)),
                "{kind:?}"
            ),
        }
    }
    Ok(())
}

/// Pruning, on keys of every kind: keys at rest lose every row; a key at
/// rest whose next check is in an open transaction does not hold the prune
/// up, and that check is not lost (once it commits, the key counts it); a
/// live key with many rows (a hundred admissions) is trimmed to exactly
/// one, its state unchanged, so the next check decides as it would have.
/// The last prune is the SQL function's own walk, from a cursor of NULLs.
#[tokio::test]
async fn prune_deletes_keys_at_rest_loses_no_check_and_trims_live_keys() -> TestResult {
    const LIVE_CHECKS: i64 = 100;
    const LIMIT: i64 = 150;
    let db = support::migrated_db().await;
    let pool = &db.pool;

    // At rest within milliseconds: buckets refilling 1,000 tokens a second,
    // windows of 20 ms; `$2` permits. Keys rest-1 and rest-2 take three
    // single permits (three rows each); key held takes three at once (the
    // bucket's level is then exactly 7, with no refill between checks).
    let quick = |kind: Kind| match kind {
        Kind::Bucket => {
            "SELECT o_allowed FROM pgsemaphore.token_bucket('quick', $1, 1000, 10, $2::float8)"
        }
        Kind::Fixed => {
            "SELECT o_allowed FROM pgsemaphore.fixed_window('quick', $1, 10, '20 ms', $2)"
        }
        Kind::Sliding => {
            "SELECT o_allowed FROM pgsemaphore.sliding_window('quick', $1, 10, '20 ms', $2)"
        }
    };
    for kind in Kind::ALL {
        for (key, checks, permits) in [("rest-1", 3, 1), ("rest-2", 3, 1), ("held", 1, 3)] {
            for _ in 0..checks {
                let allowed: bool = sqlx::query_scalar(quick(kind))
                    .bind(key)
                    .bind(permits as i64)
                    .fetch_one(pool)
                    .await?;
                assert!(allowed, "{kind:?} {key}");
            }
        }
        for _ in 0..LIVE_CHECKS {
            assert!(check(pool, kind, "live", "k", LIMIT).await?.0);
        }
        let rows = ledger_rows(pool, kind.name(), "live", "k").await?;
        assert!(
            rows > 1,
            "{kind:?}: {LIVE_CHECKS} admissions left {rows} rows"
        );
    }
    // Windows of 20 ms at most 40 ms after their last check; full buckets 10 ms.
    sleep(Duration::from_millis(200)).await;

    // A check of each "held" key, at rest, in a transaction left open, with
    // limits that keep it from rest for an hour: a rate of 0.001 (the
    // bucket's level of 7 refills nothing worth a token), windows of an hour
    // (the window that began with the first check, 3 permits in it).
    // (Since the first use stores a limiter's pair, "quick" keeps its own:
    // the key's slower pair is stored by the operator, as an override.)
    for kind in Kind::ALL {
        let (rate, burst, limit, window) = match kind {
            Kind::Bucket => (Some(0.001), Some(10.0), None, None),
            Kind::Fixed | Kind::Sliding => (None, None, Some(10_i64), Some("1 hour")),
        };
        sqlx::query(
            "SELECT pgsemaphore.set_rate_limit($1, 'quick', 'held', $2, $3, $4, $5::interval)",
        )
        .bind(kind.name())
        .bind(rate)
        .bind(burst)
        .bind(limit)
        .bind(window)
        .execute(pool)
        .await?;
    }
    let mut holder = connect(&db).await?;
    sqlx::raw_sql("BEGIN").execute(&mut holder).await?;
    for kind in Kind::ALL {
        assert_eq!(
            check(&mut holder, kind, "quick", "held", 10).await?,
            (true, 6),
            "{kind:?}"
        );
    }
    let mut live_before = Vec::new();
    for kind in Kind::ALL {
        live_before.push(view_rows(pool, kind.name(), "live", "k").await?);
    }

    timeout(
        PATIENCE,
        pg_semaphore::admin::prune_rate_limits(pool, Duration::ZERO),
    )
    .await
    .expect("the prune waited for the open transaction")?;

    for (i, kind) in Kind::ALL.into_iter().enumerate() {
        for key in ["rest-1", "rest-2"] {
            assert_eq!(
                ledger_rows(pool, kind.name(), "quick", key).await?,
                0,
                "{kind:?} {key}: a key at rest kept rows"
            );
            assert!(view_rows(pool, kind.name(), "quick", key).await?.is_empty());
        }
        assert_eq!(
            ledger_rows(pool, kind.name(), "live", "k").await?,
            1,
            "{kind:?}: a live key is trimmed to its newest row"
        );
        assert_eq!(
            view_rows(pool, kind.name(), "live", "k").await?,
            live_before[i],
            "{kind:?}: the trim changed the live key's state"
        );
        // The next check decides as it would have: the 101st permit of 150.
        assert_eq!(
            check(pool, kind, "live", "k", LIMIT).await?,
            (true, LIMIT - LIVE_CHECKS - 1),
            "{kind:?}"
        );
    }

    // The open transaction commits: its checks are the keys' state. The
    // next is the fifth permit of ten (3 before, the open one, this one).
    sqlx::raw_sql("COMMIT").execute(&mut holder).await?;
    for kind in Kind::ALL {
        assert_eq!(
            view_rows(pool, kind.name(), "quick", "held").await?.len(),
            1,
            "{kind:?}"
        );
        assert_eq!(
            check(pool, kind, "quick", "held", 10).await?,
            (true, 5),
            "{kind:?}: the open check's admission was lost"
        );
    }
    // The SQL function from a cursor of three NULLs (from the first key):
    // nothing else is at rest; every key is trimmed to its newest row.
    let (deleted, cursor): (i64, Option<String>) = sqlx::query_as(
        "SELECT o_deleted, o_kind FROM pgsemaphore.prune_rate_limits(interval '0', NULL, NULL, NULL, 1000)",
    )
    .fetch_one(pool)
    .await?;
    assert_eq!((deleted, cursor), (0, None));
    let keys: Vec<(String, String, String, i64)> = sqlx::query_as(
        "SELECT kind, limiter, key, count(*) FROM pgsemaphore.rate_ledger \
          GROUP BY kind, limiter, key ORDER BY kind, limiter, key",
    )
    .fetch_all(pool)
    .await?;
    let expected: Vec<(String, String, String, i64)> =
        ["fixed_window", "sliding_window", "token_bucket"]
            .into_iter()
            .flat_map(|kind| {
                [("live", "k"), ("quick", "held")]
                    .map(|(limiter, key)| (kind.to_owned(), limiter.to_owned(), key.to_owned(), 1))
            })
            .collect();
    assert_eq!(keys, expected);
    Ok(())
}

/// Pruning never waits for an application's open transaction, even one
/// whose check trimmed the key's old rows (an admission trims every so
/// often, and its deletes stay uncommitted with the transaction): a live
/// key of 1,000 per hour with 127 admissions, and its 128th in a
/// transaction left open; the prune returns while that transaction is open,
/// and once it commits the key's state counts all 128.
#[tokio::test]
async fn prune_never_waits_for_an_open_check_that_trimmed_its_key() -> TestResult {
    const BEFORE: i64 = 127;
    const LIMIT: i64 = 1_000;
    let db = support::migrated_db().await;
    let pool = &db.pool;
    for kind in Kind::ALL {
        for _ in 0..BEFORE {
            assert!(check(pool, kind, "trimming", "k", LIMIT).await?.0);
        }
    }
    let mut holder = connect(&db).await?;
    let holder_pid = backend_pid(&mut holder).await?;
    sqlx::raw_sql("BEGIN").execute(&mut holder).await?;
    for kind in Kind::ALL {
        assert!(check(&mut holder, kind, "trimming", "k", LIMIT).await?.0);
    }
    let prune = tokio::spawn({
        let pool = pool.clone();
        async move { pg_semaphore::admin::prune_rate_limits(&pool, Duration::ZERO).await }
    });
    let pruning = &prune;
    if !support::eventually(PATIENCE, || async move { pruning.is_finished() }).await {
        // What it waits for, for the failure message.
        let waits: Vec<(Option<String>, Option<String>, bool)> = sqlx::query_as(
            "SELECT wait_event_type, wait_event, $1 = ANY (pg_blocking_pids(pid)) \
               FROM pg_stat_activity \
              WHERE query LIKE '%prune_rate_limits%' AND pid <> pg_backend_pid()",
        )
        .bind(holder_pid)
        .fetch_all(pool)
        .await?;
        sqlx::raw_sql("COMMIT").execute(&mut holder).await?;
        panic!("the prune waited for the open transaction (wait event, blocked by it): {waits:?}");
    }
    prune.await??;
    sqlx::raw_sql("COMMIT").execute(&mut holder).await?;
    for kind in Kind::ALL {
        let state = view_rows(pool, kind.name(), "trimming", "k").await?;
        assert_eq!(state.len(), 1, "{kind:?}");
        // The next check is the 129th.
        assert_eq!(
            check(pool, kind, "trimming", "k", LIMIT).await?,
            (true, LIMIT - BEFORE - 2),
            "{kind:?}: {state:?}"
        );
    }
    Ok(())
}

/// The hard limit while another session holds the xmin horizon (a
/// REPEATABLE READ transaction that read the state and stays open, as a
/// long report or `pg_dump` would): 4 connections make 400 checks of one
/// key at once, and exactly the limit is admitted: 100 of a fixed and of a
/// sliding window of 100 an hour, 50 of a token bucket of burst 50.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_the_limit_is_admitted_while_the_horizon_is_held() -> TestResult {
    const CONNECTIONS: usize = 4;
    const CHECKS: usize = 100;
    let db = support::migrated_db().await;
    let mut snapshot = connect(&db).await?;
    let snapshot_pid = backend_pid(&mut snapshot).await?;
    sqlx::raw_sql(
        "BEGIN ISOLATION LEVEL REPEATABLE READ; \
         SELECT count(*) FROM pgsemaphore.rate_limits;",
    )
    .execute(&mut snapshot)
    .await?;
    let holds: bool =
        sqlx::query_scalar("SELECT backend_xmin IS NOT NULL FROM pg_stat_activity WHERE pid = $1")
            .bind(snapshot_pid)
            .fetch_one(&db.pool)
            .await?;
    assert!(holds, "the open snapshot holds no horizon");

    let pool = support::another_pool(&db, CONNECTIONS as u32).await;
    for (kind, limit) in [(Kind::Fixed, 100), (Kind::Sliding, 100), (Kind::Bucket, 50)] {
        let admitted = Arc::new(AtomicU32::new(0));
        let tasks: Vec<_> = (0..CONNECTIONS)
            .map(|_| {
                let (pool, admitted) = (pool.clone(), admitted.clone());
                tokio::spawn(async move {
                    for _ in 0..CHECKS {
                        if check(&pool, kind, "horizon", "the-key", limit).await?.0 {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Ok::<_, sqlx::Error>(())
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        assert_eq!(
            i64::from(admitted.load(Ordering::Relaxed)),
            limit,
            "{kind:?}: {} checks",
            CONNECTIONS * CHECKS
        );
    }
    sqlx::raw_sql("COMMIT").execute(&mut snapshot).await?;
    Ok(())
}
