//! `pg-semaphore`: the operator's command line for pg-semaphore.
//!
//! Built with the `cli` feature:
//!
//! ```text
//! cargo install pg-semaphore --features cli     # or: cargo run --features cli -- status
//! ```

use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use clap::{Args, Parser, Subcommand};
use pg_semaphore::{AuditLog, ClaimRecord, Error, Outcome, ReleaseOutcome, SemaphoreInfo, Summary};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

/// Exit status: the command did what was asked (including "nothing to do").
const EXIT_OK: u8 = 0;
/// Exit status: a database or runtime error (connection refused, query failed).
const EXIT_FAILURE: u8 = 1;
/// Exit status: a usage error (bad arguments, no database URL); clap uses it too.
const EXIT_USAGE: u8 = 2;
/// Exit status: the semaphore or claim named does not exist.
const EXIT_NOT_FOUND: u8 = 3;
/// Exit status: the database has no pg-semaphore schema (run `pg-semaphore migrate`).
const EXIT_NOT_MIGRATED: u8 = 4;

const EXIT_CODES: &str = "\
Exit status:
  0  success (also when there was nothing to do)
  1  database or runtime error (connection refused, query failed, ...)
  2  usage error (bad arguments, no database URL)
  3  not found: no such semaphore (audit, status NAME, set-capacity) or claim (release)
  4  pg-semaphore's migrations are not applied to this database (run `pg-semaphore migrate`)

The database URL comes from --database-url, else DATABASE_URL in the
environment, else DATABASE_URL in a .env file (in this directory or a parent).";

/// Operate pg-semaphore's distributed semaphores on a PostgreSQL database:
/// apply the schema, see who holds what, read the audit log, free stuck slots.
#[derive(Debug, Parser)]
#[command(name = "pg-semaphore", version, after_help = EXIT_CODES)]
struct Cli {
    /// PostgreSQL URL, e.g. postgres://user:password@host:5432/app
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        global = true,
        value_name = "URL"
    )]
    database_url: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or upgrade the pgsemaphore schema.
    ///
    /// Idempotent. The history is kept in pgsemaphore._sqlx_migrations, apart
    /// from the application's own; the same as `pg_semaphore::migrate(&pool)`
    /// and `sqlx migrate run --source migrations --config migrations/sqlx.toml`.
    Migrate,

    /// Every semaphore: capacity, live holders, their age and lease left.
    Status {
        /// Only this semaphore (exit status 3 if it does not exist).
        name: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },

    /// A semaphore's claims over a time window, with a summary.
    ///
    /// The summary counts claims per outcome (completed, timed out, live) and
    /// gives the p50, p95 and max hold time of the finished ones.
    /// The window is the last hour unless --last or --since/--until say
    /// otherwise. A claim is listed if it was held at any moment of the
    /// window. Times are UTC.
    #[command(after_help = "Examples:
  pg-semaphore audit payments-api --last 15m
  pg-semaphore audit payments-api --since 2026-11-21T08:00:00Z --until 2026-11-21T09:00:00Z --csv
  pg-semaphore audit payments-api --since 2d --until 1d --json")]
    Audit(AuditArgs),

    /// Time out every live claim whose lease has expired.
    ///
    /// What a `Reaper` does each round; prints how many were reaped.
    Reap,

    /// Force the release of one claim, for a holder that is stuck or gone.
    ///
    /// Its slot is freed at once and waiters are woken. If the holder is in
    /// fact still working, another claimer may now overlap with it; it
    /// learns so (PermitLost) when it releases. Prefer waiting for the lease
    /// when unsure.
    Release {
        /// The claim's id (`CLAIM` in `status`, `ID` in `audit`).
        #[arg(long, value_name = "N")]
        id: i64,
    },

    /// Change a semaphore's capacity, keeping its lease.
    ///
    /// Growing wakes waiters at once; shrinking lets holders above the new
    /// capacity finish (new claims see the new capacity).
    ///
    /// Processes that build the semaphore with another capacity set it back
    /// when they start: change their configuration too.
    SetCapacity {
        /// The semaphore's name.
        name: String,
        /// The new capacity (1 to 100000).
        capacity: u32,
    },

    /// Delete finished claims older than --older-than.
    ///
    /// Claims of every semaphore that completed or timed out more than that
    /// long ago are deleted, oldest first, in short batches. Live claims are
    /// never touched.
    Prune {
        /// How much history to keep, e.g. 30d, 12h, 1h30m.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        older_than: Duration,
    },
}

