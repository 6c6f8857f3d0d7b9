//! Every interleaving of the admission functions' dangerous concurrent
//! operations, run by PostgreSQL's own isolation tester
//! (`pg_isolation_regress`, from the PostgreSQL client packages) over the
//! specs in `tests/isolation/specs/`, against their expected outputs in
//! `tests/isolation/expected/`. Each spec states in its header which
//! interleaving it covers and which invariant its output shows; how to add
//! one is in `tests/isolation/README.md`.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use support::TestResult;

/// `pg_isolation_regress` of the newest PostgreSQL whose client is
/// installed (Debian keeps it out of `PATH`), else one on `PATH`.
fn isolation_regress() -> Option<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let path = entry
                .path()
                .join("lib/pgxs/src/test/isolation/pg_isolation_regress");
            path.is_file().then_some((version, path))
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, path)) => Some(path),
        None => support::require_tool("pg_isolation_regress", "apt-get install postgresql-client"),
    }
}

/// The spec names, sorted.
fn specs(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("specs"))?
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().to_str()?.to_owned();
            name.strip_suffix(".spec").map(str::to_owned)
        })
        .collect();
    names.sort();
    Ok(names)
}

#[tokio::test]
async fn every_interleaving_of_the_admission_functions_keeps_its_invariant() -> TestResult {
    let Some(tool) = isolation_regress() else {
        return Ok(()); // skipped, with one line saying how to install it
    };
    let db = support::migrated_db().await;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/isolation");
    let names = specs(&dir)?;
    assert!(!names.is_empty(), "no spec in {}", dir.display());
    for name in &names {
        assert!(
            dir.join("expected").join(format!("{name}.out")).is_file(),
            "spec {name} has no expected output: see tests/isolation/README.md"
        );
    }
    let out = std::env::temp_dir().join(format!("pgsem-isolation-{}", db.name));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let options = &db.options;
    let mut command = Command::new(&tool);
    command
        .arg("--use-existing")
        .arg(format!("--host={}", options.get_host()))
        .arg(format!("--port={}", options.get_port()))
        .arg(format!("--user={}", options.get_username()))
        .arg(format!("--dbname={}", db.name))
        .arg(format!("--inputdir={}", dir.display()))
        .arg(format!("--outputdir={}", out.display()))
        .args(&names);
    if let Ok(password) = std::env::var("PGPASSWORD") {
        command.env("PGPASSWORD", password);
    }
    let started = Instant::now();
    let run = command.output()?;
    let took = started.elapsed();
    let results = out.join("results");
    let permutations: usize = names
        .iter()
        .filter_map(|name| std::fs::read_to_string(results.join(format!("{name}.out"))).ok())
        .map(|text| text.matches("starting permutation").count())
        .sum();
    println!(
        "isolation: {} specs, {permutations} permutations, {:.1} s",
        names.len(),
        took.as_secs_f64()
    );
    if !run.status.success() {
        let diffs = std::fs::read_to_string(out.join("regression.diffs")).unwrap_or_default();
        panic!(
            "pg_isolation_regress failed ({}):\n{}\n{}\n{diffs}",
            run.status,
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr)
        );
    }
    assert!(permutations > 0, "no permutation ran");
    let _ = std::fs::remove_dir_all(&out);
    Ok(())
}
