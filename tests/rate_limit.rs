//! The rate limiters' promises, on a real PostgreSQL: Stripe's token bucket
//! test, fixed and sliding window semantics, per-key independence, exact
//! admission counts under contention from several pools (and through
//! PgBouncer), idle-key cleanup, fail-open, and bad input.
//!
//! Refill over a test's run time is made negligible where counts must be
//! exact (a rate of one token per thousand seconds, windows of an hour); the
//! tests that need time to pass sleep for it and assert counts only.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use pg_semaphore::{
    Decision, Error, RateLimiter, RatePolicy, WaitedFor,
    admin::Reaper,
    limits::{MAX_KEY_LEN, MAX_NAME_LEN, MAX_WINDOW},
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use support::TestResult;
use tokio::time::{Instant, sleep};

const HOUR: Duration = Duration::from_secs(3600);

/// The three policies, each admitting exactly `limit` per key during a
/// test (no refill worth a token within 1,000 s, windows of an hour).
fn exact_trio(pool: &PgPool, name: &str, limit: u32, pooled: bool) -> Vec<RateLimiter> {
    [
        RatePolicy::token_bucket(0.001, limit),
        RatePolicy::fixed_window(limit, HOUR),
        RatePolicy::sliding_window(limit, HOUR),
    ]
    .into_iter()
    .map(|policy| {
        RateLimiter::builder(name, policy)
            .build(&pg_semaphore::Client::new(pool.clone()).transaction_pooling(pooled))
            .expect("valid policy")
    })
    .collect()
}

/// Checks one permit at a time until the first refusal; returns how many passed.
async fn admitted_until_refused(limiter: &RateLimiter, key: &str, at_most: u32) -> u32 {
    for passed in 0..=at_most {
        let decision = limiter.check(key, 1).await.expect("check");
        if !decision.allowed {
            return passed;
        }
    }
    at_most + 1
}

async fn rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.rate_limits")
        .fetch_one(pool)
        .await
        .expect("count rate limit rows")
}

/// Seed 002's `test_check_request_rate_limiter`, on the database clock: a
/// burst of `CAPACITY` passes and the next is refused; one second later
/// `RATE` more pass and the next is refused. (Stripe's script counted whole
/// seconds; this bucket refills continuously, so the rate is low enough that
/// the checks of each phase, a few milliseconds, refill far less than a token.)
#[tokio::test]
async fn token_bucket_burst_then_steady_rate() -> TestResult {
    const RATE: u32 = 2;
    const CAPACITY: u32 = 5 * RATE;
    let db = support::migrated_db().await;
    let limiter = RateLimiter::builder(
        "request_rate_limiter",
        RatePolicy::token_bucket(f64::from(RATE), CAPACITY),
    )
    .build(&pg_semaphore::Client::new(db.pool.clone()))?;
    let user = "user-1234";

    // Burst works.
    for i in 0..CAPACITY {
        let decision = limiter.check(user, 1).await?;
        assert!(decision.allowed, "burst request {i} refused: {decision:?}");
        assert_eq!(decision.remaining, CAPACITY - i - 1);
        assert_eq!(decision.retry_after, Duration::ZERO);
        assert_eq!(decision.limit, CAPACITY);
    }
    let refused = limiter.check(user, 1).await?;
    assert!(
        !refused.allowed,
        "request after the burst admitted: {refused:?}"
    );
    assert_eq!(refused.remaining, 0);
    assert!(refused.retry_after > Duration::ZERO);
    assert!(refused.retry_after <= Duration::from_secs(1) / RATE);

    sleep(Duration::from_secs(1)).await;

    // After the burst is done, check the steady state.
    for i in 0..RATE {
        let decision = limiter.check(user, 1).await?;
        assert!(decision.allowed, "steady request {i} refused: {decision:?}");
    }
    let refused = limiter.check(user, 1).await?;
    assert!(
        !refused.allowed,
        "request beyond the rate admitted: {refused:?}"
    );
    Ok(())
}

/// A refused check tells how long to wait; waiting that long is enough.
#[tokio::test]
async fn retry_after_is_enough_for_every_limiter() -> TestResult {
    let db = support::migrated_db().await;
    let limiters = [
        RateLimiter::builder("b", RatePolicy::token_bucket(4.0, 3))
            .build(&pg_semaphore::Client::new(db.pool.clone()))?,
        RateLimiter::builder("f", RatePolicy::fixed_window(3, Duration::from_millis(400)))
            .build(&pg_semaphore::Client::new(db.pool.clone()))?,
        RateLimiter::builder(
            "s",
            RatePolicy::sliding_window(3, Duration::from_millis(400)),
        )
        .build(&pg_semaphore::Client::new(db.pool.clone()))?,
    ];
    for limiter in &limiters {
        assert_eq!(limiter.check("k", 3).await?.remaining, 0);
        let refused = limiter.check("k", 2).await?;
        assert!(!refused.allowed, "{}: {refused:?}", limiter.policy().kind());
        assert!(
            refused.retry_after > Duration::ZERO,
            "{}",
            limiter.policy().kind()
        );
        sleep(refused.retry_after).await;
        let decision = limiter.check("k", 2).await?;
        assert!(
            decision.allowed,
            "{}: refused after waiting retry_after: {decision:?}",
            limiter.policy().kind()
        );
    }
    Ok(())
}

/// Weighted checks: `permits` tokens at once, all or nothing.
#[tokio::test]
async fn weighted_checks_take_all_or_nothing() -> TestResult {
    let db = support::migrated_db().await;
    for limiter in exact_trio(&db.pool, "weighted", 5, false) {
        let kind = limiter.policy().kind();
        let first = limiter.check("k", 3).await?;
        assert!(first.allowed, "{kind}");
        assert_eq!(first.remaining, 2, "{kind}");
        let too_many = limiter.check("k", 3).await?;
        assert!(!too_many.allowed, "{kind}");
        assert_eq!(too_many.remaining, 2, "{kind}: a refusal took permits");
        let rest = limiter.check("k", 2).await?;
        assert!(rest.allowed, "{kind}");
        assert_eq!(rest.remaining, 0, "{kind}");
        assert!(!limiter.check("k", 1).await?.allowed, "{kind}");
    }
    Ok(())
}

