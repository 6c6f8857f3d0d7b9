//! The outcome counters: how many requests each semaphore, family and rate
//! limiter refused, timed out and (rate limiters) admitted, per minute, in
//! `pgsemaphore.outcomes` (its comment in
//! `migrations/20261128010001_pgsemaphore_tables.sql`; its one writer,
//! `pgsemaphore.record_outcomes`, in `..._operator.sql`, states what it
//! meets).
//!
//! Writing: each [`Client`](crate::Client) keeps a [`Tally`], counts in
//! memory on the request's path (a mutex and a hash map entry: no
//! statement, no allocation once a name is in the map), and a task of its
//! own adds what it counted to the table every [`FLUSH_EVERY`], in one
//! statement (up to 1,000 names per statement). The task starts with the
//! first count and ends when a round finds nothing counted; the client's
//! [`shutdown`](crate::Client::shutdown) writes what is left. A write that
//! fails keeps its counts (added back to what was counted meanwhile) for
//! the next round, with one `WARN` per run of failures. The counts are
//! statistics: a process that dies loses what it had not written, and the
//! row's minute is the one in which it was written (at most
//! [`FLUSH_EVERY`] after the request, later after an outage).
//!
//! Each primitive holds a [`Counter`]: its row's kind and name and the
//! client's tally. The lease and advisory semaphores count through their
//! [`SemaphoreMetrics`](crate::metrics::SemaphoreMetrics), at the places
//! that report a refusal or a timeout to the metrics; a family's keys count
//! under the family's name; the rate limiters count their decisions.
//!
//! Reading: [`outcomes`] and [`outcomes_of`] (re-exported in
//! [`admin`](crate::admin)), for any role that may read the table.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::admin::LimiterKind;
use crate::background::lock;
use crate::db::Db;
use crate::error::Result;
use crate::validate;

/// How often a client writes what it counted.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_secs(5);

/// Names per statement (the function accepts at most 1,000).
const BATCH: usize = 1_000;

/// The most one statement adds to one count (the function's bound); the
/// rest waits for the next round.
const MAX_ADDED: u64 = 1_000_000_000;

/// Adds a process's counts to the current minute's rows.
const RECORD: &str = "SELECT pgsemaphore.record_outcomes(p_kinds => $1, p_names => $2, \
                      p_admitted => $3, p_refused => $4, p_timed_out => $5)";

/// Every name's minutes that overlap the window `$1..$2`.
const READ: &str = "\
SELECT o.kind, o.name, o.minute, o.admitted, o.refused, o.timed_out
  FROM pgsemaphore.outcomes o
 WHERE o.minute > $1::timestamptz - interval '1 minute' AND o.minute < $2
 ORDER BY o.kind, o.name, o.minute";

/// One name's (`$3` of kind `$4`) minutes that overlap the window `$1..$2`.
const READ_ONE: &str = "\
SELECT o.kind, o.name, o.minute, o.admitted, o.refused, o.timed_out
  FROM pgsemaphore.outcomes o
 WHERE o.kind = $4 AND o.name = $3
   AND o.minute > $1::timestamptz - interval '1 minute' AND o.minute < $2
 ORDER BY o.minute";

/// What a row of the outcome counters counts: a lease semaphore, an
/// advisory one, a family (every key under the family's name), or a rate
/// limiter of one of the three kinds (a limiter is its kind and its name).
///
/// With the `serde` feature it serializes as its name in the database:
/// `"semaphore"`, `"advisory"`, `"family"`, `"token_bucket"`,
/// `"fixed_window"`, `"sliding_window"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum OutcomeKind {
    /// A lease [`Semaphore`](crate::Semaphore), by its name.
    Semaphore,
    /// An [`AdvisorySemaphore`](crate::AdvisorySemaphore).
    Advisory,
    /// A [`SemaphoreFamily`](crate::SemaphoreFamily): its keys together.
    Family,
    /// A rate limiter with a [`RatePolicy::TokenBucket`](crate::RatePolicy::TokenBucket).
    TokenBucket,
    /// A rate limiter with a [`RatePolicy::FixedWindow`](crate::RatePolicy::FixedWindow).
    FixedWindow,
    /// A rate limiter with a [`RatePolicy::SlidingWindow`](crate::RatePolicy::SlidingWindow).
    SlidingWindow,
}

