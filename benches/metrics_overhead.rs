//! What the `metrics` feature costs: fail-fast semaphore cycles
//! (`try_acquire` + `release`) and mutex cycles (`lock` + `commit`) against a
//! real PostgreSQL, with no recorder and with a `metrics-exporter-prometheus`
//! recorder, interleaved in one run; and the recording calls of one cycle on
//! their own, in a tight loop.
//!
//! ```text
//! cargo bench --bench metrics_overhead --features metrics
//! cargo bench --bench metrics_overhead --features metrics -- --cycles 5000
//! ```
//!
//! A build without the feature cannot run in the same binary (the calls are
//! compiled out), so the baseline is measured from the other side: the
//! recording calls a cycle makes, timed alone with and without a recorder,
//! next to the cycle's latency. Without the feature a cycle costs its
//! latency minus those calls.
//!
//! Each configuration runs 3 times. Within a repetition the two
//! configurations take turns in blocks of 50 cycles (alternating which goes
//! first), so that the machine's drift (other processes, the server's own
//! housekeeping) weighs on both alike. The tables give every repetition, the
//! median and the spread (max - min). The Prometheus recorder is installed for the thread (`with_local_recorder`)
//! around a current-thread runtime, so the crate's spawned tasks record into
//! it too; the run checks that it counted every cycle.
//!
//! It finds or starts PostgreSQL exactly as the tests do (the testkit:
//! `DATABASE_URL`, else a throwaway server from the local binaries), in a
//! database of its own, dropped at the end.

use std::hint::black_box;
use std::time::{Duration, Instant};

