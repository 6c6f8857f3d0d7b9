//! An axum service whose `/charge` endpoint calls a fragile upstream that
//! takes at most 2 requests at once, across every replica of the service.
//! `SemaphoreLayer` enforces that with a pg-semaphore semaphore: excess
//! requests get `429 Too Many Requests` with `Retry-After` at once; `/health`
//! is not limited.
//!
//! ```text
//! export DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres
//! cargo run --example axum --features tower             # serves, sends a burst of 6, prints the outcome
//! cargo run --example axum --features tower -- --serve  # just serve on 127.0.0.1:3000
//! ```
//!
//! With `--serve`, try `curl -X POST localhost:3000/charge` from a few shells
//! at once, and `pg-semaphore status` (the `cli/` crate) to see the holders.
//! `DATABASE_URL` names any PostgreSQL server the user may create a schema
//! on; the example creates (or upgrades) the `pgsemaphore` schema in that
//! database.

use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use http::{Request, StatusCode};
use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use pg_semaphore::{Client, Semaphore, audit::AuditLog, tower::SemaphoreLayer};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Stands in for the call to the fragile upstream.
async fn charge() -> &'static str {
    tokio::time::sleep(Duration::from_millis(300)).await;
    "charged\n"
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let serve_only = std::env::args().any(|arg| arg == "--serve");
    let server: PgConnectOptions = database_url().parse()?;
    let database = format!(
        "PostgreSQL {}:{}/{}",
        server.get_host(),
        server.get_port(),
        server.get_database().unwrap_or_default()
    );
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(server)
        .await?;
    pg_semaphore::migrate(&pool).await?;
    let client = Client::new(pool.clone());

    let upstream = Semaphore::builder("example-upstream", 2)
        .build(&client)
        .await?;
    let app = Router::new()
        .route("/charge", post(charge))
        .route_layer(
            SemaphoreLayer::new(upstream)
                .reject_with(StatusCode::TOO_MANY_REQUESTS)
                .retry_after(Duration::from_secs(1))
                .record_requests(true),
        )
        .route("/health", get(|| async { "ok\n" }));

    let address = if serve_only {
        "127.0.0.1:3000"
    } else {
        "127.0.0.1:0"
    };
    let listener = tokio::net::TcpListener::bind(address).await?;
    let address = listener.local_addr()?;
    println!("listening on http://{address} ({database})");
    if serve_only {
        axum::serve(listener, app).await?;
        return Ok(());
    }
    tokio::spawn(async move { axum::serve(listener, app).await });

    // A burst of 6 concurrent requests: 2 are served, 4 are told to come back.
    let started = chrono::Utc::now();
    let client = HyperClient::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let burst: Vec<_> = (0..6)
        .map(|_| {
            let client = client.clone();
            let request = Request::post(format!("http://{address}/charge"))
                .body(Empty::new())
                .expect("a valid request");
            tokio::spawn(async move { client.request(request).await })
        })
        .collect();
    for (i, response) in burst.into_iter().enumerate() {
        let response = response.await??;
        let retry = response
            .headers()
            .get(http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .map(|s| format!(" (Retry-After: {s})"))
            .unwrap_or_default();
        println!("request {i}: {}{retry}", response.status());
    }

    let summary = AuditLog::new(&pool)
        .summary("example-upstream", started..chrono::Utc::now())
        .await?;
    println!(
        "audit log: {} requests reached the upstream, p50 hold {:?}",
        summary.completed,
        summary.p50_hold.unwrap_or_default()
    );
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
                 cargo run --example axum --features tower"
            );
            std::process::exit(2)
        }
    }
}
