//! Fairness keys in the fair queue: in a FIFO queue, waiters of different
//! fairness keys take turns, so a key with one waiter is served within one
//! turn of the rotation however many waiters another key has; within a key,
//! arrival order; without keys, plain arrival order; a LIFO queue ignores
//! keys. The SQL tests drive `pgsemaphore.enqueue` and `claim` directly and
//! let the database say who is served: each grant frees the one slot and
//! offers it to every queued ticket in arrival order until one is claimed
//! (every other one must be refused as `behind`). The crate test queues
//! real waiting acquires and records the order in which they get the
//! permit.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pg_semaphore::{Error, QueueOrder, Semaphore, limits::MAX_FAIRNESS_KEY_LEN};
use sqlx::PgPool;
use support::TestResult;

/// A 16-byte token of the given tag.
fn token(tag: &str) -> Vec<u8> {
    let mut bytes = tag.as_bytes().to_vec();
    bytes.resize(16, b'.');
    bytes.truncate(16);
    bytes
}

/// A queued waiter, as the SQL test sees it.
struct Waiter {
    holder: String,
    priority: i16,
    ticket: i64,
    token: Vec<u8>,
}

/// The permit held right now: its claim ids and token.
struct Held {
    ids: Vec<i64>,
    token: Vec<u8>,
}

/// A semaphore of capacity 1 whose permit is held (by holder `first`).
async fn held_semaphore(pool: &PgPool, name: &str, lifo: bool) -> sqlx::Result<Held> {
    sqlx::query("SELECT * FROM pgsemaphore.open(p_name => $1, p_capacity => 1, p_lease => '90 s', p_queue_lifo => $2)")
        .bind(name)
        .bind(lifo)
        .execute(pool)
        .await?;
    let token = token("first");
    let (status, ids): (String, Option<Vec<i64>>) = sqlx::query_as(
        "SELECT o_status, o_ids FROM pgsemaphore.claim(p_semaphore => $1, p_holder => 'first', \
         p_lease => NULL, p_metadata => NULL, p_token => $2)",
    )
    .bind(name)
    .bind(&token)
    .fetch_one(pool)
    .await?;
    assert_eq!(status, "claimed");
    Ok(Held {
        ids: ids.unwrap_or_default(),
        token,
    })
}

/// Queues `holder` at high priority with fairness key `key` (NULL for
/// `None`).
async fn enqueue(
    pool: &PgPool,
    semaphore: &str,
    holder: &str,
    key: Option<&str>,
) -> sqlx::Result<Waiter> {
    enqueue_at(pool, semaphore, holder, key, 1).await
}

/// Queues `holder` at `priority` (1 high, 0 low) with fairness key `key`.
async fn enqueue_at(
    pool: &PgPool,
    semaphore: &str,
    holder: &str,
    key: Option<&str>,
    priority: i16,
) -> sqlx::Result<Waiter> {
    let token = token(&format!("w-{holder}"));
    let (ticket,): (Option<i64>,) = sqlx::query_as(
        "SELECT o_ticket FROM pgsemaphore.enqueue(p_semaphore => $1, p_permits => 1, \
         p_priority => $2, p_holder => $3, p_limit => NULL, \
         p_waiter_lease => '60 s', p_token => $4, p_fair_key => $5)",
    )
    .bind(semaphore)
    .bind(priority)
    .bind(holder)
    .bind(&token)
    .bind(key)
    .fetch_one(pool)
    .await?;
    Ok(Waiter {
        holder: holder.to_owned(),
        priority,
        ticket: ticket.expect("no queue limit"),
        token,
    })
}

