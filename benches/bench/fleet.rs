//! Workloads 7 and 8, the fleet and idle listeners: pg-semaphore used by many OS
//! processes at once, each with its own pool and its own LISTEN connection.
//!
//! The workers are this program, re-executed with [`WORKER_FLAG`]. Each
//! builds a pool, then waits once on a semaphore of its own (so whatever
//! listening the crate does is up, as in a process that has waited before),
//! prints `ready`, and obeys commands on stdin, one per line:
//!
//! - `run <warmup ms> <window ms> <salt>`: `clients` tasks loop
//!   `claim().timeout(..).acquire()` + `release` on semaphores picked at random among the
//!   shared ones; answers `result <ops> <elapsed µs> <errors> <p50 µs>
//!   <first error>`;
//! - `probe <seq>`: waits on the probe semaphore (held by the coordinator)
//!   and answers `woke <seq> <unix ns>` when `acquire()` returns;
//! - end of input: exit.
//!
//! An `idle` worker only gets ready and waits for the end of its input.

use std::process::Stdio;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pg_semaphore::{Error, Semaphore};
use serde_json::json;
use sqlx::PgConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

use crate::load::{Outcome, connect, pool, run_load, splitmix64, unique};
use crate::report::{
    Cell, Target, fmt_int, fmt_opt, fmt_p50_spread, fmt_rate_spread, fmt_ratio, markdown_table,
    percentile, throughput_ratios,
};
use crate::wakeup::WAKE_SETTLE;
use crate::{Ctx, POOL_SPARE, Res, Server, Settings, Workload};

/// The first argument that makes this program a fleet worker.
pub const WORKER_FLAG: &str = "--fleet-worker";

/// The fleet: how many processes, and the clients they share between them.
const FLEET_SIZES: [usize; 4] = [1, 10, 50, 100];
const FLEET_CLIENTS: usize = 100;
/// The semaphores the fleet shares, and their capacity.
const FLEET_SEMAPHORES: usize = 100;
const FLEET_CAPACITY: u32 = 4;
/// How long a fleet cycle's acquire may wait.
const FLEET_PATIENCE: Duration = Duration::from_secs(10);
/// Every worker connection carries this application_name, to be counted.
const WORKER_APP: &str = "pgsem-bench-worker";
const PROBE_SEMAPHORE: &str = "bench-fleet-probe";

/// The idle-listeners measurement: processes listening, and the load beside them.
const IDLE_PROCESSES: usize = 50;
const IDLE_CLIENTS: usize = 8;

fn fleet_semaphore(i: u64) -> String {
    format!("bench-fleet-{}", i % FLEET_SEMAPHORES as u64)
}

// ---------------------------------------------------------------------------
// The worker process
// ---------------------------------------------------------------------------

