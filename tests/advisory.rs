//! The advisory semaphore: slots held as session-level advisory locks.
//! Each test names the promise it pins: the hard limit (across processes,
//! across a capacity drop), waiting and wake-ups, the session as the lease
//! (a killed backend frees its slots at once and its holder is told), one
//! name for one kind, what an operator sees of its holders, and no row
//! written on the claim and release path.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pg_semaphore::{
    AdvisorySemaphore, Error, LostReason, Semaphore, admin::SemaphoreInfo, audit::SemaphoreKind,
};
use sqlx::PgPool;
use support::TestResult;

async fn advisory(
    pool: &PgPool,
    name: &str,
    capacity: u32,
) -> pg_semaphore::Result<AdvisorySemaphore> {
    AdvisorySemaphore::builder(name, capacity)
        .build(
            &pg_semaphore::Client::new(pool.clone())
                .advisory_heartbeat(Duration::from_millis(250))
                .fallback_interval(Duration::from_secs(60)),
        )
        .await
}

#[tokio::test]
async fn at_most_capacity_permits_are_held_and_a_release_frees_one() -> TestResult {
    let db = support::migrated_db().await;
    let sem = advisory(&db.pool, "basic", 2).await?;
    let a = sem.try_acquire().await?;
    let b = sem.try_acquire().await?;
    assert_eq!(
        {
            let mut slots = vec![a.slot(), b.slot()];
            slots.sort();
            slots
        },
        [0, 1]
    );
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { capacity: 2, .. })
    ));
    assert_eq!(sem.available_permits().await?, 0);
    a.release().await?;
    assert_eq!(sem.available_permits().await?, 1);
    let c = sem.try_acquire().await?;
    assert!(matches!(
        sem.try_acquire_many(2).await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    b.release().await?;
    c.release().await?;
    let both = sem.try_acquire_many(2).await?;
    assert_eq!(both.num_permits(), 2);
    assert!(matches!(
        sem.try_acquire_many(3).await,
        Err(Error::InvalidArgument {
            argument: "permits",
            ..
        })
    ));
    both.release().await?;
    assert_eq!(sem.available_permits().await?, 2);
    Ok(())
}

/// Many "processes" (a pool and a semaphore handle each, so their own
/// dedicated connections) hammer one semaphore; a shared counter of
/// holders never exceeds the capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_hard_limit_holds_across_processes() -> TestResult {
    let db = support::migrated_db().await;
    let capacity = 3;
    let holding = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for process in 0..4 {
        let pool = support::another_pool(&db, 3).await;
        let sem = AdvisorySemaphore::builder("limited", capacity)
            .build(&pg_semaphore::Client::new(pool.clone()).advisory_connections(3))
            .await?;
        for _ in 0..4 {
            let (sem, holding, most) = (sem.clone(), holding.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                let mut admitted = 0;
                for round in 0..60 {
                    let permit = if round % 3 == 0 {
                        tokio::time::timeout(Duration::from_secs(20), sem.acquire())
                            .await
                            .expect("admitted in time")?
                    } else {
                        match sem.try_acquire().await {
                            Ok(permit) => permit,
                            Err(Error::NoSlotsAvailable { .. }) => continue,
                            Err(error) => return Err(error),
                        }
                    };
                    let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    holding.fetch_sub(1, Ordering::SeqCst);
                    permit.release().await?;
                    admitted += 1;
                }
                let _ = process;
                Ok::<_, Error>(admitted)
            }));
        }
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await??;
    }
    assert!(admitted > 100, "only {admitted} admitted");
    assert!(
        most.load(Ordering::SeqCst) <= capacity as usize,
        "{} held at once at capacity {capacity}",
        most.load(Ordering::SeqCst)
    );
    Ok(())
}

