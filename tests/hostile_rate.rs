//! Hostile callers of the rate limiters (issue 32, attacks 1, 3 and 4), each
//! run as the application role with exactly the guide's grants and as a
//! role with no grants at all:
//!
//! 1. a caller passing other limits decides nothing for anyone else: a
//!    limiter's limits are stored by its first use and only the operator
//!    changes them;
//! 3. a reservation books no further ahead than the limits in force allow
//!    (burst / rate, one window), and no argument at its extreme overflows
//!    or bricks a key;
//! 4. a held key lock (a check left in an open transaction, or any session
//!    taking the documented advisory key) stalls a check for at most the
//!    functions' bound, answered as [`Error::Stalled`], and waiting
//!    acquires retry through it.

mod support;

use std::sync::Arc;
use std::time::Duration;

use pg_semaphore::{Error, LimiterSet, RateLimiter, RatePolicy};
use sqlx::{AssertSqlSafe, PgPool};
use support::TestResult;
use support::roles::Roles;

/// The advisory key space of the rate limiters' key locks (the migration's
/// header documents it).
const RATE_LOCK_SPACE: i32 = 1_885_828_967;

/// The pools a test body gets: the application's, the operator's and the
/// role's with no grants (the attacker's), and the owner's (`db.pool`).
struct Pools {
    db: Arc<support::MigratedDb>,
    app: PgPool,
    operator: PgPool,
    nobody: PgPool,
}

/// Runs `body`, then drops the roles whatever happened.
async fn with_roles<F, Fut>(body: F) -> TestResult
where
    F: FnOnce(Pools) -> Fut,
    Fut: std::future::Future<Output = TestResult>,
{
    let db = Arc::new(support::migrated_db().await);
    let roles = Roles::documented(&db, &["nobody"]).await?;
    let app = roles.pool(&db, "app").await?;
    let operator = roles.pool(&db, "op").await?;
    let nobody = roles.pool(&db, "nobody").await?;
    let result = body(Pools {
        db: db.clone(),
        app: app.clone(),
        operator: operator.clone(),
        nobody: nobody.clone(),
    })
    .await;
    app.close().await;
    operator.close().await;
    nobody.close().await;
    roles.drop_all().await?;
    result
}

/// The SQLSTATE of a database error (`None` for success or another error).
fn sqlstate<T>(result: &sqlx::Result<T>) -> Option<String> {
    match result {
        Err(error) => error
            .as_database_error()
            .and_then(|e| e.code())
            .map(|c| c.into_owned()),
        Ok(_) => None,
    }
}

/// One attacking call of each kind on key `acme` of the three limiters:
/// limits that would reset or fill another tenant's state.
const RESETS: [&str; 4] = [
    "SELECT o_allowed FROM pgsemaphore.fixed_window('tenant-fixed', 'acme', 1000000, '1 ms', 1)",
    "SELECT o_allowed FROM pgsemaphore.sliding_window('tenant-sliding', 'acme', 1000000, '1 ms', 1)",
    "SELECT o_allowed FROM pgsemaphore.token_bucket('tenant-bucket', 'acme', 3.2e7, 1e15, 1)",
    "SELECT o_allowed FROM pgsemaphore.check_limits(ARRAY['fixed_window', 'sliding_window', 'token_bucket'], \
         ARRAY['tenant-fixed', 'tenant-sliding', 'tenant-bucket'], ARRAY['acme', 'acme', 'acme'], \
         ARRAY[NULL, NULL, 3.2e7]::float8[], ARRAY[NULL, NULL, 1e15]::float8[], \
         ARRAY[1000000, 1000000, NULL]::bigint[], ARRAY['1 ms', '1 ms', NULL]::interval[], 1)",
];

