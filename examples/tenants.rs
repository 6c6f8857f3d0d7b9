//! A per-tenant limiter in front of an HTTP upstream: each tenant may have
//! 2 requests in flight to the upstream at once, premium tenants 4, and
//! tenant `acme` 6, across every replica of this service. The limits are a
//! `SemaphoreFamily`'s: one semaphore per tenant, created on the tenant's
//! first request, with the capacity the operator's rules give it (changed
//! at run time with `pg-semaphore rule set` / `tier set`, no redeploy).
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example tenants
//! ```
//!
//! It starts a slow "upstream" HTTP server and the proxy in front of it,
//! sends a burst of 8 concurrent requests for each of three tenants, and
//! prints how many each got through (the rest are answered 429 at once).
//! `DATABASE_URL` names any PostgreSQL server the user may create a schema
//! on; the example creates (or upgrades) the `pgsemaphore` schema in that
//! database.

use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use pg_semaphore::{Client, Error, SemaphoreFamily, admin::RuleKind};
use sqlx::postgres::PgPoolOptions;

type HttpClient = HyperClient<HttpConnector, Empty<Bytes>>;

#[derive(Clone)]
struct Proxy {
    tenants: SemaphoreFamily,
    client: HttpClient,
    upstream: String,
}

/// Forwards the request to the upstream if the tenant has a free slot,
/// else answers 429 at once.
async fn proxy(State(proxy): State<Proxy>, headers: HeaderMap) -> (StatusCode, String) {
    let Some(tenant) = headers.get("x-tenant").and_then(|v| v.to_str().ok()) else {
        return (StatusCode::BAD_REQUEST, "x-tenant missing\n".into());
    };
    let permit = match proxy.tenants.try_acquire(tenant).await {
        Ok(permit) => permit,
        Err(Error::NoSlotsAvailable { .. }) => {
            return (
                StatusCode::TOO_MANY_REQUESTS,
                format!("{tenant}: too many in flight\n"),
            );
        }
        Err(Error::InvalidArgument { .. }) => {
            return (StatusCode::BAD_REQUEST, "bad tenant\n".into());
        }
        Err(error) => return (StatusCode::SERVICE_UNAVAILABLE, format!("{error}\n")),
    };
    let request = Request::get(format!("{}/work", proxy.upstream))
        .body(Empty::new())
        .expect("a request");
    let answer = match proxy.client.request(request).await {
        Ok(response) => {
            let status = response.status();
            let body = response.into_body().collect().await.map(|b| b.to_bytes());
            let text = body
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            (status, text)
        }
        Err(error) => (StatusCode::BAD_GATEWAY, format!("{error}\n")),
    };
    // Released as soon as the upstream answered (a dropped permit would be
    // released in the background too).
    let _ = permit.release().await;
    answer
}

async fn serve(app: Router) -> Result<String, Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{address}"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&database_url())
        .await?;
    pg_semaphore::migrate(&pool).await?;
    let semaphores = Client::new(pool.clone());

    // The application: every tenant 2 unless a rule says otherwise.
    let tenants = SemaphoreFamily::builder("example-tenants", 2)
        .build(&semaphores)
        .await?;
    // The operator (here the same program; in production `pg-semaphore rule
    // set example-tenants --tier premium 4` and friends, as the operator role).
    pg_semaphore::admin::configure_family(&pool, "example-tenants", Some(2), None, None).await?;
    pg_semaphore::admin::set_family_rule(
        &pool,
        "example-tenants",
        RuleKind::Tier,
        "premium",
        Some(4),
    )
    .await?;
    pg_semaphore::admin::set_family_tier(&pool, "example-tenants", "globex", Some("premium"))
        .await?;
    pg_semaphore::admin::set_family_rule(&pool, "example-tenants", RuleKind::Key, "acme", Some(6))
        .await?;

    // The fragile upstream: each request takes 300 ms.
    let upstream = serve(Router::new().route(
        "/work",
        get(|| async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            "done\n"
        }),
    ))
    .await?;
    let client: HttpClient = HyperClient::builder(TokioExecutor::new()).build_http();
    let front = serve(Router::new().route("/", get(proxy)).with_state(Proxy {
        tenants,
        client: client.clone(),
        upstream,
    }))
    .await?;

    for tenant in ["initech", "globex", "acme"] {
        let burst: Vec<_> = (0..8)
            .map(|_| {
                let client = client.clone();
                let request = Request::get(format!("{front}/"))
                    .header("x-tenant", tenant)
                    .body(Empty::new())
                    .expect("a request");
                tokio::spawn(async move { client.request(request).await.map(|r| r.status()) })
            })
            .collect();
        let mut served = 0;
        let mut limited = 0;
        for request in burst {
            match request.await?? {
                StatusCode::OK => served += 1,
                StatusCode::TOO_MANY_REQUESTS => limited += 1,
                other => println!("{tenant}: {other}"),
            }
        }
        println!("{tenant}: {served} served, {limited} answered 429");
    }
    for key in pg_semaphore::admin::busiest_keys(&pool, "example-tenants", 10).await? {
        println!("still held: {} ({} of {})", key.key, key.held, key.capacity);
    }
    Ok(())
}

/// The server to use: `DATABASE_URL`, or a message saying how to set it.
fn database_url() -> String {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => url,
        _ => {
            eprintln!(
                "set DATABASE_URL=postgres://user@host/db, e.g.\n  \
                 DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
                 cargo run --example tenants"
            );
            std::process::exit(2)
        }
    }
}