/// Lowering the capacity while permits sit on slots above it admits nobody
/// until the holders are fewer than the new capacity.
#[tokio::test]
async fn a_capacity_drop_admits_nobody_until_the_holders_drain() -> TestResult {
    let db = support::migrated_db().await;
    let sem = advisory(&db.pool, "dropped", 4).await?;
    let other_pool = support::another_pool(&db, 2).await;
    let other = advisory(&other_pool, "dropped", 4).await?;
    let p = [
        sem.try_acquire().await?,
        sem.try_acquire().await?,
        other.try_acquire().await?,
        other.try_acquire().await?,
    ];
    let [p0, p1, p2, p3] = p;
    p0.release().await?;
    p1.release().await?;
    // Slots 2 and 3 (or whichever the two holders have) stay held.
    pg_semaphore::admin::set_capacity(&db.pool, "dropped", 2).await?;
    for handle in [&sem, &other] {
        assert!(
            matches!(
                handle.try_acquire().await,
                Err(Error::NoSlotsAvailable { .. })
            ),
            "admitted beside 2 holders at capacity 2"
        );
    }
    p2.release().await?;
    // One holder left: one more may come in, not two.
    let q = sem.try_acquire().await?;
    assert!(matches!(
        other.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    p3.release().await?;
    let r = other.try_acquire().await?;
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    q.release().await?;
    r.release().await?;
    // The drop is over: the peak came back down to the capacity.
    let peak: i32 = sqlx::query_scalar(
        "SELECT peak_capacity FROM pgsemaphore.advisory_semaphores WHERE name = 'dropped'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(peak, 2);
    Ok(())
}

/// A handle claims on its view of the semaphore's row (capacity, epoch),
/// read once: a raise by the operator, or another semaphore's change (the
/// epoch is shared), makes its next claim read the row again, and the new
/// capacity is used at once.
#[tokio::test]
async fn a_raise_and_another_semaphores_change_reach_a_handle_at_its_next_claim() -> TestResult {
    let db = support::migrated_db().await;
    let sem = advisory(&db.pool, "raised", 1).await?;
    let elsewhere = advisory(&db.pool, "elsewhere", 1).await?;
    let first = sem.try_acquire().await?;
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { capacity: 1, .. })
    ));
    pg_semaphore::admin::set_capacity(&db.pool, "raised", 2).await?;
    let second = sem.try_acquire().await?;
    assert_eq!(second.slot(), 1);
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { capacity: 2, .. })
    ));
    second.release().await?;
    // Another semaphore's change moves the shared epoch: the view is stale,
    // the claim reads again (and the general claim re-arms the row).
    let held = elsewhere.try_acquire().await?;
    pg_semaphore::admin::set_capacity(&db.pool, "elsewhere", 3).await?;
    for _ in 0..3 {
        let again = sem.try_acquire().await?;
        assert_eq!(again.slot(), 1);
        again.release().await?;
    }
    let armed: bool = sqlx::query_scalar(
        "SELECT epoch = pg_sequence_last_value('pgsemaphore.advisory_epoch') \
           FROM pgsemaphore.advisory_semaphores WHERE name = 'raised'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert!(armed, "the general claim re-armed the row");
    first.release().await?;
    held.release().await?;
    Ok(())
}

