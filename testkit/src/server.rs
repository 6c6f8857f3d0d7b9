//! Finds or starts the PostgreSQL server that tests, examples and benchmarks use.
//!
//! In order:
//! 1. `DATABASE_URL` (from the environment, or from a `.env` file);
//! 2. a throwaway server started from the locally installed PostgreSQL binaries
//!    (`initdb`, `pg_ctl`) in a temporary directory on a free port, run as the
//!    `postgres` OS user when this process is root (initdb refuses root), and
//!    stopped and deleted by a watchdog when this process exits;
//! 3. a `postgres:15` container via testcontainers, when Docker is reachable.
//!
//! That server is [`server()`], one per process. The benchmarks also start
//! throwaway servers of their own with [`start_throwaway`], one per
//! [`Durability`]: a server without fsync is the fastest, a durable one is what
//! users run.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::sync::OnceLock;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;

/// A PostgreSQL server to use.
#[derive(Debug)]
pub struct Server {
    /// Options for the server's default database (`DATABASE_URL`'s, or `postgres`).
    pub options: PgConnectOptions,
    /// What kind of server this is, for messages.
    pub description: String,
    /// Whether the server is ours to throw away (so tests need not clean up).
    pub throwaway: bool,
    /// How to restart it, when it is a local throwaway server we started.
    control: Option<Control>,
    /// `DATABASE_URL`, when the server is that one.
    url: Option<String>,
}

/// How a throwaway server commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// `fsync=off`, `synchronous_commit=off`, `full_page_writes=off`: nothing
    /// waits for the disk. What tests use: fast, and a crash loses only the
    /// throwaway data.
    FsyncOff,
    /// `fsync=on`, `synchronous_commit=on`, `full_page_writes=on`: every commit
    /// waits for its WAL flush, as on a production server.
    Durable,
}

impl Durability {
    /// The server settings, as `-c name=value` options.
    fn options(self) -> &'static str {
        match self {
            Durability::FsyncOff => {
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            }
            Durability::Durable => "-c fsync=on -c synchronous_commit=on -c full_page_writes=on",
        }
    }

    /// `fsync off` or `durable`, for messages.
    pub fn label(self) -> &'static str {
        match self {
            Durability::FsyncOff => "fsync off",
            Durability::Durable => "durable",
        }
    }
}

/// What restarting a local server takes.
#[derive(Debug)]
struct Control {
    user: Option<&'static str>,
    pg_ctl: PathBuf,
    data: String,
    log: String,
    /// The server's command-line options (port, socket directory, settings).
    options: String,
}

impl Server {
    /// Whether [`crash_and_restart`](Self::crash_and_restart) is possible:
    /// the server is a local one this process started.
    pub fn can_restart(&self) -> bool {
        self.control.is_some()
    }

    /// Crashes the server (`pg_ctl stop -m immediate`: every backend killed,
    /// no checkpoint, crash recovery at start), leaves it down for `down_for`,
    /// and starts it again on the same port, waiting until it accepts
    /// connections.
    pub fn crash_and_restart(&self, down_for: Duration) -> Result<(), String> {
        let control = self
            .control
            .as_ref()
            .ok_or("only a local throwaway server can be restarted")?;
        let pg_ctl = |args: &[&str]| {
            let mut all = vec!["-D", &control.data, "-w", "-t", "60"];
            all.extend_from_slice(args);
            run(control.user, &control.pg_ctl, &all)
        };
        pg_ctl(&["-m", "immediate", "stop"])?;
        std::thread::sleep(down_for);
        pg_ctl(&["-l", &control.log, "-o", &control.options, "start"])
    }
}

static SERVER: OnceLock<Server> = OnceLock::new();

/// The server for this process, found or started on first use.
///
/// # Panics
///
/// When no server can be found or started: the message says what to install or set.
pub fn server() -> &'static Server {
    SERVER.get_or_init(|| match find_or_start() {
        Ok(server) => server,
        Err(error) => panic!(
            "no PostgreSQL server for pg-semaphore: {error}\n\
             Set DATABASE_URL (see .env.example), or install the PostgreSQL server \
             (Debian: apt-get install postgresql), or make Docker available."
        ),
    })
}

fn find_or_start() -> Result<Server, String> {
    if let Some(server) = database_url_server()? {
        return Ok(server);
    }
    start_throwaway(Durability::FsyncOff)
}

