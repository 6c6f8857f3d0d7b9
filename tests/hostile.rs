//! Hostile callers: the SQL functions are the security boundary, so each
//! test here calls them directly, as an application role (or a buggy client
//! of the same schema) could, with wrong tokens, NULLs, negative numbers,
//! other semaphores' tickets and transactions left open, and checks that no
//! caller can end, lock or outrun another's claim, and that the hard limit
//! and the wake-ups hold. Each test names the item of the review it pins.

mod support;

use std::time::{Duration, Instant};

use pg_semaphore::{Error, Semaphore};
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use support::{TestResult, connect, live_slots, raw_claim, token};

/// SQLSTATE of a failed statement.
fn sqlstate<T: std::fmt::Debug>(result: sqlx::Result<T>) -> Option<String> {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(error) => error
            .as_database_error()
            .and_then(|e| e.code())
            .map(|c| c.into_owned()),
    }
}

/// SQLSTATE and the COLUMN field (the argument's name) of a refused call.
fn refused<T: std::fmt::Debug>(result: sqlx::Result<T>) -> (String, Option<String>) {
    match result {
        Ok(value) => panic!("expected the call to be refused, got {value:?}"),
        Err(error) => {
            let db = error.as_database_error().expect("a database error");
            let column = db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .and_then(|e| e.column())
                .map(str::to_owned);
            (db.code().unwrap_or_default().into_owned(), column)
        }
    }
}

async fn open(pool: &PgPool, name: &str, capacity: i32) -> sqlx::Result<()> {
    sqlx::query("SELECT * FROM pgsemaphore.open(p_name => $1, p_capacity => $2, p_lease => '90 s')")
        .bind(name)
        .bind(capacity)
        .execute(pool)
        .await
        .map(drop)
}

async fn live_with_token(pool: &PgPool, token: &[u8]) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM pgsemaphore.live_slots WHERE token_hash = sha256($1::bytea)",
    )
    .bind(token)
    .fetch_one(pool)
    .await
}

/// Item 1. A release with a wrong token, of ids just above the largest one
/// (a long array stretches its statements), running again and again while
/// a victim claims: a last statement that timed out every live claim
/// among the ids with no token condition would end a claim that committed
/// between its statements under its holder. No victim claim may be ended
/// by anyone but its holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_with_a_wrong_token_never_ends_a_claim_that_commits_meanwhile() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "sprayed", 4).await?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attacker = {
        let (pool, stop) = (db.pool.clone(), stop.clone());
        tokio::spawn(async move {
            let wrong = token("attacker");
            let mut calls = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let max: i64 =
                    sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM pgsemaphore.slots")
                        .fetch_one(&pool)
                        .await?;
                let ids: Vec<i64> = (max + 1..=max + 100_000).collect();
                let (outcome,): (String,) =
                    sqlx::query_as("SELECT o_outcome FROM pgsemaphore.release($1, $2)")
                        .bind(ids)
                        .bind(&wrong)
                        .fetch_one(&pool)
                        .await?;
                assert_ne!(
                    outcome, "released",
                    "a stranger's release released something"
                );
                calls += 1;
            }
            Ok::<u32, sqlx::Error>(calls)
        })
    };
    let mut ended = Vec::new();
    for round in 0..40 {
        let mine = token(&format!("victim-{round}"));
        let (status, ids) = raw_claim(&db.pool, "sprayed", &mine).await?;
        assert_eq!(status, "claimed");
        let ids = ids.expect("claimed");
        tokio::time::sleep(Duration::from_millis(30)).await;
        let (outcome,): (String,) = sqlx::query_as(
            "SELECT o_outcome FROM pgsemaphore.renew($1, $2, '90 s') ORDER BY o_id LIMIT 1",
        )
        .bind(&ids)
        .bind(&mine)
        .fetch_one(&db.pool)
        .await?;
        if outcome != "renewed" {
            ended.push((ids[0], outcome));
        }
        sqlx::query("SELECT o_outcome FROM pgsemaphore.release($1, $2)")
            .bind(&ids)
            .bind(&mine)
            .execute(&db.pool)
            .await?;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let calls = attacker.await??;
    assert!(calls > 0, "the attacker never ran");
    assert!(
        ended.is_empty(),
        "{} of 40 victim claims were ended by a stranger's release ({calls} attacking calls): {ended:?}",
        ended.len()
    );
    Ok(())
}

/// Item 2. A release with a wrong token inside a transaction left open:
/// had it locked the victim's row (`FOR UPDATE` on every id given) before
/// answering `not_holder`, the holder's heartbeat would wait behind it.
/// Nothing may lock a row whose token does not match: the holder
/// renews, fences and releases while the stranger's transaction is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_with_a_wrong_token_locks_nothing() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "locked-out", 2).await?;
    let mine = token("holder");
    let id = support::claim_with_token(&db.pool, "locked-out", "90 s", &mine).await?;

    let mut stranger = connect(&db).await?;
    sqlx::query("BEGIN").execute(&mut stranger).await?;
    for call in [
        "SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], $2)",
        "SELECT o_outcome FROM pgsemaphore.renew(ARRAY[$1], $2, '1 s')",
        "SELECT o_outcome FROM pgsemaphore.fence(ARRAY[$1], $2)",
    ] {
        let (outcome,): (String,) = sqlx::query_as(call)
            .bind(id)
            .bind(token("stranger"))
            .fetch_one(&mut stranger)
            .await?;
        assert_eq!(outcome, "not_holder", "{call}");
    }

    let mut holder = connect(&db).await?;
    sqlx::query("SET lock_timeout = '1s'")
        .execute(&mut holder)
        .await?;
    let (renewed,): (String,) =
        sqlx::query_as("SELECT o_outcome FROM pgsemaphore.renew(ARRAY[$1], $2, '90 s')")
            .bind(id)
            .bind(&mine)
            .fetch_one(&mut holder)
            .await
            .map_err(|e| format!("the holder's renewal waited for a stranger's lock: {e}"))?;
    assert_eq!(renewed, "renewed");
    let (released,): (String,) =
        sqlx::query_as("SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], $2)")
            .bind(id)
            .bind(&mine)
            .fetch_one(&mut holder)
            .await?;
    assert_eq!(released, "released");
    sqlx::query("ROLLBACK").execute(&mut stranger).await?;
    Ok(())
}

/// Item 3. NULL and too-short tokens: were NULL accepted, a claim made with
/// a NULL token would be released by anyone passing NULL, `fence(NULL)`
/// would answer `held` without a lock and `renew(NULL)` would return no
/// row. Every function that
/// takes a token refuses a NULL, empty or short one (22023, `p_token`).
#[tokio::test]
async fn null_empty_and_short_tokens_are_refused_everywhere() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "tokens", 2).await?;
    let id = support::claim_with_token(&db.pool, "tokens", "90 s", &token("real")).await?;
    for bad in [None, Some(Vec::new()), Some(b"short".to_vec())] {
        let claimed = sqlx::query_as::<_, (String, Option<Vec<i64>>)>(
            "SELECT o_status, o_ids FROM pgsemaphore.claim('tokens', 'h', NULL, NULL, $1)",
        )
        .bind(bad.clone())
        .fetch_one(&db.pool)
        .await;
        assert_eq!(
            refused(claimed),
            ("22023".to_owned(), Some("p_token".to_owned())),
            "claim with token {bad:?}"
        );
        for call in [
            "SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], $2)",
            "SELECT o_outcome FROM pgsemaphore.renew(ARRAY[$1], $2, '1 min')",
            "SELECT o_outcome FROM pgsemaphore.fence(ARRAY[$1], $2)",
        ] {
            let result = sqlx::query_as::<_, (String,)>(call)
                .bind(id)
                .bind(bad.clone())
                .fetch_one(&db.pool)
                .await;
            assert_eq!(
                refused(result),
                ("22023".to_owned(), Some("p_token".to_owned())),
                "{call} with token {bad:?}"
            );
        }
    }
    assert_eq!(
        live_slots(&db.pool, "tokens").await?,
        1,
        "the real claim is untouched"
    );
    Ok(())
}

