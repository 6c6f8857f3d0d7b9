//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`): every name the crate records, and the helpers that record
//! them. Install any recorder (`metrics-exporter-prometheus`, ...) and call
//! `describe_metrics()` once to give each metric its help text.
//!
//! | name | type | labels | what it counts |
//! |---|---|---|---|
//! | `pg_semaphore_permits_held` | gauge | `semaphore` | slots held by this process's permits (a permit of `acquire_many(n)` counts `n`; fail-open permits hold none) |
//! | `pg_semaphore_waiters` | gauge | `semaphore` | waiting acquires (`acquire`, `acquire_many`, `acquire_all`) in progress in this process |
//! | `pg_semaphore_wait_seconds` | histogram | `semaphore` | a waiting acquire's time from its call to its permit (successful waits only) |
//! | `pg_semaphore_hold_seconds` | histogram | `semaphore` | a permit's time from its acquisition to its release or drop |
//! | `pg_semaphore_acquisitions_total` | counter | `semaphore` | permits granted by the database, by any acquire method |
//! | `pg_semaphore_no_slots_available_total` | counter | `semaphore` | fail-fast refusals: `try_acquire*` returned `NoSlotsAvailable` |
//! | `pg_semaphore_timeouts_total` | counter | `semaphore` | acquires that gave up at their `claim().timeout(d)` (`Timeout`) |
//! | `pg_semaphore_queue_full_total` | counter | `semaphore` | acquires refused by the fair queue's limit (`QueueFull`) |
//! | `pg_semaphore_permits_lost_total` | counter | `semaphore`, `reason` | permits found lost when released or dropped, once per permit |
//! | `pg_semaphore_fail_open_total` | counter | `semaphore` | fail-open admissions: unchecked permits, and requests `SemaphoreLayer` served without a permit |
//! | `pg_semaphore_reaped_total` | counter | none | expired claims freed by [`reap`](crate::admin::reap) (and so by a [`Reaper`](crate::admin::Reaper)), every semaphore together |
//! | `pg_semaphore_horizon_held_seconds` | gauge | none | how long the oldest holder of the database's xmin horizon has held it, as a [`Reaper`](crate::admin::Reaper) last saw it (0: nobody) |
//! | `pg_semaphore_horizon_age_xids` | gauge | none | transaction ids begun since that horizon: row versions VACUUM cannot remove yet |
//! | `pg_semaphore_mutex_wait_seconds` | histogram | `mutex` | a waiting lock's time from its call until it was granted |
//! | `pg_semaphore_mutex_timeouts_total` | counter | `mutex` | lock waits that gave up (`Timeout`) |
//! | `pg_semaphore_mutex_deadlocks_total` | counter | `mutex` | lock waits PostgreSQL aborted as deadlocks (`Deadlock`) |
//! | `pg_semaphore_mutex_busy_total` | counter | `mutex` | `no_wait()` refusals (`Locked`) |
//! | `pg_semaphore_rate_limit_decisions_total` | counter | `limiter`, `kind`, `decision` | rate limiter checks, by outcome: `allowed`, `refused`, `failed_open` |
//!
//! Label sets are bounded: a semaphore's or limiter's name, a mutex's
//! [`name`](crate::Mutex::name), a limiter's kind (`token_bucket`,
//! `fixed_window`, `sliding_window`), a decision, a [`LostReason`] as
//! `snake_case`. Never a rate limiter key, a holder, a claim id or an error
//! text. Gauges are kept by guards (a [`Waiting`] or [`Held`] adds on
//! creation and subtracts when dropped), so a cancelled acquire or a dropped
//! permit cannot leave them off. Claims reap their own semaphore's expired
//! slots too; the database does not report those, so the reaped counter only
//! counts [`reap`](crate::admin::reap)'s.
//!
//! Each event goes through the facade's macros where it happens (no handles
//! registered in advance), so a recorder installed after a semaphore was
//! built still sees it. That costs a label vector per call: about 0.3 µs per
//! try_acquire + release cycle with no recorder and 1 µs with a Prometheus
//! recorder, against cycles of 0.3 ms and more (`benches/metrics_overhead.rs`).
//!
//! Without the feature, every helper here is an empty `#[inline]` function
//! and the guards are empty: the call sites stay as they are and cost
//! nothing. One thing is counted in every build: a semaphore's refusals
//! (`no_slots`, `queue_full`) and timeouts (`timed_out`) also go to its
//! client's outcome counters (`pgsemaphore.outcomes`, `src/outcomes.rs`),
//! which `pg-semaphore status` shows: these helpers are the one place each
//! such event is reported.
// Without the feature the helpers ignore their arguments and the names go unused.
#![cfg_attr(not(feature = "metrics"), allow(unused_variables, dead_code))]