/// The server of `DATABASE_URL` (from the environment, or from a `.env`
/// file), if it is set.
///
/// # Errors
///
/// When `DATABASE_URL` is not a valid PostgreSQL URL.
pub fn database_url_server() -> Result<Option<Server>, String> {
    let _ = dotenvy::dotenv();
    let Ok(url) = std::env::var("DATABASE_URL") else {
        return Ok(None);
    };
    let options = PgConnectOptions::from_str(&url)
        .map_err(|e| format!("DATABASE_URL is not a valid PostgreSQL URL: {e}"))?;
    Ok(Some(Server {
        options,
        description: "the server of DATABASE_URL".to_owned(),
        throwaway: false,
        control: None,
        url: Some(url),
    }))
}

/// Starts a throwaway server with the given durability: from the local
/// PostgreSQL binaries, else a `postgres:15` container when Docker is
/// reachable. It is stopped and deleted when this process exits.
///
/// # Errors
///
/// When neither works: the message says why.
pub fn start_throwaway(durability: Durability) -> Result<Server, String> {
    let local_error = match find_bin_dir() {
        Some(bin) => match start_local(&bin, durability) {
            Ok(server) => return Ok(server),
            Err(e) => format!(
                "starting a throwaway server from {} failed: {e}",
                bin.display()
            ),
        },
        None => {
            "DATABASE_URL is unset and no PostgreSQL server binaries (initdb, pg_ctl) were found"
                .to_owned()
        }
    };
    if docker_available() {
        return start_container(durability).map_err(|e| format!("{local_error}; Docker: {e}"));
    }
    Err(local_error)
}

/// The directory holding `initdb` and `pg_ctl`: `$PG_BIN`, `pg_config --bindir`,
/// the newest `/usr/lib/postgresql/*/bin`, or `$PATH`.
pub fn find_bin_dir() -> Option<PathBuf> {
    let has_tools = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    if let Some(dir) = std::env::var_os("PG_BIN").map(PathBuf::from)
        && has_tools(&dir)
    {
        return Some(dir);
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && has_tools(&dir) {
            return Some(dir);
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            has_tools(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Some(bin);
    }
    for dir in [
        "/usr/local/pgsql/bin",
        "/opt/homebrew/bin",
        "/usr/local/bin",
    ] {
        if has_tools(Path::new(dir)) {
            return Some(PathBuf::from(dir));
        }
    }
    std::env::split_paths(&std::env::var_os("PATH")?).find(|dir| has_tools(dir))
}

/// Runs a PostgreSQL tool, as `user` when given (we are root), failing with its output.
pub(crate) fn run(user: Option<&str>, program: &Path, args: &[&str]) -> Result<(), String> {
    let mut command = match user {
        Some(user) => {
            let mut c = Command::new("runuser");
            c.args(["-u", user, "--"]).arg(program);
            c
        }
        None => Command::new(program),
    };
    let out = command
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} {} failed: {}{}",
            program.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
        .unwrap_or(false)
}

fn user_exists(user: &str) -> bool {
    Command::new("id")
        .arg(user)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
///
/// # Errors
///
/// When no port can be bound.
pub fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    listener
        .local_addr()
        .map(|addr| addr.port())
        .map_err(|e| e.to_string())
}

/// The OS user to run server tools as: `None` (ourselves) unless we are root,
/// which initdb, postgres and pgbouncer refuse; then `postgres`, or `nobody`.
pub(crate) fn unprivileged_user() -> Result<Option<&'static str>, String> {
    if !is_root() {
        return Ok(None);
    }
    ["postgres", "nobody"]
        .into_iter()
        .find(|u| user_exists(u))
        .map(Some)
        .ok_or_else(|| {
            "running as root and neither a `postgres` nor a `nobody` user exists".to_owned()
        })
}

