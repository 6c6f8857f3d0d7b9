//! The dashboard's router (feature `dashboard`), mounted under a prefix in
//! an axum application on a loopback port: its snapshot follows what other
//! clients do within two samples, its sampler runs only while someone
//! watches the events, and a database outage is shown, not a panic.

mod support;

use std::time::Duration;

use pg_semaphore::admin::{self, LimiterKind};
use pg_semaphore::dashboard::Dashboard;
use pg_semaphore::{Client, RateLimiter, RatePolicy, Semaphore};
use serde_json::Value;
use support::TestResult;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Where the test application mounts the dashboard.
const PREFIX: &str = "/ops/limits";

/// Serves `dashboard` under [`PREFIX`] on a loopback port; its address.
async fn serve(dashboard: &Dashboard) -> std::net::SocketAddr {
    let app = axum::Router::new().nest(PREFIX, dashboard.router());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    addr
}

/// `GET path` (HTTP/1.1, one request per connection): status line and body.
async fn get(addr: std::net::SocketAddr, path: &str) -> TestResult<(String, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head.lines().next().unwrap_or_default().to_owned();
    Ok((format!("{status}\n{head}"), body.to_owned()))
}

async fn snapshot(addr: std::net::SocketAddr) -> TestResult<Value> {
    let (head, body) = get(addr, &format!("{PREFIX}/snapshot.json")).await?;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    Ok(serde_json::from_str(&body)?)
}

/// A viewer of the events: reads them until dropped.
struct Viewer(tokio::task::JoinHandle<()>);

impl Viewer {
    async fn open(
        addr: std::net::SocketAddr,
    ) -> TestResult<(Viewer, tokio::sync::mpsc::Receiver<String>)> {
        let mut stream = TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET {PREFIX}/events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n").as_bytes())
            .await?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let task = tokio::spawn(async move {
            let mut buffer = vec![0; 1 << 16];
            while let Ok(n) = stream.read(&mut buffer).await {
                if n == 0
                    || tx
                        .send(String::from_utf8_lossy(&buffer[..n]).into_owned())
                        .await
                        .is_err()
                {
                    break;
                }
            }
        });
        Ok((Viewer(task), rx))
    }
}

impl Drop for Viewer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Polls `snapshot.json` until `check` holds, for at most `within`.
async fn shows(
    addr: std::net::SocketAddr,
    within: Duration,
    check: impl Fn(&Value) -> bool,
) -> TestResult<bool> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let snap = snapshot(addr).await?;
        if check(&snap) {
            return Ok(true);
        }
        if tokio::time::Instant::now() >= deadline {
            eprintln!("the last snapshot: {snap}");
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn semaphore<'a>(snap: &'a Value, name: &str) -> Option<&'a Value> {
    snap["semaphores"]
        .as_array()?
        .iter()
        .find(|s| s["name"] == name)
}

fn limiter<'a>(snap: &'a Value, name: &str) -> Option<&'a Value> {
    snap["limiters"]
        .as_array()?
        .iter()
        .find(|s| s["name"] == name)
}

