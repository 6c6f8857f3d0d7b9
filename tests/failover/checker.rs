//! The checker of one failover: the workers' and the driver's logs against
//! the new primary's slot table.

use std::collections::{BTreeMap, HashMap, HashSet};

use testkit::replica::Replication;

use crate::logs::{Claim, Logs};
use crate::report::Report;
use crate::support::chaos::{SlotRow, assert_within_capacity, next_on_slot, us};
use crate::{DRIVER, SEMAPHORES, Scenario, WORKERS, checked_semaphores};

/// When the failover's steps happened (µs, the shared clock).
pub struct Times {
    pub partitioned: Option<i64>,
    pub stopped: i64,
    pub promoted: i64,
    pub switched: i64,
    pub mutex_lost: i64,
    /// When the final reap began: every claim whose lease had ended by then
    /// has an outcome.
    pub reaped: i64,
}

/// Checks one failover from the workers' logs and the new primary's audit
/// log, asserting what holds whatever the replication, and counting what
/// the replication decides (the callers assert those counts).
pub fn check(
    mode: Replication,
    scenario: Scenario,
    rows: &[SlotRow],
    logs: &Logs,
    times: &Times,
) -> Report {
    let sync = mode == Replication::Synchronous;
    let capacity: HashMap<&str, u32> = checked_semaphores().collect();
    let by_id: HashMap<i64, &SlotRow> = rows.iter().map(|r| (r.id, r)).collect();
    let mut error_kinds = BTreeMap::new();
    for (_, message) in &logs.errors {
        let kind: Vec<&str> = message.split(' ').take(4).collect();
        *error_kinds.entry(kind.join(" ")).or_default() += 1;
    }
    let mut report = Report {
        scenario,
        runs: 1,
        error_kinds,
        acknowledged: logs.claims.len(),
        promote_ms: (times.promoted - times.stopped) / 1000,
        switch_ms: (times.switched - times.stopped) / 1000,
        mutex_lost_ms: (times.mutex_lost - times.stopped) / 1000,
        errors: logs.errors.len(),
        cut_off_refused: logs.refused,
        ..Report::default()
    };

    // 1. The new primary's table is consistent, whatever it lost: at most
    //    one outcome per claim, never more than capacity, never a slot twice.
    for row in rows {
        assert!(
            !(row.completed_at.is_some() && row.timed_out_at.is_some()),
            "claim {} has two outcomes",
            row.id
        );
        assert!(
            row.completed_at.is_some()
                || row.timed_out_at.is_some()
                || us(row.expires_at) > times.reaped,
            "claim {} is live past its lease after the reap",
            row.id
        );
    }
    for (name, cap) in checked_semaphores() {
        assert_within_capacity(rows, name, cap, "the new primary's table");
    }

    // 2. Every claim a holder was told about, against the new primary.
    //    `unprotected`: why the new primary did not hold the claim's slot for
    //    as long as its holder worked, if it did not.
    let mut unprotected: Vec<Option<&'static str>> = vec![None; logs.claims.len()];
    for (i, claim) in logs.claims.iter().enumerate() {
        let end = claim.end.unwrap_or_else(|| {
            panic!(
                "claim {} ({} of {}) never ended",
                claim.id, claim.key, claim.worker
            )
        });
        assert!(capacity.contains_key(claim.semaphore.as_str()), "{claim:?}");
        if claim.at < times.stopped {
            report.acknowledged_before += 1;
        }
        // Created after the standby was cut off: the standby never saw it.
        // Under synchronous replication it cannot have been acknowledged;
        // under asynchronous, it was, and the new primary must lack it.
        let partitioned = times
            .partitioned
            .is_some_and(|at| claim.created > at && claim.created < times.stopped);
        if partitioned {
            report.acknowledged_partitioned += 1;
            assert!(
                !sync,
                "claim {} ({} of {}) was acknowledged while the synchronous standby was cut off",
                claim.id, claim.key, claim.worker
            );
        }
        let sentinel = claim.worker == DRIVER && claim.key != "cut-off";
        let cut_off = claim.worker == DRIVER && claim.key == "cut-off";
        report.cut_off_acknowledged += usize::from(cut_off);
        let row = by_id.get(&claim.id).filter(|row| {
            row.holder == claim.worker
                && row.semaphore == claim.semaphore
                && row.slot as u32 == claim.slot
                && us(row.created_at) == claim.created
        });
        assert!(
            !(partitioned && row.is_some()),
            "claim {} was created after the standby was cut off, yet the new primary has it",
            claim.id
        );
        let Some(row) = row else {
            unprotected[i] = Some("missing on the new primary");
            report.missing += 1;
            if by_id.contains_key(&claim.id) {
                report.ids_reused += 1;
            }
            if sentinel {
                report.sentinels_missing += 1;
            }
            report.cut_off_missing += usize::from(cut_off);
            continue;
        };
        if claim.outcome.as_deref() == Some("ok") {
            report.releases_acknowledged += 1;
            if row.completed_at.is_none() {
                report.releases_lost += 1;
            }
        }
        if row.end() < end {
            // Its lease ended on the new primary before its holder stopped:
            // a renewal the holder was told about is missing (or the holder
            // heard too late that the permit was lost).
            unprotected[i] = Some("its lease ended on the new primary while its holder worked");
            report.ended_early += 1;
            report.ended_early_untold += usize::from(!claim.lost);
        }
        if sync {
            // What the holder was told matches the new primary.
            match claim.outcome.as_deref() {
                Some("ok") => assert!(
                    row.completed_at.is_some(),
                    "claim {}: released ok on the old primary, not completed on the new one",
                    claim.id
                ),
                Some(told) if told.contains("TimedOut") => assert!(
                    row.timed_out_at.is_some(),
                    "claim {}: told {told}, not timed out",
                    claim.id
                ),
                Some(told) if told.contains("AlreadyReleased") => assert!(
                    row.completed_at.is_some(),
                    "claim {}: told {told}, not completed",
                    claim.id
                ),
                _ => {}
            }
        }
        if sentinel {
            if claim.lost {
                report.sentinels_lost += 1;
            } else {
                // Held through the failover, never told it was lost, and
                // released ok: its heartbeat renewed it on the new primary.
                assert_eq!(
                    claim.outcome.as_deref(),
                    Some("ok"),
                    "sentinel {}: neither renewed nor reported lost",
                    claim.key
                );
                assert!(
                    us(row.expires_at) > times.switched,
                    "sentinel {}: released ok, but never renewed on the new primary",
                    claim.key
                );
                report.sentinels_renewed += 1;
            }
        }
    }
    let sentinels = logs
        .claims
        .iter()
        .filter(|c| c.worker == DRIVER && c.key != "cut-off")
        .count();
    assert_eq!(
        sentinels, 2,
        "the driver's sentinels are missing from its log"
    );

    // 3. Holders on the workers' own clocks: more than capacity (or two on a
    //    slot) is an over-admission. Each must involve a claim the new
    //    primary did not protect (lost it, or let it end while its holder
    //    worked): with everything acknowledged on the new primary, the
    //    database's limit holds across the failover.
    for (name, cap) in checked_semaphores() {
        let mine: Vec<usize> = (0..logs.claims.len())
            .filter(|&i| logs.claims[i].semaphore == name)
            .collect();
        for episode in over_admissions(logs, &unprotected, &mine, cap as usize, times) {
            report.over_capacity += 1;
            report.over_capacity_us += episode.length;
            report.episodes.push(format!("{name}: {}", episode.what));
        }
        let mut slots: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for &i in &mine {
            slots.entry(logs.claims[i].slot).or_default().push(i);
        }
        for (slot, on_slot) in slots {
            for episode in over_admissions(logs, &unprotected, &on_slot, 1, times) {
                report.slots_twice += 1;
                report.slots_twice_us += episode.length;
                report
                    .episodes
                    .push(format!("{name} slot {slot}: {}", episode.what));
            }
        }
    }

    // 4. A holder told its permit was lost was told before the new primary
    //    gave its slot to anyone else.
    if sync {
        let next_on_slot = next_on_slot(rows);
        for claim in logs.claims.iter().filter(|c| c.lost) {
            if let (Some(next), Some(told)) = (next_on_slot.get(&claim.id), claim.end) {
                assert!(
                    *next > told,
                    "claim {}'s slot went to another holder {} µs before its holder was told",
                    claim.id,
                    told - next
                );
            }
        }
    }

    // 5. The load went on on the new primary: every semaphore and every
    //    worker served after the switch, and no acquire hung.
    let after: Vec<&Claim> = logs
        .claims
        .iter()
        .filter(|c| c.at > times.switched && c.worker != DRIVER)
        .collect();
    report.served_after = after.len();
    report.waited_through = after.iter().filter(|c| c.asked < times.switched).count();
    let semaphores: HashSet<&str> = after.iter().map(|c| c.semaphore.as_str()).collect();
    let workers: HashSet<&str> = after.iter().map(|c| c.worker.as_str()).collect();
    for (name, _) in SEMAPHORES {
        assert!(
            semaphores.contains(name),
            "{name} served no claim after the switch"
        );
    }
    assert_eq!(
        workers.len(),
        WORKERS,
        "some workers were not served after the switch: {workers:?}"
    );
    assert!(
        logs.timeouts.is_empty(),
        "acquires timed out (a hang): {:?}",
        logs.timeouts
    );
    report
}

