//! The semaphore's promises, on a real PostgreSQL: the hard limit under
//! contention, fail-fast, timed waits, wake-ups, slot reuse, leases and
//! reaping, drop and cancellation, capacity changes, independence of
//! semaphores.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use pg_semaphore::{Error, LostReason, Permit, Semaphore, WaitedFor, admin::Reaper};
use sqlx::postgres::PgPoolOptions;
use support::{TestResult, live_rows};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hard_limit_holds_under_heavy_contention() -> TestResult {
    const CAPACITY: u32 = 3;
    const TASKS: usize = 36;
    const ROUNDS: usize = 8;
    let db = support::migrated_db().await;
    // Three pools stand in for three processes.
    let mut sems = Vec::new();
    for p in 0..3 {
        let pool = support::another_pool(&db, 4).await;
        sems.push(
            Semaphore::builder("contended", CAPACITY)
                .build(&pg_semaphore::Client::new(pool.clone()).holder(format!("process-{p}")))
                .await?,
        );
    }

    let holding = Arc::new(AtomicU32::new(0));
    let max_seen = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));

    // An observer reads the slot table while the workers run.
    let observer = {
        let pool = db.pool.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut max = 0;
            while !stop.load(Ordering::Relaxed) {
                max = max.max(live_rows(&pool, "contended").await);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            max
        })
    };

    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..TASKS {
        let sem = sems[t % sems.len()].clone();
        let (holding, max_seen) = (holding.clone(), max_seen.clone());
        tasks.spawn(async move {
            for round in 0..ROUNDS {
                let permit = sem
                    .acquiring()
                    .timeout(Duration::from_secs(60))
                    .acquire()
                    .await?;
                let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                max_seen.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(((t * 7 + round * 3) % 5) as u64)).await;
                holding.fetch_sub(1, Ordering::SeqCst);
                permit.release().await?;
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    stop.store(true, Ordering::Relaxed);
    let observed = observer.await?;

    assert!(max_seen.load(Ordering::SeqCst) <= CAPACITY);
    assert!(
        observed <= CAPACITY as i64,
        "observer saw {observed} live rows"
    );
    assert_eq!(
        max_seen.load(Ordering::SeqCst),
        CAPACITY,
        "contention reached capacity"
    );

    // From the audit log's own timestamps: never more than CAPACITY claims
    // overlapping at any instant, and no slot outside 0..CAPACITY.
    let most = support::max_concurrent_claims(&db.pool, "contended").await?;
    assert!(
        most <= CAPACITY as i64,
        "audit log shows {most} overlapping claims"
    );
    let (claims, bad_slots): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE slot >= $1 OR completed_at IS NULL)
           FROM pgsemaphore.slots WHERE semaphore = 'contended'",
    )
    .bind(CAPACITY as i32)
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(claims, (TASKS * ROUNDS) as i64);
    assert_eq!(bad_slots, 0);
    Ok(())
}

#[tokio::test]
async fn try_acquire_fails_fast_when_every_slot_is_held() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("fast-fail", 2).build(&db.client).await?;
    let _a = sem.try_acquire().await?;
    let _b = sem.try_acquire().await?;

    let err = sem
        .try_acquire()
        .await
        .expect_err("a third claim must fail");
    match &err {
        Error::NoSlotsAvailable {
            semaphore,
            capacity,
        } => {
            assert_eq!(semaphore, "fast-fail");
            assert_eq!(*capacity, 2);
        }
        other => panic!("expected NoSlotsAvailable, got {other:?}"),
    }
    assert!(err.is_busy());
    assert!(err.to_string().contains("no slots available"), "{err}");
    assert_eq!(sem.available_permits().await?, 0);
    assert_eq!(live_rows(&db.pool, "fast-fail").await, 2);
    Ok(())
}

