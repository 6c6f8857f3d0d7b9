//! The advisory semaphores' audit log, written off the hot path: a finished
//! permit is queued in memory and a background task appends queued permits
//! to `pgsemaphore.advisory_claims` in batches (`pgsemaphore.advisory_log`,
//! one statement per batch, its columns as arrays, at most every
//! [`FLUSH_EVERY`]), through the application's pool. Claims and releases
//! never wait for it, and it never writes a row that is later updated:
//! under a held xmin horizon its table only grows, it does not churn.
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

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, oneshot};

use crate::db::{Db, Statement};
use crate::error::{Error, Result};

/// How often queued permits are written.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// Rows per statement (the function accepts at most 1,000).
const BATCH: usize = 1_000;

/// Slots per statement, all rows together (the function accepts at most
/// 100,000).
const BATCH_SLOTS: usize = 100_000;

/// Permits kept in memory while the database is unreachable.
const MAX_QUEUED: usize = 100_000;

const LOG: &str = "SELECT pgsemaphore.advisory_log(p_semaphores => $1, p_holders => $2, \
                   p_slot_counts => $3, p_slots => $4, p_metadata => $5, p_acquired_at => $6, \
                   p_ended_at => $7, p_outcomes => $8)";

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

/// The statement that writes `records` (at most [`BATCH`] of them, with at
/// most [`BATCH_SLOTS`] slots), a column per argument.
fn log_statement(db: &Db, records: &[Record]) -> Statement<(i32,)> {
    let mut slots = Vec::new();
    let mut counts = Vec::with_capacity(records.len());
    for record in records {
        counts.push(record.slots.len() as i32);
        slots.extend(record.slots.iter().map(|&slot| slot as i32));
    }
    db.query_as(LOG)
        .bind(
            records
                .iter()
                .map(|r| r.semaphore.clone())
                .collect::<Vec<_>>(),
        )
        .bind(records.iter().map(|r| r.holder.clone()).collect::<Vec<_>>())
        .bind(counts)
        .bind(slots)
        .bind(
            records
                .iter()
                .map(|r| r.metadata.clone())
                .collect::<Vec<_>>(),
        )
        .bind(records.iter().map(|r| r.acquired_at).collect::<Vec<_>>())
        .bind(records.iter().map(|r| r.ended_at).collect::<Vec<_>>())
        .bind(
            records
                .iter()
                .map(|r| r.ending.as_str())
                .collect::<Vec<_>>(),
        )
}

/// How many of `pending`'s first records one statement takes.
fn batch_len(pending: &[Record]) -> usize {
    let mut slots = 0;
    let mut take = 0;
    for record in pending.iter().take(BATCH) {
        slots += record.slots.len();
        if take > 0 && slots > BATCH_SLOTS {
            break;
        }
        take += 1;
    }
    take
}

/// A client's audit writer: a queue and the task that empties it.
#[derive(Debug)]
pub(crate) struct AuditWriter {
    queue: mpsc::UnboundedSender<Message>,
}

#[derive(Debug)]
enum Message {
    Record(Record),
    /// Write everything queued now, then answer: `Ok` once the queue is
    /// empty, or the error that stopped a write.
    Flush(oneshot::Sender<Result<()>>),
}

impl AuditWriter {
    /// A writer through `db`, its task started now.
    pub(crate) fn new(db: &Db) -> AuditWriter {
        let (queue, inbox) = mpsc::unbounded_channel();
        tokio::spawn(write(db.clone(), inbox));
        AuditWriter { queue }
    }

    /// Queues a finished permit; never waits.
    pub(crate) fn record(&self, record: Record) {
        let _ = self.queue.send(Message::Record(record));
    }

    /// Writes every record queued before the call; returns the error that
    /// stopped a write (the records stay queued). `Ok` if the task is gone
    /// (its runtime ended), which took its queue with it.
    pub(crate) async fn flush(&self) -> Result<()> {
        let (answer, answered) = oneshot::channel();
        if self.queue.send(Message::Flush(answer)).is_err() {
            return Ok(());
        }
        answered.await.unwrap_or(Ok(()))
    }
}

/// Empties the queue every [`FLUSH_EVERY`] (at once when asked to flush)
/// until every writer handle is gone and the queue is empty.
async fn write(db: Db, mut inbox: mpsc::UnboundedReceiver<Message>) {
    let mut pending: Vec<Record> = Vec::new();
    let mut flushes: Vec<oneshot::Sender<Result<()>>> = Vec::new();
    let mut open = true;
    let mut warned = false;
    while open || !pending.is_empty() {
        if open {
            tokio::select! {
                received = inbox.recv() => match received {
                    Some(message) => {
                        receive(message, &mut pending, &mut flushes);
                        while let Ok(message) = inbox.try_recv() {
                            receive(message, &mut pending, &mut flushes);
                        }
                        if pending.len() < BATCH && flushes.is_empty() {
                            tokio::time::sleep(FLUSH_EVERY).await;
                            while let Ok(message) = inbox.try_recv() {
                                receive(message, &mut pending, &mut flushes);
                            }
                        }
                    }
                    None => open = false,
                },
                () = tokio::time::sleep(FLUSH_EVERY), if !pending.is_empty() => {}
            }
        }
        while !pending.is_empty() {
            let take = batch_len(&pending);
            match db.fetch_one(log_statement(&db, &pending[..take])).await {
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
                        let one = log_statement(&db, std::slice::from_ref(record));
                        match db.fetch_one(one).await {
                            Ok(_) => {}
                            Err(Error::InvalidArgument { reason, .. }) => tracing::warn!(
                                semaphore = %record.semaphore,
                                %reason,
                                "advisory audit log refused a record: dropped"
                            ),
                            Err(error) => {
                                answer(&mut flushes, error);
                                break;
                            }
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
                    answer(&mut flushes, error);
                    if !open {
                        // Shutting down with the database away: give up.
                        return;
                    }
                    tokio::time::sleep(FLUSH_EVERY * 4).await;
                    break;
                }
            }
        }
        if pending.is_empty() {
            for flush in flushes.drain(..) {
                let _ = flush.send(Ok(()));
            }
        }
    }
}

fn receive(
    message: Message,
    pending: &mut Vec<Record>,
    flushes: &mut Vec<oneshot::Sender<Result<()>>>,
) {
    match message {
        Message::Record(record) => pending.push(record),
        Message::Flush(flush) => flushes.push(flush),
    }
}

/// Answers the waiting flushes with the error that stopped a write (the
/// first gets it; the others, its message).
fn answer(flushes: &mut Vec<oneshot::Sender<Result<()>>>, error: Error) {
    let mut error = Some(error);
    for flush in flushes.drain(..) {
        let error = match error.take() {
            Some(error) => error,
            None => Error::Database(sqlx::Error::Protocol(
                "the advisory audit log could not be written".into(),
            )),
        };
        let _ = flush.send(Err(error));
    }
}