/// A fixed window admits its limit, refuses until the window ends, then
/// admits the full limit again at once.
#[tokio::test]
async fn fixed_window_resets_at_the_end_of_the_window() -> TestResult {
    const LIMIT: u32 = 4;
    let db = support::migrated_db().await;
    let window = Duration::from_secs(1);
    let limiter = RateLimiter::builder("fixed", RatePolicy::fixed_window(LIMIT, window))
        .build(&pg_semaphore::Client::new(db.pool.clone()))?;
    assert_eq!(admitted_until_refused(&limiter, "k", LIMIT).await, LIMIT);
    let refused = limiter.check("k", 1).await?;
    assert!(!refused.allowed);
    assert!(refused.retry_after > Duration::ZERO && refused.retry_after <= window);
    sleep(refused.retry_after).await;
    // A new window: the whole limit again.
    assert_eq!(admitted_until_refused(&limiter, "k", LIMIT).await, LIMIT);
    Ok(())
}

/// Right after a full window, a fixed window admits its whole limit again;
/// the sliding window still counts most of the previous window and admits
/// only what slid out of it.
#[tokio::test]
async fn sliding_window_holds_back_the_burst_after_a_boundary() -> TestResult {
    const LIMIT: u32 = 10;
    let db = support::migrated_db().await;
    let window = Duration::from_secs(3);
    let limiter = RateLimiter::builder("sliding", RatePolicy::sliding_window(LIMIT, window))
        .build(&pg_semaphore::Client::new(db.pool.clone()))?;
    assert_eq!(admitted_until_refused(&limiter, "k", LIMIT).await, LIMIT);
    let refused = limiter.check("k", 1).await?;
    assert!(!refused.allowed);
    // Past the window's end, plus the tenth of a window it takes for one of
    // the ten permits to slide out.
    assert!(refused.retry_after > window / 10, "{refused:?}");
    assert!(refused.retry_after <= window + window / 10, "{refused:?}");
    sleep(refused.retry_after).await;
    assert!(limiter.check("k", 1).await?.allowed);
    // A fixed window would admit nine more here; the previous window's
    // weight (0.9 of ten, minus what slid out since) holds them back.
    let after = admitted_until_refused(&limiter, "k", LIMIT).await;
    assert!(
        after < LIMIT - 1,
        "{after} admitted right after the boundary"
    );
    Ok(())
}

/// Keys, limiter names and limiter kinds never share state.
#[tokio::test]
async fn keys_names_and_kinds_are_independent() -> TestResult {
    let db = support::migrated_db().await;
    let a = exact_trio(&db.pool, "a", 2, false);
    let b = exact_trio(&db.pool, "b", 2, false);
    // Exhaust key "alice" on every limiter named "a".
    for limiter in &a {
        assert_eq!(admitted_until_refused(limiter, "alice", 2).await, 2);
    }
    for limiter in &a {
        // Another key of the same limiter is untouched.
        assert_eq!(
            admitted_until_refused(limiter, "bob", 2).await,
            2,
            "{}",
            limiter.policy().kind()
        );
    }
    for limiter in &b {
        // The same key of another limiter is untouched.
        assert_eq!(
            admitted_until_refused(limiter, "alice", 2).await,
            2,
            "{}",
            limiter.policy().kind()
        );
    }
    // Three kinds x (two keys of "a" + one of "b").
    assert_eq!(rows(&db.pool).await, 9);
    Ok(())
}

/// Many tasks on three pools (three "processes") hit one fresh key at once:
/// exactly the limit is admitted, for every kind, including the race to
/// create the key's row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_the_limit_is_admitted_under_contention() -> TestResult {
    const LIMIT: u32 = 60;
    const TASKS: usize = 24;
    const CHECKS: u32 = 8; // 192 checks for 60 permits
    let db = support::migrated_db().await;
    let mut pools = Vec::new();
    for _ in 0..3 {
        pools.push(support::another_pool(&db, 4).await);
    }
    for kind in 0..3 {
        let admitted = Arc::new(AtomicU32::new(0));
        let tasks: Vec<_> = (0..TASKS)
            .map(|task| {
                let pool = &pools[task % pools.len()];
                let limiter = exact_trio(pool, "hot", LIMIT, false).swap_remove(kind);
                let admitted = admitted.clone();
                tokio::spawn(async move {
                    for _ in 0..CHECKS {
                        if limiter.check("the-key", 1).await?.allowed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Ok::<_, Error>(limiter.policy().kind())
                })
            })
            .collect();
        let mut name = None;
        for task in tasks {
            name = Some(task.await??);
        }
        assert_eq!(admitted.load(Ordering::Relaxed), LIMIT, "{name:?}");
    }
    Ok(())
}

