//! `SemaphoreLayer` and `RateLimitLayer` on a real axum server on loopback,
//! called by a real HTTP client (hyper), with the limits on a real
//! PostgreSQL. Handlers count
//! themselves in and out, so the limit is checked where it matters: inside
//! the handler.

mod support;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use http::{Request, StatusCode};
use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use pg_semaphore::{
    RateLimiter, RatePolicy, Semaphore, SemaphoreFamily,
    audit::{AuditLog, Outcome},
    tower::{RateLimitLayer, SemaphoreLayer},
};
use support::TestResult;

/// What the handlers saw: how many were inside at once, at most, and in all.
#[derive(Default)]
struct Gauge {
    inside: AtomicUsize,
    max_inside: AtomicUsize,
    entered: AtomicUsize,
}

/// Counts a handler in; counts it out when dropped (also when the request is
/// cancelled and the handler future dropped).
struct Inside(Arc<Gauge>);

impl Inside {
    fn enter(gauge: &Arc<Gauge>) -> Self {
        gauge.entered.fetch_add(1, Ordering::SeqCst);
        let now = gauge.inside.fetch_add(1, Ordering::SeqCst) + 1;
        gauge.max_inside.fetch_max(now, Ordering::SeqCst);
        Inside(gauge.clone())
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Clone)]
struct App {
    gauge: Arc<Gauge>,
    /// Each `/slow` handler waits for a ticket before it returns.
    tickets: Arc<tokio::sync::Semaphore>,
}

async fn slow(State(app): State<App>) -> &'static str {
    let _inside = Inside::enter(&app.gauge);
    app.tickets.acquire().await.expect("never closed").forget();
    "done"
}

async fn fast(State(app): State<App>) -> &'static str {
    let _inside = Inside::enter(&app.gauge);
    "done"
}

struct Server {
    addr: SocketAddr,
    gauge: Arc<Gauge>,
    tickets: Arc<tokio::sync::Semaphore>,
    client: Client<HttpConnector, Empty<Bytes>>,
}

/// Serves `/slow` and `/fast` behind `layer` on a loopback port.
async fn serve(layer: SemaphoreLayer) -> Server {
    serve_with(|router| router.layer(layer)).await
}

