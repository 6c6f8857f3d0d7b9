//! A live dashboard: one page showing every semaphore, family, rate limiter
//! and mutex of the database as it changes, as an [`axum::Router`] an
//! application mounts behind its own authentication (`pg-semaphore
//! dashboard` serves the same router).
//!
//! ```no_run
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let app = axum::Router::new().nest("/ops/limits", pg_semaphore::dashboard::router(pool));
//! // ... behind the application's own authentication layer
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! # Routes
//!
//! Relative to where the router is mounted:
//!
//! - `GET /`: the page (HTML, CSS and script in one response; nothing is
//!   fetched from any other site, so it works offline). It opens `events`
//!   and draws each snapshot; it never queries the database itself.
//! - `GET /events`: server-sent events, one JSON snapshot per sample (about
//!   once a second) in `data:`.
//! - `GET /snapshot.json`: the current snapshot.
//!
//! # The sampler
//!
//! One task per [`Dashboard`] samples the schema and `pg_locks` once per
//! [`interval`](Dashboard::interval), a second by default (the reads of
//! [`admin`](crate::admin): [`semaphores`](crate::admin::semaphores),
//! [`families`](crate::admin::families),
//! [`busiest_keys`](crate::admin::busiest_keys),
//! [`rate_limiters`](crate::admin::rate_limiters),
//! [`mutexes`](crate::admin::mutexes), [`horizon`](crate::admin::horizon),
//! [`outcomes`](crate::admin::outcomes) over the last 15 minutes, and the
//! fair queues' waiters by key) and hands the snapshot to every viewer.
//! It starts with the first viewer of `events` and stops when the last
//! one leaves (the viewers own it: no handle to shut down), so an
//! unwatched dashboard costs the database nothing;
//! `snapshot.json` with no viewer samples once. A sample that fails (the
//! database is down, or does not answer within five intervals) is sent as
//! an error beside the last good snapshot: the page says since when the
//! database has been unreachable, and recovers with the next good sample.
//!
//! # Privileges
//!
//! Every read is one the application role of the guide's grants may make
//! (SELECT on the schema's tables, `pg_locks`, `pg_stat_activity`,
//! `pg_replication_slots`, `pg_prepared_xacts`): the page needs no
//! operator role and changes nothing. Other roles' sessions show their
//! application name and start times only to a role with
//! `pg_read_all_stats` (or `pg_monitor`).

mod snapshot;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use chrono::Utc;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The page: markup, style and script in one response.
const PAGE: &str = concat!(
    include_str!("page.html"),
    "<style>\n",
    include_str!("page.css"),
    "</style>\n<script>\n",
    include_str!("page.js"),
    "</script>\n</body>\n</html>\n"
);

/// What the page may load: nothing from elsewhere, its own events only.
const CSP: &str = "default-src 'none'; connect-src 'self'; script-src 'unsafe-inline'; \
                   style-src 'unsafe-inline'; img-src data:; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

/// The dashboard's page, its events and its sampler; [`router`] serves
/// them. Clones share the sampler.
#[derive(Debug, Clone)]
pub struct Dashboard {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    pool: PgPool,
    interval: Duration,
    /// The latest frame (JSON); empty until the first sample. Each viewer
    /// of `events` holds a receiver: the receiver count is the number of
    /// viewers.
    frames: watch::Sender<Arc<str>>,
    /// The running sampler, if any. Viewers arriving and the sampler
    /// leaving take this lock, so a viewer never subscribes to a sampler
    /// that has decided to stop.
    sampler: StdMutex<Option<JoinHandle<()>>>,
    /// Samples taken by the sampler since the dashboard was built.
    samples: AtomicU64,
}

/// The dashboard's router for `pool`, with a sampler of its own: mount it
/// with [`Router::nest`] (under any prefix) behind the application's
/// authentication. Short for `Dashboard::new(pool).router()`.
pub fn router(pool: PgPool) -> Router {
    Dashboard::new(pool).router()
}

impl Dashboard {
    /// A dashboard of the database `pool` connects to, sampling every
    /// second. Nothing runs until the first viewer arrives.
    pub fn new(pool: PgPool) -> Self {
        Dashboard::with_interval(pool, Duration::from_secs(1))
    }

    fn with_interval(pool: PgPool, interval: Duration) -> Self {
        let (frames, _) = watch::channel(Arc::<str>::from(""));
        Dashboard {
            shared: Arc::new(Shared {
                pool,
                interval,
                frames,
                sampler: StdMutex::new(None),
                samples: AtomicU64::new(0),
            }),
        }
    }