/// The same through PgBouncer in transaction mode, with `transaction_pooling(true)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_the_limit_is_admitted_through_pgbouncer() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    const LIMIT: u32 = 30;
    let db = support::migrated_db().await;
    let pool = support::pgbouncer::pool_through_bouncer(&db, 4).await;
    for limiter in exact_trio(&pool, "bounced", LIMIT, true) {
        let admitted = Arc::new(AtomicU32::new(0));
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let limiter = limiter.clone();
                let admitted = admitted.clone();
                tokio::spawn(async move {
                    for _ in 0..6 {
                        if limiter.check("the-key", 1).await?.allowed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Ok::<_, Error>(())
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        assert_eq!(
            admitted.load(Ordering::Relaxed),
            LIMIT,
            "{}",
            limiter.policy().kind()
        );
    }
    Ok(())
}

/// Pruning deletes keys at rest, and only those: a key still limited stays
/// (its next check is still refused), and `idle_for` spares keys at rest
/// for less than that.
#[tokio::test]
async fn prune_deletes_only_idle_keys() -> TestResult {
    let db = support::migrated_db().await;
    // At rest a millisecond after its check: the bucket refills at once.
    let fast = RateLimiter::builder("fast", RatePolicy::token_bucket(1000.0, 1))
        .build(&pg_semaphore::Client::new(db.pool.clone()))?;
    // Still limited for the whole test.
    let limited = exact_trio(&db.pool, "limited", 1, false);
    assert!(fast.check("idle-key", 1).await?.allowed);
    for limiter in &limited {
        assert!(limiter.check("busy-key", 1).await?.allowed);
    }
    assert_eq!(rows(&db.pool).await, 4);
    sleep(Duration::from_millis(50)).await;

    // At rest for 50 ms, not an hour: kept.
    assert_eq!(
        pg_semaphore::admin::prune_rate_limits(&db.pool, HOUR).await?,
        0
    );
    assert_eq!(
        pg_semaphore::admin::prune_rate_limits(&db.pool, Duration::ZERO).await?,
        1
    );
    assert_eq!(rows(&db.pool).await, 3);
    for limiter in &limited {
        assert!(
            !limiter.check("busy-key", 1).await?.allowed,
            "{}: pruning forgot a limited key",
            limiter.policy().kind()
        );
    }
    // The pruned key starts afresh.
    assert_eq!(fast.check("idle-key", 1).await?.remaining, 0);
    Ok(())
}

/// Pruning walks a table bigger than one batch (5,000 rows) to the end.
#[tokio::test]
async fn prune_walks_every_batch() -> TestResult {
    let db = support::migrated_db().await;
    // 12,000 keys at rest for a day, 3,000 not at rest for another hour.
    sqlx::query(
        "INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, tokens, stamp, idle_at) \
         SELECT 'token_bucket', 'bulk', 'k' || i, 1, 1, now() - interval '1 day', \
                CASE WHEN i % 5 = 0 THEN now() + interval '1 hour' ELSE now() - interval '1 day' END \
           FROM generate_series(1, 15000) AS i",
    )
    .execute(&db.pool)
    .await?;
    let deleted = pg_semaphore::admin::prune_rate_limits(&db.pool, Duration::from_secs(60)).await?;
    assert_eq!(deleted, 12_000);
    assert_eq!(rows(&db.pool).await, 3_000);
    Ok(())
}

/// A reaper with `rate_limits(idle_for)` prunes idle keys each round.
#[tokio::test]
async fn reaper_prunes_idle_keys() -> TestResult {
    let db = support::migrated_db().await;
    let fast = RateLimiter::builder("fast", RatePolicy::token_bucket(1000.0, 1))
        .build(&pg_semaphore::Client::new(db.pool.clone()))?;
    let slow = RateLimiter::builder("slow", RatePolicy::token_bucket(0.001, 1))
        .build(&pg_semaphore::Client::new(db.pool.clone()))?;
    assert!(fast.check("k", 1).await?.allowed);
    assert!(slow.check("k", 1).await?.allowed);
    let reaper = Reaper::builder()
        .interval(Duration::from_millis(50))
        .rate_limits(Duration::ZERO)
        .spawn(&db.pool)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while rows(&db.pool).await > 1 && Instant::now() < deadline {
        sleep(Duration::from_millis(20)).await;
    }
    reaper.shutdown().await;
    let left: Vec<String> = sqlx::query_scalar("SELECT limiter FROM pgsemaphore.rate_limits")
        .fetch_all(&db.pool)
        .await?;
    assert_eq!(left, ["slow"]);
    Ok(())
}

/// Connect options for a port nothing listens on.
fn closed_port(db: &support::TestDb) -> PgConnectOptions {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let port = listener.local_addr().expect("local address").port();
    drop(listener);
    db.options.clone().host("127.0.0.1").port(port)
}

/// With the database unreachable, a fail-open limiter admits (and says so);
/// the default, fail-closed, returns the error.
#[tokio::test]
async fn fail_open_admits_when_the_database_is_down() -> TestResult {
    let db = support::empty_db().await;
    let down = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(closed_port(&db));
    for fail_open in [true, false] {
        let limiters = [
            RateLimiter::builder("down", RatePolicy::token_bucket(1.0, 1))
                .fail_open(fail_open)
                .build(&pg_semaphore::Client::new(down.clone()))?,
            RateLimiter::builder("down", RatePolicy::fixed_window(1, HOUR))
                .fail_open(fail_open)
                .build(&pg_semaphore::Client::new(down.clone()))?,
            RateLimiter::builder("down", RatePolicy::sliding_window(1, HOUR))
                .fail_open(fail_open)
                .build(&pg_semaphore::Client::new(down.clone()))?,
        ];
        for limiter in &limiters {
            let kind = limiter.policy().kind();
            let outcome = limiter.check("k", 1).await;
            if fail_open {
                let decision = outcome?;
                assert!(
                    decision.allowed && decision.failed_open,
                    "{kind}: {decision:?}"
                );
                // Every request passes: nothing is counted.
                assert!(limiter.check("k", 1).await?.allowed, "{kind}");
            } else {
                assert!(
                    matches!(outcome, Err(Error::Database(_))),
                    "{kind}: fail-closed gave {outcome:?}"
                );
            }
        }
    }
    Ok(())
}

/// Failing open covers an unreachable database, not a broken setup: missing
/// migrations are still an error. A reachable database never fails open.
#[tokio::test]
async fn fail_open_does_not_hide_missing_migrations() -> TestResult {
    let db = support::empty_db().await;
    let limiter = RateLimiter::builder("unmigrated", RatePolicy::token_bucket(1.0, 1))
        .fail_open(true)
        .build(&pg_semaphore::Client::new(db.pool.clone()))?;
    let outcome = limiter.check("k", 1).await;
    assert!(
        matches!(
            outcome,
            Err(Error::Schema(
                pg_semaphore::schema::SchemaError::Missing { .. }
            ))
        ),
        "{outcome:?}"
    );
    pg_semaphore::migrate(&db.pool).await?;
    let decision = limiter.check("k", 1).await?;
    assert!(decision.allowed && !decision.failed_open);
    Ok(())
}

/// Bad input is an `InvalidArgument` naming the argument, never a panic,
/// and nothing is written.
#[tokio::test]
async fn bad_input_is_rejected_before_the_database() -> TestResult {
    let db = support::migrated_db().await;
    let pool = &db.pool;
    let argument = |result: pg_semaphore::Result<()>| match result {
        Err(Error::InvalidArgument { argument, .. }) => argument,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    let bucket = |rate: f64, burst: u32| {
        RateLimiter::builder("b", RatePolicy::token_bucket(rate, burst))
            .build(&pg_semaphore::Client::new(pool.clone()))
            .map(drop)
    };
    let fixed = |limit: u32, window: Duration| {
        RateLimiter::builder("f", RatePolicy::fixed_window(limit, window))
            .build(&pg_semaphore::Client::new(pool.clone()))
            .map(drop)
    };
    let sliding = |limit: u32, window: Duration| {
        RateLimiter::builder("s", RatePolicy::sliding_window(limit, window))
            .build(&pg_semaphore::Client::new(pool.clone()))
            .map(drop)
    };
    let huge = "x".repeat(MAX_NAME_LEN + 1);
    let builders: Vec<(&str, pg_semaphore::Result<()>)> = vec![
        ("rate", bucket(0.0, 10)),
        ("rate", bucket(-1.0, 10)),
        ("rate", bucket(f64::NAN, 10)),
        ("rate", bucket(f64::INFINITY, 10)),
        ("rate", bucket(1e300, 10)), // would overflow the refill arithmetic
        ("rate", bucket(1e-9, 10)),  // ten billion seconds to refill
        ("burst", bucket(1.0, 0)),
        (
            "name",
            RateLimiter::builder("", RatePolicy::token_bucket(1.0, 1))
                .build(&pg_semaphore::Client::new(pool.clone()))
                .map(drop),
        ),
        (
            "name",
            RateLimiter::builder(huge.as_str(), RatePolicy::token_bucket(1.0, 1))
                .build(&pg_semaphore::Client::new(pool.clone()))
                .map(drop),
        ),
        (
            "name",
            RateLimiter::builder("a\0b", RatePolicy::token_bucket(1.0, 1))
                .build(&pg_semaphore::Client::new(pool.clone()))
                .map(drop),
        ),
        ("permit_limit", fixed(0, HOUR)),
        ("window", fixed(1, Duration::ZERO)),
        ("window", fixed(1, Duration::from_micros(999))),
        ("window", fixed(1, MAX_WINDOW + Duration::from_secs(1))),
        ("window", fixed(1, Duration::MAX)),
        ("permit_limit", sliding(0, HOUR)),
        ("window", sliding(1, Duration::ZERO)),
        ("window", sliding(1, Duration::MAX)),
        (
            "name",
            RateLimiter::builder("", RatePolicy::sliding_window(1, HOUR))
                .build(&pg_semaphore::Client::new(pool.clone()))
                .map(drop),
        ),
    ];
    for (i, (expected, result)) in builders.into_iter().enumerate() {
        assert_eq!(argument(result), expected, "builder case {i}");
    }

    let long_key = "k".repeat(MAX_KEY_LEN + 1);
    for limiter in exact_trio(pool, "valid", 5, false) {
        let kind = limiter.policy().kind();
        let cases: [(&str, &str, u32); 6] = [
            ("key", "", 1),
            ("key", &long_key, 1),
            ("key", "nul\0key", 1),
            ("permits", "k", 0),
            ("permits", "k", 6),
            ("permits", "k", u32::MAX),
        ];
        for (expected, key, permits) in cases {
            let result = limiter.check(key, permits).await.map(drop);
            assert_eq!(
                argument(result),
                expected,
                "{kind}: key {key:?}, permits {permits}"
            );
        }
    }
    assert_eq!(rows(pool).await, 0, "a rejected check wrote something");
    Ok(())
}

/// Keys are data: SQL-looking, quoted, multibyte and maximal keys are
/// stored and counted exactly as given.
#[tokio::test]
async fn hostile_keys_are_stored_as_data() -> TestResult {
    let db = support::migrated_db().await;
    let widest = "é".repeat(MAX_KEY_LEN); // 512 bytes
    let name = "名".repeat(MAX_NAME_LEN); // 600 bytes
    let keys = [
        "'; DROP TABLE pgsemaphore.rate_limits; --",
        "Robert'); DELETE FROM pgsemaphore.rate_limits; --",
        "$1",
        "%_\\",
        "\"quoted\"",
        "🦀 ünïcödé",
        widest.as_str(),
    ];
    for limiters in [
        exact_trio(&db.pool, "hostile", 1, false),
        exact_trio(&db.pool, &name, 1, false),
    ] {
        for limiter in &limiters {
            for key in keys {
                assert!(
                    limiter.check(key, 1).await?.allowed,
                    "{}: {key:?}",
                    limiter.policy().kind()
                );
                assert!(
                    !limiter.check(key, 1).await?.allowed,
                    "{}: {key:?}",
                    limiter.policy().kind()
                );
            }
        }
    }
    let mut stored: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT key FROM pgsemaphore.rate_limits")
            .fetch_all(&db.pool)
            .await?;
    let mut expected: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
    stored.sort();
    expected.sort();
    assert_eq!(stored, expected);
    assert_eq!(rows(&db.pool).await, 2 * 3 * keys.len() as i64);
    Ok(())
}

/// Waiting acquires never pass the rate: 60 waiters on a key of 10 per
/// second with a burst of 5, from many tasks and two pools (two
/// processes, as far as the database can tell), are admitted at most
/// `burst + rate x d` in any `d` (at the instants `acquire` returned, with
/// 20 ms of slack for this process's scheduling, and one more for rounding),
/// and all of them within `(60 - 5) / 10` s and a margin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_acquires_are_admitted_at_the_rate_and_never_faster() -> TestResult {
    const RATE: f64 = 10.0;
    const BURST: u32 = 5;
    const WAITERS: usize = 60;
    let db = support::migrated_db().await;
    let pools = [
        support::another_pool(&db, 4).await,
        support::another_pool(&db, 4).await,
    ];
    let start = Instant::now();
    let tasks: Vec<_> = (0..WAITERS)
        .map(|i| {
            let limiter = RateLimiter::builder("waiting", RatePolicy::token_bucket(RATE, BURST))
                .build(&pg_semaphore::Client::new(pools[i % pools.len()].clone()));
            tokio::spawn(async move {
                let decision = limiter?.acquire("the-key", 1).await?;
                assert!(decision.allowed && !decision.failed_open, "{decision:?}");
                Ok::<_, Error>(Instant::now())
            })
        })
        .collect();
    let mut admitted = Vec::new();
    for task in tasks {
        admitted.push(task.await??);
    }
    admitted.sort();
    let slack = Duration::from_millis(20);
    for (i, first) in admitted.iter().enumerate() {
        for (j, last) in admitted.iter().enumerate().skip(i) {
            let span = *last - *first + slack;
            let allowed = f64::from(BURST) + RATE * span.as_secs_f64() + 1.0;
            let count = (j - i + 1) as f64;
            assert!(
                count <= allowed,
                "{count} admissions within {:?}; at most {allowed:.1} allowed",
                *last - *first
            );
        }
    }
    let took = admitted[WAITERS - 1] - start;
    let expected = Duration::from_secs_f64((WAITERS as f64 - f64::from(BURST)) / RATE);
    assert!(
        took >= expected - slack && took <= expected + Duration::from_millis(1500),
        "the last waiter was admitted after {took:?}; the rate allows it after {expected:?}"
    );
    Ok(())
}

/// A pool of 4 connections named `application` on `db`, whose function
/// calls PostgreSQL counts (`track_functions = 'all'` on the database, for
/// sessions that start after it): [`reservations_counted`] reads them.
async fn counted_pool(db: &support::TestDb, application: &str) -> sqlx::Result<PgPool> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"ALTER DATABASE "{}" SET track_functions = 'all'"#,
        db.name
    )))
    .execute(&db.pool)
    .await?;
    PgPoolOptions::new()
        .max_connections(4)
        .connect_with(db.options.clone().application_name(application))
        .await
}