fn start_local(bin: &Path, durability: Durability) -> Result<Server, String> {
    // initdb and postgres refuse to run as root: use an unprivileged OS user.
    let user = unprivileged_user()?;
    let dir = std::env::temp_dir().join(format!(
        "pg-semaphore-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    if let Some(user) = user {
        let status = Command::new("chown")
            .arg(format!("{user}:"))
            .arg(&dir)
            .status()
            .map_err(|e| format!("cannot run chown: {e}"))?;
        if !status.success() {
            return Err(format!("chown {user} {} failed", dir.display()));
        }
    }
    let data = dir.join("data");
    let data_s = data.to_string_lossy().into_owned();
    let dir_s = dir.to_string_lossy().into_owned();
    run(
        user,
        &bin.join("initdb"),
        &[
            "-D",
            &data_s,
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        ],
    )?;

    // The watchdog stops the server and deletes its files once this process is gone.
    let pg_ctl = bin.join("pg_ctl").to_string_lossy().into_owned();
    let as_user = user
        .map(|u| format!("runuser -u {u} -- "))
        .unwrap_or_default();
    spawn_watchdog(&format!(
        "{as_user}'{pg_ctl}' -D '{data_s}' -m immediate -w stop >/dev/null 2>&1; rm -rf '{dir_s}'"
    ))?;

    // A port can be taken between choosing and binding it: try a few.
    let mut last_error = String::new();
    for _ in 0..5 {
        let port = free_port()?;
        let server_options = format!(
            "-p {port} -k {dir_s} -c listen_addresses=127.0.0.1 -c max_connections=400 {}",
            durability.options()
        );
        let log = dir.join("server.log").to_string_lossy().into_owned();
        match run(
            user,
            &bin.join("pg_ctl"),
            &[
                "-D",
                &data_s,
                "-l",
                &log,
                "-o",
                &server_options,
                "-w",
                "-t",
                "60",
                "start",
            ],
        ) {
            Ok(()) => {
                return Ok(Server {
                    options: PgConnectOptions::new()
                        .host("127.0.0.1")
                        .port(port)
                        .username("postgres")
                        .database("postgres"),
                    description: format!(
                        "a throwaway PostgreSQL ({}) on 127.0.0.1:{port} ({dir_s})",
                        durability.label()
                    ),
                    throwaway: true,
                    control: Some(Control {
                        user,
                        pg_ctl: bin.join("pg_ctl"),
                        data: data_s,
                        log,
                        options: server_options,
                    }),
                    url: None,
                });
            }
            Err(e) => {
                last_error = format!("{e}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
            }
        }
    }
    Err(last_error)
}

/// Runs `cleanup` (a shell command) once this process has exited, however it
/// exits: a detached `sh` polls for our pid.
pub(crate) fn spawn_watchdog(cleanup: &str) -> Result<(), String> {
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 1; done; {cleanup}",
        pid = std::process::id()
    );
    Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map(drop)
        .map_err(|e| format!("cannot start the watchdog: {e}"))
}

/// A connection URL for `database` on [`server()`], for tools and child
/// processes that take a URL (sqlx-cli, worker processes): `DATABASE_URL`
/// with its database replaced (keeping its password and parameters), or the
/// throwaway server's.
pub fn url_for(database: &str) -> String {
    server().url_for(database)
}

impl Server {
    /// A connection URL for `database` on this server (see [`url_for`]).
    pub fn url_for(&self, database: &str) -> String {
        if let Some(url) = &self.url {
            // postgres://user:pass@host:port/db?params: replace `/db`.
            let authority_start = url.find("://").map_or(0, |i| i + 3);
            let path_start = url[authority_start..]
                .find(['/', '?'])
                .map_or(url.len(), |i| authority_start + i);
            let query_start = url[path_start..]
                .find('?')
                .map_or(url.len(), |i| path_start + i);
            return format!("{}/{database}{}", &url[..path_start], &url[query_start..]);
        }
        format!(
            "postgres://{}@{}:{}/{database}",
            self.options.get_username(),
            self.options.get_host(),
            self.options.get_port(),
        )
    }
}

fn docker_available() -> bool {
    Command::new("docker")
        .arg("info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn start_container(durability: Durability) -> Result<Server, String> {
    use testcontainers::core::{IntoContainerPort, WaitFor};
    use testcontainers::runners::SyncRunner;
    use testcontainers::{GenericImage, ImageExt};

    let container = GenericImage::new("postgres", "15")
        .with_exposed_port(5432.tcp())
        .with_wait_for(WaitFor::message_on_stderr(
            "database system is ready to accept connections",
        ))
        .with_wait_for(WaitFor::message_on_stdout(
            "database system is ready to accept connections",
        ))
        .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
        .with_cmd(
            std::iter::once("postgres")
                .chain(durability.options().split(' '))
                .chain(["-c", "max_connections=400"]),
        )
        .start()
        .map_err(|e| format!("cannot start a postgres container: {e}"))?;
    let port = container
        .get_host_port_ipv4(5432.tcp())
        .map_err(|e| e.to_string())?;
    let id = container.id().to_owned();
    // Kept for the life of the process; the watchdog removes it afterwards.
    let _ = spawn_watchdog(&format!("docker rm -f {id} >/dev/null 2>&1"));
    std::mem::forget(container);
    // The image restarts once after initialisation; give it a moment.
    std::thread::sleep(Duration::from_millis(500));
    Ok(Server {
        options: PgConnectOptions::new()
            .host("127.0.0.1")
            .port(port)
            .username("postgres")
            .database("postgres"),
        description: format!(
            "a postgres:15 container ({id}, {}) on port {port}",
            durability.label()
        ),
        throwaway: true,
        control: None,
        url: None,
    })
}