/// One grant: releases the held permit, then offers the free slot to every
/// queued ticket in arrival order until one is claimed; every ticket tried
/// before it must be refused as `behind` (the database says who is ahead,
/// not this test). Returns the served holder and its permit; removes it
/// from `queue`.
async fn grant(
    pool: &PgPool,
    semaphore: &str,
    held: Held,
    queue: &mut Vec<Waiter>,
) -> Result<(String, Held), Box<dyn std::error::Error + Send + Sync>> {
    let (outcome,): (String,) =
        sqlx::query_as("SELECT o_outcome FROM pgsemaphore.release(p_ids => $1, p_token => $2)")
            .bind(&held.ids)
            .bind(&held.token)
            .fetch_one(pool)
            .await?;
    assert_eq!(outcome, "released");
    for i in 0..queue.len() {
        let waiter = &queue[i];
        let claim_token = token(&format!("c-{}", waiter.holder));
        let (status, ids): (String, Option<Vec<i64>>) = sqlx::query_as(
            "SELECT o_status, o_ids FROM pgsemaphore.claim(p_semaphore => $1, p_holder => $2, \
             p_lease => NULL, p_metadata => NULL, p_token => $3, p_ticket => $4, \
             p_ticket_token => $5, p_waiter_lease => '60 s', p_priority => $6)",
        )
        .bind(semaphore)
        .bind(&waiter.holder)
        .bind(&claim_token)
        .bind(waiter.ticket)
        .bind(&waiter.token)
        .bind(waiter.priority)
        .fetch_one(pool)
        .await?;
        match status.as_str() {
            "claimed" => {
                let served = queue.remove(i);
                return Ok((
                    served.holder,
                    Held {
                        ids: ids.unwrap_or_default(),
                        token: claim_token,
                    },
                ));
            }
            "behind" => {}
            other => panic!("{}'s ticket claim answered {other}", waiter.holder),
        }
    }
    panic!(
        "nobody of {} queued waiters could claim the free slot",
        queue.len()
    )
}

/// Grants the slot `n` times (or until the queue is empty); returns the
/// served holders in order, and the permit of the last.
async fn serve(
    pool: &PgPool,
    semaphore: &str,
    mut held: Held,
    queue: &mut Vec<Waiter>,
    n: usize,
) -> Result<(Vec<String>, Held), Box<dyn std::error::Error + Send + Sync>> {
    let mut served = Vec::new();
    while served.len() < n && !queue.is_empty() {
        let (holder, next) = grant(pool, semaphore, held, queue).await?;
        served.push(holder);
        held = next;
    }
    Ok((served, held))
}

/// The rule: key A queues 1,000 waiters, then key B queues one; B
/// is served within the next 2 grants (after A's head, which arrived first
/// at the same turn), and A's waiters keep their arrival order.
#[tokio::test]
async fn a_key_with_one_waiter_is_served_within_two_grants_of_a_key_with_a_thousand() -> TestResult
{
    let db = support::migrated_db().await;
    let held = held_semaphore(&db.pool, "tenants", false).await?;
    let mut queue = Vec::new();
    for i in 0..1000 {
        queue.push(enqueue(&db.pool, "tenants", &format!("a{i}"), Some("A")).await?);
    }
    queue.push(enqueue(&db.pool, "tenants", "b", Some("B")).await?);
    let (served, _) = serve(&db.pool, "tenants", held, &mut queue, 3).await?;
    let b = served.iter().position(|h| h == "b");
    assert!(
        b.is_some_and(|at| at < 2),
        "B was not served within the next 2 grants: {served:?}"
    );
    assert_eq!(served, ["a0", "b", "a1"]);
    Ok(())
}

/// Three keys, each with three waiters queued one key after the other, are
/// served round-robin.
#[tokio::test]
async fn three_keys_are_served_round_robin() -> TestResult {
    let db = support::migrated_db().await;
    let held = held_semaphore(&db.pool, "three", false).await?;
    let mut queue = Vec::new();
    for key in ["a", "b", "c"] {
        for i in 0..3 {
            queue.push(enqueue(&db.pool, "three", &format!("{key}{i}"), Some(key)).await?);
        }
    }
    let (served, _) = serve(&db.pool, "three", held, &mut queue, usize::MAX).await?;
    assert_eq!(
        served,
        ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]
    );
    Ok(())
}

/// A key that joins late starts at the head's turn, not at the back: after
/// A's first waiter is served, C's one waiter comes right after A's next.
#[tokio::test]
async fn a_key_that_joins_late_starts_at_the_heads_turn() -> TestResult {
    let db = support::migrated_db().await;
    let held = held_semaphore(&db.pool, "late", false).await?;
    let mut queue = Vec::new();
    for i in 0..4 {
        queue.push(enqueue(&db.pool, "late", &format!("a{i}"), Some("A")).await?);
    }
    let (first, held) = serve(&db.pool, "late", held, &mut queue, 1).await?;
    assert_eq!(first, ["a0"]);
    queue.push(enqueue(&db.pool, "late", "c0", Some("C")).await?);
    let (rest, _) = serve(&db.pool, "late", held, &mut queue, usize::MAX).await?;
    assert_eq!(rest, ["a1", "c0", "a2", "a3"]);
    Ok(())
}

