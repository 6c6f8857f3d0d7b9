//! What the workers and the driver logged (`<worker>.log`, `driver.log`;
//! format in [`worker`](crate::worker)), read back for the checker.

use std::collections::HashMap;
use std::path::Path;

use crate::support::chaos::{Fields, worker_logs};

/// A claim as its holder saw it.
#[derive(Debug, Clone)]
pub struct Claim {
    pub worker: String,
    pub key: String,
    pub id: i64,
    pub semaphore: String,
    pub slot: u32,
    /// When the holder was told it held the permit.
    pub at: i64,
    /// When its acquire began.
    pub asked: i64,
    /// The database's `created_at`, as the claim returned it.
    pub created: i64,
    /// When the holder stopped work (E or L).
    pub end: Option<i64>,
    /// What release said, or the lost reason.
    pub outcome: Option<String>,
    pub lost: bool,
}

/// The workers' and the driver's logs.
#[derive(Debug, Default)]
pub struct Logs {
    pub claims: Vec<Claim>,
    pub timeouts: Vec<String>,
    pub cancellations: u64,
    /// Claims the driver made while the standby was cut off, and that were
    /// never acknowledged (`N` lines).
    pub refused: usize,
    /// Every database error a worker saw: µs, and the message.
    pub errors: Vec<(i64, String)>,
}

/// The logs in `dir`.
pub fn read_logs(dir: &Path) -> std::io::Result<Logs> {
    let mut logs = Logs::default();
    for (worker, text) in worker_logs(dir)? {
        let mut by_key: HashMap<String, usize> = HashMap::new();
        for line in text.lines() {
            let fields = Fields::of(line);
            let int = |i: usize| fields.int(i);
            let key = fields.get(1).unwrap_or_default().to_owned();
            match fields.kind() {
                "A" => {
                    if let (Some(id), Some(sem), Some(slot), Some(at), Some(asked), Some(created)) =
                        (int(2), fields.get(3), int(4), int(5), int(6), int(7))
                    {
                        by_key.insert(key.clone(), logs.claims.len());
                        logs.claims.push(Claim {
                            worker: worker.clone(),
                            key,
                            id,
                            semaphore: sem.to_owned(),
                            slot: slot as u32,
                            at,
                            asked,
                            created,
                            end: None,
                            outcome: None,
                            lost: false,
                        });
                    }
                }
                "E" => {
                    if let (Some(&i), Some(at)) = (by_key.get(&key), int(2)) {
                        logs.claims[i].end = Some(at);
                    }
                }
                "L" => {
                    if let (Some(&i), Some(at)) = (by_key.get(&key), int(2)) {
                        let claim = &mut logs.claims[i];
                        claim.end = Some(at);
                        claim.outcome = Some(format!("lost {}", fields.rest(3)));
                        claim.lost = true;
                    }
                }
                "R" => {
                    if let Some(&i) = by_key.get(&key) {
                        logs.claims[i].outcome = Some(fields.rest(2));
                    }
                }
                "T" => logs.timeouts.push(line.to_owned()),
                "C" => logs.cancellations += 1,
                "N" => logs.refused += 1,
                "X" => {
                    if let Some(at) = int(1) {
                        logs.errors.push((at, fields.rest(2)));
                    }
                }
                _ => {}
            }
        }
    }
    Ok(logs)
}
