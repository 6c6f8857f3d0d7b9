//! Metrics (feature `metrics`): a real workload against the real database,
//! recorded by `metrics-exporter-prometheus`, served on `/metrics` over HTTP
//! and scraped like Prometheus would, then read with a small parser of the
//! text exposition format (`# TYPE`, `# HELP`, samples with labels).
//!
//! The checks: every metric exists with its type and help text; the counts
//! equal what the test did (acquisitions, refusals, timeouts, queue-full,
//! lost permits, reaps, fail-open admissions, mutex timeouts, deadlocks and
//! busy refusals, rate limiter decisions); the gauges come back to 0 after
//! releases, a dropped permit and a cancelled acquire; labels are only the
//! bounded ones, and a rate limiter key or a holder never appears.
//!
//! The recorder is global, so every test of this file shares it: each uses
//! names of its own and reads only its own series (the reaped counter, which
//! has no label, is only moved by one test).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use metrics_exporter_prometheus::PrometheusBuilder;
use pg_semaphore::{Error, Mutex, QueueOrder, RateLimiter, RatePolicy, Semaphore, SemaphoreFamily};
use support::TestDb;
use support::TestResult;
use support::proxy::Proxy;

/// Every metric of the crate, with its Prometheus type and the label keys
/// its samples may carry (a histogram's buckets add `le`).
const METRICS: &[(&str, &str, &[&str])] = &[
    ("pg_semaphore_permits_held", "gauge", &["semaphore"]),
    ("pg_semaphore_waiters", "gauge", &["semaphore"]),
    ("pg_semaphore_wait_seconds", "histogram", &["semaphore"]),
    ("pg_semaphore_hold_seconds", "histogram", &["semaphore"]),
    ("pg_semaphore_acquisitions_total", "counter", &["semaphore"]),
    (
        "pg_semaphore_no_slots_available_total",
        "counter",
        &["semaphore"],
    ),
    ("pg_semaphore_timeouts_total", "counter", &["semaphore"]),
    ("pg_semaphore_queue_full_total", "counter", &["semaphore"]),
    (
        "pg_semaphore_permits_lost_total",
        "counter",
        &["semaphore", "reason"],
    ),
    ("pg_semaphore_fail_open_total", "counter", &["semaphore"]),
    ("pg_semaphore_reaped_total", "counter", &[]),
    ("pg_semaphore_horizon_held_seconds", "gauge", &[]),
    ("pg_semaphore_horizon_age_xids", "gauge", &[]),
    ("pg_semaphore_mutex_wait_seconds", "histogram", &["mutex"]),
    ("pg_semaphore_mutex_timeouts_total", "counter", &["mutex"]),
    ("pg_semaphore_mutex_deadlocks_total", "counter", &["mutex"]),
    ("pg_semaphore_mutex_busy_total", "counter", &["mutex"]),
    (
        "pg_semaphore_rate_limit_decisions_total",
        "counter",
        &["limiter", "kind", "decision"],
    ),
];

/// A rate limiter key and a holder label: neither may ever become a label.
const SECRET_KEY: &str = "user-7f3a-secret-rate-limit-key";
const SECRET_HOLDER: &str = "holder-9c1e-never-a-label";

// ---------------------------------------------------------------------------
// The exporter, served on /metrics
// ---------------------------------------------------------------------------

/// Installs the Prometheus recorder (histograms with buckets, as Prometheus
/// aggregates them) once, describes the metrics, and serves `/metrics` from
/// a thread of its own (each test has its own runtime). Returns the address.
fn exporter() -> SocketAddr {
    static ADDRESS: OnceLock<SocketAddr> = OnceLock::new();
    *ADDRESS.get_or_init(|| {
        let handle = PrometheusBuilder::new()
            .set_buckets(&[0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 30.0])
            .expect("buckets")
            .install_recorder()
            .expect("install the Prometheus recorder");
        pg_semaphore::describe_metrics();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind /metrics");
        let address = listener.local_addr().expect("its address");
        listener.set_nonblocking(true).expect("non-blocking");
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the exporter's runtime");
            runtime.block_on(async move {
                let app = axum::Router::new().route(
                    "/metrics",
                    axum::routing::get(move || std::future::ready(handle.render())),
                );
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                axum::serve(listener, app).await.expect("serve /metrics");
            });
        });
        address
    })
}

