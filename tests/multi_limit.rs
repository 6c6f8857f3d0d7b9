//! Several limits at once (`Semaphore::acquire_all`, `pgsemaphore.claim_all`):
//! all or nothing, never a deadlock whatever order callers name the
//! semaphores in, nothing held while waiting, a wake-up on a release of any
//! of them, one permit that releases all, the claims linked in the audit
//! log, and no limit exceeded under concurrency from several pools.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pg_semaphore::{
    Client, Error, QueueOrder, RateLimiter, RatePolicy, Semaphore, audit::AuditLog,
    limits::MAX_SEMAPHORES_PER_CLAIM,
};
use support::{TestResult, connect, live_rows, token};

/// A client whose waiters re-check only every minute: nothing wakes them
/// but a release.
fn quiet(client: &Client) -> Client {
    client.clone().fallback_interval(Duration::from_secs(60))
}

/// A semaphore without heartbeats, with a long lease: nothing frees a slot
/// but a release.
async fn semaphore(client: &Client, name: &str, capacity: u32) -> pg_semaphore::Result<Semaphore> {
    Semaphore::builder(name, capacity)
        .lease(Duration::from_secs(60))
        .without_heartbeat()
        .build(client)
        .await
}

#[tokio::test]
async fn one_full_semaphore_makes_the_whole_claim_fail_and_takes_nothing() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let global = semaphore(&client, "global", 3).await?;
    let merchant = semaphore(&client, "merchant-7", 1).await?;
    let held = merchant.try_acquire().await?;
    // Named in either order, the full semaphore refuses the whole claim.
    for members in [
        [(&global, 1), (&merchant, 1)],
        [(&merchant, 1), (&global, 1)],
    ] {
        match Semaphore::try_acquire_all(&members).await {
            Err(Error::NoSlotsAvailable {
                semaphore,
                capacity,
            }) => assert_eq!((semaphore.as_str(), capacity), ("merchant-7", 1)),
            other => panic!("expected NoSlotsAvailable on merchant-7, got {other:?}"),
        }
        assert_eq!(
            live_rows(&db.pool, "global").await,
            0,
            "a global permit was left held"
        );
    }
    held.release().await?;
    let permit = Semaphore::try_acquire_all(&[(&global, 2), (&merchant, 1)]).await?;
    assert_eq!(live_rows(&db.pool, "global").await, 2);
    assert_eq!(live_rows(&db.pool, "merchant-7").await, 1);
    permit.release().await?;
    Ok(())
}

#[tokio::test]
async fn one_permit_holds_and_releases_every_claim_linked_in_the_audit_log() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let b = semaphore(&client, "b-per-merchant", 5).await?;
    let a = semaphore(&client, "a-global", 100).await?;
    let permit = tokio::time::timeout(
        Duration::from_secs(10),
        Semaphore::acquire_all(&[(&b, 2), (&a, 1)]),
    )
    .await??;
    assert_eq!(permit.semaphore_names(), vec!["a-global", "b-per-merchant"]);
    assert_eq!(permit.num_permits(), 3);
    let ids = permit.ids();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids ascend: {ids:?}");
    assert_eq!(permit.id(), ids[0]);
    assert_eq!(
        (
            live_rows(&db.pool, "a-global").await,
            live_rows(&db.pool, "b-per-merchant").await
        ),
        (1, 2)
    );

    // The audit log links the three claims: each carries the first one's id.
    let log = AuditLog::new(&db.pool);
    let window = chrono::Utc::now() - chrono::Duration::hours(1)
        ..chrono::Utc::now() + chrono::Duration::hours(1);
    let mut groups = Vec::new();
    for name in ["a-global", "b-per-merchant"] {
        groups.extend(
            log.history(name, window.clone())
                .await?
                .into_iter()
                .map(|c| c.group_id),
        );
    }
    assert_eq!(groups, vec![Some(permit.id()); 3]);

    // The fence and the release cover every claim, on both semaphores.
    let mut tx = db.pool.begin().await?;
    permit.fence(&mut tx).await?;
    tx.commit().await?;
    permit.release().await?;
    assert_eq!(
        (
            live_rows(&db.pool, "a-global").await,
            live_rows(&db.pool, "b-per-merchant").await
        ),
        (0, 0)
    );
    let single = a.try_acquire().await?;
    let history = log.history("a-global", window).await?;
    assert_eq!(
        history.last().map(|c| c.group_id),
        Some(None),
        "a single claim has no group"
    );
    single.release().await?;
    Ok(())
}

