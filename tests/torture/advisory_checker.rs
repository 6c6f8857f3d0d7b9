//! The checker of the advisory semaphores, over the workers' own
//! timestamps, the driver's events and the advisory audit log.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::logs::{Events, Hold, Logs};
use crate::support::BoxError;
use crate::support::chaos::{max_open_at_once, us};
use crate::{ADVISORY, HEARTBEAT, KILL_FREES_WITHIN, TOLD_SLACK};

#[derive(sqlx::FromRow)]
struct AuditRow {
    semaphore: String,
    slots: Vec<i32>,
    holder: String,
    acquired_at: DateTime<Utc>,
    ended_at: DateTime<Utc>,
    outcome: String,
}

/// What cut an advisory hold short: its backend ended before its holder
/// stopped work on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    Terminated,
    Crash,
}

/// One advisory hold as the checker sees it.
struct Span<'a> {
    worker: &'a str,
    id: &'a str,
    hold: &'a Hold,
    /// Whether its worker logged it (else it is known from the audit log only).
    logged: bool,
    /// When its worker was SIGKILLed, if it was after the lock was taken.
    kill: Option<i64>,
    /// The earliest end of its backend after the lock was taken, if any.
    cut: Option<(i64, Cut)>,
    /// `[start, end)`: from the lock to the earliest of the holder's own end
    /// (done or told), its backend's end, its worker's death.
    start: i64,
    end: i64,
}

impl Span<'_> {
    /// Whether its backend ended while its holder still worked.
    fn cut_short(&self) -> Option<(i64, Cut)> {
        self.cut.filter(|(at, _)| {
            self.hold.own_end().is_none_or(|end| *at < end) && self.kill.is_none_or(|k| *at < k)
        })
    }

    fn describe(&self) -> String {
        format!(
            "{}/{} on {} slot {} (backend {}): locked {}, had it {}, done {:?}, told {:?}, \
             release {:?}, backend ended {:?}, worker killed {:?}",
            self.worker,
            self.id,
            self.hold.semaphore,
            self.hold.slot,
            self.hold.pid,
            self.hold.locked,
            self.hold.acquired,
            self.hold.ended,
            self.hold.told,
            self.hold.outcome,
            self.cut,
            self.kill,
        )
    }
}