/// A worker's life: `args` = `fleet|idle <url> <clients> <id>`.
pub async fn worker(args: &[String]) -> Res<()> {
    let [mode, url, clients, id] = args else {
        return Err(format!("usage: {WORKER_FLAG} fleet|idle <url> <clients> <id>").into());
    };
    let clients: usize = clients.parse()?;
    let options = PgConnectOptions::from_str(url)?.application_name(WORKER_APP);
    let pool = PgPoolOptions::new()
        .max_connections(clients.max(1) as u32)
        .connect_with(options)
        .await?;

    // Wait once, so that the process listens as one that has waited before.
    let own = Semaphore::builder(format!("bench-worker-{id}"), 1)
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    let held = own.try_acquire().await?;
    let waiter = {
        let own = own.clone();
        tokio::spawn(async move {
            own.acquiring()
                .timeout(FLEET_PATIENCE)
                .acquire()
                .await?
                .release()
                .await
        })
    };
    tokio::time::sleep(WAKE_SETTLE).await;
    held.release().await?;
    waiter.await??;

    // The shared semaphores' handles, built before the measurements start.
    let mut semaphores = Vec::new();
    if mode == "fleet" {
        for i in 0..FLEET_SEMAPHORES as u64 {
            semaphores.push(
                Semaphore::builder(fleet_semaphore(i), FLEET_CAPACITY)
                    .build(&pg_semaphore::Client::new(pool.clone()))
                    .await?,
            );
        }
    }
    let semaphores = Arc::new(semaphores);
    let probe_sem = Semaphore::builder(PROBE_SEMAPHORE, 1)
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;

    let (out, mut lines) = mpsc::unbounded_channel::<String>();
    let writer = tokio::spawn(async move {
        let mut stdout = tokio::io::stdout();
        while let Some(line) = lines.recv().await {
            if stdout.write_all(line.as_bytes()).await.is_err() || stdout.flush().await.is_err() {
                break;
            }
        }
    });
    out.send("ready\n".into())?;

    let mut commands = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = commands.next_line().await? {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["run", warmup, window, salt] if mode == "fleet" => {
                let warmup = Duration::from_millis(warmup.parse()?);
                let window = Duration::from_millis(window.parse()?);
                let salt: u64 = salt.parse()?;
                // In a task of its own: probes arrive while it runs.
                let (semaphores, out) = (semaphores.clone(), out.clone());
                tokio::spawn(async move {
                    let answer = run_cycles(&semaphores, clients, warmup, window, salt)
                        .await
                        .unwrap_or_else(|e| format!("failed run {e}\n"));
                    let _ = out.send(answer);
                });
            }
            ["probe", seq] => {
                let (probe_sem, out, seq) = (probe_sem.clone(), out.clone(), seq.to_string());
                tokio::spawn(async move {
                    let answer = match probe(&probe_sem).await {
                        Ok(nanos) => format!("woke {seq} {nanos}\n"),
                        Err(error) => format!("failed {seq} {error}\n"),
                    };
                    let _ = out.send(answer);
                });
            }
            _ => return Err(format!("worker {id}: unknown command {line:?}").into()),
        }
    }
    drop(out);
    let _ = writer.await;
    pool.close().await;
    Ok(())
}

/// The worker's share of the fleet's load.
async fn run_cycles(
    semaphores: &Arc<Vec<Semaphore>>,
    clients: usize,
    warmup: Duration,
    window: Duration,
    salt: u64,
) -> Res<String> {
    let semaphores = semaphores.clone();
    let load = run_load(clients, warmup, window, move |client, seq| {
        let semaphores = semaphores.clone();
        async move {
            let r = splitmix64(salt ^ ((client as u64) << 40) ^ seq);
            let sem = &semaphores[(r % FLEET_SEMAPHORES as u64) as usize];
            sem.acquiring()
                .timeout(FLEET_PATIENCE)
                .acquire()
                .await?
                .release()
                .await?;
            Ok(Outcome::Done)
        }
    })
    .await?;
    let mut samples = load.samples;
    samples.sort_unstable();
    let error = load
        .first_error
        .map_or_else(|| "-".to_owned(), |e| e.replace(char::is_whitespace, " "));
    Ok(format!(
        "result {} {} {} {} {error}\n",
        samples.len(),
        load.elapsed.as_micros(),
        load.errors,
        percentile(&samples, 50.0).map_or(0, |d| d.as_micros()),
    ))
}

/// Waits for the probe semaphore; the wall-clock time it was granted.
async fn probe(sem: &Semaphore) -> Res<u128> {
    let permit = sem.acquiring().timeout(FLEET_PATIENCE).acquire().await?;
    let woke = unix_nanos();
    permit.release().await?;
    Ok(woke)
}

fn unix_nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

// ---------------------------------------------------------------------------
// The coordinator's side
// ---------------------------------------------------------------------------

/// Running worker processes and their output, line by line.
struct Fleet {
    children: Vec<Child>,
    stdins: Vec<ChildStdin>,
    lines: mpsc::UnboundedReceiver<(usize, String)>,
    /// Lines read while waiting for others.
    pending: Vec<(usize, String)>,
}