/// Without fairness keys the queue is plain arrival order, as before keys
/// existed, also after a waiter in the middle left.
#[tokio::test]
async fn without_keys_the_queue_is_arrival_order() -> TestResult {
    let db = support::migrated_db().await;
    let held = held_semaphore(&db.pool, "plain", false).await?;
    let mut queue = Vec::new();
    for i in 0..4 {
        queue.push(enqueue(&db.pool, "plain", &format!("n{i}"), None).await?);
    }
    let left = queue.remove(1);
    let (gone,): (bool,) =
        sqlx::query_as("SELECT pgsemaphore.leave_queue(p_ticket => $1, p_token => $2)")
            .bind(left.ticket)
            .bind(&left.token)
            .fetch_one(&db.pool)
            .await?;
    assert!(gone);
    for i in 4..6 {
        queue.push(enqueue(&db.pool, "plain", &format!("n{i}"), None).await?);
    }
    // Turns ascend with arrival.
    let turns: Vec<i64> = sqlx::query_scalar(
        "SELECT turn FROM pgsemaphore.waiters WHERE semaphore = 'plain' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await?;
    assert!(turns.windows(2).all(|w| w[0] < w[1]), "{turns:?}");
    let (served, _) = serve(&db.pool, "plain", held, &mut queue, usize::MAX).await?;
    assert_eq!(served, ["n0", "n2", "n3", "n4", "n5"]);
    Ok(())
}

/// A LIFO queue serves the newest waiter first and ignores keys.
#[tokio::test]
async fn a_lifo_queue_ignores_keys() -> TestResult {
    let db = support::migrated_db().await;
    let held = held_semaphore(&db.pool, "newest", true).await?;
    let mut queue = Vec::new();
    for i in 0..3 {
        queue.push(enqueue(&db.pool, "newest", &format!("a{i}"), Some("A")).await?);
    }
    queue.push(enqueue(&db.pool, "newest", "b0", Some("B")).await?);
    queue.push(enqueue(&db.pool, "newest", "a3", Some("A")).await?);
    let (served, _) = serve(&db.pool, "newest", held, &mut queue, usize::MAX).await?;
    assert_eq!(served, ["a3", "b0", "a2", "a1", "a0"]);
    Ok(())
}

/// Priority still comes first: a low-priority key with one waiter, queued
/// before everyone, waits behind every high-priority waiter, and keys take
/// turns within each priority.
#[tokio::test]
async fn priority_comes_before_keys() -> TestResult {
    let db = support::migrated_db().await;
    let held = held_semaphore(&db.pool, "ranked", false).await?;
    let mut queue = vec![enqueue_at(&db.pool, "ranked", "low", Some("L"), 0).await?];
    for i in 0..2 {
        queue.push(enqueue(&db.pool, "ranked", &format!("a{i}"), Some("A")).await?);
    }
    queue.push(enqueue(&db.pool, "ranked", "b0", Some("B")).await?);
    let (served, _) = serve(&db.pool, "ranked", held, &mut queue, usize::MAX).await?;
    assert_eq!(served, ["a0", "b0", "a1", "low"]);
    Ok(())
}

/// Through the crate: 1,000 waiting `acquire()`s of key A queue behind a
/// held permit, then one of key B, all in one process (so the local order
/// of waiters must follow the database's turns, or B would never be the
/// one that claims); B gets the permit within the next 2 grants, and every
/// waiter is served. Each task records the order it got the permit in
/// while it holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_acquires_of_a_key_with_one_waiter_are_served_within_two_grants() -> TestResult {
    const A_WAITERS: usize = 1000;
    let patience = Duration::from_secs(120);
    let db = support::migrated_db().await;
    let pool = support::another_pool(&db, 10).await;
    let sem = Semaphore::builder("crate-tenants", 1)
        .queue(QueueOrder::OldestFirst)
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    let held = sem.acquiring().holder("first").try_acquire().await?;
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    let spawn =
        |tasks: &mut tokio::task::JoinSet<Result<(), Error>>, holder: String, key: &'static str| {
            let (sem, order) = (sem.clone(), order.clone());
            tasks.spawn(async move {
                let permit = sem
                    .acquiring()
                    .holder(holder.clone())
                    .fairness_key(key)
                    .timeout(patience)
                    .acquire()
                    .await?;
                // Capacity 1: only the holder of the permit writes here.
                order.lock().unwrap().push(holder);
                permit.release().await?;
                Ok::<_, Error>(())
            });
        };
    for i in 0..A_WAITERS {
        spawn(&mut tasks, format!("a{i}"), "A");
    }
    assert!(
        support::eventually(patience, || async {
            sem.queue_len().await.ok() == Some(A_WAITERS as u32)
        })
        .await,
        "key A's waiters did not all queue"
    );
    spawn(&mut tasks, "b".to_owned(), "B");
    assert!(
        support::eventually(patience, || async {
            sem.queue_len().await.ok() == Some(A_WAITERS as u32 + 1)
        })
        .await,
        "key B's waiter did not queue"
    );
    let started = std::time::Instant::now();
    held.release().await?;
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    let order = order.lock().unwrap().clone();
    println!(
        "{} grants in {:.1} s; B was grant {}",
        order.len(),
        started.elapsed().as_secs_f64(),
        order.iter().position(|h| h == "b").map_or(0, |at| at + 1)
    );
    assert_eq!(order.len(), A_WAITERS + 1, "every waiter was served");
    let b = order.iter().position(|h| h == "b");
    assert!(
        b.is_some_and(|at| at < 2),
        "B was not served within the next 2 grants: {:?}",
        &order[..order.len().min(5)]
    );
    assert_eq!(sem.queue_len().await?, 0);
    Ok(())
}