#[tokio::test]
async fn a_dropped_multi_limit_permit_frees_every_semaphore() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let a = semaphore(&client, "drop-a", 1).await?;
    let b = semaphore(&client, "drop-b", 1).await?;
    drop(Semaphore::try_acquire_all(&[(&a, 1), (&b, 1)]).await?);
    let freed = support::eventually(Duration::from_secs(10), || async {
        live_rows(&db.pool, "drop-a").await + live_rows(&db.pool, "drop-b").await == 0
    })
    .await;
    assert!(freed, "the dropped permit's claims are still live");
    Semaphore::try_acquire_all(&[(&a, 1), (&b, 1)])
        .await?
        .release()
        .await?;
    Ok(())
}

/// Interleaving: a transaction holds semaphore "g"'s row (a claim left
/// uncommitted) while a multi-limit claim names "m" then "g"; then the same
/// transaction claims "m". Had the multi-limit claim locked in the order it
/// was given, it would hold "m" and wait for "g" while the transaction
/// waits for "m": a deadlock. In the canonical order it waits for "g"
/// holding nothing, so the transaction's claim of "m" goes through.
#[tokio::test]
async fn callers_naming_the_semaphores_in_opposite_orders_never_deadlock() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let g = semaphore(&client, "g", 2).await?;
    let m = semaphore(&client, "m", 2).await?;
    let mut first = connect(&db).await?;
    sqlx::query("BEGIN").execute(&mut first).await?;
    support::claim_with_token(&mut first, "g", "60 s", &token("first")).await?;

    // Straight through the SQL function, "m" first (the crate sorts the
    // names before sending; a client in another language may not).
    let mut second = connect(&db).await?;
    let waiter = tokio::spawn(async move {
        sqlx::query_as::<_, (String, Option<Vec<i64>>)>(
            "SELECT o_status, o_ids FROM pgsemaphore.claim_all(p_semaphores => ARRAY['m', 'g'], \
             p_holder => 'h', p_lease => NULL, p_metadata => NULL, p_token => $1)",
        )
        .bind(token("second"))
        .fetch_one(&mut second)
        .await
    });
    // The multi-limit claim now waits for "g"'s row.
    let waiting = support::eventually(Duration::from_secs(10), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'
                AND query LIKE '%claim_all%'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap_or(0);
        waiting == 1
    })
    .await;
    assert!(waiting, "the multi-limit claim never waited for g's row");
    assert_eq!(live_rows(&db.pool, "m").await, 0);

    // The open transaction now claims "m": nothing holds its row.
    let (status, _) = support::raw_claim(&mut first, "m", &token("first-m")).await?;
    assert_eq!(status, "claimed");
    sqlx::query("COMMIT").execute(&mut first).await?;
    let (status, ids) = waiter.await??;
    assert_eq!(
        (status.as_str(), ids.map(|ids| ids.len())),
        ("claimed", Some(2))
    );
    assert_eq!(
        (
            live_rows(&db.pool, "g").await,
            live_rows(&db.pool, "m").await
        ),
        (2, 2)
    );
    // The crate's own call, in either order, goes through the same path.
    assert!(matches!(
        Semaphore::try_acquire_all(&[(&m, 1), (&g, 1)]).await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    Ok(())
}

#[tokio::test]
async fn a_waiter_holds_nothing_and_wakes_on_a_release_of_either_semaphore() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let other = quiet(&Client::new(support::another_pool(&db, 4).await));
    let a = semaphore(&client, "wake-a", 1).await?;
    let b = semaphore(&client, "wake-b", 1).await?;
    let a_elsewhere = semaphore(&other, "wake-a", 1).await?;
    let b_elsewhere = semaphore(&other, "wake-b", 1).await?;
    for last in ["wake-a", "wake-b"] {
        // Another pool (another LISTEN connection) holds both.
        let held_a = a_elsewhere.try_acquire().await?;
        let held_b = b_elsewhere.try_acquire().await?;
        let waiter = {
            let (a, b) = (a.clone(), b.clone());
            tokio::spawn(async move { Semaphore::acquire_all(&[(&a, 1), (&b, 1)]).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The first release frees one semaphore: the waiter cannot have both,
        // and takes nothing of the one that is free.
        let (first, second) = if last == "wake-a" {
            (held_b, held_a)
        } else {
            (held_a, held_b)
        };
        first.release().await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!waiter.is_finished(), "claimed while {last} was held");
        assert_eq!(
            live_rows(&db.pool, "wake-a").await + live_rows(&db.pool, "wake-b").await,
            1,
            "the waiter holds a slot while it waits"
        );
        // The release of the other one wakes it (no lease ends for a minute,
        // and the fallback re-check is a minute away).
        second.release().await?;
        let permit = tokio::time::timeout(Duration::from_secs(20), waiter)
            .await
            .map_err(|_| format!("the waiter slept through the release of {last}"))???;
        permit.release().await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_multi_limit_claim_never_jumps_a_fair_queue() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let queued = Semaphore::builder("queued", 2)
        .queue(QueueOrder::OldestFirst)
        .build(&client)
        .await?;
    let plain = semaphore(&client, "plain", 2).await?;
    // A waiter queued on "queued" (a live ticket), with slots free.
    let ticket: Option<i64> = sqlx::query_scalar(
        "SELECT o_ticket FROM pgsemaphore.enqueue(p_semaphore => 'queued', p_permits => 1, \
         p_priority => 1::smallint, p_holder => 'w', p_limit => NULL, p_waiter_lease => '60 s', \
         p_token => $1)",
    )
    .bind(token("queued-waiter"))
    .fetch_one(&db.pool)
    .await?;
    assert!(ticket.is_some());
    match Semaphore::try_acquire_all(&[(&plain, 1), (&queued, 1)]).await {
        Err(Error::NoSlotsAvailable { semaphore, .. }) => assert_eq!(semaphore, "queued"),
        other => panic!("expected the queue to refuse the claim, got {other:?}"),
    }
    assert_eq!(live_rows(&db.pool, "plain").await, 0);
    Ok(())
}

#[tokio::test]
async fn bad_member_lists_are_refused_before_anything_is_sent() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let other = quiet(&Client::new(support::another_pool(&db, 2).await));
    let a = semaphore(&client, "check-a", 2).await?;
    let a_elsewhere = semaphore(&other, "check-a", 2).await?;
    let b = semaphore(&client, "check-b", 2).await?;
    let many: Vec<Semaphore> = {
        let mut many = Vec::new();
        for i in 0..=MAX_SEMAPHORES_PER_CLAIM {
            many.push(semaphore(&client, &format!("many-{i}"), 1).await?);
        }
        many
    };
    let too_many: Vec<(&Semaphore, u32)> = many.iter().map(|s| (s, 1)).collect();
    type Members<'a> = Vec<(&'a Semaphore, u32)>;
    let cases: Vec<(&str, Members, &str)> = vec![
        ("none", vec![], "semaphores"),
        ("too many", too_many, "semaphores"),
        ("twice", vec![(&a, 1), (&b, 1), (&a, 1)], "semaphores"),
        ("zero permits", vec![(&a, 0), (&b, 1)], "permits"),
        ("above the capacity", vec![(&a, 3), (&b, 1)], "permits"),
        (
            "two clients",
            vec![(&a_elsewhere, 1), (&b, 1)],
            "semaphores",
        ),
    ];
    for (case, members, argument) in cases {
        match Semaphore::try_acquire_all(&members).await {
            Err(Error::InvalidArgument { argument: got, .. }) => {
                assert_eq!(got, argument, "{case}")
            }
            other => panic!("{case}: expected InvalidArgument, got {other:?}"),
        }
    }
    let mut exactly: Vec<(&Semaphore, u32)> = many.iter().map(|s| (s, 1)).collect();
    exactly.pop();
    Semaphore::try_acquire_all(&exactly)
        .await?
        .release()
        .await?;
    Ok(())
}

/// The use case: at most `GLOBAL` calls in total and at most `PER_MERCHANT`
/// per merchant, claimed together by many workers on three pools (three
/// LISTEN connections, as three processes would have), mixed with plain
/// claims of the global limit alone. A monitor checks the live counts
/// throughout, and the audit log's own timestamps are swept afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_limit_is_exceeded_by_multi_limit_claims_under_concurrency() -> TestResult {
    const GLOBAL: u32 = 8;
    const PER_MERCHANT: u32 = 3;
    const MERCHANTS: usize = 4;
    const WORKERS_PER_POOL: usize = 8;
    const ROUNDS: usize = 8;
    let db = support::migrated_db().await;
    let mut pools = vec![db.pool.clone()];
    for _ in 0..2 {
        pools.push(support::another_pool(&db, 6).await);
    }
    let mut workers = Vec::new();
    for (p, pool) in pools.iter().enumerate() {
        let client = Client::new(pool.clone());
        let global = Semaphore::builder("payments", GLOBAL)
            .lease(Duration::from_secs(60))
            .build(&client)
            .await?;
        let mut merchants = Vec::new();
        for m in 0..MERCHANTS {
            merchants.push(
                Semaphore::builder(format!("payments:merchant-{m}"), PER_MERCHANT)
                    .lease(Duration::from_secs(60))
                    .build(&client)
                    .await?,
            );
        }
        for w in 0..WORKERS_PER_POOL {
            let (global, merchants) = (global.clone(), merchants.clone());
            workers.push(tokio::spawn(async move {
                for round in 0..ROUNDS {
                    let merchant = &merchants[(p + w + round) % MERCHANTS];
                    let permit = if (w + round) % 4 == 0 {
                        global
                            .acquiring()
                            .timeout(Duration::from_secs(60))
                            .acquire()
                            .await?
                    } else {
                        tokio::time::timeout(
                            Duration::from_secs(60),
                            Semaphore::acquire_all(&[(merchant, 1), (&global, 1)]),
                        )
                        .await
                        .expect("served within 60 s")?
                    };
                    tokio::time::sleep(Duration::from_millis(5 + (w as u64 % 3) * 5)).await;
                    permit.release().await?;
                }
                Ok::<_, Error>(())
            }));
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (pool, stop) = (db.pool.clone(), stop.clone());
        tokio::spawn(async move {
            let mut worst: Vec<(String, i64)> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let counts: Vec<(String, i64)> = sqlx::query_as(
                    "SELECT semaphore, count(*) FROM pgsemaphore.live_slots GROUP BY semaphore",
                )
                .fetch_all(&pool)
                .await?;
                worst.extend(counts);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok::<_, sqlx::Error>(worst)
        })
    };
    for worker in workers {
        worker.await??;
    }
    stop.store(true, Ordering::Relaxed);
    for (name, live) in monitor.await?? {
        let limit = if name == "payments" {
            GLOBAL
        } else {
            PER_MERCHANT
        };
        assert!(
            live <= i64::from(limit),
            "{live} live claims of {name} (limit {limit})"
        );
    }
    let most = support::max_concurrent_claims(&db.pool, "payments").await?;
    assert!(
        most <= i64::from(GLOBAL),
        "{most} overlapping claims of the global limit"
    );
    for m in 0..MERCHANTS {
        let name = format!("payments:merchant-{m}");
        let most = support::max_concurrent_claims(&db.pool, &name).await?;
        assert!(
            most <= i64::from(PER_MERCHANT),
            "{most} overlapping claims of {name}"
        );
    }
    // Every multi-limit claim took both of its limits, never one alone.
    let (groups, halves): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE n <> 2)
           FROM (SELECT group_id, count(*) AS n FROM pgsemaphore.slots
                  WHERE group_id IS NOT NULL GROUP BY group_id) g",
    )
    .fetch_one(&db.pool)
    .await?;
    let expected = (pools.len() * WORKERS_PER_POOL * ROUNDS) as i64;
    assert!(
        groups > expected / 2,
        "only {groups} multi-limit claims of {expected} rounds"
    );
    assert_eq!(halves, 0, "a multi-limit claim holding one limit alone");
    Ok(())
}

