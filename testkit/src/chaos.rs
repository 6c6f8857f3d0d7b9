//! The scaffolding of the tests that are programs (pg-semaphore's
//! `tests/torture/` and `tests/failover/`): worker processes hammer the
//! database and log what they were told, a driver brings the chaos (kills,
//! crashes, failovers) and logs what it did, and a checker reads the logs
//! afterwards. None of it knows pg-semaphore.
//!
//! - **The processes.** A worker is the test binary itself, run again for
//!   one test, its *entry point*: a `#[test]` that returns at once in a
//!   normal run, and runs the worker when [`WorkerArgs::from_env`] finds the
//!   driver's environment variables (`<PREFIX>_URL`, `_LOG`, `_LABEL`,
//!   `_STOP`). [`Workers`] is the driver's side: it spawns them, SIGKILLs
//!   one, and stops them all by writing the stop file, which each worker
//!   waits for in [`WorkerArgs::run_until_stopped`].
//! - **The logs.** Every event is a line, stamped with [`now_us`], the clock
//!   the workers and the driver share (they run on one host). [`Log`]
//!   appends; [`worker_logs`] and [`Fields`] read back.
//! - **The rest.** [`Rng`]: chaos without a dependency; [`until_ok`]: retry
//!   what the chaos may break; [`max_open_at_once`]: the sweep behind every
//!   "never more than N at once" check.

use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::task::JoinSet;

/// Microseconds since the epoch: the workers' and the driver's shared clock.
pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// A small xorshift generator: no extra dependency, good enough for chaos.
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded from the clock, the process id and `salt` (one
    /// per task), so that no two tasks draw the same numbers.
    pub fn seeded(salt: u64) -> Rng {
        Rng((now_us() as u64
            ^ (u64::from(std::process::id()) << 32)
            ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            | 1)
    }

    /// The next number.
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// A log: one line per event, appended.
#[derive(Debug, Clone)]
pub struct Log(Arc<std::sync::Mutex<std::fs::File>>);

impl Log {
    /// Opens (creates) the log at `path` for appending.
    ///
    /// # Errors
    ///
    /// When the file cannot be opened.
    pub fn open(path: &Path) -> std::io::Result<Log> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Log(Arc::new(std::sync::Mutex::new(file))))
    }

    /// Appends `line`.
    pub fn line(&self, line: String) {
        // One write per line on an O_APPEND file: a SIGKILL loses at most the line in flight.
        let mut file = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = file.write_all(format!("{line}\n").as_bytes());
    }
}

/// An error on one line of a log.
pub fn one_line(error: &dyn std::fmt::Display) -> String {
    error.to_string().replace('\n', " ")
}

/// The largest number of intervals `[start, end)` open at once.
pub fn max_open_at_once(intervals: impl IntoIterator<Item = (i64, i64)>) -> usize {
    // Ends sort before starts at the same instant: a hand-over is not an overlap.
    let mut events: Vec<(i64, i32)> = Vec::new();
    for (start, end) in intervals {
        events.push((start, 1));
        events.push((end, -1));
    }
    events.sort();
    let (mut open, mut max) = (0i64, 0i64);
    for (_, delta) in events {
        open += i64::from(delta);
        max = max.max(open);
    }
    max as usize
}