/// GET /metrics, parsed.
async fn scrape() -> Exposition {
    let address = exporter();
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let uri = format!("http://{address}/metrics").parse().expect("a URI");
    let response = client.get(uri).await.expect("GET /metrics");
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.expect("the body");
    let text = String::from_utf8(body.to_bytes().to_vec()).expect("UTF-8");
    Exposition::parse(&text).unwrap_or_else(|error| panic!("{error}\n{text}"))
}

/// Scrapes until `metric{labels}` reads `want` (a gauge moved by a task
/// running elsewhere), for up to 10 s.
async fn until(metric: &str, labels: &[(&str, &str)], want: f64) {
    let reads = || async { scrape().await.value(metric, labels) == want };
    if !support::eventually(Duration::from_secs(10), reads).await {
        let now = scrape().await.value(metric, labels);
        panic!("{metric}{labels:?} is {now}, not {want}");
    }
}

// ---------------------------------------------------------------------------
// The exposition format
// ---------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Exposition {
    /// Family name -> type (`# TYPE`).
    types: BTreeMap<String, String>,
    /// Family name -> help text (`# HELP`).
    helps: BTreeMap<String, String>,
    samples: Vec<Sample>,
    /// The text as served.
    text: String,
}

#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

impl Exposition {
    /// Parses Prometheus' text format 0.0.4: `# HELP name text`, `# TYPE name
    /// type`, other comments, and `name{label="value",...} value [timestamp]`
    /// with `\\`, `\"` and `\n` escaped in label values.
    fn parse(text: &str) -> Result<Exposition, String> {
        let mut exposition = Exposition {
            text: text.to_owned(),
            ..Exposition::default()
        };
        for (number, line) in text.lines().enumerate() {
            let at = |what: &str| format!("line {}: {what}: {line:?}", number + 1);
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                let mut words = comment.trim_start().splitn(3, ' ');
                match (words.next(), words.next(), words.next()) {
                    (Some("TYPE"), Some(name), Some(kind)) => {
                        let known = ["counter", "gauge", "histogram", "summary", "untyped"];
                        if !known.contains(&kind) {
                            return Err(at("unknown type"));
                        }
                        if exposition.types.insert(name.into(), kind.into()).is_some() {
                            return Err(at("a second TYPE line"));
                        }
                    }
                    (Some("HELP"), Some(name), help) => {
                        exposition
                            .helps
                            .insert(name.into(), help.unwrap_or_default().into());
                    }
                    (Some("TYPE" | "HELP"), ..) => return Err(at("incomplete")),
                    _ => {}
                }
                continue;
            }
            exposition
                .samples
                .push(parse_sample(line).map_err(|e| at(&e))?);
        }
        Ok(exposition)
    }

    /// The value of the sample `name` whose labels are exactly `labels`; 0
    /// when there is none (a counter never incremented is not exported).
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let matching: Vec<_> = self
            .samples
            .iter()
            .filter(|s| s.name == name && s.labels == want)
            .collect();
        assert!(matching.len() <= 1, "{name}{labels:?} twice: {matching:?}");
        matching.first().map_or(0.0, |s| s.value)
    }

    /// The family a sample belongs to: a histogram's `_bucket`, `_sum` and
    /// `_count` series belong to the histogram.
    fn family(&self, sample: &str) -> String {
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = sample.strip_suffix(suffix)
                && matches!(
                    self.types.get(base).map(String::as_str),
                    Some("histogram" | "summary")
                )
            {
                return base.to_owned();
            }
        }
        sample.to_owned()
    }
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("a sample without a value")?;
    let name = &line[..name_end];
    let valid_name = |n: &str| {
        !n.is_empty()
            && !n.starts_with(|c: char| c.is_ascii_digit())
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    if !valid_name(name) {
        return Err(format!("bad metric name {name:?}"));
    }
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices().peekable();
        loop {
            // A label name, or the end of the set.
            let start = match chars.peek() {
                Some(&(_, '}')) => {
                    chars.next();
                    break;
                }
                Some(&(i, _)) => i,
                None => return Err("unterminated label set".into()),
            };
            let eq = inner[start..].find('=').ok_or("a label without '='")? + start;
            let key = &inner[start..eq];
            if !valid_name(key) || key.contains(':') {
                return Err(format!("bad label name {key:?}"));
            }
            while chars.peek().is_some_and(|&(i, _)| i <= eq) {
                chars.next();
            }
            if chars.next().map(|(_, c)| c) != Some('"') {
                return Err("a label value without quotes".into());
            }
            let mut value = String::new();
            loop {
                match chars.next().map(|(_, c)| c) {
                    Some('"') => break,
                    Some('\\') => match chars.next().map(|(_, c)| c) {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        other => return Err(format!("bad escape {other:?}")),
                    },
                    Some(c) => value.push(c),
                    None => return Err("unterminated label value".into()),
                }
            }
            if labels.insert(key.to_owned(), value).is_some() {
                return Err(format!("label {key:?} twice"));
            }
            if chars.peek().map(|&(_, c)| c) == Some(',') {
                chars.next();
            }
        }
        let consumed = chars.peek().map_or(inner.len(), |&(i, _)| i);
        rest = &inner[consumed..];
    }
    let mut fields = rest.split_whitespace();
    let value = match fields.next().ok_or("no value")? {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        number => number
            .parse()
            .map_err(|e| format!("bad value {number:?}: {e}"))?,
    };
    if let Some(timestamp) = fields.next() {
        timestamp
            .parse::<i64>()
            .map_err(|e| format!("bad timestamp {timestamp:?}: {e}"))?;
    }
    if fields.next().is_some() {
        return Err("trailing text".into());
    }
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

