//! The audit log: finished claims stay, and the queries report holders,
//! history with outcomes and hold times, and summaries.

mod support;

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use pg_semaphore::{
    AdvisorySemaphore, Error, Semaphore,
    audit::{AuditLog, Outcome, SemaphoreKind},
};
use support::TestResult;

#[tokio::test]
async fn history_reports_every_claim_with_its_outcome() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("history", 3)
        .lease(Duration::from_millis(200))
        .without_heartbeat()
        .build(&db.client)
        .await?;
    let start = Utc::now() - chrono::Duration::seconds(1);

    let completed = sem
        .acquiring()
        .metadata(serde_json::json!({ "route": "/charge" }))
        .lease(Duration::from_secs(60))
        .try_acquire()
        .await?;
    let completed_id = completed.id();
    tokio::time::sleep(Duration::from_millis(50)).await;
    completed.release().await?;

    let abandoned = sem.try_acquire().await?; // lease 200 ms, never released
    let abandoned_id = abandoned.id();
    std::mem::forget(abandoned); // as if the process died: no background release
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(pg_semaphore::admin::reap(&db.pool).await?, 1);

    let live = sem
        .acquiring()
        .lease(Duration::from_secs(60))
        .try_acquire()
        .await?;

    let log = AuditLog::new(&db.pool);
    let history = log
        .history("history", start..Utc::now() + chrono::Duration::seconds(1))
        .await?;
    let outcomes: Vec<(Option<i64>, Outcome)> = history.iter().map(|c| (c.id, c.outcome)).collect();
    assert_eq!(
        outcomes,
        vec![
            (Some(completed_id), Outcome::Completed),
            (Some(abandoned_id), Outcome::TimedOut),
            (Some(live.id()), Outcome::Live)
        ]
    );
    assert!(
        history.iter().all(|c| c.kind == SemaphoreKind::Lease
            && c.slots.len() == 1
            && c.expires_at.is_some())
    );
    let first = &history[0];
    assert_eq!(
        first.metadata,
        Some(serde_json::json!({ "route": "/charge" }))
    );
    assert!(first.ended_at.is_some());
    assert!(
        first.held_for >= Duration::from_millis(50),
        "{:?}",
        first.held_for
    );
    assert!(first.held_for < Duration::from_secs(30));
    assert!(
        history[1].held_for >= Duration::from_millis(200),
        "held until reaped"
    );
    assert_eq!(history[2].ended_at, None);
    assert!(history.iter().all(|c| !c.holder.is_empty()));

    // A window that ends before the first claim sees nothing.
    let before = log
        .history("history", start - chrono::Duration::hours(1)..start)
        .await?;
    assert!(before.is_empty());
    // Other semaphores are not mixed in.
    assert!(log.history("other", start..Utc::now()).await?.is_empty());
    live.release().await?;
    Ok(())
}

/// Inserts a finished claim with exact timestamps (the audit queries only read
/// the table, so a fixture row is as good as a real claim).
async fn finished_claim(
    pool: &sqlx::PgPool,
    slot: i32,
    created_at: DateTime<Utc>,
    held: chrono::Duration,
    timed_out: bool,
) -> sqlx::Result<()> {
    let ended = created_at + held;
    sqlx::query(
        "INSERT INTO pgsemaphore.slots
             (semaphore, slot, holder, created_at, expires_at, completed_at, timed_out_at)
         VALUES ('summarised', $1, 'fixture', $2, $2 + interval '1 hour', $3, $4)",
    )
    .bind(slot)
    .bind(created_at)
    .bind((!timed_out).then_some(ended))
    .bind(timed_out.then_some(ended))
    .execute(pool)
    .await?;
    Ok(())
}