use std::time::Duration;

use crate::error::LostReason;
use crate::outcomes::Counter;

#[cfg(feature = "metrics")]
use ::metrics::{SharedString, counter, gauge, histogram};

const PERMITS_HELD: &str = "pg_semaphore_permits_held";
const WAITERS: &str = "pg_semaphore_waiters";
const WAIT_SECONDS: &str = "pg_semaphore_wait_seconds";
const HOLD_SECONDS: &str = "pg_semaphore_hold_seconds";
const ACQUISITIONS: &str = "pg_semaphore_acquisitions_total";
const NO_SLOTS_AVAILABLE: &str = "pg_semaphore_no_slots_available_total";
const TIMEOUTS: &str = "pg_semaphore_timeouts_total";
const QUEUE_FULL: &str = "pg_semaphore_queue_full_total";
const PERMITS_LOST: &str = "pg_semaphore_permits_lost_total";
const FAIL_OPEN: &str = "pg_semaphore_fail_open_total";
const REAPED: &str = "pg_semaphore_reaped_total";
const HORIZON_HELD_SECONDS: &str = "pg_semaphore_horizon_held_seconds";
const HORIZON_AGE_XIDS: &str = "pg_semaphore_horizon_age_xids";
const MUTEX_WAIT_SECONDS: &str = "pg_semaphore_mutex_wait_seconds";
const MUTEX_TIMEOUTS: &str = "pg_semaphore_mutex_timeouts_total";
const MUTEX_DEADLOCKS: &str = "pg_semaphore_mutex_deadlocks_total";
const MUTEX_BUSY: &str = "pg_semaphore_mutex_busy_total";
const RATE_LIMIT_DECISIONS: &str = "pg_semaphore_rate_limit_decisions_total";

/// Gives every metric of pg-semaphore its help text (and histograms their
/// unit) in the installed recorder: call it once, after installing the
/// recorder. Recording works without it; exporters then show no `# HELP`.
///
/// The metrics and their labels are listed in the guide's
/// [operations](crate::guide::operations#metrics) chapter.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // With metrics-exporter-prometheus; any `metrics` recorder works.
/// let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
/// pg_semaphore::describe_metrics();
/// // ... serve `prometheus.render()` on /metrics ...
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "metrics")]
pub fn describe_metrics() {
    use ::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

    describe_gauge!(
        PERMITS_HELD,
        "Slots held by this process's permits of the semaphore"
    );
    describe_gauge!(
        WAITERS,
        "Acquires of the semaphore waiting for a permit in this process"
    );
    describe_histogram!(
        WAIT_SECONDS,
        Unit::Seconds,
        "Time from a waiting acquire's call to its permit (successful waits only)"
    );
    describe_histogram!(
        HOLD_SECONDS,
        Unit::Seconds,
        "Time from a permit's acquisition to its release or drop"
    );
    describe_counter!(
        ACQUISITIONS,
        "Permits of the semaphore granted to this process"
    );
    describe_counter!(
        NO_SLOTS_AVAILABLE,
        "Fail-fast acquires refused because no slot was free (NoSlotsAvailable)"
    );
    describe_counter!(
        TIMEOUTS,
        "Acquires that gave up after their timeout (Timeout)"
    );
    describe_counter!(
        QUEUE_FULL,
        "Acquires refused because the fair queue was full (QueueFull)"
    );
    describe_counter!(
        PERMITS_LOST,
        "Permits found lost (reaped, released elsewhere, lease ended) when released or dropped"
    );
    describe_counter!(
        FAIL_OPEN,
        "Admissions without a slot because the database was unreachable (fail-open)"
    );
    describe_counter!(
        REAPED,
        "Expired claims freed by reap() or a Reaper, all semaphores together"
    );
    describe_gauge!(
        HORIZON_HELD_SECONDS,
        Unit::Seconds,
        "How long the oldest holder of the database's xmin horizon has held it (Reaper)"
    );
    describe_gauge!(
        HORIZON_AGE_XIDS,
        "Transaction ids begun since the database's xmin horizon (Reaper)"
    );
    describe_histogram!(
        MUTEX_WAIT_SECONDS,
        Unit::Seconds,
        "Time from a waiting lock's call until the mutex was granted"
    );
    describe_counter!(
        MUTEX_TIMEOUTS,
        "Mutex lock waits that gave up after their timeout (Timeout)"
    );
    describe_counter!(
        MUTEX_DEADLOCKS,
        "Mutex lock waits aborted by PostgreSQL's deadlock detector (Deadlock)"
    );
    describe_counter!(
        MUTEX_BUSY,
        "try_lock refusals because the mutex was held (Locked)"
    );
    describe_counter!(
        RATE_LIMIT_DECISIONS,
        "Rate limiter checks by decision: allowed, refused, failed_open"
    );
}

