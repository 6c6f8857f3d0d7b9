//! The checker of the lease semaphores and the mutex, over the workers'
//! own timestamps, the driver's kills and the slot table; and, last, the
//! proof that every semaphore serves again at full capacity.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use pg_semaphore::{AdvisorySemaphore, Error, Semaphore};
use sqlx::PgPool;

use crate::logs::Logs;
use crate::support::chaos::{
    SlotRow, assert_within_capacity, max_open_at_once, next_on_slot, slot_rows, us,
};
use crate::support::{BoxError, TestResult};
use crate::{ADVISORY, LEASE, REAP_EVERY, SEMAPHORES};

/// Checks the lease semaphores and the mutex; what they showed, to print.
pub async fn check(
    pool: &PgPool,
    logs: &Logs,
    killed: &HashMap<String, i64>,
    restart: Option<(i64, i64)>,
    chaos_started: i64,
    chaos_ended: i64,
) -> Result<String, BoxError> {
    let rows = slot_rows(pool).await?;
    let by_id: HashMap<i64, &SlotRow> = rows.iter().map(|r| (r.id, r)).collect();
    let capacity: HashMap<&str, u32> = SEMAPHORES.into_iter().collect();

    // 1. The slot table: exactly one outcome per claim; no overlap beyond
    //    capacity, none on one slot.
    let mut db_max: BTreeMap<&str, usize> = BTreeMap::new();
    for (name, cap) in SEMAPHORES {
        let mine: Vec<&SlotRow> = rows.iter().filter(|r| r.semaphore == name).collect();
        for row in &mine {
            assert!(
                row.completed_at.is_some() != row.timed_out_at.is_some(),
                "claim {} has not exactly one outcome: completed {:?}, timed out {:?}",
                row.id,
                row.completed_at,
                row.timed_out_at
            );
        }
        let max = assert_within_capacity(&rows, name, cap, "the slot table");
        db_max.insert(name, max);
    }

    // 2. The workers' own view: every claim they were given is in the log with
    //    the outcome they were told; their holds never exceeded capacity.
    let mut worker_max: BTreeMap<&str, usize> = BTreeMap::new();
    let mut intervals: HashMap<&str, Vec<(i64, i64)>> = HashMap::new();
    let mut open_at_kill = 0u64;
    for (id, (worker, sem, slot, at)) in &logs.acquired {
        let row = by_id.get(id).unwrap_or_else(|| {
            panic!("claim {id} given to {worker} is missing from the slot table")
        });
        assert_eq!(
            (&row.semaphore, row.slot as u32),
            (sem, *slot),
            "claim {id}"
        );
        assert_eq!(&row.holder, worker, "claim {id}");
        let end = match (logs.ended.get(id), killed.get(worker)) {
            (Some(end), _) => *end,
            (None, Some(kill)) => {
                open_at_kill += 1;
                *kill
            }
            (None, None) => {
                panic!("claim {id} of {worker} never ended, and {worker} was not killed")
            }
        };
        intervals
            .entry(capacity.get_key_value(sem.as_str()).map_or("?", |(k, _)| k))
            .or_default()
            .push((*at, end));
        match logs.outcome.get(id).map(String::as_str) {
            Some("ok") => assert!(
                row.completed_at.is_some(),
                "claim {id}: released ok, but {:?}",
                row.timed_out_at
            ),
            Some(told) if told.starts_with("lost") => {}
            Some(told) if told.starts_with("error") => {} // release could not reach the database
            Some(told) => panic!("claim {id}: unexpected outcome {told}"),
            None => {} // killed before it was told
        }
    }
    for (name, cap) in SEMAPHORES {
        let max = max_open_at_once(intervals.remove(name).unwrap_or_default());
        assert!(
            max <= cap as usize,
            "{name}: {max} workers held permits at once, capacity {cap}"
        );
        worker_max.insert(name, max);
    }

    // 3. Killed holders: their slots were freed within lease + reaper interval
    //    (+ slack for scheduling, and for the restart if it overlapped).
    let slack =
        Duration::from_secs(3).as_micros() as i64 + restart.map_or(0, |(from, to)| to - from);
    let bound = (LEASE + REAP_EVERY).as_micros() as i64 + slack;
    let mut freed_after_kill = Vec::new();
    for row in &rows {
        let Some(kill) = killed.get(&row.holder) else {
            continue;
        };
        let end = row.completed_at.or(row.timed_out_at).map(us);
        if end.is_some_and(|end| end <= *kill) {
            continue; // ended before the kill
        }
        let freed = end.unwrap_or(i64::MAX) - kill;
        assert!(
            freed <= bound,
            "claim {} of killed worker {} was freed {} ms after the kill (bound {} ms)",
            row.id,
            row.holder,
            freed / 1000,
            bound / 1000
        );
        freed_after_kill.push(freed);
    }

    // 3b. A holder told its permit was lost was told before its slot went to
    //     anyone else (both clocks are this host's), and for the right reason.
    let next_on_slot = next_on_slot(&rows);
    for (id, told_at, reason) in &logs.lost_at {
        let row = by_id
            .get(id)
            .unwrap_or_else(|| panic!("lost claim {id} is missing"));
        if let Some(next) = next_on_slot.get(id) {
            assert!(
                next > told_at,
                "claim {id}'s slot went to another holder {} µs before its holder was told",
                told_at - next
            );
        }
        if reason.starts_with("TimedOut") {
            assert!(
                row.timed_out_at.is_some(),
                "claim {id}: told {reason}, but not timed out"
            );
        } else if reason.starts_with("AlreadyReleased") {
            assert!(
                row.completed_at.is_some(),
                "claim {id}: told {reason}, but not completed"
            );
        }
    }
    let renewed = rows
        .iter()
        .filter(|r| {
            (r.expires_at - r.created_at).to_std().unwrap_or_default()
                > LEASE + Duration::from_millis(100)
        })
        .count();
    assert!(
        renewed > 0,
        "no lease was ever renewed: the heartbeat was not exercised"
    );

    // 4. Nothing hung.
    assert!(
        logs.timeouts.is_empty(),
        "acquires timed out (a hang): {:?}",
        logs.timeouts
    );

    // 5. The mutex: no lost update, no overlap between committed critical sections.
    let counter: i64 = sqlx::query_scalar("SELECT v FROM torture_counter")
        .fetch_one(pool)
        .await?;
    let sections: Vec<(DateTime<Utc>, DateTime<Utc>)> =
        sqlx::query_as("SELECT started_at, ended_at FROM torture_mutex_log")
            .fetch_all(pool)
            .await?;
    assert_eq!(
        counter,
        sections.len() as i64,
        "an increment under the mutex was lost"
    );
    // A commit can succeed with its acknowledgement lost (connection killed),
    // never the reverse.
    assert!(
        counter >= logs.mutex_commits as i64,
        "{} increments were acknowledged, {counter} survived",
        logs.mutex_commits
    );
    let mutex_max = max_open_at_once(sections.iter().map(|(s, e)| (us(*s), us(*e))));
    assert!(mutex_max <= 1, "{mutex_max} holders of the mutex at once");

    // 6. After the chaos every semaphore served again.
    let after: HashSet<&str> = logs
        .acquired
        .values()
        .filter(|(_, _, _, at)| *at > chaos_ended)
        .map(|(_, sem, _, _)| sem.as_str())
        .collect();
    for (name, _) in SEMAPHORES {
        assert!(
            after.contains(name),
            "{name} served no claim after the chaos stopped"
        );
    }
    let during = logs
        .acquired
        .values()
        .filter(|(_, _, _, at)| (chaos_started..=chaos_ended).contains(at))
        .count();
    let calm = logs
        .acquired
        .values()
        .filter(|(_, _, _, at)| *at > chaos_ended)
        .count();

    freed_after_kill.sort_unstable();
    let timed_out = rows.iter().filter(|r| r.timed_out_at.is_some()).count();
    Ok(format!(
        "torture: {} claims in the slot table ({} during the chaos, {} after it; {} timed out), \
         {} acquires cancelled on purpose, {} leases renewed by heartbeats, {} permits reported lost to their holders, \
         {} held by workers when they were killed, {} database errors seen by workers, \
         {} mutex-protected increments (counter = {counter}).\n\
         torture: max concurrent holders, workers' clocks: {worker_max:?}; slot table: {db_max:?}; mutex: {mutex_max}.\n\
         torture: killed holders' slots freed after the kill: max {} ms (bound {} ms: lease {} ms + reaper {} ms + slack).",
        rows.len(),
        during,
        calm,
        timed_out,
        logs.cancellations,
        renewed,
        logs.lost_at.len(),
        open_at_kill,
        logs.errors,
        logs.mutex_commits,
        freed_after_kill.last().map_or(0, |f| f / 1000),
        bound / 1000,
        LEASE.as_millis(),
        REAP_EVERY.as_millis(),
    ))
}