#[test]
fn the_parser_reads_the_exposition_format() {
    let text = "# HELP a_total Things.\n# TYPE a_total counter\n\
                a_total{x=\"q\\\"uo\\\\te\\n\",y=\"2\"} 3\n\
                # TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 0.5\nh_count 1 1700000000000\n\
                # a comment\ng -1.5e-3\n";
    let parsed = Exposition::parse(text).expect("parses");
    assert_eq!(parsed.types["a_total"], "counter");
    assert_eq!(parsed.helps["a_total"], "Things.");
    assert_eq!(
        parsed.value("a_total", &[("x", "q\"uo\\te\n"), ("y", "2")]),
        3.0
    );
    assert_eq!(parsed.value("h_count", &[]), 1.0);
    assert_eq!(parsed.value("g", &[]), -0.0015);
    assert_eq!(parsed.family("h_bucket"), "h");
    assert_eq!(parsed.family("a_total"), "a_total");
    for bad in [
        "x{a=\"1\" 2",
        "x{a=1} 2",
        "x 2 3 4",
        "x{a=\"1\",a=\"2\"} 1",
        "# TYPE x nonsense",
    ] {
        assert!(Exposition::parse(bad).is_err(), "{bad:?} parsed");
    }
}

// ---------------------------------------------------------------------------
// The workload
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_semaphore_workload_is_counted_and_its_gauges_return_to_zero() -> TestResult {
    exporter();
    let db = support::migrated_db().await;
    let name = "metrics-upstream";
    let sem = Semaphore::builder(name, 2)
        .build(&db.client.clone().holder(SECRET_HOLDER))
        .await?;
    let of = [("semaphore", name)];

    // Two fail-fast acquisitions fill it; the third is refused.
    let first = sem.try_acquire().await?;
    let second = sem.try_acquire().await?;
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    let m = scrape().await;
    assert_eq!(m.value("pg_semaphore_permits_held", &of), 2.0);
    assert_eq!(m.value("pg_semaphore_acquisitions_total", &of), 2.0);
    assert_eq!(m.value("pg_semaphore_no_slots_available_total", &of), 1.0);

    // A wait that times out, and a waiter cancelled mid-wait, on another
    // semaphore whose only slot stays held. A claim either of them had in
    // flight when it gave up is finished by a spawned task (cancel
    // safety); on `sem` it could take the slot released below, and add its
    // permit to the counts (CI saw a second hold counted). Here it never
    // finds a slot.
    let full_name = "metrics-full";
    let full = Semaphore::builder(full_name, 1)
        .build(&db.client.clone().holder(SECRET_HOLDER))
        .await?;
    let of_full = [("semaphore", full_name)];
    let fills_it = full.try_acquire().await?;
    // The timed-out wait: counted, not timed as a successful wait.
    assert!(matches!(
        full.acquiring()
            .timeout(Duration::from_millis(200))
            .acquire()
            .await,
        Err(Error::Timeout { .. })
    ));
    // The cancelled waiter leaves the waiters gauge.
    let cancelled = tokio::spawn({
        let full = full.clone();
        async move { full.acquire().await }
    });
    until("pg_semaphore_waiters", &of_full, 1.0).await;
    cancelled.abort();
    assert!(cancelled.await.is_err_and(|e| e.is_cancelled()));
    let m = scrape().await;
    assert_eq!(m.value("pg_semaphore_waiters", &of_full), 0.0);
    assert_eq!(m.value("pg_semaphore_timeouts_total", &of_full), 1.0);
    assert_eq!(m.value("pg_semaphore_wait_seconds_count", &of_full), 0.0);
    assert_eq!(m.value("pg_semaphore_permits_held", &of_full), 1.0);

    // A waiter served by a release: one successful wait, timed.
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    until("pg_semaphore_waiters", &of, 1.0).await;
    first.release().await?;
    let third = waiter.await??;
    let m = scrape().await;
    assert_eq!(m.value("pg_semaphore_waiters", &of), 0.0);
    assert_eq!(m.value("pg_semaphore_wait_seconds_count", &of), 1.0);
    assert_eq!(m.value("pg_semaphore_permits_held", &of), 2.0);
    assert_eq!(m.value("pg_semaphore_hold_seconds_count", &of), 1.0);

    // Releases and a drop bring the held gauge back to 0 at once.
    third.release().await?;
    drop(second);
    let m = scrape().await;
    assert_eq!(m.value("pg_semaphore_permits_held", &of), 0.0);
    assert_eq!(m.value("pg_semaphore_hold_seconds_count", &of), 3.0);
    let wait_sum = m.value("pg_semaphore_wait_seconds_sum", &of);
    assert!(wait_sum > 0.0 && wait_sum < 10.0, "{wait_sum}");

    // A weighted permit counts its slots in the gauge, once as an acquisition.
    let both = sem.acquire_many(2).await?;
    assert_eq!(scrape().await.value("pg_semaphore_permits_held", &of), 2.0);
    both.release().await?;
    let m = scrape().await;
    assert_eq!(m.value("pg_semaphore_permits_held", &of), 0.0);
    assert_eq!(m.value("pg_semaphore_acquisitions_total", &of), 4.0);
    assert_eq!(m.value("pg_semaphore_wait_seconds_count", &of), 2.0);
    assert!(!m.text.contains(SECRET_HOLDER), "a holder became a label");
    fills_it.release().await?;
    Ok(())
}

