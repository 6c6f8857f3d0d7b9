//! A PgBouncer in transaction pooling mode in front of the test server, so
//! tests can show what works through a pooler.
//!
//! Started once per test process from the `pgbouncer` binary (Debian package
//! `pgbouncer`), on 127.0.0.1 and a free port, with its files in a temporary
//! directory; run as the `postgres` OS user when this process is root
//! (pgbouncer refuses root), and stopped and deleted by a watchdog when this
//! process exits, like the throwaway server in `server.rs`.
//!
//! Every database of the server is reachable under its own name (`* =` in
//! `[databases]`), so a [`TestDb`]'s database is too. Clients
//! log in as the server's user without a password (`auth_type = trust`).
//!
//! What goes through it safely is spelled out, and tested, in `tests/pgbouncer.rs`:
//! in short, every `sqlx::query*` must run inside an explicit transaction as an
//! unnamed statement (`.persistent(false)`); outside transactions only
//! parameterless `raw_sql` is safe.
//!
//! A test that needs PgBouncer starts with [`installed`]: where PgBouncer is
//! missing it skips with one line saying how to install it (or fails, under
//! `PGSEMAPHORE_REQUIRE_TOOLS=1`; see [`require_tool`](crate::require_tool)).

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};

use crate::TestDb;
use crate::server;

/// How to install PgBouncer, for messages.
pub const INSTALL: &str = "apt-get install pgbouncer";

/// The `pgbouncer` binary, or `None` (with one line saying how to install it)
/// when it is missing: the test that asked returns without testing.
///
/// # Panics
///
/// When it is missing and `PGSEMAPHORE_REQUIRE_TOOLS=1`.
pub fn installed() -> Option<PathBuf> {
    crate::require_tool("pgbouncer", INSTALL)
}

/// A running PgBouncer.
#[derive(Debug)]
pub struct PgBouncer {
    /// The port it listens on, on 127.0.0.1.
    pub port: u16,
    /// The user clients log in as: the test server's.
    pub username: String,
    /// Its configuration, log and pid file (deleted when the process exits).
    pub dir: PathBuf,
}

static PGBOUNCER: OnceLock<PgBouncer> = OnceLock::new();

/// A PgBouncer in transaction pooling mode in front of the test server, started
/// once per test process.
///
/// Blocking (it may start the server too): from async code call it through
/// `tokio::task::spawn_blocking`, or use [`bouncer`].
///
/// # Panics
///
/// When PgBouncer is not installed or does not start: the message says why.
pub fn pgbouncer() -> &'static PgBouncer {
    PGBOUNCER.get_or_init(|| match start() {
        Ok(bouncer) => bouncer,
        Err(error) => panic!("cannot start PgBouncer for the pooler tests: {error}"),
    })
}

/// [`pgbouncer`], from async code.
pub async fn bouncer() -> &'static PgBouncer {
    match tokio::task::spawn_blocking(pgbouncer).await {
        Ok(bouncer) => bouncer,
        Err(error) => std::panic::resume_unwind(error.into_panic()),
    }
}

impl PgBouncer {
    /// Lets clients log in as `role` too (PgBouncer wants every user in its
    /// `auth_file`, even with `auth_type = trust`): appends it and reloads
    /// the configuration through the admin console.
    pub async fn add_user(&self, role: &str, password: &str) -> Result<(), String> {
        use sqlx::Connection as _;
        let userlist = self.dir.join("userlist.txt");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&userlist)
            .and_then(|mut file| writeln!(file, "{} {}", quote(role), quote(password)))
            .map_err(|e| format!("cannot append to {}: {e}", userlist.display()))?;
        let mut admin = sqlx::PgConnection::connect_with(&self.options("pgbouncer"))
            .await
            .map_err(|e| format!("cannot reach PgBouncer's admin console: {e}"))?;
        sqlx::raw_sql("RELOAD")
            .execute(&mut admin)
            .await
            .map_err(|e| format!("PgBouncer RELOAD failed: {e}"))?;
        let _ = sqlx::Connection::close(admin).await;
        Ok(())
    }

    /// Connect options for database `database` through the bouncer, with
    /// `statement_cache_capacity(0)` (required: PgBouncer 1.18 in transaction
    /// mode cannot keep named prepared statements).
    ///
    /// Required but not enough: sqlx still names each statement unless the
    /// query is `.persistent(false)`, and still runs it in two round trips that
    /// only a transaction keeps on one server connection (`tests/pgbouncer.rs`).
    pub fn options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username(&self.username)
            .database(database)
            .ssl_mode(PgSslMode::Disable)
            .statement_cache_capacity(0)
    }
}

/// Convenience: a pool of `max` connections to the [`TestDb`]'s database
/// through the bouncer.
pub async fn pool_through_bouncer(db: &TestDb, max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .connect_with(bouncer().await.options(&db.name))
        .await
        .expect("connect a pool through PgBouncer")
}