/// A waiter in another process is woken by a release (a NOTIFY, its
/// fallback a minute away), and one in the same process directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_a_release_in_any_process() -> TestResult {
    let db = support::migrated_db().await;
    let sem = advisory(&db.pool, "woken", 1).await?;
    let other_pool = support::another_pool(&db, 2).await;
    let remote = advisory(&other_pool, "woken", 1).await?;
    for waiter_sem in [remote.clone(), sem.clone()] {
        let held = sem.try_acquire().await?;
        let waiter = tokio::spawn(async move {
            let started = Instant::now();
            let permit = tokio::time::timeout(Duration::from_secs(20), waiter_sem.acquire())
                .await
                .expect("admitted in time")?;
            Ok::<_, Error>((permit, started))
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let released = Instant::now();
        held.release().await?;
        let (permit, _) = waiter.await??;
        let woken = released.elapsed();
        assert!(
            woken < Duration::from_secs(2),
            "woken {woken:?} after the release"
        );
        permit.release().await?;
    }
    Ok(())
}

/// The session is the lease: terminating a holder's backend frees its slot
/// at once, and the holder is told within about two heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_session_frees_its_slots_and_its_holder_is_told() -> TestResult {
    let db = support::migrated_db().await;
    let holder_pool = support::another_pool(&db, 2).await;
    let holder = advisory(&holder_pool, "killed", 1).await?;
    let sem = advisory(&db.pool, "killed", 1).await?;
    let permit = holder.try_acquire().await?;
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    let lost = permit.lost();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(permit.backend_pid())
        .execute(&db.pool)
        .await?;
    let killed = Instant::now();
    // The slot is free as soon as the backend is gone.
    let next = loop {
        match sem.try_acquire().await {
            Ok(permit) => break permit,
            Err(Error::NoSlotsAvailable { .. }) if killed.elapsed() < Duration::from_secs(2) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(error) => return Err(error.into()),
        }
    };
    let freed = killed.elapsed();
    let reason = tokio::time::timeout(Duration::from_secs(2), lost).await?;
    assert_eq!(reason, LostReason::ConnectionLost);
    assert!(permit.is_lost());
    assert!(matches!(
        permit.release().await,
        Err(Error::PermitLost {
            reason: LostReason::ConnectionLost,
            ..
        })
    ));
    assert!(
        freed < Duration::from_millis(500),
        "slot freed {freed:?} after the kill"
    );
    next.release().await?;
    // The holder's process carries on with a new session.
    holder.try_acquire().await?.release().await?;
    Ok(())
}