    /// Samples every `interval` instead (at least 100 ms).
    pub fn interval(self, interval: Duration) -> Self {
        let pool = self.shared.pool.clone();
        Dashboard::with_interval(pool, interval.max(Duration::from_millis(100)))
    }

    /// The routes (see the [module](self)), sharing this dashboard's sampler.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/", get(page))
            .route("/events", get(events))
            .route("/snapshot.json", get(snapshot))
            .with_state(self.clone())
    }

    /// How many viewers the events have now.
    pub fn viewers(&self) -> usize {
        self.shared.frames.receiver_count()
    }

    /// Whether the sampler runs now (it does while someone views the events).
    pub fn is_sampling(&self) -> bool {
        self.shared
            .sampler
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|task| !task.is_finished())
    }

    /// How many samples the sampler has taken (not counting `snapshot.json`'s
    /// own when nobody watched).
    pub fn samples(&self) -> u64 {
        self.shared.samples.load(Ordering::Relaxed)
    }

    /// A receiver of the frames, with the sampler started if it was not.
    fn watch(&self) -> watch::Receiver<Arc<str>> {
        let mut sampler = self
            .shared
            .sampler
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let start = sampler.as_ref().is_none_or(|task| task.is_finished());
        if start {
            // The last run's frame is stale: the new viewer waits for a fresh one.
            self.shared.frames.send_replace(Arc::from(""));
        }
        // Subscribed before the sampler can look at the receiver count.
        let frames = self.shared.frames.subscribe();
        if start {
            *sampler = Some(tokio::spawn(sample_while_watched(self.shared.clone())));
        }
        frames
    }
}

/// The sampler: a sample, then a pause of an interval (cut short when the
/// last viewer leaves), while anyone watches.
async fn sample_while_watched(shared: Arc<Shared>) {
    let mut last = None;
    let mut down: Option<(String, chrono::DateTime<Utc>)> = None;
    let deadline = (shared.interval * 5).max(Duration::from_secs(5));
    loop {
        match tokio::time::timeout(deadline, snapshot::sample(&shared.pool)).await {
            Ok(Ok(sample)) => {
                last = Some(sample);
                down = None;
            }
            Ok(Err(error)) => {
                let since = down.map_or_else(Utc::now, |(_, since)| since);
                down = Some((error.to_string(), since));
            }
            Err(_) => {
                let since = down.map_or_else(Utc::now, |(_, since)| since);
                let message = format!(
                    "the database did not answer within {} s",
                    deadline.as_secs()
                );
                down = Some((message, since));
            }
        }
        shared.samples.fetch_add(1, Ordering::Relaxed);
        let frame = snapshot::frame(
            last.as_ref(),
            down.as_ref().map(|(m, s)| (m.as_str(), *s)),
            shared.interval,
        );
        shared.frames.send_replace(frame.into());
        tokio::select! {
            () = tokio::time::sleep(shared.interval) => {}
            () = shared.frames.closed() => {}
        }
        let mut sampler = shared
            .sampler
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if shared.frames.receiver_count() == 0 {
            *sampler = None;
            return;
        }
    }
}

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::CACHE_CONTROL, "no-store"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        PAGE,
    )
        .into_response()
}

async fn events(State(dashboard): State<Dashboard>) -> impl IntoResponse {
    let frames = dashboard.watch();
    // Each frame once, starting with the current one if there is one.
    let stream = futures_util::stream::unfold((frames, true), |(mut frames, first)| async move {
        if !first || frames.borrow().is_empty() {
            frames.changed().await.ok()?;
        }
        let frame = frames.borrow_and_update().clone();
        let event = Event::default().event("snapshot").data(&*frame);
        Some((Ok::<_, Infallible>(event), (frames, false)))
    });
    let mut response = Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

async fn snapshot(State(dashboard): State<Dashboard>) -> Response {
    let shared = &dashboard.shared;
    let current = shared.frames.borrow().clone();
    let frame = if dashboard.is_sampling() && !current.is_empty() {
        current.to_string()
    } else {
        match snapshot::sample(&shared.pool).await {
            Ok(sample) => snapshot::frame(Some(&sample), None, shared.interval),
            Err(error) => snapshot::frame(
                None,
                Some((&error.to_string(), Utc::now())),
                shared.interval,
            ),
        }
    };
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        frame,
    )
        .into_response()
}