impl OutcomeKind {
    /// The kind's name in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeKind::Semaphore => "semaphore",
            OutcomeKind::Advisory => "advisory",
            OutcomeKind::Family => "family",
            OutcomeKind::TokenBucket => "token_bucket",
            OutcomeKind::FixedWindow => "fixed_window",
            OutcomeKind::SlidingWindow => "sliding_window",
        }
    }

    /// The rate limiter's kind, for a rate limiter's row.
    pub fn limiter(self) -> Option<LimiterKind> {
        match self {
            OutcomeKind::TokenBucket => Some(LimiterKind::TokenBucket),
            OutcomeKind::FixedWindow => Some(LimiterKind::FixedWindow),
            OutcomeKind::SlidingWindow => Some(LimiterKind::SlidingWindow),
            _ => None,
        }
    }

    fn parse(text: &str) -> Option<OutcomeKind> {
        Some(match text {
            "semaphore" => OutcomeKind::Semaphore,
            "advisory" => OutcomeKind::Advisory,
            "family" => OutcomeKind::Family,
            "token_bucket" => OutcomeKind::TokenBucket,
            "fixed_window" => OutcomeKind::FixedWindow,
            "sliding_window" => OutcomeKind::SlidingWindow,
            _ => return None,
        })
    }
}

impl From<LimiterKind> for OutcomeKind {
    fn from(kind: LimiterKind) -> OutcomeKind {
        match kind {
            LimiterKind::TokenBucket => OutcomeKind::TokenBucket,
            LimiterKind::FixedWindow => OutcomeKind::FixedWindow,
            LimiterKind::SlidingWindow => OutcomeKind::SlidingWindow,
        }
    }
}

impl fmt::Display for OutcomeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One minute of one semaphore's, family's or rate limiter's outcome
/// counters, as every process reported them ([`outcomes`]).
///
/// With the `serde` feature it serializes as `{"kind", "name", "minute",
/// "admitted", "refused", "timed_out"}`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct OutcomeCounts {
    /// What the name is.
    pub kind: OutcomeKind,
    /// The semaphore's, family's or limiter's name (never a key).
    pub name: String,
    /// The start of the minute (database clock) in which the counts were
    /// written: each process writes every 5 s, so a request is counted in
    /// its minute or, in the last seconds of it, in the next; after an
    /// outage, in the minute its process could write again.
    pub minute: DateTime<Utc>,
    /// Rate limiters: checks and acquires admitted (a [`LimiterSet`](crate::LimiterSet)'s
    /// admission counts for each of its limiters). 0 for semaphores: their
    /// admissions are their claims in the audit log.
    pub admitted: u64,
    /// Refused at once: a full semaphore ([`Error::NoSlotsAvailable`](crate::Error::NoSlotsAvailable)),
    /// a full fair queue ([`Error::QueueFull`](crate::Error::QueueFull)), a refused rate check (a
    /// set's refusal counts for the limiter that decided).
    pub refused: u64,
    /// Waits that gave up at their timeout ([`Error::Timeout`](crate::Error::Timeout)): a
    /// semaphore's [`timeout`](crate::Acquiring::timeout), a rate
    /// limiter's acquire that could not be admitted within its wait.
    pub timed_out: u64,
}

type Row = (String, String, DateTime<Utc>, i64, i64, i64);

fn counts((kind, name, minute, admitted, refused, timed_out): Row) -> Option<OutcomeCounts> {
    Some(OutcomeCounts {
        kind: OutcomeKind::parse(&kind)?,
        name,
        minute,
        admitted: admitted.max(0) as u64,
        refused: refused.max(0) as u64,
        timed_out: timed_out.max(0) as u64,
    })
}