#[tokio::test]
async fn acquire_timeout_gives_up_after_the_timeout() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("timed", 1).build(&db.client).await?;
    let _held = sem.try_acquire().await?;

    let started = Instant::now();
    let err = sem
        .acquiring()
        .timeout(Duration::from_millis(400))
        .acquire()
        .await
        .expect_err("no slot frees up");
    let waited = started.elapsed();
    match err {
        Error::Timeout {
            waited_for: WaitedFor::Permit { semaphore },
            timeout,
        } => {
            assert_eq!(semaphore, "timed");
            assert_eq!(timeout, Duration::from_millis(400));
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(
        waited >= Duration::from_millis(400),
        "gave up early: {waited:?}"
    );
    assert!(waited < Duration::from_secs(10), "hung: {waited:?}");
    assert_eq!(
        live_rows(&db.pool, "timed").await,
        1,
        "the timed-out wait claimed nothing"
    );
    Ok(())
}

#[tokio::test]
async fn a_release_wakes_a_waiter_in_another_process() -> TestResult {
    let db = support::migrated_db().await;
    // The fallback re-check is far beyond the test's patience: only the
    // NOTIFY of the release can wake the waiter in time.
    let holder_side = Semaphore::builder("wake", 1)
        .build(
            &db.client
                .clone()
                .fallback_interval(Duration::from_secs(600)),
        )
        .await?;
    let other_process = support::another_pool(&db, 2).await;
    let waiter_side = Semaphore::builder("wake", 1)
        .build(
            &pg_semaphore::Client::new(other_process.clone())
                .fallback_interval(Duration::from_secs(600)),
        )
        .await?;

    let held = holder_side.try_acquire().await?;
    let waiter = tokio::spawn(async move {
        let permit = waiter_side
            .acquiring()
            .timeout(Duration::from_secs(60))
            .acquire()
            .await?;
        Ok::<_, Error>((Instant::now(), permit))
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter must wait while the slot is held"
    );

    let released_at = Instant::now();
    held.release().await?;
    let (woke_at, permit) = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter was not woken by the release")??;
    assert!(woke_at >= released_at);
    assert_eq!(permit.slot(), 0);
    permit.release().await?;
    Ok(())
}

#[tokio::test]
async fn waiting_tasks_hold_no_pooled_connection() -> TestResult {
    let db = support::migrated_db().await;
    let holder = Semaphore::builder("no-conn", 1).build(&db.client).await?;
    // The waiters' process has a pool of two connections for twenty waiters.
    let small = support::another_pool(&db, 2).await;
    let sem = Semaphore::builder("no-conn", 1)
        .build(&pg_semaphore::Client::new(small.clone()))
        .await?;
    let held = holder.try_acquire().await?;

    let served = Arc::new(AtomicUsize::new(0));
    let mut waiters = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let (sem, served) = (sem.clone(), served.clone());
        waiters.spawn(async move {
            let permit = sem.acquire().await?;
            served.fetch_add(1, Ordering::SeqCst);
            permit.release().await
        });
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(served.load(Ordering::SeqCst), 0);

    // Both connections of the small pool are still available to other work.
    let mut a = tokio::time::timeout(Duration::from_secs(2), small.acquire()).await??;
    let mut b = tokio::time::timeout(Duration::from_secs(2), small.acquire()).await??;
    sqlx::query("SELECT 1").execute(&mut *a).await?;
    sqlx::query("SELECT 1").execute(&mut *b).await?;
    drop((a, b));

    held.release().await?;
    let all = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(result) = waiters.join_next().await {
            result??;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .await;
    assert!(all.is_ok(), "waiters were not all served");
    all.unwrap()?;
    assert_eq!(served.load(Ordering::SeqCst), 20);
    Ok(())
}

#[tokio::test]
async fn the_lowest_free_slot_is_reused() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("lowest", 3).build(&db.client).await?;
    let a = sem.try_acquire().await?;
    let b = sem.try_acquire().await?;
    let c = sem.try_acquire().await?;
    assert_eq!((a.slot(), b.slot(), c.slot()), (0, 1, 2));
    assert!(a.id() < b.id() && b.id() < c.id(), "ids strictly increase");

    b.release().await?;
    let d = sem.try_acquire().await?;
    assert_eq!(d.slot(), 1);
    a.release().await?;
    let e = sem.try_acquire().await?;
    assert_eq!(e.slot(), 0);
    assert!(e.id() > d.id());
    Ok(())
}

#[tokio::test]
async fn the_reaper_frees_a_slot_whose_lease_expired() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("reaped", 2)
        .lease(Duration::from_millis(300))
        .without_heartbeat()
        .build(&db.client)
        .await?;
    let abandoned = sem.try_acquire().await?;
    assert!(abandoned.expires_at() > abandoned.acquired_at());
    assert_eq!(sem.holders().await?.len(), 1);

    let reaper = Reaper::spawn(&db.pool, Duration::from_millis(50))?;
    let pool = db.pool.clone();
    assert!(
        support::eventually(Duration::from_secs(10), || {
            let pool = pool.clone();
            async move { live_rows(&pool, "reaped").await == 0 }
        })
        .await,
        "the reaper did not free the expired slot"
    );
    reaper.shutdown().await;
    assert!(sem.holders().await?.is_empty());

    // The holder learns it lost the slot.
    match abandoned.release().await {
        Err(Error::PermitLost {
            reason: LostReason::TimedOut { .. },
            ..
        }) => {}
        other => panic!("expected PermitLost(TimedOut), got {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn reap_once_counts_what_it_freed() -> TestResult {
    let db = support::migrated_db().await;
    let short = Semaphore::builder("short", 3)
        .lease(Duration::from_millis(100))
        .without_heartbeat()
        .build(&db.client)
        .await?;
    let long = Semaphore::builder("long", 3).build(&db.client).await?;
    let _s1 = short.try_acquire().await?;
    let _s2 = short.try_acquire().await?;
    let _l1 = long.try_acquire().await?;
    assert_eq!(
        pg_semaphore::admin::reap(&db.pool).await?,
        0,
        "nothing expired yet"
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(pg_semaphore::admin::reap(&db.pool).await?, 2);
    assert_eq!(pg_semaphore::admin::reap(&db.pool).await?, 0);
    assert_eq!(
        live_rows(&db.pool, "long").await,
        1,
        "unexpired slots are kept"
    );
    Ok(())
}

#[tokio::test]
async fn a_claim_reaps_its_own_semaphore_first() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("self-reap", 1)
        .lease(Duration::from_millis(150))
        .without_heartbeat()
        .build(&db.client)
        .await?;
    let crashed = sem.try_acquire().await?;
    assert!(sem.try_acquire().await.is_err());
    tokio::time::sleep(Duration::from_millis(300)).await;

    // No reaper runs: the claim itself frees the expired slot.
    let next = sem.try_acquire().await?;
    assert_eq!(next.slot(), 0);
    assert!(matches!(
        crashed.release().await,
        Err(Error::PermitLost { .. })
    ));
    next.release().await?;
    Ok(())
}

#[tokio::test]
async fn a_dropped_permit_is_released_in_the_background() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("dropped", 1).build(&db.client).await?;
    let permit = sem.try_acquire().await?;
    let id = permit.id();
    drop(permit);

    let pool = db.pool.clone();
    assert!(
        support::eventually(Duration::from_secs(10), || {
            let pool = pool.clone();
            async move { live_rows(&pool, "dropped").await == 0 }
        })
        .await,
        "the dropped permit was not released"
    );
    // Released, not reaped: the lease (90 s) is far from over.
    let completed: bool = sqlx::query_scalar(
        "SELECT completed_at IS NOT NULL AND timed_out_at IS NULL FROM pgsemaphore.slots WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await?;
    assert!(completed);
    sem.try_acquire().await?.release().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_acquires_never_leave_a_slot_held() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("cancelled", 2).build(&db.client).await?;
    let blocker = sem.try_acquire().await?;

    // Cancel acquires at many points: before, during and after the claim
    // round trip, and while waiting.
    let mut acquired_and_released = 0;
    for i in 0..120u64 {
        let cancel_after = Duration::from_micros((i * 137) % 4000);
        let attempt = match i % 3 {
            0 => tokio::time::timeout(cancel_after, sem.try_acquire()).await,
            1 => tokio::time::timeout(cancel_after, sem.acquire()).await,
            _ => {
                tokio::time::timeout(
                    cancel_after,
                    sem.acquiring().timeout(Duration::from_secs(5)).acquire(),
                )
                .await
            }
        };
        match attempt {
            Ok(Ok(permit)) => {
                permit.release().await?;
                acquired_and_released += 1;
            }
            // The slot of an earlier cancelled claim may not be released yet.
            Ok(Err(Error::NoSlotsAvailable { .. })) => {}
            Ok(Err(other)) => return Err(other.into()),
            Err(_cancelled) => {}
        }
    }
    blocker.release().await?;

    // Every claim that completed after its caller left has been released.
    // (A cancelled claim may still be in flight for a moment: it claims and
    // releases at once. So the table must stay empty, not just be empty once.)
    let pool = db.pool.clone();
    assert!(
        support::eventually(Duration::from_secs(10), || {
            let pool = pool.clone();
            async move {
                live_rows(&pool, "cancelled").await == 0 && {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    live_rows(&pool, "cancelled").await == 0
                }
            }
        })
        .await,
        "a cancelled acquire left a slot held"
    );
    assert_eq!(sem.available_permits().await?, 2);
    let a = sem.try_acquire().await?;
    let b = sem.try_acquire().await?;
    let mut slots = [a.slot(), b.slot()];
    slots.sort_unstable();
    assert_eq!(slots, [0, 1]);
    println!("{acquired_and_released} of 120 attempts completed before their cancellation");
    Ok(())
}

#[tokio::test]
async fn capacity_changes_apply_to_new_claims_only() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("resized", 3).build(&db.client).await?;
    let s0 = sem.try_acquire().await?;
    let s1 = sem.try_acquire().await?;
    let s2 = sem.try_acquire().await?;

    // Shrink to 1: nobody loses a slot, nobody new gets in until only
    // fewer than 1 remain.
    assert_eq!(
        pg_semaphore::admin::set_capacity(&db.pool, "resized", 1).await?,
        3
    );
    let small = Semaphore::builder("resized", 1).build(&db.client).await?;
    assert_eq!(small.capacity(), 1);
    assert!(matches!(
        small.try_acquire().await,
        Err(Error::NoSlotsAvailable { capacity: 1, .. })
    ));
    s0.release().await?;
    assert!(small.try_acquire().await.is_err(), "2 live > capacity 1");
    s1.release().await?;
    assert!(small.try_acquire().await.is_err(), "1 live = capacity 1");
    s2.release().await?; // the holder above the new capacity kept its slot until now
    let only = small.try_acquire().await?;
    assert_eq!(only.slot(), 0);

    // Grow to 2 while someone waits: the waiter is woken by the change.
    let waiting = Semaphore::builder("resized", 1)
        .build(
            &pg_semaphore::Client::new(support::another_pool(&db, 2).await)
                .fallback_interval(Duration::from_secs(600)),
        )
        .await;
    // Building with capacity 1 again is a no-op for the row; the wait follows.
    let waiting = waiting?;
    let waiter = tokio::spawn(async move {
        waiting
            .acquiring()
            .timeout(Duration::from_secs(30))
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!waiter.is_finished());
    pg_semaphore::admin::set_capacity(&db.pool, "resized", 2).await?;
    let permit = tokio::time::timeout(Duration::from_secs(20), waiter).await???;
    assert_eq!(permit.slot(), 1);
    Ok(())
}

#[tokio::test]
async fn different_semaphores_never_wait_on_each_other() -> TestResult {
    let db = support::migrated_db().await;
    let a = Semaphore::builder("a", 1).build(&db.client).await?;
    let b = Semaphore::builder("b", 1).build(&db.client).await?;

    // Another session is in the middle of a claim on `b`: it holds b's row.
    let mut tx = db.pool.begin().await?;
    sqlx::query("SELECT 1 FROM pgsemaphore.semaphores WHERE name = 'b' FOR NO KEY UPDATE")
        .execute(&mut *tx)
        .await?;

    // A claim on `a` goes straight through ...
    let permit = tokio::time::timeout(Duration::from_secs(5), a.try_acquire())
        .await
        .expect("a claim on `a` waited for `b`")?;
    permit.release().await?;
    // ... while a claim on `b` queues behind the in-flight one.
    let b_claim = tokio::spawn(async move { b.try_acquire().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!b_claim.is_finished(), "claims on one semaphore serialise");
    tx.rollback().await?;
    b_claim.await??.release().await?;
    Ok(())
}

#[tokio::test]
async fn permits_carry_holder_and_metadata() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("labelled", 2)
        .build(&db.client.clone().holder("api-7"))
        .await?;
    let plain = sem.try_acquire().await?;
    let tagged = sem
        .acquiring()
        .holder("api-7/job-42")
        .metadata(serde_json::json!({ "request_id": "r-1" }))
        .lease(Duration::from_secs(5))
        .try_acquire()
        .await?;
    let holders = sem.holders().await?;
    assert_eq!(holders.len(), 2);
    assert_eq!(holders[0].id, Some(plain.id()));
    assert_eq!(holders[0].holder.as_deref(), Some("api-7"));
    assert_eq!(holders[0].metadata, None);
    assert_eq!(holders[1].holder.as_deref(), Some("api-7/job-42"));
    assert_eq!(
        holders[1].metadata,
        Some(serde_json::json!({ "request_id": "r-1" }))
    );
    let lease = tagged.expires_at() - tagged.acquired_at();
    assert_eq!(lease, chrono::Duration::seconds(5));
    Ok(())
}

#[tokio::test]
async fn the_default_holder_label_is_host_and_pid() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("default-holder", 1)
        .build(&db.client)
        .await?;
    let _permit = sem.try_acquire().await?;
    let holder = sem.holders().await?[0].holder.clone().unwrap_or_default();
    assert!(
        holder.ends_with(&format!(":{}", std::process::id())),
        "holder label {holder:?} should end with the pid"
    );
    assert!(holder.len() > format!(":{}", std::process::id()).len());
    Ok(())
}

/// Compile-time check: handles, permits and futures can cross threads.
#[allow(dead_code)]
fn bounds() {
    fn send_sync<T: Send + Sync>(_: &T) {}
    fn send<T: Send>(_: &T) {}
    fn check(sem: &Semaphore, permit: Permit) {
        send_sync(sem);
        send_sync(&permit);
        send(&sem.try_acquire());
        send(&sem.acquire());
        send(&sem.acquiring().timeout(Duration::from_secs(1)).acquire());
        send(&sem.acquiring().try_acquire());
        send(&sem.available_permits());
        send(&permit.release());
    }
    let _ = check;
}

#[tokio::test]
async fn a_lost_notification_is_covered_by_the_fallback_re_check() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("silent", 1)
        .build(
            &db.client
                .clone()
                .fallback_interval(Duration::from_millis(300)),
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
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished());
    // Free the slot behind the crate's back: no NOTIFY is sent.
    sqlx::query("UPDATE pgsemaphore.slots SET completed_at = clock_timestamp() WHERE id = $1")
        .bind(held.id())
        .execute(&db.pool)
        .await?;
    std::mem::forget(held);
    let permit = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter hung although a slot was free")??;
    assert_eq!(permit.slot(), 0);
    Ok(())
}

#[tokio::test]
async fn waiters_survive_the_listen_connection_being_killed() -> TestResult {
    let db = support::migrated_db().await;
    // The fallback is out of reach: only a recovered LISTEN can wake the waiter.
    let sem = Semaphore::builder("relisten", 1)
        .build(
            &db.client
                .clone()
                .fallback_interval(Duration::from_secs(600)),
        )
        .await?;
    let held = sem.try_acquire().await?;
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move {
            sem.acquiring()
                .timeout(Duration::from_secs(60))
                .acquire()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;

    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_all(&db.pool)
    .await?;
    assert_eq!(
        killed,
        vec![true],
        "exactly one LISTEN connection serves the pool"
    );

    // Let the listener reconnect, then release.
    let pool = db.pool.clone();
    assert!(
        support::eventually(Duration::from_secs(10), || {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND query LIKE 'LISTEN%'",
                )
                .fetch_one(&pool)
                .await
                .unwrap_or(0)
                    == 1
            }
        })
        .await,
        "the listener did not reconnect"
    );
    held.release().await?;
    let permit = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter was not woken after the listener reconnected")??;
    permit.release().await?;
    Ok(())
}