#[tokio::test]
async fn summary_counts_outcomes_and_hold_time_percentiles() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("summarised", 4)
        .build(&db.client)
        .await?;
    let t0 = Utc.with_ymd_and_hms(2026, 1, 1, 12, 0, 0).unwrap();
    // Held 1 s, 2 s, ..., 20 s; the 19 s and 20 s ones were reaped.
    for seconds in 1..=20 {
        let created = t0 + chrono::Duration::seconds(seconds * 60);
        finished_claim(
            &db.pool,
            0,
            created,
            chrono::Duration::seconds(seconds),
            seconds > 18,
        )
        .await?;
    }
    // One claim outside the window.
    finished_claim(
        &db.pool,
        0,
        t0 - chrono::Duration::days(1),
        chrono::Duration::seconds(500),
        false,
    )
    .await?;
    let window = t0..t0 + chrono::Duration::hours(1);

    let summary = sem.summary(window.clone()).await?;
    assert_eq!(summary.completed, 18);
    assert_eq!(summary.timed_out, 2);
    assert_eq!(summary.live, Some(0));
    assert_eq!(
        (summary.kind, summary.dropped),
        (SemaphoreKind::Lease, None)
    );
    assert_eq!(summary.total(), 20);
    // percentile_cont over 1..=20 s: p50 = 10.5 s, p95 = 19.05 s.
    assert_eq!(summary.p50_hold, Some(Duration::from_millis(10_500)));
    assert_eq!(summary.p95_hold, Some(Duration::from_millis(19_050)));
    assert_eq!(summary.max_hold, Some(Duration::from_secs(20)));

    // A live claim counts as live and stays out of the percentiles.
    let _live = sem.try_acquire().await?;
    let now = Utc::now();
    let recent = sem.summary(now - chrono::Duration::minutes(1)..now).await?;
    assert_eq!(
        (recent.completed, recent.timed_out, recent.live),
        (0, 0, Some(1))
    );
    assert_eq!(recent.p50_hold, None);

    // An empty window is all zeros.
    let empty = AuditLog::new(&db.pool)
        .summary(
            "summarised",
            t0 - chrono::Duration::days(30)..t0 - chrono::Duration::days(29),
        )
        .await?;
    assert_eq!(empty.total(), 0);
    assert_eq!(empty.p95_hold, None);
    Ok(())
}

#[tokio::test]
async fn holders_lists_live_claims_only() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("holders", 3)
        .build(&db.client.clone().holder("web-1"))
        .await?;
    let a = sem.try_acquire().await?;
    let b = sem.acquiring().holder("web-2").try_acquire().await?;
    let log = AuditLog::new(&db.pool);
    let holders = log.holders("holders").await?;
    assert_eq!(
        holders
            .iter()
            .map(|h| (h.id, h.slot, h.holder.as_deref()))
            .collect::<Vec<_>>(),
        vec![
            (Some(a.id()), 0, Some("web-1")),
            (Some(b.id()), 1, Some("web-2"))
        ]
    );
    assert!(
        holders.iter().all(|h| h.kind == SemaphoreKind::Lease
            && h.expires_at > h.created_at
            && h.pid.is_none())
    );
    a.release().await?;
    let holders = log.holders("holders").await?;
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0].id, Some(b.id()));
    // The released claim is still in the log.
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.slots")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(rows, 2);
    Ok(())
}

#[tokio::test]
async fn a_window_that_ends_before_it_starts_is_rejected() -> TestResult {
    let db = support::migrated_db().await;
    let log = AuditLog::new(&db.pool);
    let now = Utc::now();
    let backwards = now..now - chrono::Duration::seconds(1);
    assert!(matches!(
        log.history("x", backwards.clone()).await,
        Err(Error::InvalidArgument {
            argument: "window",
            ..
        })
    ));
    assert!(matches!(
        log.summary("x", backwards).await,
        Err(Error::InvalidArgument {
            argument: "window",
            ..
        })
    ));
    Ok(())
}

