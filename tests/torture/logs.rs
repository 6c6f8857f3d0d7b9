//! What the workers and the driver logged, read back for the checkers:
//! the workers' logs (`<worker>.log`, format in [`worker`](crate::worker))
//! and the driver's (`chaos.events`, format at [`Events`]).

use std::collections::HashMap;
use std::path::Path;

use crate::support::chaos::{Fields, worker_logs};

/// The workers' logs, gathered by event.
#[derive(Debug, Default)]
pub struct Logs {
    /// id -> (worker, semaphore, slot, acquired µs)
    pub acquired: HashMap<i64, (String, String, u32, i64)>,
    /// id -> µs the worker stopped work (E or L)
    pub ended: HashMap<i64, i64>,
    /// id -> what release said, or the lost reason
    pub outcome: HashMap<i64, String>,
    pub lost: u64,
    /// (id, µs the holder was told, reason) for every lost permit.
    pub lost_at: Vec<(i64, i64, String)>,
    pub timeouts: Vec<String>,
    pub cancellations: u64,
    pub errors: u64,
    pub mutex_commits: u64,
    /// (worker, id) -> an advisory hold, as its worker logged it.
    pub holds: HashMap<(String, String), Hold>,
    pub advisory_timeouts: Vec<String>,
    /// worker -> advisory acquires it cancelled on purpose.
    pub advisory_cancellations: HashMap<String, u64>,
    pub advisory_errors: u64,
}

/// One advisory hold, as its worker logged it (times in µs, this host's clock).
#[derive(Debug, Default)]
pub struct Hold {
    pub semaphore: String,
    pub slot: u32,
    pub pid: i32,
    /// When its claim statement had taken the lock (the permit's `acquired_at`).
    pub locked: i64,
    /// When the worker had the permit.
    pub acquired: i64,
    /// When it stopped work to release (`e`).
    pub ended: Option<i64>,
    /// When it was told the permit was lost, and why (`l`).
    pub told: Option<(i64, String)>,
    /// What its release said (`r`).
    pub outcome: Option<String>,
}

impl Hold {
    /// When the worker stopped work on its own: done, or told.
    pub fn own_end(&self) -> Option<i64> {
        self.ended.or(self.told.as_ref().map(|(at, _)| *at))
    }
}

/// What the driver did, from its log `chaos.events`, one line per event:
/// - `K <worker> <t>`: SIGKILLed the worker (t just before the signal);
/// - `F <worker> <µs>|never`: how long after that kill none of the backends
///   the worker's log names held an advisory slot;
/// - `P <pid> <t> <victim> <application>`: terminated the backend (t: the
///   server's clock just before `pg_terminate_backend`);
/// - `S <from> <to>`: crashed the server (from: just before `pg_ctl stop -m
///   immediate`), which accepted connections again at `to`.
#[derive(Debug, Default)]
pub struct Events {
    pub killed: HashMap<String, i64>,
    pub freed_after_kill: Vec<(String, Option<i64>)>,
    /// pid -> when it was terminated (a pid can be reused).
    pub terminated: HashMap<i32, Vec<i64>>,
    pub crash: Option<(i64, i64)>,
}

/// The driver's log in `dir`.
pub fn read_events(dir: &Path) -> std::io::Result<Events> {
    let mut events = Events::default();
    for line in std::fs::read_to_string(dir.join("chaos.events"))?.lines() {
        let fields = Fields::of(line);
        let int = |i: usize| fields.int(i);
        match (fields.kind(), fields.get(1)) {
            ("K", Some(worker)) => {
                if let Some(at) = int(2) {
                    events.killed.insert(worker.to_owned(), at);
                }
            }
            ("F", Some(worker)) => events.freed_after_kill.push((worker.to_owned(), int(2))),
            ("P", _) => {
                if let (Some(pid), Some(at)) = (int(1), int(2)) {
                    events.terminated.entry(pid as i32).or_default().push(at);
                }
            }
            ("S", _) => events.crash = int(1).zip(int(2)),
            _ => {}
        }
    }
    Ok(events)
}

/// The workers' logs in `dir`.
pub fn read_logs(dir: &Path) -> std::io::Result<Logs> {
    let mut logs = Logs::default();
    for (worker, text) in worker_logs(dir)? {
        for line in text.lines() {
            let fields = Fields::of(line);
            let int = |i: usize| fields.int(i);
            match fields.kind() {
                "A" => {
                    if let (Some(id), Some(sem), Some(slot), Some(at)) =
                        (int(1), fields.get(2), int(3), int(4))
                    {
                        logs.acquired
                            .insert(id, (worker.clone(), sem.to_owned(), slot as u32, at));
                    }
                }
                "E" => {
                    if let (Some(id), Some(at)) = (int(1), int(2)) {
                        logs.ended.insert(id, at);
                    }
                }
                "L" => {
                    if let (Some(id), Some(at)) = (int(1), int(2)) {
                        logs.ended.insert(id, at);
                        logs.outcome.insert(id, format!("lost {}", fields.rest(3)));
                        logs.lost += 1;
                        logs.lost_at.push((id, at, fields.rest(3)));
                    }
                }
                "R" => {
                    if let Some(id) = int(1) {
                        logs.outcome.insert(id, fields.rest(2));
                    }
                }
                "T" => logs.timeouts.push(line.to_owned()),
                "C" => logs.cancellations += 1,
                "X" => logs.errors += 1,
                "M" => logs.mutex_commits += 1,
                "a" => {
                    if let (Some(id), Some(sem), Some(slot), Some(pid), Some(at), Some(locked)) =
                        (fields.get(1), fields.get(2), int(3), int(4), int(5), int(6))
                    {
                        let hold = Hold {
                            semaphore: sem.to_owned(),
                            slot: slot as u32,
                            pid: pid as i32,
                            locked,
                            acquired: at,
                            ..Hold::default()
                        };
                        logs.holds.insert((worker.clone(), id.to_owned()), hold);
                    }
                }
                "e" | "l" | "r" => {
                    let Some(hold) = fields
                        .get(1)
                        .and_then(|id| logs.holds.get_mut(&(worker.clone(), id.to_owned())))
                    else {
                        continue;
                    };
                    match (fields.kind(), int(2)) {
                        ("e", Some(at)) => hold.ended = Some(at),
                        ("l", Some(at)) => hold.told = Some((at, fields.rest(3))),
                        ("r", _) => hold.outcome = Some(fields.rest(2)),
                        _ => {}
                    }
                }
                "t" => logs.advisory_timeouts.push(format!("{worker}: {line}")),
                "c" => {
                    *logs
                        .advisory_cancellations
                        .entry(worker.clone())
                        .or_default() += 1
                }
                "x" => logs.advisory_errors += 1,
                _ => {} // a line cut by SIGKILL
            }
        }
    }
    Ok(logs)
}
