//! A throwaway primary and a streaming standby, for failover tests.
//!
//! Both servers are started from the local PostgreSQL binaries (as the
//! throwaway server of [`server`](crate::server) is: in a temporary
//! directory, on free ports, as the `postgres` OS user when this process is
//! root), and both are **durable**: `fsync`, `full_page_writes` and
//! `synchronous_commit` on, because what survives a failover is the point.
//! They are kept small (`shared_buffers = 32MB`, `max_connections = 100`).
//!
//! - The primary runs with `wal_level = replica` and a `replication` entry
//!   in `pg_hba.conf`; the standby is a `pg_basebackup -R` clone of it
//!   (`standby.signal`, and a `primary_conninfo` naming it
//!   [`STANDBY_NAME`] as its `application_name`), on a port of its own. It
//!   streams through a [`Proxy`], the link between the two hosts, which
//!   [`ReplicaPair::partition`] blackholes: the standby then receives
//!   nothing while the primary goes on (a network partition between them).
//! - [`Replication::Synchronous`]: the primary's `synchronous_standby_names`
//!   names the standby, so with `synchronous_commit = on` a commit is
//!   acknowledged only once the standby has flushed its WAL.
//!   [`Replication::Asynchronous`]: a commit is acknowledged once it is on
//!   the primary's disk; the standby follows as fast as it can.
//! - [`ReplicaPair::stop_primary_hard`] is `pg_ctl stop -m immediate` (every
//!   process killed, no shutdown checkpoint, nothing more sent to the
//!   standby); [`ReplicaPair::promote_standby`] is `pg_ctl promote` and
//!   returns once the standby accepts writes. Afterwards the promoted server
//!   is the primary, and runs without a standby (as a Patroni cluster does
//!   until a replica rejoins) until [`ReplicaPair::reinit_standby`] clones a
//!   new one from it, discarding the old primary's data (what Patroni's
//!   `reinit` does when `pg_rewind` is not used).
//!
//! The servers are stopped and their files deleted when the pair is dropped,
//! and by a watchdog when this process exits, however it exits.
//!
//! Clients see one server or the other; to give them one address that
//! follows the primary, put a [`Router`](crate::router::Router) in front.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

use crate::proxy::Proxy;
use crate::server::{find_bin_dir, free_port, run, spawn_watchdog, unprivileged_user};

/// The standby's `application_name`, which the primary's
/// `synchronous_standby_names` names in [`Replication::Synchronous`] mode.
pub const STANDBY_NAME: &str = "pgsem_standby";

/// How to install the server binaries, for messages.
pub const INSTALL: &str = "apt-get install postgresql";

/// Whether the server binaries a pair needs (`initdb`, `pg_ctl`,
/// `pg_basebackup`) are installed; if not, prints one line saying how to
/// install them, and the test that asked returns without testing.
///
/// # Panics
///
/// When they are missing and `PGSEMAPHORE_REQUIRE_TOOLS=1`
/// (see [`require_tool`](crate::require_tool)).
pub fn installed() -> bool {
    match find_bin_dir() {
        Some(bin) if bin.join("pg_basebackup").is_file() => true,
        _ => crate::tools::missing(
            "PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup) not found",
            INSTALL,
        )
        .is_some(),
    }
}

/// Settings of every server of a pair (appended to `postgresql.conf`; a
/// standby inherits them through `pg_basebackup`).
const SETTINGS: &str = "
# pg-semaphore testkit: a durable, small server that can stream its WAL.
listen_addresses = '127.0.0.1'
fsync = on
full_page_writes = on
synchronous_commit = on
wal_level = replica
max_wal_senders = 4
wal_keep_size = 128MB
hot_standby = on
shared_buffers = 32MB
max_connections = 100
";

/// How the primary's commits wait for the standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_standby_names` names the standby: with
    /// `synchronous_commit = on`, a commit is acknowledged only once the
    /// standby has flushed it.
    Synchronous,
    /// No synchronous standby: a commit is acknowledged once it is on the
    /// primary's disk, and the standby may lag behind.
    Asynchronous,
}

impl Replication {
    /// `synchronous` or `asynchronous`, for messages.
    pub fn label(self) -> &'static str {
        match self {
            Replication::Synchronous => "synchronous",
            Replication::Asynchronous => "asynchronous",
        }
    }
}

/// One server of the pair.
#[derive(Debug, Clone)]
struct Node {
    data: PathBuf,
    port: u16,
    log: PathBuf,
}

impl Node {
    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database("postgres")
    }
}