#[tokio::test]
async fn prune_deletes_only_finished_claims_past_the_cutoff() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("summarised", 4)
        .build(&db.client)
        .await?;
    let now = Utc::now();
    // 12,000 claims that ended two hours ago (more than one prune batch) ...
    sqlx::query(
        "INSERT INTO pgsemaphore.slots (semaphore, slot, holder, created_at, expires_at, completed_at)
         SELECT 'summarised', 0, 'old', $1, $1 + interval '1 hour', $1 + interval '1 second'
           FROM generate_series(1, 12000)",
    )
    .bind(now - chrono::Duration::hours(2))
    .execute(&db.pool)
    .await?;
    // ... one reaped an hour and a half ago, one that ended a minute ago ...
    finished_claim(
        &db.pool,
        1,
        now - chrono::Duration::minutes(100),
        chrono::Duration::minutes(10),
        true,
    )
    .await?;
    finished_claim(
        &db.pool,
        2,
        now - chrono::Duration::minutes(2),
        chrono::Duration::minutes(1),
        false,
    )
    .await?;
    // ... and a live claim older than all of them.
    sqlx::query(
        "INSERT INTO pgsemaphore.slots (semaphore, slot, holder, created_at, expires_at)
         VALUES ('summarised', 3, 'ancient but live', $1, $1 + interval '1 day')",
    )
    .bind(now - chrono::Duration::hours(3))
    .execute(&db.pool)
    .await?;

    let deleted = pg_semaphore::admin::prune_claims(&db.pool, Duration::from_secs(3600)).await?;
    assert_eq!(deleted, 12_001);
    let left: Vec<String> =
        sqlx::query_scalar("SELECT holder FROM pgsemaphore.slots ORDER BY created_at")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(
        left,
        vec!["ancient but live".to_owned(), "fixture".to_owned()]
    );
    assert_eq!(sem.holders().await?.len(), 1, "the live claim is untouched");
    assert_eq!(
        pg_semaphore::admin::prune_claims(&db.pool, Duration::from_secs(3600)).await?,
        0
    );
    // Zero retention: every finished claim goes, the live one stays.
    assert_eq!(
        pg_semaphore::admin::prune_claims(&db.pool, Duration::ZERO).await?,
        1
    );
    assert!(matches!(
        pg_semaphore::admin::prune_claims(&db.pool, Duration::MAX).await,
        Err(Error::InvalidArgument {
            argument: "older_than",
            ..
        })
    ));
    Ok(())
}

#[tokio::test]
async fn a_reaper_with_retention_keeps_the_log_bounded() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("retained", 2).build(&db.client).await?;
    for _ in 0..20 {
        sem.try_acquire().await?.release().await?;
    }
    let live = sem.try_acquire().await?;
    let reaper = pg_semaphore::admin::Reaper::builder()
        .interval(Duration::from_millis(50))
        .retention(Duration::from_millis(200))
        .spawn(&db.pool)?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.slots")
            .fetch_one(&db.pool)
            .await?;
        if rows == 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "still {rows} rows");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    reaper.shutdown().await;
    assert_eq!(sem.holders().await?[0].id, Some(live.id()));
    assert!(matches!(
        pg_semaphore::admin::Reaper::builder()
            .retention(Duration::MAX)
            .spawn(&db.pool),
        Err(Error::InvalidArgument {
            argument: "retention",
            ..
        })
    ));
    Ok(())
}

