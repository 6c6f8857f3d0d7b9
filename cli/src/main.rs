//! `pg-semaphore`: the operator's command line for pg-semaphore.
//!
//! The workspace's `cli/` crate (`pg-semaphore-cli`):
//!
//! ```text
//! cargo install --path cli     # or: cargo run -p pg-semaphore-cli -- status
//! ```
//!
//! The library returns data; this binary only parses and renders:
//!
//! - `main.rs`: the command line (clap), exit statuses, connecting;
//! - `commands.rs`: one function per command, from arguments to output text;
//! - `render.rs`: tables, JSON and CSV; `render/report.rs` the HTML report;
//! - `parse.rs`: durations, times and time windows.

mod commands;
mod parse;
mod render;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{Args, Parser, Subcommand};
use pg_semaphore::{Error, schema::SchemaError};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

use crate::parse::{parse_duration, parse_time};

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
  3  not found: no such semaphore (audit, report, status NAME, set-capacity, clear-queue,
     fair-weight), rate limiter (audit --limiter, report --limiter),
     claim (release) or family (family, rule, tier)
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

    /// Every semaphore, lease and advisory, with its live holders; the
    /// families; the rate limiters; what each refused and timed out.
    ///
    /// Keys of semaphore families (named @family/key) are listed only while
    /// held; `families` and `family NAME` show the rest.
    ///
    /// REFUSED and TIMED OUT (and a rate limiter's ADMITTED) are the
    /// outcome counters of the minutes that overlap the last 60 seconds
    /// (this minute so far and the previous one, on the database's clock:
    /// between 60 and 120 seconds of counts), as every process using
    /// pg-semaphore writes them every 5 s: refused at once (no free slot, a
    /// full queue, a refused rate check), gave up at a timeout. A family's
    /// keys count under the family, never per key (so a family key's row
    /// shows -).
    ///
    /// Lease semaphores first, each holder with its claim id, slot, label,
    /// age, lease left and silence: the time since it last renewed its
    /// lease (or claimed, if it never renewed). A live holder's heartbeat
    /// keeps its silence under the heartbeat interval (a third of the lease
    /// by default); a silence that grows past it is a holder that stopped
    /// renewing (dead, hung or cut off), whose slot is freed when its lease
    /// runs out. (Silence assumes
    /// the semaphore's lease: a claim with a lease of its own may show
    /// more or less.) Then advisory semaphores, each held slot with
    /// the session whose advisory lock it is (from pg_locks): its backend
    /// pid, client address, how long it has been connected (not how long it
    /// has held the slot) and application_name. Sessions of other roles
    /// show their client and start only to a role with pg_read_all_stats
    /// (or pg_monitor). Then, without NAME: the families (default
    /// capacity, keys); the rate limiters (kind, the limits stored for all
    /// their keys, a pause of all their keys with its end, how many keys
    /// are paused on their own, how many keys they have); and every other
    /// advisory lock of the database (a Mutex's), held or waited for, with
    /// its backend and since when; --mutex NAME shows a mutex's lock under
    /// its name.
    ///
    /// --json prints one array: the lease semaphores ("kind": "lease"),
    /// each holder with "age_seconds", "lease_left_seconds" and
    /// "silent_seconds", then the advisory ones, each with "kind":
    /// "advisory" and its holders as {"slot", "pid", "application_name",
    /// "client_addr", "backend_start"}; each with "refused", "timed_out"
    /// and "counted_since". Without NAME, then the families ("kind":
    /// "family") and the rate limiters ("kind": "rate_limiter",
    /// "limiter_kind", "limit", "paused_until", "paused_keys", "keys",
    /// "admitted", "refused", "timed_out", "counted_since").
    Status {
        /// Only this semaphore, of either kind (exit status 3 if it does not exist).
        name: Option<String>,
        /// Print JSON instead of tables (advisory semaphores carry "kind": "advisory").
        /// The mutexes' table is printed in text only.
        #[arg(long)]
        json: bool,
        /// Show this mutex's lock under its name instead of its key (repeatable).
        #[arg(long = "mutex", value_name = "NAME")]
        mutexes: Vec<String>,
    },

    /// Name what holds back VACUUM on this database, if anything.
    ///
    /// The oldest session, replication slot or prepared transaction that
    /// holds the database's xmin horizon: while one does, the lease
    /// semaphore slows down by the minute (the advisory semaphore, the mutex
    /// and the rate limiters do not). Sessions of other roles show their
    /// start and state only to a role with pg_read_all_stats (or pg_monitor).
    Doctor {
        /// Print JSON instead of text (`null`: nobody holds the horizon).
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
    ///
    /// For an advisory semaphore: its finished permits, from its audit log
    /// (written in batches after each permit ends; live holders are in
    /// `status`, not in the log): slots, holder, claimed, ended, outcome
    /// (released, dropped, lost) and hold time; no claim id, no lease.
    /// --json has "kind": "advisory", each claim {"slots", "holder",
    /// "metadata", "claimed_at", "ended_at", "outcome", "held_seconds"}.
    /// Under the summary: how many requests the semaphore refused and
    /// timed out in the window (the outcome counters' minutes that overlap
    /// it; --json: "outcomes", one object per minute).
    ///
    /// --limiter NAME: a rate limiter's decisions instead, per minute
    /// (admitted, refused, timed out), from the outcome counters, with its
    /// stored limits; --kind when limiters of several kinds share the name.
    /// --json: {"limiter", "kind", "since", "until", "info", "minutes",
    /// "total"}; --csv: minute,admitted,refused,timed_out.
    #[command(after_help = "Examples:
  pg-semaphore audit payments-api --last 15m
  pg-semaphore audit payments-api --since 2026-11-21T08:00:00Z --until 2026-11-21T09:00:00Z --csv
  pg-semaphore audit payments-api --since 2d --until 1d --json
  pg-semaphore audit --limiter partner-api --last 6h")]
    Audit(AuditArgs),

    /// Draw a semaphore's claims over a time window as one HTML page.
    ///
    /// The page is self-contained (it loads nothing, works offline): a
    /// timeline of the claims per slot (a bar from claim to release or
    /// timeout, colored by outcome; holder and metadata on hover),
    /// occupancy over time against the capacity, a hold-time histogram and
    /// the summary. Over 5,000 claims in the window (or over 100 slots), the
    /// timeline shows each slot's busy share per time bucket instead of one
    /// bar per claim, and the page says so. The window is the last hour
    /// unless --last or --since/--until say otherwise. Times are UTC.
    ///
    /// For an advisory semaphore the page draws its finished permits from
    /// its audit log, and says that the picture ends at the last finished
    /// permit (live permits are not in the log: see `status`). Under them,
    /// the requests refused and timed out per minute (the outcome
    /// counters).
    ///
    /// --limiter NAME draws a rate limiter's decisions per minute instead
    /// (admitted, refused, timed out, stacked), with its stored limits and
    /// totals; --kind when limiters of several kinds share the name.
    #[command(after_help = "Examples:
  pg-semaphore report payments-api --since 1h --html report.html
  pg-semaphore report payments-api --since 2026-11-21T08:00:00Z --until 2026-11-21T09:00:00Z --html 0800.html
  pg-semaphore report --limiter partner-api --last 6h --html partner.html")]
    Report(ReportArgs),

    /// Time out every live claim whose lease has expired.
    ///
    /// What a `Reaper` does each round; prints how many were reaped.
    Reap,

    /// Run the reaper until stopped (Ctrl-C or SIGTERM): the operator's
    /// long-lived process.
    ///
    /// Each round times out expired claims (a crashed holder's slot is
    /// otherwise freed only by the next claim on its semaphore), removes
    /// idle family keys whose history was pruned, and with --retention and
    /// --rate-limits prunes the audit log and rate limiter keys at rest.
    /// Run it as the operator's role; one per database is enough (several
    /// are safe).
    #[command(after_help = "Examples:
  pg-semaphore reaper
  pg-semaphore reaper --every 5s --retention 30d --rate-limits 1h")]
    Reaper {
        /// How often to reap.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "10s")]
        every: Duration,
        /// Also delete finished claims older than this (the audit log's history).
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        retention: Option<Duration>,
        /// Also delete rate limiter keys at rest for this long.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        rate_limits: Option<Duration>,
    },

    /// Serve the live dashboard until stopped (Ctrl-C or SIGTERM): one page
    /// showing every semaphore, family, rate limiter and mutex as it changes.
    ///
    /// Open the address it prints in a browser. A sampler reads the schema
    /// and pg_locks about once a second while anyone has the page open, and
    /// stops when nobody does; the page only receives its snapshots (server-
    /// sent events at /events, the current one at /snapshot.json). It is
    /// read-only, and the application's role is enough to run it.
    ///
    /// It listens on 127.0.0.1 by default. With --token, every request must
    /// carry `Authorization: Bearer TOKEN`, or `?token=TOKEN` in its URL (for
    /// a browser: open http://HOST:PORT/?token=TOKEN). A listen address other
    /// than a loopback one is refused without a token, unless
    /// --allow-unauthenticated says that is meant (behind a proxy that
    /// authenticates, say).
    #[command(after_help = "Examples:
  pg-semaphore dashboard
  pg-semaphore dashboard --listen 127.0.0.1:9000
  PGSEMAPHORE_DASHBOARD_TOKEN=s3cret pg-semaphore dashboard --listen 0.0.0.0:7070")]
    Dashboard {
        /// The address to listen on (port 0: any free port, printed).
        #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:7070")]
        listen: std::net::SocketAddr,
        /// Require this bearer token of every request (letters, digits, `-`,
        /// `_`, `.`, `~`: it may travel in a URL).
        #[arg(
            long,
            env = "PGSEMAPHORE_DASHBOARD_TOKEN",
            hide_env_values = true,
            value_name = "TOKEN"
        )]
        token: Option<String>,
        /// Listen on a non-loopback address without a token.
        #[arg(long)]
        allow_unauthenticated: bool,
        /// How often to sample while someone watches.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "1s")]
        every: Duration,
    },

    /// Give a role the application's or the operator's grants, in one step.
    ///
    /// Run it as the role that ran the migrations (the schema's owner). The
    /// role gets USAGE on the schema, SELECT on its tables and EXECUTE on
    /// exactly its part's functions, and is recorded: a later schema
    /// upgrade gives it what the upgrade adds. Idempotent.
    #[command(after_help = "Examples:
  pg-semaphore grant --application app
  pg-semaphore grant --operator ops")]
    #[command(group(clap::ArgGroup::new("part").required(true).args(["application", "operator"])))]
    Grant {
        /// The role that runs the application.
        #[arg(long, value_name = "ROLE")]
        application: Option<String>,
        /// The role of operators and of the reaper.
        #[arg(long, value_name = "ROLE")]
        operator: Option<String>,
    },

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
    /// Processes that open the semaphore with another capacity do not set
    /// it back (opening never changes an existing semaphore): change their
    /// configuration too, for the day the semaphore is created anew.
    SetCapacity {
        /// The semaphore's name.
        name: String,
        /// The new capacity (1 to 100000).
        capacity: u32,
    },

    /// Remove every waiter from a semaphore's fair queue.
    ///
    /// For a queue that a waiter blocks (a process that keeps renewing its
    /// place but never claims). Waiters of live processes notice at their
    /// next claim and queue again, at the back; the semaphore's waiters are
    /// woken. Prints how many were removed (exit status 3 if the semaphore
    /// does not exist).
    ClearQueue {
        /// The semaphore's name.
        name: String,
    },

    /// Set the weight of a fairness key in a semaphore's fair queue.
    ///
    /// A key of weight W has up to W of its waiters in each turn of the
    /// rotation between keys (every key starts at 1; 1 removes the
    /// setting). Applies to waiters queued from now on. Prints the previous
    /// weight (exit status 3 if the semaphore does not exist).
    FairWeight {
        /// The semaphore's name.
        name: String,
        /// The fairness key; without it, the shared default key (waiters
        /// that carry no key).
        #[arg(long)]
        key: Option<String>,
        /// The weight (1 to 1000).
        weight: u32,
    },

    /// Every semaphore family: default capacity and lease, idle time, keys, rules.
    ///
    /// A family gives each key (a tenant, a customer) its own semaphore,
    /// with the capacity its rules give it: an exact-key rule, else the
    /// rule of the key's tier, else the family's default.
    Families {
        /// Print JSON: an array of families, each with its "rules".
        #[arg(long)]
        json: bool,
    },

    /// One family: its settings and rules, and its busiest keys with their holders.
    ///
    /// The busiest keys are those with the most live claims (exit status 3
    /// if the family does not exist).
    Family {
        /// The family's name.
        name: String,
        /// How many of the busiest keys to show.
        #[arg(long, value_name = "N", default_value_t = 10)]
        top: u32,
        /// Print JSON: {"family": {...}, "busiest_keys": [...]}.
        #[arg(long)]
        json: bool,
    },

    /// Set or remove a capacity rule of a family.
    ///
    /// The family's existing keys get their new capacity in the same
    /// transaction: a lowered capacity admits no claim above it (holders
    /// above it finish), a raised one wakes waiters.
    #[command(
        subcommand,
        after_help = "Examples:
  pg-semaphore rule set tenants --tier premium 50
  pg-semaphore rule set tenants --key tenant-7 200
  pg-semaphore rule remove tenants --key tenant-7"
    )]
    Rule(RuleCommand),

    /// Put a key of a family in a tier, or take it out.
    ///
    /// The key, if it exists, gets the capacity of its tier's rule (unless
    /// a rule of its own wins) in the same transaction.
    #[command(
        subcommand,
        after_help = "Examples:
  pg-semaphore tier set tenants tenant-42 premium
  pg-semaphore tier remove tenants tenant-42"
    )]
    Tier(TierCommand),

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

    /// Rate limiters' stored limits and pauses: list, set, clear, pause, resume.
    ///
    /// A limiter's first check stores the limits its code builds it with;
    /// a limit set here replaces the stored one, in every process, from
    /// each key's next check (a key's own limit beats its limiter's). A
    /// deploy that changes a limiter's limits in code must set them here. A paused limiter or key refuses
    /// every check until the pause ends; waiting acquires sleep until then.
    #[command(
        subcommand,
        after_help = "Examples:
  pg-semaphore limits list
  pg-semaphore limits set token-bucket partner-api --rate 50 --burst 100
  pg-semaphore limits set fixed-window per-day --key tenant-7 --permit-limit 20000 --window 1d
  pg-semaphore limits clear token-bucket partner-api
  pg-semaphore limits pause token-bucket partner-api --for 30s
  pg-semaphore limits resume token-bucket partner-api"
    )]
    Limits(LimitsCommand),
}

