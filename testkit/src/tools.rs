//! External tools some tests need (PgBouncer, sqlx-cli, a browser), and the
//! policy when one is missing.
//!
//! Plain `cargo test` needs only a PostgreSQL server (or `DATABASE_URL`): a
//! test whose tool is missing prints one line saying how to get it and
//! returns without testing anything. `bash scripts/test.sh`, which CI runs,
//! installs every tool and sets `PGSEMAPHORE_REQUIRE_TOOLS=1`, under which a
//! missing tool fails the test instead: CI never skips.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;

/// The environment variable that turns a missing tool from a skip into a
/// failure (`PGSEMAPHORE_REQUIRE_TOOLS=1`; `bash scripts/test.sh` sets it).
pub const REQUIRE_TOOLS_VAR: &str = "PGSEMAPHORE_REQUIRE_TOOLS";

/// Where `program` is installed: on `PATH`, or in the `sbin` directories
/// that a non-root `PATH` often lacks (Debian puts `pgbouncer` in `/usr/sbin`).
pub fn find_tool(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([
            "/usr/sbin".into(),
            "/usr/local/sbin".into(),
            "/usr/local/bin".into(),
        ])
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

/// The path of `program`, which a test needs; `None` when it is not installed,
/// after printing one line that says how to install it (`install`, a
/// command), so the caller returns without testing.
///
/// ```no_run
/// # fn a_test() {
/// let Some(_pgbouncer) = pg_semaphore_testkit::require_tool("pgbouncer", "apt-get install pgbouncer")
/// else {
///     return; // printed: skipped: pgbouncer not found; install it with ...
/// };
/// # }
/// ```
///
/// # Panics
///
/// When the tool is missing and `PGSEMAPHORE_REQUIRE_TOOLS=1` (as under
/// `bash scripts/test.sh` and in CI): there, a test may not skip.
pub fn require_tool(program: &str, install: &str) -> Option<PathBuf> {
    match find_tool(program) {
        Some(path) => Some(path),
        None => missing(&format!("{program} not found"), install),
    }
}

/// [`require_tool`] for a tool whose version matters: `program --version`
/// must print `version` as the start of a version number (`"0.9"` matches
/// `sqlx-cli 0.9.0`, not `0.10.1` or `10.9`). Another version counts as
/// missing. `name` is what messages call it (`sqlx-cli` for `sqlx`).
///
/// # Panics
///
/// As [`require_tool`].
pub fn require_tool_version(
    name: &str,
    program: &str,
    version: &str,
    install: &str,
) -> Option<PathBuf> {
    let Some(path) = find_tool(program) else {
        return missing(&format!("{name} {version} not found"), install);
    };
    let printed = Command::new(&path)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .unwrap_or_default();
    let matches = printed.split_whitespace().any(|word| {
        word.strip_prefix(version)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    });
    if matches {
        Some(path)
    } else {
        let found = printed.lines().next().unwrap_or("an unknown version");
        missing(
            &format!("{name} {version} not found ({found} is installed)"),
            install,
        )
    }
}

/// Whether a missing tool must fail the test (`PGSEMAPHORE_REQUIRE_TOOLS=1`).
fn tools_required() -> bool {
    std::env::var(REQUIRE_TOOLS_VAR).is_ok_and(|v| !v.is_empty() && v != "0")
}

pub(crate) fn missing(what: &str, install: &str) -> Option<PathBuf> {
    let how = format!("install it with `{install}` or run `bash scripts/test.sh`");
    assert!(
        !tools_required(),
        "{what}; {how} ({REQUIRE_TOOLS_VAR}=1: tests that need it may not skip)"
    );
    // Once per tool and test process, and straight to stderr: the test harness
    // captures `eprintln!` of passing tests, and a skip must be seen.
    static REPORTED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let line = format!("skipped: {what}; {how}\n");
    let first = REPORTED
        .lock()
        .map(|mut reported| reported.insert(line.clone()))
        .unwrap_or(true);
    if first {
        // One write, so that the test harness's own output cannot split the line.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
    None
}