/// An over-admission: its length (µs), and what it was.
struct Episode {
    length: i64,
    what: String,
}

/// Over-admission episodes among `claims` (indexes into `logs.claims`) on
/// the holders' clocks, with more than `limit` open at once. Panics if one
/// involves only claims the new primary protected (see `unprotected`).
fn over_admissions(
    logs: &Logs,
    unprotected: &[Option<&'static str>],
    claims: &[usize],
    limit: usize,
    times: &Times,
) -> Vec<Episode> {
    // Ends sort before starts at the same instant: a hand-over is not an overlap.
    let mut events: Vec<(i64, i32, usize)> = Vec::new();
    for &i in claims {
        let claim = &logs.claims[i];
        events.push((claim.at, 1, i));
        events.push((claim.end.unwrap_or(claim.at), -1, i));
    }
    events.sort();
    let mut open: HashSet<usize> = HashSet::new();
    let mut episodes = Vec::new();
    let mut current: Option<(i64, usize, BTreeMap<String, &str>)> = None;
    for (at, delta, i) in events {
        if delta > 0 {
            open.insert(i);
        } else {
            open.remove(&i);
        }
        if open.len() > limit {
            let holders: Vec<&Claim> = open.iter().map(|&j| &logs.claims[j]).collect();
            assert!(
                open.iter().any(|&j| unprotected[j].is_some()),
                "{} holders at once, each held on the new primary: {holders:#?}",
                open.len()
            );
            let (_, most, culprits) = current.get_or_insert_with(|| (at, 0, BTreeMap::new()));
            *most = (*most).max(open.len());
            for &j in &open {
                if let Some(why) = unprotected[j] {
                    let claim = &logs.claims[j];
                    culprits.insert(
                        format!("{} of {} (id {})", claim.key, claim.worker, claim.id),
                        why,
                    );
                }
            }
        } else if let Some((from, most, culprits)) = current.take() {
            episodes.push(Episode {
                length: at - from,
                what: format!(
                    "{most} holders for {} ms from {} ms after the switch; not held by the new \
                     primary: {culprits:?}",
                    (at - from) / 1000,
                    (from - times.switched) / 1000,
                ),
            });
        }
    }
    episodes
}
