//! Rate limits stored in the database, pauses and several limits per check,
//! on a real PostgreSQL: a stored limit beats the code's
//! in every process with no extra statement, a key's override beats its
//! limiter's, a pause holds back checks and waiting acquires across
//! processes, a raised rate or an ended pause wakes waiters early, and a
//! multi-limit check charges all or none, never exceeding any limit under
//! contention, whatever a concurrent single check or settings change does.

mod support;

use std::time::Duration;

use pg_semaphore::{
    Error, LimiterSet, RateLimiter, RatePolicy,
    admin::LimiterKind,
    limits::{MAX_LIMITS, MAX_PAUSE},
};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::TestResult;
use tokio::time::Instant;

const HOUR: Duration = Duration::from_secs(3600);

/// A token bucket that refills nothing worth a token during a test.
fn bucket(pool: &PgPool, name: &str, burst: u32) -> RateLimiter {
    RateLimiter::builder(name, RatePolicy::token_bucket(0.001, burst))
        .build(&pg_semaphore::Client::new(pool.clone()))
        .expect("valid token bucket")
}

fn window(pool: &PgPool, name: &str, limit: u32) -> RateLimiter {
    RateLimiter::builder(name, RatePolicy::fixed_window(limit, HOUR))
        .build(&pg_semaphore::Client::new(pool.clone()))
        .expect("valid fixed window")
}

async fn admitted(
    check: impl std::future::Future<Output = pg_semaphore::Result<pg_semaphore::Decision>>,
) -> bool {
    check.await.expect("check").allowed
}

/// How many of `n` single checks of `key` are admitted.
async fn admits(limiter: &RateLimiter, key: &str, n: usize) -> pg_semaphore::Result<usize> {
    let mut count = 0;
    for _ in 0..n {
        if limiter.check(key, 1).await?.allowed {
            count += 1;
        }
    }
    Ok(count)
}

/// The operator stores a burst of 3 for a limiter whose code says 10: two
/// processes (two pools, handles built with 10) admit 3 between them, and
/// their 10 checks made exactly 10 statements of the schema, each one call
/// of `token_bucket` that read the settings once inside it (PostgreSQL's
/// function statistics): no extra round trip. Clearing the stored limit
/// brings the code's back.
#[tokio::test]
async fn a_stored_limit_beats_the_code_s_in_every_process_with_no_extra_statement() -> TestResult {
    const APPLICATION: &str = "settings-counter";
    let db = support::migrated_db().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"ALTER DATABASE "{}" SET track_functions = 'all'"#,
        db.name
    )))
    .execute(&db.pool)
    .await?;
    pg_semaphore::admin::set_rate_limit(
        &db.pool,
        "stored",
        None,
        RatePolicy::token_bucket(0.001, 3),
    )
    .await?;
    let options = db.options.clone().application_name(APPLICATION);
    let mut pools = Vec::new();
    for _ in 0..2 {
        pools.push(
            PgPoolOptions::new()
                .max_connections(1)
                .connect_with(options.clone())
                .await?,
        );
    }
    let mut allowed = 0;
    for i in 0..10 {
        if bucket(&pools[i % 2], "stored", 10)
            .check("k", 1)
            .await?
            .allowed
        {
            allowed += 1;
        }
    }
    assert_eq!(
        allowed, 3,
        "the stored burst of 3 was not applied by both processes"
    );
    for pool in &pools {
        pool.close().await;
    }
    assert!(
        support::eventually(Duration::from_secs(20), || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            )
            .bind(APPLICATION)
            .fetch_one(&db.pool)
            .await
            .is_ok_and(|n| n == 0)
        })
        .await
    );
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&db.pool)
        .await?;
    let calls: Vec<(String, i64)> = sqlx::query_as(
        "SELECT funcname::text, calls FROM pg_stat_user_functions \
         WHERE schemaname = 'pgsemaphore' \
           AND funcname IN ('token_bucket', 'rate_take', 'rate_limit_stored', \
                            'rate_limit_in_force', 'check_limits') \
         ORDER BY funcname",
    )
    .fetch_all(&db.pool)
    .await?;
    // The settings are read by the engine's first
    // statement (rate_take, once per check), with no function of their own;
    // the crate compares its pair with the stored one once per limiter and
    // process (rate_limit_in_force, which reads rate_limit_stored).
    assert_eq!(
        calls,
        vec![
            ("rate_limit_in_force".to_owned(), 1),
            ("rate_limit_stored".to_owned(), 1),
            ("rate_take".to_owned(), 10),
            ("token_bucket".to_owned(), 10)
        ],
        "10 checks: 10 calls of token_bucket, each reading the settings once inside it, \
         and one comparison of the limiter's pair"
    );

    assert!(
        pg_semaphore::admin::clear_rate_limit(&db.pool, LimiterKind::TokenBucket, "stored", None)
            .await?
    );
    // The code's burst of 10 again, for a fresh key (the 3 taken from "k"
    // are not given back: its bucket is empty until it refills).
    let limiter = bucket(&db.pool, "stored", 10);
    assert_eq!(admits(&limiter, "fresh", 12).await?, 10);
    assert_eq!(admits(&limiter, "k", 1).await?, 0);
    Ok(())
}

