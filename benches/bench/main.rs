//! Benchmarks pg-semaphore side by side with the designs it comes from and
//! with what users would pick instead, in one run, on a PostgreSQL without
//! fsync and on a durable one, and checks the project's performance targets.
//!
//! ```text
//! cargo bench --bench bench                          # every workload, both servers
//! cargo bench --bench bench -- --quick               # every workload, much shorter
//! cargo bench --bench bench -- --only semaphore      # one workload (see below)
//! cargo bench --bench bench -- --server durable      # one server: fsync-off | durable
//! cargo bench --bench bench -- --json                # JSON instead of markdown tables
//! ```
//!
//! Servers: without `DATABASE_URL`, two throwaway servers started from the
//! local binaries (as the tests do, by the testkit), one with `fsync=off`,
//! `synchronous_commit=off`, one with `fsync=on`, `synchronous_commit=on`,
//! `full_page_writes=on`; with `DATABASE_URL`, that server is the durable one
//! (its settings are printed as found) beside a throwaway fsync-off one. Each
//! gets a database of its own (`pgsem_bench_<pid>`, dropped at the end).
//!
//! Workloads (`--only NAME`):
//!
//! 1. **semaphore**: fail-fast claim + immediate release cycles, against the
//!    Django slot table of seed 001 and the counter row of seed 000;
//! 2. **mutex**: lock + unlock, against a raw `pg_advisory_xact_lock` loop
//!    and sqlx's `PgAdvisoryLock`;
//! 3. **wakeup**: time from a release to the waiter's `acquire()` returning,
//!    for the lease semaphore and the advisory semaphore, against a
//!    `SELECT 1` round trip and the polling fallback;
//! 4. **waiters**: 1,000 tasks waiting on one permit: connections, memory,
//!    order served, time to drain;
//! 5. **growth**: a million cycles, the slot table's size without and with
//!    a retention reaper (each run in a fresh database of its own);
//! 6. **rate**: rate limiter decisions (token bucket, fixed window, sliding
//!    window) at 1, 8 and 32 clients, hot key and spread keys, against a
//!    bare single-row `UPDATE` counter (a ≥ 0.5x target per limiter and
//!    cell);
//! 7. **fleet**: 1, 10, 50 and 100 OS processes (this program, re-executed as
//!    workers), each with its own pool and LISTEN connection, sharing 100
//!    semaphores with the same total number of clients: cycles/s, wake-up
//!    latency and connections used;
//! 8. **idle**: try_acquire + release throughput with 50 idle processes
//!    listening, against none;
//! 9. **lease**: a waiter behind a holder that vanished without releasing,
//!    with no reaper: how long after the lease's end it gets the slot;
//! 10. **redis**: seed 002's concurrent requests limiter (Stripe's: a sorted
//!     set and a Lua script) on the Redis at 127.0.0.1:6379 (or
//!     `PGSEMAPHORE_BENCH_REDIS_URL`), side by side with ours; skipped, saying
//!     so, when no Redis answers there;
//! 11. **advisory**: the advisory semaphore's try_acquire + release cycles at
//!     1, 8 and 32 clients, against the raw advisory-lock cycle, the counter
//!     row, the lease semaphore and (when one answers) the Redis limiter;
//! 12. **pressure** (only with `--only pressure`: it takes hours): each
//!     design's cycles/s, 30 s interval by 30 s interval, while a long query,
//!     an idle transaction with an xid, a query in another database or a
//!     `pg_dump` holds back the xmin horizon, against its undisturbed rate
//!     just before. `--minutes M` (10 by default) sets the time under each
//!     pressure, `--pressure NAME` runs one (query|idle-xact|other-db|pg-dump),
//!     `--designs a,b` only these designs
//!     (lease|advisory|mutex|bucket|counter|raw, and the hot-key limiters
//!     with their bare `UPDATE` baseline:
//!     update-hot|bucket-hot|sliding-hot|fixed-hot).
//!     `--interleave` runs the chosen designs in turns of 5 s (two
//!     undisturbed rounds, then rounds under the pressure for `--minutes`)
//!     instead of one after the other, so that they meet the same machine
//!     and the same held horizon, with a ratio to the hot-key bare `UPDATE`
//!     in the same rounds.
//! 13. **multi**: several limits at once: `try_acquire_all` of two
//!     semaphores + release, against one semaphore's `try_acquire` +
//!     release, at 1 and 8 clients.
//! 14. **limits**: a `LimiterSet` of three limits (token bucket, fixed and
//!     sliding window on one key) against a single token bucket check, at 1
//!     and 8 clients, hot and spread keys: the multi-limit check's cost.
//! 15. **lateness** (only with `--only lateness`): 1,000 waiters (100 with
//!     `--quick`) on one key of 10 per second, for each limiter's waiting
//!     acquire: how late each is admitted after the instant the database
//!     allows (p50 and p99, bounded below and above), and round trips per
//!     admission counted by PostgreSQL.
//! 16. **family**: try_acquire + release cycles on a key of a semaphore
//!     family with 10, 10,000 and 1,000,000 keys in the table (1,000 and
//!     10,000 with `--quick`), hot keys and random keys, against named
//!     semaphores in the same run.
//! 17. **heartbeat**: workload 1's cycle at 8 clients while another client
//!     holds 100 or 1,000 permits renewed by their heartbeat, with a 90 s
//!     and a 10 s lease, against the cycle with nothing held: cycles/s and
//!     the renewals per second counted on the server.
//! 18. **outcomes**: what counting outcomes costs: 8 clients refused by a
//!     full semaphore's `try_acquire`, and by an empty token bucket key, each
//!     refusal counted by the client and written every 5 s (the baseline is
//!     this workload built at the commit before the counters, run apart);
//!     and `pgsemaphore.record_outcomes` timed on its own: 1, 100 and 1,000
//!     names per call, one row written 1,200 times in a minute with and
//!     without a held xmin horizon.
//!
//! Throughput and latency cells are measured 3 times, interleaved with their
//! baselines; tables show the median and the spread (min–max) and targets
//! are judged on the median. Baselines are plain SQL on sqlx, in their own
//! schema (`bench_baseline`). Every ratio and PASS/FAIL is computed from
//! numbers measured in the same run, through pg-semaphore's public API only.
//! Tables (or JSON) go to stdout, progress to stderr.