/// The honest tenant's three limiters (3 per hour each), their key `acme`
/// used up.
async fn honest_limiters_used_up(
    app: &PgPool,
) -> Result<(RateLimiter, RateLimiter, RateLimiter), support::BoxError> {
    let fixed = RateLimiter::builder(
        "tenant-fixed",
        RatePolicy::fixed_window(3, Duration::from_secs(3600)),
    )
    .build(&pg_semaphore::Client::new(app.clone()))?;
    let sliding = RateLimiter::builder(
        "tenant-sliding",
        RatePolicy::sliding_window(3, Duration::from_secs(3600)),
    )
    .build(&pg_semaphore::Client::new(app.clone()))?;
    let bucket = RateLimiter::builder("tenant-bucket", RatePolicy::token_bucket(3.0 / 3600.0, 3))
        .build(&pg_semaphore::Client::new(app.clone()))?;
    for _ in 0..3 {
        assert!(fixed.check("acme", 1).await?.allowed);
        assert!(sliding.check("acme", 1).await?.allowed);
        assert!(bucket.check("acme", 1).await?.allowed);
    }
    Ok((fixed, sliding, bucket))
}

async fn all_refused(
    (fixed, sliding, bucket): &(RateLimiter, RateLimiter, RateLimiter),
) -> Result<bool, support::BoxError> {
    Ok(!fixed.check("acme", 1).await?.allowed
        && !sliding.check("acme", 1).await?.allowed
        && !bucket.check("acme", 1).await?.allowed)
}