impl Fleet {
    /// Starts `n` workers and waits until every one is ready.
    async fn start(server: &Server, mode: &str, n: usize, clients: usize) -> Res<Fleet> {
        let exe = std::env::current_exe()?;
        let (tx, lines) = mpsc::unbounded_channel();
        let mut fleet = Fleet {
            children: Vec::with_capacity(n),
            stdins: Vec::with_capacity(n),
            lines,
            pending: Vec::new(),
        };
        for i in 0..n {
            let mut child = Command::new(&exe)
                .args([
                    WORKER_FLAG,
                    mode,
                    &server.url,
                    &clients.to_string(),
                    &unique("w"),
                ])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()?;
            let stdout = child.stdout.take().ok_or("no worker stdout")?;
            fleet
                .stdins
                .push(child.stdin.take().ok_or("no worker stdin")?);
            fleet.children.push(child);
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if tx.send((i, line)).is_err() {
                        break;
                    }
                }
            });
        }
        for _ in 0..n {
            fleet
                .expect(Duration::from_secs(120), |_, line| line == "ready")
                .await
                .map_err(|e| format!("a {mode} worker did not get ready: {e}"))?;
        }
        Ok(fleet)
    }

    async fn send(&mut self, worker: usize, line: &str) -> Res<()> {
        let stdin = &mut self.stdins[worker];
        stdin.write_all(format!("{line}\n").as_bytes()).await?;
        stdin.flush().await?;
        Ok(())
    }

    /// The next line that `wanted` accepts, within `patience`; a worker's
    /// exit is an error.
    async fn expect(
        &mut self,
        patience: Duration,
        wanted: impl Fn(usize, &str) -> bool,
    ) -> Res<(usize, String)> {
        if let Some(i) = self.pending.iter().position(|(w, l)| wanted(*w, l)) {
            return Ok(self.pending.remove(i));
        }
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Err(_) => return Err("timed out waiting for a worker".into()),
                Ok(None) => return Err("every worker has exited".into()),
                Ok(Some((worker, line))) if wanted(worker, &line) => return Ok((worker, line)),
                Ok(Some(other)) => self.pending.push(other),
            }
        }
    }

    /// Ends every worker: closes their input, then waits (killing stragglers).
    async fn stop(mut self) {
        self.stdins.clear();
        for child in &mut self.children {
            if tokio::time::timeout(Duration::from_secs(10), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }
}

/// Connections on `opts`' database opened by workers.
async fn worker_connections(conn: &mut PgConnection) -> Res<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind(WORKER_APP)
    .fetch_one(conn)
    .await?)
}

/// 1, 10, 50 and 100 processes sharing 100 semaphores with 100 clients in all.
pub async fn fleet_workload(ctx: &mut Ctx) -> Res<()> {
    let s = ctx.settings.clone();
    let mut all = Vec::new();
    for server in &ctx.servers.clone() {
        let mut group = Vec::new();
        for n in FLEET_SIZES {
            group.push(fleet_cell(server, &s, n).await?);
        }
        throughput_ratios(&mut group, "vs_one_process", 0);
        let label = server.label;
        let at_100 = group.last().and_then(|c| c.ratio("vs_one_process"));
        ctx.report.targets.push(Target::at_least(
            Workload::Fleet,
            format!(
                "{label}: cycles/s at {} processes ≥ 0.8x at 1 process ({FLEET_CLIENTS} clients in all)",
                FLEET_SIZES[FLEET_SIZES.len() - 1]
            ),
            at_100,
            0.8,
            fmt_ratio(at_100),
        ));
        let excess = group
            .iter()
            .map(|c| {
                let used = c.extra["connections_max"].as_i64().unwrap_or(i64::MAX);
                let allowed = c.extra["connections_allowed"].as_i64().unwrap_or(0);
                (
                    used - allowed,
                    c.config["processes"].as_u64().unwrap_or(0),
                    used,
                    allowed,
                )
            })
            .max_by_key(|(excess, ..)| *excess);
        if let Some((excess, n, used, allowed)) = excess {
            ctx.report.targets.push(Target::at_most(
                Workload::Fleet,
                format!("{label}: connections used ≤ pool + 1 per process, at every size"),
                Some(excess as f64),
                0.0,
                format!("worst at {n} processes: {used} used, {allowed} allowed"),
            ));
        }
        all.extend(group);
    }

    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.config["server"].as_str().unwrap_or("").to_owned(),
                c.config["processes"].to_string(),
                c.config["clients_per_process"].to_string(),
                fmt_rate_spread(c),
                fmt_ratio(c.ratio("vs_one_process")),
                fmt_int(c.extra["wakeups"].as_u64().unwrap_or(0)),
                fmt_p50_spread(c),
                fmt_opt(c.p99()),
                format!(
                    "{} (≤ {})",
                    c.extra["connections_max"], c.extra["connections_allowed"]
                ),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 7. Fleet: many processes, each with its pool and its LISTEN connection\n\n\
         N worker processes (this program re-executed), {FLEET_CLIENTS} clients in all \
         ({FLEET_CLIENTS}/N each, pool of that size per process), loop claim().timeout(..).acquire() + \
         release on {FLEET_SEMAPHORES} shared semaphores of capacity {FLEET_CAPACITY}, each \
         cycle on one at random. Every worker waited once before the measurement, so it \
         listens as a process that has waited. cycles/s: the sum over the processes, median \
         of {} runs (min–max). Wake-ups: meanwhile the coordinator holds a capacity-1 probe \
         semaphore, a worker (each in turn) waits on it, {} ms later the coordinator releases; \
         latency = the worker's acquire() returning − the release's start (wall clocks of one \
         machine); p50 the median of the runs' p50s. Connections: the most worker connections \
         seen in pg_stat_activity during the runs, against pool + 1 per process.\n",
        s.reps,
        WAKE_SETTLE.as_millis()
    ));
    ctx.report.print(&markdown_table(
        &[
            "server",
            "processes",
            "clients each",
            "cycles/s (min–max)",
            "÷ 1 process",
            "wake-ups",
            "wake-up p50 (min–max)",
            "wake-up p99",
            "connections (allowed)",
            "errors",
        ],
        &rows,
    ));
    ctx.report.add_cells(all);
    Ok(())
}