/// Pruning with nothing old enough reads (almost) nothing: the reaper calls
/// it every round, and a slot table of a busy semaphore holds hundreds of
/// thousands of recent claims. Counted by the statistics of the pruning
/// transaction itself: rows fetched by sequential and index scans.
#[tokio::test]
async fn pruning_nothing_does_not_walk_the_audit_log() -> TestResult {
    let db = support::migrated_db().await;
    Semaphore::builder("busy-log", 4).build(&db.client).await?;
    sqlx::query(
        "INSERT INTO pgsemaphore.slots (semaphore, slot, holder, created_at, expires_at, completed_at)
         SELECT 'busy-log', 0, 'recent', t, t + interval '1 minute', t + interval '1 second'
           FROM (SELECT clock_timestamp() - interval '1 hour' + i * interval '10 ms' AS t
                   FROM generate_series(1, 50000) AS i) AS s",
    )
    .execute(&db.pool)
    .await?;
    sqlx::query("ANALYZE pgsemaphore.slots")
        .execute(&db.pool)
        .await?;
    // The advisory semaphores' log too, which prune deletes from since issue
    // 32: read through its BRIN index, whose full block ranges are
    // summarised (by autovacuum as each fills; here by VACUUM). What is left
    // to read is the newest range, not summarised yet: at most 128 pages,
    // about 11,000 of these rows, of the 200,000.
    sqlx::query(
        "INSERT INTO pgsemaphore.advisory_claims (semaphore, slots, holder, acquired_at, ended_at, outcome)
         SELECT 'busy-log', '{0}', 'recent', t, t + interval '1 second', 'released'
           FROM (SELECT clock_timestamp() - interval '1 hour' + i * interval '10 ms' AS t
                   FROM generate_series(1, 200000) AS i) AS s",
    )
    .execute(&db.pool)
    .await?;
    sqlx::query("VACUUM (ANALYZE) pgsemaphore.advisory_claims")
        .execute(&db.pool)
        .await?;

    let mut tx = db.pool.begin().await?;
    let deleted: i64 = sqlx::query_scalar(
        "SELECT pgsemaphore.prune(p_older_than => interval '1 day', p_batch => 5000)",
    )
    .fetch_one(&mut *tx)
    .await?;
    let (seq_read, idx_fetched): (i64, i64) = sqlx::query_as(
        "SELECT coalesce(seq_tup_read, 0), coalesce(idx_tup_fetch, 0)
           FROM pg_stat_xact_user_tables WHERE relid = 'pgsemaphore.slots'::regclass",
    )
    .fetch_one(&mut *tx)
    .await?;
    let (log_seq_read, log_fetched): (i64, i64) = sqlx::query_as(
        "SELECT coalesce(seq_tup_read, 0), coalesce(idx_tup_fetch, 0)
           FROM pg_stat_xact_user_tables WHERE relid = 'pgsemaphore.advisory_claims'::regclass",
    )
    .fetch_one(&mut *tx)
    .await?;
    tx.rollback().await?;
    assert_eq!(deleted, 0);
    assert!(
        seq_read + idx_fetched < 1_000,
        "pruning nothing read {seq_read} rows sequentially and fetched {idx_fetched} by index"
    );
    assert!(
        log_seq_read + log_fetched < 15_000,
        "pruning nothing read {log_seq_read} advisory log rows sequentially and fetched {log_fetched} \
         (of 200,000)"
    );
    Ok(())
}

/// Appends a lost permit of `semaphore` on `slot` to the advisory audit log,
/// acquired `ago` (an interval) before now and held 3 s, as a holder's
/// audit writer does (`pgsemaphore.advisory_log`): a session that died
/// leaves no other trace of its permit.
async fn log_lost_permit(
    db: &support::TestDb,
    semaphore: &str,
    slot: i32,
    ago: &str,
) -> sqlx::Result<()> {
    sqlx::query(
        "SELECT pgsemaphore.advisory_log(
             p_semaphores => ARRAY[$1::text], p_holders => '{crashed}', p_slot_counts => '{1}',
             p_slots => ARRAY[$2::int], p_metadata => ARRAY[jsonb_build_object('job', 'j-9')],
             p_acquired_at => ARRAY[now() - $3::interval],
             p_ended_at => ARRAY[now() - $3::interval + interval '3 seconds'],
             p_outcomes => '{lost}')",
    )
    .bind(semaphore)
    .bind(slot)
    .bind(ago)
    .execute(&db.pool)
    .await?;
    Ok(())
}