/// How many times `pgsemaphore.<function>` ran in `options`' database, from the statistics of sessions that have ended (the test's
/// database tracks function calls; a backend reports its counts at exit at
/// the latest, and leaves `pg_stat_activity` after it has).
async fn reservations_counted(
    options: &PgConnectOptions,
    application: &str,
    function: &str,
) -> sqlx::Result<i64> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect_with(options).await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let running: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(application)
                .fetch_one(&mut conn)
                .await?;
        if running == 0 || Instant::now() > deadline {
            break;
        }
        sleep(Duration::from_millis(50)).await;
    }
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut conn)
        .await?;
    let calls: Option<i64> = sqlx::query_scalar(
        "SELECT sum(calls)::bigint FROM pg_stat_user_functions \
         WHERE schemaname = 'pgsemaphore' AND funcname = $1",
    )
    .bind(function)
    .fetch_one(&mut conn)
    .await?;
    Ok(calls.unwrap_or(0))
}

/// One round trip per admission: 60 waiters on one key, each waiting for
/// its turn, call `pgsemaphore.token_bucket_reserve` exactly 60 times
/// between them (counted by PostgreSQL's function statistics, on this
/// test's own database), and no check. (A reservation books at most burst /
/// rate ahead: the queue here is one burst deep, half of the waiters
/// admitted from the full bucket and half booked ahead.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_waiting_acquire_costs_one_reservation() -> TestResult {
    const WAITERS: usize = 60;
    const APPLICATION: &str = "reservation-counter";
    let db = support::migrated_db().await;
    let pools = vec![
        counted_pool(&db, APPLICATION).await?,
        counted_pool(&db, APPLICATION).await?,
    ];
    // 100 per second, a burst of 30: the second 30 queue for about 0.3 s.
    let tasks: Vec<_> = (0..WAITERS)
        .map(|i| {
            let limiter = RateLimiter::builder(
                "counted",
                RatePolicy::token_bucket(100.0, WAITERS as u32 / 2),
            )
            .build(&pg_semaphore::Client::new(pools[i % pools.len()].clone()));
            tokio::spawn(async move { limiter?.acquire("the-key", 1).await })
        })
        .collect();
    for task in tasks {
        assert!(task.await??.allowed);
    }
    for pool in &pools {
        pool.close().await;
    }
    let calls = reservations_counted(&db.options, APPLICATION, "token_bucket_reserve").await?;
    assert_eq!(calls, WAITERS as i64, "reservations for {WAITERS} waiters");
    let checks: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_user_functions \
         WHERE schemaname = 'pgsemaphore' AND funcname = 'token_bucket'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(checks, 0, "a waiting acquire made plain checks");
    Ok(())
}