/// The crate checks a fairness key before anything is sent, on every kind
/// of claim; a handle without a queue ignores a good one.
#[tokio::test]
async fn a_fairness_key_is_one_to_max_characters_without_nul() -> TestResult {
    let db = support::migrated_db().await;
    let queued = Semaphore::builder("keys", 1)
        .queue(QueueOrder::OldestFirst)
        .build(&db.client)
        .await?;
    let long = "k".repeat(MAX_FAIRNESS_KEY_LEN + 1);
    for bad in ["", long.as_str(), "a\0b"] {
        for result in [
            queued.acquiring().fairness_key(bad).try_acquire().await,
            queued
                .acquiring()
                .fairness_key(bad)
                .timeout(Duration::from_secs(5))
                .acquire()
                .await,
        ] {
            match result {
                Err(Error::InvalidArgument { argument, .. }) => {
                    assert_eq!(argument, "fairness_key")
                }
                other => panic!("expected InvalidArgument for {bad:?}, got {other:?}"),
            }
        }
    }
    assert_eq!(queued.available_permits().await?, 1, "nothing was claimed");
    let longest = "k".repeat(MAX_FAIRNESS_KEY_LEN);
    queued
        .acquiring()
        .fairness_key(longest.as_str())
        .acquire()
        .await?
        .release()
        .await?;
    let plain = Semaphore::builder("keys", 1).build(&db.client).await?;
    plain
        .acquiring()
        .fairness_key("tenant-7")
        .try_acquire()
        .await?
        .release()
        .await?;
    Ok(())
}

/// Weighted keys: the operator gives key A weight 3, so while A and B both
/// have waiters queued, each turn of the rotation serves three of A's and
/// one of B's; within a key, arrival order.
#[tokio::test]
async fn a_key_of_weight_three_is_served_three_grants_for_every_one_of_a_key_of_weight_one()
-> TestResult {
    let db = support::migrated_db().await;
    let held = held_semaphore(&db.pool, "weighted", false).await?;
    let previous =
        pg_semaphore::admin::set_fairness_weight(&db.pool, "weighted", Some("A"), 3).await?;
    assert_eq!(previous, 1, "every key starts at weight 1");
    let mut queue = Vec::new();
    for i in 0..9 {
        queue.push(enqueue(&db.pool, "weighted", &format!("a{i}"), Some("A")).await?);
    }
    for i in 0..4 {
        queue.push(enqueue(&db.pool, "weighted", &format!("b{i}"), Some("B")).await?);
    }
    let (served, _) = serve(&db.pool, "weighted", held, &mut queue, usize::MAX).await?;
    assert_eq!(
        served,
        [
            "a0", "a1", "a2", "b0", "a3", "a4", "a5", "b1", "a6", "a7", "a8", "b2", "b3"
        ]
    );
    Ok(())
}