/// A name belongs to one kind: a lease semaphore and an advisory semaphore
/// of one name would each admit the capacity.
#[tokio::test]
async fn a_name_belongs_to_one_kind_of_semaphore() -> TestResult {
    let db = support::migrated_db().await;
    advisory(&db.pool, "advisory-name", 1).await?;
    Semaphore::builder("lease-name", 1)
        .build(&db.client)
        .await?;
    match Semaphore::builder("advisory-name", 1)
        .build(&db.client)
        .await
    {
        Err(Error::InvalidArgument {
            argument: "name",
            reason,
        }) => {
            assert!(reason.contains("advisory semaphore"), "{reason}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    match advisory(&db.pool, "lease-name", 1).await {
        Err(Error::InvalidArgument {
            argument: "name",
            reason,
        }) => {
            assert!(reason.contains("lease semaphore"), "{reason}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    Ok(())
}

/// The advisory semaphores `pg_semaphore::admin::semaphores` lists.
async fn advisory_semaphores(pool: &PgPool) -> pg_semaphore::Result<Vec<SemaphoreInfo>> {
    let mut list = pg_semaphore::admin::semaphores(pool).await?;
    list.retain(|s| s.kind == SemaphoreKind::Advisory);
    Ok(list)
}

/// `pg_semaphore::admin::semaphores` lists every semaphore of both kinds, by name,
/// with its kind; an advisory one with the sessions that hold its slots, by
/// slot: the
/// permits' own backends, any session that took a slot's key, and holders
/// left above a dropped capacity; a release takes its slots off the list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_semaphores_lists_the_sessions_that_hold_each_slot() -> TestResult {
    let db = support::migrated_db().await;
    let started: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT statement_timestamp()")
        .fetch_one(&db.pool)
        .await?;
    let listed = advisory(&db.pool, "listed", 4).await?;
    advisory(&db.pool, "idle", 1).await?;
    Semaphore::builder("leased", 1).build(&db.client).await?;
    let kinds: Vec<(String, SemaphoreKind)> = pg_semaphore::admin::semaphores(&db.pool)
        .await?
        .into_iter()
        .map(|s| (s.name, s.kind))
        .collect();
    assert_eq!(
        kinds,
        [
            ("idle".to_owned(), SemaphoreKind::Advisory),
            ("leased".to_owned(), SemaphoreKind::Lease),
            ("listed".to_owned(), SemaphoreKind::Advisory),
        ]
    );

    let pair = listed.try_acquire_many(2).await?;
    let one = listed.try_acquire().await?;
    assert_eq!((pair.slots(), one.slot()), (&[0, 1][..], 2));

    let list = advisory_semaphores(&db.pool).await?;
    let names: Vec<&str> = list.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["idle", "listed"]);
    assert_eq!((list[0].capacity, list[0].holders.len()), (1, 0));
    let sem = &list[1];
    assert_eq!(sem.capacity, 4);
    let seen: Vec<(u32, Option<i32>)> = sem.holders.iter().map(|h| (h.slot, h.pid)).collect();
    assert_eq!(
        seen,
        [
            (0, Some(pair.backend_pid())),
            (1, Some(pair.backend_pid())),
            (2, Some(one.backend_pid())),
        ]
    );
    assert_eq!(sem.default_lease, None);
    for h in &sem.holders {
        assert_eq!(
            (h.kind, h.id, h.shared),
            (SemaphoreKind::Advisory, None, Some(false))
        );
        assert_eq!(h.application_name.as_deref(), Some("pg-semaphore advisory"));
        let connected = h.backend_start.expect("our own sessions are visible");
        assert!(started <= connected && connected <= sem.as_of, "{h:?}");
    }

    // A session that takes a slot's key by hand holds it too.
    let key_base: i64 = sqlx::query_scalar(
        "SELECT key_base FROM pgsemaphore.advisory_semaphores WHERE name = 'listed'",
    )
    .fetch_one(&db.pool)
    .await?;
    let (mut squatter, squatter_pid) = {
        use sqlx::Connection;
        let mut conn =
            sqlx::PgConnection::connect_with(&db.options.clone().application_name("squatter"))
                .await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await?;
        (conn, pid)
    };
    sqlx::query("SELECT pg_advisory_lock($1 + 3)")
        .bind(key_base)
        .execute(&mut squatter)
        .await?;
    let list = advisory_semaphores(&db.pool).await?;
    let last = list[1].holders.last().expect("holders");
    assert_eq!(
        (last.slot, last.pid, last.application_name.as_deref()),
        (3, Some(squatter_pid), Some("squatter"))
    );
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut squatter)
        .await?;

    // A capacity drop below the slots held: they stay listed until released.
    pg_semaphore::admin::set_capacity(&db.pool, "listed", 1).await?;
    let list = advisory_semaphores(&db.pool).await?;
    assert_eq!((list[1].capacity, list[1].holders.len()), (1, 3));

    pair.release().await?;
    let list = advisory_semaphores(&db.pool).await?;
    let slots: Vec<u32> = list[1].holders.iter().map(|h| h.slot).collect();
    assert_eq!(slots, [2]);
    one.release().await?;
    let list = advisory_semaphores(&db.pool).await?;
    assert!(list.iter().all(|s| s.holders.is_empty()), "{list:?}");
    Ok(())
}

/// An advisory lock belongs to one database: a semaphore of the same name
/// (so the same keys) in another database of the cluster shares no slot
/// with this one, and neither lists the other's holders, counts them as
/// held, or keeps a capacity drop in force because of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_of_the_same_name_in_another_database_is_another_semaphore() -> TestResult {
    let (here, there) = (support::migrated_db().await, support::migrated_db().await);
    let ours = advisory(&here.pool, "same-name", 2).await?;
    let theirs = advisory(&there.pool, "same-name", 2).await?;
    let held = [ours.try_acquire().await?, ours.try_acquire().await?];
    assert_eq!(ours.available_permits().await?, 0);
    assert_eq!(
        theirs.available_permits().await?,
        2,
        "counted another database's holders"
    );
    let list = advisory_semaphores(&there.pool).await?;
    assert!(
        list[0].holders.is_empty(),
        "listed another database's holders: {list:?}"
    );
    let [a, b] = [theirs.try_acquire().await?, theirs.try_acquire().await?];
    a.release().await?;
    b.release().await?;

    // A drop from 2 to 1 there ends although slot 1 of the same keys is
    // held here.
    pg_semaphore::admin::set_capacity(&there.pool, "same-name", 1).await?;
    let c = theirs.try_acquire().await?;
    c.release().await?;
    let peak: i32 = sqlx::query_scalar(
        "SELECT peak_capacity FROM pgsemaphore.advisory_semaphores WHERE name = 'same-name'",
    )
    .fetch_one(&there.pool)
    .await?;
    assert_eq!(peak, 1, "the drop is over");
    for permit in held {
        permit.release().await?;
    }
    Ok(())
}

/// Claims and releases write no row: the statistics of every table of the
/// schema (but the audit log's, which is off here) do not move during a
/// run, once the sessions that ran it have ended and reported them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_and_releases_write_nothing() -> TestResult {
    let db = support::migrated_db().await;
    let stats = "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del + n_tup_hot_upd), 0)::bigint \
                 FROM pg_stat_user_tables WHERE schemaname = 'pgsemaphore'";
    {
        let pool = support::another_pool(&db, 2).await;
        let sem = AdvisorySemaphore::builder("silent", 4)
            .audit(false)
            .build(&pg_semaphore::Client::new(pool.clone()))
            .await?;
        sem.try_acquire().await?.release().await?;
        pool.close().await;
    }
    let read = |pool: PgPool| async move {
        let mut conn = pool.acquire().await?;
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *conn)
            .await?;
        sqlx::query_scalar::<_, i64>(stats)
            .fetch_one(&mut *conn)
            .await
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = read(db.pool.clone()).await?;
    {
        let pool = support::another_pool(&db, 2).await;
        let sem = AdvisorySemaphore::builder("silent", 4)
            .audit(false)
            .build(&pg_semaphore::Client::new(pool.clone()))
            .await?;
        for _ in 0..200 {
            let permit = sem.try_acquire().await?;
            let two = sem.try_acquire_many(2).await?;
            permit.release().await?;
            two.release().await?;
        }
        drop(sem);
        pool.close().await;
    }
    // The sessions' backends report their statistics as they exit.
    let mut after = before;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        after = read(db.pool.clone()).await?;
        if after != before {
            break;
        }
    }
    assert_eq!(after, before, "claims and releases wrote rows");
    Ok(())
}