/// `pg-semaphore limits ...`.
#[derive(Debug, Subcommand)]
enum LimitsCommand {
    /// Every stored limit and pause (a row per limiter, and per key with its own).
    List {
        /// Print JSON: an array of {"kind", "limiter", "key", "limit", "paused_until", "updated_at", "as_of"}.
        #[arg(long)]
        json: bool,
    },
    /// Store a limiter's limits (or one key's, with --key).
    ///
    /// A token bucket takes --rate and --burst; a fixed or sliding window
    /// --permit-limit and --window. Waiting acquires are told, and a raised
    /// rate shortens their wait.
    Set {
        #[command(flatten)]
        target: LimitTarget,
        /// Tokens per second (token bucket).
        #[arg(long, requires = "burst", conflicts_with_all = ["permit_limit", "window"])]
        rate: Option<f64>,
        /// The bucket's capacity (token bucket).
        #[arg(long, requires = "rate")]
        burst: Option<u32>,
        /// Permits per window (fixed or sliding window).
        #[arg(long, requires = "window")]
        permit_limit: Option<u32>,
        /// The window's length, e.g. 1s, 1h, 1d (fixed or sliding window).
        #[arg(long, value_name = "DURATION", value_parser = parse_duration, requires = "permit_limit")]
        window: Option<Duration>,
    },
    /// Forget a limiter's (or a key's) stored limits: a key's limiter's apply again; a limiter's next check stores its code's.
    Clear {
        #[command(flatten)]
        target: LimitTarget,
    },
    /// Pause a limiter (or one key) for --for, at most 1h, in every process.
    ///
    /// Never shortens a pause in force.
    Pause {
        #[command(flatten)]
        target: LimitTarget,
        /// How long, e.g. 30s, 5m, 1h.
        #[arg(long = "for", value_name = "DURATION", value_parser = parse_duration)]
        duration: Duration,
    },
    /// End a limiter's (or a key's) pause now; waiting acquires go on at once.
    Resume {
        #[command(flatten)]
        target: LimitTarget,
    },
}