/// The shared default key (waiters without a key) can be weighted too, a
/// weight of 1 removes the setting, and a change applies to waiters queued
/// after it: those already queued keep their turns.
#[tokio::test]
async fn a_weight_change_applies_to_waiters_queued_after_it() -> TestResult {
    let db = support::migrated_db().await;
    let held = held_semaphore(&db.pool, "reweighed", false).await?;
    pg_semaphore::admin::set_fairness_weight(&db.pool, "reweighed", None, 2).await?;
    let mut queue = Vec::new();
    for i in 0..4 {
        queue.push(enqueue(&db.pool, "reweighed", &format!("n{i}"), None).await?);
    }
    queue.push(enqueue(&db.pool, "reweighed", "k0", Some("K")).await?);
    // Back to weight 1: the default key's next waiters take a turn each.
    let previous = pg_semaphore::admin::set_fairness_weight(&db.pool, "reweighed", None, 1).await?;
    assert_eq!(previous, 2);
    let (rows,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM pgsemaphore.fair_weights WHERE semaphore = 'reweighed'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(rows, 0, "weight 1 is the default: no row is kept");
    queue.push(enqueue(&db.pool, "reweighed", "n4", None).await?);
    queue.push(enqueue(&db.pool, "reweighed", "n5", None).await?);
    queue.push(enqueue(&db.pool, "reweighed", "k1", Some("K")).await?);
    let (served, _) = serve(&db.pool, "reweighed", held, &mut queue, usize::MAX).await?;
    // Turns: n0 n1 | 0, n2 n3 | 1 (weight 2); k0 | 0; n4 | 2, n5 | 3
    // (weight 1 now); k1 | 1.
    assert_eq!(served, ["n0", "n1", "k0", "n2", "n3", "k1", "n4", "n5"]);
    Ok(())
}

/// The weight is the operator's: out-of-range weights, bad keys and
/// unknown semaphores are refused by the crate and by the database alike,
/// and nothing is written.
#[tokio::test]
async fn a_fairness_weight_is_one_to_max_on_an_existing_semaphore() -> TestResult {
    let db = support::migrated_db().await;
    held_semaphore(&db.pool, "bounded", false).await?;
    for weight in [0, pg_semaphore::limits::MAX_FAIRNESS_WEIGHT + 1] {
        let refused =
            pg_semaphore::admin::set_fairness_weight(&db.pool, "bounded", Some("A"), weight).await;
        assert!(
            matches!(
                refused,
                Err(Error::InvalidArgument {
                    argument: "weight",
                    ..
                })
            ),
            "weight {weight}: {refused:?}"
        );
    }
    let long = "k".repeat(MAX_FAIRNESS_KEY_LEN + 1);
    assert!(matches!(
        pg_semaphore::admin::set_fairness_weight(&db.pool, "bounded", Some(&long), 2).await,
        Err(Error::InvalidArgument {
            argument: "fairness_key",
            ..
        })
    ));
    assert!(matches!(
        pg_semaphore::admin::set_fairness_weight(&db.pool, "nobody", Some("A"), 2).await,
        Err(Error::SemaphoreNotFound { .. })
    ));
    // The database's own checks, for callers of the SQL API.
    for (weight, key) in [
        (0, Some("A")),
        (1001, Some("A")),
        (-5, Some("A")),
        (2, Some("")),
    ] {
        let error = sqlx::query(
            "SELECT pgsemaphore.set_fair_weight(p_semaphore => 'bounded', p_fair_key => $1, \
             p_weight => $2)",
        )
        .bind(key)
        .bind(weight)
        .execute(&db.pool)
        .await
        .expect_err("refused");
        let code = error.as_database_error().and_then(|e| e.code());
        assert_eq!(code.as_deref(), Some("22023"), "{weight} {key:?}: {error}");
    }
    let (rows,): (i64,) = sqlx::query_as("SELECT count(*) FROM pgsemaphore.fair_weights")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(rows, 0);
    Ok(())
}