#[tokio::test]
async fn a_timed_out_or_cancelled_wait_leaves_nothing_held() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let a = semaphore(&client, "cancel-a", 1).await?;
    let b = semaphore(&client, "cancel-b", 1).await?;
    let held = b.try_acquire().await?;
    // A timeout around the cancel-safe future is how a multi-limit wait is bounded.
    let timed_out = tokio::time::timeout(
        Duration::from_millis(300),
        Semaphore::acquire_all(&[(&a, 1), (&b, 1)]),
    )
    .await;
    assert!(timed_out.is_err(), "expected a timeout, got {timed_out:?}");
    let waiter = {
        let (a, b) = (a.clone(), b.clone());
        tokio::spawn(async move { Semaphore::acquire_all(&[(&a, 1), (&b, 1)]).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    waiter.abort();
    let _ = waiter.await;
    held.release().await?;
    // Nobody waits any more: a slot of each is free, and stays free.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        (
            live_rows(&db.pool, "cancel-a").await,
            live_rows(&db.pool, "cancel-b").await
        ),
        (0, 0)
    );
    let registered: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.wakeups")
        .fetch_one(&db.pool)
        .await?;
    let gone = support::eventually(Duration::from_secs(5), || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pgsemaphore.wakeups")
            .fetch_one(&db.pool)
            .await
            .is_ok_and(|n| n == 0)
    })
    .await;
    assert!(
        gone,
        "{registered} wake-up registrations left after the waiters went"
    );
    Ok(())
}

