//! The SQL API is a contract (docs/sql-api.md): its worked example runs, as
//! written, from `psql` as a role with exactly the guide's application
//! grants, and prints what the document shows; and the document's table of
//! application functions names exactly the functions the application role
//! is granted.

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};
use testkit::TestResult;

const PASSWORD: &str = "sql-api-example-pw";

/// What varies from run to run, masked: the notifying backend's pid, and
/// the C source line PostgreSQL reports an error from.
fn masked(text: &str) -> String {
    text.lines()
        .map(|line| {
            if line.starts_with("LOCATION:") {
                "LOCATION:  (masked)".to_owned()
            } else if let Some(at) = line.find("received from server process with PID ") {
                format!(
                    "{}received from server process with PID (masked).",
                    &line[..at]
                )
            } else {
                line.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// Where the two texts first differ, for a failure message.
fn first_difference(expected: &str, got: &str) -> String {
    for (n, (e, g)) in expected.lines().zip(got.lines()).enumerate() {
        if e != g {
            return format!("line {}:\n  expected: {e}\n  got:      {g}", n + 1);
        }
    }
    format!(
        "{} lines expected, {} lines got",
        expected.lines().count(),
        got.lines().count()
    )
}

#[tokio::test]
async fn the_documented_psql_example_runs_as_written_with_the_application_grants() -> TestResult {
    let Some(psql) = support::require_tool("psql", "apt-get install postgresql-client") else {
        return Ok(()); // skipped, with one line saying how to install it
    };
    let db = support::migrated_db().await;
    let app = format!("{}_app", db.name);
    let operator = format!("{}_op", db.name);
    let mut admin = PgConnection::connect_with(&db.options).await?;
    for role in [&app, &operator] {
        admin
            .execute(AssertSqlSafe(format!(
                r#"CREATE ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '{PASSWORD}'"#
            )))
            .await?;
    }
    admin
        .execute(AssertSqlSafe(support::documented_grants(&app, &operator)))
        .await?;

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let options = &db.options;
    let run = Command::new(&psql)
        .current_dir(root)
        .env_clear()
        .env("PGPASSWORD", PASSWORD)
        .env("PGCONNECT_TIMEOUT", "10")
        .args(["-X", "-f", "docs/sql-api/example.sql"])
        .arg(format!("--host={}", options.get_host()))
        .arg(format!("--port={}", options.get_port()))
        .arg(format!("--username={app}"))
        .arg(format!("--dbname={}", db.name))
        .output()?;
    for role in [&app, &operator] {
        admin
            .execute(AssertSqlSafe(format!(
                r#"DROP OWNED BY "{role}"; DROP ROLE "{role}""#
            )))
            .await?;
    }
    let stdout = masked(&String::from_utf8_lossy(&run.stdout));
    let stderr = masked(&String::from_utf8_lossy(&run.stderr));
    assert!(
        run.status.success(),
        "psql -f docs/sql-api/example.sql failed ({}):\n{stdout}\n{stderr}",
        run.status
    );
    for (file, got) in [("example.out", &stdout), ("example.err", &stderr)] {
        let path = root.join("docs/sql-api").join(file);
        if std::env::var_os("PGSEM_BLESS").is_some() {
            std::fs::write(&path, got)?;
        }
        let expected = std::fs::read_to_string(&path)?;
        assert!(
            &expected == got,
            "docs/sql-api/{file} is not what the example prints ({}); \
             if the change is meant, rerun with PGSEM_BLESS=1 and read the diff\n{got}",
            first_difference(&expected, got)
        );
    }
    // The pins that matter, whatever the expected file says.
    for line in [
        "claim a: claimed, slots {0}, 1 free, wake f",
        " full     | (null) |      0 | t                 | f",
        "release a: released, wake t",
        "Asynchronous notification \"pgsemaphore\" with payload \"upstream\"",
        "error: 22023",
        "error: P0002",
    ] {
        assert!(
            stdout.contains(line),
            "the example no longer prints {line:?}"
        );
    }
    assert!(stderr.contains("COLUMN NAME:  p_token"), "{stderr}");
    Ok(())
}

/// The routines `pgsemaphore.grant_access` gives the application's part
/// (its array in the migration; `tests/security.rs` checks what it grants).
fn granted_to_app() -> Vec<String> {
    let sql = include_str!("../migrations/20261128010007_pgsemaphore_operator.sql");
    let body = &sql[sql
        .find("CREATE FUNCTION pgsemaphore.grant_access")
        .expect("grant_access is defined")..];
    let array = body
        .split("WHEN 'application' THEN ARRAY[")
        .nth(1)
        .and_then(|rest| rest.split("]\n").next())
        .expect("the application's array");
    let mut names: Vec<String> = array
        .split("'pgsemaphore.")
        .skip(1)
        .filter_map(|routine| routine.split('(').next())
        .map(str::to_owned)
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn the_function_table_names_every_application_function() -> TestResult {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The table: rows `| `pgsemaphore.NAME(...)` | ... |` between the markers.
    let doc = std::fs::read_to_string(root.join("docs/sql-api.md"))?;
    let table = doc
        .split("<!-- functions:begin")
        .nth(1)
        .and_then(|rest| rest.split("<!-- functions:end -->").next())
        .ok_or("docs/sql-api.md has no functions:begin/functions:end markers")?;
    let mut listed = BTreeSet::new();
    for row in table.lines().filter(|l| l.starts_with("| `pgsemaphore.")) {
        let name = row["| `pgsemaphore.".len()..]
            .split(['(', '`'])
            .next()
            .unwrap_or_default()
            .to_owned();
        assert!(listed.insert(name.clone()), "{name} listed twice");
    }

    let granted = granted_to_app();
    assert!(granted.len() >= 20, "parsed too few grants: {granted:?}");
    for name in &granted {
        assert!(
            listed.contains(name),
            "docs/sql-api.md's table does not list pgsemaphore.{name}, granted to the application"
        );
    }
    for name in &listed {
        assert!(
            granted.contains(name),
            "docs/sql-api.md lists pgsemaphore.{name}, which docs/guide/operations.md does not grant to the application"
        );
    }
    Ok(())
}