/// The outcome counters of every semaphore, family and rate limiter, one
/// row per name and minute, for the minutes that overlap `window` (a
/// minute starting at 12:04 overlaps a window from 12:04:30), by kind, name
/// and minute. Only minutes with counts have rows.
///
/// What a dashboard of "refused and timed out per second over the last 15
/// minutes" reads (a minute's counts divided by 60); `pg-semaphore status`
/// shows the minutes that overlap the last 60 seconds.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), pg_semaphore::Error> {
/// use chrono::{TimeDelta, Utc};
/// let now = Utc::now();
/// for row in pg_semaphore::admin::outcomes(&pool, now - TimeDelta::minutes(15)..now).await? {
///     println!(
///         "{} {} {}: {:.2} refused/s, {:.2} timed out/s",
///         row.minute, row.kind, row.name,
///         row.refused as f64 / 60.0, row.timed_out as f64 / 60.0,
///     );
/// }
/// # Ok(())
/// # }
/// ```
///
/// # Privileges
///
/// Reads `pgsemaphore.outcomes`, which the guide's grants let both the
/// application and the operator role read.
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a window that ends before it starts;
/// [`Error::Schema`](crate::Error::Schema), [`Error::Database`](crate::Error::Database).
///
/// # Cancel safety
///
/// Read-only: cancel at will.
pub async fn outcomes(pool: &PgPool, window: Range<DateTime<Utc>>) -> Result<Vec<OutcomeCounts>> {
    validate::time_range(&window)?;
    let db = Db::new(pool, true);
    let query = db.query_as::<Row>(READ).bind(window.start).bind(window.end);
    Ok(db
        .fetch_all(query)
        .await?
        .into_iter()
        .filter_map(counts)
        .collect())
}

/// The outcome counters of one semaphore, family or rate limiter (`kind`
/// and `name`: a rate limiter's kind is its policy's, `LimiterKind::into`),
/// one row per minute that overlaps `window` and has counts, oldest first:
/// `pg-semaphore audit --limiter` and `report --limiter` read them.
///
/// # Errors
///
/// As [`outcomes`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a bad name.
///
/// # Cancel safety
///
/// Read-only: cancel at will.
pub async fn outcomes_of(
    pool: &PgPool,
    kind: OutcomeKind,
    name: &str,
    window: Range<DateTime<Utc>>,
) -> Result<Vec<OutcomeCounts>> {
    validate::time_range(&window)?;
    validate::name(name)?;
    let db = Db::new(pool, true);
    let query = db
        .query_as::<Row>(READ_ONE)
        .bind(window.start)
        .bind(window.end)
        .bind(name.to_owned())
        .bind(kind.as_str());
    Ok(db
        .fetch_all(query)
        .await?
        .into_iter()
        .filter_map(counts)
        .collect())
}

/// What one name counted since the last write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counts {
    admitted: u64,
    refused: u64,
    timed_out: u64,
}

impl Counts {
    fn add(&mut self, other: Counts) {
        self.admitted = self.admitted.saturating_add(other.admitted);
        self.refused = self.refused.saturating_add(other.refused);
        self.timed_out = self.timed_out.saturating_add(other.timed_out);
    }

    /// What one statement may add (each count up to [`MAX_ADDED`]), and
    /// what is left for the next.
    fn split(self) -> (Counts, Counts) {
        let part = |n: u64| (n.min(MAX_ADDED), n.saturating_sub(MAX_ADDED));
        let (admitted, admitted_left) = part(self.admitted);
        let (refused, refused_left) = part(self.refused);
        let (timed_out, timed_out_left) = part(self.timed_out);
        (
            Counts {
                admitted,
                refused,
                timed_out,
            },
            Counts {
                admitted: admitted_left,
                refused: refused_left,
                timed_out: timed_out_left,
            },
        )
    }