/// A label value shared by every sample of one semaphore, mutex or limiter
/// (an `Arc<str>`: cloning it does not allocate).
#[cfg(feature = "metrics")]
fn shared(name: &str) -> SharedString {
    SharedString::from(std::sync::Arc::<str>::from(name))
}

/// The one label of every sample of a semaphore (`semaphore`) or a mutex
/// (`mutex`): its name. Every metric of theirs is recorded through it.
#[derive(Debug, Clone)]
struct Label {
    #[cfg(feature = "metrics")]
    key: &'static str,
    #[cfg(feature = "metrics")]
    value: SharedString,
}

impl Label {
    fn new(key: &'static str, name: &str) -> Self {
        Label {
            #[cfg(feature = "metrics")]
            key,
            #[cfg(feature = "metrics")]
            value: shared(name),
        }
    }

    /// One event of the counter `metric`.
    #[inline]
    fn count(&self, metric: &'static str) {
        #[cfg(feature = "metrics")]
        counter!(metric, self.key => self.value.clone()).increment(1);
    }

    /// A time in the histogram `metric`.
    #[inline]
    fn record(&self, metric: &'static str, time: Duration) {
        #[cfg(feature = "metrics")]
        histogram!(metric, self.key => self.value.clone()).record(time);
    }

    /// The gauge `metric`.
    #[cfg(feature = "metrics")]
    fn gauge(&self, metric: &'static str) -> ::metrics::Gauge {
        gauge!(metric, self.key => self.value.clone())
    }
}

/// The metrics of one semaphore, as its handles share them, and its
/// outcome counter: every refusal and timeout reported here is counted in
/// the client's outcome counters too (`pgsemaphore.outcomes`, see
/// `src/outcomes.rs`), with or without the `metrics` feature.
#[derive(Debug, Clone)]
pub(crate) struct SemaphoreMetrics {
    semaphore: Label,
    outcomes: Option<Counter>,
}

impl SemaphoreMetrics {
    /// A semaphore's metrics, counting no outcome (a layer's fail-open).
    pub(crate) fn new(name: &str) -> Self {
        SemaphoreMetrics {
            semaphore: Label::new("semaphore", name),
            outcomes: None,
        }
    }

    /// These metrics, counting refusals and timeouts on `counter` too.
    pub(crate) fn counting(mut self, counter: Counter) -> Self {
        self.outcomes = Some(counter);
        self
    }

    /// The database granted `permits` slots: counts the acquisition; the
    /// guard keeps them in the held gauge until it is dropped with the
    /// permit, and then records the hold time.
    #[inline]
    pub(crate) fn acquired(&self, permits: usize) -> Held {
        #[cfg(feature = "metrics")]
        {
            let permits = permits as f64;
            self.semaphore.count(ACQUISITIONS);
            self.semaphore.gauge(PERMITS_HELD).increment(permits);
            Held {
                semaphore: self.semaphore.clone(),
                permits,
                since: std::time::Instant::now(),
            }
        }
        #[cfg(not(feature = "metrics"))]
        Held {}
    }