/// Which limiter, or which key of it.
#[derive(Debug, Args)]
struct LimitTarget {
    /// token-bucket, fixed-window or sliding-window.
    kind: pg_semaphore::admin::LimiterKind,
    /// The limiter's name.
    limiter: String,
    /// One key of the limiter instead of all of them.
    #[arg(long)]
    key: Option<String>,
}

#[derive(Debug, Subcommand)]
enum RuleCommand {
    /// Set a rule: keys it matches get CAPACITY slots.
    Set {
        /// The family's name.
        family: String,
        #[command(flatten)]
        target: RuleTarget,
        /// The capacity (1 to 100000).
        capacity: u32,
    },
    /// Remove a rule: the keys it matched fall back to the next rule or the default.
    Remove {
        /// The family's name.
        family: String,
        #[command(flatten)]
        target: RuleTarget,
    },
}

/// What a rule matches: one key, or a tier.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct RuleTarget {
    /// This key exactly (wins over its tier's rule).
    #[arg(long, value_name = "KEY")]
    key: Option<String>,
    /// Every key in this tier (wins over the default).
    #[arg(long, value_name = "TIER")]
    tier: Option<String>,
}

#[derive(Debug, Subcommand)]
enum TierCommand {
    /// Put KEY in TIER.
    Set {
        /// The family's name.
        family: String,
        /// The key.
        key: String,
        /// The tier.
        tier: String,
    },
    /// Take KEY out of its tier.
    Remove {
        /// The family's name.
        family: String,
        /// The key.
        key: String,
    },
}