/// The audit log gets one row per finished permit, off the hot path.
#[tokio::test]
async fn finished_permits_reach_the_audit_log() -> TestResult {
    let db = support::migrated_db().await;
    let sem = AdvisorySemaphore::builder("audited", 2)
        .build(&db.client.clone().holder("audit-test"))
        .await?;
    sem.try_acquire().await?.release().await?;
    drop(sem.try_acquire_many(2).await?);
    let logged = support::advisory_rows_logged(&db.pool, "audited", 2).await;
    assert!(logged, "the audit log did not get both permits");
    let rows: Vec<(Vec<i32>, String, String)> = sqlx::query_as(
        "SELECT slots, holder, outcome FROM pgsemaphore.advisory_claims \
         WHERE semaphore = 'audited' ORDER BY acquired_at",
    )
    .fetch_all(&db.pool)
    .await?;
    assert_eq!(
        rows[0],
        (vec![0], "audit-test".to_owned(), "released".to_owned())
    );
    assert_eq!(
        rows[1],
        (vec![0, 1], "audit-test".to_owned(), "dropped".to_owned())
    );
    Ok(())
}

/// A pool of two connections through `proxy`, for a holder whose link a
/// test cuts.
async fn pool_through(proxy: &support::proxy::Proxy) -> Result<PgPool, sqlx::Error> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(proxy.options())
        .await
}

/// Polls `sem` every 20 ms from `cut_off` until a slot is free (at most
/// 10 s): the permit, and when it was granted.
async fn acquire_once_freed(
    sem: &AdvisorySemaphore,
    cut_off: Instant,
) -> Result<(pg_semaphore::AdvisoryPermit, Instant), String> {
    loop {
        match sem.try_acquire().await {
            Ok(next) => return Ok((next, Instant::now())),
            Err(Error::NoSlotsAvailable { .. }) if cut_off.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => return Err(format!("no slot was freed: {error}")),
        }
    }
}