/// A key's stored override beats its limiter's stored limit, which beats the
/// code's: a burst of 1 for the limiter, 4 for "vip".
#[tokio::test]
async fn a_key_s_override_beats_its_limiter_s_setting() -> TestResult {
    let db = support::migrated_db().await;
    let limiter = bucket(&db.pool, "tiers", 10);
    let set = |key: Option<&'static str>, burst| {
        pg_semaphore::admin::set_rate_limit(
            &db.pool,
            "tiers",
            key,
            RatePolicy::token_bucket(0.001, burst),
        )
    };
    set(None, 1).await?;
    set(Some("vip"), 4).await?;
    assert_eq!(admits(&limiter, "plain", 10).await?, 1);
    assert_eq!(admits(&limiter, "vip", 10).await?, 4);
    // A window's override too, and a request above the stored limit is an
    // argument error (it could never be admitted), not a refusal.
    let win = window(&db.pool, "win", 10);
    pg_semaphore::admin::set_rate_limit(
        &db.pool,
        "win",
        Some("small"),
        RatePolicy::fixed_window(2, HOUR),
    )
    .await?;
    assert!(win.check("small", 2).await?.allowed);
    assert!(!win.check("small", 1).await?.allowed);
    assert!(matches!(
        win.check("small", 3).await,
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(win.check("other", 10).await?.remaining, 0);
    let listed = pg_semaphore::admin::rate_limit_settings(&db.pool).await?;
    // The operator's three rows, and "win"'s own pair, stored by its first
    // check of a key with no override ("other").
    assert_eq!(listed.len(), 4, "{listed:?}");
    // Each row lists what was stored as the policy it was stored as.
    let stored = |limiter: &str, key: Option<&str>| {
        listed
            .iter()
            .find(|s| s.limiter == limiter && s.key.as_deref() == key)
            .and_then(|s| s.policy)
    };
    assert_eq!(
        stored("tiers", Some("vip")),
        Some(RatePolicy::token_bucket(0.001, 4))
    );
    assert_eq!(
        stored("win", Some("small")),
        Some(RatePolicy::fixed_window(2, HOUR))
    );
    Ok(())
}

/// A lowered burst caps the tokens a key saved: a key with 10 saved tokens
/// admits 2 after the burst is lowered to 2.
#[tokio::test]
async fn a_lowered_burst_caps_the_tokens_a_key_saved() -> TestResult {
    let db = support::migrated_db().await;
    let limiter = bucket(&db.pool, "capped", 10);
    assert!(limiter.check("k", 1).await?.allowed); // 9 left
    pg_semaphore::admin::set_rate_limit(
        &db.pool,
        "capped",
        None,
        RatePolicy::token_bucket(0.001, 2),
    )
    .await?;
    assert_eq!(admits(&limiter, "k", 10).await?, 2);
    Ok(())
}

/// A pause set by one process refuses another process's checks of that key
/// (with a retry-after up to the pause's end, taking nothing), not other
/// keys'; a limiter-wide pause refuses every key; a shorter pause never
/// shortens one in force; the operator's resume ends it.
#[tokio::test]
async fn a_pause_refuses_checks_in_every_process_until_it_ends() -> TestResult {
    let db = support::migrated_db().await;
    let other = support::another_pool(&db, 2).await;
    let here = bucket(&db.pool, "upstream", 5);
    let there = bucket(&other, "upstream", 5);
    here.pause("tenant", Duration::from_secs(60)).await?;
    let refused = there.check("tenant", 1).await?;
    assert!(!refused.allowed);
    assert!(
        refused.retry_after > Duration::from_secs(50)
            && refused.retry_after <= Duration::from_secs(60)
    );
    assert!(there.check("someone-else", 1).await?.allowed);
    // A shorter pause does not shorten it.
    there.pause("tenant", Duration::from_millis(1)).await?;
    assert!(there.check("tenant", 1).await?.retry_after > Duration::from_secs(50));
    // The whole limiter.
    here.pause_all(Duration::from_secs(60)).await?;
    assert!(!admitted(there.check("someone-else", 1)).await);
    assert!(
        pg_semaphore::admin::resume_rate_limit(
            &db.pool,
            LimiterKind::TokenBucket,
            "upstream",
            None
        )
        .await?
    );
    assert!(
        pg_semaphore::admin::resume_rate_limit(
            &db.pool,
            LimiterKind::TokenBucket,
            "upstream",
            Some("tenant")
        )
        .await?
    );
    // Nothing was taken while paused: 5 - 1 (someone-else's first) = 4 left for someone-else, 5 for tenant.
    assert_eq!(admits(&there, "tenant", 10).await?, 5);
    assert_eq!(admits(&there, "someone-else", 10).await?, 4);
    // Bounds.
    assert!(matches!(
        here.pause("k", MAX_PAUSE + Duration::from_secs(1)).await,
        Err(Error::InvalidArgument {
            argument: "duration",
            ..
        })
    ));
    assert!(matches!(
        here.pause("k", Duration::ZERO).await,
        Err(Error::InvalidArgument {
            argument: "duration",
            ..
        })
    ));
    Ok(())
}

/// A waiting acquire honours a pause set by another process: it sleeps
/// until the pause ends (about 1.5 s), then is admitted; an acquire whose
/// timeout ends before the pause does is refused at once.
#[tokio::test]
async fn a_waiting_acquire_sleeps_through_a_pause_set_elsewhere() -> TestResult {
    let db = support::migrated_db().await;
    let other = support::another_pool(&db, 2).await;
    let here = bucket(&db.pool, "paused-wait", 5);
    let there = bucket(&other, "paused-wait", 5);
    there.pause("k", Duration::from_millis(1500)).await?;
    let asked = Instant::now();
    assert!(matches!(
        here.acquire_timeout("k", 1, Duration::from_millis(200))
            .await,
        Err(Error::Timeout { .. })
    ));
    assert!(
        asked.elapsed() < Duration::from_millis(1000),
        "refused only after waiting"
    );
    let decision = here.acquire("k", 1).await?;
    assert!(decision.allowed);
    assert!(
        asked.elapsed() >= Duration::from_millis(1400),
        "admitted during the pause"
    );
    Ok(())
}

/// Waiting acquires are woken early: one paused for 60 s is admitted soon
/// after the operator resumes the key; one whose reservation waits 100 s
/// (rate 0.01/s) is admitted soon after the operator raises the rate to
/// 1,000/s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_acquires_wake_early_when_a_pause_ends_or_the_rate_is_raised() -> TestResult {
    let db = support::migrated_db().await;
    let paused = bucket(&db.pool, "resumed", 5);
    paused.pause("k", Duration::from_secs(60)).await?;
    let asked = Instant::now();
    let waiter = tokio::spawn(async move { paused.acquire("k", 1).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    pg_semaphore::admin::resume_rate_limit(
        &db.pool,
        LimiterKind::TokenBucket,
        "resumed",
        Some("k"),
    )
    .await?;
    assert!(waiter.await??.allowed);
    assert!(
        asked.elapsed() < Duration::from_secs(30),
        "not woken when the pause ended"
    );

    let slow =
        RateLimiter::builder("raised", RatePolicy::token_bucket(0.01, 1)).build(&db.client)?;
    assert!(slow.check("k", 1).await?.allowed);
    let asked = Instant::now();
    let waiter = tokio::spawn(async move { slow.acquire("k", 1).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    pg_semaphore::admin::set_rate_limit(
        &db.pool,
        "raised",
        None,
        RatePolicy::token_bucket(1000.0, 1),
    )
    .await?;
    assert!(waiter.await??.allowed);
    assert!(
        asked.elapsed() < Duration::from_secs(30),
        "not woken when the rate was raised"
    );
    Ok(())
}

/// Three limits on one key (buckets of 5 and 3, a window of 4): exactly 3
/// checks are admitted, and the refused ones charged nothing: the bucket of
/// 5 still has 2 tokens and the window 1 permit for single checks.
#[tokio::test]
async fn a_multi_limit_check_admits_only_if_all_admit_and_charges_none_when_refused() -> TestResult
{
    let db = support::migrated_db().await;
    let five = bucket(&db.pool, "five", 5);
    let three = bucket(&db.pool, "three", 3);
    let four = window(&db.pool, "four", 4);
    let set = LimiterSet::new().with(&five).with(&three).with(&four);
    let mut allowed = 0;
    let mut last = None;
    for _ in 0..6 {
        let decision = set.check("k", 1).await?;
        if decision.allowed {
            allowed += 1;
        } else {
            last = Some(decision);
        }
    }
    assert_eq!(allowed, 3);
    let refused = last.expect("refusals");
    assert_eq!(refused.limit, 3, "the bucket of 3 decided");
    assert!(refused.retry_after > Duration::from_secs(100));
    assert_eq!(admits(&five, "k", 10).await?, 2);
    assert_eq!(four.check("k", 1).await?.remaining, 0);
    // A global limit beside per-key ones.
    let global = bucket(&db.pool, "global", 2);
    let set = LimiterSet::new().with(&five).with_key(&global, "all");
    assert!(set.check("a", 1).await?.allowed);
    assert!(set.check("b", 1).await?.allowed);
    assert!(!set.check("c", 1).await?.allowed);
    assert_eq!(
        admits(&five, "c", 10).await?,
        5,
        "a refused set charged its per-key limit"
    );
    Ok(())
}

/// Sixteen tasks on two pools run multi-limit checks (a bucket of 30, a
/// sliding window of 20, and a global bucket of 25 over two keys) while
/// single checks of the same bucket run beside them, listing the limits in
/// different orders: no limit admits more than it allows, and no check
/// deadlocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn multi_limit_checks_under_contention_never_exceed_any_limit() -> TestResult {
    let db = support::migrated_db().await;
    let pools = [db.pool.clone(), support::another_pool(&db, 8).await];
    let mut tasks = Vec::new();
    for i in 0..16 {
        let pool = pools[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            let per_key = bucket(&pool, "contended", 30);
            let sliding =
                RateLimiter::builder("contended-sliding", RatePolicy::sliding_window(20, HOUR))
                    .build(&pg_semaphore::Client::new(pool.clone()))?;
            let global = bucket(&pool, "contended-global", 25);
            let key = if i % 4 < 2 { "a" } else { "b" };
            let set = if i % 2 == 0 {
                LimiterSet::new()
                    .with(&per_key)
                    .with(&sliding)
                    .with_key(&global, "all")
            } else {
                LimiterSet::new()
                    .with_key(&global, "all")
                    .with(&sliding)
                    .with(&per_key)
            };
            let (mut multi, mut single) = (0u32, 0u32);
            for _ in 0..10 {
                if set.check(key, 1).await?.allowed {
                    multi += 1;
                }
                if i % 4 == 3 && per_key.check(key, 1).await?.allowed {
                    single += 1;
                }
            }
            Ok::<_, Error>((key, multi, single))
        }));
    }
    let (mut by_key_multi, mut by_key_single) = ([0u32; 2], [0u32; 2]);
    for task in tasks {
        let (key, multi, single) = task.await??;
        let k = usize::from(key == "b");
        by_key_multi[k] += multi;
        by_key_single[k] += single;
    }
    for k in 0..2 {
        assert!(
            by_key_multi[k] <= 20,
            "sliding window of 20 exceeded: {by_key_multi:?}"
        );
        assert!(
            by_key_multi[k] + by_key_single[k] <= 30,
            "bucket of 30 exceeded"
        );
    }
    assert!(
        by_key_multi[0] + by_key_multi[1] <= 25,
        "global bucket of 25 exceeded"
    );
    assert_eq!(
        by_key_multi[0] + by_key_multi[1],
        25,
        "the global limit should have been the binding one"
    );
    Ok(())
}

/// A set's own mistakes are argument errors, found before anything is sent:
/// empty, too many limits, limiters of different pools; the same key of the
/// same limiter twice is refused by the database (`limits`).
#[tokio::test]
async fn a_bad_limiter_set_is_an_argument_error() -> TestResult {
    let db = support::migrated_db().await;
    let other = support::another_pool(&db, 1).await;
    let a = bucket(&db.pool, "a", 5);
    assert!(matches!(
        LimiterSet::new().check("k", 1).await,
        Err(Error::InvalidArgument {
            argument: "limits",
            ..
        })
    ));
    let mut many = LimiterSet::new();
    for _ in 0..=MAX_LIMITS {
        many = many.with(&a);
    }
    assert!(matches!(
        many.check("k", 1).await,
        Err(Error::InvalidArgument {
            argument: "limits",
            ..
        })
    ));
    let elsewhere = bucket(&other, "b", 5);
    assert!(matches!(
        LimiterSet::new()
            .with(&a)
            .with(&elsewhere)
            .check("k", 1)
            .await,
        Err(Error::InvalidArgument {
            argument: "limits",
            ..
        })
    ));
    assert!(matches!(
        LimiterSet::new().with(&a).with(&a).check("k", 1).await,
        Err(Error::InvalidArgument {
            argument: "limits",
            ..
        })
    ));
    assert!(matches!(
        LimiterSet::new().with(&a).check("k", 6).await,
        Err(Error::InvalidArgument {
            argument: "permits",
            ..
        })
    ));
    Ok(())
}

/// With the database unreachable, a set fails open only if every one of its
/// limiters was built to (one fail-closed limiter makes the set return the
/// error).
#[tokio::test]
async fn a_set_fails_open_only_if_all_its_limiters_do() -> TestResult {
    let db = support::empty_db().await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    drop(listener);
    let down = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(db.options.clone().host("127.0.0.1").port(port));
    let open = |name: &str| {
        RateLimiter::builder(name, RatePolicy::token_bucket(1.0, 1))
            .fail_open(true)
            .build(&pg_semaphore::Client::new(down.clone()))
    };
    let closed = RateLimiter::builder("closed", RatePolicy::token_bucket(1.0, 1))
        .build(&pg_semaphore::Client::new(down.clone()))?;
    let both_open = LimiterSet::new().with(&open("a")?).with(&open("b")?);
    let decision = both_open.check("k", 1).await?;
    assert!(decision.allowed && decision.failed_open, "{decision:?}");
    let mixed = LimiterSet::new().with(&open("a")?).with(&closed);
    assert!(matches!(mixed.check("k", 1).await, Err(Error::Database(_))));
    Ok(())
}

/// The windows' waiting acquires honour pauses and
/// stored limits as the token bucket's do: a paused key's acquire sleeps
/// until the pause ends, then books (and one whose timeout is shorter is
/// refused at once); a stored limit of 1 an hour replaces the code's 100,
/// so the second acquire would wait an hour and is refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_acquires_honour_pauses_and_stored_limits() -> TestResult {
    let db = support::migrated_db().await;
    let other = support::another_pool(&db, 2).await;
    let here = RateLimiter::builder("paused-window", RatePolicy::fixed_window(5, HOUR))
        .build(&db.client)?;
    let there = RateLimiter::builder("paused-window", RatePolicy::fixed_window(5, HOUR))
        .build(&pg_semaphore::Client::new(other.clone()))?;
    there.pause("k", Duration::from_millis(1500)).await?;
    let asked = Instant::now();
    assert!(matches!(
        here.acquire_timeout("k", 1, Duration::from_millis(200))
            .await,
        Err(Error::Timeout { .. })
    ));
    assert!(
        asked.elapsed() < Duration::from_millis(1000),
        "refused only after waiting"
    );
    assert!(here.acquire("k", 1).await?.allowed);
    assert!(
        asked.elapsed() >= Duration::from_millis(1400),
        "admitted during the pause"
    );

    let sliding = RateLimiter::builder("stored-window", RatePolicy::sliding_window(100, HOUR))
        .build(&db.client)?;
    pg_semaphore::admin::set_rate_limit(
        &db.pool,
        "stored-window",
        None,
        RatePolicy::sliding_window(1, HOUR),
    )
    .await?;
    assert!(sliding.acquire("k", 1).await?.allowed);
    let asked = Instant::now();
    assert!(matches!(
        sliding
            .acquire_timeout("k", 1, Duration::from_secs(5))
            .await,
        Err(Error::Timeout { .. })
    ));
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "the stored limit of 1 an hour was not applied: the code's 100 would admit at once"
    );
    Ok(())
}

