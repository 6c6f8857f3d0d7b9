//! A nightly job that must run exactly once, though five worker *processes*
//! start at the same moment.
//!
//! Workers 1 to 3 use `locking().no_wait()` and skip the job when another process holds
//! the lock; workers 4 and 5 wait for it with `locking().timeout(..)`. Whoever gets the
//! lock checks, inside the lock's transaction, whether the job already ran
//! today, runs it if not, and records the run in that same transaction, so the
//! record commits atomically with the release. The parent then checks that the
//! job ran exactly once.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example mutex
//! ```
//!
//! `DATABASE_URL` names any PostgreSQL server the user may create a schema
//! and a table on; the example creates (or upgrades) the `pgsemaphore`
//! schema and a `nightly_runs` table in that database. The workers are
//! copies of this program, started as `mutex worker <id> <job> <start at>`
//! with the same `DATABASE_URL`.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pg_semaphore::{Client, Error, Mutex};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const WORKERS: u32 = 5;
/// Workers above this id wait for the lock instead of skipping.
const LAST_IMPATIENT: u32 = 3;
const PATIENCE: Duration = Duration::from_secs(3);

type BoxError = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => parent().await,
        [role, id, job, start_at] if role == "worker" => {
            worker(id.parse()?, job, start_at.parse()?).await
        }
        _ => Err("usage: mutex [worker <id> <job> <start at, ms since the epoch>]".into()),
    }
}

/// Prepares the database, starts the workers, then checks that the job ran once.
async fn parent() -> Result<(), BoxError> {
    let url = database_url();
    let server: PgConnectOptions = url.parse()?;
    println!(
        "PostgreSQL: {}:{}/{}",
        server.get_host(),
        server.get_port(),
        server.get_database().unwrap_or_default()
    );

    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(server)
        .await?;
    pg_semaphore::migrate(&pool).await?;
    // No unique constraint on purpose: the lock alone must keep it to one row.
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS nightly_runs \
         (job text NOT NULL, day date NOT NULL, run_by text NOT NULL, pid bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;

    // A fresh job name per run, so reruns against a persistent DATABASE_URL don't mix.
    let start_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
    let job = format!("nightly-report-{start_ms}");
    println!(
        "job {job:?}: {WORKERS} worker processes; 1-{LAST_IMPATIENT} skip if it is \
         running elsewhere, {}-{WORKERS} wait up to {} s\n",
        LAST_IMPATIENT + 1,
        PATIENCE.as_secs()
    );

    // Every worker connects first, then all try for the lock at this moment.
    let start_at = (start_ms + 500).to_string();
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for id in 1..=WORKERS {
        let child = tokio::process::Command::new(&exe)
            .args(["worker", &id.to_string(), &job, &start_at])
            .env("DATABASE_URL", &url)
            .spawn()?;
        children.push((id, child));
    }
    let mut failed = 0;
    for (id, mut child) in children {
        let status = child.wait().await?;
        if !status.success() {
            eprintln!("worker {id} failed: {status}");
            failed += 1;
        }
    }

    let runs: Vec<(String, i64, chrono::NaiveDate)> =
        sqlx::query_as("SELECT run_by, pid, day FROM nightly_runs WHERE job = $1")
            .bind(&job)
            .fetch_all(&pool)
            .await?;
    println!("\n== nightly_runs for {job:?}");
    for (run_by, pid, day) in &runs {
        println!("   {day}: run by {run_by} (pid {pid})");
    }
    pool.close().await;
    if runs.len() != 1 {
        return Err(format!("the job ran {} times, not exactly once", runs.len()).into());
    }
    if failed > 0 {
        return Err(format!("{failed} of {WORKERS} workers failed").into());
    }
    println!("   ran exactly once");
    Ok(())
}

/// A worker process: connects, takes its turn at the job, disconnects.
async fn worker(id: u32, job: &str, start_at: u64) -> Result<(), BoxError> {
    let pool = PgPool::connect(&database_url()).await?;
    let result = take_turn(&Client::new(pool.clone()), id, job, start_at).await;
    pool.close().await;
    result
}

/// One worker's attempt at the nightly job.
async fn take_turn(client: &Client, id: u32, job: &str, start_at: u64) -> Result<(), BoxError> {
    let say = |what: &str| println!("[worker {id} pid {}] {what}", std::process::id());
    let mutex = Mutex::new(job);

    let now = SystemTime::now().duration_since(UNIX_EPOCH)?;
    tokio::time::sleep(Duration::from_millis(start_at).saturating_sub(now)).await;

    let asked = Instant::now();
    let patient = id > LAST_IMPATIENT;
    let mut guard = if patient {
        say(&format!(
            "waiting up to {} s for the lock",
            PATIENCE.as_secs()
        ));
        match mutex.locking().timeout(PATIENCE).lock(client).await {
            Ok(guard) => guard,
            Err(Error::Timeout { .. }) => {
                say(&format!(
                    "gave up after {} s: the lock is still held",
                    PATIENCE.as_secs()
                ));
                return Ok(());
            }
            Err(other) => return Err(other.into()),
        }
    } else {
        match mutex.locking().no_wait().lock(client).await {
            Ok(guard) => guard,
            Err(Error::Locked { .. }) => {
                say("skipped: another process holds the lock");
                return Ok(());
            }
            Err(other) => return Err(other.into()),
        }
    };
    let how = if patient {
        format!("waited {:.2} s for the lock", asked.elapsed().as_secs_f64())
    } else {
        "got the lock".to_owned()
    };

    // Checked under the lock, in its transaction: nobody can record a run
    // between this check and our commit.
    let done_by: Option<String> =
        sqlx::query_scalar("SELECT run_by FROM nightly_runs WHERE job = $1 AND day = current_date")
            .bind(job)
            .fetch_optional(&mut *guard)
            .await?;
    if let Some(done_by) = done_by {
        say(&format!(
            "{how}, job already done by {done_by}: nothing to do"
        ));
        guard.rollback().await?;
        return Ok(());
    }

    say(&format!("{how}: running the nightly job"));
    tokio::time::sleep(Duration::from_secs(1)).await; // the job itself
    sqlx::query(
        "INSERT INTO nightly_runs (job, day, run_by, pid) VALUES ($1, current_date, $2, $3)",
    )
    .bind(job)
    .bind(format!("worker {id}"))
    .bind(i64::from(std::process::id()))
    .execute(&mut *guard)
    .await?;
    guard.commit().await?; // records the run and releases the lock, atomically
    say("job done: recorded it and released the lock in one commit");
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
                 cargo run --example mutex"
            );
            std::process::exit(2)
        }
    }
}
