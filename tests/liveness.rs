//! Liveness of waits: a waiter is served when it can be, in the order the
//! docs promise, and never sleeps on a wake-up that nobody will send.
//! Fallback re-checks are set far away (30 s or more) so that a test only
//! passes when the right wake-up arrives.

mod support;

use std::time::Duration;

use pg_semaphore::{Priority, QueueOrder, Semaphore};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};
use support::TestResult;
use tokio::time::Instant;

const FAR: Duration = Duration::from_secs(30);

/// Within a process, waits are served in order: a weighted acquire that
/// waits for two slots is not overtaken by a plain acquire that came after
/// it, even when one slot frees up (tokio's semaphore makes the same
/// promise, and the docs say "a large request at the front is not
/// overtaken").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weighted_wait_is_not_overtaken_by_a_later_plain_wait() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("weighted-first", 2)
        .build(&db.client.clone().fallback_interval(FAR))
        .await?;
    let a = sem.try_acquire().await?;
    let b = sem.try_acquire().await?;

    let heavy = {
        let sem = sem.clone();
        tokio::spawn(async move { sem.acquire_many(2).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let light = {
        let sem = sem.clone();
        tokio::spawn(async move { sem.acquire().await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    // One slot frees: not enough for the heavy waiter, which is first.
    a.release().await?;
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !light.is_finished(),
        "a later plain acquire took the slot the weighted waiter in front of it needs"
    );
    // The second slot frees: the heavy waiter takes both.
    b.release().await?;
    let heavy = tokio::time::timeout(Duration::from_secs(5), heavy).await???;
    assert_eq!(heavy.num_permits(), 2);
    assert!(!light.is_finished());
    heavy.release().await?;
    let light = tokio::time::timeout(Duration::from_secs(5), light).await???;
    light.release().await?;
    Ok(())
}

/// A queued waiter's ticket is renewed for as long as it waits, whoever is
/// first in the process's local order: here a weighted wait on a handle
/// without a queue comes first, and a low-priority queued wait of another
/// handle holds the ticket. The ticket's lease is 10 s; after 12 s it must
/// still be live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_tickets_are_renewed_behind_a_waiter_without_one() -> TestResult {
    let db = support::migrated_db().await;
    let plain = Semaphore::builder("mixed-handles", 2)
        .build(&db.client.clone().fallback_interval(FAR))
        .await?;
    let queued = Semaphore::builder("mixed-handles", 2)
        .queue(QueueOrder::OldestFirst)
        .build(&db.client.clone().fallback_interval(FAR))
        .await?;
    let held = plain.try_acquire_many(2).await?;

    let heavy = {
        let plain = plain.clone();
        tokio::spawn(async move { plain.acquire_many(2).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let low = {
        let queued = queued.clone();
        tokio::spawn(async move { queued.acquiring().priority(Priority::Low).acquire().await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(queued.queue_len().await?, 1, "the low-priority wait queued");

    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(
        queued.queue_len().await?,
        1,
        "the queued waiter's ticket expired while it was still waiting"
    );
    assert!(!heavy.is_finished() && !low.is_finished());
    heavy.abort();
    low.abort();
    held.release().await?;
    Ok(())
}

/// A role that may use pg-semaphore (through membership of the owner) but
/// open only `limit` connections, so a pool can hold them all and nothing
/// else (the LISTEN connection) can connect.
async fn limited_role(db: &support::TestDb, limit: u32) -> TestResult<String> {
    let role = format!("{}_limited", db.name);
    let mut admin = PgConnection::connect_with(&db.options).await?;
    let owner: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&mut admin)
        .await?;
    admin
        .execute(AssertSqlSafe(format!(
            r#"CREATE ROLE "{role}" LOGIN CONNECTION LIMIT {limit} PASSWORD 'limited-pw';
               GRANT "{owner}" TO "{role}";"#
        )))
        .await?;
    admin.close().await?;
    Ok(role)
}

/// A weighted acquire tries to claim at once, whether or not the LISTEN
/// connection is up: here it cannot connect at all (the role's connection
/// limit is taken by the pool), the fallback is 30 s away, and two slots are
/// free. It must succeed well within its 2 s timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weighted_acquire_tries_before_waiting_for_the_listener() -> TestResult {
    let db = support::migrated_db().await;
    let role = limited_role(&db, 1).await?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .connect_with(db.options.clone().username(&role).password("limited-pw"))
        .await?;
    let sem = Semaphore::builder("no-listener", 3)
        .build(&pg_semaphore::Client::new(pool.clone()).fallback_interval(FAR))
        .await?;
    let started = Instant::now();
    let permit = sem
        .acquiring()
        .timeout(Duration::from_secs(2))
        .acquire_many(2)
        .await?;
    assert!(started.elapsed() < Duration::from_secs(1));
    permit.release().await?;
    Ok(())
}

/// A queue row of a crashed process, first in the queue.
async fn dead_waiter(db: &support::TestDb, semaphore: &str, lease: &str) -> TestResult {
    sqlx::query(
        "INSERT INTO pgsemaphore.waiters (semaphore, permits, priority, holder, expires_at) \
         VALUES ($1, 1, 1, 'crashed', clock_timestamp() + $2::interval)",
    )
    .bind(semaphore)
    .bind(lease)
    .execute(&db.pool)
    .await?;
    sqlx::query("UPDATE pgsemaphore.semaphores SET queue_used = true WHERE name = $1")
        .bind(semaphore)
        .execute(&db.pool)
        .await?;
    Ok(())
}

/// A waiter held up by a crashed process's queue row looks again when that
/// row's lease ends, without a reaper, a release or its fallback re-check
/// (30 s away): served within a second or two of the end, not at its next
/// renewal or fallback tick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_behind_a_crashed_waiter_looks_again_when_its_lease_ends() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("dead-waiter", 1)
        .queue(QueueOrder::OldestFirst)
        .build(&db.client.clone().fallback_interval(FAR))
        .await?;
    dead_waiter(&db, "dead-waiter", "4 s").await?;
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move { sem.acquire().await })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !waiter.is_finished(),
        "served past a live waiter ahead of it"
    );
    let permit = tokio::time::timeout(Duration::from_secs(3), waiter)
        .await
        .map_err(|_| "the waiter slept past the end of the dead waiter's lease")???;
    permit.release().await?;
    Ok(())
}

/// A claim or enqueue that deletes a dead queue row wakes the waiters behind
/// it: here the row's lease is ended behind the waiter's back (so it cannot
/// have planned to look at that moment), another process's queued acquire
/// deletes it as it joins the queue, and the first waiter must be served at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_an_expired_waiter_wakes_the_waiters_behind_it() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("dead-waiter", 1)
        .queue(QueueOrder::OldestFirst)
        .build(&db.client.clone().fallback_interval(FAR))
        .await?;
    dead_waiter(&db, "dead-waiter", "60 s").await?;
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move { sem.acquire().await })
    };
    tokio::time::sleep(Duration::from_millis(4500)).await;
    assert!(
        !waiter.is_finished(),
        "served past a live waiter ahead of it"
    );
    // Its process stopped renewing it long ago: its lease has ended.
    sqlx::query(
        "UPDATE pgsemaphore.waiters SET expires_at = clock_timestamp() - interval '1 s' \
          WHERE holder = 'crashed'",
    )
    .execute(&db.pool)
    .await?;

    // Another process's acquire joins the queue, deleting the dead row.
    let other = support::another_pool(&db, 2).await;
    let sem_b = Semaphore::builder("dead-waiter", 1)
        .queue(QueueOrder::OldestFirst)
        .build(&pg_semaphore::Client::new(other.clone()).fallback_interval(FAR))
        .await?;
    let second = tokio::spawn(async move { sem_b.acquire().await });
    let permit = tokio::time::timeout(Duration::from_millis(1500), waiter)
        .await
        .map_err(|_| "the waiter slept through the deletion of the dead row ahead of it")???;
    permit.release().await?;
    tokio::time::timeout(Duration::from_secs(5), second)
        .await???
        .release()
        .await?;
    Ok(())
}
