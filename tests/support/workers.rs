//! What the tests with worker processes share (`tests/torture.rs`,
//! `tests/failover.rs`): the clock the workers and the driver stamp events
//! with, a small random generator for chaos, the append-only log each worker
//! writes, and the sweep that finds the most intervals open at once.

use std::io::Write;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Microseconds since the epoch: the workers' and the driver's shared clock.
pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// A small xorshift generator: no extra dependency, good enough for chaos.
pub struct Rng(u64);

impl Rng {
    pub fn seeded(salt: u64) -> Rng {
        Rng((now_us() as u64
            ^ (u64::from(std::process::id()) << 32)
            ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A worker's log: one line per event, appended.
#[derive(Clone)]
pub struct Log(Arc<std::sync::Mutex<std::fs::File>>);

impl Log {
    /// Opens (creates) the log at `path` for appending.
    pub fn open(path: &std::path::Path) -> std::io::Result<Log> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Log(Arc::new(std::sync::Mutex::new(file))))
    }

    pub fn line(&self, line: String) {
        // One write per line on an O_APPEND file: a SIGKILL loses at most the line in flight.
        let mut file = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = file.write_all(format!("{line}\n").as_bytes());
    }
}

/// An error on one line of a log.
pub fn one_line(error: &dyn std::fmt::Display) -> String {
    error.to_string().replace('\n', " ")
}

/// The largest number of intervals `[start, end)` open at once.
pub fn max_overlap(intervals: impl IntoIterator<Item = (i64, i64)>) -> usize {
    // Ends sort before starts at the same instant: a hand-over is not an overlap.
    let mut events: Vec<(i64, i32)> = Vec::new();
    for (start, end) in intervals {
        events.push((start, 1));
        events.push((end, -1));
    }
    events.sort();
    let (mut open, mut max) = (0i64, 0i64);
    for (_, delta) in events {
        open += i64::from(delta);
        max = max.max(open);
    }
    max as usize
}