/// Interleaving: a refused multi-limit claim inside a transaction the
/// caller keeps open. The first semaphore's row was locked before the
/// second refused; the refusal rolls the claims back *and releases that
/// row lock*, so another session's claim of the first semaphore does not
/// wait for the open transaction.
#[tokio::test]
async fn a_refused_multi_limit_claim_keeps_no_row_locked_in_an_open_transaction() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let a = semaphore(&client, "locked-a", 2).await?;
    let b = semaphore(&client, "locked-b", 1).await?;
    let held = b.try_acquire().await?;
    let mut open = connect(&db).await?;
    sqlx::query("BEGIN").execute(&mut open).await?;
    let (status, semaphore): (String, Option<String>) = sqlx::query_as(
        "SELECT o_status, o_semaphore FROM pgsemaphore.claim_all(ARRAY['locked-b', 'locked-a'], \
         'h', NULL, NULL, $1)",
    )
    .bind(token("refused-in-xact"))
    .fetch_one(&mut open)
    .await?;
    assert_eq!(
        (status.as_str(), semaphore.as_deref()),
        ("full", Some("locked-b"))
    );
    // The transaction stays open; a claim of "locked-a" must not wait for it
    // (it would wait 2 s for the row, then fail with Stalled).
    let permit = tokio::time::timeout(Duration::from_millis(1500), a.try_acquire())
        .await
        .map_err(|_| "a claim waited for the refused multi-limit claim's row lock")??;
    permit.release().await?;
    sqlx::query("ROLLBACK").execute(&mut open).await?;
    held.release().await?;
    Ok(())
}