#[tokio::test]
async fn the_snapshot_follows_other_clients_while_someone_watches() -> TestResult {
    let db = support::migrated_db().await;
    let dashboard = Dashboard::new(db.pool.clone());
    let addr = serve(&dashboard).await;

    // The page, under the prefix, self-contained.
    let (head, page) = get(addr, PREFIX).await?;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-security-policy: default-src 'none'"),
        "{head}"
    );
    assert!(page.contains("<title>pg-semaphore dashboard</title>"));
    // Only the SVG namespace's name is a URL.
    let page = page.replace("\"http://www.w3.org/2000/svg\"", "");
    assert!(
        !page.contains("http://") && !page.contains("https://"),
        "the page loads nothing from elsewhere"
    );

    // Nobody watches: nothing samples.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!dashboard.is_sampling());
    assert_eq!(dashboard.samples(), 0);

    let (viewer, mut events) = Viewer::open(addr).await?;
    let first = tokio::time::timeout(Duration::from_secs(5), events.recv()).await?;
    assert!(
        first.is_some_and(|e| e.contains("text/event-stream") || e.contains("event: snapshot"))
    );
    assert!(dashboard.is_sampling());
    assert_eq!(dashboard.viewers(), 1);

    // Another client, with a pool of its own.
    let other = Client::new(support::another_pool(&db, 2).await);
    let payments = Semaphore::builder("payments", 3).build(&other).await?;
    let permit = payments
        .acquiring()
        .holder("worker-7")
        .try_acquire()
        .await?;
    let id = permit.id();
    assert!(
        shows(addr, Duration::from_secs(2), |snap| semaphore(
            snap, "payments"
        )
        .is_some_and(|s| {
            s["held"] == 1 && s["holders"][0]["id"] == id && s["holders"][0]["holder"] == "worker-7"
        }))
        .await?,
        "the claim shows within 2 s"
    );
    permit.release().await?;
    assert!(
        shows(addr, Duration::from_secs(2), |snap| {
            semaphore(snap, "payments").is_some_and(|s| s["held"] == 0)
        })
        .await?,
        "the release shows within 2 s"
    );

    // An operator drops the capacity and pauses a rate limiter.
    admin::set_capacity(&db.pool, "payments", 1).await?;
    let limiter_client =
        RateLimiter::builder("emails", RatePolicy::token_bucket(10.0, 20)).build(&other)?;
    assert!(limiter_client.check("tenant-1", 1).await?.allowed);
    let until = admin::pause_rate_limit(
        &db.pool,
        LimiterKind::TokenBucket,
        "emails",
        None,
        Duration::from_secs(600),
    )
    .await?;
    assert!(
        shows(addr, Duration::from_secs(2), |snap| {
            semaphore(snap, "payments").is_some_and(|s| s["capacity"] == 1)
                && limiter(snap, "emails").is_some_and(|l| {
                    l["paused"] == true
                        && l["paused_until"].as_str().is_some_and(|t| {
                            t.parse::<chrono::DateTime<chrono::Utc>>().ok() == Some(until)
                        })
                })
        })
        .await?,
        "the capacity drop and the pause show within 2 s"
    );

    // The last viewer leaves: the sampler stops, and samples no more.
    drop(viewer);
    drop(events);
    assert!(
        support::eventually(Duration::from_secs(5), || async {
            !dashboard.is_sampling()
        })
        .await,
        "the sampler stops when nobody watches"
    );
    assert_eq!(dashboard.viewers(), 0);
    let samples = dashboard.samples();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        dashboard.samples(),
        samples,
        "no sample after the sampler stopped"
    );

    // The next viewer starts it again.
    let (_viewer, mut events) = Viewer::open(addr).await?;
    let mut seen = String::new();
    while !seen.contains("\"payments\"") {
        let more = tokio::time::timeout(Duration::from_secs(5), events.recv()).await?;
        seen.push_str(&more.expect("events go on"));
    }
    assert!(dashboard.is_sampling());
    Ok(())
}

#[tokio::test]
async fn an_outage_is_shown_and_recovered_from() -> TestResult {
    let db = support::migrated_db().await;
    let proxy = support::proxy::Proxy::start(&db).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(1))
        .connect_with(proxy.options())
        .await?;
    let dashboard = Dashboard::new(pool).interval(Duration::from_millis(200));
    let addr = serve(&dashboard).await;
    let (_viewer, _events) = Viewer::open(addr).await?;
    assert!(
        shows(addr, Duration::from_secs(5), |snap| snap["error"].is_null()
            && snap["sampled_at"].is_string())
        .await?
    );

    // The sampler has a good snapshot of its own (the one above may be
    // snapshot.json's, taken before the viewer's request arrived).
    assert!(
        support::eventually(Duration::from_secs(5), || async {
            dashboard.samples() >= 2
        })
        .await
    );
    assert!(shows(addr, Duration::from_secs(5), |snap| snap["error"].is_null()).await?);

    // Partitioned: the pool's connections break, new ones hang.
    proxy.blackhole();
    proxy.reset().await;
    assert!(
        shows(addr, Duration::from_secs(10), |snap| {
            snap["error"]["since"].is_string()
                && snap["error"]["message"].is_string()
                && snap["semaphores"].is_array() // the last good snapshot stays
        })
        .await?,
        "an unreachable database is reported"
    );
    proxy.restore();
    assert!(
        shows(addr, Duration::from_secs(15), |snap| snap["error"]
            .is_null())
        .await?,
        "the dashboard recovers"
    );
    Ok(())
}