#[derive(Debug, Args)]
struct AuditArgs {
    /// The semaphore's name.
    name: String,

    /// The window is the last DURATION (e.g. 30s, 15m, 1h, 7d). Default: 1h.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration,
          conflicts_with_all = ["since", "until"])]
    last: Option<Duration>,

    /// Window start: an RFC 3339 time (2026-11-21T08:00:00Z) or a duration
    /// ago (2h). Default: one hour before --until.
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    since: Option<DateTime<Utc>>,

    /// Window end: an RFC 3339 time, a duration ago, or `now` (the default).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    until: Option<DateTime<Utc>>,

    /// Print JSON: {"claims": [...], "summary": {...}}.
    #[arg(long, conflicts_with = "csv")]
    json: bool,

    /// Print the claims as CSV (a header line, then one line per claim; no summary).
    #[arg(long)]
    csv: bool,
}

/// A failure, with the exit status it maps to.
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn new(code: u8, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        let code = match &error {
            Error::MigrationsMissing { .. } => {
                return Failure::new(
                    EXIT_NOT_MIGRATED,
                    "pg-semaphore's migrations are not applied to this database: \
                     run `pg-semaphore migrate` first",
                );
            }
            Error::SemaphoreNotFound { semaphore } => {
                return Failure::new(EXIT_NOT_FOUND, format!("no semaphore named {semaphore:?}"));
            }
            Error::InvalidArgument { .. } => EXIT_USAGE,
            _ => EXIT_FAILURE,
        };
        let mut message = error.to_string();
        let mut source = std::error::Error::source(&error);
        while let Some(cause) = source {
            let cause = cause.to_string();
            if !message.contains(&cause) {
                let _ = write!(message, ": {cause}");
            }
            source = cause_of(source);
        }
        Failure::new(code, message)
    }
}

fn cause_of<'a>(
    error: Option<&'a (dyn std::error::Error + 'static)>,
) -> Option<&'a (dyn std::error::Error + 'static)> {
    error.and_then(|e| e.source())
}