/// The binaries and the OS user the servers run with, and their directory.
#[derive(Debug, Clone)]
struct Tools {
    bin: PathBuf,
    user: Option<&'static str>,
    dir: PathBuf,
}

impl Tools {
    fn run(&self, program: &str, args: &[&str]) -> Result<(), String> {
        run(self.user, &self.bin.join(program), args)
    }

    fn pg_ctl(&self, node: &Node, args: &[&str]) -> Result<(), String> {
        let data = path(&node.data);
        let mut all = vec!["-D", &data, "-w", "-t", "60"];
        all.extend_from_slice(args);
        self.run("pg_ctl", &all)
    }

    /// Starts `node` from its own `postgresql.conf`, on its port or, as a
    /// port can be taken between choosing and binding it, on another.
    fn start(&self, node: &mut Node) -> Result<(), String> {
        let mut last_error = String::new();
        for _ in 0..5 {
            let options = format!("-p {} -k {}", node.port, path(&self.dir));
            match self.pg_ctl(node, &["-l", &path(&node.log), "-o", &options, "start"]) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    let log = std::fs::read_to_string(&node.log).unwrap_or_default();
                    last_error = format!("{e}\n{log}");
                    node.port = free_port()?;
                }
            }
        }
        Err(last_error)
    }

    /// Stops `node` hard; an error when it was not running is ignored.
    fn stop_hard(&self, node: &Node) -> Result<(), String> {
        self.pg_ctl(node, &["-m", "immediate", "stop"])
    }

    /// A new, empty directory for a server's data, and its port and log.
    fn new_node(&self, name: &str) -> Result<Node, String> {
        Ok(Node {
            data: self.dir.join(format!("node-{name}")),
            port: free_port()?,
            log: self.dir.join(format!("node-{name}.log")),
        })
    }

    /// initdb, the settings, a replication entry in pg_hba, start.
    fn init_primary(&self) -> Result<Node, String> {
        let mut node = self.new_node("1")?;
        // --no-sync: what initdb writes is flushed by the server's first
        // checkpoint; the tests crash servers, never the machine.
        self.run(
            "initdb",
            &[
                "-D",
                &path(&node.data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )?;
        append(&node.data.join("postgresql.conf"), SETTINGS)?;
        append(
            &node.data.join("pg_hba.conf"),
            "# pg-semaphore testkit: the standby streams from here.\n\
             host replication postgres 127.0.0.1/32 trust\n",
        )?;
        self.start(&mut node)?;
        Ok(node)
    }

    /// A standby of `primary`: `pg_basebackup -R` (streaming the WAL it
    /// needs), named [`STANDBY_NAME`], started on a port of its own, that
    /// streams from the primary through `link` (the port of a proxy to it).
    fn clone_standby(&self, primary: &Node, link: u16, name: &str) -> Result<Node, String> {
        let mut node = self.new_node(name)?;
        self.run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
                "-D",
                &path(&node.data),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
            ],
        )?;
        // -R wrote standby.signal and a primary_conninfo; this one, later in
        // the same file, wins and gives the standby its name.
        append(
            &node.data.join("postgresql.auto.conf"),
            &format!(
                "primary_conninfo = 'host=127.0.0.1 port={link} user=postgres application_name={STANDBY_NAME}'\n",
            ),
        )?;
        self.start(&mut node)?;
        Ok(node)
    }
}

/// A primary and its streaming standby; see the [module docs](self).
#[derive(Debug)]
pub struct ReplicaPair {
    tools: Tools,
    mode: Replication,
    primary: Node,
    standby: Option<Node>,
    /// The replication link: a proxy from the standby to the primary.
    link: Option<Proxy>,
    /// Servers stopped hard and replaced, whose data is deleted at the next
    /// [`reinit_standby`](Self::reinit_standby) (or on drop).
    retired: Vec<Node>,
    /// Servers made so far (they are named by number).
    nodes: u32,
}