    /// A waiting acquire starts: in the waiters gauge until the guard drops
    /// (served, failed or cancelled).
    #[inline]
    pub(crate) fn waiting(&self) -> Waiting {
        #[cfg(feature = "metrics")]
        {
            self.semaphore.gauge(WAITERS).increment(1);
            Waiting {
                semaphore: self.semaphore.clone(),
            }
        }
        #[cfg(not(feature = "metrics"))]
        Waiting {}
    }

    /// A waiting acquire got its permit after `waited`.
    #[inline]
    pub(crate) fn waited(&self, waited: Duration) {
        self.semaphore.record(WAIT_SECONDS, waited);
    }

    /// A fail-fast acquire found no free slot.
    #[inline]
    pub(crate) fn no_slots(&self) {
        self.semaphore.count(NO_SLOTS_AVAILABLE);
        if let Some(outcomes) = &self.outcomes {
            outcomes.refused();
        }
    }

    /// A waiting acquire gave up at its timeout.
    #[inline]
    pub(crate) fn timed_out(&self) {
        self.semaphore.count(TIMEOUTS);
        if let Some(outcomes) = &self.outcomes {
            outcomes.timed_out();
        }
    }

    /// An acquire was refused by the fair queue's limit.
    #[inline]
    pub(crate) fn queue_full(&self) {
        self.semaphore.count(QUEUE_FULL);
        if let Some(outcomes) = &self.outcomes {
            outcomes.refused();
        }
    }

    /// A permit ended lost.
    #[inline]
    pub(crate) fn lost(&self, reason: LostReason) {
        #[cfg(feature = "metrics")]
        counter!(
            PERMITS_LOST,
            "semaphore" => self.semaphore.value.clone(),
            "reason" => lost_reason(reason),
        )
        .increment(1);
    }

    /// A caller was admitted without a slot: the database was unreachable.
    #[inline]
    pub(crate) fn failed_open(&self) {
        self.semaphore.count(FAIL_OPEN);
    }
}

/// Slots of a permit in the held gauge (see [`SemaphoreMetrics::acquired`]).
#[derive(Debug)]
pub(crate) struct Held {
    #[cfg(feature = "metrics")]
    semaphore: Label,
    #[cfg(feature = "metrics")]
    permits: f64,
    #[cfg(feature = "metrics")]
    since: std::time::Instant,
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        {
            self.semaphore.gauge(PERMITS_HELD).decrement(self.permits);
            self.semaphore.record(HOLD_SECONDS, self.since.elapsed());
        }
    }
}

/// A waiting acquire in the waiters gauge (see [`SemaphoreMetrics::waiting`]).
#[derive(Debug)]
pub(crate) struct Waiting {
    #[cfg(feature = "metrics")]
    semaphore: Label,
}

impl Drop for Waiting {
    #[inline]
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        self.semaphore.gauge(WAITERS).decrement(1);
    }
}

/// [`reap`](crate::admin::reap) freed `reaped` expired claims.
#[inline]
pub(crate) fn reaped(reaped: u64) {
    #[cfg(feature = "metrics")]
    counter!(REAPED).increment(reaped);
}

/// A [`Reaper`](crate::admin::Reaper) round's look at the xmin horizon.
#[inline]
pub(crate) fn horizon(held_for: Duration, age_xids: i64) {
    #[cfg(feature = "metrics")]
    {
        gauge!(HORIZON_HELD_SECONDS).set(held_for.as_secs_f64());
        gauge!(HORIZON_AGE_XIDS).set(age_xids as f64);
    }
}

/// The metrics of one mutex.
#[derive(Debug, Clone)]
pub(crate) struct MutexMetrics {
    mutex: Label,
}

impl MutexMetrics {
    pub(crate) fn new(name: &str) -> Self {
        MutexMetrics {
            mutex: Label::new("mutex", name),
        }
    }

    /// A waiting lock was granted after `waited`.
    #[inline]
    pub(crate) fn waited(&self, waited: Duration) {
        self.mutex.record(MUTEX_WAIT_SECONDS, waited);
    }