/// Runs `attempt` until it succeeds, every 200 ms, and gives each failure
/// to `failed` (to log it): for what the chaos may break, such as
/// connecting while the server restarts.
pub async fn until_ok<T, E, Fut>(mut attempt: impl FnMut() -> Fut, mut failed: impl FnMut(E)) -> T
where
    Fut: Future<Output = Result<T, E>>,
{
    loop {
        match attempt().await {
            Ok(value) => return value,
            Err(error) => {
                failed(error);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// A new directory for a run's logs, `pgsem-<name>-<pid>-<µs>` in the
/// temporary directory.
///
/// # Errors
///
/// When it cannot be created.
pub fn log_dir(name: &str) -> std::io::Result<PathBuf> {
    let dir =
        std::env::temp_dir().join(format!("pgsem-{name}-{}-{}", std::process::id(), now_us()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The workers' logs in `dir` (every `*.log`, in no particular order):
/// each one's worker (the file's stem, the worker's label) and its text.
///
/// # Errors
///
/// When the directory or a log cannot be read.
pub fn worker_logs(dir: &Path) -> std::io::Result<Vec<(String, String)>> {
    let mut logs = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "log") {
            continue;
        }
        let worker = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        logs.push((worker, std::fs::read_to_string(&path)?));
    }
    Ok(logs)
}

/// One line of a log, split at its spaces: the event's letter first, then
/// its fields.
#[derive(Debug)]
pub struct Fields<'a>(Vec<&'a str>);

impl<'a> Fields<'a> {
    /// Splits `line`.
    pub fn of(line: &'a str) -> Fields<'a> {
        Fields(line.split(' ').collect())
    }

    /// The first field: which event.
    pub fn kind(&self) -> &'a str {
        self.0[0]
    }

    /// Field `i`, if the line has it.
    pub fn get(&self, i: usize) -> Option<&'a str> {
        self.0.get(i).copied()
    }

    /// Field `i` as a number, if the line has it and it is one.
    pub fn int(&self, i: usize) -> Option<i64> {
        self.get(i).and_then(|f| f.parse().ok())
    }

    /// The fields from `i` on, joined again (a message, a reason).
    pub fn rest(&self, i: usize) -> String {
        self.0.get(i..).unwrap_or_default().join(" ")
    }
}

/// What the driver gives a worker process, in environment variables named
/// after a prefix (`<PREFIX>_URL`, `_LOG`, `_LABEL`, `_STOP`).
#[derive(Debug, Clone)]
pub struct WorkerArgs {
    /// The database's URL.
    pub url: String,
    /// The worker's log.
    pub log: PathBuf,
    /// The worker's label (`w1`, `w2`, ...): its holder name, its
    /// connections' application name, its log's stem.
    pub label: String,
    /// The file whose appearance tells the worker to stop.
    pub stop: PathBuf,
}

impl WorkerArgs {
    /// What the driver gave this process; `None` when it is not a worker
    /// (a normal test run).
    pub fn from_env(prefix: &str) -> Option<WorkerArgs> {
        let var = |name: &str| std::env::var(format!("{prefix}_{name}")).ok();
        Some(WorkerArgs {
            url: var("URL")?,
            log: var("LOG")?.into(),
            label: var("LABEL")?,
            stop: var("STOP")?.into(),
        })
    }

    /// A worker entry point's body: if this process is a worker (see
    /// [`from_env`](Self::from_env)), runs `worker` on a runtime of two
    /// threads, as a worker process of its own; else does nothing.
    ///
    /// # Panics
    ///
    /// When the runtime cannot be built.
    pub fn run<F>(prefix: &str, worker: impl FnOnce(WorkerArgs) -> F)
    where
        F: Future<Output = ()>,
    {
        let Some(args) = WorkerArgs::from_env(prefix) else {
            return; // Not a worker: nothing to do in a normal test run.
        };
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(worker(args));
    }

    /// A worker's end: waits until the driver writes the stop file, then
    /// raises `stopping` and waits for `tasks` to finish (each finishes
    /// the round it is in, and releases what it holds).
    pub async fn run_until_stopped(&self, stopping: &AtomicBool, mut tasks: JoinSet<()>) {
        while !self.stop.exists() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stopping.store(true, Ordering::SeqCst);
        while tasks.join_next().await.is_some() {}
    }
}

/// The driver's worker processes: this test binary run again for its
/// worker entry point; see the [module docs](self). Workers still running
/// when this is dropped are killed.
#[derive(Debug)]
pub struct Workers {
    entry_point: &'static str,
    prefix: &'static str,
    url: String,
    dir: PathBuf,
    stop: PathBuf,
    spawned: u64,
    running: Vec<Worker>,
}

#[derive(Debug)]
struct Worker {
    label: String,
    child: Child,
}

impl Workers {
    /// Workers that run the test `entry_point` of this binary, given `url`
    /// and environment variables named after `prefix` (see [`WorkerArgs`]),
    /// with their logs (`<label>.log`) and the stop file in `dir`. None is
    /// started yet.
    pub fn new(
        entry_point: &'static str,
        prefix: &'static str,
        url: String,
        dir: &Path,
    ) -> Workers {
        Workers {
            entry_point,
            prefix,
            url,
            dir: dir.to_owned(),
            stop: dir.join("stop"),
            spawned: 0,
            running: Vec::new(),
        }
    }

    /// Starts one more worker, labelled `w<n>` (`n` counts from 1); its label.
    ///
    /// # Errors
    ///
    /// When the process cannot be started.
    pub fn spawn(&mut self) -> std::io::Result<String> {
        self.spawned += 1;
        let label = format!("w{}", self.spawned);
        let var = |name: &str| format!("{}_{name}", self.prefix);
        let child = Command::new(std::env::current_exe()?)
            .args([
                self.entry_point,
                "--exact",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(var("URL"), &self.url)
            .env(var("LOG"), self.dir.join(format!("{label}.log")))
            .env(var("LABEL"), &label)
            .env(var("STOP"), &self.stop)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.running.push(Worker {
            label: label.clone(),
            child,
        });
        Ok(label)
    }

    /// How many workers were started in all.
    pub fn spawned(&self) -> u64 {
        self.spawned
    }

    /// The labels of the workers running.
    pub fn labels(&self) -> impl Iterator<Item = &str> {
        self.running.iter().map(|w| w.label.as_str())
    }

    /// SIGKILLs a random worker, waits for it to die, and starts another in
    /// its place; returns the victim's label and when it was killed
    /// ([`now_us`], stamped just before the signal: the process may die at
    /// once).
    ///
    /// # Errors
    ///
    /// When no worker runs, or the signal cannot be sent, or the new worker
    /// cannot be started.
    pub fn kill_one(&mut self, rng: &mut Rng) -> std::io::Result<(String, i64)> {
        if self.running.is_empty() {
            return Err(std::io::Error::other("no worker to kill"));
        }
        let mut victim = self
            .running
            .swap_remove(rng.below(self.running.len() as u64) as usize);
        let at = now_us();
        victim.child.kill()?; // SIGKILL
        let _ = victim.child.wait();
        self.spawn()?;
        Ok((victim.label, at))
    }

    /// Writes the stop file and waits for every worker to exit, for
    /// `within` at most.
    ///
    /// # Errors
    ///
    /// When the stop file cannot be written or a worker's status read.
    ///
    /// # Panics
    ///
    /// When a worker failed, or did not stop in time (a task hung). The
    /// workers still running are then killed, as on drop.
    pub async fn stop(&mut self, within: Duration) -> std::io::Result<()> {
        std::fs::write(&self.stop, b"stop")?;
        let deadline = tokio::time::Instant::now() + within;
        // A worker leaves `running` only once it has exited: on a panic,
        // Drop kills those still there.
        while let Some(worker) = self.running.first_mut() {
            if let Some(status) = worker.child.try_wait()? {
                let worker = self.running.remove(0);
                assert!(status.success(), "worker {} failed: {status}", worker.label);
                continue;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "worker {} did not stop: a task hung",
                worker.label
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // A driver that failed halfway: its workers would run until killed.
        for worker in &mut self.running {
            let _ = worker.child.kill();
            let _ = worker.child.wait();
        }
    }
}
