//! The advisory semaphores' audit log, written off the hot path: a finished
//! permit is queued in memory and a background task appends queued permits
//! to `pgsemaphore.advisory_claims` in batches (`pgsemaphore.advisory_log`,
//! one statement per batch, at most every [`FLUSH_EVERY`]), through the
//! application's pool. Claims and releases never wait for it, and it never
//! writes a row that is later updated: under a held xmin horizon its table
//! only grows, it does not churn.
//!
//! What it does not promise: permits that end while the database is
//! unreachable are retried until the queue holds [`MAX_QUEUED`] of them,
//! then dropped with a `WARN`; a process that dies loses its queue. The
//! live holders are in `pg_locks`, never only here.
//!
//! The function checks every entry (the semaphore exists, the slots lie
//! below the highest capacity it has had, the times are ordered) and refuses
//! a batch with one entry that fails (SQLSTATE 22023): the batch is then
//! written one entry at a time, and an entry refused on its own is dropped
//! with a `WARN` (say, a semaphore an operator removed meanwhile), so one
//! record never holds up the others.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::mpsc;

use crate::db::Db;
use crate::error::Error;
use crate::per_pool::PerPool;

/// How often queued permits are written.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// Rows per statement (the function accepts at most 1,000).
const BATCH: usize = 1_000;

/// Permits kept in memory while the database is unreachable.
const MAX_QUEUED: usize = 100_000;

const LOG: &str = "SELECT pgsemaphore.advisory_log(p_claims => $1)";

/// How a permit ended, as the audit log records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    Released,
    Lost,
    Dropped,
}

impl Ending {
    fn as_str(self) -> &'static str {
        match self {
            Ending::Released => "released",
            Ending::Lost => "lost",
            Ending::Dropped => "dropped",
        }
    }
}

/// One finished permit.
#[derive(Debug)]
pub(crate) struct Record {
    pub(crate) semaphore: String,
    pub(crate) slots: Vec<u32>,
    pub(crate) holder: String,
    pub(crate) metadata: Option<serde_json::Value>,
    pub(crate) acquired_at: DateTime<Utc>,
    pub(crate) ended_at: DateTime<Utc>,
    pub(crate) ending: Ending,
}

impl Record {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "semaphore": self.semaphore,
            "slots": self.slots,
            "holder": self.holder,
            "metadata": self.metadata,
            "acquired_at": self.acquired_at.to_rfc3339(),
            "ended_at": self.ended_at.to_rfc3339(),
            "outcome": self.ending.as_str(),
        })
    }
}

/// A pool's audit writer: a queue and the task that empties it.
#[derive(Debug)]
pub(crate) struct AuditWriter {
    queue: mpsc::UnboundedSender<Record>,
}

static WRITERS: PerPool<AuditWriter> = PerPool::new();

impl AuditWriter {
    /// The writer for `db`'s pool (one per pool per process).
    pub(crate) fn for_db(db: &Db) -> Arc<AuditWriter> {
        WRITERS.get(&db.pool().connect_options(), || {
            let (queue, inbox) = mpsc::unbounded_channel();
            tokio::spawn(write(db.clone(), inbox));
            Arc::new(AuditWriter { queue })
        })
    }

    /// Queues a finished permit; never waits.
    pub(crate) fn record(&self, record: Record) {
        let _ = self.queue.send(record);
    }
}

/// Empties the queue every [`FLUSH_EVERY`] until every writer handle is
/// gone and the queue is empty.
async fn write(db: Db, mut inbox: mpsc::UnboundedReceiver<Record>) {
    let mut pending: Vec<Record> = Vec::new();
    let mut open = true;
    let mut warned = false;
    while open || !pending.is_empty() {
        if open {
            tokio::select! {
                received = inbox.recv() => match received {
                    Some(record) => {
                        pending.push(record);
                        while let Ok(record) = inbox.try_recv() {
                            pending.push(record);
                        }
                        if pending.len() < BATCH {
                            tokio::time::sleep(FLUSH_EVERY).await;
                            while let Ok(record) = inbox.try_recv() {
                                pending.push(record);
                            }
                        }
                    }
                    None => open = false,
                },
                () = tokio::time::sleep(FLUSH_EVERY), if !pending.is_empty() => {}
            }
        }
        while !pending.is_empty() {
            let take = pending.len().min(BATCH);
            let batch: Vec<serde_json::Value> = pending[..take].iter().map(Record::json).collect();
            let query = db
                .query_as::<(i32,)>(LOG)
                .bind(serde_json::Value::Array(batch));
            match db.fetch_one(query).await {
                Ok(_) => {
                    pending.drain(..take);
                    warned = false;
                }
                Err(Error::InvalidArgument { .. }) => {
                    // One entry of the batch does not fit: write them one by
                    // one. A failure other than a refusal keeps the rest
                    // queued for the next round.
                    let mut written = 0;
                    for record in &pending[..take] {
                        let one = db
                            .query_as::<(i32,)>(LOG)
                            .bind(serde_json::Value::Array(vec![record.json()]));
                        match db.fetch_one(one).await {
                            Ok(_) => {}
                            Err(Error::InvalidArgument { reason, .. }) => tracing::warn!(
                                semaphore = %record.semaphore,
                                %reason,
                                "advisory audit log refused a record: dropped"
                            ),
                            Err(_) => break,
                        }
                        written += 1;
                    }
                    pending.drain(..written);
                    if written < take {
                        tokio::time::sleep(FLUSH_EVERY * 4).await;
                        break;
                    }
                }
                Err(error) => {
                    if !warned {
                        tracing::warn!(%error, queued = pending.len(), "writing the advisory semaphores' audit log failed; retrying");
                        warned = true;
                    }
                    if pending.len() > MAX_QUEUED {
                        let dropped = pending.len() - MAX_QUEUED;
                        pending.drain(..dropped);
                        tracing::warn!(
                            dropped,
                            "advisory audit log queue full: oldest records dropped"
                        );
                    }
                    if !open {
                        // Shutting down with the database away: give up.
                        return;
                    }
                    tokio::time::sleep(FLUSH_EVERY * 4).await;
                    break;
                }
            }
        }
    }
}