    /// A lock wait gave up at its timeout.
    #[inline]
    pub(crate) fn timed_out(&self) {
        self.mutex.count(MUTEX_TIMEOUTS);
    }

    /// PostgreSQL aborted a lock wait as a deadlock.
    #[inline]
    pub(crate) fn deadlock(&self) {
        self.mutex.count(MUTEX_DEADLOCKS);
    }

    /// A try-lock found the mutex held.
    #[inline]
    pub(crate) fn busy(&self) {
        self.mutex.count(MUTEX_BUSY);
    }
}

/// The metrics of one rate limiter.
#[derive(Debug, Clone)]
pub(crate) struct LimiterMetrics {
    #[cfg(feature = "metrics")]
    limiter: SharedString,
    #[cfg(feature = "metrics")]
    kind: &'static str,
}

impl LimiterMetrics {
    /// `kind`: `token_bucket`, `fixed_window` or `sliding_window`.
    pub(crate) fn new(name: &str, kind: &'static str) -> Self {
        LimiterMetrics {
            #[cfg(feature = "metrics")]
            limiter: shared(name),
            #[cfg(feature = "metrics")]
            kind,
        }
    }

    /// A check was decided by the database.
    #[inline]
    pub(crate) fn decided(&self, allowed: bool) {
        self.decision(if allowed { "allowed" } else { "refused" });
    }

    /// A check was admitted uncounted: the database was unreachable.
    #[inline]
    pub(crate) fn failed_open(&self) {
        self.decision("failed_open");
    }

    #[inline]
    fn decision(&self, decision: &'static str) {
        #[cfg(feature = "metrics")]
        counter!(
            RATE_LIMIT_DECISIONS,
            "limiter" => self.limiter.clone(),
            "kind" => self.kind,
            "decision" => decision,
        )
        .increment(1);
    }
}

/// A [`LostReason`] as a label value.
#[cfg(feature = "metrics")]
fn lost_reason(reason: LostReason) -> &'static str {
    match reason {
        LostReason::TimedOut { .. } => "timed_out",
        LostReason::AlreadyReleased { .. } => "already_released",
        LostReason::LeaseExpired => "lease_expired",
        LostReason::Missing => "missing",
        LostReason::NotHolder => "not_holder",
        LostReason::Unchecked => "unchecked",
        LostReason::ConnectionLost => "connection_lost",
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use chrono::Utc;

    use super::*;

    #[test]
    fn every_name_follows_prometheus_conventions() {
        let counters = [
            ACQUISITIONS,
            NO_SLOTS_AVAILABLE,
            TIMEOUTS,
            QUEUE_FULL,
            PERMITS_LOST,
            FAIL_OPEN,
            REAPED,
            MUTEX_TIMEOUTS,
            MUTEX_DEADLOCKS,
            MUTEX_BUSY,
            RATE_LIMIT_DECISIONS,
        ];
        let histograms = [WAIT_SECONDS, HOLD_SECONDS, MUTEX_WAIT_SECONDS];
        let gauges = [
            PERMITS_HELD,
            WAITERS,
            HORIZON_HELD_SECONDS,
            HORIZON_AGE_XIDS,
        ];
        for name in counters.iter().chain(&histograms).chain(&gauges) {
            assert!(name.starts_with("pg_semaphore_"), "{name}");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{name}"
            );
        }
        assert!(counters.iter().all(|name| name.ends_with("_total")));
        assert!(histograms.iter().all(|name| name.ends_with("_seconds")));
        // A gauge may carry its unit (Prometheus' own
        // `process_start_time_seconds` is one), never a counter's suffix.
        assert!(gauges.iter().all(|name| !name.ends_with("_total")));
    }

    #[test]
    fn lost_reasons_are_a_few_fixed_labels() {
        let at = Utc::now();
        assert_eq!(lost_reason(LostReason::TimedOut { at }), "timed_out");
        assert_eq!(
            lost_reason(LostReason::AlreadyReleased { at }),
            "already_released"
        );
        assert_eq!(lost_reason(LostReason::LeaseExpired), "lease_expired");
        assert_eq!(lost_reason(LostReason::ConnectionLost), "connection_lost");
    }
}
