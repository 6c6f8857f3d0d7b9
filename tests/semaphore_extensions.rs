//! The semaphore extensions on a real PostgreSQL: `wait_idle`, weighted
//! permits, reserved capacity for critical traffic, the fair queue (FIFO
//! across processes, LIFO, queue limit, cancelled and crashed waiters).

mod support;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use pg_semaphore::{Error, Priority, QueueOrder, Semaphore};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::{TestResult, eventually, live_rows};

/// Long enough that only a notification, never the fallback re-check, can
/// wake a waiter within a test.
const NO_FALLBACK: Duration = Duration::from_secs(600);

/// A bound on how long a test waits for something that should happen.
const PATIENCE: Duration = Duration::from_secs(30);

/// Waits until `n` waiters are queued on `sem`.
async fn queued(sem: &Semaphore, n: u32) -> bool {
    eventually(PATIENCE, || async { sem.queue_len().await.ok() == Some(n) }).await
}

#[tokio::test]
async fn wait_idle_wakes_when_the_last_holder_releases_and_not_before() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("group", 3).build(&db.client).await?;
    // Returns at once when nobody holds a permit.
    tokio::time::timeout(PATIENCE, sem.wait_idle()).await??;

    let first = sem.acquire().await?;
    let other = support::another_pool(&db, 2).await;
    let second = Semaphore::builder("group", 3)
        .build(&pg_semaphore::Client::new(other.clone()))
        .await?
        .acquire()
        .await?;

    // The waiter lives in a third "process" whose fallback never fires.
    let third = support::another_pool(&db, 2).await;
    let watcher = Semaphore::builder("group", 3)
        .build(&pg_semaphore::Client::new(third.clone()).fallback_interval(NO_FALLBACK))
        .await?;
    let busy = tokio::time::timeout(Duration::from_millis(50), watcher.wait_idle()).await;
    assert!(busy.is_err(), "{busy:?}");

    let last_released = Arc::new(AtomicBool::new(false));
    let waiter = tokio::spawn({
        let last_released = last_released.clone();
        async move {
            tokio::time::timeout(PATIENCE, watcher.wait_idle())
                .await
                .expect("idle within the patience")?;
            Ok::<_, Error>(last_released.load(Ordering::SeqCst))
        }
    });
    // Releasing one of two holders notifies the waiter, which must keep waiting.
    first.release().await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiter.is_finished(),
        "wait_idle returned with a holder left"
    );
    last_released.store(true, Ordering::SeqCst);
    second.release().await?;
    assert!(waiter.await??, "wait_idle returned before the last release");
    assert_eq!(live_rows(&db.pool, "group").await, 0);
    Ok(())
}