/// Behind a partition (a link that drops every packet, no reset): the
/// holder is told within about two heartbeats, and the server ends the
/// silent session after three, freeing the slot for others; no one else
/// got it before the holder was told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_holder_is_told_before_its_slot_is_freed() -> TestResult {
    let db = support::migrated_db().await;
    let proxy = support::proxy::Proxy::start(&db).await;
    let cut_pool = pool_through(&proxy).await?;
    let heartbeat = Duration::from_millis(300);
    let holder = AdvisorySemaphore::builder("partitioned", 1)
        .audit(false)
        .build(&pg_semaphore::Client::new(cut_pool.clone()).advisory_heartbeat(heartbeat))
        .await?;
    let sem = advisory(&db.pool, "partitioned", 1).await?;
    let permit = holder.try_acquire().await?;
    let lost = permit.lost();
    tokio::time::sleep(heartbeat * 2).await;
    assert!(!permit.is_lost());

    proxy.blackhole();
    let cut_off = Instant::now();
    let told = tokio::spawn(async move {
        let reason = lost.await;
        (reason, Instant::now())
    });
    let freed = acquire_once_freed(&sem, cut_off).await?;
    let (reason, told_at) = tokio::time::timeout(Duration::from_secs(5), told).await??;
    assert_eq!(reason, LostReason::ConnectionLost);
    let told_after = told_at - cut_off;
    let freed_after = freed.1 - cut_off;
    assert!(
        told_after <= heartbeat * 2 + Duration::from_millis(300),
        "told {told_after:?} after the cut, more than two heartbeats"
    );
    assert!(
        told_at < freed.1,
        "the slot was freed ({freed_after:?}) before its holder was told ({told_after:?})"
    );
    assert!(
        freed_after < Duration::from_secs(4),
        "freed {freed_after:?} after the cut"
    );
    freed.0.release().await?;
    proxy.restore();
    Ok(())
}

/// A statement lost on its way is given up, and the session's holders told,
/// before the server's dead-man switch frees their slots. The release of a
/// second permit goes out a little after the session's last answer, into a
/// link that forwards nothing; the server's switch fires three heartbeats
/// after the last statement it saw. (A statement bounded by three heartbeats
/// from its own start, as before, was given up that long after the server
/// had freed the slots: this test then fails by about the 200 ms between the
/// last answer and the release.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_lost_on_the_way_is_given_up_before_the_slots_are_freed() -> TestResult {
    let db = support::migrated_db().await;
    let proxy = support::proxy::Proxy::start(&db).await;
    let cut_pool = pool_through(&proxy).await?;
    let heartbeat = Duration::from_millis(500);
    // One session, so that both permits and the release share it.
    let holder = AdvisorySemaphore::builder("lost-on-the-way", 2)
        .audit(false)
        .build(
            &pg_semaphore::Client::new(cut_pool.clone())
                .advisory_heartbeat(heartbeat)
                .advisory_connections(1),
        )
        .await?;
    let sem = advisory(&db.pool, "lost-on-the-way", 2).await?;
    let first = holder.try_acquire().await?;
    let lost = first.lost();
    tokio::time::sleep(heartbeat * 2).await;
    assert!(!first.is_lost());
    // The session's last answer; no ping follows within half a heartbeat.
    let second = holder.try_acquire().await?;
    tokio::time::sleep(heartbeat * 2 / 5).await;

    proxy.blackhole();
    let cut_off = Instant::now();
    let release = tokio::spawn(second.release());
    let told = tokio::spawn(async move {
        let reason = lost.await;
        (reason, Instant::now())
    });
    let freed = acquire_once_freed(&sem, cut_off).await?;
    let (reason, told_at) = tokio::time::timeout(Duration::from_secs(5), told).await??;
    assert_eq!(reason, LostReason::ConnectionLost);
    let told_after = told_at - cut_off;
    let freed_after = freed.1 - cut_off;
    assert!(
        told_at < freed.1,
        "the slots were freed ({freed_after:?} after the release went out) before their holder \
         was told ({told_after:?})"
    );
    match tokio::time::timeout(Duration::from_secs(5), release).await?? {
        Err(Error::PermitLost { .. }) => {}
        other => return Err(format!("the lost release answered {other:?}").into()),
    }
    freed.0.release().await?;
    proxy.restore();
    Ok(())
}