/// Item 4. A negative reserve: unchecked, a low-priority claim with
/// `p_reserve => -2`, after a capacity drop from 4 to 2 with holders on
/// slots 2 and 3, would take slots 0 and 1: four live claims at capacity 2.
#[tokio::test]
async fn a_negative_reserve_never_exceeds_the_capacity() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "reserve", 4).await?;
    let mut ids = Vec::new();
    for slot in 0..4 {
        ids.push(
            support::claim_with_token(&db.pool, "reserve", "90 s", &token(&format!("h{slot}")))
                .await?,
        );
    }
    for (slot, id) in ids.iter().enumerate().take(2) {
        sqlx::query("SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1], $2)")
            .bind(id)
            .bind(token(&format!("h{slot}")))
            .execute(&db.pool)
            .await?;
    }
    pg_semaphore::admin::set_capacity(&db.pool, "reserve", 2).await?;
    let result = sqlx::query_as::<_, (String,)>(
        "SELECT o_status FROM pgsemaphore.claim(p_semaphore => 'reserve', p_holder => 'low', \
         p_lease => NULL, p_metadata => NULL, p_token => $1, p_permits => 2, \
         p_priority => 0::smallint, p_reserve => -2)",
    )
    .bind(token("negative"))
    .fetch_one(&db.pool)
    .await;
    let live = live_slots(&db.pool, "reserve").await?;
    assert_eq!(live, 2, "{live} live claims at capacity 2");
    assert_eq!(
        refused(result),
        ("22023".to_owned(), Some("p_reserve".to_owned()))
    );
    Ok(())
}