/// Serves `/slow` and `/fast`, wrapped by `wrap`, on a loopback port.
async fn serve_with(wrap: impl FnOnce(Router<App>) -> Router<App>) -> Server {
    let tickets = Arc::new(tokio::sync::Semaphore::new(0));
    let gauge = Arc::new(Gauge::default());
    let app = wrap(
        Router::new()
            .route("/slow", get(slow))
            .route("/fast", get(fast)),
    )
    .with_state(App {
        gauge: gauge.clone(),
        tickets: tickets.clone(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = Client::builder(TokioExecutor::new()).build_http();
    Server {
        addr,
        gauge,
        tickets,
        client,
    }
}

impl Server {
    /// GETs `path`; the status and the `Retry-After` header, if any.
    fn get(
        &self,
        path: &str,
    ) -> impl Future<Output = (StatusCode, Option<String>)> + Send + 'static {
        let client = self.client.clone();
        let uri = format!("http://{}{path}", self.addr);
        async move {
            let response = client
                .request(Request::get(uri).body(Empty::new()).unwrap())
                .await
                .expect("HTTP request");
            let retry_after = response
                .headers()
                .get(http::header::RETRY_AFTER)
                .map(|v| v.to_str().unwrap().to_owned());
            (response.status(), retry_after)
        }
    }

    fn inside(&self) -> usize {
        self.gauge.inside.load(Ordering::SeqCst)
    }

    fn max_inside(&self) -> usize {
        self.gauge.max_inside.load(Ordering::SeqCst)
    }

    fn entered(&self) -> usize {
        self.gauge.entered.load(Ordering::SeqCst)
    }

    /// Lets every `/slow` handler, present and future, return.
    fn open_gate(&self) {
        self.tickets.add_permits(1 << 20);
    }

    /// Lets one `/slow` handler return.
    fn let_one_through(&self) {
        self.tickets.add_permits(1);
    }
}

/// Polls `check` until it holds; fails the test after a minute (a hang
/// guard, not a timing assertion).
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..6000 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened: {what}");
}

async fn semaphore(db: &support::TestDb, name: &str, capacity: u32) -> Semaphore {
    Semaphore::builder(name, capacity)
        .lease(Duration::from_secs(3600)) // only a release frees a slot here
        .build(&pg_semaphore::Client::new(db.pool.clone()))
        .await
        .expect("build semaphore")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fail_fast_rejects_the_excess_with_503_and_the_limit_holds() -> TestResult {
    let db = support::migrated_db().await;
    let server = serve(SemaphoreLayer::new(semaphore(&db, "api", 2).await)).await;

    let held: Vec<_> = (0..2).map(|_| tokio::spawn(server.get("/slow"))).collect();
    eventually("two requests inside", || server.inside() == 2).await;

    // Every slot is held: the next requests are turned away at the door.
    for path in ["/slow", "/fast", "/fast"] {
        let (status, retry_after) = server.get(path).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(retry_after, None);
    }
    assert_eq!(server.entered(), 2, "a rejected request reached a handler");

    server.open_gate();
    for request in held {
        assert_eq!(request.await?.0, StatusCode::OK);
    }
    // Released as the responses completed: the next request is served.
    assert_eq!(server.get("/fast").await.0, StatusCode::OK);
    assert_eq!(server.max_inside(), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rejection_status_and_retry_after_are_configurable() -> TestResult {
    let db = support::migrated_db().await;
    let layer = SemaphoreLayer::new(semaphore(&db, "api", 1).await)
        .reject_with(StatusCode::TOO_MANY_REQUESTS)
        .retry_after(Duration::from_millis(1500));
    let server = serve(layer).await;

    let held = tokio::spawn(server.get("/slow"));
    eventually("one request inside", || server.inside() == 1).await;
    let (status, retry_after) = server.get("/fast").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after.as_deref(), Some("2")); // rounded up

    server.open_gate();
    assert_eq!(held.await?.0, StatusCode::OK);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wait_mode_serves_a_burst_in_turn_never_more_than_capacity() -> TestResult {
    const CAPACITY: usize = 3;
    const REQUESTS: usize = 24;
    let db = support::migrated_db().await;
    let layer = SemaphoreLayer::new(semaphore(&db, "api", CAPACITY as u32).await)
        .wait(Duration::from_secs(120));
    let server = serve(layer).await;

    let requests: Vec<_> = (0..REQUESTS)
        .map(|_| tokio::spawn(server.get("/slow")))
        .collect();
    eventually("the first requests inside", || server.inside() == CAPACITY).await;
    // One at a time: each request that finishes lets exactly one waiter in.
    for served in 1..=REQUESTS - CAPACITY {
        server.let_one_through();
        eventually("a waiter takes the freed slot", || {
            server.entered() == CAPACITY + served && server.inside() == CAPACITY
        })
        .await;
    }
    server.open_gate();
    for request in requests {
        assert_eq!(
            request.await?.0,
            StatusCode::OK,
            "a waiting request was not served"
        );
    }
    assert_eq!(server.entered(), REQUESTS);
    assert_eq!(server.max_inside(), CAPACITY);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wait_that_times_out_is_rejected() -> TestResult {
    let db = support::migrated_db().await;
    let layer =
        SemaphoreLayer::new(semaphore(&db, "api", 1).await).wait(Duration::from_millis(200));
    let server = serve(layer).await;

    let held = tokio::spawn(server.get("/slow"));
    eventually("one request inside", || server.inside() == 1).await;
    assert_eq!(server.get("/fast").await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.entered(), 1);

    server.open_gate();
    assert_eq!(held.await?.0, StatusCode::OK);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_whose_client_goes_away_frees_its_slot() -> TestResult {
    let db = support::migrated_db().await;
    let layer = SemaphoreLayer::new(semaphore(&db, "api", 1).await).record_requests(true);
    let server = serve(layer).await;

    // A client on a connection of its own, aborted mid-request: its socket closes.
    let addr = server.addr;
    let client = tokio::spawn(async move {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        let request = Request::get(format!("http://{addr}/slow"))
            .body(Empty::<Bytes>::new())
            .unwrap();
        tokio::select! {
            _ = connection => {}
            _ = sender.send_request(request) => {}
        }
    });
    eventually("the request inside", || server.inside() == 1).await;
    assert_eq!(server.get("/fast").await.0, StatusCode::SERVICE_UNAVAILABLE);

    client.abort();
    // The server drops the handler (and with it the permit) when it sees
    // the connection close; the gate never opens for it.
    eventually("the abandoned handler dropped", || server.inside() == 0).await;
    let mut served = false;
    for _ in 0..6000 {
        if server.get("/fast").await.0 == StatusCode::OK {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(served, "the abandoned request's slot was never freed");

    // Released, not left to its one-hour lease; the request is on record.
    let now = chrono::Utc::now();
    let history = AuditLog::new(&db.pool)
        .history(
            "api",
            now - chrono::Duration::hours(1)..now + chrono::Duration::hours(1),
        )
        .await?;
    let abandoned = history
        .iter()
        .find(|c| c.metadata.as_ref().is_some_and(|m| m["path"] == "/slow"))
        .expect("the /slow claim");
    assert_eq!(abandoned.outcome, Outcome::Completed);
    assert_eq!(abandoned.metadata.as_ref().unwrap()["method"], "GET");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_database_requests_get_503_unless_failing_open() -> TestResult {
    let db = support::migrated_db().await;
    let pool = support::another_pool(&db, 2).await;
    let sem = Semaphore::builder("api", 1)
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    pool.close().await; // the database is gone, as far as this semaphore knows

    let closed =
        serve(SemaphoreLayer::new(sem.clone()).reject_with(StatusCode::TOO_MANY_REQUESTS)).await;
    // Not "busy": an outage is a 503 whatever the busy status.
    assert_eq!(closed.get("/fast").await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(closed.entered(), 0);

    let open = serve(SemaphoreLayer::new(sem).fail_open(true)).await;
    assert_eq!(open.get("/fast").await.0, StatusCode::OK);
    assert_eq!(open.entered(), 1);
    Ok(())
}

/// The key a test request names in its query: `/slow?k=acme`.
fn query_key(request: &http::request::Parts) -> Option<String> {
    request.uri.query()?.strip_prefix("k=").map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_global_and_a_tenant_limit_are_one_claim_that_takes_nothing_when_refused() -> TestResult {
    let db = support::migrated_db().await;
    let global = Semaphore::builder("api", 3)
        .lease(Duration::from_secs(3600))
        .build(&db.client)
        .await?;
    let tenants = SemaphoreFamily::builder("tenants", 2)
        .lease(Duration::from_secs(3600))
        .build(&db.client)
        .await?;
    let server = serve(SemaphoreLayer::new(global).per_key(tenants, query_key)).await;

    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(tokio::spawn(server.get("/slow?k=acme")));
    }
    eventually("acme's two requests inside", || server.inside() == 2).await;
    // acme is at its limit: refused, and its refusal holds no global slot.
    assert_eq!(
        server.get("/fast?k=acme").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(support::live_rows(&db.pool, "api").await, 2);
    // Another tenant takes the last global slot.
    held.push(tokio::spawn(server.get("/slow?k=globex")));
    eventually("globex inside", || server.inside() == 3).await;
    // The global limit is full: a third tenant is refused, and holds no
    // slot of its own key either.
    assert_eq!(
        server.get("/fast?k=initech").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(support::live_rows(&db.pool, "@tenants/initech").await, 0);
    // A request without a key takes only the global limit (full here).
    assert_eq!(server.get("/fast").await.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.entered(), 3, "a refused request reached a handler");

    server.open_gate();
    for request in held {
        assert_eq!(request.await?.0, StatusCode::OK);
    }
    assert_eq!(server.get("/fast?k=initech").await.0, StatusCode::OK);
    assert_eq!(server.max_inside(), 3);
    assert_eq!(support::live_rows(&db.pool, "api").await, 0);
    assert_eq!(support::live_rows(&db.pool, "@tenants/acme").await, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_family_layer_limits_each_key_on_its_own_and_waits_for_it() -> TestResult {
    let db = support::migrated_db().await;
    let tenants = SemaphoreFamily::builder("tenants", 1)
        .lease(Duration::from_secs(3600))
        .build(&db.client)
        .await?;
    let layer = SemaphoreLayer::family(tenants, query_key).wait(Duration::from_secs(60));
    let server = serve(layer).await;

    let acme = tokio::spawn(server.get("/slow?k=acme"));
    let globex = tokio::spawn(server.get("/slow?k=globex"));
    eventually("one request of each tenant inside", || server.inside() == 2).await;
    // A second acme request waits for acme's slot; requests without a key
    // are not limited.
    let waiting = tokio::spawn(server.get("/slow?k=acme"));
    assert_eq!(server.get("/fast").await.0, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(server.inside(), 2, "the waiting request got in early");

    server.open_gate();
    for request in [acme, globex, waiting] {
        assert_eq!(request.await?.0, StatusCode::OK);
    }
    assert_eq!(server.entered(), 4);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_rate_limit_layer_refuses_with_429_and_retry_after_per_key() -> TestResult {
    let db = support::migrated_db().await;
    // Bursts of 2, then one request every 10 s.
    let limiter =
        RateLimiter::builder("per-customer", RatePolicy::token_bucket(0.1, 2)).build(&db.client)?;
    let server = serve_with(|router| router.layer(RateLimitLayer::new(limiter, query_key))).await;
    server.open_gate();

    for _ in 0..2 {
        assert_eq!(server.get("/fast?k=acme").await.0, StatusCode::OK);
    }
    let (status, retry_after) = server.get("/fast?k=acme").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = retry_after.expect("Retry-After").parse()?;
    assert!((1..=10).contains(&retry_after), "Retry-After {retry_after}");
    // Other keys, and requests without one, are not held back.
    assert_eq!(server.get("/fast?k=globex").await.0, StatusCode::OK);
    assert_eq!(server.get("/fast").await.0, StatusCode::OK);
    assert_eq!(server.entered(), 4, "a refused request reached a handler");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_rate_limit_layer_waits_within_its_bound_and_refuses_beyond_it() -> TestResult {
    let db = support::migrated_db().await;
    // One request at once, then one every 100 ms: a burst of 4 fits in a
    // wait of 10 s; one every 100 s does not.
    let quick =
        RateLimiter::builder("quick", RatePolicy::token_bucket(10.0, 1)).build(&db.client)?;
    let slow = RateLimiter::builder("slow", RatePolicy::token_bucket(0.01, 1)).build(&db.client)?;
    let server = serve_with(|router| {
        router
            .layer(RateLimitLayer::new(quick, query_key).wait(Duration::from_secs(10)))
            .layer(
                RateLimitLayer::new(slow, |request| {
                    request
                        .uri
                        .path()
                        .starts_with("/slow")
                        .then(|| "all".to_owned())
                })
                .wait(Duration::from_secs(1)),
            )
    })
    .await;
    server.open_gate();

    let burst: Vec<_> = (0..4)
        .map(|_| tokio::spawn(server.get("/fast?k=acme")))
        .collect();
    for request in burst {
        assert_eq!(request.await?.0, StatusCode::OK, "waited within the bound");
    }
    assert_eq!(server.get("/slow").await.0, StatusCode::OK);
    let (status, retry_after) = server.get("/slow").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = retry_after.expect("Retry-After").parse()?;
    assert!(retry_after > 1, "Retry-After {retry_after}");
    Ok(())
}

/// The customer a test request names after its key: `/slow?k=acme&c=c1`.
fn customer_key(request: &http::request::Parts) -> Option<String> {
    let query = request.uri.query()?;
    query
        .split('&')
        .find_map(|part| part.strip_prefix("c=").map(str::to_owned))
}

/// The tenant of `/slow?k=acme&c=c1`.
fn tenant_key(request: &http::request::Parts) -> Option<String> {
    let query = request.uri.query()?;
    query
        .split('&')
        .find_map(|part| part.strip_prefix("k=").map(str::to_owned))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrency_and_rate_limits_are_one_claim_that_takes_nothing_when_refused() -> TestResult {
    let db = support::migrated_db().await;
    let global = Semaphore::builder("api", 2)
        .lease(Duration::from_secs(3600))
        .build(&db.client)
        .await?;
    let tenants = SemaphoreFamily::builder("tenants", 1)
        .lease(Duration::from_secs(3600))
        .build(&db.client)
        .await?;
    // Two requests per customer, then one every 100 s.
    let per_customer = RateLimiter::builder("per-customer", RatePolicy::token_bucket(0.01, 2))
        .build(&db.client)?;
    let tokens = |customer: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, f64>(
                "SELECT tokens FROM pgsemaphore.rate_limits WHERE limiter = 'per-customer' AND key = $1",
            )
            .bind(customer)
            .fetch_optional(&pool)
            .await
            .expect("read the bucket")
        }
    };
    let layer = SemaphoreLayer::new(global)
        .per_key(tenants, tenant_key)
        .rate_limit(per_customer, customer_key);
    let server = serve(layer).await;

    // acme's request takes a slot of api, of acme, and a token of c1.
    let first = tokio::spawn(server.get("/slow?k=acme&c=c1"));
    eventually("acme's request inside", || server.inside() == 1).await;
    assert_eq!(tokens("c1").await, Some(1.0));
    // acme is full: refused with the concurrency status, and c1 keeps its token.
    assert_eq!(
        server.get("/fast?k=acme&c=c1").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        tokens("c1").await,
        Some(1.0),
        "a refused request spent a token"
    );
    // globex spends c1's last token.
    let second = tokio::spawn(server.get("/slow?k=globex&c=c1"));
    eventually("globex's request inside", || server.inside() == 2).await;
    server.let_one_through();
    server.let_one_through();
    assert_eq!(first.await?.0, StatusCode::OK);
    assert_eq!(second.await?.0, StatusCode::OK);
    // c1 is out of tokens: 429 with Retry-After, and no slot was taken.
    let (status, retry_after) = server.get("/fast?k=initech&c=c1").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = retry_after.expect("Retry-After").parse()?;
    assert!(
        (1..=100).contains(&retry_after),
        "Retry-After {retry_after}"
    );
    assert_eq!(support::live_rows(&db.pool, "api").await, 0);
    assert_eq!(support::live_rows(&db.pool, "@tenants/initech").await, 0);
    // Another customer, and a request without one, are served.
    server.open_gate();
    assert_eq!(server.get("/fast?k=initech&c=c2").await.0, StatusCode::OK);
    assert_eq!(server.get("/fast?k=initech").await.0, StatusCode::OK);
    assert_eq!(server.entered(), 4, "a refused request reached a handler");
    assert_eq!(server.max_inside(), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_layer_answers_429_at_once_when_the_rate_limit_outlasts_its_wait() -> TestResult {
    let db = support::migrated_db().await;
    let global = Semaphore::builder("api", 4)
        .lease(Duration::from_secs(3600))
        .build(&db.client)
        .await?;
    // One request per customer, then one every 1,000 s.
    let per_customer = RateLimiter::builder("per-customer", RatePolicy::token_bucket(0.001, 1))
        .build(&db.client)?;
    let layer = SemaphoreLayer::new(global)
        .rate_limit(per_customer, customer_key)
        .wait(Duration::from_secs(60));
    let server = serve(layer).await;
    server.open_gate();
    assert_eq!(server.get("/fast?c=c1").await.0, StatusCode::OK);
    // The limit admits c1 again only after the layer's wait: 429 with
    // Retry-After (a wait to the bound would end in 503).
    let (status, retry_after) = server.get("/fast?c=c1").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = retry_after.expect("Retry-After").parse()?;
    assert!(retry_after > 60, "Retry-After {retry_after}");
    assert_eq!(support::live_rows(&db.pool, "api").await, 0);
    assert_eq!(server.entered(), 1);
    Ok(())
}