#[derive(Debug, Args)]
struct AuditArgs {
    /// The semaphore's name; a family key is @family/key (held or not).
    #[arg(required_unless_present = "limiter")]
    name: Option<String>,

    #[command(flatten)]
    limiter: LimiterArgs,

    #[command(flatten)]
    window: WindowArgs,

    /// Print JSON: {"claims": [...], "summary": {...}}.
    #[arg(long, conflicts_with = "csv")]
    json: bool,

    /// Print the claims as CSV (a header line, then one line per claim; no summary).
    #[arg(long)]
    csv: bool,
}

#[derive(Debug, Args)]
struct ReportArgs {
    /// The semaphore's name; a family key is @family/key (held or not).
    #[arg(required_unless_present = "limiter")]
    name: Option<String>,

    #[command(flatten)]
    limiter: LimiterArgs,

    #[command(flatten)]
    window: WindowArgs,

    /// Write the HTML page to FILE (`-`: to stdout).
    #[arg(long, value_name = "FILE")]
    html: PathBuf,
}

/// A rate limiter instead of a semaphore: its name, and its kind when
/// limiters of several kinds share the name.
#[derive(Debug, Args)]
struct LimiterArgs {
    /// A rate limiter's name instead of a semaphore's.
    #[arg(long, value_name = "NAME", conflicts_with = "name")]
    limiter: Option<String>,
    /// The limiter's kind: token-bucket, fixed-window or sliding-window
    /// (needed only when limiters of several kinds have the name).
    #[arg(long, requires = "limiter")]
    kind: Option<pg_semaphore::admin::LimiterKind>,
}