/// Item 4, every argument: each application function refuses every bad
/// argument with SQLSTATE 22023 and the argument's name in COLUMN, and
/// writes nothing.
#[tokio::test]
async fn every_argument_of_every_application_function_is_checked() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "args", 2).await?;
    let long = "x".repeat(201);
    let cm = "SELECT * FROM pgsemaphore.check_limits(";
    // (call, the argument it must name)
    let cases: Vec<(String, &str)> = vec![
        ("SELECT * FROM pgsemaphore.open(NULL, 1, '1 s')".into(), "p_name"),
        ("SELECT * FROM pgsemaphore.open('', 1, '1 s')".into(), "p_name"),
        (format!("SELECT * FROM pgsemaphore.open('{long}', 1, '1 s')"), "p_name"),
        ("SELECT * FROM pgsemaphore.open('n', 0, '1 s')".into(), "p_capacity"),
        ("SELECT * FROM pgsemaphore.open('n', 100001, '1 s')".into(), "p_capacity"),
        ("SELECT * FROM pgsemaphore.open('n', NULL, '1 s')".into(), "p_capacity"),
        ("SELECT * FROM pgsemaphore.open('n', 1, '0 s')".into(), "p_lease"),
        ("SELECT * FROM pgsemaphore.open('n', 1, '-1 s')".into(), "p_lease"),
        ("SELECT * FROM pgsemaphore.open('n', 1, '367 days')".into(), "p_lease"),
        ("SELECT * FROM pgsemaphore.open('n', 1, NULL)".into(), "p_lease"),
        ("SELECT * FROM pgsemaphore.claim(NULL, 'h', NULL, NULL, $1)".into(), "p_semaphore"),
        ("SELECT * FROM pgsemaphore.claim('args', NULL, NULL, NULL, $1)".into(), "p_holder"),
        ("SELECT * FROM pgsemaphore.claim('args', '', NULL, NULL, $1)".into(), "p_holder"),
        ("SELECT * FROM pgsemaphore.claim('args', 'h', '5 ms', NULL, $1)".into(), "p_lease"),
        ("SELECT * FROM pgsemaphore.claim('args', 'h', '-1 day', NULL, $1)".into(), "p_lease"),
        ("SELECT * FROM pgsemaphore.claim('args', 'h', '400 days', NULL, $1)".into(), "p_lease"),
        (
            "SELECT * FROM pgsemaphore.claim('args', 'h', NULL, \
             jsonb_build_object('pad', repeat(md5(random()::text), 5000)), $1)"
                .into(),
            "p_metadata",
        ),
        ("SELECT * FROM pgsemaphore.claim('args', 'h', NULL, NULL, $1, p_permits => 0)".into(), "p_permits"),
        ("SELECT * FROM pgsemaphore.claim('args', 'h', NULL, NULL, $1, p_permits => -1)".into(), "p_permits"),
        ("SELECT * FROM pgsemaphore.claim('args', 'h', NULL, NULL, $1, p_permits => NULL)".into(), "p_permits"),
        ("SELECT * FROM pgsemaphore.claim('args', 'h', NULL, NULL, $1, p_priority => 2::smallint)".into(), "p_priority"),
        ("SELECT * FROM pgsemaphore.claim('args', 'h', NULL, NULL, $1, p_priority => -1::smallint)".into(), "p_priority"),
        ("SELECT * FROM pgsemaphore.claim('args', 'h', NULL, NULL, $1, p_priority => NULL)".into(), "p_priority"),
        ("SELECT * FROM pgsemaphore.claim('args', 'h', NULL, NULL, $1, p_reserve => NULL)".into(), "p_reserve"),
        (
            "SELECT * FROM pgsemaphore.claim('args', 'h', NULL, NULL, $1, p_ticket => 1, \
             p_ticket_token => NULL, p_waiter_lease => '10 s')"
                .into(),
            "p_ticket_token",
        ),
        (
            "SELECT * FROM pgsemaphore.claim('args', 'h', NULL, NULL, $1, p_ticket => 1, \
             p_ticket_token => $1, p_waiter_lease => '100 years')"
                .into(),
            "p_waiter_lease",
        ),
        (
            "SELECT * FROM pgsemaphore.claim('args', 'h', NULL, NULL, $1, p_ticket => 1, \
             p_ticket_token => $1, p_waiter_lease => NULL)"
                .into(),
            "p_waiter_lease",
        ),
        ("SELECT * FROM pgsemaphore.release(NULL, $1)".into(), "p_ids"),
        ("SELECT * FROM pgsemaphore.release('{}', $1)".into(), "p_ids"),
        ("SELECT * FROM pgsemaphore.release(ARRAY[1, NULL], $1)".into(), "p_ids"),
        ("SELECT * FROM pgsemaphore.release('{{1,2},{3,4}}', $1)".into(), "p_ids"),
        ("SELECT * FROM pgsemaphore.release(array_fill(1::bigint, ARRAY[100001]), $1)".into(), "p_ids"),
        ("SELECT * FROM pgsemaphore.release(ARRAY[1], $1, NULL)".into(), "p_lost"),
        ("SELECT * FROM pgsemaphore.renew(ARRAY[1], $1, NULL)".into(), "p_lease"),
        ("SELECT * FROM pgsemaphore.renew(ARRAY[1], $1, '0 s')".into(), "p_lease"),
        ("SELECT * FROM pgsemaphore.renew(ARRAY[1], $1, '1000 years')".into(), "p_lease"),
        ("SELECT * FROM pgsemaphore.renew(NULL, $1, '1 s')".into(), "p_ids"),
        ("SELECT * FROM pgsemaphore.fence(NULL, $1)".into(), "p_ids"),
        ("SELECT * FROM pgsemaphore.release_by_token(NULL, $1)".into(), "p_semaphore"),
        ("SELECT * FROM pgsemaphore.enqueue(NULL, 1, 1::smallint, 'h', NULL, '10 s', $1)".into(), "p_semaphore"),
        ("SELECT * FROM pgsemaphore.enqueue('args', 0, 1::smallint, 'h', NULL, '10 s', $1)".into(), "p_permits"),
        ("SELECT * FROM pgsemaphore.enqueue('args', 1, 2::smallint, 'h', NULL, '10 s', $1)".into(), "p_priority"),
        ("SELECT * FROM pgsemaphore.enqueue('args', 1, NULL, 'h', NULL, '10 s', $1)".into(), "p_priority"),
        ("SELECT * FROM pgsemaphore.enqueue('args', 1, 1::smallint, NULL, NULL, '10 s', $1)".into(), "p_holder"),
        ("SELECT * FROM pgsemaphore.enqueue('args', 1, 1::smallint, 'h', -1, '10 s', $1)".into(), "p_limit"),
        ("SELECT * FROM pgsemaphore.enqueue('args', 1, 1::smallint, 'h', NULL, '100 years', $1)".into(), "p_waiter_lease"),
        ("SELECT * FROM pgsemaphore.enqueue('args', 1, 1::smallint, 'h', NULL, '0 s', $1)".into(), "p_waiter_lease"),
        ("SELECT * FROM pgsemaphore.enqueue('args', 1, 1::smallint, 'h', NULL, NULL, $1)".into(), "p_waiter_lease"),
        ("SELECT * FROM pgsemaphore.enqueue('args', 1, 1::smallint, 'h', NULL, '10 s', $1, '')".into(), "p_fair_key"),
        (format!("SELECT * FROM pgsemaphore.enqueue('args', 1, 1::smallint, 'h', NULL, '10 s', $1, '{long}')"), "p_fair_key"),
        ("SELECT pgsemaphore.leave_queue(NULL, $1)".into(), "p_ticket"),
        ("SELECT pgsemaphore.keep_waiting('args', '100 years', '{}', $1, true, 1)".into(), "p_lease"),
        ("SELECT pgsemaphore.keep_waiting('args', NULL, '{}', $1, true, 1)".into(), "p_lease"),
        ("SELECT pgsemaphore.keep_waiting('args', '10 s', NULL, $1, true, 1)".into(), "p_tickets"),
        ("SELECT pgsemaphore.keep_waiting('args', '10 s', ARRAY[NULL::bigint], $1, true, 1)".into(), "p_tickets"),
        ("SELECT pgsemaphore.keep_waiting('args', '10 s', '{}', $1, NULL, 1)".into(), "p_register"),
        ("SELECT pgsemaphore.keep_waiting('args', '10 s', '{}', $1, true, NULL)".into(), "p_spell"),
        ("SELECT pgsemaphore.keep_waiting(NULL, '10 s', '{}', $1, true, 1)".into(), "p_semaphore"),
        ("SELECT pgsemaphore.stop_waiting('args', $1, NULL)".into(), "p_spell"),
        ("SELECT pgsemaphore.wake(NULL)".into(), "p_semaphore"),
        ("SELECT pgsemaphore.wake_claimed(NULL)".into(), "p_claim"),
        ("SELECT * FROM pgsemaphore.token_bucket(NULL, 'k', 1, 1, 1)".into(), "p_limiter"),
        ("SELECT * FROM pgsemaphore.token_bucket('l', NULL, 1, 1, 1)".into(), "p_key"),
        (format!("SELECT * FROM pgsemaphore.token_bucket('l', '{}', 1, 1, 1)", "k".repeat(257)), "p_key"),
        ("SELECT * FROM pgsemaphore.token_bucket('l', 'k', 'NaN', 1, 1)".into(), "p_rate"),
        ("SELECT * FROM pgsemaphore.token_bucket('l', 'k', 'Infinity', 1, 1)".into(), "p_rate"),
        ("SELECT * FROM pgsemaphore.token_bucket('l', 'k', 0, 1, 1)".into(), "p_rate"),
        ("SELECT * FROM pgsemaphore.token_bucket('l', 'k', 1, 'NaN', 1)".into(), "p_burst"),
        ("SELECT * FROM pgsemaphore.token_bucket('l', 'k', 1, 1, 'NaN')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.token_bucket('l', 'k', 1, 1, 2)".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve(NULL, 'k', 1, 1, 1, '1 s')".into(), "p_limiter"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', '', 1, 1, 1, '1 s')".into(), "p_key"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', -1, 1, 1, '1 s')".into(), "p_rate"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', NULL, 1, 1, '1 s')".into(), "p_rate"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', 1e-9, 1, 1, '1 s')".into(), "p_burst"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', 1, 'Infinity', 1, '1 s')".into(), "p_burst"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', 1, 1, 2, '1 s')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', 1, 1, 0, '1 s')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', 1, 1, -1, '1 s')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', 1, 1, 'NaN', '1 s')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', 1, 1, 1, NULL)".into(), "p_max_wait"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', 1, 1, 1, '-1 s')".into(), "p_max_wait"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', 1, 1, 1, '367 days')".into(), "p_max_wait"),
        ("SELECT * FROM pgsemaphore.token_bucket_reserve('l', 'k', 1, 1, 1, '1000 years')".into(), "p_max_wait"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve(NULL, 'k', 1, '1 s', 1, '1 s')".into(), "p_limiter"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', '', 1, '1 s', 1, '1 s')".into(), "p_key"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', 0, '1 s', 1, '1 s')".into(), "p_limit"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', -1, '1 s', 1, '1 s')".into(), "p_limit"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', 1, NULL, 1, '1 s')".into(), "p_window"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', 1, '0 s', 1, '1 s')".into(), "p_window"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', 1, '1000 years', 1, '1 s')".into(), "p_window"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', 1, '1 s', 2, '1 s')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', 1, '1 s', 0, '1 s')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', 1, '1 s', NULL, '1 s')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', 1, '1 s', 1, NULL)".into(), "p_max_wait"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', 1, '1 s', 1, '-1 s')".into(), "p_max_wait"),
        ("SELECT * FROM pgsemaphore.fixed_window_reserve('l', 'k', 1, '1 s', 1, '367 days')".into(), "p_max_wait"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve(NULL, 'k', 1, '1 s', 1, '1 s')".into(), "p_limiter"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', '', 1, '1 s', 1, '1 s')".into(), "p_key"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', 0, '1 s', 1, '1 s')".into(), "p_limit"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', -1, '1 s', 1, '1 s')".into(), "p_limit"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', 1, NULL, 1, '1 s')".into(), "p_window"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', 1, '0 s', 1, '1 s')".into(), "p_window"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', 1, '1000 years', 1, '1 s')".into(), "p_window"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', 1, '1 s', 2, '1 s')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', 1, '1 s', 0, '1 s')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', 1, '1 s', NULL, '1 s')".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', 1, '1 s', 1, NULL)".into(), "p_max_wait"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', 1, '1 s', 1, '-1 s')".into(), "p_max_wait"),
        ("SELECT * FROM pgsemaphore.sliding_window_reserve('l', 'k', 1, '1 s', 1, '367 days')".into(), "p_max_wait"),
        ("SELECT * FROM pgsemaphore.fixed_window('l', 'k', 0, '1 s', 1)".into(), "p_limit"),
        ("SELECT * FROM pgsemaphore.fixed_window('l', 'k', 1, NULL, 1)".into(), "p_window"),
        ("SELECT * FROM pgsemaphore.fixed_window('l', 'k', 1, '1 s', NULL)".into(), "p_n"),
        ("SELECT * FROM pgsemaphore.sliding_window('l', 'k', 1, '-1 s', 1)".into(), "p_window"),
        ("SELECT * FROM pgsemaphore.sliding_window('', 'k', 1, '1 s', 1)".into(), "p_limiter"),
        // Several limits, pauses, what is in force.
        (format!("{cm}NULL, '{{l}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_kinds"),
        (format!("{cm}'{{}}', '{{}}', '{{}}', '{{}}', '{{}}', '{{}}', '{{}}', 1)"), "p_kinds"),
        (format!("{cm}'{{{{token_bucket}}}}', '{{l}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_kinds"),
        (format!("{cm}'[0:0]={{token_bucket}}', '{{l}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_kinds"),
        (format!("{cm}array_fill('token_bucket'::text, ARRAY[17]), array_fill('l'::text, ARRAY[17]), array_fill('k'::text, ARRAY[17]), array_fill(1::float8, ARRAY[17]), array_fill(1::float8, ARRAY[17]), array_fill(NULL::bigint, ARRAY[17]), array_fill(NULL::interval, ARRAY[17]), 1)"), "p_kinds"),
        (format!("{cm}'{{NULL}}', '{{l}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_kinds"),
        (format!("{cm}'{{leaky_bucket}}', '{{l}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_kinds"),
        (format!("{cm}'{{token_bucket}}', '{{l,m}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_limiters"),
        (format!("{cm}'{{token_bucket}}', NULL, '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_limiters"),
        (format!("{cm}'{{token_bucket}}', '{{NULL}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_limiter"),
        (format!("{cm}'{{token_bucket}}', '{{l}}', '{{\"\"}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_key"),
        (format!("{cm}'{{token_bucket}}', '{{l}}', '{{k}}', '{{}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_rates"),
        (format!("{cm}'{{token_bucket}}', '{{l}}', '{{k}}', '{{1}}', NULL, '{{NULL}}', '{{NULL}}', 1)"), "p_bursts"),
        (format!("{cm}'{{token_bucket}}', '{{l}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL,NULL}}', '{{NULL}}', 1)"), "p_limits"),
        (format!("{cm}'{{token_bucket}}', '{{l}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '[2:2]={{NULL}}', 1)"), "p_windows"),
        (format!("{cm}'{{token_bucket}}', '{{l}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', NULL)"), "p_n"),
        (format!("{cm}'{{token_bucket}}', '{{l}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 0)"), "p_n"),
        (format!("{cm}'{{token_bucket}}', '{{l}}', '{{k}}', '{{1}}', '{{1}}', '{{NULL}}', '{{NULL}}', 2)"), "p_n"),
        (format!("{cm}'{{token_bucket}}', '{{l}}', '{{k}}', '{{NaN}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_rate"),
        (format!("{cm}'{{token_bucket}}', '{{l}}', '{{k}}', '{{NULL}}', '{{1}}', '{{NULL}}', '{{NULL}}', 1)"), "p_rate"),
        (format!("{cm}'{{fixed_window}}', '{{l}}', '{{k}}', '{{NULL}}', '{{NULL}}', '{{NULL}}', '{{1 s}}', 1)"), "p_limit"),
        (format!("{cm}'{{sliding_window}}', '{{l}}', '{{k}}', '{{NULL}}', '{{NULL}}', '{{1}}', '{{NULL}}', 1)"), "p_window"),
        (format!("{cm}'{{token_bucket,token_bucket}}', '{{l,l}}', '{{k,k}}', '{{1,1}}', '{{1,1}}', '{{NULL,NULL}}', '{{NULL,NULL}}', 1)"), "p_limiters"),
        ("SELECT pgsemaphore.pause_rate_limit(NULL, 'l', 'k', '1 s')".into(), "p_kind"),
        ("SELECT pgsemaphore.pause_rate_limit('semaphore', 'l', 'k', '1 s')".into(), "p_kind"),
        ("SELECT pgsemaphore.pause_rate_limit('token_bucket', NULL, 'k', '1 s')".into(), "p_limiter"),
        ("SELECT pgsemaphore.pause_rate_limit('token_bucket', 'l', '', '1 s')".into(), "p_key"),
        (format!("SELECT pgsemaphore.pause_rate_limit('token_bucket', 'l', '{}', '1 s')", "k".repeat(257)), "p_key"),
        ("SELECT pgsemaphore.pause_rate_limit('token_bucket', 'l', 'k', NULL)".into(), "p_for"),
        ("SELECT pgsemaphore.pause_rate_limit('token_bucket', 'l', 'k', '0 s')".into(), "p_for"),
        ("SELECT pgsemaphore.pause_rate_limit('token_bucket', 'l', 'k', '-1 s')".into(), "p_for"),
        ("SELECT pgsemaphore.pause_rate_limit('token_bucket', 'l', 'k', '61 minutes')".into(), "p_for"),
        ("SELECT pgsemaphore.pause_rate_limit('token_bucket', 'l', 'k', '1000 years')".into(), "p_for"),
        ("SELECT * FROM pgsemaphore.rate_limit_in_force('token_bucket', 'l', '')".into(), "p_key"),
        ("SELECT * FROM pgsemaphore.rate_limit_in_force('x', 'l', 'k')".into(), "p_kind"),
        ("SELECT pgsemaphore.set_rate_limit('token_bucket', 'l', NULL, 0, 1, NULL, NULL)".into(), "p_rate"),
        ("SELECT pgsemaphore.set_rate_limit('token_bucket', 'l', NULL, 1e-9, 1, NULL, NULL)".into(), "p_burst"),
        ("SELECT pgsemaphore.set_rate_limit('token_bucket', 'l', NULL, 1, 1, 5, NULL)".into(), "p_limit"),
        ("SELECT pgsemaphore.set_rate_limit('fixed_window', 'l', NULL, NULL, NULL, 0, '1 s')".into(), "p_limit"),
        ("SELECT pgsemaphore.set_rate_limit('fixed_window', 'l', NULL, 1, NULL, 5, '1 s')".into(), "p_rate"),
        ("SELECT pgsemaphore.set_rate_limit('sliding_window', 'l', NULL, NULL, NULL, 5, '367 days')".into(), "p_window"),
        ("SELECT pgsemaphore.set_rate_limit('sliding_window', 'l', '', NULL, NULL, 5, '1 s')".into(), "p_key"),
        ("SELECT pgsemaphore.clear_rate_limit('token_bucket', '', NULL)".into(), "p_limiter"),
        ("SELECT pgsemaphore.resume_rate_limit(NULL, 'l', NULL)".into(), "p_kind"),
        ("SELECT * FROM pgsemaphore.open_family(NULL, 1, '1 s', '0')".into(), "p_family"),
        ("SELECT * FROM pgsemaphore.open_family('a/b', 1, '1 s', '0')".into(), "p_family"),
        (format!("SELECT * FROM pgsemaphore.open_family('{}', 1, '1 s', '0')", "f".repeat(65)), "p_family"),
        ("SELECT * FROM pgsemaphore.open_family('f', 0, '1 s', '0')".into(), "p_capacity"),
        ("SELECT * FROM pgsemaphore.open_family('f', NULL, '1 s', '0')".into(), "p_capacity"),
        ("SELECT * FROM pgsemaphore.open_family('f', 1, '1 ms', '0')".into(), "p_lease"),
        ("SELECT * FROM pgsemaphore.open_family('f', 1, '1 s', NULL)".into(), "p_idle_after"),
        ("SELECT * FROM pgsemaphore.open_family('f', 1, '1 s', '-1 s')".into(), "p_idle_after"),
        ("SELECT * FROM pgsemaphore.open_family('f', 1, '1 s', '367 days')".into(), "p_idle_after"),
        ("SELECT * FROM pgsemaphore.open_family_key(NULL, 'k')".into(), "p_family"),
        ("SELECT * FROM pgsemaphore.open_family_key('@x', 'k')".into(), "p_family"),
        ("SELECT * FROM pgsemaphore.open_family_key('f', NULL)".into(), "p_key"),
        ("SELECT * FROM pgsemaphore.open_family_key('f', '')".into(), "p_key"),
        (format!("SELECT * FROM pgsemaphore.open_family_key('f', '{}')", "k".repeat(129)), "p_key"),
        ("SELECT * FROM pgsemaphore.open('@f/k', 1, '1 s')".into(), "p_name"),
        ("SELECT * FROM pgsemaphore.open_advisory('@f/k', 1)".into(), "p_name"),
    ];
    let mut wrong = Vec::new();
    for (call, argument) in &cases {
        let result = sqlx::query(sqlx::AssertSqlSafe(call.clone()))
            .bind(token("args"))
            .execute(&db.pool)
            .await;
        let got = match result {
            Ok(_) => ("accepted".to_owned(), None),
            Err(error) => {
                let db_error = error.as_database_error();
                (
                    db_error
                        .and_then(|e| e.code())
                        .map_or_else(|| error.to_string(), |c| c.into_owned()),
                    db_error
                        .and_then(|e| e.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
                        .and_then(|e| e.column())
                        .map(str::to_owned),
                )
            }
        };
        if got != ("22023".to_owned(), Some((*argument).to_owned())) {
            wrong.push(format!(
                "{call}\n    expected 22023 naming {argument}, got {got:?}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} bad calls were not refused as they should be:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    let (slots, waiters, limits): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pgsemaphore.slots), (SELECT count(*) FROM pgsemaphore.waiters),
                (SELECT count(*) FROM pgsemaphore.rate_limits)",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(
        (slots, waiters, limits),
        (0, 0, 0),
        "a refused call wrote something"
    );
    let (families, semaphores): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pgsemaphore.families), (SELECT count(*) FROM pgsemaphore.semaphores)",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(
        (families, semaphores),
        (0, 1),
        "a refused call wrote something"
    );
    Ok(())
}

/// Families: the application names a key and never chooses its capacity.
/// Opening an existing family with a bigger default changes nothing; a
/// named semaphore cannot take a family key's name (`@...`), and a family
/// key never takes over a named semaphore whose row already has such a name
/// (written around the trigger); a key of a family that does not exist is
/// P0002.
#[tokio::test]
async fn an_application_cannot_choose_a_family_keys_capacity() -> TestResult {
    let db = support::migrated_db().await;
    sqlx::query("SELECT * FROM pgsemaphore.open_family('tenants', 2, '10 s', '0')")
        .execute(&db.pool)
        .await?;
    let (capacity, created): (i32, bool) = sqlx::query_as(
        "SELECT o_capacity, o_created FROM pgsemaphore.open_family('tenants', 100000, '10 s', '0')",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!((capacity, created), (2, false));
    let (name, capacity): (String, i32) = sqlx::query_as(
        "SELECT o_name, o_capacity FROM pgsemaphore.open_family_key('tenants', 'k')",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!((name.as_str(), capacity), ("@tenants/k", 2));
    // Opening the key's name as a named semaphore with another capacity is refused.
    assert_eq!(
        refused(
            sqlx::query("SELECT * FROM pgsemaphore.open('@tenants/k', 500, '10 s')")
                .execute(&db.pool)
                .await
        ),
        ("22023".to_owned(), Some("p_name".to_owned()))
    );
    assert_eq!(
        sqlstate(
            sqlx::query("SELECT * FROM pgsemaphore.open_family_key('nobody', 'k')")
                .execute(&db.pool)
                .await
        )
        .as_deref(),
        Some("P0002")
    );
    // A named semaphore with an '@' name written around the trigger (here
    // by the owner) is never adopted as a family key.
    sqlx::query("ALTER TABLE pgsemaphore.semaphores DISABLE TRIGGER semaphores_one_kind_per_name")
        .execute(&db.pool)
        .await?;
    sqlx::query("INSERT INTO pgsemaphore.semaphores (name, capacity, default_lease) VALUES ('@tenants/old', 9, '10 s')")
        .execute(&db.pool)
        .await?;
    sqlx::query("ALTER TABLE pgsemaphore.semaphores ENABLE TRIGGER semaphores_one_kind_per_name")
        .execute(&db.pool)
        .await?;
    assert_eq!(
        refused(
            sqlx::query("SELECT * FROM pgsemaphore.open_family_key('tenants', 'old')")
                .execute(&db.pool)
                .await
        ),
        ("22023".to_owned(), Some("p_key".to_owned()))
    );
    let (capacity, created): (i32, bool) = sqlx::query_as(
        "SELECT o_capacity, o_created FROM pgsemaphore.open('@tenants/old', 1, '10 s')",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(
        (capacity, created),
        (9, false),
        "the old named semaphore keeps working"
    );
    Ok(())
}

/// A fairness key is NULL (the shared default key, also what a call
/// without the argument gets) or 1 to 200 characters:
/// the empty string and 201 characters are refused with 22023 naming
/// p_fair_key, and write nothing.
#[tokio::test]
async fn a_fairness_key_is_null_or_one_to_200_characters() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "keys", 1).await?;
    let enqueue = "SELECT o_ticket FROM pgsemaphore.enqueue('keys', 1, 1::smallint, 'h', NULL, \
                   '10 s', $1, p_fair_key => $2)";
    let old_shape =
        "SELECT o_ticket FROM pgsemaphore.enqueue('keys', 1, 1::smallint, 'h', NULL, '10 s', $1)";
    let longest = "k".repeat(200);
    for key in [None, Some("tenant-7"), Some(longest.as_str())] {
        let (ticket,): (Option<i64>,) = sqlx::query_as(enqueue)
            .bind(token("keyed"))
            .bind(key)
            .fetch_one(&db.pool)
            .await?;
        assert!(ticket.is_some(), "{key:?} refused");
    }
    let (ticket,): (Option<i64>,) = sqlx::query_as(old_shape)
        .bind(token("unkeyed"))
        .fetch_one(&db.pool)
        .await?;
    assert!(ticket.is_some());
    let keys: Vec<Option<String>> =
        sqlx::query_scalar("SELECT fair_key FROM pgsemaphore.waiters ORDER BY id")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(
        keys,
        [
            None,
            Some("tenant-7".to_owned()),
            Some(longest.clone()),
            None
        ]
    );

    let too_long = "k".repeat(201);
    for key in ["", too_long.as_str()] {
        let result = sqlx::query(enqueue)
            .bind(token("keyed"))
            .bind(key)
            .execute(&db.pool)
            .await;
        assert_eq!(
            refused(result),
            ("22023".to_owned(), Some("p_fair_key".to_owned())),
            "{} characters",
            key.len()
        );
    }
    let (waiters,): (i64,) = sqlx::query_as("SELECT count(*) FROM pgsemaphore.waiters")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(waiters, 4, "a refused call queued someone");
    Ok(())
}

/// The crate reads the database's refusal as `Error::InvalidArgument`,
/// naming the argument: metadata too large for the audit log.
#[tokio::test]
async fn the_crate_reports_a_refused_argument_as_invalid_argument() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("crate-args", 1)
        .build(&db.client)
        .await?;
    let huge =
        serde_json::json!({ "pad": (0..20_000).map(|i| format!("{i:x}")).collect::<Vec<_>>() });
    match sem.acquiring().metadata(huge).try_acquire().await {
        Err(Error::InvalidArgument { argument, reason }) => {
            assert_eq!(argument, "metadata");
            assert!(reason.contains("64 kB"), "{reason}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(sem.available_permits().await?, 1);
    Ok(())
}

/// Item 5. A ticket of another semaphore: checked by id and token only,
/// it would jump this semaphore's queue. A
/// ticket proves a place only in its own semaphore's queue, for the
/// permits and priority it was queued with.
#[tokio::test]
async fn a_ticket_proves_a_place_only_in_its_own_queue() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "queue-a", 1).await?;
    open(&db.pool, "queue-b", 1).await?;
    let enqueue =
        "SELECT o_ticket FROM pgsemaphore.enqueue($1, 1, 1::smallint, 'h', NULL, '30 s', $2)";
    let jumper = token("jumper");
    // The jumper queues on A first (the smaller id), then W on B.
    let (foreign,): (Option<i64>,) = sqlx::query_as(enqueue)
        .bind("queue-a")
        .bind(&jumper)
        .fetch_one(&db.pool)
        .await?;
    let (own,): (Option<i64>,) = sqlx::query_as(enqueue)
        .bind("queue-b")
        .bind(token("w"))
        .fetch_one(&db.pool)
        .await?;
    assert!(foreign < own);
    let with_ticket = "SELECT o_status FROM pgsemaphore.claim(p_semaphore => 'queue-b', \
                       p_holder => 'h', p_lease => NULL, p_metadata => NULL, p_token => $1, \
                       p_ticket => $2, p_ticket_token => $3, p_waiter_lease => '30 s', \
                       p_priority => $4)";
    let (status,): (String,) = sqlx::query_as(with_ticket)
        .bind(token("jumper-claim"))
        .bind(foreign)
        .bind(&jumper)
        .bind(1i16)
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(
        status, "no_ticket",
        "another semaphore's ticket jumped the queue"
    );
    assert_eq!(live_slots(&db.pool, "queue-b").await?, 0);

    // W's own ticket, claimed at another priority than it was queued with:
    // not a proof either.
    let (status,): (String,) = sqlx::query_as(with_ticket)
        .bind(token("w-claim"))
        .bind(own)
        .bind(token("w"))
        .bind(0i16)
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(status, "no_ticket");
    Ok(())
}

/// Item 5. The queue's order is the semaphore's: `claim` takes no order
/// argument, and a LIFO semaphore serves its newest waiter first whoever
/// claims.
#[tokio::test]
async fn the_queue_order_belongs_to_the_semaphore() -> TestResult {
    let db = support::migrated_db().await;
    let per_call = sqlx::query(
        "SELECT * FROM pgsemaphore.claim(p_semaphore => 'x', p_holder => 'h', p_lease => NULL, \
         p_metadata => NULL, p_token => $1, p_lifo => true)",
    )
    .bind(token("lifo"))
    .execute(&db.pool)
    .await;
    assert_eq!(
        sqlstate(per_call).as_deref(),
        Some("42883"),
        "claim takes no order"
    );

    sqlx::query("SELECT * FROM pgsemaphore.open('newest', 1, '90 s', p_queue_lifo => true)")
        .execute(&db.pool)
        .await?;
    let enqueue =
        "SELECT o_ticket FROM pgsemaphore.enqueue('newest', 1, 1::smallint, 'h', NULL, '30 s', $1)";
    let (older,): (Option<i64>,) = sqlx::query_as(enqueue)
        .bind(token("older"))
        .fetch_one(&db.pool)
        .await?;
    let (newer,): (Option<i64>,) = sqlx::query_as(enqueue)
        .bind(token("newer"))
        .fetch_one(&db.pool)
        .await?;
    let with_ticket = "SELECT o_status FROM pgsemaphore.claim(p_semaphore => 'newest', \
                       p_holder => 'h', p_lease => NULL, p_metadata => NULL, p_token => $1, \
                       p_ticket => $2, p_ticket_token => $3, p_waiter_lease => '30 s')";
    let (status,): (String,) = sqlx::query_as(with_ticket)
        .bind(token("older-claim"))
        .bind(older)
        .bind(token("older"))
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(status, "behind");
    let (status,): (String,) = sqlx::query_as(with_ticket)
        .bind(token("newer-claim"))
        .bind(newer)
        .bind(token("newer"))
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(status, "claimed");
    Ok(())
}

/// Item 6. A waiter that blocks the queue: its lease is bounded (60 s; a
/// 100-year lease would block every plain claim for good), and an
/// operator clears the queue.
#[tokio::test]
async fn an_operator_clears_a_queue_that_a_waiter_blocks() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("blocked-queue", 2)
        .build(&db.client)
        .await?;
    let (ticket,): (Option<i64>,) = sqlx::query_as(
        "SELECT o_ticket FROM pgsemaphore.enqueue('blocked-queue', 1, 1::smallint, 'squatter', NULL, '60 s', $1)",
    )
    .bind(token("squatter"))
    .fetch_one(&db.pool)
    .await?;
    assert!(ticket.is_some());
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    assert_eq!(
        pg_semaphore::admin::clear_queue(&db.pool, "blocked-queue").await?,
        1
    );
    let permit = sem.try_acquire().await?;
    permit.release().await?;
    assert!(matches!(
        pg_semaphore::admin::clear_queue(&db.pool, "no-such-semaphore").await,
        Err(Error::SemaphoreNotFound { .. })
    ));
    Ok(())
}

/// Item 6. A claim left uncommitted in a caller's transaction holds the
/// semaphore's row; unbounded, every other claim would wait on it without
/// limit. Another claim waits at most the functions' lock_timeout (2 s)
/// and is refused with 55P03 (`Error::Stalled` from the crate), and a
/// waiting acquire rides it out until the row is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_left_open_stalls_other_claims_for_at_most_the_bound() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("stalled", 2).build(&db.client).await?;
    let mut squatter = connect(&db).await?;
    sqlx::query("BEGIN").execute(&mut squatter).await?;
    let (status, _) = raw_claim(&mut squatter, "stalled", &token("squatter")).await?;
    assert_eq!(status, "claimed");

    let mut other = connect(&db).await?;
    sqlx::query("SET statement_timeout = '10s'")
        .execute(&mut other)
        .await?;
    let started = Instant::now();
    let raw = raw_claim(&mut other, "stalled", &token("other")).await;
    let waited = started.elapsed();
    assert_eq!(sqlstate(raw).as_deref(), Some("55P03"), "after {waited:?}");
    assert!(waited < Duration::from_secs(5), "waited {waited:?}");

    let started = Instant::now();
    match sem.try_acquire().await {
        Err(Error::Stalled { semaphore }) => assert_eq!(semaphore, "stalled"),
        other => panic!("expected Error::Stalled, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));

    // A waiting acquire rides the stall out, and is served once the row is free.
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move {
            sem.acquiring()
                .timeout(Duration::from_secs(20))
                .acquire()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!waiter.is_finished(), "the waiter gave up on a stall");
    sqlx::query("ROLLBACK").execute(&mut squatter).await?;
    let permit = waiter.await??;
    permit.release().await?;
    Ok(())
}

/// A LISTEN connection on the channel every wake-up goes to.
async fn listener(db: &support::TestDb) -> sqlx::Result<PgListener> {
    let mut listener = PgListener::connect_with(&db.pool).await?;
    listener.listen("pgsemaphore").await?;
    Ok(listener)
}

/// Whether a wake-up for `semaphore` arrives within `within`.
async fn woken(listener: &mut PgListener, semaphore: &str, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, listener.recv()).await {
            Ok(Ok(n)) if n.payload() == semaphore => return true,
            Ok(Ok(_)) => continue,
            _ => return false,
        }
    }
}

/// A waiter W that registers for wake-ups and then claims while a
/// transaction T that frees the way is uncommitted: either W's claim (made
/// after its registration committed) succeeds, or W is woken after T
/// commits. `free` runs T's statement inside T.
async fn no_lost_wakeup(db: &support::TestDb, semaphore: &str, free: &str) -> TestResult {
    let mut listener = listener(db).await?;
    let mut t = connect(db).await?;
    sqlx::query("BEGIN").execute(&mut t).await?;
    sqlx::query(sqlx::AssertSqlSafe(free.to_owned()))
        .execute(&mut t)
        .await?;

    // W: registers (waiting for the gate if T holds it), then claims.
    let w = {
        let (pool, semaphore) = (db.pool.clone(), semaphore.to_owned());
        tokio::spawn(async move {
            sqlx::query("SELECT pgsemaphore.keep_waiting($1, interval '10 s', '{}', $2, true, 1)")
                .bind(&semaphore)
                .bind(token("w-process"))
                .execute(&pool)
                .await?;
            raw_claim(&pool, &semaphore, &token("w-claim")).await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    sqlx::query("COMMIT").execute(&mut t).await?;
    let (status, _) = tokio::time::timeout(Duration::from_secs(5), w).await???;
    if status != "claimed" {
        assert!(
            woken(&mut listener, semaphore, Duration::from_secs(2)).await,
            "lost wake-up: the waiter's claim was refused ({status}) and nobody woke it \
             after the transaction that freed the way committed"
        );
    }
    Ok(())
}

/// Item 7. `leave_queue` moves the queue's head: had it looked for
/// registered waiters inside its own transaction without the wake-up gate,
/// a waiter that registered and claimed while the leave was uncommitted
/// would be told `behind` and never woken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_the_queue_never_loses_a_wakeup() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "leaving", 1).await?;
    let (ticket,): (Option<i64>,) = sqlx::query_as(
        "SELECT o_ticket FROM pgsemaphore.enqueue('leaving', 1, 1::smallint, 'head', NULL, '30 s', $1)",
    )
    .bind(token("head"))
    .fetch_one(&db.pool)
    .await?;
    let head = format!(
        "SELECT pgsemaphore.leave_queue({}, '\\x{}')",
        ticket.expect("queued"),
        support_hex(&token("head"))
    );
    no_lost_wakeup(&db, "leaving", &head).await
}

/// Item 7. `reap` frees slots: had it, too, checked for waiters inside its
/// own transaction without the gate, a registration made meanwhile would be
/// missed (a waiter's claim skips a row the reaper holds, and counts it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reaping_never_loses_a_wakeup() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "reaped", 1).await?;
    support::claim_with_token(&db.pool, "reaped", "200 ms", &token("crashed")).await?;
    tokio::time::sleep(Duration::from_millis(400)).await;
    no_lost_wakeup(&db, "reaped", "SELECT pgsemaphore.reap()").await
}

fn support_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Item 8. A release of ids of two semaphores: it would check for waiters
/// on one and wake the other's. Such a call is refused; nothing is
/// released.
#[tokio::test]
async fn a_release_of_claims_of_two_semaphores_is_refused() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "two-a", 1).await?;
    open(&db.pool, "two-b", 1).await?;
    let mine = token("both");
    let a = support::claim_with_token(&db.pool, "two-a", "90 s", &mine).await?;
    let b = support::claim_with_token(&db.pool, "two-b", "90 s", &token("both-b")).await?;
    // The same token on both, as only a hand-made client could send.
    sqlx::query("UPDATE pgsemaphore.slots SET token_hash = sha256($1::bytea) WHERE id = $2")
        .bind(&mine)
        .bind(b)
        .execute(&db.pool)
        .await?;
    let result = sqlx::query_as::<_, (String,)>(
        "SELECT o_outcome FROM pgsemaphore.release(ARRAY[$1, $2], $3)",
    )
    .bind(a)
    .bind(b)
    .bind(&mine)
    .fetch_one(&db.pool)
    .await;
    assert_eq!(
        refused(result),
        ("22023".to_owned(), Some("p_ids".to_owned()))
    );
    assert_eq!(
        live_slots(&db.pool, "two-a").await? + live_slots(&db.pool, "two-b").await?,
        2
    );
    Ok(())
}

/// Item 9. "A claim whose reply is lost does not hold its slot": a client
/// that gives up while its claim still waits for the semaphore's row runs
/// `release_by_token` first, which would find nothing; the claim would then
/// commit and hold its slot for its whole lease. So the release waits for
/// the claim in flight (or leaves a tombstone that the claim refuses): once
/// it has returned, no claim with that token is live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_by_token_ends_a_claim_still_in_flight() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "in-flight", 3).await?;
    let lost = token("lost-reply");

    // Another claim holds the semaphore's row, uncommitted.
    let mut holder = connect(&db).await?;
    sqlx::query("BEGIN").execute(&mut holder).await?;
    raw_claim(&mut holder, "in-flight", &token("holder")).await?;

    // The claim whose reply will be lost waits for the row.
    let in_flight = {
        let pool = db.pool.clone();
        let lost = lost.clone();
        tokio::spawn(async move { raw_claim(&pool, "in-flight", &lost).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!in_flight.is_finished());

    // The client gave up: it releases by token.
    let release = {
        let pool = db.pool.clone();
        let lost = lost.clone();
        tokio::spawn(async move {
            sqlx::query("SELECT * FROM pgsemaphore.release_by_token('in-flight', $1)")
                .bind(lost)
                .execute(&pool)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query("COMMIT").execute(&mut holder).await?;
    release.await??;
    // The claim in flight either committed before the release looked (and
    // was ended by it) or was refused after it.
    let _ = in_flight.await?;
    assert_eq!(
        live_with_token(&db.pool, &lost).await?,
        0,
        "a claim released by its token holds its slot"
    );
    // And a later claim with that token is refused.
    let again = raw_claim(&db.pool, "in-flight", &lost).await;
    assert_eq!(
        refused(again),
        ("22023".to_owned(), Some("p_token".to_owned()))
    );
    Ok(())
}

/// Item 10. The audit log must not show a release before the fenced work
/// committed, as it would if `release` read its clock before waiting for
/// the row lock that a fence (`Permit::fence`) held. A release that waited
/// is stamped after the fenced transaction ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_waited_for_a_fence_is_stamped_after_it() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "fenced", 1).await?;
    let mine = token("fenced");
    let id = support::claim_with_token(&db.pool, "fenced", "90 s", &mine).await?;
    let mut fence = connect(&db).await?;
    sqlx::query("BEGIN").execute(&mut fence).await?;
    let (held,): (String,) =
        sqlx::query_as("SELECT o_outcome FROM pgsemaphore.fence(ARRAY[$1], $2)")
            .bind(id)
            .bind(&mine)
            .fetch_one(&mut fence)
            .await?;
    assert_eq!(held, "held");
    let release = {
        let pool = db.pool.clone();
        let mine = mine.clone();
        tokio::spawn(async move {
            sqlx::query_as::<_, (String, Option<chrono::DateTime<chrono::Utc>>)>(
                "SELECT o_outcome, o_at FROM pgsemaphore.release(ARRAY[$1], $2)",
            )
            .bind(id)
            .bind(mine)
            .fetch_one(&pool)
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !release.is_finished(),
        "the release did not wait for the fence"
    );
    let (work_done,): (chrono::DateTime<chrono::Utc>,) = sqlx::query_as("SELECT clock_timestamp()")
        .fetch_one(&mut fence)
        .await?;
    sqlx::query("COMMIT").execute(&mut fence).await?;
    let (outcome, at) = release.await??;
    assert_eq!(outcome, "released");
    let completed: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT completed_at FROM pgsemaphore.slots WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await?;
    assert!(
        completed >= work_done,
        "the audit log shows the release at {completed}, before the fenced work at {work_done}"
    );
    if let Some(at) = at {
        assert_eq!(at, completed);
    }
    Ok(())
}

/// The multi-limit claim's arrays, hostile: every bad shape is refused with
/// 22023 naming the argument, and nothing is claimed on any semaphore.
#[tokio::test]
async fn claim_all_refuses_every_bad_array_and_claims_nothing() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "ha", 2).await?;
    open(&db.pool, "hb", 2).await?;
    let call = |semaphores: &'static str, permits: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (String,)>(sqlx::AssertSqlSafe(format!(
                "SELECT o_status FROM pgsemaphore.claim_all(p_semaphores => {semaphores}, \
                 p_holder => 'h', p_lease => NULL, p_metadata => NULL, \
                 p_token => '\\x00112233445566778899aabbccddeeff'::bytea, p_permits => {permits})"
            )))
            .fetch_one(&pool)
            .await
        }
    };
    let seventeen = "(SELECT array_agg('s' || i) FROM generate_series(1, 17) i)";
    let long = "ARRAY['ha', repeat('x', 201)]";
    let cases: [(&str, &str, &str); 13] = [
        ("NULL", "NULL", "p_semaphores"),
        ("'{}'::text[]", "NULL", "p_semaphores"),
        (seventeen, "NULL", "p_semaphores"),
        ("ARRAY['ha', NULL]", "NULL", "p_semaphores"),
        ("ARRAY['ha', 'hb', 'ha']", "NULL", "p_semaphores"),
        ("ARRAY[['ha'], ['hb']]", "NULL", "p_semaphores"),
        ("ARRAY['ha', '']", "NULL", "p_semaphores"),
        (long, "NULL", "p_semaphores"),
        ("ARRAY['ha', 'hb']", "ARRAY[1]", "p_permits"),
        ("ARRAY['ha', 'hb']", "ARRAY[1, NULL]", "p_permits"),
        ("ARRAY['ha', 'hb']", "ARRAY[1, 0]", "p_permits"),
        ("ARRAY['ha', 'hb']", "ARRAY[-1, 1]", "p_permits"),
        ("ARRAY['ha', 'hb']", "ARRAY[1, 2147483647]", "p_permits"),
    ];
    for (semaphores, permits, argument) in cases {
        let (state, column) = refused(call(semaphores, permits).await);
        assert_eq!(
            (state.as_str(), column.as_deref()),
            ("22023", Some(argument)),
            "{semaphores} / {permits}"
        );
    }
    // The scalar arguments go through claim's own checks.
    let bad_token = sqlx::query(
        "SELECT * FROM pgsemaphore.claim_all(ARRAY['ha', 'hb'], 'h', NULL, NULL, '\\x00'::bytea)",
    )
    .execute(&db.pool)
    .await;
    assert_eq!(
        refused(bad_token),
        ("22023".to_owned(), Some("p_token".to_owned()))
    );
    let bad_lease = sqlx::query(
        "SELECT * FROM pgsemaphore.claim_all(ARRAY['ha', 'hb'], 'h', '-1 s', NULL, \
         '\\x00112233445566778899aabbccddeeff'::bytea)",
    )
    .execute(&db.pool)
    .await;
    assert_eq!(
        refused(bad_lease),
        ("22023".to_owned(), Some("p_lease".to_owned()))
    );
    // An unknown semaphore among known ones: P0002, and the known ones untouched.
    let unknown = sqlx::query(
        "SELECT * FROM pgsemaphore.claim_all(ARRAY['ha', 'nope'], 'h', NULL, NULL, \
         '\\x00112233445566778899aabbccddeeff'::bytea)",
    )
    .execute(&db.pool)
    .await;
    assert_eq!(sqlstate(unknown).as_deref(), Some("P0002"));
    // More permits than a capacity: refused as too_many, nothing taken.
    let (status,) = call("ARRAY['ha', 'hb']", "ARRAY[1, 3]").await?;
    assert_eq!(status, "too_many");
    assert_eq!(
        live_slots(&db.pool, "ha").await? + live_slots(&db.pool, "hb").await?,
        0
    );
    // And the same arrays, well formed, claim both.
    let (status,) = call("ARRAY['hb', 'ha']", "ARRAY[2, 1]").await?;
    assert_eq!(status, "claimed");
    assert_eq!(
        (
            live_slots(&db.pool, "ha").await?,
            live_slots(&db.pool, "hb").await?
        ),
        (1, 2)
    );
    Ok(())
}

/// The multi-limit claim's rate limits, hostile: half of them given, bad
/// kinds, lengths, NULLs, a key twice, or limits out of range are refused
/// with 22023 before anything is claimed or charged.
#[tokio::test]
async fn claim_all_refuses_bad_rate_limits_and_takes_nothing() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "hr", 2).await?;
    let call = |rates: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (String,)>(sqlx::AssertSqlSafe(format!(
                "SELECT o_status FROM pgsemaphore.claim_all(p_semaphores => ARRAY['hr'], \
                 p_holder => 'h', p_lease => NULL, p_metadata => NULL, \
                 p_token => '\\x00112233445566778899aabbccddeeff'::bytea{rates})"
            )))
            .fetch_one(&pool)
            .await
        }
    };
    let bucket = |kinds: &str, limiters: &str, keys: &str, rates: &str, bursts: &str| {
        format!(
            ", p_rate_kinds => {kinds}, p_rate_limiters => {limiters}, p_rate_keys => {keys}, \
             p_rate_rates => {rates}, p_rate_bursts => {bursts}, \
             p_rate_limits => ARRAY[NULL]::bigint[], p_rate_windows => ARRAY[NULL]::interval[]"
        )
    };
    let cases: Vec<(String, &str)> = vec![
        (", p_rate_limiters => ARRAY['l']".to_owned(), "p_rate_kinds"),
        (
            bucket(
                "ARRAY['nope']",
                "ARRAY['l']",
                "ARRAY['k']",
                "ARRAY[1.0]",
                "ARRAY[1.0]",
            ),
            "p_rate_kinds",
        ),
        (
            bucket(
                "ARRAY['token_bucket']",
                "ARRAY[NULL]::text[]",
                "ARRAY['k']",
                "ARRAY[1.0]",
                "ARRAY[1.0]",
            ),
            "p_rate_limiters",
        ),
        (
            bucket(
                "ARRAY['token_bucket']",
                "ARRAY['l']",
                "ARRAY['']",
                "ARRAY[1.0]",
                "ARRAY[1.0]",
            ),
            "p_rate_keys",
        ),
        (
            bucket(
                "ARRAY['token_bucket']",
                "ARRAY['l']",
                "ARRAY['k']",
                "ARRAY[-1.0]",
                "ARRAY[1.0]",
            ),
            "p_rate_rates",
        ),
        (
            bucket(
                "ARRAY['token_bucket']",
                "ARRAY['l']",
                "ARRAY['k']",
                "ARRAY[1.0]",
                "ARRAY['NaN']::float8[]",
            ),
            "p_rate_bursts",
        ),
        (
            bucket(
                "ARRAY['token_bucket']",
                "ARRAY['l', 'l']",
                "ARRAY['k']",
                "ARRAY[1.0]",
                "ARRAY[1.0]",
            ),
            "p_rate_limiters",
        ),
    ];
    for (rates, argument) in cases {
        let (state, column) = refused(call(Box::leak(rates.clone().into_boxed_str())).await);
        assert_eq!(
            (state.as_str(), column.as_deref()),
            ("22023", Some(argument)),
            "{rates}"
        );
    }
    let twice = ", p_rate_kinds => ARRAY['token_bucket', 'token_bucket'], p_rate_limiters => ARRAY['l', 'l'], \
                 p_rate_keys => ARRAY['k', 'k'], p_rate_rates => ARRAY[1.0, 1.0], p_rate_bursts => ARRAY[1.0, 1.0], \
                 p_rate_limits => ARRAY[NULL, NULL]::bigint[], p_rate_windows => ARRAY[NULL, NULL]::interval[]";
    let (state, column) = refused(call(twice).await);
    assert_eq!(
        (state.as_str(), column.as_deref()),
        ("22023", Some("p_rate_limiters"))
    );
    assert_eq!(live_slots(&db.pool, "hr").await?, 0);
    let charged: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.rate_ledger")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(charged, 0, "a refused call charged a limit");
    // Well formed: claimed and charged.
    let (status,) = call(", p_rate_kinds => ARRAY['token_bucket'], p_rate_limiters => ARRAY['l'], \
                          p_rate_keys => ARRAY['k'], p_rate_rates => ARRAY[1.0], p_rate_bursts => ARRAY[1.0], \
                          p_rate_limits => ARRAY[NULL]::bigint[], p_rate_windows => ARRAY[NULL]::interval[]")
        .await?;
    assert_eq!(status, "claimed");
    let (status,) = call(", p_rate_kinds => ARRAY['token_bucket'], p_rate_limiters => ARRAY['l'], \
                          p_rate_keys => ARRAY['k'], p_rate_rates => ARRAY[1.0], p_rate_bursts => ARRAY[1.0], \
                          p_rate_limits => ARRAY[NULL]::bigint[], p_rate_windows => ARRAY[NULL]::interval[]")
        .await?;
    assert_eq!(status, "rate_limited");
    assert_eq!(live_slots(&db.pool, "hr").await?, 1);
    Ok(())
}

/// release_all with a stranger's token locks and ends nothing, and with a
/// mix of the caller's ids and someone else's ends only the caller's,
/// reporting the other as not_holder.
#[tokio::test]
async fn release_all_ends_only_the_callers_own_claims() -> TestResult {
    let db = support::migrated_db().await;
    open(&db.pool, "ra", 1).await?;
    open(&db.pool, "rb", 1).await?;
    open(&db.pool, "rc", 1).await?;
    let mine = token("release-all-mine");
    let theirs = token("release-all-them");
    let (status, ids): (String, Option<Vec<i64>>) = sqlx::query_as(
        "SELECT o_status, o_ids FROM pgsemaphore.claim_all(ARRAY['ra', 'rb'], 'me', NULL, NULL, $1)",
    )
    .bind(&mine)
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(status, "claimed");
    let ids = ids.expect("claimed");
    let their_id = support::claim_with_token(&db.pool, "rc", "60 s", &theirs).await?;

    // A stranger's token, in an open transaction: nothing locked, nothing ended.
    let mut stranger = connect(&db).await?;
    sqlx::query("BEGIN").execute(&mut stranger).await?;
    let (outcome, id): (String, Option<i64>) =
        sqlx::query_as("SELECT o_outcome, o_id FROM pgsemaphore.release_all($1, $2)")
            .bind(&ids)
            .bind(&theirs)
            .fetch_one(&mut stranger)
            .await?;
    assert_eq!((outcome.as_str(), id), ("not_holder", Some(ids[0])));
    // The holder's own renewal does not wait for the stranger.
    let renewed: Vec<(i64, String)> = tokio::time::timeout(
        Duration::from_secs(5),
        sqlx::query_as("SELECT o_id, o_outcome FROM pgsemaphore.renew($1, $2, '60 s')")
            .bind(&ids)
            .bind(&mine)
            .fetch_all(&db.pool),
    )
    .await??;
    assert_eq!(renewed.len(), 2);
    sqlx::query("COMMIT").execute(&mut stranger).await?;
    assert_eq!(live_with_token(&db.pool, &mine).await?, 2);

    // Mine and theirs together: mine end, theirs stays, reported.
    let mut all = ids.clone();
    all.push(their_id);
    let (outcome, id): (String, Option<i64>) =
        sqlx::query_as("SELECT o_outcome, o_id FROM pgsemaphore.release_all($1, $2)")
            .bind(&all)
            .bind(&mine)
            .fetch_one(&db.pool)
            .await?;
    assert_eq!((outcome.as_str(), id), ("not_holder", Some(their_id)));
    assert_eq!(live_with_token(&db.pool, &mine).await?, 0);
    assert_eq!(live_with_token(&db.pool, &theirs).await?, 1);
    // Bad arrays: 22023 naming p_ids.
    for bad in ["NULL", "'{}'::bigint[]", "ARRAY[1, NULL]::bigint[]"] {
        let result = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT * FROM pgsemaphore.release_all({bad}, '\\x00112233445566778899aabbccddeeff'::bytea)"
        )))
        .execute(&db.pool)
        .await;
        assert_eq!(
            refused(result),
            ("22023".to_owned(), Some("p_ids".to_owned())),
            "{bad}"
        );
    }
    Ok(())
}