/// Full capacity after the chaos: every slot of every semaphore can be held
/// at once, by one process.
pub async fn assert_full_capacity(pool: &PgPool) -> TestResult {
    for (name, capacity) in ADVISORY {
        let sem = AdvisorySemaphore::builder(name, capacity)
            .build(&pg_semaphore::Client::new(pool.clone()).holder("torture-driver"))
            .await?;
        assert_eq!(
            sem.available_permits().await?,
            capacity,
            "{name}: advisory slots still held after the chaos"
        );
        let mut held = Vec::new();
        for _ in 0..capacity {
            held.push(sem.try_acquire().await?);
        }
        assert!(matches!(
            sem.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
        for permit in held {
            permit.release().await?;
        }
    }
    for (name, capacity) in SEMAPHORES {
        let sem = Semaphore::builder(name, capacity)
            .lease(LEASE)
            .build(&pg_semaphore::Client::new(pool.clone()))
            .await?;
        assert_eq!(
            sem.available_permits().await?,
            capacity,
            "{name}: slots still held after the chaos"
        );
        let mut held = Vec::new();
        for _ in 0..capacity {
            held.push(sem.try_acquire().await?);
        }
        assert!(matches!(
            sem.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
        for permit in held {
            permit.release().await?;
        }
    }
    Ok(())
}