/// A database restart loses every permit, and every holder is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_holder_is_told_when_the_sessions_die() -> TestResult {
    let db = support::migrated_db().await;
    let pool = support::another_pool(&db, 2).await;
    let sem = AdvisorySemaphore::builder("restarted", 4)
        .audit(false)
        .build(&pg_semaphore::Client::new(pool.clone()).advisory_connections(2))
        .await?;
    let permits = vec![
        sem.try_acquire().await?,
        sem.try_acquire().await?,
        sem.try_acquire_many(2).await?,
    ];
    // What a restart does to the sessions: every backend of them ends.
    let pids: Vec<i32> = permits.iter().map(|p| p.backend_pid()).collect();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) pid")
        .bind(&pids)
        .execute(&db.pool)
        .await?;
    for permit in &permits {
        let reason = tokio::time::timeout(Duration::from_secs(3), permit.lost()).await?;
        assert_eq!(reason, LostReason::ConnectionLost);
    }
    drop(permits);
    // Nothing is left held, and new permits come from new sessions.
    assert_eq!(sem.available_permits().await?, 4);
    sem.try_acquire_many(4).await?.release().await?;
    Ok(())
}

/// Behind PgBouncer in transaction pooling mode: the application's pool
/// goes through the bouncer, the slots' sessions connect directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn it_works_with_the_pool_behind_pgbouncer_and_its_sessions_direct() -> TestResult {
    if support::pgbouncer::installed().is_none() {
        return Ok(()); // skipped, with one line saying how to install it
    }
    let db = support::migrated_db().await;
    let bounced = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(support::pgbouncer::bouncer().await.options(&db.name))
        .await?;
    assert!(matches!(
        AdvisorySemaphore::builder("bounced", 1)
            .build(&pg_semaphore::Client::new(bounced.clone()).transaction_pooling(true))
            .await,
        Err(Error::InvalidArgument {
            argument: "connect_options",
            ..
        })
    ));
    let sem = AdvisorySemaphore::builder("bounced", 1)
        .build(
            &pg_semaphore::Client::new(bounced.clone())
                .transaction_pooling(true)
                .connect_options(db.options.clone())
                .fallback_interval(Duration::from_secs(60))
                .holder("bounced-app"),
        )
        .await?;
    let held = sem.try_acquire().await?;
    assert_eq!(sem.available_permits().await?, 0);
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(20), sem.acquire())
                .await
                .expect("admitted in time")
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    held.release().await?;
    waiter.await??.release().await?;
    let logged = support::eventually(Duration::from_secs(5), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pgsemaphore.advisory_claims WHERE holder = 'bounced-app'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap_or(0)
            == 2
    })
    .await;
    assert!(logged, "the audit log went through the bouncer");
    Ok(())
}

/// The audit log refuses a record whose semaphore an operator removed
/// meanwhile; the writer drops that one record (with a warning) and writes
/// the permits queued with it, instead of retrying the batch forever.
#[tokio::test]
async fn a_record_the_audit_log_refuses_never_holds_up_the_others() -> TestResult {
    let db = support::migrated_db().await;
    let kept = AdvisorySemaphore::builder("log-kept", 2)
        .build(&db.client)
        .await?;
    let removed = AdvisorySemaphore::builder("log-removed", 1)
        .build(&db.client)
        .await?;
    let first = kept.try_acquire().await?;
    let doomed = removed.try_acquire().await?;
    sqlx::query("DELETE FROM pgsemaphore.advisory_semaphores WHERE name = 'log-removed'")
        .execute(&db.pool)
        .await?;
    doomed.release().await?;
    first.release().await?;
    kept.try_acquire().await?.release().await?;
    assert!(
        support::advisory_rows_logged(&db.pool, "log-kept", 2).await,
        "the permits queued with a refused record were not written"
    );
    let logged_removed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pgsemaphore.advisory_claims WHERE semaphore = 'log-removed'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(logged_removed, 0);
    Ok(())
}