// ---------------------------------------------------------------- weighted

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weighted_claims_are_all_or_nothing_under_contention() -> TestResult {
    const CAPACITY: u32 = 5;
    const TASKS: usize = 24;
    const ROUNDS: usize = 6;
    let db = support::migrated_db().await;
    // Three pools stand in for three processes.
    let mut sems = Vec::new();
    for p in 0..3 {
        let pool = support::another_pool(&db, 4).await;
        sems.push(
            Semaphore::builder("weighted", CAPACITY)
                .build(&pg_semaphore::Client::new(pool.clone()).holder(format!("process-{p}")))
                .await?,
        );
    }
    let held = Arc::new(AtomicU32::new(0));
    let max_held = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(AtomicBool::new(false));

    // An observer reads the slot table while the workers run.
    let observer = {
        let (pool, stop) = (db.pool.clone(), stop.clone());
        tokio::spawn(async move {
            let mut max = 0;
            while !stop.load(Ordering::Relaxed) {
                max = max.max(live_rows(&pool, "weighted").await);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            max
        })
    };

    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..TASKS {
        let sem = sems[t % sems.len()].clone();
        let (held, max_held, pool) = (held.clone(), max_held.clone(), db.pool.clone());
        let weight = (t % 3 + 1) as u32;
        tasks.spawn(async move {
            for round in 0..ROUNDS {
                let permit = sem
                    .acquiring()
                    .metadata(
                        serde_json::json!({ "claim": format!("{t}-{round}"), "weight": weight }),
                    )
                    .timeout(Duration::from_secs(120))
                    .acquire_many(weight)
                    .await?;
                let now = held.fetch_add(weight, Ordering::SeqCst) + weight;
                max_held.fetch_max(now, Ordering::SeqCst);
                // The permit holds exactly `weight` distinct live slots.
                assert_eq!(permit.num_permits(), weight);
                let mut slots = permit.slots();
                slots.sort_unstable();
                slots.dedup();
                assert_eq!(slots.len(), weight as usize, "{permit:?}");
                assert!(slots.iter().all(|&s| s < CAPACITY));
                let live: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pgsemaphore.slots \
                     WHERE id = ANY($1) AND completed_at IS NULL AND timed_out_at IS NULL",
                )
                .bind(permit.ids())
                .fetch_one(&pool)
                .await
                .expect("count the permit's rows");
                assert_eq!(live, i64::from(weight));
                tokio::time::sleep(Duration::from_millis(((t * 7 + round * 3) % 5) as u64)).await;
                held.fetch_sub(weight, Ordering::SeqCst);
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
    let max_held = max_held.load(Ordering::SeqCst);
    assert!(max_held <= CAPACITY, "held weights summed to {max_held}");
    assert!(
        observed <= i64::from(CAPACITY),
        "observer saw {observed} live rows"
    );
    assert!(
        max_held >= CAPACITY - 1,
        "contention stayed low: {max_held}"
    );

    // From the audit log: every claim holds exactly its weight in rows, made
    // and released together; never more than CAPACITY rows overlapping.
    let bad_groups: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT metadata->>'claim' AS claim
               FROM pgsemaphore.slots WHERE semaphore = 'weighted'
              GROUP BY metadata->>'claim'
             HAVING count(*) <> max((metadata->>'weight')::int)
                 OR count(DISTINCT created_at) <> 1
                 OR count(DISTINCT completed_at) <> 1
                 OR count(DISTINCT slot) <> count(*)
         ) g",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(bad_groups, 0, "a weighted claim was split");
    let most = support::max_concurrent_claims(&db.pool, "weighted").await?;
    assert!(
        most <= i64::from(CAPACITY),
        "audit log shows {most} overlapping"
    );
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.slots WHERE semaphore = 'weighted'")
            .fetch_one(&db.pool)
            .await?;
    let expected: usize = (0..TASKS).map(|t| (t % 3 + 1) * ROUNDS).sum();
    assert_eq!(rows, expected as i64);
    Ok(())
}

#[tokio::test]
async fn try_acquire_many_takes_all_or_nothing() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("heavy", 4).build(&db.client).await?;
    let a = sem.try_acquire().await?;
    let b = sem.try_acquire().await?;
    let err = sem.try_acquire_many(3).await.expect_err("only 2 free");
    assert!(
        matches!(err, Error::NoSlotsAvailable { capacity: 4, .. }),
        "{err:?}"
    );
    assert_eq!(
        live_rows(&db.pool, "heavy").await,
        2,
        "a refused claim took slots"
    );

    let pair = sem.try_acquire_many(2).await?;
    assert_eq!(pair.num_permits(), 2);
    let mut slots = pair.slots();
    slots.sort_unstable();
    assert_eq!(slots, vec![2, 3]);
    let ids = pair.ids();
    assert_eq!(pair.id(), ids[0]);
    assert!(
        ids[0] > b.id() && ids[1] > ids[0],
        "ids are fencing tokens: {ids:?}"
    );
    assert_eq!(sem.available_permits().await?, 0);

    // Released together, in one statement.
    pair.release().await?;
    let completed: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT completed_at) FROM pgsemaphore.slots WHERE id = ANY($1) AND completed_at IS NOT NULL",
    )
    .bind(&ids)
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(completed, 1);
    assert_eq!(sem.available_permits().await?, 2);

    // Weights that can never be held are refused at once, even by a waiting acquire.
    for n in [0, 5] {
        let err = sem.acquire_many(n).await.expect_err("impossible weight");
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    argument: "permits",
                    ..
                }
            ),
            "{err:?}"
        );
        let err = sem
            .try_acquire_many(n)
            .await
            .expect_err("impossible weight");
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    argument: "permits",
                    ..
                }
            ),
            "{err:?}"
        );
    }
    a.release().await?;
    b.release().await?;
    Ok(())
}