#[tokio::test]
async fn queue_full_lost_permits_reaps_and_fail_open_are_counted() -> TestResult {
    exporter();
    let db = support::migrated_db().await;

    // Queue full: a bounded queue that admits no waiter.
    let queued = Semaphore::builder("metrics-queued", 1)
        .queue(QueueOrder::OldestFirst)
        .queue_limit(0)
        .build(&db.client)
        .await?;
    let held = queued.try_acquire().await?;
    assert!(matches!(
        queued.acquire().await,
        Err(Error::QueueFull { .. })
    ));
    held.release().await?;

    // A lost permit: its lease runs out, the reaper takes it, the release
    // finds it reaped.
    let short = Semaphore::builder("metrics-short-lease", 1)
        .lease(Duration::from_millis(100))
        .without_heartbeat()
        .build(&db.client)
        .await?;
    let before = scrape().await.value("pg_semaphore_reaped_total", &[]);
    let permit = short.try_acquire().await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let reaped = pg_semaphore::admin::reap(&db.pool).await?;
    assert!(reaped >= 1, "reaped {reaped}");
    assert!(matches!(
        permit.release().await,
        Err(Error::PermitLost { .. })
    ));

    // Fail-open: the database becomes unreachable for a fail-open handle
    // and a fail-open limiter.
    let proxy = Proxy::start(&db).await;
    let remote = proxy.pool(2).await;
    let open = Semaphore::builder("metrics-fail-open", 1)
        .lease(Duration::from_secs(1))
        .fail_open(true)
        .build(&pg_semaphore::Client::new(remote.clone()))
        .await?;
    let limiter = RateLimiter::builder(
        "metrics-fail-open-limiter",
        RatePolicy::token_bucket(1.0, 1),
    )
    .fail_open(true)
    .build(&pg_semaphore::Client::new(remote.clone()))?;
    proxy.cut().await;
    let unchecked = open.try_acquire().await?;
    assert!(unchecked.is_unchecked());
    assert!(limiter.check(SECRET_KEY, 1).await?.failed_open);

    let m = scrape().await;
    assert_eq!(
        m.value(
            "pg_semaphore_queue_full_total",
            &[("semaphore", "metrics-queued")]
        ),
        1.0
    );
    assert_eq!(
        m.value(
            "pg_semaphore_permits_lost_total",
            &[
                ("semaphore", "metrics-short-lease"),
                ("reason", "timed_out")
            ]
        ),
        1.0
    );
    assert_eq!(
        m.value("pg_semaphore_reaped_total", &[]) - before,
        reaped as f64
    );
    let open_of = [("semaphore", "metrics-fail-open")];
    assert_eq!(m.value("pg_semaphore_fail_open_total", &open_of), 1.0);
    // An unchecked permit holds no slot and was not granted by the database.
    assert_eq!(m.value("pg_semaphore_permits_held", &open_of), 0.0);
    assert_eq!(m.value("pg_semaphore_acquisitions_total", &open_of), 0.0);
    assert_eq!(
        m.value(
            "pg_semaphore_rate_limit_decisions_total",
            &[
                ("limiter", "metrics-fail-open-limiter"),
                ("kind", "token_bucket"),
                ("decision", "failed_open")
            ]
        ),
        1.0
    );
    unchecked.release().await?;
    Ok(())
}