/// A claim that fails after its statement took a slot's lock (here: the
/// one-statement claim's read of the capacity epoch raises, through a
/// function that a database-wide `search_path` puts before `pg_catalog`)
/// answers the error holding nothing: the session gives the slot back
/// before it answers, so what it believes it holds and what the server
/// holds for it agree, and its next claim takes the slot.
#[tokio::test]
async fn a_claim_that_fails_after_taking_a_lock_leaves_nothing_held() -> TestResult {
    let db = support::migrated_db().await;
    let sem = advisory(&db.pool, "fails-late", 1).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA evil; \
         CREATE FUNCTION evil.pg_sequence_last_value(regclass) RETURNS bigint LANGUAGE plpgsql \
             AS $$ BEGIN RAISE EXCEPTION 'boom after the lock'; END $$; \
         ALTER DATABASE \"{}\" SET search_path = evil, pg_catalog, public",
        db.name
    )))
    .execute(&db.pool)
    .await?;
    let held = || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pgsemaphore.advisory_semaphores a JOIN pg_locks l \
                ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
               AND ((l.classid::bigint << 32) | l.objid::bigint) \
                   BETWEEN a.key_base AND a.key_base + 1048559 \
             WHERE a.name = 'fails-late'",
        )
        .fetch_one(&db.pool)
    };
    // The session opens now, with the database's search_path.
    let failed = sem.try_acquire().await;
    assert!(
        matches!(&failed, Err(Error::Database(e)) if e.to_string().contains("boom")),
        "{failed:?}"
    );
    assert_eq!(held().await?, 0, "the failed claim's slot stayed locked");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA evil CASCADE; ALTER DATABASE \"{}\" RESET search_path",
        db.name
    )))
    .execute(&db.pool)
    .await?;
    let permit = sem.try_acquire().await?;
    assert_eq!(permit.slot(), 0);
    assert_eq!(held().await?, 1);
    permit.release().await?;
    Ok(())
}

/// A claim behind a lock on the semaphores' table (a migration's DDL
/// waiting, or holding it) that must read the semaphore's row waits at most
/// the session's lock_timeout and answers `Error::Stalled`, holding nothing,
/// and the session stays usable (a claim whose process has read the row
/// already does not read it, and goes through);
/// a waiting acquire keeps waiting through it and gets the slot once the
/// table is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_behind_a_table_lock_is_stalled_not_stuck() -> TestResult {
    let db = support::migrated_db().await;
    let sem = advisory(&db.pool, "behind-ddl", 1).await?;
    sem.try_acquire().await?.release().await?;
    // A handle of another process: it has not read the row yet.
    let other = advisory(&db.pool, "behind-ddl", 1).await?;
    let mut ddl = db.pool.acquire().await?;
    sqlx::query("BEGIN").execute(&mut *ddl).await?;
    sqlx::query("LOCK TABLE pgsemaphore.advisory_semaphores IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *ddl)
        .await?;
    // The handle that read the row claims without the table: its claim is
    // checked against the capacity epoch, which the lock does not hold.
    let claimed = tokio::time::timeout(Duration::from_secs(10), sem.try_acquire())
        .await
        .map_err(|_| "a claim on a view of the row waited for the table's lock")??;
    claimed.release().await?;
    let sem = other;
    let refused = tokio::time::timeout(Duration::from_secs(10), sem.try_acquire())
        .await
        .map_err(|_| "a claim waited for the table's lock without bound")?;
    assert!(matches!(refused, Err(Error::Stalled { .. })), "{refused:?}");
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(20), sem.acquire())
                .await
                .expect("admitted in time")
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished());
    sqlx::query("ROLLBACK").execute(&mut *ddl).await?;
    let permit = waiter.await??;
    assert_eq!(permit.slot(), 0);
    permit.release().await?;
    Ok(())
}