#[tokio::test]
async fn a_waiting_weighted_claim_never_holds_part_of_its_slots() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("triple", 3).build(&db.client).await?;
    let first = sem.try_acquire().await?;
    let second = sem.try_acquire().await?;
    let other = support::another_pool(&db, 2).await;
    let waiter_sem = Semaphore::builder("triple", 3)
        .build(&pg_semaphore::Client::new(other.clone()).fallback_interval(NO_FALLBACK))
        .await?;
    let waiter = tokio::spawn(async move {
        waiter_sem
            .acquiring()
            .timeout(PATIENCE)
            .acquire_many(3)
            .await
    });

    first.release().await?;
    // Two slots are free now: the waiter is woken and must not take them.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiter.is_finished(),
        "a weight-3 claim returned with 2 free"
    );
    assert_eq!(live_rows(&db.pool, "triple").await, 1);

    second.release().await?;
    let permit = waiter.await??;
    assert_eq!(permit.num_permits(), 3);
    assert_eq!(live_rows(&db.pool, "triple").await, 3);
    permit.release().await?;
    assert_eq!(live_rows(&db.pool, "triple").await, 0);
    Ok(())
}

// ---------------------------------------------------------------- reserved

#[tokio::test]
async fn reserved_capacity_sheds_low_priority_first() -> TestResult {
    let db = support::migrated_db().await;
    let err = Semaphore::builder("shed", 5)
        .reserved(5)
        .build(&db.client)
        .await
        .expect_err("reserving every slot");
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                argument: "reserved",
                ..
            }
        ),
        "{err:?}"
    );

    let sem = Semaphore::builder("shed", 5)
        .reserved(2)
        .build(&db.client)
        .await?;
    assert_eq!(sem.reserved(), 2);
    let low = || sem.acquiring().priority(Priority::Low);
    // Low priority succeeds while more than 2 slots are free: 5, 4, 3.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(low().try_acquire().await?);
    }
    assert_eq!(sem.available_permits().await?, 2);
    let err = low()
        .try_acquire()
        .await
        .expect_err("only the reserve is left");
    assert!(err.is_busy(), "{err:?}");
    assert_eq!(live_rows(&db.pool, "shed").await, 3);
    // High priority (the default) may use the reserve, down to the last slot.
    held.push(sem.try_acquire().await?);
    held.push(
        sem.acquiring()
            .priority(Priority::High)
            .try_acquire()
            .await?,
    );
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));

    // Two free again: still the reserve for low priority, not for high.
    held.pop().expect("held").release().await?;
    held.pop().expect("held").release().await?;
    assert!(low().try_acquire().await.is_err());
    let critical = sem.try_acquire().await?;
    critical.release().await?;

    // A weighted low-priority claim must leave the reserve too: with 3 free
    // (after one more release), 2 would leave 1 < 2.
    held.pop().expect("held").release().await?;
    assert!(low().try_acquire_many(2).await.is_err());
    let one = low().try_acquire_many(1).await?;
    // A low-priority weight above capacity - reserve can never succeed.
    let err = low().acquire_many(4).await.expect_err("4 > 5 - 2");
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                argument: "permits",
                ..
            }
        ),
        "{err:?}"
    );
    one.release().await?;

    // A waiting low-priority claim is admitted once more than 2 are free.
    let other = support::another_pool(&db, 2).await;
    let low_sem = Semaphore::builder("shed", 5)
        .reserved(2)
        .build(&pg_semaphore::Client::new(other.clone()).fallback_interval(NO_FALLBACK))
        .await?;
    assert_eq!(sem.available_permits().await?, 3);
    held.push(sem.try_acquire().await?); // 2 free: low must wait
    let waiter = tokio::spawn(async move {
        low_sem
            .acquiring()
            .priority(Priority::Low)
            .timeout(PATIENCE)
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished(), "low priority took the reserve");
    held.pop().expect("held").release().await?;
    let admitted = waiter.await??;
    assert_eq!(sem.available_permits().await?, 2);
    admitted.release().await?;
    for permit in held {
        permit.release().await?;
    }
    Ok(())
}

// ---------------------------------------------------------------- queue