fn main() -> ExitCode {
    // Variables already in the environment win over the .env file.
    let _ = dotenvy::dotenv();
    let cli = Cli::parse(); // usage errors exit with status 2, --help with 0
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("pg-semaphore: error: cannot start the runtime: {error}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(output) => {
            match std::io::stdout().lock().write_all(output.as_bytes()) {
                // A closed pipe (`| head`) is not an error worth reporting.
                Ok(()) => ExitCode::from(EXIT_OK),
                Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => {
                    ExitCode::from(EXIT_OK)
                }
                Err(error) => {
                    eprintln!("pg-semaphore: error: cannot write the output: {error}");
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
        Err(failure) => {
            eprintln!("pg-semaphore: error: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

async fn run(cli: Cli) -> Result<String, Failure> {
    let pool = connect(cli.database_url.as_deref()).await?;
    let output = match cli.command {
        Command::Migrate => migrate(&pool).await?,
        Command::Status { name, json } => status(&pool, name.as_deref(), json).await?,
        Command::Audit(args) => audit(&pool, args).await?,
        Command::Reap => {
            let reaped = pg_semaphore::reap(&pool).await?;
            format!("reaped {reaped} expired claim{}\n", plural(reaped))
        }
        Command::Release { id } => release(&pool, id).await?,
        Command::SetCapacity { name, capacity } => {
            let previous = pg_semaphore::set_capacity(&pool, &name, capacity).await?;
            format!("{name}: capacity {previous} -> {capacity}\n")
        }
        Command::Prune { older_than } => {
            let deleted = pg_semaphore::prune(&pool, older_than).await?;
            format!(
                "deleted {deleted} finished claim{} that ended more than {} ago\n",
                plural(deleted),
                human(older_than)
            )
        }
    };
    pool.close().await;
    Ok(output)
}

async fn connect(url: Option<&str>) -> Result<PgPool, Failure> {
    let Some(url) = url.filter(|u| !u.trim().is_empty()) else {
        return Err(Failure::new(
            EXIT_USAGE,
            "no database: set DATABASE_URL (in the environment or a .env file) \
             or pass --database-url postgres://user@host/db",
        ));
    };
    let options: PgConnectOptions = url.parse().map_err(|e| {
        Failure::new(
            EXIT_USAGE,
            format!("DATABASE_URL is not a valid PostgreSQL URL: {e}"),
        )
    })?;
    let target = format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("")
    );
    // One direct attempt first: a pool retries a refused connection until
    // its acquire timeout, and an operator wants the answer now.
    let probe = PgConnection::connect_with(&options).await.map_err(|e| {
        Failure::new(
            EXIT_FAILURE,
            format!("cannot connect to the database at {target}: {e}"),
        )
    })?;
    let _ = probe.close().await;
    Ok(PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(30))
        .connect_lazy_with(options))
}

async fn migrate(pool: &PgPool) -> Result<String, Failure> {
    pg_semaphore::migrate(pool).await?;
    let migrator = pg_semaphore::migrator();
    let latest = migrator.iter().last();
    Ok(match latest {
        Some(m) => format!(
            "pg-semaphore schema is up to date: {} migrations, latest {} ({})\n",
            migrator.iter().count(),
            m.version,
            m.description
        ),
        None => "pg-semaphore schema is up to date\n".to_owned(),
    })
}

async fn status(pool: &PgPool, name: Option<&str>, json: bool) -> Result<String, Failure> {
    let mut list = pg_semaphore::semaphores(pool).await?;
    if let Some(name) = name {
        list.retain(|s| s.name == name);
        if list.is_empty() {
            return Err(Failure::new(
                EXIT_NOT_FOUND,
                format!("no semaphore named {name:?}"),
            ));
        }
    }
    if json {
        let value = serde_json::Value::Array(list.iter().map(status_json).collect());
        return Ok(format!("{value:#}\n"));
    }
    if list.is_empty() {
        return Ok("no semaphores yet\n".to_owned());
    }
    let mut out = String::new();
    let mut rows = Vec::new();
    for sem in &list {
        let held = sem.holders.len() as u32;
        rows.push(vec![
            sem.name.clone(),
            sem.capacity.to_string(),
            held.to_string(),
            sem.capacity.saturating_sub(held).to_string(),
            human(sem.default_lease),
        ]);
    }
    table(
        &mut out,
        "",
        &["SEMAPHORE", "CAPACITY", "HELD", "FREE", "LEASE"],
        &rows,
    );
    for sem in list.iter().filter(|s| !s.holders.is_empty()) {
        let _ = writeln!(out, "\n{}:", sem.name);
        let rows: Vec<Vec<String>> = sem
            .holders
            .iter()
            .map(|h| {
                let left = h.expires_at - sem.as_of;
                vec![
                    h.id.to_string(),
                    h.slot.to_string(),
                    h.holder.clone(),
                    human(signed(sem.as_of - h.created_at)),
                    if left > chrono::TimeDelta::zero() {
                        human(signed(left))
                    } else {
                        format!("expired {} ago", human(signed(-left)))
                    },
                ]
            })
            .collect();
        table(
            &mut out,
            "  ",
            &["CLAIM", "SLOT", "HOLDER", "AGE", "LEASE LEFT"],
            &rows,
        );
    }
    Ok(out)
}

fn status_json(sem: &SemaphoreInfo) -> serde_json::Value {
    serde_json::json!({
        "name": sem.name,
        "capacity": sem.capacity,
        "held": sem.holders.len(),
        "default_lease_seconds": sem.default_lease.as_secs_f64(),
        "created_at": rfc3339(sem.created_at),
        "updated_at": rfc3339(sem.updated_at),
        "as_of": rfc3339(sem.as_of),
        "holders": sem.holders.iter().map(|h| serde_json::json!({
            "id": h.id,
            "slot": h.slot,
            "holder": h.holder,
            "metadata": h.metadata,
            "claimed_at": rfc3339(h.created_at),
            "expires_at": rfc3339(h.expires_at),
            "age_seconds": seconds_f64(sem.as_of - h.created_at),
            "lease_left_seconds": seconds_f64(h.expires_at - sem.as_of),
        })).collect::<Vec<_>>(),
    })
}

async fn audit(pool: &PgPool, args: AuditArgs) -> Result<String, Failure> {
    let now = Utc::now();
    let (since, until) = match args.last {
        Some(last) => {
            let since = now.checked_sub_signed(delta(last)?).ok_or_else(|| {
                Failure::new(
                    EXIT_USAGE,
                    format!("--last {} reaches before year 1", human(last)),
                )
            })?;
            (since, now)
        }
        None => {
            let until = args.until.unwrap_or(now);
            (
                args.since.unwrap_or(until - chrono::TimeDelta::hours(1)),
                until,
            )
        }
    };
    if until < since {
        return Err(Failure::new(
            EXIT_USAGE,
            format!(
                "the window ends ({}) before it starts ({})",
                rfc3339(until),
                rfc3339(since)
            ),
        ));
    }
    // An unknown name would just give an empty log: say so instead.
    if !pg_semaphore::semaphores(pool)
        .await?
        .iter()
        .any(|s| s.name == args.name)
    {
        return Err(Failure::new(
            EXIT_NOT_FOUND,
            format!("no semaphore named {:?}", args.name),
        ));
    }
    let log = AuditLog::new(pool);
    let claims = log.history(&args.name, since..until).await?;
    if args.csv {
        return Ok(audit_csv(&claims));
    }
    let summary = log.summary(&args.name, since..until).await?;
    if args.json {
        let value = serde_json::json!({
            "semaphore": args.name,
            "since": rfc3339(since),
            "until": rfc3339(until),
            "claims": claims.iter().map(claim_json).collect::<Vec<_>>(),
            "summary": summary_json(&summary),
        });
        return Ok(format!("{value:#}\n"));
    }
    let mut out = format!(
        "claims of {:?} held between {} and {}\n\n",
        args.name,
        rfc3339(since),
        rfc3339(until)
    );
    if claims.is_empty() {
        out.push_str("(none)\n");
    } else {
        let rows: Vec<Vec<String>> = claims
            .iter()
            .map(|c| {
                vec![
                    c.id.to_string(),
                    c.slot.to_string(),
                    c.holder.clone(),
                    rfc3339(c.created_at),
                    c.ended_at.map(rfc3339).unwrap_or_else(|| "-".to_owned()),
                    outcome(c.outcome).to_owned(),
                    human(c.held_for),
                ]
            })
            .collect();
        table(
            &mut out,
            "",
            &[
                "ID", "SLOT", "HOLDER", "CLAIMED", "ENDED", "OUTCOME", "HELD",
            ],
            &rows,
        );
    }
    let hold = |d: Option<Duration>| d.map_or_else(|| "-".to_owned(), human);
    let _ = writeln!(
        out,
        "\nsummary: {} claims: {} completed, {} timed out, {} live; \
         hold time (finished claims) p50 {}, p95 {}, max {}",
        summary.total(),
        summary.completed,
        summary.timed_out,
        summary.live,
        hold(summary.p50_hold),
        hold(summary.p95_hold),
        hold(summary.max_hold),
    );
    Ok(out)
}

fn claim_json(c: &ClaimRecord) -> serde_json::Value {
    serde_json::json!({
        "id": c.id,
        "slot": c.slot,
        "holder": c.holder,
        "metadata": c.metadata,
        "claimed_at": rfc3339(c.created_at),
        "expires_at": rfc3339(c.expires_at),
        "ended_at": c.ended_at.map(rfc3339),
        "outcome": outcome(c.outcome),
        "held_seconds": c.held_for.as_secs_f64(),
    })
}

fn summary_json(s: &Summary) -> serde_json::Value {
    let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
    serde_json::json!({
        "total": s.total(),
        "completed": s.completed,
        "timed_out": s.timed_out,
        "live": s.live,
        "p50_hold_seconds": secs(s.p50_hold),
        "p95_hold_seconds": secs(s.p95_hold),
        "max_hold_seconds": secs(s.max_hold),
    })
}

fn audit_csv(claims: &[ClaimRecord]) -> String {
    let mut out = String::from(
        "id,slot,holder,claimed_at,expires_at,ended_at,outcome,held_seconds,metadata\n",
    );
    for c in claims {
        let fields = [
            c.id.to_string(),
            c.slot.to_string(),
            c.holder.clone(),
            rfc3339(c.created_at),
            rfc3339(c.expires_at),
            c.ended_at.map(rfc3339).unwrap_or_default(),
            outcome(c.outcome).to_owned(),
            format!("{:.6}", c.held_for.as_secs_f64()),
            c.metadata
                .as_ref()
                .map(|m| m.to_string())
                .unwrap_or_default(),
        ];
        let line: Vec<String> = fields.iter().map(|f| csv_field(f)).collect();
        out.push_str(&line.join(","));
        out.push('\n');
    }
    out
}

/// RFC 4180: quote a field holding a comma, quote or line break; double its quotes.
fn csv_field(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_owned()
    }
}

async fn release(pool: &PgPool, id: i64) -> Result<String, Failure> {
    Ok(match pg_semaphore::force_release(pool, id).await? {
        ReleaseOutcome::Released { semaphore, at } => {
            format!("released claim {id} of {semaphore:?} at {}\n", rfc3339(at))
        }
        ReleaseOutcome::AlreadyTimedOut { semaphore, at } => format!(
            "claim {id} of {semaphore:?} had already timed out at {}: nothing to do\n",
            rfc3339(at)
        ),
        ReleaseOutcome::AlreadyCompleted { semaphore, at } => format!(
            "claim {id} of {semaphore:?} had already been released at {}: nothing to do\n",
            rfc3339(at)
        ),
        _ => return Err(Failure::new(EXIT_NOT_FOUND, format!("no claim {id}"))),
    })
}

fn outcome(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Completed => "completed",
        Outcome::TimedOut => "timed_out",
        Outcome::Live => "live",
    }
}

/// Appends an aligned table (columns padded to their widest cell).
fn table(out: &mut String, indent: &str, headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::from(indent);
        for (i, (cell, width)) in cells.zip(&widths).enumerate() {
            if i + 1 == widths.len() {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<width$}  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
}

fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn signed(delta: chrono::TimeDelta) -> Duration {
    delta.to_std().unwrap_or(Duration::ZERO)
}

fn seconds_f64(delta: chrono::TimeDelta) -> f64 {
    delta
        .num_microseconds()
        .map_or(f64::NAN, |us| us as f64 / 1e6)
}

fn delta(d: Duration) -> Result<chrono::TimeDelta, Failure> {
    chrono::TimeDelta::from_std(d)
        .map_err(|_| Failure::new(EXIT_USAGE, format!("{} is too long", human(d))))
}

/// A short human form: 250ms, 4.2s, 3m07s, 2h05m, 3d04h.
fn human(d: Duration) -> String {
    let secs = d.as_secs();
    if secs < 1 {
        format!("{}ms", d.as_millis())
    } else if secs < 60 {
        format!("{:.1}s", d.as_secs_f64())
    } else if secs < 3600 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else if secs < 86_400 {
        format!("{}h{:02}m", secs / 3600, secs % 3600 / 60)
    } else {
        format!("{}d{:02}h", secs / 86_400, secs % 86_400 / 3600)
    }
}

/// Parses `500ms`, `90s`, `15m`, `1h30m`, `7d`, `2w`: one or more
/// number-unit pairs.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || {
        format!(
            "invalid duration {text:?}: use a number and a unit (ms, s, m, h, d, w), e.g. 90s, 15m, 1h30m, 7d"
        )
    };
    let text = text.trim();
    if text.is_empty() {
        return Err(invalid());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(invalid)?;
        if digits == 0 {
            return Err(invalid());
        }
        let number: u64 = rest[..digits].parse().map_err(|_| invalid())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit_secs: u64 = match &rest[..unit_len] {
            "ms" => {
                total += Duration::from_millis(number);
                rest = &rest[unit_len..];
                continue;
            }
            "s" | "sec" | "secs" => 1,
            "m" | "min" | "mins" => 60,
            "h" | "hour" | "hours" => 3600,
            "d" | "day" | "days" => 86_400,
            "w" | "week" | "weeks" => 7 * 86_400,
            _ => return Err(invalid()),
        };
        let secs = number.checked_mul(unit_secs).ok_or_else(invalid)?;
        total = total
            .checked_add(Duration::from_secs(secs))
            .ok_or_else(invalid)?;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// Parses an RFC 3339 time, `now`, or a duration meaning that long ago.
fn parse_time(text: &str) -> Result<DateTime<Utc>, String> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("now") {
        return Ok(Utc::now());
    }
    if let Ok(at) = DateTime::parse_from_rfc3339(text) {
        return Ok(at.with_timezone(&Utc));
    }
    match parse_duration(text) {
        Ok(ago) => chrono::TimeDelta::from_std(ago)
            .ok()
            .and_then(|ago| Utc::now().checked_sub_signed(ago))
            .ok_or_else(|| format!("{text:?} is too long ago")),
        Err(_) => Err(format!(
            "invalid time {text:?}: use an RFC 3339 time (2026-11-21T08:00:00Z), \
             a duration ago (2h, 1d) or `now`"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("2w"), Ok(Duration::from_secs(14 * 86_400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in ["", "h", "10", "10x", "-5m", "1.5h", "99999999999999999999w"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn times_parse() {
        assert_eq!(
            parse_time("2026-11-21T08:00:00Z").unwrap(),
            DateTime::parse_from_rfc3339("2026-11-21T08:00:00+00:00").unwrap()
        );
        let before = Utc::now();
        let ago = parse_time("2h").unwrap();
        let after = Utc::now();
        let two_hours = chrono::TimeDelta::hours(2);
        assert!(before - two_hours <= ago && ago <= after - two_hours);
        assert!(parse_time("yesterday").is_err());
    }

    #[test]
    fn csv_fields_are_quoted_when_needed() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }

    #[test]
    fn human_durations() {
        assert_eq!(human(Duration::from_millis(250)), "250ms");
        assert_eq!(human(Duration::from_millis(4200)), "4.2s");
        assert_eq!(human(Duration::from_secs(187)), "3m07s");
        assert_eq!(human(Duration::from_secs(2 * 3600 + 300)), "2h05m");
        assert_eq!(human(Duration::from_secs(3 * 86_400 + 4 * 3600)), "3d04h");
    }

    #[test]
    fn cli_definition_is_valid() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