#[tokio::test]
async fn a_cancelled_release_still_releases() -> TestResult {
    let db = support::migrated_db().await;
    let single = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options.clone())
        .await?;
    let sem = Semaphore::builder("cancelled-release", 1)
        .build(&pg_semaphore::Client::new(single.clone()))
        .await?;
    let permit = sem.try_acquire().await?;
    let id = permit.id();

    // The pool's only connection is busy, so the release has to wait for it ...
    let busy = single.acquire().await?;
    let cancelled = tokio::time::timeout(Duration::from_millis(100), permit.release()).await;
    assert!(cancelled.is_err(), "the release could not have finished");
    // ... and is then cancelled. Once the connection is free it still happens.
    drop(busy);
    let pool = db.pool.clone();
    assert!(
        support::eventually(Duration::from_secs(10), || {
            let pool = pool.clone();
            async move { live_rows(&pool, "cancelled-release").await == 0 }
        })
        .await,
        "the cancelled release never happened"
    );
    let completed: bool =
        sqlx::query_scalar("SELECT completed_at IS NOT NULL FROM pgsemaphore.slots WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await?;
    assert!(completed, "released, not reaped");
    Ok(())
}

#[tokio::test]
async fn a_fence_keeps_the_permit_live_until_the_callers_transaction_ends() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("fenced", 1)
        .lease(Duration::from_millis(300))
        .without_heartbeat()
        .build(&db.client)
        .await?;
    let permit = sem.try_acquire().await?;
    let mut tx = db.pool.begin().await?;
    permit.fence(&mut tx).await?;
    sqlx::query("CREATE TEMP TABLE protected_write (n int)")
        .execute(&mut *tx)
        .await?;

    // The lease runs out while the transaction is open: no reaper can take
    // the slot from under the fenced write ...
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        pg_semaphore::admin::reap(&db.pool).await?,
        0,
        "a fenced claim was reaped"
    );
    // ... and a release waits for the transaction. The lease has ended by
    // then, so the release says the permit is lost and the audit log agrees
    // (timed out, not completed).
    let id = permit.id();
    let release = tokio::spawn(permit.release());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !release.is_finished(),
        "the release did not wait for the fence"
    );
    tx.commit().await?;
    assert!(matches!(release.await?, Err(Error::PermitLost { .. })));
    let timed_out: bool =
        sqlx::query_scalar("SELECT timed_out_at IS NOT NULL FROM pgsemaphore.slots WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await?;
    assert!(timed_out);
    Ok(())
}