mod advisory;
mod family;
mod fleet;
mod growth;
mod heartbeat;
mod lateness;
mod lease;
mod limits;
mod load;
mod multi;
mod mutex;
mod outcomes;
mod pressure;
mod rate;
mod redis;
mod report;
mod semaphore;
mod waiters;
mod wakeup;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, PgPool};
use testkit::server::{self as harness, Durability};

use crate::load::{create_database, drop_database, kib, pool, proc_value};
use crate::report::{Report, fmt_bytes};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Res<T> = Result<T, BoxError>;

const USAGE: &str = "usage: cargo bench --bench bench -- [--json] [--quick] \
                     [--only semaphore|mutex|wakeup|waiters|growth|rate|fleet|idle|lease|redis|advisory|pressure|multi|limits|lateness|family|heartbeat|outcomes] \
                     [--server fsync-off|durable] [--minutes M] \
                     [--pressure query|idle-xact|other-db|pg-dump] \
                     [--interleave] [--designs lease,advisory,mutex,bucket,counter,raw,update-hot,bucket-hot,sliding-hot,fixed-hot]";

/// The schema the baselines' tables live in; never `pgsemaphore`.
pub const BASELINE_SCHEMA: &str = "bench_baseline";

/// Extra pooled connections beyond one per client.
pub const POOL_SPARE: u32 = 2;

// ---------------------------------------------------------------------------
// Command line and settings
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    Semaphore,
    Mutex,
    Wakeup,
    Waiters,
    Growth,
    Rate,
    Fleet,
    Idle,
    Lease,
    Redis,
    Advisory,
    Pressure,
    Multi,
    Limits,
    Lateness,
    Family,
    Heartbeat,
    Outcomes,
}

