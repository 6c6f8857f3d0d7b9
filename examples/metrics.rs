//! The quickstart workload (twenty workers, a capacity-4 semaphore guarding a
//! slow upstream), plus a mutex and a rate limiter, with pg-semaphore's
//! metrics served on `/metrics` in the Prometheus exposition format.
//!
//! ```text
//! export DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres
//! cargo run --example metrics --features metrics            # runs, then prints its own /metrics
//! cargo run --example metrics --features metrics -- --serve # and keeps serving on 127.0.0.1:9184
//! ```
//!
//! With `--serve`, point Prometheus at it:
//!
//! ```text
//! scrape_configs:
//!   - job_name: my-service
//!     static_configs: [{ targets: ["127.0.0.1:9184"] }]
//! ```
//!
//! and ask, for example, how saturated the upstream is
//! (`sum(pg_semaphore_permits_held{semaphore=~"quickstart-.*"})`), how long
//! callers wait (`histogram_quantile(0.95, rate(pg_semaphore_wait_seconds_bucket[5m]))`)
//! or how often they are turned away
//! (`rate(pg_semaphore_no_slots_available_total[5m])`).
//!
//! `DATABASE_URL` names any PostgreSQL server the user may create a schema
//! on; the example creates (or upgrades) the `pgsemaphore` schema in that
//! database.

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use pg_semaphore::{Client, Error, Mutex, RateLimiter, RatePolicy, Semaphore, admin::Reaper};
use sqlx::postgres::PgPoolOptions;

const CAPACITY: u32 = 4;
const WORKERS: u32 = 20;
const PATIENCE: Duration = Duration::from_secs(5);
const SERVE_ON: &str = "127.0.0.1:9184";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let serve = std::env::args().any(|arg| arg == "--serve");
    let url = database_url();

    // 1. The recorder, before anything records; then the help texts.
    let prometheus = PrometheusBuilder::new()
        // Histograms as buckets (aggregatable across replicas), in seconds.
        .set_buckets(&[
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ])?
        .install_recorder()?;
    pg_semaphore::describe_metrics();
    // The recorder's housekeeping: the application runs it now and then.
    tokio::spawn({
        let prometheus = prometheus.clone();
        async move {
            let mut every = tokio::time::interval(Duration::from_secs(5));
            loop {
                every.tick().await;
                prometheus.run_upkeep();
            }
        }
    });

    // 2. /metrics.
    let listener =
        tokio::net::TcpListener::bind(if serve { SERVE_ON } else { "127.0.0.1:0" }).await?;
    let address = listener.local_addr()?;
    let app = Router::new().route("/metrics", get(metrics_page).with_state(prometheus));
    tokio::spawn(async move { axum::serve(listener, app).await });
    println!("metrics on http://{address}/metrics");

    // 3. The quickstart workload, a mutex and a rate limiter.
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await?;
    pg_semaphore::migrate(&pool).await?;
    let client = Client::new(pool.clone());
    let reaper = Reaper::spawn(&pool, Duration::from_secs(5))?;
    // A fresh name per run, so reruns against a persistent DATABASE_URL don't mix.
    let name = format!(
        "quickstart-upstream-{}",
        chrono::Utc::now().timestamp_millis()
    );
    let sem = Semaphore::builder(name, CAPACITY).build(&client).await?;
    let workers: Vec<_> = (1..=WORKERS)
        .map(|id| tokio::spawn(worker(sem.clone(), id)))
        .collect();
    for worker in workers {
        worker.await??;
    }
    let nightly = Mutex::new("nightly-report");
    let guard = nightly.lock(&client).await?;
    let _ = nightly.locking().no_wait().lock(&client).await; // busy: counted, not an error here
    guard.commit().await?;
    let limiter = RateLimiter::builder("api", RatePolicy::token_bucket(5.0, 3)).build(&client)?;
    for _ in 0..5 {
        let _ = limiter.check("user-42", 1).await?; // the key never becomes a label
    }

    // 4. Scrape ourselves, as Prometheus would, and show pg-semaphore's part.
    let client = HyperClient::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let response = client
        .get(format!("http://{address}/metrics").parse()?)
        .await?;
    let page = response.into_body().collect().await?.to_bytes();
    println!();
    for line in String::from_utf8_lossy(&page).lines() {
        // Leave out the buckets: the page is long enough.
        if line.contains("pg_semaphore") && !line.contains("_bucket{") {
            println!("{line}");
        }
    }

    if serve {
        println!("\nserving http://{address}/metrics until Ctrl-C");
        tokio::signal::ctrl_c().await?;
    }
    reaper.shutdown().await;
    pool.close().await;
    Ok(())
}

async fn metrics_page(
    axum::extract::State(prometheus): axum::extract::State<PrometheusHandle>,
) -> String {
    prometheus.render()
}

/// One request to the upstream, as in the quickstart: every third worker is
/// impatient (`try_acquire`, a 503 when full), the others wait up to 5 s.
async fn worker(sem: Semaphore, id: u32) -> Result<(), Error> {
    // Requests arrive a little faster than the upstream can serve them.
    tokio::time::sleep(Duration::from_millis(u64::from(id - 1) * 60)).await;
    let claimed = if id.is_multiple_of(3) {
        sem.try_acquire().await
    } else {
        sem.acquiring().timeout(PATIENCE).acquire().await
    };
    match claimed {
        Ok(permit) => {
            // The slow upstream: 150 to 400 ms, the same for a worker on every run.
            let latency = 150 + (u64::from(id) * 7919 + 31) % 251;
            tokio::time::sleep(Duration::from_millis(latency)).await;
            permit.release().await
        }
        Err(error) if error.is_busy() => Ok(()), // a 503, counted in the metrics
        Err(error) => Err(error),
    }
}

/// The server to use: `DATABASE_URL`, or a message saying how to set it.
fn database_url() -> String {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => url,
        _ => {
            eprintln!(
                "set DATABASE_URL=postgres://user@host/db, e.g.\n  \
                 DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
                 cargo run --example metrics --features metrics"
            );
            std::process::exit(2)
        }
    }
}