#[tokio::test]
async fn a_fence_reports_how_the_slot_was_lost() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("unfenced", 3)
        .lease(Duration::from_millis(200))
        .without_heartbeat()
        .build(&db.client)
        .await?;
    let released_elsewhere = sem
        .acquiring()
        .lease(Duration::from_secs(60))
        .try_acquire()
        .await?;
    let expired = sem.try_acquire().await?;
    let reaped = sem.try_acquire().await?;
    sqlx::query("SELECT pgsemaphore.force_release(p_id => $1)")
        .bind(released_elsewhere.id())
        .execute(&db.pool)
        .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("UPDATE pgsemaphore.slots SET timed_out_at = clock_timestamp() WHERE id = $1")
        .bind(reaped.id())
        .execute(&db.pool)
        .await?;

    for (permit, expected) in [
        (&released_elsewhere, "AlreadyReleased"),
        (&expired, "LeaseExpired"),
        (&reaped, "TimedOut"),
    ] {
        let mut tx = db.pool.begin().await?;
        match permit.fence(&mut tx).await {
            Err(Error::PermitLost { id, reason, .. }) => {
                assert_eq!(id, permit.id());
                assert!(format!("{reason:?}").starts_with(expected), "{reason:?}");
            }
            other => panic!("expected PermitLost({expected}), got {other:?}"),
        }
        tx.rollback().await?;
    }
    Ok(())
}