/// A wait longer than the timeout is refused at once, with the semaphore's
/// timeout error, and takes nothing: a check that follows still finds the
/// tokens. A wait within the timeout is admitted.
#[tokio::test]
async fn a_wait_past_the_timeout_is_refused_at_once_and_takes_nothing() -> TestResult {
    let db = support::migrated_db().await;
    // One token per 1,000 s: the second token of a key is 1,000 s away.
    let limiter = RateLimiter::builder("slow", RatePolicy::token_bucket(0.001, 2))
        .build(&pg_semaphore::Client::new(db.pool.clone()))?;
    assert!(limiter.check("k", 1).await?.allowed);
    let timeout = Duration::from_secs(5);
    let asked = Instant::now();
    let outcome = limiter.acquire_timeout("k", 2, timeout).await;
    let took = asked.elapsed();
    match outcome {
        Err(Error::Timeout {
            waited_for: WaitedFor::RateLimit { limiter, key },
            timeout: reported,
        }) => {
            assert_eq!(
                (limiter.as_str(), key.as_str(), reported),
                ("slow", "k", timeout)
            );
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(took < timeout, "the refusal waited {took:?}");
    let decision = limiter.check("k", 1).await?;
    assert!(
        decision.allowed,
        "the refused wait took tokens: {decision:?}"
    );
    // Within the timeout: a key of 2 per second, its burst spent, admits
    // the next 500 ms after the first.
    let fast = RateLimiter::builder("fast", RatePolicy::token_bucket(2.0, 1))
        .build(&pg_semaphore::Client::new(db.pool.clone()))?;
    let asked = Instant::now();
    assert!(fast.acquire_timeout("k", 1, Duration::ZERO).await?.allowed);
    let outcome = fast.acquire_timeout("k", 1, Duration::ZERO).await;
    assert!(
        matches!(outcome, Err(Error::Timeout { .. })),
        "{outcome:?} after {:?}",
        asked.elapsed()
    );
    let decision = fast.acquire_timeout("k", 1, timeout).await?;
    assert!(decision.allowed);
    assert!(
        asked.elapsed() >= Duration::from_millis(500),
        "admitted after {:?}, before the token was refilled",
        asked.elapsed()
    );
    Ok(())
}

/// Reservations are served first: while the tokens of one are owed, a
/// plain check is refused and its retry-after counts them; the key is not
/// at rest (prune keeps it) until they are refilled.
#[tokio::test]
async fn checks_wait_behind_reservations() -> TestResult {
    let db = support::migrated_db().await;
    let reserve = "SELECT o_allowed, o_wait_us, o_remaining FROM pgsemaphore.token_bucket_reserve(\
                   p_limiter => 'r', p_key => 'k', p_rate => 10, p_burst => 1, p_n => 1, \
                   p_max_wait => '10 s')";
    let first: (bool, i64, i64) = sqlx::query_as(reserve).fetch_one(&db.pool).await?;
    assert_eq!(first, (true, 0, 0), "a full bucket admits at once");
    let second: (bool, i64, i64) = sqlx::query_as(reserve).fetch_one(&db.pool).await?;
    assert!(second.0 && second.2 == -1, "{second:?}");
    assert!((1..=100_000).contains(&second.1), "{second:?}");
    let limiter = RateLimiter::builder("r", RatePolicy::token_bucket(10.0, 1))
        .build(&pg_semaphore::Client::new(db.pool.clone()))?;
    let refused = limiter.check("k", 1).await?;
    assert!(
        !refused.allowed,
        "a check passed a reservation: {refused:?}"
    );
    assert!(
        refused.retry_after > Duration::from_millis(100),
        "the retry-after ignores the reservation: {refused:?}"
    );
    assert_eq!(
        pg_semaphore::admin::prune_rate_limits(&db.pool, Duration::ZERO).await?,
        0
    );
    sleep(refused.retry_after).await;
    assert!(limiter.check("k", 1).await?.allowed);
    Ok(())
}

/// A window limiter of `limit` per `window` named `name`: fixed or sliding.
fn window_limiter(
    pool: &PgPool,
    sliding: bool,
    name: &str,
    limit: u32,
    window: Duration,
) -> RateLimiter {
    if sliding {
        RateLimiter::builder(name, RatePolicy::sliding_window(limit, window))
            .build(&pg_semaphore::Client::new(pool.clone()))
            .expect("valid sliding window")
    } else {
        RateLimiter::builder(name, RatePolicy::fixed_window(limit, window))
            .build(&pg_semaphore::Client::new(pool.clone()))
            .expect("valid fixed window")
    }
}

/// Waiting acquires on a window never pass its limit: 40 waiters on a key
/// of 5 per 400 ms, from many tasks and two pools, are admitted in bursts as
/// the windows open, never more than 5 within any 150 ms (a fixed window's
/// waiters are admitted at its opening, one window's length apart; 150 ms
/// leaves room for this process's scheduling), never more than 10 within
/// any window's length for the sliding window (two windows of the grid),
/// and all of them within the 7 windows after the first and a margin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_window_acquires_never_pass_the_limit() -> TestResult {
    const LIMIT: u32 = 5;
    const WAITERS: usize = 40;
    const WINDOW: Duration = Duration::from_millis(400);
    let db = support::migrated_db().await;
    let pools = [
        support::another_pool(&db, 4).await,
        support::another_pool(&db, 4).await,
    ];
    for sliding in [false, true] {
        let start = Instant::now();
        let tasks: Vec<_> = (0..WAITERS)
            .map(|i| {
                let limiter =
                    window_limiter(&pools[i % pools.len()], sliding, "waiting", LIMIT, WINDOW);
                tokio::spawn(async move {
                    let decision = limiter.acquire("the-key", 1).await?;
                    assert!(decision.allowed && !decision.failed_open, "{decision:?}");
                    Ok::<_, Error>(Instant::now())
                })
            })
            .collect();
        let mut admitted = Vec::new();
        for task in tasks {
            admitted.push(task.await??);
        }
        admitted.sort();
        let (span, most) = if sliding {
            (WINDOW - Duration::from_millis(20), 2 * LIMIT as usize)
        } else {
            (Duration::from_millis(150), LIMIT as usize)
        };
        for (i, first) in admitted.iter().enumerate() {
            let within = admitted[i..]
                .iter()
                .take_while(|t| **t - *first < span)
                .count();
            assert!(
                within <= most,
                "sliding {sliding}: {within} admissions within {span:?} from the {i}th; at most {most}"
            );
        }
        let took = admitted[WAITERS - 1] - start;
        let windows = (WAITERS as u32).div_ceil(LIMIT);
        let expected = WINDOW * windows;
        assert!(
            took <= expected + Duration::from_millis(1000),
            "sliding {sliding}: the last waiter was admitted after {took:?}; expected within {expected:?}"
        );
    }
    Ok(())
}

/// One round trip per admission for the windows too: 60 waiters on one
/// key of a fixed window call `fixed_window_reserve` exactly 60 times
/// (PostgreSQL's function statistics), and no plain check. A reservation
/// books at most one window ahead: the queue here is the current window
/// and the next. A sliding window's next window is weighed with the full
/// current one, so most of its room lies more than a window ahead: its
/// waiters are refused with the instant, sleep until then and book again,
/// at most a few reservations each (still no plain check).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_waiting_window_acquire_costs_one_reservation() -> TestResult {
    const WAITERS: usize = 60;
    const APPLICATION: &str = "window-reservation-counter";
    let db = support::migrated_db().await;
    let pools = vec![
        counted_pool(&db, APPLICATION).await?,
        counted_pool(&db, APPLICATION).await?,
    ];
    // 30 per 300 ms: half of the waiters of each kind queue for the next window.
    let tasks: Vec<_> = (0..2 * WAITERS)
        .map(|i| {
            let limiter = window_limiter(
                &pools[i % pools.len()],
                i % 2 == 1,
                "counted",
                WAITERS as u32 / 2,
                Duration::from_millis(300),
            );
            tokio::spawn(async move { limiter.acquire("the-key", 1).await })
        })
        .collect();
    for task in tasks {
        assert!(task.await??.allowed);
    }
    for pool in &pools {
        pool.close().await;
    }
    let calls = reservations_counted(&db.options, APPLICATION, "fixed_window_reserve").await?;
    assert_eq!(
        calls, WAITERS as i64,
        "fixed_window_reserve calls for {WAITERS} waiters"
    );
    let calls = reservations_counted(&db.options, APPLICATION, "sliding_window_reserve").await?;
    assert!(
        (WAITERS as i64..=4 * WAITERS as i64).contains(&calls),
        "{calls} sliding_window_reserve calls for {WAITERS} waiters"
    );
    let checks: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_user_functions \
         WHERE schemaname = 'pgsemaphore' AND funcname IN ('fixed_window', 'sliding_window')",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(checks, 0, "a waiting acquire made plain checks");
    Ok(())
}