    fn is_zero(self) -> bool {
        self == Counts::default()
    }
}

type Key = (OutcomeKind, Arc<str>);

/// What the tally keeps under its lock.
#[derive(Debug, Default)]
struct State {
    counts: HashMap<Key, Counts>,
    /// Whether the task that writes every [`FLUSH_EVERY`] runs. Changed
    /// only with the counts, under the lock: the task ends only when it
    /// finds no count, and a count finds it running or starts it.
    running: bool,
}

/// A client's outcome counters in memory, and the writing of them.
#[derive(Debug)]
pub(crate) struct Tally {
    db: Db,
    state: Mutex<State>,
    /// One write at a time: a shutdown's waits for the task's in flight.
    writing: tokio::sync::Mutex<()>,
    /// Whether the current run of failed writes was reported.
    warned: AtomicBool,
}

impl Tally {
    pub(crate) fn new(db: &Db) -> Tally {
        Tally {
            db: db.clone(),
            state: Mutex::new(State::default()),
            writing: tokio::sync::Mutex::new(()),
            warned: AtomicBool::new(false),
        }
    }

    /// The counter of `kind` `name` on this tally.
    pub(crate) fn counter(self: &Arc<Self>, kind: OutcomeKind, name: &str) -> Counter {
        Counter {
            tally: self.clone(),
            key: (kind, Arc::from(name)),
        }
    }

    /// Adds `counts` to `key`'s, and starts the writing task if it is not
    /// running. Never waits but for the lock (held for a map update).
    fn add(self: &Arc<Self>, key: &Key, counts: Counts) {
        let start = {
            let mut state = lock(&self.state);
            match state.counts.get_mut(key) {
                Some(kept) => kept.add(counts),
                None => {
                    state.counts.insert(key.clone(), counts);
                }
            }
            !std::mem::replace(&mut state.running, true)
        };
        if start {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(write_every(Arc::downgrade(self)));
                }
                // No runtime (cannot happen on the request paths, which are
                // async): the next count, or the shutdown, writes.
                Err(_) => lock(&self.state).running = false,
            }
        }
    }

    /// Adds back counts that could not be written.
    fn restore(&self, entries: impl IntoIterator<Item = (Key, Counts)>) {
        let mut state = lock(&self.state);
        for (key, counts) in entries {
            state.counts.entry(key).or_default().add(counts);
        }
    }

    /// Writes everything counted so far (one statement per 1,000 names):
    /// `Ok` once written, or the error of the write that failed, whose
    /// counts and the rest are kept for the next round. Cancel-safe only in
    /// a task of its own ([`flush`](Self::flush)).
    async fn write(&self) -> Result<()> {
        let _one = self.writing.lock().await;
        let taken: Vec<(Key, Counts)> = std::mem::take(&mut lock(&self.state).counts)
            .into_iter()
            .collect();
        let mut rest = taken.into_iter().peekable();
        while rest.peek().is_some() {
            let chunk: Vec<(Key, Counts)> = rest.by_ref().take(BATCH).collect();
            let mut kinds = Vec::with_capacity(chunk.len());
            let mut names = Vec::with_capacity(chunk.len());
            let mut admitted = Vec::with_capacity(chunk.len());
            let mut refused = Vec::with_capacity(chunk.len());
            let mut timed_out = Vec::with_capacity(chunk.len());
            let mut left = Vec::new();
            for ((kind, name), counts) in &chunk {
                let (now, later) = counts.split();
                kinds.push(kind.as_str());
                names.push(name.to_string());
                admitted.push(now.admitted as i64);
                refused.push(now.refused as i64);
                timed_out.push(now.timed_out as i64);
                if !later.is_zero() {
                    left.push(((*kind, name.clone()), later));
                }
            }
            let query = self
                .db
                .query_as::<(i32,)>(RECORD)
                .bind(kinds)
                .bind(names)
                .bind(admitted)
                .bind(refused)
                .bind(timed_out);
            if let Err(error) = self.db.fetch_one(query).await {
                let kept = chunk.len() + rest.len();
                self.restore(chunk.into_iter().chain(rest));
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        %error,
                        names = kept,
                        "writing the outcome counters failed; the counts are kept and written later"
                    );
                }
                return Err(error);
            }
            self.restore(left);
        }
        if self.warned.swap(false, Ordering::Relaxed) {
            tracing::info!("the outcome counters are written again");
        }
        Ok(())
    }

    /// Writes everything counted so far, in a task of its own, so that a
    /// caller that stops waiting leaves nothing half written: the
    /// [`shutdown`](crate::Client::shutdown) of the client.
    pub(crate) async fn flush(self: &Arc<Self>) -> Result<()> {
        let tally = self.clone();
        match tokio::spawn(async move { tally.write().await }).await {
            Ok(result) => result,
            // The runtime is shutting down: nothing more can be written.
            Err(_) => Ok(()),
        }
    }
}