impl ReplicaPair {
    /// Starts a primary and a standby streaming from it, and returns once
    /// the standby streams (and, in [`Replication::Synchronous`] mode, is
    /// the primary's synchronous standby).
    ///
    /// # Errors
    ///
    /// When no PostgreSQL server binaries are installed, or a step fails:
    /// the message has the tool's output.
    pub async fn start(mode: Replication) -> Result<ReplicaPair, String> {
        let bin = find_bin_dir()
            .ok_or("no PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup) were found")?;
        let user = unprivileged_user()?;
        let dir = std::env::temp_dir().join(format!(
            "pg-semaphore-replica-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        if let Some(user) = user {
            let status = std::process::Command::new("chown")
                .arg(format!("{user}:"))
                .arg(&dir)
                .status()
                .map_err(|e| format!("cannot run chown: {e}"))?;
            if !status.success() {
                return Err(format!("chown {user} {} failed", dir.display()));
            }
        }
        let tools = Tools { bin, user, dir };
        // Whatever happens to this process, the servers stop and their files go.
        let pg_ctl = path(&tools.bin.join("pg_ctl"));
        let as_user = user
            .map(|u| format!("runuser -u {u} -- "))
            .unwrap_or_default();
        let dir_s = path(&tools.dir);
        spawn_watchdog(&format!(
            "for d in '{dir_s}'/node-*/; do {as_user}'{pg_ctl}' -D \"$d\" -m immediate -w stop >/dev/null 2>&1; done; \
             rm -rf '{dir_s}'"
        ))?;

        let primary = blocking({
            let tools = tools.clone();
            move || tools.init_primary()
        })
        .await?;
        let mut pair = ReplicaPair {
            tools,
            mode,
            primary,
            standby: None,
            link: None,
            retired: Vec::new(),
            nodes: 1,
        };
        pair.add_standby().await?;
        Ok(pair)
    }

    /// The replication mode.
    pub fn mode(&self) -> Replication {
        self.mode
    }

    /// The primary's address (`127.0.0.1:port`): after a promotion, the
    /// promoted server's.
    pub fn primary_address(&self) -> String {
        self.primary.address()
    }

    /// The standby's address, if there is a standby.
    pub fn standby_address(&self) -> Option<String> {
        self.standby.as_ref().map(Node::address)
    }

    /// Connect options for the primary's `postgres` database, as `postgres`.
    pub fn primary_options(&self) -> PgConnectOptions {
        self.primary.options()
    }

    /// Connect options for the standby's `postgres` database, if there is a standby.
    pub fn standby_options(&self) -> Option<PgConnectOptions> {
        self.standby.as_ref().map(Node::options)
    }

    /// What this pair is, for messages.
    pub fn description(&self) -> String {
        format!(
            "a throwaway PostgreSQL primary on {} with {} ({} replication; {})",
            self.primary.address(),
            self.standby
                .as_ref()
                .map_or("no standby".to_owned(), |s| format!(
                    "a standby on {}",
                    s.address()
                )),
            self.mode.label(),
            path(&self.tools.dir),
        )
    }

    /// Waits until the standby streams from the primary (`pg_stat_replication`),
    /// as the primary's synchronous standby in [`Replication::Synchronous`] mode.
    ///
    /// # Errors
    ///
    /// When there is no standby, or it does not stream within a minute.
    pub async fn wait_streaming(&self) -> Result<(), String> {
        if self.standby.is_none() {
            return Err("there is no standby".to_owned());
        }
        let want_sync = self.mode == Replication::Synchronous;
        let mut conn = connect(&self.primary.options()).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let row: Option<(String, String)> = sqlx::query_as(
                "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1",
            )
            .bind(STANDBY_NAME)
            .fetch_optional(&mut conn)
            .await
            .map_err(|e| format!("reading pg_stat_replication: {e}"))?;
            if let Some((state, sync_state)) = &row
                && state == "streaming"
                && (!want_sync || sync_state == "sync")
            {
                let _ = conn.close().await;
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "the standby does not stream (pg_stat_replication: {row:?}); its log:\n{}",
                    self.standby
                        .as_ref()
                        .and_then(|s| std::fs::read_to_string(&s.log).ok())
                        .unwrap_or_default()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Partitions the replication link: from now on the standby receives
    /// nothing, while the primary goes on. Under [`Replication::Asynchronous`]
    /// it keeps acknowledging commits the standby will never see; under
    /// [`Replication::Synchronous`] its commits wait. Undo with
    /// [`heal`](Self::heal).
    pub fn partition(&self) {
        if let Some(link) = &self.link {
            link.blackhole();
        }
    }

    /// Heals a [`partition`](Self::partition): what was held back reaches
    /// the standby.
    pub fn heal(&self) {
        if let Some(link) = &self.link {
            link.restore();
        }
    }

    /// Stops the primary hard (`pg_ctl stop -m immediate`): every process of
    /// it is killed at once, no shutdown checkpoint, and nothing more reaches
    /// the standby. Its clients' connections break.
    ///
    /// # Errors
    ///
    /// When `pg_ctl` fails (the primary was not running).
    pub async fn stop_primary_hard(&self) -> Result<(), String> {
        let (tools, primary) = (self.tools.clone(), self.primary.clone());
        blocking(move || tools.stop_hard(&primary)).await
    }

    /// Promotes the standby (`pg_ctl promote`) and returns once it accepts
    /// writes (`pg_is_in_recovery()` is false). From then on it is the
    /// primary, without a standby; the old primary is retired (stop it first:
    /// two primaries are a split brain).
    ///
    /// # Errors
    ///
    /// When there is no standby, or promotion fails or takes over a minute.
    pub async fn promote_standby(&mut self) -> Result<(), String> {
        let standby = self
            .standby
            .clone()
            .ok_or("there is no standby to promote")?;
        let tools = self.tools.clone();
        blocking({
            let standby = standby.clone();
            move || tools.pg_ctl(&standby, &["promote"])
        })
        .await?;
        let mut conn = connect(&standby.options()).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                .fetch_one(&mut conn)
                .await
                .map_err(|e| format!("asking the promoted standby: {e}"))?;
            if !in_recovery {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(
                    "the standby is still in recovery a minute after pg_ctl promote".into(),
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = conn.close().await;
        let old = std::mem::replace(&mut self.primary, standby);
        self.retired.push(old);
        self.standby = None;
        if let Some(link) = self.link.take() {
            link.cut().await;
        }
        Ok(())
    }

    /// After a promotion: deletes the retired servers' data and clones a new
    /// standby from the (new) primary, and returns once it streams (as the
    /// synchronous standby, in [`Replication::Synchronous`] mode).
    ///
    /// # Errors
    ///
    /// When there is a standby already, or a step fails.
    pub async fn reinit_standby(&mut self) -> Result<(), String> {
        if self.standby.is_some() {
            return Err("the pair has a standby already".to_owned());
        }
        let (tools, retired) = (self.tools.clone(), std::mem::take(&mut self.retired));
        blocking(move || {
            for node in &retired {
                let _ = tools.stop_hard(node);
                let _ = std::fs::remove_dir_all(&node.data);
                let _ = std::fs::remove_file(&node.log);
            }
            Ok(())
        })
        .await?;
        self.add_standby().await
    }

    /// Clones a standby from the primary, streaming through a new link;
    /// makes it synchronous (in that mode), and waits until it streams.
    async fn add_standby(&mut self) -> Result<(), String> {
        let link = Proxy::start_to(self.primary.address()).await;
        self.nodes += 1;
        let (tools, primary, port, name) = (
            self.tools.clone(),
            self.primary.clone(),
            link.address().port(),
            self.nodes.to_string(),
        );
        let standby = blocking(move || tools.clone_standby(&primary, port, &name)).await?;
        self.standby = Some(standby);
        self.link = Some(link);
        let names = match self.mode {
            Replication::Synchronous => STANDBY_NAME,
            Replication::Asynchronous => "",
        };
        // ALTER SYSTEM after the clone, so that the standby does not inherit
        // it: promoted, it must not wait for a standby it does not have.
        let mut conn = connect(&self.primary.options()).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
        )))
        .execute(&mut conn)
        .await
        .map_err(|e| format!("setting synchronous_standby_names: {e}"))?;
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&mut conn)
            .await
            .map_err(|e| format!("reloading the configuration: {e}"))?;
        let _ = conn.close().await;
        self.wait_streaming().await
    }
}

impl Drop for ReplicaPair {
    fn drop(&mut self) {
        let nodes = std::iter::once(&self.primary)
            .chain(&self.standby)
            .chain(&self.retired);
        for node in nodes {
            let _ = self.tools.stop_hard(node);
        }
        let _ = std::fs::remove_dir_all(&self.tools.dir);
    }
}

/// Connects, retrying while a server finishes starting.
async fn connect(options: &PgConnectOptions) -> Result<PgConnection, String> {
    let mut last = None;
    for _ in 0..100 {
        match PgConnection::connect_with(options).await {
            Ok(conn) => return Ok(conn),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "cannot connect to 127.0.0.1:{}: {last:?}",
        options.get_port()
    ))
}

/// Runs blocking work (initdb, pg_ctl, pg_basebackup) off the runtime's threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| format!("a blocking step panicked: {e}"))?
}

fn path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn append(file: &Path, text: &str) -> Result<(), String> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .append(true)
        .open(file)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| format!("cannot append to {}: {e}", file.display()))
}