/// The tokens left in `limiter`'s bucket for `key` (none before its first use).
async fn tokens(pool: &sqlx::PgPool, limiter: &str, key: &str) -> Option<f64> {
    sqlx::query_scalar("SELECT tokens FROM pgsemaphore.rate_limits WHERE limiter = $1 AND key = $2")
        .bind(limiter)
        .bind(key)
        .fetch_optional(pool)
        .await
        .expect("read the bucket")
}

#[tokio::test]
async fn a_claim_with_a_rate_limit_takes_both_or_nothing() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let upstream = semaphore(&client, "geocoder", 1).await?;
    // One call per customer, then one every 1,000 s.
    let per_customer =
        RateLimiter::builder("geo-rate", RatePolicy::token_bucket(0.001, 1)).build(&client)?;

    // Both admit: a slot and a token.
    let permit = upstream
        .acquiring()
        .rate_limit(&per_customer, "c1")
        .try_acquire()
        .await?;
    assert_eq!(live_rows(&db.pool, "geocoder").await, 1);
    assert_eq!(tokens(&db.pool, "geo-rate", "c2").await, None);
    // The semaphore is full: refused, and c2's bucket is not even touched.
    match upstream
        .acquiring()
        .rate_limit(&per_customer, "c2")
        .try_acquire()
        .await
    {
        Err(Error::NoSlotsAvailable { semaphore, .. }) => assert_eq!(semaphore, "geocoder"),
        other => panic!("expected NoSlotsAvailable, got {other:?}"),
    }
    assert_eq!(
        tokens(&db.pool, "geo-rate", "c2").await,
        None,
        "a refused claim took a token"
    );
    permit.release().await?;

    // c1's token is spent: the rate limit refuses, and no slot is taken.
    match upstream
        .acquiring()
        .rate_limit(&per_customer, "c1")
        .try_acquire()
        .await
    {
        Err(Error::RateLimited {
            limiter,
            retry_after,
        }) => {
            assert_eq!(limiter, "geo-rate");
            assert!(
                retry_after > Duration::from_secs(900),
                "retry after {retry_after:?}"
            );
        }
        other => panic!("expected RateLimited, got {other:?}"),
    }
    assert_eq!(
        live_rows(&db.pool, "geocoder").await,
        0,
        "a refused claim held a slot"
    );
    // A wait the limit would outlast gives up at once, saying why (it
    // would otherwise end in Timeout after a minute).
    match upstream
        .acquiring()
        .rate_limit(&per_customer, "c1")
        .timeout(Duration::from_secs(60))
        .acquire()
        .await
    {
        Err(Error::RateLimited { limiter, .. }) => assert_eq!(limiter, "geo-rate"),
        other => panic!("expected RateLimited, got {other:?}"),
    }
    assert!(
        upstream
            .acquiring()
            .rate_limit(&per_customer, "c1")
            .try_acquire()
            .await
            .unwrap_err()
            .is_busy()
    );

    // Another customer is served, and a claim without the limit too.
    let permit = upstream
        .acquiring()
        .rate_limit(&per_customer, "c2")
        .try_acquire()
        .await?;
    assert_eq!(
        tokens(&db.pool, "geo-rate", "c2").await.map(f64::round),
        Some(0.0)
    );
    permit.release().await?;
    upstream.try_acquire().await?.release().await?;
    Ok(())
}