/// `n` processes, `reps` runs: one cell.
async fn fleet_cell(server: &Server, s: &Settings, n: usize) -> Res<Cell> {
    let per = (FLEET_CLIENTS / n).max(1);
    let config = json!({
        "server": server.label,
        "processes": n,
        "clients_per_process": per,
        "semaphores": FLEET_SEMAPHORES,
        "capacity": FLEET_CAPACITY,
    });
    eprintln!("  fleet [{}]: starting {n} worker processes", server.label);
    let started = Instant::now();
    let mut fleet = Fleet::start(server, "fleet", n, per).await?;
    eprintln!(
        "  fleet [{}]: {n} workers ready after {:.1} s",
        server.label,
        started.elapsed().as_secs_f64()
    );
    let holder_pool = pool(&server.opts, 2).await?;
    let probe_sem = Semaphore::builder(PROBE_SEMAPHORE, 1)
        .build(&pg_semaphore::Client::new(holder_pool.clone()))
        .await?;
    let mut monitor = connect(&server.opts).await?;
    let mut reps = Vec::new();
    let mut connections_max = worker_connections(&mut monitor).await?;
    let mut probe_seq = 0u64;
    for rep in 0..s.reps {
        let salt = splitmix64((n as u64) << 8 | rep as u64);
        for worker in 0..n {
            let line = format!(
                "run {} {} {}",
                s.warmup.as_millis(),
                s.fleet_window.as_millis(),
                salt ^ worker as u64
            );
            fleet.send(worker, &line).await?;
        }
        let from = Instant::now() + s.warmup;
        let until = from + s.fleet_window;
        let mut wakeups = Vec::new();
        let mut probe_errors = 0u64;
        let mut probes = 0;
        while Instant::now() + WAKE_SETTLE * 2 < until {
            probes += 1;
            let worker = (probe_seq % n as u64) as usize;
            let seq = probe_seq;
            probe_seq += 1;
            let measured = Instant::now() >= from;
            let held = probe_sem
                .acquiring()
                .timeout(FLEET_PATIENCE)
                .acquire()
                .await?;
            fleet.send(worker, &format!("probe {seq}")).await?;
            tokio::time::sleep(WAKE_SETTLE).await;
            let t0 = unix_nanos();
            held.release().await?;
            let seq_word = seq.to_string();
            let (_, line) = fleet
                .expect(FLEET_PATIENCE, |w, l| {
                    let mut words = l.split_whitespace();
                    w == worker
                        && matches!(words.next(), Some("woke" | "failed"))
                        && words.next() == Some(seq_word.as_str())
                })
                .await?;
            let woke: Option<u128> = line
                .strip_prefix("woke ")
                .and_then(|rest| rest.split_whitespace().nth(1)?.parse().ok());
            match woke {
                Some(woke) if measured && woke >= t0 => {
                    wakeups.push(Duration::from_nanos((woke - t0) as u64));
                }
                Some(_) if measured => probe_errors += 1,
                Some(_) => {}
                None => {
                    eprintln!("  fleet probe failed: {line}");
                    probe_errors += u64::from(measured);
                }
            }
            connections_max = connections_max.max(worker_connections(&mut monitor).await?);
        }
        eprintln!(
            "  fleet [{}] {n} processes, run {rep}: {probes} probes, {} measured",
            server.label,
            wakeups.len()
        );
        // Every worker's result.
        let mut ops = 0u64;
        let mut rate = 0.0;
        let mut errors = probe_errors;
        let mut cycle_p50s = Vec::new();
        for _ in 0..n {
            let (worker, line) = fleet
                .expect(s.fleet_window + FLEET_PATIENCE * 3, |_, l| {
                    l.starts_with("result ") || l.starts_with("failed run")
                })
                .await?;
            if line.starts_with("failed run") {
                return Err(format!("fleet worker {worker}: {line}").into());
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [_, w_ops, w_elapsed, w_errors, w_p50, error @ ..] = fields.as_slice() else {
                return Err(format!("worker {worker}: bad result {line:?}").into());
            };
            let w_ops: u64 = w_ops.parse()?;
            let w_elapsed: f64 = w_elapsed.parse::<f64>()? / 1e6;
            ops += w_ops;
            if w_elapsed > 0.0 {
                rate += w_ops as f64 / w_elapsed;
            }
            errors += w_errors.parse::<u64>()?;
            cycle_p50s.push(Duration::from_micros(w_p50.parse()?));
            if error.first().is_some_and(|e| *e != "-") {
                eprintln!("  fleet worker {worker}: {}", error.join(" "));
            }
        }
        let mut cell = Cell::from_samples(Workload::Fleet, "ours", config.clone(), wakeups);
        cell.ops = ops;
        cell.errors = errors;
        // Elapsed such that ops / elapsed is the sum of the workers' rates.
        cell.elapsed = (rate > 0.0).then(|| Duration::from_secs_f64(ops as f64 / rate));
        cycle_p50s.sort_unstable();
        cell.extra.insert(
            "cycle_p50_us_median_worker".into(),
            json!(percentile(&cycle_p50s, 50.0).map(|d| d.as_micros() as u64)),
        );
        // The probe latencies are the cell's samples; its ops are the cycles.
        let wakeup_count = cell.samples.len();
        cell.extra.insert("wakeups".into(), json!(wakeup_count));
        reps.push(cell);
    }
    fleet.stop().await;
    drop(probe_sem);
    holder_pool.close().await;
    // Each repetition: throughput from the cycles, p50 from the wake-ups.
    let mut cell = Cell::from_reps(reps, &["wakeups"]);
    let pool_size = (per as u32).max(1);
    let allowed = n as i64 * (i64::from(pool_size) + 1);
    cell.extra
        .insert("connections_max".into(), json!(connections_max));
    cell.extra
        .insert("connections_allowed".into(), json!(allowed));
    eprintln!(
        "{} ; connections {connections_max} (allowed {allowed})",
        cell.progress()
    );
    Ok(cell)
}

/// try_acquire + release at 8 clients with 50 idle processes listening,
/// against none, interleaved.
pub async fn idle_workload(ctx: &mut Ctx) -> Res<()> {
    let s = ctx.settings.clone();
    let mut all = Vec::new();
    for server in &ctx.servers.clone() {
        let mut none = Vec::new();
        let mut with = Vec::new();
        let mut listening = (0, 0);
        for _ in 0..s.reps {
            none.push(idle_cell(server, &s, 0).await?);
            let fleet = Fleet::start(server, "idle", IDLE_PROCESSES, 1).await?;
            let mut monitor = connect(&server.opts).await?;
            listening.0 = worker_connections(&mut monitor).await?;
            with.push(idle_cell(server, &s, IDLE_PROCESSES).await?);
            listening.1 = worker_connections(&mut monitor).await?;
            fleet.stop().await;
        }
        let mut group = vec![Cell::from_reps(none, &[]), Cell::from_reps(with, &[])];
        throughput_ratios(&mut group, "vs_no_listeners", 0);
        group[1].extra.insert(
            "worker_connections".into(),
            json!({ "before": listening.0, "after": listening.1 }),
        );
        let ratio = group[1].ratio("vs_no_listeners");
        ctx.report.targets.push(Target::at_least(
            Workload::Idle,
            format!(
                "{}: {IDLE_CLIENTS} clients with {IDLE_PROCESSES} idle listening processes ≥ 0.9x \
                 without",
                server.label
            ),
            ratio,
            0.9,
            fmt_ratio(ratio),
        ));
        all.extend(group);
    }
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.implementation.clone(),
                c.config["server"].as_str().unwrap_or("").to_owned(),
                fmt_rate_spread(c),
                fmt_opt(c.p50()),
                fmt_opt(c.p99()),
                fmt_ratio(c.ratio("vs_no_listeners")),
                c.extra.get("worker_connections").map_or_else(
                    || "–".into(),
                    |v| format!("{} / {}", v["before"], v["after"]),
                ),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 8. Idle listeners\n\n\
         {IDLE_CLIENTS} clients in this process loop try_acquire + release over \
         {FLEET_SEMAPHORES} semaphores of capacity {FLEET_CAPACITY} (a random one each cycle), \
         without and with {IDLE_PROCESSES} other processes that have each waited once (so they \
         listen) and now only sit there. cycles/s: median of {} runs (min–max), the two \
         interleaved. Worker connections: counted in pg_stat_activity before and after the \
         measurement with listeners (pool + LISTEN connection per process).\n",
        s.reps
    ));
    ctx.report.print(&markdown_table(
        &[
            "measurement",
            "server",
            "cycles/s (min–max)",
            "p50 cycle",
            "p99 cycle",
            "÷ none",
            "worker connections before / after",
            "errors",
        ],
        &rows,
    ));
    ctx.report.add_cells(all);
    Ok(())
}