/// The writing task: every [`FLUSH_EVERY`], writes what was counted; ends
/// when a round finds nothing counted (the next count starts it again), or
/// when the tally is gone (its client and every primitive were dropped).
async fn write_every(tally: Weak<Tally>) {
    loop {
        tokio::time::sleep(FLUSH_EVERY).await;
        let Some(tally) = tally.upgrade() else {
            return;
        };
        {
            let mut state = lock(&tally.state);
            if state.counts.is_empty() {
                state.running = false;
                return;
            }
        }
        // A failure is reported (once per run of them) and its counts kept.
        let _ = tally.write().await;
    }
}

/// One semaphore's, family's or limiter's counter on its client's tally.
#[derive(Clone)]
pub(crate) struct Counter {
    tally: Arc<Tally>,
    key: Key,
}

impl fmt::Debug for Counter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Counter")
            .field("kind", &self.key.0)
            .field("name", &self.key.1)
            .finish_non_exhaustive()
    }
}

impl Counter {
    /// A request was admitted (rate limiters).
    pub(crate) fn admitted(&self) {
        self.tally.add(
            &self.key,
            Counts {
                admitted: 1,
                ..Counts::default()
            },
        );
    }

    /// A request was refused at once.
    pub(crate) fn refused(&self) {
        self.tally.add(
            &self.key,
            Counts {
                refused: 1,
                ..Counts::default()
            },
        );
    }

    /// A waiting request gave up at its timeout.
    pub(crate) fn timed_out(&self) {
        self.tally.add(
            &self.key,
            Counts {
                timed_out: 1,
                ..Counts::default()
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_above_what_one_statement_adds_is_split() {
        let counts = Counts {
            admitted: 3,
            refused: MAX_ADDED + 5,
            timed_out: u64::MAX,
        };
        let (now, later) = counts.split();
        assert_eq!(
            now,
            Counts {
                admitted: 3,
                refused: MAX_ADDED,
                timed_out: MAX_ADDED
            }
        );
        assert_eq!(
            later,
            Counts {
                admitted: 0,
                refused: 5,
                timed_out: u64::MAX - MAX_ADDED
            }
        );
        let mut kept = Counts {
            refused: u64::MAX,
            ..Counts::default()
        };
        kept.add(later);
        assert_eq!(kept.refused, u64::MAX);
    }

    #[test]
    fn every_kind_reads_back_as_itself() {
        for kind in [
            OutcomeKind::Semaphore,
            OutcomeKind::Advisory,
            OutcomeKind::Family,
            OutcomeKind::TokenBucket,
            OutcomeKind::FixedWindow,
            OutcomeKind::SlidingWindow,
        ] {
            assert_eq!(OutcomeKind::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(
            OutcomeKind::from(LimiterKind::FixedWindow).limiter(),
            Some(LimiterKind::FixedWindow)
        );
    }
}