/// The advisory semaphores' checks, over the workers' logs, the driver's
/// events and the audit log `pgsemaphore.advisory_claims`.
///
/// A hold lasts from its lock (the claim statement's clock) to the earliest
/// of: its end of work, its lost notice, the termination of its backend,
/// the server's crash, its worker's SIGKILL. An advisory slot is freed the
/// moment its backend ends, while its holder only learns of it at its
/// session's next heartbeat: a hold cut short that way ends, for the hard
/// limit, when its backend ended, and its holder's work may overlap the next
/// holder's until it is told. That window, and only it, is the documented
/// one: the checker counts and prints the holds cut short and how many
/// overlapped their slot's next holder, and asserts that each holder was
/// told within two heartbeats plus [`TOLD_SLACK`]. An overlap of the
/// holds as defined here is outside the window: it fails.
pub async fn check_advisory(
    pool: &PgPool,
    logs: &Logs,
    events: &Events,
    dir: &Path,
    chaos_ended: i64,
) -> Result<String, BoxError> {
    let capacity: HashMap<&str, u32> = ADVISORY.into_iter().collect();
    let where_ = format!("(logs in {})", dir.display());
    let rows: Vec<AuditRow> = sqlx::query_as(
        "SELECT semaphore, slots, holder, acquired_at, ended_at, outcome \
         FROM pgsemaphore.advisory_claims",
    )
    .fetch_all(pool)
    .await?;
    // Holds only the audit log knows: an acquire cancelled after its claim
    // had taken a slot (the permit was dropped in the background, never
    // seen by the worker). They join the hard limit as [acquired_at,
    // ended_at), less than they held (the background release ends later).
    let logged: HashSet<(&str, &str, i64)> = logs
        .holds
        .iter()
        .map(|((worker, _), hold)| (worker.as_str(), hold.semaphore.as_str(), hold.locked))
        .collect();
    let audit_only: Vec<((String, String), Hold)> = rows
        .iter()
        .filter(|row| {
            !logged.contains(&(
                row.holder.as_str(),
                row.semaphore.as_str(),
                us(row.acquired_at),
            ))
        })
        .enumerate()
        .map(|(n, row)| {
            let hold = Hold {
                semaphore: row.semaphore.clone(),
                slot: row.slots.first().map_or(u32::MAX, |s| *s as u32),
                locked: us(row.acquired_at),
                acquired: us(row.acquired_at),
                ended: Some(us(row.ended_at)),
                outcome: Some(format!("audit only: {}", row.outcome)),
                ..Hold::default()
            };
            ((row.holder.clone(), format!("audit-only-{n}")), hold)
        })
        .collect();
    let mut spans: Vec<Span<'_>> = Vec::new();
    let mut outlived_signal = 0u64;
    let all = logs
        .holds
        .iter()
        .map(|hold| (hold, true))
        .chain(audit_only.iter().map(|(key, hold)| ((key, hold), false)));
    for (((worker, id), hold), logged) in all {
        let cap = capacity.get(hold.semaphore.as_str()).copied().unwrap_or(0);
        assert!(
            hold.slot < cap,
            "{worker}/{id}: slot {} of {} (capacity {cap})",
            hold.slot,
            hold.semaphore
        );
        let start = hold.locked;
        let terminated = events
            .terminated
            .get(&hold.pid)
            .into_iter()
            .flatten()
            .copied()
            .filter(|at| *at > start)
            .min()
            .map(|at| (at, Cut::Terminated));
        let crashed = events
            .crash
            .map(|(from, _)| (from, Cut::Crash))
            .filter(|(from, _)| *from > start);
        let cut = terminated
            .into_iter()
            .chain(crashed)
            .min_by_key(|(at, _)| *at)
            // A release that said ok was run by the backend: it was alive
            // then, whatever signal was on its way (pg_ctl takes a moment to
            // start killing backends).
            .filter(|(at, _)| {
                hold.outcome.as_deref() != Some("ok") || hold.own_end().is_some_and(|e| e < *at)
            });
        outlived_signal += u64::from(
            hold.outcome.as_deref() == Some("ok")
                && terminated
                    .into_iter()
                    .chain(crashed)
                    .any(|(at, _)| hold.own_end().is_some_and(|e| at < e)),
        );
        let kill = events.killed.get(worker).copied().filter(|at| *at > start);
        let end = [hold.own_end(), cut.map(|(at, _)| at), kill]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or_else(|| {
                panic!("{worker}/{id}: an advisory hold never ended, and {worker} was not killed")
            });
        spans.push(Span {
            worker,
            id,
            hold,
            logged,
            kill,
            cut,
            start,
            end,
        });
    }

    // 1. The hard limit: never more than capacity holders, never two of a slot.
    let mut max_held: BTreeMap<&str, usize> = BTreeMap::new();
    for (name, cap) in ADVISORY {
        let mine: Vec<&Span<'_>> = spans.iter().filter(|s| s.hold.semaphore == name).collect();
        let mut by_slot: BTreeMap<u32, Vec<&Span<'_>>> = BTreeMap::new();
        for span in &mine {
            by_slot.entry(span.hold.slot).or_default().push(span);
        }
        for (slot, mut held) in by_slot {
            held.sort_by_key(|s| s.start);
            for pair in held.windows(2) {
                assert!(
                    pair[1].start >= pair[0].end,
                    "{name}: slot {slot} held twice at once, for {} µs:\n  {}\n  {}\n{where_}",
                    pair[0].end - pair[1].start,
                    pair[0].describe(),
                    pair[1].describe(),
                );
            }
        }
        let max = max_open_at_once(mine.iter().map(|s| (s.start, s.end)));
        assert!(
            max <= cap as usize,
            "{name}: {max} holders at once, capacity {cap} {where_}"
        );
        max_held.insert(name, max);
    }

    // 2. A holder whose backend ended (terminated, or the server crashed)
    //    was told within two heartbeats plus the slack, or its work ended
    //    first (its release then said so), or its worker died first.
    let bound = (HEARTBEAT * 2 + TOLD_SLACK).as_micros() as i64;
    let mut next_on_slot: HashMap<(&str, u32, i64), i64> = HashMap::new();
    {
        let mut by_slot: HashMap<(&str, u32), Vec<i64>> = HashMap::new();
        for span in &spans {
            by_slot
                .entry((span.hold.semaphore.as_str(), span.hold.slot))
                .or_default()
                .push(span.start);
        }
        for ((sem, slot), mut starts) in by_slot {
            starts.sort_unstable();
            for pair in starts.windows(2) {
                next_on_slot.insert((sem, slot, pair[0]), pair[1]);
            }
        }
    }
    let (mut cut_by_termination, mut cut_by_crash) = (0u64, 0u64);
    let (mut told_by_notice, mut finished_first, mut died_first) = (0u64, 0u64, 0u64);
    let (mut overlapped_next, mut max_overlap_next, mut max_told) = (0u64, 0i64, 0i64);
    for span in spans.iter().filter(|s| s.logged) {
        let Some((cut, why)) = span.cut_short() else {
            continue;
        };
        match why {
            Cut::Terminated => cut_by_termination += 1,
            Cut::Crash => cut_by_crash += 1,
        }
        let deadline = cut + bound;
        // Until when the holder worked on.
        let worked_until = match (span.hold.own_end(), span.kill) {
            (Some(end), kill) if kill.is_none_or(|kill| end <= kill) => {
                assert!(
                    end <= deadline,
                    "a holder worked on (not told) {} ms after its backend ended ({why:?}), bound {} ms:\n  {}\n{where_}",
                    (end - cut) / 1000,
                    bound / 1000,
                    span.describe()
                );
                max_told = max_told.max(end - cut);
                if span.hold.told.is_some() {
                    told_by_notice += 1;
                } else {
                    finished_first += 1;
                }
                end
            }
            (_, Some(kill)) => {
                assert!(
                    kill <= deadline,
                    "a holder was not told within {} ms of its backend's end ({why:?}), and worked on until killed:\n  {}\n{where_}",
                    bound / 1000,
                    span.describe()
                );
                died_first += 1;
                kill
            }
            (_, None) => unreachable!("a hold without an end was refused above"),
        };
        if let Some(next) =
            next_on_slot.get(&(span.hold.semaphore.as_str(), span.hold.slot, span.start))
            && *next < worked_until
        {
            overlapped_next += 1;
            max_overlap_next = max_overlap_next.max(worked_until - next);
        }
    }
    // A lost notice with no termination or crash behind it: the session
    // lost itself (a ping or a statement unanswered in time) or the server
    // ended it (idle_session_timeout). Counted, and held to the hard limit above.
    let lost_notices = spans.iter().filter(|s| s.hold.told.is_some()).count();
    let open_at_kill = spans
        .iter()
        .filter(|s| s.kill.is_some_and(|k| s.end == k))
        .count();
    let unexplained_notices = spans
        .iter()
        .filter(|s| s.hold.told.is_some() && s.cut_short().is_none())
        .count();

    // 3. A SIGKILLed worker's advisory slots were free again at once.
    let kill_bound = KILL_FREES_WITHIN.as_micros() as i64;
    let mut max_freed = 0i64;
    for (worker, freed) in &events.freed_after_kill {
        let freed = freed.unwrap_or_else(|| {
            panic!("{worker}'s advisory slots were still held 5 s after its SIGKILL {where_}")
        });
        assert!(
            freed <= kill_bound,
            "{worker}'s advisory slots were freed {} ms after its SIGKILL, bound {} ms {where_}",
            freed / 1000,
            kill_bound / 1000
        );
        max_freed = max_freed.max(freed);
    }

    // 4. Nothing hung, and every advisory semaphore served after the chaos.
    assert!(
        logs.advisory_timeouts.is_empty(),
        "advisory acquires timed out (a hang): {:?} {where_}",
        logs.advisory_timeouts
    );
    for (name, _) in ADVISORY {
        assert!(
            spans
                .iter()
                .any(|s| s.logged && s.hold.semaphore == name && s.hold.acquired > chaos_ended),
            "{name} served no hold after the chaos stopped"
        );
    }

    // 5. The audit log: each row is a hold its worker logged, with the
    //    outcome the worker saw; a worker that stopped normally lived to
    //    flush, so each of its holds has its row, except those the crash
    //    took (a row is written up to 500 ms after the permit ended, with a
    //    fast commit the crash may lose for about 600 ms more: 2 s allowed).
    //    A SIGKILLed worker's queued rows are lost: the documented promise.
    let by_lock: HashMap<(&str, &str, i64), &Span<'_>> = spans
        .iter()
        .filter(|s| s.logged)
        .map(|s| ((s.worker, s.hold.semaphore.as_str(), s.hold.locked), s))
        .collect();
    let workers: HashSet<&str> = logs
        .holds
        .keys()
        .map(|(w, _)| w.as_str())
        .chain(logs.advisory_cancellations.keys().map(String::as_str))
        .collect();
    let mut rows_of: HashMap<(&str, &str), usize> = HashMap::new();
    let mut unmatched: HashMap<&str, u64> = HashMap::new();
    let mut outcomes: BTreeMap<&str, u64> = BTreeMap::new();
    for row in &rows {
        *outcomes.entry(row.outcome.as_str()).or_default() += 1;
        assert!(
            workers.contains(row.holder.as_str()),
            "an audit row of an unknown holder: {} {} {:?} {}",
            row.holder,
            row.semaphore,
            row.slots,
            row.acquired_at
        );
        assert!(
            row.ended_at >= row.acquired_at,
            "an audit row ends before it starts"
        );
        let Some(span) = by_lock.get(&(
            row.holder.as_str(),
            row.semaphore.as_str(),
            us(row.acquired_at),
        )) else {
            // Audit only (above): what a cancelled acquire's claim left.
            assert!(
                matches!(row.outcome.as_str(), "dropped" | "lost")
                    && row.slots.len() == 1
                    && capacity
                        .get(row.semaphore.as_str())
                        .is_some_and(|cap| (row.slots[0] as u32) < *cap),
                "an audit row matches no logged acquire: {} {} {:?} {} {} {where_}",
                row.holder,
                row.semaphore,
                row.slots,
                row.acquired_at,
                row.outcome
            );
            *unmatched.entry(row.holder.as_str()).or_default() += 1;
            continue;
        };
        assert_eq!(
            row.slots,
            vec![span.hold.slot as i32],
            "audit row of {}/{}",
            span.worker,
            span.id
        );
        *rows_of.entry((span.worker, span.id)).or_default() += 1;
        let expected: &[&str] = match (&span.hold.told, span.hold.outcome.as_deref()) {
            (Some(_), _) => &["lost"],
            (None, Some("ok")) => &["released"],
            (None, Some("dropped-lost")) => &["lost"],
            (None, Some("dropped")) => &["dropped", "lost"],
            (None, Some(told)) if told.starts_with("lost") => &["lost"],
            (None, Some(told)) if told.starts_with("error") => &["released"],
            (None, Some(told)) => panic!("{}/{}: unexpected outcome {told}", span.worker, span.id),
            // Killed after its row was queued, before it logged the outcome.
            (None, None) => &["released", "lost", "dropped"],
        };
        assert!(
            expected.contains(&row.outcome.as_str()),
            "{}/{}: the audit log says {}, the worker saw {:?} {where_}",
            span.worker,
            span.id,
            row.outcome,
            span.hold
                .told
                .as_ref()
                .map(|(_, r)| r)
                .or(span.hold.outcome.as_ref())
        );
    }
    for (worker, count) in &unmatched {
        let cancelled = logs
            .advisory_cancellations
            .get(*worker)
            .copied()
            .unwrap_or(0);
        assert!(
            *count <= cancelled,
            "{worker}: {count} audit rows match no logged acquire, more than its {cancelled} cancelled acquires"
        );
    }
    let duplicates = rows_of.values().filter(|n| **n > 1).count();
    let (mut missing_killed, mut missing_crash) = (0u64, 0u64);
    for span in spans.iter().filter(|s| s.logged) {
        if rows_of.contains_key(&(span.worker, span.id)) {
            continue;
        }
        if events.killed.contains_key(span.worker) {
            missing_killed += 1;
            continue;
        }
        let ended = span.hold.own_end().unwrap_or(span.end);
        if events
            .crash
            .is_some_and(|(from, _)| ended <= from && ended > from - 2_000_000)
        {
            missing_crash += 1;
            continue;
        }
        panic!(
            "a hold of a worker that stopped normally has no audit row:\n  {}\n{where_}",
            span.describe()
        );
    }

    let calm = spans
        .iter()
        .filter(|s| s.logged && s.hold.acquired > chaos_ended)
        .count();
    let cancellations: u64 = logs.advisory_cancellations.values().sum();
    let terminations: usize = events.terminated.values().map(Vec::len).sum();
    Ok(format!(
        "torture (advisory, heartbeat {} ms): {} holds ({} after the chaos), {} acquires cancelled on purpose, \
         {} database errors seen by workers; {} backends terminated by the driver; max concurrent holders {max_held:?}.\n\
         torture (advisory): {} lost notices ({} with no termination or crash behind them); \
         {} holds cut short (backend ended while its holder worked: {} terminated, {} by the crash): \
         {told_by_notice} told by a notice, {finished_first} finished first, {died_first} killed first \
         ({outlived_signal} more released ok after the signal: their backend was still alive); \
         told at most {} ms after the backend ended (bound {} ms); {overlapped_next} overlapped their slot's \
         next holder, by at most {} ms.\n\
         torture (advisory): SIGKILLed workers' slots free after at most {} ms (bound {} ms, {} kills, \
         {open_at_kill} holds open at a kill); \
         audit log: {} rows {outcomes:?}, {} of acquires cancelled after their claim, {duplicates} holds with \
         more than one row; holds without a row: {missing_killed} of killed workers, {missing_crash} lost with the crash.",
        HEARTBEAT.as_millis(),
        spans.iter().filter(|s| s.logged).count(),
        calm,
        cancellations,
        logs.advisory_errors,
        terminations,
        lost_notices,
        unexplained_notices,
        cut_by_termination + cut_by_crash,
        cut_by_termination,
        cut_by_crash,
        max_told / 1000,
        bound / 1000,
        max_overlap_next / 1000,
        max_freed / 1000,
        kill_bound / 1000,
        events.freed_after_kill.len(),
        rows.len(),
        unmatched.values().sum::<u64>(),
    ))
}