async fn idle_cell(server: &Server, s: &Settings, listeners: usize) -> Res<Cell> {
    let pool = pool(&server.opts, IDLE_CLIENTS as u32 + POOL_SPARE).await?;
    let mut semaphores = Vec::with_capacity(FLEET_SEMAPHORES);
    for i in 0..FLEET_SEMAPHORES as u64 {
        semaphores.push(
            Semaphore::builder(format!("bench-idle-{i}"), FLEET_CAPACITY)
                .build(&pg_semaphore::Client::new(pool.clone()))
                .await?,
        );
    }
    let semaphores = Arc::new(semaphores);
    let salt = splitmix64(listeners as u64 ^ 0x1D1E);
    let load = run_load(IDLE_CLIENTS, s.warmup, s.cell, move |client, seq| {
        let semaphores = semaphores.clone();
        async move {
            let r = splitmix64(salt ^ ((client as u64) << 40) ^ seq);
            match semaphores[(r % FLEET_SEMAPHORES as u64) as usize]
                .try_acquire()
                .await
            {
                Ok(permit) => {
                    permit.release().await?;
                    Ok(Outcome::Done)
                }
                Err(Error::NoSlotsAvailable { .. }) => Ok(Outcome::Refused),
                Err(error) => Err(error.into()),
            }
        }
    })
    .await?;
    pool.close().await;
    let label = if listeners == 0 {
        "ours, no other processes".to_owned()
    } else {
        format!("ours, {listeners} idle processes listening")
    };
    let config = json!({
        "server": server.label,
        "clients": IDLE_CLIENTS,
        "listening_processes": listeners,
    });
    let cell = Cell::from_load(Workload::Idle, label, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}