/// A window's wait longer than the timeout is refused at once, with the
/// semaphore's timeout error, and takes nothing: a check that follows still
/// finds the permit. A wait within the timeout is admitted, no earlier than
/// the next window opens.
#[tokio::test]
async fn a_window_wait_past_the_timeout_is_refused_at_once_and_takes_nothing() -> TestResult {
    let db = support::migrated_db().await;
    for sliding in [false, true] {
        let limiter = window_limiter(&db.pool, sliding, "slow", 2, HOUR);
        assert!(limiter.check("k", 1).await?.allowed);
        let timeout = Duration::from_secs(5);
        let asked = Instant::now();
        let outcome = limiter.acquire_timeout("k", 2, timeout).await;
        match outcome {
            Err(Error::Timeout {
                waited_for: WaitedFor::RateLimit { limiter, key },
                timeout: reported,
            }) => assert_eq!(
                (limiter.as_str(), key.as_str(), reported),
                ("slow", "k", timeout)
            ),
            other => panic!("sliding {sliding}: expected a timeout, got {other:?}"),
        }
        assert!(
            asked.elapsed() < timeout,
            "the refusal waited {:?}",
            asked.elapsed()
        );
        let decision = limiter.check("k", 1).await?;
        assert!(
            decision.allowed,
            "sliding {sliding}: the refused wait took permits: {decision:?}"
        );

        let fast = window_limiter(&db.pool, sliding, "fast", 1, Duration::from_millis(500));
        let asked = Instant::now();
        assert!(fast.acquire_timeout("k", 1, Duration::ZERO).await?.allowed);
        let outcome = fast.acquire_timeout("k", 1, Duration::ZERO).await;
        assert!(matches!(outcome, Err(Error::Timeout { .. })), "{outcome:?}");
        assert!(fast.acquire_timeout("k", 1, timeout).await?.allowed);
        assert!(
            asked.elapsed() >= Duration::from_millis(500),
            "sliding {sliding}: admitted after {:?}, before the next window",
            asked.elapsed()
        );
    }
    Ok(())
}

