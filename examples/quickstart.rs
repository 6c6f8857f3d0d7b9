//! Twenty workers share a capacity-4 semaphore that guards a slow upstream.
//!
//! Impatient workers use `try_acquire` and answer 503 at once when every slot
//! is taken; patient ones wait up to 5 s with `claim().timeout(..).acquire()`. An observer
//! checks the database's list of holders never exceeds the capacity, and the
//! run ends with the audit log's summary of its own time window.
//!
//! ```text
//! cargo run --example quickstart
//! ```
//!
//! It uses `DATABASE_URL` (environment or `.env`) when set, and otherwise
//! starts a throwaway PostgreSQL from the locally installed server binaries,
//! exactly as the tests do (the one example that uses the repository's
//! unpublished test harness, so that it runs with no configuration; the
//! others need only `DATABASE_URL`, and can be copied as they are).

use std::time::{Duration, Instant};

use pg_semaphore::{Client, Error, Semaphore, admin::Reaper};
use sqlx::postgres::PgPoolOptions;
use testkit::server;
use tokio::sync::oneshot;

const CAPACITY: u32 = 4;
const WORKERS: u32 = 20;
const PATIENCE: Duration = Duration::from_secs(5);

/// How a worker's request went.
enum Served {
    AtOnce,       // try_acquire found a free slot
    AfterWaiting, // the timed acquire got one, possibly after waiting
    FastFail,     // try_acquire found every slot taken: 503
    TimedOut,     // the timed acquire gave up
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Finding or starting the server blocks (initdb, pg_ctl): keep it off the runtime.
    let server = tokio::task::spawn_blocking(server::server).await?;
    println!("PostgreSQL: {}", server.description);

    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(server.options.clone())
        .await?;
    pg_semaphore::migrate(&pool).await?;
    // One client per pool: everything is built on it.
    let client = Client::new(pool.clone());
    let reaper = Reaper::spawn(&pool, Duration::from_secs(5))?;

    // A fresh name per run, so reruns against a persistent DATABASE_URL don't mix.
    let run_start = chrono::Utc::now();
    let name = format!("quickstart-upstream-{}", run_start.timestamp_millis());
    let sem = Semaphore::builder(name, CAPACITY).build(&client).await?;
    println!(
        "semaphore {:?}: {CAPACITY} slots, {WORKERS} workers\n",
        sem.name()
    );

    let t0 = Instant::now();
    let (stop_observer, stopped) = oneshot::channel();
    let observer = tokio::spawn(observe(sem.clone(), stopped));
    let workers: Vec<_> = (1..=WORKERS)
        .map(|id| tokio::spawn(worker(sem.clone(), id, t0)))
        .collect();

    let (mut at_once, mut after_waiting, mut fast_fails, mut timeouts) = (0, 0, 0, 0);
    for worker in workers {
        match worker.await?? {
            Served::AtOnce => at_once += 1,
            Served::AfterWaiting => after_waiting += 1,
            Served::FastFail => fast_fails += 1,
            Served::TimedOut => timeouts += 1,
        }
    }
    let _ = stop_observer.send(());
    let peak = observer.await??;

    let summary = sem.summary(run_start..chrono::Utc::now()).await?;
    println!("\n== audit log of this run ({:.1?})", t0.elapsed());
    println!(
        "   claims     {} completed, {} timed out, {} still held",
        summary.completed,
        summary.timed_out,
        summary.live.unwrap_or(0)
    );
    println!(
        "   hold time  p50 {}, p95 {}, max {}",
        ms(summary.p50_hold),
        ms(summary.p95_hold),
        ms(summary.max_hold)
    );
    println!("== workers");
    println!(
        "   acquired   {:>2}  ({at_once} via try_acquire, {after_waiting} waited via a timed acquire)",
        at_once + after_waiting
    );
    println!("   503s       {fast_fails:>2}  (try_acquire found no free slot)");
    println!("   timeouts   {timeouts:>2}  (waited {PATIENCE:?} in vain)");
    println!("   holders    {peak:>2}  at most at once, of {CAPACITY} slots");

    reaper.shutdown().await;
    drop(sem);
    client.shutdown().await?;
    pool.close().await;
    Ok(())
}

/// One request to the upstream: every third worker is impatient.
async fn worker(sem: Semaphore, id: u32, t0: Instant) -> Result<Served, Error> {
    // Requests arrive a little faster than the upstream can serve them.
    tokio::time::sleep(Duration::from_millis(u64::from(id - 1) * 60)).await;
    let impatient = id.is_multiple_of(3);
    let asked = Instant::now();
    let claimed = if impatient {
        sem.try_acquire().await
    } else if id.is_multiple_of(2) {
        // Metadata is stored with the claim in the audit log.
        sem.acquiring()
            .metadata(serde_json::json!({ "worker": id, "route": "/quote" }))
            .timeout(PATIENCE)
            .acquire()
            .await
    } else {
        sem.acquiring().timeout(PATIENCE).acquire().await
    };
    let permit = match claimed {
        Ok(permit) => permit,
        Err(Error::NoSlotsAvailable { .. }) => {
            println!("{} worker {id:02} no slot free -> 503", stamp(t0));
            return Ok(Served::FastFail);
        }
        Err(Error::Timeout { .. }) => {
            println!("{} worker {id:02} gave up after {PATIENCE:?}", stamp(t0));
            return Ok(Served::TimedOut);
        }
        Err(other) => return Err(other),
    };
    let (served, how) = if impatient {
        (Served::AtOnce, "try_acquire".to_owned())
    } else {
        let waited = asked.elapsed().as_millis();
        (Served::AfterWaiting, format!("waited {waited} ms"))
    };
    let slot = permit.slot();
    let claim = permit.id();
    println!(
        "{} worker {id:02} holds slot {slot} (claim #{claim}, {how})",
        stamp(t0)
    );

    tokio::time::sleep(upstream_latency(id)).await; // the slow upstream call
    permit.release().await?;
    println!("{} worker {id:02} released slot {slot}", stamp(t0));
    Ok(served)
}

/// Polls the live holders until told to stop; panics if there are ever more
/// than the capacity. Returns the most seen at once.
async fn observe(sem: Semaphore, mut stop: oneshot::Receiver<()>) -> Result<usize, Error> {
    let mut peak = 0;
    let mut every = tokio::time::interval(Duration::from_millis(20));
    loop {
        tokio::select! {
            _ = &mut stop => return Ok(peak),
            _ = every.tick() => {}
        }
        let held = sem.holders().await?.len();
        assert!(
            held <= CAPACITY as usize,
            "{held} holders of a {CAPACITY}-slot semaphore"
        );
        peak = peak.max(held);
    }
}

/// 150 to 400 ms, pseudo-random but the same for a worker on every run.
fn upstream_latency(id: u32) -> Duration {
    Duration::from_millis(150 + (u64::from(id) * 7919 + 31) % 251)
}

/// `[  123 ms]`: time since the workers started.
fn stamp(t0: Instant) -> String {
    format!("[{:>5} ms]", t0.elapsed().as_millis())
}

fn ms(duration: Option<Duration>) -> String {
    duration.map_or_else(|| "-".to_owned(), |d| format!("{} ms", d.as_millis()))
}