#[tokio::test]
async fn mutex_waits_timeouts_deadlocks_and_busy_refusals_are_counted() -> TestResult {
    exporter();
    let db = support::migrated_db().await;
    let mutex = Mutex::new("metrics-ledger");
    let of = [("mutex", mutex.name())];
    assert_eq!(
        mutex.name(),
        "mutex \"metrics-ledger\"",
        "quotes are escaped"
    );

    let guard = mutex.lock(&db.client).await?;
    assert!(matches!(
        mutex
            .locking()
            .timeout(Duration::from_millis(100))
            .lock(&db.client)
            .await,
        Err(Error::Timeout { .. })
    ));
    assert!(matches!(
        mutex.locking().no_wait().lock(&db.client).await,
        Err(Error::Locked { .. })
    ));
    guard.commit().await?;
    mutex.lock(&db.client).await?.commit().await?;

    // A deadlock: two transactions each hold one lock and wait for the other.
    let (a, b) = (Mutex::new("metrics-a"), Mutex::new("metrics-b"));
    let (mut one, mut two) = (db.pool.begin().await?, db.pool.begin().await?);
    a.locking().lock_in(&mut one).await?;
    b.locking().lock_in(&mut two).await?;
    let crossed = tokio::join!(b.locking().lock_in(&mut one), a.locking().lock_in(&mut two));
    let deadlocks = [&crossed.0, &crossed.1]
        .iter()
        .filter(|r| matches!(r, Err(Error::Deadlock { .. })))
        .count();
    assert_eq!(deadlocks, 1, "{crossed:?}");
    drop((one, two));

    let m = scrape().await;
    assert_eq!(m.value("pg_semaphore_mutex_timeouts_total", &of), 1.0);
    assert_eq!(m.value("pg_semaphore_mutex_busy_total", &of), 1.0);
    // Both granted waits of `mutex`; the timed-out one is not a wait served.
    assert_eq!(m.value("pg_semaphore_mutex_wait_seconds_count", &of), 2.0);
    let deadlocked: f64 = [a.name(), b.name()]
        .iter()
        .map(|name| m.value("pg_semaphore_mutex_deadlocks_total", &[("mutex", name)]))
        .sum();
    assert_eq!(deadlocked, 1.0);
    Ok(())
}