/// Runs queued waiters `indices` of a queue test: waiter `i` joins the queue
/// when the `turn` table says `i`, then takes the permit as holder `w{i}`
/// and releases it at once. The service order is the order of the claims' ids.
async fn queued_waiters(pool: &PgPool, order: QueueOrder, indices: &[i32]) -> TestResult {
    let sem = Semaphore::builder("fair", 1)
        .queue(order)
        .build(&pg_semaphore::Client::new(pool.clone()).fallback_interval(NO_FALLBACK))
        .await?;
    let mut tasks = tokio::task::JoinSet::new();
    for &i in indices {
        let (sem, pool) = (sem.clone(), pool.clone());
        tasks.spawn(async move {
            assert!(
                eventually(PATIENCE, || async {
                    sqlx::query_scalar::<_, i32>("SELECT i FROM turn")
                        .fetch_one(&pool)
                        .await
                        .ok()
                        == Some(i)
                })
                .await,
                "waiter {i} never got its turn"
            );
            let permit = sem
                .acquiring()
                .holder(format!("w{i}"))
                .timeout(PATIENCE)
                .acquire()
                .await?;
            permit.release().await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        });
    }
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    Ok(())
}

/// Run as a separate OS process by the queue order tests.
#[tokio::test]
async fn queue_child_process_entry_point() -> TestResult {
    let Ok(url) = std::env::var("PGSEM_QUEUE_CHILD_URL") else {
        return Ok(()); // not a child: nothing to do
    };
    let order = match std::env::var("PGSEM_QUEUE_CHILD_ORDER")?.as_str() {
        "lifo" => QueueOrder::NewestFirst,
        _ => QueueOrder::OldestFirst,
    };
    let indices: Vec<i32> = std::env::var("PGSEM_QUEUE_CHILD_INDICES")?
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .connect(&url)
        .await?;
    queued_waiters(&pool, order, &indices).await
}