/// Bookings are served first: while a window booked ahead has not opened,
/// a plain check is refused and its retry-after reaches that window; once
/// it opens, its permits are counted there (the booked window is full, so
/// the check waits for the one after); the key is not at rest (prune keeps
/// it) while bookings are outstanding.
#[tokio::test]
async fn checks_wait_behind_window_bookings() -> TestResult {
    let db = support::migrated_db().await;
    for (function, kind) in [
        ("fixed_window_reserve", false),
        ("sliding_window_reserve", true),
    ] {
        let reserve = format!(
            "SELECT o_allowed, o_wait_us, o_remaining FROM pgsemaphore.{function}(\
             p_limiter => 'r', p_key => 'k', p_limit => 1, p_window => '300 ms', p_n => 1, \
             p_max_wait => '10 s')"
        );
        let first: (bool, i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(reserve.clone()))
            .fetch_one(&db.pool)
            .await?;
        assert_eq!(
            first,
            (true, 0, 0),
            "{function}: an empty window admits at once"
        );
        let second: (bool, i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(reserve.clone()))
            .fetch_one(&db.pool)
            .await?;
        if kind {
            // A sliding window's next window still counts the current one's
            // permit: room only two windows ahead, beyond the one-window
            // bound of a reservation.
            assert!(
                !second.0 && second.1 > 300_000,
                "{function}: booked beyond one window: {second:?}"
            );
            continue;
        }
        assert!(
            second.0 && (1..=300_000).contains(&second.1),
            "{function}: {second:?}"
        );
        let limiter = window_limiter(&db.pool, kind, "r", 1, Duration::from_millis(300));
        let refused = limiter.check("k", 1).await?;
        assert!(
            !refused.allowed,
            "{function}: a check passed a booking: {refused:?}"
        );
        assert!(
            refused.retry_after
                >= Duration::from_micros(second.1 as u64) - Duration::from_millis(50),
            "{function}: the retry-after ignores the booking: {refused:?}, booked in {} us",
            second.1
        );
        assert_eq!(
            pg_semaphore::admin::prune_rate_limits(&db.pool, Duration::ZERO).await?,
            0
        );
        // The booked window opens: its permit is the booking's.
        sleep(Duration::from_micros(second.1 as u64)).await;
        let after = limiter.check("k", 1).await?;
        assert!(
            !after.allowed,
            "{function}: the booked window admitted a check too: {after:?}"
        );
    }
    Ok(())
}

/// The handles and futures can be shared across tasks.
#[test]
fn limiters_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<RateLimiter>();
    send_sync::<Decision>();
    #[allow(dead_code)]
    async fn futures(limiter: RateLimiter, pool: PgPool) {
        send(&limiter.check("k", 1));
        send(&limiter.acquire("k", 1));
        send(&limiter.acquire_timeout("k", 1, HOUR));
        send(&limiter.pause("k", HOUR));
        send(&limiter.pause_all(HOUR));
        send(&pg_semaphore::admin::prune_rate_limits(&pool, HOUR));
    }
}