#[tokio::test]
async fn rate_limit_decisions_are_counted_without_their_keys() -> TestResult {
    exporter();
    let db = support::migrated_db().await;
    let bucket = RateLimiter::builder("metrics-api", RatePolicy::token_bucket(0.001, 2))
        .build(&db.client)?;
    let window = RateLimiter::builder(
        "metrics-api",
        RatePolicy::fixed_window(1, Duration::from_secs(60)),
    )
    .build(&db.client)?;
    for _ in 0..3 {
        let _ = bucket.check(SECRET_KEY, 1).await?;
        let _ = window.check(SECRET_KEY, 1).await?;
    }
    let m = scrape().await;
    let decisions = |kind, decision| {
        m.value(
            "pg_semaphore_rate_limit_decisions_total",
            &[
                ("limiter", "metrics-api"),
                ("kind", kind),
                ("decision", decision),
            ],
        )
    };
    assert_eq!(decisions("token_bucket", "allowed"), 2.0);
    assert_eq!(decisions("token_bucket", "refused"), 1.0);
    assert_eq!(decisions("fixed_window", "allowed"), 1.0);
    assert_eq!(decisions("fixed_window", "refused"), 2.0);
    assert!(
        !m.text.contains(SECRET_KEY),
        "a rate limit key became a label"
    );
    Ok(())
}

/// After a workload that touches every metric (the tests above, run here
/// once more on names of its own): each is exported with its type and help
/// text, and every sample of the crate carries only its bounded labels.
#[tokio::test]
async fn every_metric_is_exported_with_its_type_help_and_bounded_labels() -> TestResult {
    exporter();
    let db = support::migrated_db().await;
    touch_every_metric(&db).await?;
    let m = scrape().await;

    for (name, kind, _) in METRICS {
        assert_eq!(
            m.types.get(*name).map(String::as_str),
            Some(*kind),
            "# TYPE of {name}"
        );
        assert!(
            m.helps.get(*name).is_some_and(|help| !help.is_empty()),
            "# HELP of {name}"
        );
    }
    let reasons = [
        "timed_out",
        "already_released",
        "lease_expired",
        "missing",
        "not_holder",
        "unchecked",
        "connection_lost",
    ];
    let mut seen = BTreeSet::new();
    for sample in m
        .samples
        .iter()
        .filter(|s| s.name.starts_with("pg_semaphore"))
    {
        let family = m.family(&sample.name);
        let Some((_, kind, allowed)) = METRICS.iter().find(|(name, ..)| *name == family) else {
            panic!("{} is not a documented metric", sample.name);
        };
        seen.insert(family.clone());
        let mut allowed: BTreeSet<&str> = allowed.iter().copied().collect();
        if *kind == "histogram" && sample.name.ends_with("_bucket") {
            allowed.insert("le");
        }
        let keys: BTreeSet<&str> = sample.labels.keys().map(String::as_str).collect();
        assert_eq!(keys, allowed, "labels of {sample:?}");
        let label = |key: &str| sample.labels.get(key).map(String::as_str);
        if let Some(reason) = label("reason") {
            assert!(reasons.contains(&reason), "{sample:?}");
        }
        if let Some(kind) = label("kind") {
            assert!(
                ["token_bucket", "fixed_window", "sliding_window"].contains(&kind),
                "{sample:?}"
            );
        }
        if let Some(decision) = label("decision") {
            assert!(
                ["allowed", "refused", "failed_open"].contains(&decision),
                "{sample:?}"
            );
        }
    }
    let documented: BTreeSet<String> = METRICS.iter().map(|(n, ..)| n.to_string()).collect();
    assert_eq!(seen, documented, "every metric was exported");
    assert!(!m.text.contains(SECRET_KEY) && !m.text.contains(SECRET_HOLDER));
    Ok(())
}