/// Six waiters join a capacity-1 queue one at a time, alternating between
/// a child process (odd ones) and two pools of this one (even ones), while
/// the permit is held; returns the order in which they were served.
async fn serve_across_processes(
    order: QueueOrder,
) -> Result<Vec<String>, Box<dyn std::error::Error + Send + Sync>> {
    const WAITERS: i32 = 6;
    let db = support::migrated_db().await;
    sqlx::query("CREATE TABLE turn (i int NOT NULL)")
        .execute(&db.pool)
        .await?;
    sqlx::query("INSERT INTO turn VALUES (-1)")
        .execute(&db.pool)
        .await?;
    let sem = Semaphore::builder("fair", 1)
        .queue(order)
        .build(&db.client)
        .await?;
    let holder = sem.acquiring().holder("first").try_acquire().await?;

    let child_indices: Vec<i32> = (0..WAITERS).filter(|i| i % 2 == 1).collect();
    let child = Command::new(std::env::current_exe()?)
        .args([
            "queue_child_process_entry_point",
            "--exact",
            "--test-threads=1",
        ])
        .env("PGSEM_QUEUE_CHILD_URL", support::server::url_for(&db.name))
        .env(
            "PGSEM_QUEUE_CHILD_ORDER",
            if order == QueueOrder::NewestFirst {
                "lifo"
            } else {
                "fifo"
            },
        )
        .env(
            "PGSEM_QUEUE_CHILD_INDICES",
            child_indices
                .iter()
                .map(i32::to_string)
                .collect::<Vec<_>>()
                .join(","),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // The even waiters live in this process, on two pools of their own.
    let mut local = Vec::new();
    for indices in [vec![0, 4], vec![2]] {
        let pool = support::another_pool(&db, 3).await;
        local.push(tokio::spawn(async move {
            queued_waiters(&pool, order, &indices).await
        }));
    }
    // Let them join one at a time, so arrival order is known.
    for i in 0..WAITERS {
        sqlx::query("UPDATE turn SET i = $1")
            .bind(i)
            .execute(&db.pool)
            .await?;
        assert!(
            queued(&sem, (i + 1) as u32).await,
            "waiter {i} did not queue"
        );
    }
    // Each served waiter releases at once: the queue drains in its order.
    holder.release().await?;
    for task in local {
        task.await??;
    }
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
    assert!(
        out.status.success(),
        "child failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(sem.queue_len().await?, 0);
    let served: Vec<String> = sqlx::query_scalar(
        "SELECT holder FROM pgsemaphore.slots WHERE semaphore = 'fair' AND holder <> 'first' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await?;
    Ok(served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_queue_serves_in_arrival_order_across_processes() -> TestResult {
    let served = serve_across_processes(QueueOrder::OldestFirst).await?;
    assert_eq!(served, ["w0", "w1", "w2", "w3", "w4", "w5"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifo_queue_serves_the_newest_first_across_processes() -> TestResult {
    let served = serve_across_processes(QueueOrder::NewestFirst).await?;
    assert_eq!(served, ["w5", "w4", "w3", "w2", "w1", "w0"]);
    Ok(())
}

#[tokio::test]
async fn a_full_queue_refuses_new_waiters_at_once() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("bounded", 1)
        .queue_limit(2)
        .build(&db.client)
        .await?;
    let held = sem.try_acquire().await?;
    let mut waiters = Vec::new();
    for n in 1..=2 {
        let waiter = sem.clone();
        waiters.push(tokio::spawn(async move {
            waiter.acquiring().timeout(PATIENCE).acquire().await
        }));
        assert!(queued(&sem, n).await);
    }
    // The third is refused without waiting for PATIENCE.
    let err = sem
        .acquiring()
        .timeout(PATIENCE)
        .acquire()
        .await
        .expect_err("queue full");
    match &err {
        Error::QueueFull { semaphore, limit } => {
            assert_eq!(semaphore, "bounded");
            assert_eq!(*limit, 2);
        }
        other => panic!("expected QueueFull, got {other:?}"),
    }
    assert!(err.is_busy());
    assert_eq!(sem.queue_len().await?, 2);
    held.release().await?;
    for waiter in waiters {
        waiter.await??.release().await?;
    }
    // Served waiters left the queue: there is room again.
    assert_eq!(sem.queue_len().await?, 0);
    sem.acquiring()
        .timeout(PATIENCE)
        .acquire()
        .await?
        .release()
        .await?;
    Ok(())
}

#[tokio::test]
async fn no_claim_jumps_a_queued_waiter() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("nojump", 2)
        .queue(QueueOrder::OldestFirst)
        .build(&db.client)
        .await?;
    // A handle without a queue, in another "process".
    let other = support::another_pool(&db, 2).await;
    let plain = Semaphore::builder("nojump", 2)
        .build(&pg_semaphore::Client::new(other.clone()))
        .await?;
    let a = sem.try_acquire().await?;
    let b = sem.try_acquire().await?;
    // The head of the queue wants both slots.
    let head = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquiring().timeout(PATIENCE).acquire_many(2).await }
    });
    assert!(queued(&sem, 1).await);
    a.release().await?;
    // One slot is free, but a waiter is queued: fail-fast claims are refused,
    // with or without a queue, weighted or not.
    assert!(matches!(
        plain.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    assert!(matches!(
        sem.try_acquire_many(1).await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    assert_eq!(live_rows(&db.pool, "nojump").await, 1);
    b.release().await?;
    let both = head.await??;
    assert_eq!(both.num_permits(), 2);
    assert_eq!(sem.queue_len().await?, 0);
    both.release().await?;
    plain.try_acquire().await?.release().await?;
    Ok(())
}

#[tokio::test]
async fn a_cancelled_waiter_leaves_the_queue_and_the_next_is_served() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("cancel", 1)
        .queue(QueueOrder::OldestFirst)
        .build(&db.client.clone().fallback_interval(NO_FALLBACK))
        .await?;
    let held = sem.try_acquire().await?;
    let first = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquiring().holder("first").acquire().await }
    });
    assert!(queued(&sem, 1).await);
    let other = support::another_pool(&db, 2).await;
    let second_sem = Semaphore::builder("cancel", 1)
        .queue(QueueOrder::OldestFirst)
        .build(&pg_semaphore::Client::new(other.clone()).fallback_interval(NO_FALLBACK))
        .await?;
    let second =
        tokio::spawn(async move { second_sem.acquiring().holder("second").acquire().await });
    assert!(queued(&sem, 2).await);

    // The head gives up: its row goes, the second becomes the head.
    first.abort();
    assert!(first.await.is_err_and(|e| e.is_cancelled()));
    assert!(queued(&sem, 1).await, "the cancelled waiter stayed queued");
    held.release().await?;
    let permit = second.await??;
    assert_eq!(
        sqlx::query_scalar::<_, String>("SELECT holder FROM pgsemaphore.slots WHERE id = $1")
            .bind(permit.id())
            .fetch_one(&db.pool)
            .await?,
        "second"
    );
    permit.release().await?;
    assert_eq!(sem.queue_len().await?, 0);
    Ok(())
}

#[tokio::test]
async fn a_crashed_waiter_leaves_the_queue_when_its_lease_ends() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("crash", 1)
        .queue(QueueOrder::OldestFirst)
        .build(
            &db.client
                .clone()
                .fallback_interval(Duration::from_millis(100)),
        )
        .await?;
    // A process queued a waiter (as `acquire` does, with a short lease
    // here) and died: nobody renews it.
    let ghost: i64 = sqlx::query_scalar(
        "SELECT o_ticket FROM pgsemaphore.enqueue(p_semaphore => 'crash', p_permits => 1, p_priority => 1::smallint, \
         p_holder => 'dead-process', p_limit => NULL, p_waiter_lease => interval '3 seconds', \
         p_token => 'dead-process-tok'::bytea)",
    )
    .fetch_one(&db.pool)
    .await?;
    // While it is live, nobody jumps it, although the slot is free.
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    // A queued acquire is served once its lease has ended, and removes it.
    let permit = sem.acquiring().timeout(PATIENCE).acquire().await?;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.waiters WHERE id = $1")
        .bind(ghost)
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(left, 0);
    permit.release().await?;
    Ok(())
}

#[tokio::test]
async fn the_reaper_removes_a_crashed_waiter_and_wakes_the_semaphore() -> TestResult {
    let db = support::migrated_db().await;
    Semaphore::builder("crash-reaped", 1)
        .queue(QueueOrder::OldestFirst)
        .build(&db.client)
        .await?;
    let ghost: i64 = sqlx::query_scalar(
        "SELECT o_ticket FROM pgsemaphore.enqueue(p_semaphore => 'crash-reaped', p_permits => 1, p_priority => 1::smallint, \
         p_holder => 'dead-process', p_limit => NULL, p_waiter_lease => interval '1 second', \
         p_token => 'dead-process-tok'::bytea)",
    )
    .fetch_one(&db.pool)
    .await?;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    pg_semaphore::admin::reap(&db.pool).await?;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.waiters WHERE id = $1")
        .bind(ghost)
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(left, 0, "the reaper left a dead waiter in the queue");
    Ok(())
}

#[tokio::test]
async fn a_high_priority_waiter_is_not_held_up_by_a_queued_low_priority_one() -> TestResult {
    let db = support::migrated_db().await;
    let queued = Semaphore::builder("mixed", 4)
        .reserved(2)
        .queue(QueueOrder::OldestFirst)
        .build(
            &db.client
                .clone()
                .fallback_interval(Duration::from_millis(100)),
        )
        .await?;
    let plain = Semaphore::builder("mixed", 4)
        .reserved(2)
        .build(
            &db.client
                .clone()
                .fallback_interval(Duration::from_millis(100)),
        )
        .await?;
    let held = plain.try_acquire_many(2).await?;
    // A low-priority claim must leave the reserve of 2 free: it queues.
    let low = {
        let queued = queued.clone();
        tokio::spawn(async move {
            queued
                .acquiring()
                .priority(Priority::Low)
                .timeout(PATIENCE)
                .acquire()
                .await
        })
    };
    while queued.queue_len().await? == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A high-priority weighted claim in the same process may use the reserve,
    // as the database allows: it must not wait behind the low one.
    let high = plain
        .acquiring()
        .timeout(Duration::from_secs(10))
        .acquire_many(2)
        .await?;
    assert_eq!(high.num_permits(), 2);
    high.release().await?;
    held.release().await?;
    low.await??.release().await?;
    Ok(())
}

/// The public futures and guards can cross threads.
#[allow(dead_code)]
fn bounds(sem: Semaphore, permit: pg_semaphore::Permit) {
    fn send<T: Send>(_: &T) {}
    fn send_sync<T: Send + Sync>(_: &T) {}
    send(&sem.wait_idle());
    send(&sem.acquire_many(2));
    send(&sem.try_acquire_many(2));
    send(&sem.acquiring().timeout(PATIENCE).acquire_many(2));
    send(&sem.acquiring().priority(Priority::Low).acquire());
    send(&sem.queue_len());
    send_sync(&permit);
    send_sync(&Priority::Low);
    send_sync(&QueueOrder::NewestFirst);
}