/// A set's waiting acquire is admitted at one instant
/// that every limit allows: 30 waiters against a token bucket of 10/s
/// (burst 2) and a fixed window of 8 per second are admitted no faster than
/// either allows. (A booking at a later instant must hold the bucket's
/// tokens back from the checks before it: taking them at the decision would
/// let 4 through within 4 ms here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_s_waiting_acquires_never_pass_any_of_its_limits() -> TestResult {
    const WAITERS: usize = 30;
    let db = support::migrated_db().await;
    let pools = [
        support::another_pool(&db, 4).await,
        support::another_pool(&db, 4).await,
    ];
    let start = Instant::now();
    let tasks: Vec<_> = (0..WAITERS)
        .map(|i| {
            let pool = &pools[i % pools.len()];
            let fast = RateLimiter::builder("set-wait-bucket", RatePolicy::token_bucket(10.0, 2))
                .build(&pg_semaphore::Client::new(pool.clone()))
                .expect("valid bucket");
            let slow = RateLimiter::builder(
                "set-wait-window",
                RatePolicy::fixed_window(8, Duration::from_secs(1)),
            )
            .build(&pg_semaphore::Client::new(pool.clone()))
            .expect("valid window");
            tokio::spawn(async move {
                let set = LimiterSet::new().with(&fast).with(&slow);
                let decision = set.acquire("k", 1).await?;
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
            let count = (j - i + 1) as f64;
            // The bucket: burst + rate x span (+1 for the span's edges).
            let bucket = 2.0 + 10.0 * span.as_secs_f64() + 1.0;
            // The window: 8 per window of the key's grid, so at most 8 x
            // (the windows a span touches).
            let window = 8.0 * (span.as_secs_f64().floor() + 2.0);
            assert!(
                count <= bucket && count <= window,
                "{count} admissions within {:?}",
                *last - *first
            );
        }
    }
    // 30 permits at 8 per second: the last needs the fourth window.
    let took = admitted[WAITERS - 1] - start;
    assert!(
        took >= Duration::from_secs(3) - slack,
        "30 admitted in {took:?}: faster than 8 per second"
    );
    // Every limit counted every admission, and nothing more.
    let hits: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(l.hits), 0)::bigint FROM pgsemaphore.rate_ledger l \
          WHERE l.kind = 'fixed_window' AND l.limiter = 'set-wait-window' \
            AND l.seq = (SELECT max(m.seq) FROM pgsemaphore.rate_ledger m \
                          WHERE m.kind = l.kind AND m.limiter = l.limiter AND m.key = l.key)",
    )
    .fetch_one(&db.pool)
    .await?;
    assert!(
        (1..=8).contains(&hits),
        "the window's last window has {hits}"
    );
    Ok(())
}