impl Workload {
    const ALL: [Workload; 18] = [
        Workload::Semaphore,
        Workload::Mutex,
        Workload::Wakeup,
        Workload::Waiters,
        Workload::Growth,
        Workload::Rate,
        Workload::Fleet,
        Workload::Idle,
        Workload::Lease,
        Workload::Redis,
        Workload::Advisory,
        Workload::Pressure,
        Workload::Multi,
        Workload::Limits,
        Workload::Lateness,
        Workload::Family,
        Workload::Heartbeat,
        Workload::Outcomes,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Workload::Semaphore => "semaphore",
            Workload::Mutex => "mutex",
            Workload::Wakeup => "wakeup",
            Workload::Waiters => "waiters",
            Workload::Growth => "growth",
            Workload::Rate => "rate",
            Workload::Fleet => "fleet",
            Workload::Idle => "idle",
            Workload::Lease => "lease",
            Workload::Redis => "redis",
            Workload::Advisory => "advisory",
            Workload::Limits => "limits",
            Workload::Family => "family",
            Workload::Pressure => "pressure",
            Workload::Multi => "multi",
            Workload::Lateness => "lateness",
            Workload::Heartbeat => "heartbeat",
            Workload::Outcomes => "outcomes",
        }
    }

    fn parse(name: &str) -> Result<Workload, String> {
        Workload::ALL
            .into_iter()
            .find(|w| w.name() == name)
            .ok_or_else(|| format!("unknown workload {name:?}"))
    }
}

