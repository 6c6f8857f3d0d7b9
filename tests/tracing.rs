//! Tracing: a mutex lock timeout and a reap are reported as events that name
//! what they concern, and a wait is one event, not one per poll. Events are
//! captured by a minimal `tracing::Subscriber` installed for the test's
//! thread (the tests run on a current-thread runtime, so the crate's spawned
//! tasks report to it too).

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use pg_semaphore::{Error, Mutex, Semaphore, admin::Reaper};
use support::TestResult;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// One captured event: its level and fields (`message` included).
#[derive(Debug, Clone)]
struct Captured {
    level: Level,
    fields: BTreeMap<String, String>,
}

impl Captured {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }
}

#[derive(Clone, Default)]
struct Capture {
    events: Arc<StdMutex<Vec<Captured>>>,
    next_span: Arc<AtomicU64>,
}

impl Capture {
    fn events(&self) -> Vec<Captured> {
        self.events.lock().unwrap().clone()
    }
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.events.lock().unwrap().push(Captured {
            level: *event.metadata().level(),
            fields,
        });
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

#[tokio::test(flavor = "current_thread")]
async fn a_mutex_lock_timeout_is_one_event_naming_the_mutex() -> TestResult {
    let db = support::migrated_db().await;
    let capture = Capture::default();
    let _default = tracing::subscriber::set_default(capture.clone());

    let mutex = Mutex::new("nightly-report");
    let held = mutex.lock(&db.client).await?;
    let err = mutex
        .locking()
        .timeout(Duration::from_millis(300))
        .lock(&db.client)
        .await
        .expect_err("the lock is held");
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    held.rollback().await?;

    let events = capture.events();
    let about_it: Vec<&Captured> = events
        .iter()
        .filter(|e| e.field("mutex") == Some(r#"mutex "nightly-report""#))
        .collect();
    let timeouts: Vec<&&Captured> = about_it
        .iter()
        .filter(|e| e.field("message") == Some("mutex lock timed out"))
        .collect();
    assert_eq!(timeouts.len(), 1, "{events:#?}");
    assert_eq!(timeouts[0].level, Level::INFO);
    assert_eq!(timeouts[0].field("timeout_ms"), Some("300"));
    // The granted lock, and the timeout: nothing per poll of the wait.
    assert_eq!(about_it.len(), 2, "{about_it:#?}");
    assert_eq!(about_it[0].field("message"), Some("mutex locked"));
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn a_reap_reports_how_many_slots_it_freed() -> TestResult {
    let db = support::migrated_db().await;
    // Holders that died, on two semaphores (a claim on the same semaphore
    // would reap the first itself): only their lease frees the slots.
    for name in ["crashy-0", "crashy-1"] {
        let sem = Semaphore::builder(name, 3)
            .without_heartbeat()
            .build(&db.client)
            .await?;
        std::mem::forget(
            sem.acquiring()
                .lease(Duration::from_millis(10))
                .try_acquire()
                .await?,
        );
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let capture = Capture::default();
    let _default = tracing::subscriber::set_default(capture.clone());

    let reaped = pg_semaphore::admin::reap(&db.pool).await?;
    assert_eq!(reaped, 2);
    let events = capture.events();
    let reaps: Vec<&Captured> = events
        .iter()
        .filter(|e| e.field("reaped").is_some())
        .collect();
    assert_eq!(reaps.len(), 1, "{events:#?}");
    assert_eq!(reaps[0].field("reaped"), Some("2"));

    // Nothing to reap: nothing said.
    assert_eq!(pg_semaphore::admin::reap(&db.pool).await?, 0);
    assert_eq!(
        capture
            .events()
            .iter()
            .filter(|e| e.field("reaped").is_some())
            .count(),
        1
    );
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn the_reaper_warns_about_a_session_holding_back_vacuum_naming_it() -> TestResult {
    let db = support::migrated_db().await;
    let (mut idle, pid) = support::idle_in_transaction(&db.options, "stuck-report").await?;
    let capture = Capture::default();
    let _default = tracing::subscriber::set_default(capture.clone());
    let warnings = |capture: &Capture| -> Vec<Captured> {
        capture
            .events()
            .into_iter()
            .filter(|e| e.level == Level::WARN && e.field("pid") == Some(&pid.to_string()))
            .collect()
    };

    let threshold = Duration::from_millis(400);
    let reaper = Reaper::builder()
        .interval(Duration::from_millis(50))
        .horizon_warning(Some(threshold))
        .spawn(&db.pool)?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(warnings(&capture).is_empty(), "not before the threshold");
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let said = warnings(&capture);
    // Over 1.2 s: at 0.4 s at the earliest, then at most once per 0.4 s.
    assert!((1..=3).contains(&said.len()), "{said:#?}");
    let first = &said[0];
    assert_eq!(first.field("application"), Some("stuck-report"));
    assert_eq!(first.field("state"), Some("idle in transaction"));
    assert!(
        first
            .field("message")
            .is_some_and(|m| m.contains(&format!("pid {pid}"))),
        "{first:?}"
    );

    // Once it ends, the reaper says nothing more.
    sqlx::raw_sql("COMMIT").execute(&mut idle).await?;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let before = warnings(&capture).len();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(warnings(&capture).len(), before);
    reaper.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn a_handle_whose_limits_differ_from_the_stored_ones_is_warned_once_naming_both_pairs()
-> TestResult {
    use pg_semaphore::{RateLimiter, RatePolicy};
    let db = support::migrated_db().await;
    let capture = Capture::default();
    let _default = tracing::subscriber::set_default(capture.clone());

    // The first use stores 3 per hour; a handle with the same pair says nothing.
    let stored = RateLimiter::builder(
        "deployed",
        RatePolicy::fixed_window(3, Duration::from_secs(3600)),
    )
    .build(&db.client)?;
    assert_eq!(stored.check("k", 1).await?.remaining, 2);
    // A later deploy's code says 50 per minute: decided under the stored
    // pair, and told so once.
    let newer = RateLimiter::builder(
        "deployed",
        RatePolicy::fixed_window(50, Duration::from_secs(60)),
    )
    .build(&db.client)?;
    assert_eq!(newer.check("k", 1).await?.remaining, 1);
    assert!(newer.check("k", 1).await?.allowed);
    let again = RateLimiter::builder(
        "deployed",
        RatePolicy::fixed_window(50, Duration::from_secs(60)),
    )
    .build(&db.client)?;
    assert!(!again.check("k", 1).await?.allowed);

    let events = capture.events();
    let warnings: Vec<&Captured> = events
        .iter()
        .filter(|e| e.level == Level::WARN && e.field("limiter") == Some("deployed"))
        .collect();
    assert_eq!(warnings.len(), 1, "{events:#?}");
    let warning = warnings[0];
    assert_eq!(
        warning.field("code_limits"),
        Some("50 per 60s"),
        "{warning:?}"
    );
    assert_eq!(
        warning.field("stored_limits"),
        Some("3 per 3600s"),
        "{warning:?}"
    );
    let message = warning.field("message").unwrap_or_default();
    assert!(message.contains("set_rate_limit"), "{message}");
    assert!(message.contains("pg-semaphore limits"), "{message}");
    Ok(())
}
