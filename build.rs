//! Generates the list of refinery migrations (feature `refinery`) from
//! `migrations/`, so it follows the directory: a new sqlx migration file is a
//! new refinery migration, with nothing to edit by hand.
//!
//! sqlx names files `<VERSION>_<DESCRIPTION>.sql` (the version is a 14-digit
//! timestamp); refinery wants `V<N>__<NAME>` with a 32-bit `N`. The files are
//! sorted by sqlx version, which is the order sqlx applies them in, and
//! numbered from 1: `20261128010001_pgsemaphore_tables.sql` becomes
//! `V1__pgsemaphore_tables`. Migrations are only ever appended, so the
//! numbers are stable; were a file ever inserted before another, refinery
//! would report the applied migration as divergent (its checksum covers the
//! number, name and SQL) rather than apply anything.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=migrations");
    let dir = Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("migrations");
    let mut files: Vec<(u64, String, String)> = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("read migrations/") {
        let path = entry.expect("read migrations/").path();
        let Some(file) = path.file_name().and_then(|f| f.to_str()) else {
            continue;
        };
        // Only what sqlx applies: `<VERSION>_<DESCRIPTION>.sql` (or `.up.sql`).
        if file.ends_with(".down.sql") {
            continue;
        }
        let Some(stem) = file
            .strip_suffix(".up.sql")
            .or_else(|| file.strip_suffix(".sql"))
        else {
            continue;
        };
        let Some((version, description)) = stem.split_once('_') else {
            continue;
        };
        let Ok(version) = version.parse::<u64>() else {
            continue;
        };
        let name: String = description
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let sql = std::fs::read_to_string(&path).expect("read a migration");
        if sql.trim_start().starts_with("-- no-transaction") {
            println!(
                "cargo:warning={file} is marked `-- no-transaction`: refinery runs every migration in a transaction"
            );
        }
        files.push((version, name, file.to_owned()));
    }
    files.sort();
    // Paths relative to CARGO_MANIFEST_DIR, not absolute: Cargo gives two
    // copies of this package (a checkout and its unpacked .crate, as `cargo
    // publish` verifies it) the same build directory when they share a
    // target directory, and an absolute path would then point into the
    // other copy, which may be gone.
    let mut out = String::from("&[\n");
    for (number, (_, name, file)) in files.iter().enumerate() {
        writeln!(
            out,
            "    ({:?}, include_str!(concat!(env!(\"CARGO_MANIFEST_DIR\"), {:?}))),",
            format!("V{}__{name}", number + 1),
            format!("/migrations/{file}")
        )
        .unwrap();
    }
    out.push_str("]\n");
    let target = Path::new(&std::env::var("OUT_DIR").unwrap()).join("refinery_migrations.rs");
    std::fs::write(target, out).expect("write refinery_migrations.rs");
}