/// An advisory semaphore's finished permits come back from its log, with
/// their slots, outcome and hold time; its live permit does not; and its
/// report draws them, a lane per slot.
#[tokio::test]
async fn an_advisory_semaphore_s_finished_permits_are_its_history_and_its_report() -> TestResult {
    let db = support::migrated_db().await;
    let sem = AdvisorySemaphore::builder("exports", 3)
        .build(&db.client.clone().holder("batch-1"))
        .await?;
    sem.try_acquire().await?.release().await?;
    drop(sem.try_acquire_many(2).await?);
    log_lost_permit(&db, "exports", 2, "10 minutes").await?;
    AdvisorySemaphore::builder("another", 1)
        .build(&db.client)
        .await?;
    log_lost_permit(&db, "another", 0, "10 minutes").await?; // another semaphore's
    log_lost_permit(&db, "exports", 1, "3 hours").await?; // before the window
    let logged = support::advisory_rows_logged(&db.pool, "exports", 4).await;
    assert!(logged, "the audit writer did not log both permits");
    let live = sem.try_acquire().await?; // held: not in the log

    let now = Utc::now();
    let window = now - chrono::Duration::hours(1)..now + chrono::Duration::seconds(1);
    let log = AuditLog::new(&db.pool);
    let permits = log.history("exports", window.clone()).await?;
    let seen: Vec<(Vec<u32>, &str, Outcome)> = permits
        .iter()
        .map(|p| (p.slots.clone(), p.holder.as_str(), p.outcome))
        .collect();
    assert_eq!(
        seen,
        [
            (vec![2], "crashed", Outcome::TimedOut),
            (vec![0], "batch-1", Outcome::Completed),
            (vec![0, 1], "batch-1", Outcome::Dropped),
        ]
    );
    // An advisory permit has no claim id and no lease.
    assert!(permits.iter().all(|p| p.kind == SemaphoreKind::Advisory
        && p.id.is_none()
        && p.expires_at.is_none()
        && p.ended_at.is_some()));
    assert_eq!(permits[0].held_for, Duration::from_secs(3));
    assert_eq!(
        permits[0].metadata,
        Some(serde_json::json!({ "job": "j-9" }))
    );
    assert!(Some(permits[1].created_at) <= permits[1].ended_at);

    let summary = log.summary("exports", window.clone()).await?;
    assert_eq!(
        (
            summary.kind,
            summary.total(),
            summary.completed,
            summary.dropped,
            summary.timed_out,
            summary.live
        ),
        (SemaphoreKind::Advisory, 3, 1, Some(1), 1, None)
    );
    assert_eq!(summary.max_hold, Some(Duration::from_secs(3)));
    // The live permit is a holder now: its session, on its slot.
    let holders = log.holders("exports").await?;
    assert_eq!(
        holders
            .iter()
            .map(|h| (h.kind, h.slot, h.pid, h.id))
            .collect::<Vec<_>>(),
        [(
            SemaphoreKind::Advisory,
            live.slot(),
            Some(live.backend_pid()),
            None
        )]
    );

    let report = log.report("exports", window.clone()).await?;
    assert_eq!(report.kind, SemaphoreKind::Advisory);
    assert_eq!(report.capacity, 3);
    assert_eq!(report.lanes, 3);
    assert!(!report.aggregated);
    assert_eq!(report.claims, permits);
    assert_eq!(report.summary, summary);
    // The two-slot permit holds two of the capacity at once.
    assert_eq!(report.occupancy.iter().map(|b| b.peak).max(), Some(2));
    let lanes: std::collections::BTreeSet<u32> = report.cells.iter().map(|c| c.lane).collect();
    assert_eq!(lanes.into_iter().collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(report.cells.iter().map(|c| c.timed_out).sum::<u64>(), 1);
    let holds: Vec<(u64, u64)> = report
        .hold_times
        .iter()
        .map(|b| (b.completed, b.timed_out))
        .collect();
    assert_eq!(holds.iter().map(|h| h.0).sum::<u64>(), 2);
    assert_eq!(
        holds.last(),
        Some(&(0, 1)),
        "the 3 s lost permit is the longest"
    );

    let err = log.report("never-built", window).await.unwrap_err();
    assert!(matches!(err, Error::SemaphoreNotFound { .. }), "{err:?}");
    live.release().await?;
    Ok(())
}