use metrics::{SharedString, counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use pg_semaphore::{Mutex, Semaphore};
use sqlx::PgPool;
use tokio::runtime::Runtime;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const REPETITIONS: usize = 3;
const WARM_UP: usize = 200;
/// Cycles a configuration runs before the other takes its turn.
const BLOCK: usize = 50;
/// Iterations of the recording calls' loop, per repetition.
const CALL_LOOPS: u32 = 1_000_000;
const SEMAPHORE: &str = "bench-metrics";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Config {
    NoRecorder,
    Prometheus,
}

impl Config {
    fn label(self) -> &'static str {
        match self {
            Config::NoRecorder => "feature on, no recorder",
            Config::Prometheus => "feature on, Prometheus recorder",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    Semaphore,
    Mutex,
}

impl Workload {
    fn label(self) -> &'static str {
        match self {
            Workload::Semaphore => "try_acquire + release",
            Workload::Mutex => "lock + commit",
        }
    }
}

fn main() -> Res<()> {
    let cycles = cycles_argument()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let db = runtime.block_on(testkit::empty_db_with(4));
    eprintln!("PostgreSQL: {}", testkit::server::server().description);
    let result = run(&runtime, &db.pool, cycles);
    runtime.block_on(db.pool.close());
    result
}

fn run(runtime: &Runtime, pool: &PgPool, cycles: usize) -> Res<()> {
    let client = pg_semaphore::Client::new(pool.clone());
    let sem = runtime.block_on(async {
        pg_semaphore::migrate(pool).await?;
        Res::Ok(Semaphore::builder(SEMAPHORE, 1).build(&client).await?)
    })?;
    let mutex = Mutex::new(SEMAPHORE);
    let recorder = PrometheusBuilder::new()
        .set_buckets(&[0.001, 0.01, 0.1, 1.0])?
        .build_recorder();

    // Cycles: [workload][config] -> microseconds per cycle, one per repetition.
    let mut latency = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
    let workloads = [Workload::Semaphore, Workload::Mutex];
    for config in [Config::NoRecorder, Config::Prometheus] {
        for workload in workloads {
            in_config(config, &recorder, || {
                runtime.block_on(cycle(workload, &client, &sem, &mutex, WARM_UP))
            })?;
        }
    }
    let blocks = cycles.div_ceil(BLOCK);
    let cycles = blocks * BLOCK;
    for repetition in 0..REPETITIONS {
        for (w, workload) in workloads.into_iter().enumerate() {
            eprintln!("repetition {}: {}", repetition + 1, workload.label());
            let mut took = [Duration::ZERO; 2];
            for block in 0..blocks {
                let mut order = [Config::NoRecorder, Config::Prometheus];
                if block % 2 == 1 {
                    order.reverse();
                }
                for config in order {
                    took[config as usize] += in_config(config, &recorder, || {
                        runtime.block_on(cycle(workload, &client, &sem, &mutex, BLOCK))
                    })?;
                }
            }
            for config in [Config::NoRecorder, Config::Prometheus] {
                latency[w][config as usize].push(micros(took[config as usize]) / cycles as f64);
            }
        }
    }

    // The recorder saw every cycle run under it (spawned tasks included).
    let expected = WARM_UP + REPETITIONS * cycles;
    let rendered = recorder.handle().render();
    let acquisitions =
        format!("pg_semaphore_acquisitions_total{{semaphore=\"{SEMAPHORE}\"}} {expected}");
    let waits = format!(
        "pg_semaphore_mutex_wait_seconds_count{{mutex=\"mutex \\\"{SEMAPHORE}\\\"\"}} {expected}"
    );
    for line in [acquisitions, waits] {
        if !rendered.lines().any(|l| l == line) {
            return Err(
                format!("the recorder missed cycles: no line {line:?} in\n{rendered}").into(),
            );
        }
    }

    // The recording calls of one cycle, alone: [workload][config] -> ns.
    let mut calls = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
    let label = SharedString::from(std::sync::Arc::<str>::from("bench-calls"));
    let mutex_label = SharedString::from(std::sync::Arc::<str>::from("mutex \"bench-calls\""));
    for _ in 0..REPETITIONS {
        for config in [Config::NoRecorder, Config::Prometheus] {
            let took = in_config(config, &recorder, || {
                time_loop(|| semaphore_cycle_calls(&label))
            })?;
            calls[0][config as usize].push(took);
            let took = in_config(config, &recorder, || {
                time_loop(|| mutex_cycle_calls(&mutex_label))
            })?;
            calls[1][config as usize].push(took);
        }
    }

    println!("## Overhead of the `metrics` feature\n");
    println!(
        "{cycles} cycles per configuration and repetition, one task, the configurations taking \
         turns every {BLOCK} cycles; {REPETITIONS} repetitions; {CALL_LOOPS} iterations per \
         repetition of the recording calls.\n"
    );
    println!("### Cycle latency (µs per cycle)\n");
    println!("| workload | configuration | repetitions | median | spread |");
    println!("|---|---|---|---|---|");
    for (w, workload) in workloads.into_iter().enumerate() {
        for config in [Config::NoRecorder, Config::Prometheus] {
            let values = &latency[w][config as usize];
            println!(
                "| {} | {} | {} | {:.1} | {:.1} |",
                workload.label(),
                config.label(),
                list(values, 1),
                median(values),
                spread(values)
            );
        }
    }
    println!("\n### The recording calls of one cycle, alone (ns per cycle)\n");
    println!("| workload | calls | configuration | repetitions | median | spread |");
    println!("|---|---|---|---|---|---|");
    for (w, workload) in workloads.into_iter().enumerate() {
        let what = match workload {
            Workload::Semaphore => "counter + 2 gauge + histogram",
            Workload::Mutex => "histogram",
        };
        for config in [Config::NoRecorder, Config::Prometheus] {
            let values = &calls[w][config as usize];
            println!(
                "| {} | {what} | {} | {} | {:.0} | {:.0} |",
                workload.label(),
                config.label(),
                list(values, 0),
                median(values),
                spread(values)
            );
        }
    }
    println!("\n### Summary\n");
    println!(
        "| workload | baseline without the feature (est.) | no recorder | Prometheus recorder | \
         Prometheus - none, per repetition | recording cost, no recorder | recording cost, \
         Prometheus |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (w, workload) in workloads.into_iter().enumerate() {
        let cycle_none = median(&latency[w][0]);
        let cycle_prometheus = median(&latency[w][1]);
        let cost_none = median(&calls[w][0]) / 1000.0;
        let cost_prometheus = median(&calls[w][1]) / 1000.0;
        let paired: Vec<String> = latency[w][0]
            .iter()
            .zip(&latency[w][1])
            .map(|(none, prometheus)| format!("{:+.1} µs", prometheus - none))
            .collect();
        println!(
            "| {} | {:.1} µs | {:.1} µs | {:.1} µs | {} | {:.3} µs ({:.3} %) | {:.3} µs ({:.3} %) |",
            workload.label(),
            cycle_none - cost_none,
            cycle_none,
            cycle_prometheus,
            paired.join(" / "),
            cost_none,
            100.0 * cost_none / cycle_none,
            cost_prometheus,
            100.0 * cost_prometheus / cycle_prometheus,
        );
    }
    Ok(())
}

/// Runs `f` with the Prometheus recorder installed for this thread, or with
/// none at all.
fn in_config<T>(config: Config, recorder: &PrometheusRecorder, f: impl FnOnce() -> T) -> T {
    match config {
        Config::NoRecorder => f(),
        Config::Prometheus => metrics::with_local_recorder(recorder, f),
    }
}

/// `n` cycles of `workload`, one after the other; how long they took.
async fn cycle(
    workload: Workload,
    client: &pg_semaphore::Client,
    sem: &Semaphore,
    mutex: &Mutex,
    n: usize,
) -> Res<Duration> {
    let started = Instant::now();
    for _ in 0..n {
        match workload {
            Workload::Semaphore => sem.try_acquire().await?.release().await?,
            Workload::Mutex => mutex.lock(client).await?.commit().await?,
        }
    }
    Ok(started.elapsed())
}

/// What one semaphore cycle records (src/metrics.rs): the acquisition and
/// the held gauge when the permit is made, the gauge and the hold time when
/// it is released.
fn semaphore_cycle_calls(semaphore: &SharedString) {
    counter!("pg_semaphore_acquisitions_total", "semaphore" => semaphore.clone()).increment(1);
    gauge!("pg_semaphore_permits_held", "semaphore" => semaphore.clone()).increment(1.0);
    let held = (semaphore.clone(), Instant::now());
    gauge!("pg_semaphore_permits_held", "semaphore" => held.0.clone()).decrement(1.0);
    histogram!("pg_semaphore_hold_seconds", "semaphore" => held.0.clone()).record(held.1.elapsed());
}

/// What one mutex cycle records: the wait time of the granted lock.
fn mutex_cycle_calls(mutex: &SharedString) {
    histogram!("pg_semaphore_mutex_wait_seconds", "mutex" => mutex.clone())
        .record(black_box(Duration::from_micros(250)));
}

/// Nanoseconds per call of `f`, over [`CALL_LOOPS`] calls.
fn time_loop(f: impl Fn()) -> Res<f64> {
    let started = Instant::now();
    for _ in 0..CALL_LOOPS {
        f();
        black_box(());
    }
    Ok(started.elapsed().as_nanos() as f64 / f64::from(CALL_LOOPS))
}

fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

fn spread(values: &[f64]) -> f64 {
    let max = values.iter().copied().fold(f64::MIN, f64::max);
    let min = values.iter().copied().fold(f64::MAX, f64::min);
    max - min
}

fn list(values: &[f64], decimals: usize) -> String {
    values
        .iter()
        .map(|v| format!("{v:.decimals$}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

fn cycles_argument() -> Res<usize> {
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--cycles" {
            let value = args.next().ok_or("--cycles needs a number")?;
            return Ok(value.parse()?);
        }
    }
    Ok(2_000)
}