/// A queue deeper than a reservation may book (burst / rate, one window):
/// 40 waiters of one handle (and its clones), 5 per 100 ms, so the last is
/// admitted about 0.8 s after the first, while a reservation reaches at most
/// 100 ms ahead. The handle's waiters ask the database one at a time, in
/// line, so the refused ones do not all come back at each instant: at most
/// 2 reservations per admission, for the token bucket and the fixed window
/// (without the line every refused waiter came back at every instant: 149
/// token bucket reservations for the 40 waiters, in the run that checked
/// this test fails without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_deeper_than_a_reservation_costs_at_most_two_per_admission() -> TestResult {
    const WAITERS: usize = 40;
    const APPLICATION: &str = "deep-queue-counter";
    let db = support::migrated_db().await;
    let pool = counted_pool(&db, APPLICATION).await?;
    let bucket = RateLimiter::builder("deep-bucket", RatePolicy::token_bucket(50.0, 5))
        .build(&pg_semaphore::Client::new(pool.clone()))?;
    let window = RateLimiter::builder(
        "deep-window",
        RatePolicy::fixed_window(5, Duration::from_millis(100)),
    )
    .build(&pg_semaphore::Client::new(pool.clone()))?;
    let mut tasks = Vec::new();
    for _ in 0..WAITERS {
        let bucket = bucket.clone();
        tasks.push(tokio::spawn(async move {
            bucket
                .acquire_timeout("k", 1, Duration::from_secs(20))
                .await
                .map(|d| d.allowed)
        }));
        let window = window.clone();
        tasks.push(tokio::spawn(async move {
            window
                .acquire_timeout("k", 1, Duration::from_secs(20))
                .await
                .map(|d| d.allowed)
        }));
    }
    for task in tasks {
        assert!(task.await??);
    }
    drop((bucket, window));
    pool.close().await;
    for function in ["token_bucket_reserve", "fixed_window_reserve"] {
        let calls = reservations_counted(&db.options, APPLICATION, function).await?;
        assert!(
            (WAITERS as i64..=2 * WAITERS as i64).contains(&calls),
            "{calls} {function} calls for {WAITERS} waiters"
        );
    }
    Ok(())
}

/// A key's trim (every 16th admission deletes the rows 16 to 32 behind) keeps
/// its plan for the session. Planned while the ledger is a page (as in this
/// new database), it must still not read the table sequentially: while a
/// transaction holds the xmin horizon no deleted row can go, and a
/// sequential scan then reads every one, at every trim, under the key's
/// lock (the held-query stall of BENCHMARKS.md, workload 12). Counted in
/// this transaction's statistics: 33 admissions, two trims, no sequential
/// scan of the ledger.
#[tokio::test]
async fn a_trim_never_scans_the_ledger() -> TestResult {
    let db = support::migrated_db().await;
    let mut conn = db.pool.acquire().await?;
    sqlx::query("BEGIN").execute(&mut *conn).await?;
    let before = ledger_seq_scans(&mut conn).await?;
    for _ in 0..33 {
        let allowed: bool = sqlx::query_scalar(
            "SELECT o_allowed FROM pgsemaphore.token_bucket('trim', 'k', 1000, 1000, 1)",
        )
        .fetch_one(&mut *conn)
        .await?;
        assert!(allowed, "a bucket of 1,000 admits 33");
    }
    let after = ledger_seq_scans(&mut conn).await?;
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.rate_ledger WHERE key = 'k'")
            .fetch_one(&mut *conn)
            .await?;
    assert!(rows < 33, "the trims ran: {rows} rows left of 33");
    assert_eq!(after - before, 0, "a trim read the ledger sequentially");
    sqlx::query("ROLLBACK").execute(&mut *conn).await?;
    Ok(())
}

/// A check's read of its key's newest row keeps its plan for the session.
/// Planned after an ANALYZE that found a few live rows, all of one key, in
/// a table whose index is ten times its size (here: 200,000 rows deleted
/// and vacuumed, then 10,000 of which the newest 8 stay; in the bench, a
/// hot key's trims and a vacuum), it must still not be a
/// sequential scan and a sort of the whole table: a
/// check would read every page, and with the xmin horizon held every dead
/// row too (BENCHMARKS.md, workload 12).
#[tokio::test]
async fn no_check_scans_the_ledger() -> TestResult {
    let db = support::migrated_db().await;
    // A vacuumed table beside its larger index, as a busy key's leaves them:
    // the planner then prices the index above a scan of the heap.
    for sql in [
        "INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, tokens, stamp, idle_at) \
           SELECT 'token_bucket', 'scan', 'k', g, 1, now(), now() \
             FROM generate_series(1, 200000) g",
        "DELETE FROM pgsemaphore.rate_ledger",
        "VACUUM pgsemaphore.rate_ledger",
        "INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, tokens, stamp, idle_at) \
           SELECT 'token_bucket', 'scan', 'k', g, 1, now(), now() \
             FROM generate_series(200001, 210000) g",
        "DELETE FROM pgsemaphore.rate_ledger WHERE seq <= 209992",
        "ANALYZE pgsemaphore.rate_ledger",
    ] {
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(&db.pool).await?;
    }
    let mut conn = db.pool.acquire().await?;
    sqlx::query("BEGIN").execute(&mut *conn).await?;
    let before = ledger_seq_scans(&mut conn).await?;
    for _ in 0..3 {
        sqlx::query("SELECT o_allowed FROM pgsemaphore.token_bucket('scan', 'k', 1000, 1000, 1)")
            .execute(&mut *conn)
            .await?;
    }
    let after = ledger_seq_scans(&mut conn).await?;
    assert_eq!(after - before, 0, "a check read the ledger sequentially");
    sqlx::query("ROLLBACK").execute(&mut *conn).await?;
    Ok(())
}

/// The sequential scans of the ledger this transaction has made so far.
/// Tests count before and after what they check: PostgreSQL 15's
/// per-transaction counts can still hold this session's earlier statements
/// (a migration's index builds, a test's setup, count as sequential scans).
async fn ledger_seq_scans(conn: &mut sqlx::PgConnection) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT seq_scan FROM pg_stat_xact_user_tables \
          WHERE relid = 'pgsemaphore.rate_ledger'::regclass",
    )
    .fetch_one(conn)
    .await
}
