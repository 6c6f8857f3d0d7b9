//! The `pg-semaphore` binary, run as an operator would (`tests/cli.rs`,
//! `tests/report.rs`): its output and exit status.

use std::path::PathBuf;
use std::process::Output;

use tokio::process::Command;

/// A directory with no `.env` in it or above it (unlike the checkout).
pub fn bare_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pgsem-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the binary with `args`, `DATABASE_URL` set to `url` (or unset), in
/// `dir` (default: a directory without `.env`).
pub async fn run_in(dir: Option<&PathBuf>, url: Option<&str>, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_pg-semaphore"));
    command
        .args(args)
        .current_dir(dir.cloned().unwrap_or_else(bare_dir))
        .env_remove("DATABASE_URL");
    if let Some(url) = url {
        command.env("DATABASE_URL", url);
    }
    command.output().await.expect("run pg-semaphore")
}

/// Runs the binary with `args` on `db`.
pub async fn run(db: &super::TestDb, args: &[&str]) -> Output {
    run_in(None, Some(&super::server::url_for(&db.name)), args).await
}

/// What it printed on stdout.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What it printed on stderr.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts the exit status, showing the output when it differs.
#[track_caller]
pub fn assert_status(out: &Output, code: i32) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "expected exit status {code}\nstdout:\n{}\nstderr:\n{}",
        stdout(out),
        stderr(out)
    );
}