// ---------------------------------------------------------------------------
// 1. Limits belong to the database
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_passing_other_limits_cannot_reset_another_tenants_key_as_the_application()
-> TestResult {
    with_roles(|p| async move {
        let honest = honest_limiters_used_up(&p.app).await?;
        assert!(all_refused(&honest).await?);
        // The same role, other limits, again and again: each call is
        // decided under the stored ones (so refused), and resets nothing.
        for _ in 0..3 {
            for attack in RESETS {
                let (allowed,): (bool,) = sqlx::query_as(AssertSqlSafe(attack))
                    .fetch_one(&p.app)
                    .await?;
                assert!(!allowed, "decided under the caller's limits: {attack}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            all_refused(&honest).await?,
            "an attacker's limits rolled the window or filled the bucket"
        );
        // The limits stored by the first use are the honest tenant's.
        type Pair = (String, Option<f64>, Option<f64>, Option<i64>);
        let stored: Vec<Pair> = sqlx::query_as(
            "SELECT kind, rate, burst, permit_limit FROM pgsemaphore.rate_limit_settings
              WHERE key = '' ORDER BY kind",
        )
        .fetch_all(&p.db.pool)
        .await?;
        assert_eq!(
            stored,
            vec![
                ("fixed_window".into(), None, None, Some(3)),
                ("sliding_window".into(), None, None, Some(3)),
                ("token_bucket".into(), Some(3.0 / 3600.0), Some(3.0), None),
            ]
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_grants_cannot_reset_another_tenants_key() -> TestResult {
    with_roles(|p| async move {
        let honest = honest_limiters_used_up(&p.app).await?;
        for attack in RESETS {
            let result = sqlx::query_as::<_, (bool,)>(AssertSqlSafe(attack))
                .fetch_one(&p.nobody)
                .await;
            assert_eq!(
                sqlstate(&result).as_deref(),
                Some("42501"),
                "{attack}: {result:?}"
            );
        }
        // Nor store limits of its own for a limiter nobody used yet.
        let result = sqlx::query_as::<_, (bool,)>(
            "SELECT o_allowed FROM pgsemaphore.fixed_window('unused', 'acme', 1000000, '1 ms', 1)",
        )
        .fetch_one(&p.nobody)
        .await;
        assert_eq!(sqlstate(&result).as_deref(), Some("42501"), "{result:?}");
        assert!(all_refused(&honest).await?);
        Ok(())
    })
    .await
}

#[tokio::test]
async fn two_deployed_versions_with_different_limits_both_decide_under_the_stored_pair()
-> TestResult {
    let db = support::migrated_db().await;
    let old = RateLimiter::builder(
        "rolling",
        RatePolicy::fixed_window(2, Duration::from_secs(3600)),
    )
    .build(&db.client)?;
    let new = RateLimiter::builder(
        "rolling",
        RatePolicy::fixed_window(100, Duration::from_millis(1)),
    )
    .build(&db.client)?;
    assert!(old.check("k", 1).await?.allowed); // the first use stores 2 per hour
    assert!(new.check("k", 1).await?.allowed);
    tokio::time::sleep(Duration::from_millis(5)).await;
    // The new version's 1 ms window would have rolled the key: it is still
    // the first hour's, full.
    assert!(!new.check("k", 1).await?.allowed);
    assert!(!old.check("k", 1).await?.allowed);
    // Only the operator changes the pair; then every version applies it.
    pg_semaphore::admin::set_rate_limit(
        &db.pool,
        "rolling",
        None,
        RatePolicy::fixed_window(3, Duration::from_secs(3600)),
    )
    .await?;
    assert!(old.check("k", 1).await?.allowed);
    assert!(!new.check("k", 1).await?.allowed);
    Ok(())
}

#[tokio::test]
async fn a_cleared_limiter_stores_the_next_callers_pair() -> TestResult {
    let db = support::migrated_db().await;
    let first =
        RateLimiter::builder("cleared", RatePolicy::token_bucket(1.0, 2)).build(&db.client)?;
    let second =
        RateLimiter::builder("cleared", RatePolicy::token_bucket(5.0, 9)).build(&db.client)?;
    assert_eq!(first.check("k", 1).await?.remaining, 1);
    assert!(
        pg_semaphore::admin::clear_rate_limit(
            &db.pool,
            pg_semaphore::admin::LimiterKind::TokenBucket,
            "cleared",
            None
        )
        .await?
    );
    // The next check after a clear is a first use again: its pair is stored.
    assert!(second.check("other", 1).await?.allowed);
    let (rate, burst): (f64, f64) = sqlx::query_as(
        "SELECT rate, burst FROM pgsemaphore.rate_limit_settings
          WHERE kind = 'token_bucket' AND limiter = 'cleared' AND key = ''",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!((rate, burst), (5.0, 9.0));
    Ok(())
}

#[tokio::test]
async fn a_key_with_state_and_no_stored_pair_keeps_its_state_and_stores_the_pair_at_its_next_check()
-> TestResult {
    let db = support::migrated_db().await;
    // A key as an upgrade leaves it: a full window, no stored pair.
    sqlx::query(
        "INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, hits, stamp, idle_at)
         VALUES ('fixed_window', 'upgraded', 'k', 1, 2, now(), now() + interval '1 hour')",
    )
    .execute(&db.pool)
    .await?;
    let limiter = RateLimiter::builder(
        "upgraded",
        RatePolicy::fixed_window(2, Duration::from_secs(3600)),
    )
    .build(&db.client)?;
    assert!(!limiter.check("k", 1).await?.allowed, "the state was lost");
    let (limit,): (i64,) = sqlx::query_as(
        "SELECT permit_limit FROM pgsemaphore.rate_limit_settings
          WHERE kind = 'fixed_window' AND limiter = 'upgraded' AND key = ''",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(limit, 2);
    Ok(())
}

// ---------------------------------------------------------------------------
// 3. Reservations within the limits in force; no overflow
// ---------------------------------------------------------------------------

/// Reservations of a whole limit with the longest wait the functions take.
const BOOKINGS: [&str; 3] = [
    "SELECT o_allowed FROM pgsemaphore.token_bucket_reserve('tenant-bucket', 'acme', 3.2e7, 1e15, 3, '366 days')",
    "SELECT o_allowed FROM pgsemaphore.fixed_window_reserve('tenant-fixed', 'acme', 1000000, '366 days', 3, '366 days')",
    "SELECT o_allowed FROM pgsemaphore.sliding_window_reserve('tenant-sliding', 'acme', 1000000, '366 days', 3, '366 days')",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_books_no_further_ahead_than_the_limits_in_force_as_the_application()
-> TestResult {
    with_roles(|p| async move {
        let honest = honest_limiters_used_up(&p.app).await?;
        let mut admitted = [0; 3];
        for _ in 0..20 {
            for (i, booking) in BOOKINGS.iter().enumerate() {
                let (allowed,): (bool,) = sqlx::query_as(AssertSqlSafe(*booking))
                    .fetch_one(&p.app)
                    .await?;
                admitted[i] += usize::from(allowed);
            }
        }
        // One whole limit ahead at most: one booking of 3 in a bucket of 3
        // (burst / rate ahead), one in the next window of a fixed window,
        // none beyond the next window for a sliding one (its next window
        // still counts the current one's 3 until it has passed).
        assert!(admitted.iter().all(|&n| n <= 1), "{admitted:?}");
        // The honest tenant is refused for at most two limits' worth: the
        // current one and the one booked ahead (a sliding window: three).
        let hour = Duration::from_secs(3600);
        let (fixed, sliding, bucket) = &honest;
        let waits = [
            bucket.check("acme", 1).await?.retry_after,
            fixed.check("acme", 1).await?.retry_after,
            sliding.check("acme", 1).await?.retry_after,
        ];
        assert!(waits[0] <= 2 * hour, "{waits:?}");
        assert!(waits[1] <= 2 * hour, "{waits:?}");
        assert!(waits[2] <= 3 * hour, "{waits:?}");
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_grants_cannot_book_another_tenants_key() -> TestResult {
    with_roles(|p| async move {
        let honest = honest_limiters_used_up(&p.app).await?;
        for booking in BOOKINGS {
            let result = sqlx::query_as::<_, (bool,)>(AssertSqlSafe(booking))
                .fetch_one(&p.nobody)
                .await;
            assert_eq!(
                sqlstate(&result).as_deref(),
                Some("42501"),
                "{booking}: {result:?}"
            );
        }
        // The fixed window's next window is free: a check waits for it.
        let wait = honest.0.check("acme", 1).await?.retry_after;
        assert!(wait <= Duration::from_secs(3600), "{wait:?}");
        Ok(())
    })
    .await
}

/// Every call of `sql` on the application's pool: admitted, refused, or
/// 22023 when `n_may_exceed` (p_n above a lowered stored limit); never an
/// overflow (22003), a datetime out of range (22008) or another error.
async fn no_overflow(app: &PgPool, sql: &str, n_may_exceed: bool) -> TestResult {
    let result = sqlx::query_as::<_, (bool,)>(AssertSqlSafe(sql.to_owned()))
        .fetch_one(app)
        .await;
    match sqlstate(&result).as_deref() {
        None => {
            result?;
        }
        Some("22023") if n_may_exceed => {}
        other => panic!("{sql}: {other:?} {result:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_argument_at_its_extreme_overflows_or_bricks_a_key() -> TestResult {
    with_roles(|p| async move {
        // A bucket: the widest pairs (rate 1e9 or the slowest that refills
        // within 366 days; burst 1e15 or 1), n 1 or the whole burst, the
        // longest wait; then the operator swaps for the opposite extreme,
        // and the key must still answer.
        let slow = 1.0 / (366.0 * 86400.0) * 1.000_001;
        let buckets = [(1e9, 1e15), (slow, 1.0), (1e9, 1.0), (slow * 1e15, 1e15)];
        for (i, &(rate, burst)) in buckets.iter().enumerate() {
            let limiter = format!("extreme-bucket-{i}");
            for n in [1.0, burst] {
                for wait in ["0", "366 days"] {
                    for _ in 0..3 {
                        no_overflow(
                            &p.app,
                            &format!(
                                "SELECT o_allowed FROM pgsemaphore.token_bucket_reserve('{limiter}', 'k', \
                                 {rate:e}, {burst:e}, {n:e}, '{wait}')"
                            ),
                            false,
                        )
                        .await?;
                    }
                }
            }
            for &(rate2, burst2) in &buckets {
                sqlx::query(
                    "SELECT pgsemaphore.set_rate_limit('token_bucket', $1, NULL, $2, $3, NULL, NULL)",
                )
                .bind(&limiter)
                .bind(rate2)
                .bind(burst2)
                .execute(&p.operator)
                .await?;
                for n in [1.0, burst] {
                    no_overflow(
                        &p.app,
                        &format!(
                            "SELECT o_allowed FROM pgsemaphore.token_bucket_reserve('{limiter}', 'k', \
                             {rate:e}, {burst:e}, {n:e}, '366 days')"
                        ),
                        n > burst2,
                    )
                    .await?;
                    no_overflow(
                        &p.app,
                        &format!(
                            "SELECT o_allowed FROM pgsemaphore.token_bucket('{limiter}', 'k', \
                             {rate:e}, {burst:e}, {n:e})"
                        ),
                        n > burst2,
                    )
                    .await?;
                }
            }
        }
        // Windows: limit 1 or 1e15, window 1 ms or 366 days, n 1 or the
        // whole limit, wait 0 or the longest; then the opposite extremes.
        let windows = [
            (1_i64, "1 ms"),
            (1_000_000_000_000_000, "1 ms"),
            (1, "366 days"),
            (1_000_000_000_000_000, "366 days"),
        ];
        for kind in ["fixed_window", "sliding_window"] {
            for (i, &(limit, window)) in windows.iter().enumerate() {
                let limiter = format!("extreme-{kind}-{i}");
                for n in [1, limit] {
                    for wait in ["0", "366 days"] {
                        for _ in 0..3 {
                            no_overflow(
                                &p.app,
                                &format!(
                                    "SELECT o_allowed FROM pgsemaphore.{kind}_reserve('{limiter}', 'k', \
                                     {limit}, '{window}', {n}, '{wait}')"
                                ),
                                false,
                            )
                            .await?;
                        }
                    }
                }
                for &(limit2, window2) in &windows {
                    sqlx::query(
                        "SELECT pgsemaphore.set_rate_limit($1, $2, NULL, NULL, NULL, $3, $4::interval)",
                    )
                    .bind(kind)
                    .bind(&limiter)
                    .bind(limit2)
                    .bind(window2)
                    .execute(&p.operator)
                    .await?;
                    for n in [1, limit] {
                        no_overflow(
                            &p.app,
                            &format!(
                                "SELECT o_allowed FROM pgsemaphore.{kind}('{limiter}', 'k', {limit}, '{window}', {n})"
                            ),
                            n > limit2,
                        )
                        .await?;
                    }
                }
            }
            // A limit the arithmetic cannot hold is refused, naming it.
            let result = sqlx::query_as::<_, (bool,)>(AssertSqlSafe(format!(
                "SELECT o_allowed FROM pgsemaphore.{kind}('huge', 'k', 9223372036854775807, '1 s', 1)"
            )))
            .fetch_one(&p.app)
            .await;
            assert_eq!(sqlstate(&result).as_deref(), Some("22023"), "{result:?}");
        }
        // The brick: a bucket booked a year deep under a large pair,
        // then an operator's slowest pair; every later check still answers.
        let honest = RateLimiter::builder("bricked", RatePolicy::token_bucket(1e9, u32::MAX))
            .build(&pg_semaphore::Client::new(p.app.clone()))?;
        assert!(honest.check("k", 1).await?.allowed);
        for _ in 0..5 {
            no_overflow(
                &p.app,
                "SELECT o_allowed FROM pgsemaphore.token_bucket_reserve('bricked', 'k', 1e9, 4294967295, 4294967295, '366 days')",
                false,
            )
            .await?;
        }
        pg_semaphore::admin::set_rate_limit(&p.db.pool, "bricked", None, RatePolicy::token_bucket(slow, 1))
        .await?;
        let decision = honest.check("k", 1).await?;
        assert!(!decision.allowed);
        assert!(
            decision.retry_after <= Duration::from_secs_f64(2.0 / slow + 1.0),
            "{decision:?}"
        );
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------
// 4. Every wait is bounded
// ---------------------------------------------------------------------------

/// What a check must answer well before this: the functions' bound is 2 s;
/// a check still waiting then waits for the holder.
const LIVENESS: Duration = Duration::from_secs(30);

/// `pool`'s session that took the key lock of `kind/limiter/key`, as any
/// role may, and holds it until dropped or unlocked.
async fn hold_key_lock(
    pool: &PgPool,
    kind: &str,
    limiter: &str,
    key: &str,
) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, support::BoxError> {
    let mut session = pool.acquire().await?;
    sqlx::query("SELECT pg_advisory_lock($1, hashtext($2))")
        .bind(RATE_LOCK_SPACE)
        .bind(format!("{kind}/{limiter}/{key}"))
        .execute(&mut *session)
        .await?;
    Ok(session)
}

async fn a_held_key_lock_stalls_checks_for_at_most_the_bound(
    holder: &PgPool,
    app: &PgPool,
) -> TestResult {
    let bucket = RateLimiter::builder("stalled", RatePolicy::token_bucket(100.0, 100))
        .build(&pg_semaphore::Client::new(app.clone()))?;
    let window = RateLimiter::builder(
        "stalled-window",
        RatePolicy::fixed_window(100, Duration::from_secs(60)),
    )
    .build(&pg_semaphore::Client::new(app.clone()))?;
    assert!(bucket.check("k", 1).await?.allowed);
    assert!(window.check("k", 1).await?.allowed);
    let mut held = hold_key_lock(holder, "token_bucket", "stalled", "k").await?;
    // A plain check answers Stalled, naming the limiter.
    let error = tokio::time::timeout(LIVENESS, bucket.check("k", 1))
        .await
        .expect("a check waited for the key lock without bound")
        .expect_err("the key is held");
    assert!(
        matches!(&error, Error::Stalled { semaphore } if semaphore == "stalled"),
        "{error:?}"
    );
    // So does a set's check naming the key, and nothing of the set is taken.
    let set = LimiterSet::new().with(&window).with(&bucket);
    let error = tokio::time::timeout(LIVENESS, set.check("k", 1))
        .await
        .expect("a set's check waited for the key lock without bound")
        .expect_err("the key is held");
    assert!(matches!(error, Error::Stalled { .. }), "{error:?}");
    // The SQL answer is 55P03, for the reservations too.
    let result = tokio::time::timeout(
        LIVENESS,
        sqlx::query_as::<_, (bool,)>(
            "SELECT o_allowed FROM pgsemaphore.token_bucket_reserve('stalled', 'k', 100, 100, 1, '1 s')",
        )
        .fetch_one(app),
    )
    .await
    .expect("a reservation waited without bound");
    assert_eq!(sqlstate(&result).as_deref(), Some("55P03"), "{result:?}");
    // A waiting acquire retries through the stall and is admitted once the
    // lock is let go.
    let waiter = {
        let bucket = bucket.clone();
        tokio::spawn(async move { bucket.acquire_timeout("k", 1, LIVENESS).await })
    };
    tokio::time::sleep(Duration::from_millis(2500)).await;
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut *held)
        .await?;
    let decision = waiter.await??;
    assert!(decision.allowed);
    // The set's own keys were charged by nothing while stalled: the window
    // key still has its first permit only (and the acquire's bucket).
    let (hits,): (i64,) = sqlx::query_as(
        "SELECT hits FROM pgsemaphore.rate_limits WHERE kind = 'fixed_window' AND limiter = 'stalled-window'",
    )
    .fetch_one(app)
    .await?;
    assert_eq!(hits, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_grants_stalls_a_keys_checks_for_at_most_the_bound() -> TestResult {
    with_roles(|p| async move {
        a_held_key_lock_stalls_checks_for_at_most_the_bound(&p.nobody, &p.app).await
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_holding_a_key_lock_stalls_its_checks_for_at_most_the_bound() -> TestResult
{
    with_roles(|p| async move {
        a_held_key_lock_stalls_checks_for_at_most_the_bound(&p.app, &p.app).await?;
        // A check left in an open transaction holds its key's lock too.
        let mut open = p.app.begin().await?;
        sqlx::query(
            "SELECT * FROM pgsemaphore.fixed_window('stalled-window', 'k', 100, '60 s', 1)",
        )
        .execute(&mut *open)
        .await?;
        let window = RateLimiter::builder(
            "stalled-window",
            RatePolicy::fixed_window(100, Duration::from_secs(60)),
        )
        .build(&pg_semaphore::Client::new(p.app.clone()))?;
        let error = tokio::time::timeout(LIVENESS, window.check("k", 1))
            .await
            .expect("a check waited for an open transaction without bound")
            .expect_err("the key is held");
        assert!(matches!(error, Error::Stalled { .. }), "{error:?}");
        open.rollback().await?;
        assert!(window.check("k", 1).await?.allowed);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_change_waits_at_most_the_bound_for_an_applications_open_transaction()
-> TestResult {
    with_roles(|p| async move {
        let bucket = RateLimiter::builder("paused", RatePolicy::token_bucket(1.0, 5))
            .build(&pg_semaphore::Client::new(p.app.clone()))?;
        assert!(bucket.check("k", 1).await?.allowed);
        // The application pauses the limiter and leaves the transaction
        // open: it holds the settings row.
        let mut open = p.app.begin().await?;
        sqlx::query("SELECT pgsemaphore.pause_rate_limit('token_bucket', 'paused', NULL, '1 s')")
            .execute(&mut *open)
            .await?;
        let calls = [
            "SELECT true FROM pgsemaphore.set_rate_limit('token_bucket', 'paused', NULL, 2, 5, NULL, NULL)",
            "SELECT pgsemaphore.clear_rate_limit('token_bucket', 'paused', NULL)",
        ];
        for call in calls {
            let result = tokio::time::timeout(
                LIVENESS,
                sqlx::query_as::<_, (bool,)>(AssertSqlSafe(call)).fetch_one(&p.operator),
            )
            .await
            .expect("an operator function waited without bound");
            assert_eq!(sqlstate(&result).as_deref(), Some("55P03"), "{call}: {result:?}");
        }
        // And another process's pause of the same limiter.
        let result = tokio::time::timeout(
            LIVENESS,
            sqlx::query_as::<_, (bool,)>(
                "SELECT pgsemaphore.pause_rate_limit('token_bucket', 'paused', NULL, '1 s') IS NOT NULL",
            )
            .fetch_one(&p.app),
        )
        .await
        .expect("a pause waited without bound");
        assert_eq!(sqlstate(&result).as_deref(), Some("55P03"), "{result:?}");
        // Through the crate: Error::Stalled, naming the limiter.
        let error = tokio::time::timeout(
            LIVENESS,
            pg_semaphore::admin::set_rate_limit(&p.operator, "paused", None, RatePolicy::token_bucket(2.0, 5)),
        )
        .await
        .expect("set_rate_limit waited without bound")
        .expect_err("the settings row is held");
        assert!(
            matches!(&error, Error::Stalled { semaphore } if semaphore == "paused"),
            "{error:?}"
        );
        let error = tokio::time::timeout(LIVENESS, bucket.pause_all(Duration::from_secs(1)))
            .await
            .expect("a pause waited without bound")
            .expect_err("the settings row is held");
        assert!(matches!(error, Error::Stalled { .. }), "{error:?}");
        // A resume finds no committed pause to end, so it locks nothing:
        // it answers at once (or, had it to wait, within the bound).
        let resume = "SELECT pgsemaphore.resume_rate_limit('token_bucket', 'paused', NULL)";
        let result = tokio::time::timeout(
            LIVENESS,
            sqlx::query_as::<_, (bool,)>(resume).fetch_one(&p.operator),
        )
        .await
        .expect("a resume waited without bound");
        assert!(
            result.is_ok() || sqlstate(&result).as_deref() == Some("55P03"),
            "{result:?}"
        );
        open.rollback().await?;
        // Without grants, none of them runs at all.
        for call in calls.into_iter().chain([resume]) {
            let result = sqlx::query_as::<_, (bool,)>(AssertSqlSafe(call))
                .fetch_one(&p.nobody)
                .await;
            assert_eq!(sqlstate(&result).as_deref(), Some("42501"), "{call}: {result:?}");
        }
        Ok(())
    })
    .await
}