/// A set's waiting acquire that would wait past its timeout is refused at
/// once, books nothing in any limit, and names the limit that decided; a
/// pause of one limit is waited out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_s_acquire_times_out_at_once_taking_nothing_and_waits_out_a_pause() -> TestResult {
    let db = support::migrated_db().await;
    let roomy = bucket(&db.pool, "set-timeout-bucket", 5);
    let full = window(&db.pool, "set-timeout-window", 1);
    let set = LimiterSet::new().with(&roomy).with(&full);
    assert!(set.acquire_timeout("k", 1, Duration::ZERO).await?.allowed);
    let asked = Instant::now();
    match set.acquire_timeout("k", 1, Duration::from_secs(60)).await {
        Err(Error::Timeout {
            waited_for: pg_semaphore::WaitedFor::RateLimit { limiter, key },
            ..
        }) => {
            assert_eq!(
                (limiter.as_str(), key.as_str()),
                ("set-timeout-window", "k")
            );
        }
        other => panic!("expected a timeout naming the window, got {other:?}"),
    }
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "refused only after waiting"
    );
    // The bucket was charged once (the first acquire), not by the refusal.
    assert_eq!(roomy.check("k", 1).await?.remaining, 3);

    let other = bucket(&db.pool, "set-pause-bucket", 5);
    let open = window(&db.pool, "set-pause-window", 5);
    open.pause("k", Duration::from_millis(800)).await?;
    let set = LimiterSet::new().with(&other).with(&open);
    let asked = Instant::now();
    assert!(
        set.acquire_timeout("k", 1, Duration::from_secs(10))
            .await?
            .allowed
    );
    assert!(
        asked.elapsed() >= Duration::from_millis(750),
        "admitted during the pause, after {:?}",
        asked.elapsed()
    );
    // An empty set is an argument error, before anything is sent.
    assert!(matches!(
        LimiterSet::new().acquire("k", 1).await,
        Err(Error::InvalidArgument { .. })
    ));
    Ok(())
}