fn start() -> Result<PgBouncer, String> {
    let binary = crate::find_tool("pgbouncer").ok_or_else(|| {
        format!(
            "the `pgbouncer` binary was not found on PATH or in /usr/sbin: install it with \
             `{INSTALL}` or run `bash scripts/test.sh`"
        )
    })?;
    let server = server::server();
    let user = server::unprivileged_user()?;
    let dir = std::env::temp_dir().join(format!(
        "pg-semaphore-pgbouncer-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    // auth_file may hold DATABASE_URL's password: keep the directory private.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("cannot chmod {}: {e}", dir.display()))?;
    let dir_s = dir.to_string_lossy().into_owned();
    let pidfile = dir.join("pgbouncer.pid");
    let logfile = dir.join("pgbouncer.log");

    // The watchdog stops PgBouncer and deletes its files once this process is gone.
    server::spawn_watchdog(&format!(
        "kill $(cat '{pidfile}' 2>/dev/null) 2>/dev/null; sleep 1; rm -rf '{dir_s}'",
        pidfile = pidfile.display(),
    ))?;

    let username = server.options.get_username().to_owned();
    // For `trust`, PgBouncer still wants the user in auth_file; a password there
    // is what it logs in to the server with, if the server asks for one.
    let password = server_password(server).unwrap_or_default();
    write_file(
        &dir.join("userlist.txt"),
        &format!("{} {}\n", quote(&username), quote(&password)),
    )?;
    let target = match server.options.get_socket() {
        Some(socket_dir) => format!("host={}", socket_dir.display()),
        None => format!("host={}", server.options.get_host()),
    };

    // A port can be taken between choosing and binding it: try a few.
    let mut last_error = String::new();
    for _ in 0..5 {
        let port = server::free_port()?;
        let config = format!(
            "[databases]\n\
             * = {target} port={server_port}\n\
             \n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             pool_mode = transaction\n\
             auth_type = trust\n\
             auth_file = {dir_s}/userlist.txt\n\
             admin_users = {username}\n\
             max_client_conn = 500\n\
             default_pool_size = 20\n\
             server_reset_query =\n\
             ignore_startup_parameters = extra_float_digits,options,search_path,application_name\n\
             logfile = {logfile}\n\
             pidfile = {pidfile}\n\
             log_connections = 0\n\
             log_disconnections = 0\n",
            server_port = server.options.get_port(),
            logfile = logfile.display(),
            pidfile = pidfile.display(),
        );
        let _ = std::fs::remove_file(&logfile);
        let config_path = dir.join("pgbouncer.ini");
        write_file(&config_path, &config)?;
        if let Some(user) = user {
            chown_recursive(user, &dir)?;
        }
        // `-d`: it daemonises and writes its pid file; then wait for it to listen.
        let config_s = config_path.to_string_lossy().into_owned();
        server::run(user, &binary, &["-d", &config_s])?;
        match wait_until_listening(port, &pidfile, &logfile) {
            Ok(()) => {
                return Ok(PgBouncer {
                    port,
                    username,
                    dir,
                });
            }
            Err(e) => last_error = e,
        }
    }
    Err(last_error)
}

/// Waits for PgBouncer to accept TCP connections on `port`, failing early when
/// its log shows it died (say, the port was taken meanwhile).
fn wait_until_listening(port: u16, pidfile: &Path, logfile: &Path) -> Result<(), String> {
    let address = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = std::fs::read_to_string(logfile).unwrap_or_default();
        if log.contains(" FATAL ") || log.contains(" ERROR ") {
            return Err(format!("PgBouncer did not start on port {port}:\n{log}"));
        }
        if pidfile.is_file()
            && TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_ok()
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "PgBouncer did not listen on port {port} within 20 s:\n{log}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The password of `DATABASE_URL` (or `PGPASSWORD`), for PgBouncer to log in to
/// a server we did not start; throwaway servers trust everyone.
fn server_password(server: &server::Server) -> Option<String> {
    if server.throwaway {
        return None;
    }
    let url = std::env::var("DATABASE_URL").ok()?;
    let authority = url.split_once("://")?.1.split(['/', '?']).next()?;
    let userinfo = authority.rsplit_once('@')?.0;
    match userinfo.split_once(':') {
        Some((_, password)) => Some(percent_decode(password)),
        None => std::env::var("PGPASSWORD").ok(),
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = || u8::from_str_radix(s.get(i + 1..i + 3)?, 16).ok();
        match (bytes[i], hex()) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A string as auth_file wants it: in double quotes, with `"` doubled.
fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

fn write_file(path: &Path, contents: &str) -> Result<(), String> {
    std::fs::File::create(path)
        .and_then(|mut file| file.write_all(contents.as_bytes()))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn chown_recursive(user: &str, path: &Path) -> Result<(), String> {
    let status = Command::new("chown")
        .arg("-R")
        .arg(format!("{user}:"))
        .arg(path)
        .status()
        .map_err(|e| format!("cannot run chown: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("chown -R {user} {} failed", path.display()))
    }
}