#[derive(Debug, Default)]
struct Args {
    json: bool,
    quick: bool,
    only: Option<Workload>,
    server: Option<Durability>,
    minutes: Option<f64>,
    pressure: Option<pressure::Pressure>,
    designs: Option<Vec<&'static str>>,
    interleave: bool,
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    let mut parsed = Args::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) => (flag, Some(value.to_owned())),
            None => (arg.as_str(), None),
        };
        let mut value = |what: &str| {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or(format!("{flag} needs {what}"))
        };
        match flag {
            "--json" => parsed.json = true,
            "--quick" => parsed.quick = true,
            "--interleave" => parsed.interleave = true,
            // `cargo bench` passes --bench to harness = false benchmarks.
            "--bench" => {}
            "--only" => parsed.only = Some(Workload::parse(&value("a workload")?)?),
            "--server" => {
                parsed.server = Some(match value("a server")?.as_str() {
                    "fsync-off" => Durability::FsyncOff,
                    "durable" => Durability::Durable,
                    other => return Err(format!("unknown server {other:?}")),
                });
            }
            "--minutes" => {
                let minutes: f64 = value("a number of minutes")?
                    .parse()
                    .map_err(|_| format!("{flag} needs a number of minutes"))?;
                if !(minutes > 0.0 && minutes.is_finite()) {
                    return Err(format!("{flag} needs a positive number of minutes"));
                }
                parsed.minutes = Some(minutes);
            }
            "--pressure" => {
                parsed.pressure = Some(pressure::Pressure::parse(&value("a pressure")?)?)
            }
            "--designs" => {
                parsed.designs = Some(pressure::parse_designs(&value("a list of designs")?)?)
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(parsed)
}

/// How long each workload runs; `--quick` shortens everything.
#[derive(Debug, Clone)]
pub struct Settings {
    pub quick: bool,
    /// Repetitions of each throughput and latency cell.
    pub reps: usize,
    pub warmup: Duration,
    pub cell: Duration,
    pub wake_warmup: usize,
    pub wake_reps: usize,
    pub select_reps: usize,
    pub fallback_reps: usize,
    pub waiters: usize,
    pub growth_cycles: u64,
    /// The fleet workload's measured window per repetition.
    pub fleet_window: Duration,
    /// How many times the lease workload lets a lease expire under a waiter.
    pub lease_reps: usize,
    /// The lease the vanished holder had.
    pub lease: Duration,
    /// The pressure workload's time under each pressure (`--minutes`).
    pub pressure_minutes: Option<f64>,
    /// The one pressure to apply (`--pressure`), or all.
    pub pressure: Option<pressure::Pressure>,
    /// The pressure workload's designs (`--designs`), or all.
    pub pressure_designs: Option<Vec<&'static str>>,
    /// `--interleave`: the pressure workload's designs in turns.
    pub pressure_interleave: bool,
}

impl Settings {
    fn new(quick: bool) -> Settings {
        if quick {
            Settings {
                quick,
                reps: 3,
                warmup: Duration::from_millis(100),
                cell: Duration::from_millis(300),
                wake_warmup: 3,
                wake_reps: 30,
                select_reps: 200,
                fallback_reps: 3,
                waiters: 200,
                growth_cycles: 20_000,
                fleet_window: Duration::from_millis(1_000),
                lease_reps: 3,
                lease: Duration::from_millis(500),
                pressure_minutes: None,
                pressure: None,
                pressure_designs: None,
                pressure_interleave: false,
            }
        } else {
            Settings {
                quick,
                reps: 3,
                warmup: Duration::from_millis(500),
                cell: Duration::from_secs(3),
                wake_warmup: 10,
                wake_reps: 200,
                select_reps: 1_000,
                fallback_reps: 20,
                waiters: 1_000,
                growth_cycles: 1_000_000,
                fleet_window: Duration::from_secs(5),
                lease_reps: 10,
                lease: Duration::from_secs(1),
                pressure_minutes: None,
                pressure: None,
                pressure_designs: None,
                pressure_interleave: false,
            }
        }
    }

    /// The growth workload measures the table size every tenth of the run.
    pub fn growth_checkpoint(&self) -> u64 {
        (self.growth_cycles / 10).max(1)
    }
}

// ---------------------------------------------------------------------------
// Servers and the run
// ---------------------------------------------------------------------------

/// One server the workloads run against.
#[derive(Debug, Clone)]
pub struct Server {
    /// `fsync off` or `durable`: the column the tables show.
    pub label: &'static str,
    pub description: String,
    /// The server's default database (for CREATE/DROP DATABASE).
    pub admin: PgConnectOptions,
    /// The bench database.
    pub opts: PgConnectOptions,
    /// The bench database's URL, for worker processes.
    pub url: String,
    /// fsync, synchronous_commit and friends, as the server reports them.
    pub settings: String,
}

/// What every workload needs.
#[derive(Debug)]
pub struct Ctx {
    pub servers: Vec<Server>,
    pub pid: u32,
    /// Databases created besides the bench databases, to drop at the end.
    pub extra_dbs: Vec<(PgConnectOptions, String)>,
    pub settings: Settings,
    pub report: Report,
}

#[tokio::main]
async fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.first().is_some_and(|a| a == fleet::WORKER_FLAG) {
        return match fleet::worker(&argv[1..]).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("bench worker failed: {error}");
                ExitCode::FAILURE
            }
        };
    }
    let args = match parse_args(&argv) {
        Ok(args) => args,
        Err(message) => {
            if message.is_empty() {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            eprintln!("{message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench failed: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The testkit's servers: (label, server) pairs, fsync-off first.
fn find_servers(only: Option<Durability>) -> Res<Vec<(Durability, harness::Server)>> {
    let wanted = |d: Durability| only.is_none_or(|o| o == d);
    let mut servers = Vec::new();
    match harness::database_url_server()? {
        Some(durable) => {
            if wanted(Durability::FsyncOff) {
                match harness::start_throwaway(Durability::FsyncOff) {
                    Ok(server) => servers.push((Durability::FsyncOff, server)),
                    Err(error) => eprintln!(
                        "no fsync-off server beside DATABASE_URL (the durable one): {error}"
                    ),
                }
            }
            if wanted(Durability::Durable) {
                servers.push((Durability::Durable, durable));
            }
        }
        None => {
            for durability in [Durability::FsyncOff, Durability::Durable] {
                if wanted(durability) {
                    servers.push((durability, harness::start_throwaway(durability)?));
                }
            }
        }
    }
    if servers.is_empty() {
        return Err("no server to run against".into());
    }
    Ok(servers)
}

async fn run(args: Args) -> Res<()> {
    let started = Instant::now();
    // Finding or starting servers blocks (initdb, pg_ctl): keep it off the runtime.
    let only_server = args.server;
    let found = tokio::task::spawn_blocking(move || find_servers(only_server)).await??;
    let pid = std::process::id();
    let db = format!("pgsem_bench_{pid}");
    let mut servers = Vec::new();
    for (durability, server) in &found {
        eprintln!(
            "PostgreSQL ({}): {}",
            durability.label(),
            server.description
        );
        create_database(&server.options, &db).await?;
        servers.push(Server {
            label: durability.label(),
            description: server.description.clone(),
            admin: server.options.clone(),
            opts: server.options.clone().database(&db),
            url: server.url_for(&db),
            settings: String::new(),
        });
    }
    let mut settings = Settings::new(args.quick);
    settings.pressure_minutes = args.minutes;
    settings.pressure = args.pressure;
    settings.pressure_designs = args.designs;
    settings.pressure_interleave = args.interleave;
    let mut ctx = Ctx {
        servers,
        pid,
        extra_dbs: Vec::new(),
        report: Report {
            json: args.json,
            machine: Vec::new(),
            settings: json!({
                "quick": args.quick,
                "only": args.only.map(Workload::name),
                "reps": settings.reps,
                "warmup_s": settings.warmup.as_secs_f64(),
                "cell_s": settings.cell.as_secs_f64(),
                "wake_reps": settings.wake_reps,
                "select_reps": settings.select_reps,
                "fallback_reps": settings.fallback_reps,
                "waiters": settings.waiters,
                "growth_cycles": settings.growth_cycles,
                "fleet_window_s": settings.fleet_window.as_secs_f64(),
                "lease_reps": settings.lease_reps,
                "pressure_minutes": settings.pressure_minutes,
                "pressure": settings.pressure.map(pressure::Pressure::name),
                "pressure_designs": settings.pressure_designs,
            }),
            cells: Vec::new(),
            targets: Vec::new(),
        },
        settings,
    };

    let outcome = tokio::select! {
        outcome = run_workloads(&mut ctx, args.only) => outcome,
        _ = tokio::signal::ctrl_c() => Err("interrupted".into()),
    };

    // Clean up whatever happened.
    let bench_dbs: Vec<_> = ctx
        .servers
        .iter()
        .map(|s| (s.admin.clone(), db.clone()))
        .collect();
    for (admin, name) in ctx.extra_dbs.iter().chain(&bench_dbs) {
        if let Err(error) = drop_database(admin, name).await {
            eprintln!("could not drop database {name}: {error}");
        }
    }
    drop(found);
    outcome?;

    let total = started.elapsed();
    if args.json {
        ctx.report.print_json(total);
    } else {
        ctx.report.print_targets();
        println!("Total run time: {:.1} s.", total.as_secs_f64());
    }
    Ok(())
}

async fn run_workloads(ctx: &mut Ctx, only: Option<Workload>) -> Res<()> {
    describe_machine(&mut ctx.report);
    for server in &mut ctx.servers {
        let pool = pool(&server.opts, 2).await?;
        pg_semaphore::migrate(&pool).await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE SCHEMA {BASELINE_SCHEMA};
             CREATE TABLE {BASELINE_SCHEMA}.counters (
                 name text PRIMARY KEY,
                 max  integer NOT NULL,
                 used integer NOT NULL DEFAULT 0
             );"
        )))
        .execute(&pool)
        .await?;
        describe_server(&pool, server, &mut ctx.report).await?;
        pool.close().await;
    }
    let settings = &ctx.settings;
    ctx.report.machine.push((
        "settings".into(),
        format!(
            "{} repetitions of {} s per cell after a {} s warm-up{}; tables show the median \
             and (min–max)",
            settings.reps,
            settings.cell.as_secs_f64(),
            settings.warmup.as_secs_f64(),
            if settings.quick { " (--quick)" } else { "" }
        ),
    ));
    ctx.report.machine.push((
        "pools".into(),
        "sqlx defaults except size (test_before_acquire = true: a ping per checkout), \
         the same for every implementation"
            .to_owned(),
    ));
    ctx.report.print_machine();

    for workload in Workload::ALL {
        if only.is_some_and(|only| only != workload) {
            continue;
        }
        // Hours (pressure) or minutes of sleeping (lateness): only when asked
        // for by name.
        if matches!(workload, Workload::Pressure | Workload::Lateness) && only.is_none() {
            continue;
        }
        eprintln!("== {}", workload.name());
        let started = Instant::now();
        match workload {
            Workload::Semaphore => semaphore::semaphore_workload(ctx).await?,
            Workload::Mutex => mutex::mutex_workload(ctx).await?,
            Workload::Wakeup => wakeup::wakeup_workload(ctx).await?,
            Workload::Waiters => waiters::waiters_workload(ctx).await?,
            Workload::Growth => growth::growth_workload(ctx).await?,
            Workload::Rate => rate::rate_workload(ctx).await?,
            Workload::Fleet => fleet::fleet_workload(ctx).await?,
            Workload::Idle => fleet::idle_workload(ctx).await?,
            Workload::Lease => lease::lease_workload(ctx).await?,
            Workload::Redis => redis::redis_workload(ctx).await?,
            Workload::Advisory => advisory::advisory_workload(ctx).await?,
            Workload::Limits => limits::limits_workload(ctx).await?,
            Workload::Family => family::family_workload(ctx).await?,
            Workload::Pressure => pressure::pressure_workload(ctx).await?,
            Workload::Multi => multi::multi_workload(ctx).await?,
            Workload::Lateness => lateness::lateness_workload(ctx).await?,
            Workload::Heartbeat => heartbeat::heartbeat_workload(ctx).await?,
            Workload::Outcomes => outcomes::outcomes_workload(ctx).await?,
        }
        let took = started.elapsed().as_secs_f64();
        eprintln!("== {} took {took:.1} s", workload.name());
        ctx.report.print(&format!(
            "_{} workload: {took:.1} s of wall time._\n",
            workload.name()
        ));
    }
    Ok(())
}

/// The header: the machine, so numbers can be compared.
fn describe_machine(report: &mut Report) {
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    report.machine.push(("nproc".into(), nproc.to_string()));
    report.machine.push((
        "cpu".into(),
        proc_value("/proc/cpuinfo", "model name").unwrap_or_else(|| "unknown".into()),
    ));
    let memory = proc_value("/proc/meminfo", "MemTotal")
        .and_then(|v| kib(&v))
        .map_or_else(|| "unknown".into(), |b| fmt_bytes(b as f64));
    report.machine.push(("memory".into(), memory));
}

/// The header's lines for one server: what it is and how it commits.
async fn describe_server(pool: &PgPool, server: &mut Server, report: &mut Report) -> Res<()> {
    let version: String = sqlx::query_scalar("SELECT version()")
        .fetch_one(pool)
        .await?;
    let settings: String = sqlx::query_scalar(
        "SELECT string_agg(name || '=' || setting || coalesce(unit, ''), ', ' ORDER BY name) \
         FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'full_page_writes', \
         'max_connections', 'shared_buffers', 'autovacuum_naptime')",
    )
    .fetch_one(pool)
    .await?;
    let fsync: String = sqlx::query_scalar("SELECT current_setting('fsync')")
        .fetch_one(pool)
        .await?;
    if server.label == Durability::Durable.label() && fsync != "on" {
        eprintln!(
            "warning: the server labelled durable ({}) has fsync={fsync}",
            server.description
        );
    }
    let label = server.label;
    report
        .machine
        .push((format!("server ({label})"), server.description.clone()));
    report
        .machine
        .push((format!("postgresql ({label})"), version));
    report
        .machine
        .push((format!("settings ({label})"), settings.clone()));
    server.settings = settings;
    Ok(())
}