#[tokio::test]
async fn a_waiting_claim_with_a_rate_limit_waits_for_the_limit_then_takes_both() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let upstream = semaphore(&client, "waits-rate", 2).await?;
    // One call at once, then one every 200 ms.
    let limit =
        RateLimiter::builder("five-per-s", RatePolicy::token_bucket(5.0, 1)).build(&client)?;
    let first = upstream
        .acquiring()
        .rate_limit(&limit, "k")
        .try_acquire()
        .await?;
    // The second is refused now, and admitted by a waiting acquire.
    assert!(matches!(
        upstream
            .acquiring()
            .rate_limit(&limit, "k")
            .try_acquire()
            .await,
        Err(Error::RateLimited { .. })
    ));
    let second = upstream
        .acquiring()
        .rate_limit(&limit, "k")
        .timeout(Duration::from_secs(30))
        .acquire()
        .await?;
    assert_eq!(live_rows(&db.pool, "waits-rate").await, 2);
    // A third waits for a slot and a token both, and times out holding nothing.
    let third = upstream
        .acquiring()
        .rate_limit(&limit, "k")
        .timeout(Duration::from_millis(300))
        .acquire()
        .await;
    assert!(matches!(third, Err(Error::Timeout { .. })), "got {third:?}");
    assert_eq!(live_rows(&db.pool, "waits-rate").await, 2);
    first.release().await?;
    second.release().await?;
    Ok(())
}

#[tokio::test]
async fn a_claim_with_rate_limits_refuses_what_it_cannot_do_before_sending() -> TestResult {
    let db = support::migrated_db().await;
    let client = quiet(&db.client);
    let sem = semaphore(&client, "rate-args", 2).await?;
    let limit =
        RateLimiter::builder("rate-args-l", RatePolicy::token_bucket(1.0, 5)).build(&client)?;
    let refused = |result: pg_semaphore::Result<pg_semaphore::Permit>| match result {
        Err(Error::InvalidArgument { argument, .. }) => argument,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    let argument = refused(
        sem.acquiring()
            .rate_limit(&limit, "k")
            .fairness_key("t")
            .try_acquire()
            .await,
    );
    assert_eq!(argument, "rate_limit");
    assert_eq!(
        refused(sem.acquiring().rate_limit(&limit, "").try_acquire().await),
        "key"
    );
    // A limiter of another pool (another database, as far as a claim knows).
    let other = support::migrated_db().await;
    let elsewhere = RateLimiter::builder("rate-args-l", RatePolicy::token_bucket(1.0, 5))
        .build(&other.client)?;
    assert_eq!(
        refused(
            sem.acquiring()
                .rate_limit(&elsewhere, "k")
                .try_acquire()
                .await
        ),
        "rate_limit"
    );
    assert_eq!(live_rows(&db.pool, "rate-args").await, 0);
    Ok(())
}