/// One of every event, on names no other test uses.
async fn touch_every_metric(db: &TestDb) -> TestResult {
    let pool = &db.pool;
    // Nothing has expired in a fresh database: the reaped counter is
    // exported (+0) without moving under another test's feet.
    assert_eq!(pg_semaphore::admin::reap(pool).await?, 0);
    let sem = Semaphore::builder("metrics-every", 1)
        .queue_limit(0)
        .build(&pg_semaphore::Client::new(pool.clone()).holder(SECRET_HOLDER))
        .await?;
    let permit = sem.try_acquire().await?;
    let _ = sem.try_acquire().await; // no slot
    let _ = sem.acquire().await; // queue full
    permit.release().await?;
    let unqueued = Semaphore::builder("metrics-every-unqueued", 1)
        .lease(Duration::from_millis(100))
        .without_heartbeat()
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    let lost = unqueued.try_acquire().await?;
    let _ = unqueued
        .acquiring()
        .timeout(Duration::from_millis(10))
        .acquire()
        .await; // timeout
    tokio::time::sleep(Duration::from_millis(200)).await;
    let again = unqueued.acquire().await?; // a wait served (the lease ended)
    assert!(lost.release().await.is_err()); // lost
    again.release().await?;

    let proxy = Proxy::start(db).await;
    let remote = proxy.pool(1).await;
    let open = Semaphore::builder("metrics-every-open", 1)
        .fail_open(true)
        .lease(Duration::from_secs(1))
        .build(&pg_semaphore::Client::new(remote.clone()))
        .await?;
    proxy.cut().await;
    open.try_acquire().await?.release().await?;

    let mutex = Mutex::new("metrics-every");
    let guard = mutex.lock(&pg_semaphore::Client::new(pool.clone())).await?;
    let _ = mutex
        .locking()
        .timeout(Duration::from_millis(10))
        .lock(&pg_semaphore::Client::new(pool.clone()))
        .await;
    let _ = mutex
        .locking()
        .no_wait()
        .lock(&pg_semaphore::Client::new(pool.clone()))
        .await;
    guard.commit().await?;
    let (a, b) = (Mutex::new("metrics-every-a"), Mutex::new("metrics-every-b"));
    let (mut one, mut two) = (pool.begin().await?, pool.begin().await?);
    a.locking().lock_in(&mut one).await?;
    b.locking().lock_in(&mut two).await?;
    let _ = tokio::join!(b.locking().lock_in(&mut one), a.locking().lock_in(&mut two));

    let limiter = RateLimiter::builder("metrics-every", RatePolicy::token_bucket(0.001, 1))
        .build(&pg_semaphore::Client::new(pool.clone()))?;
    let _ = limiter.check(SECRET_KEY, 1).await?;
    let _ = limiter.check(SECRET_KEY, 1).await?;

    // A reaper's round records the xmin horizon's gauges.
    let reaper = pg_semaphore::admin::Reaper::builder()
        .interval(Duration::from_secs(3600))
        .spawn(pool)?;
    for _ in 0..100 {
        if scrape()
            .await
            .types
            .contains_key("pg_semaphore_horizon_age_xids")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    reaper.shutdown().await;
    Ok(())
}

/// A family's keys are labelled by their family (`semaphore="@family"`),
/// never by their key: a key is unbounded, a family is not.
#[tokio::test]
async fn family_keys_are_labelled_by_their_family_never_by_their_key() -> TestResult {
    exporter();
    let db = support::migrated_db().await;
    let tenants = SemaphoreFamily::builder("metrics-tenants", 1)
        .build(&db.client)
        .await?;
    let a = tenants.try_acquire("secret-tenant-a").await?;
    let b = tenants.try_acquire("secret-tenant-b").await?;
    assert!(matches!(
        tenants.try_acquire("secret-tenant-a").await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    let of = [("semaphore", "@metrics-tenants")];
    let m = scrape().await;
    assert_eq!(m.value("pg_semaphore_permits_held", &of), 2.0);
    assert_eq!(m.value("pg_semaphore_acquisitions_total", &of), 2.0);
    assert_eq!(m.value("pg_semaphore_no_slots_available_total", &of), 1.0);
    assert!(
        !m.text.contains("secret-tenant"),
        "a key is a label:\n{}",
        m.text
    );
    a.release().await?;
    b.release().await?;
    until("pg_semaphore_permits_held", &of, 0.0).await;
    Ok(())
}