/// A time window: `--last`, or `--since` and `--until`.
#[derive(Debug, Args)]
struct WindowArgs {
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

    fn usage(message: impl Into<String>) -> Self {
        Failure::new(EXIT_USAGE, message)
    }

    fn not_found(message: impl Into<String>) -> Self {
        Failure::new(EXIT_NOT_FOUND, message)
    }
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        let code = match &error {
            Error::Schema(SchemaError::Missing { .. }) => {
                return Failure::new(
                    EXIT_NOT_MIGRATED,
                    "pg-semaphore's migrations are not applied to this database: \
                     run `pg-semaphore migrate` first",
                );
            }
            Error::SemaphoreNotFound { semaphore } => {
                return Failure::not_found(format!("no semaphore named {semaphore:?}"));
            }
            Error::FamilyNotFound { family } => {
                return Failure::not_found(format!("no semaphore family named {family:?}"));
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

/// Runs one command; its output goes to stdout.
async fn run(cli: Cli) -> Result<String, Failure> {
    // Refused before connecting: a usage error needs no database.
    if let Command::Dashboard {
        listen,
        token,
        allow_unauthenticated,
        ..
    } = &cli.command
    {
        commands::check_dashboard(*listen, token.as_deref(), *allow_unauthenticated)?;
    }
    let pool = connect(cli.database_url.as_deref()).await?;
    let output = match cli.command {
        Command::Migrate => commands::migrate(&pool).await?,
        Command::Status {
            name,
            json,
            mutexes,
        } => commands::status(&pool, name.as_deref(), json, &mutexes).await?,
        Command::Doctor { json } => commands::doctor(&pool, json).await?,
        Command::Audit(args) => commands::audit(&pool, args).await?,
        Command::Report(args) => commands::report(&pool, args).await?,
        Command::Reap => commands::reap(&pool).await?,
        Command::Reaper {
            every,
            retention,
            rate_limits,
        } => commands::reaper(&pool, every, retention, rate_limits).await?,
        Command::Dashboard {
            listen,
            token,
            every,
            ..
        } => commands::dashboard(&pool, listen, token, every).await?,
        Command::Grant {
            application,
            operator,
        } => commands::grant(&pool, application.as_deref(), operator.as_deref()).await?,
        Command::Release { id } => commands::release(&pool, id).await?,
        Command::SetCapacity { name, capacity } => {
            commands::set_capacity(&pool, &name, capacity).await?
        }
        Command::ClearQueue { name } => commands::clear_queue(&pool, &name).await?,
        Command::FairWeight { name, key, weight } => {
            commands::fair_weight(&pool, &name, key.as_deref(), weight).await?
        }
        Command::Prune { older_than } => commands::prune(&pool, older_than).await?,
        Command::Limits(command) => commands::limits(&pool, command).await?,
        Command::Families { json } => commands::families(&pool, json).await?,
        Command::Family { name, top, json } => commands::family(&pool, &name, top, json).await?,
        Command::Rule(RuleCommand::Set {
            family,
            target,
            capacity,
        }) => commands::rule(&pool, &family, target.key, target.tier, Some(capacity)).await?,
        Command::Rule(RuleCommand::Remove { family, target }) => {
            commands::rule(&pool, &family, target.key, target.tier, None).await?
        }
        Command::Tier(TierCommand::Set { family, key, tier }) => {
            commands::tier(&pool, &family, &key, Some(&tier)).await?
        }
        Command::Tier(TierCommand::Remove { family, key }) => {
            commands::tier(&pool, &family, &key, None).await?
        }
    };
    pool.close().await;
    Ok(output)
}

async fn connect(url: Option<&str>) -> Result<PgPool, Failure> {
    let Some(url) = url.filter(|u| !u.trim().is_empty()) else {
        return Err(Failure::usage(
            "no database: set DATABASE_URL (in the environment or a .env file) \
             or pass --database-url postgres://user@host/db",
        ));
    };
    let options: PgConnectOptions = url
        .parse()
        .map_err(|e| Failure::usage(format!("DATABASE_URL is not a valid PostgreSQL URL: {e}")))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_valid() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
