//! The `pg-semaphore` binary, run as an operator would: against a real
//! database, checking what it prints and the exit status scripts rely on.

mod support;

use std::time::Duration;

use pg_semaphore::{AdvisorySemaphore, Error, LostReason, Semaphore, SemaphoreFamily};
use support::TestResult;
use support::cli::{assert_status, run, run_in, stderr, stdout};

#[tokio::test]
async fn help_lists_every_command_and_the_exit_statuses() {
    let out = run_in(None, None, &["--help"]).await;
    assert_status(&out, 0);
    let help = stdout(&out);
    for command in [
        "migrate",
        "status",
        "audit",
        "reap",
        "release",
        "set-capacity",
        "clear-queue",
        "prune",
        "doctor",
        "families",
        "family",
        "rule",
        "tier",
    ] {
        assert!(help.contains(command), "--help lacks {command}:\n{help}");
    }
    for line in [
        "0  success",
        "1  database",
        "2  usage",
        "3  not found",
        "4  pg-semaphore's migrations",
    ] {
        assert!(
            help.contains(line),
            "--help lacks exit status {line:?}:\n{help}"
        );
    }
    assert!(help.contains("DATABASE_URL"), "{help}");

    let out = run_in(None, None, &["audit", "--help"]).await;
    assert_status(&out, 0);
    for option in ["--last", "--since", "--until", "--json", "--csv"] {
        assert!(stdout(&out).contains(option), "audit --help lacks {option}");
    }
}

#[tokio::test]
async fn bad_usage_exits_with_status_2() {
    for args in [
        &["frobnicate"][..],
        &["release"],                                     // --id is required
        &["release", "--id", "x"],                        // not a number
        &["prune", "--older-than", "soon"],               // not a duration
        &["audit", "s", "--last", "1h", "--since", "2h"], // conflicting windows
        &["audit", "s", "--json", "--csv"],               // one format
        &["set-capacity", "s", "-1"],
    ] {
        let out = run_in(None, Some("postgres://unused@127.0.0.1:1/x"), args).await;
        assert_status(&out, 2);
        assert!(!stderr(&out).is_empty(), "{args:?}: no message");
    }
}

#[tokio::test]
async fn no_database_url_is_a_usage_error_that_says_what_to_set() {
    let out = run_in(None, None, &["status"]).await;
    assert_status(&out, 2);
    let message = stderr(&out);
    assert!(message.contains("DATABASE_URL"), "{message}");
    assert!(message.contains(".env"), "{message}");
}

#[tokio::test]
async fn an_unreachable_database_is_a_runtime_error() {
    let port = support::server::free_port().unwrap();
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let out = run_in(None, Some(&url), &["status"]).await;
    assert_status(&out, 1);
    let message = stderr(&out);
    assert!(message.contains("cannot connect"), "{message}");
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
}

#[tokio::test]
async fn an_unmigrated_database_says_to_migrate_then_migrate_fixes_it() -> TestResult {
    let db = support::empty_db().await;
    for args in [
        &["status"][..],
        &["reap"],
        &["audit", "x"],
        &["release", "--id", "1"],
        &["set-capacity", "x", "2"],
        &["prune", "--older-than", "1d"],
    ] {
        let out = run(&db, args).await;
        assert_status(&out, 4);
        assert!(
            stderr(&out).contains("run `pg-semaphore migrate`"),
            "{args:?}: {}",
            stderr(&out)
        );
    }

    let out = run(&db, &["migrate"]).await;
    assert_status(&out, 0);
    assert!(stdout(&out).contains("up to date"), "{}", stdout(&out));
    let out = run(&db, &["migrate"]).await; // idempotent
    assert_status(&out, 0);

    let out = run(&db, &["status"]).await;
    assert_status(&out, 0);
    assert!(stdout(&out).contains("no semaphores"), "{}", stdout(&out));
    // The library agrees: the schema is there.
    Semaphore::builder("after-cli-migrate", 1)
        .build(&pg_semaphore::Client::new(db.pool.clone()))
        .await?
        .try_acquire()
        .await?
        .release()
        .await?;
    Ok(())
}

#[tokio::test]
async fn the_database_url_can_come_from_a_dotenv_file() -> TestResult {
    let db = support::empty_db().await;
    let dir = std::env::temp_dir().join(format!("pgsem-cli-dotenv-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join(".env"),
        format!("DATABASE_URL={}\n", support::server::url_for(&db.name)),
    )?;
    let out = run_in(Some(&dir), None, &["migrate"]).await;
    assert_status(&out, 0);
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM pgsemaphore._sqlx_migrations")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(
        applied as usize,
        pg_semaphore::schema::migrator().iter().count()
    );
    Ok(())
}

#[tokio::test]
async fn status_lists_every_semaphore_and_its_holders() -> TestResult {
    let db = support::migrated_db().await;
    let payments = Semaphore::builder("payments", 3)
        .lease(Duration::from_secs(600))
        .build(&db.client)
        .await?;
    Semaphore::builder("idle", 2).build(&db.client).await?;
    let a = payments
        .acquiring()
        .holder("worker-a")
        .try_acquire()
        .await?;
    let b = payments
        .acquiring()
        .holder("worker-b")
        .try_acquire()
        .await?;

    let out = run(&db, &["status"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    let row = |name: &str| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row for {name}:\n{text}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    // SEMAPHORE CAPACITY HELD FREE LEASE
    assert_eq!(row("payments")[1..4], ["3", "2", "1"]);
    assert_eq!(row("idle")[1..4], ["2", "0", "2"]);
    for (permit, holder) in [(&a, "worker-a"), (&b, "worker-b")] {
        let line = row(&permit.id().to_string());
        assert_eq!(line[1], permit.slot().to_string(), "{text}");
        assert_eq!(line[2], holder, "{text}");
    }

    let out = run(&db, &["status", "payments", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let list = json.as_array().expect("an array");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["name"], "payments");
    assert_eq!(list[0]["capacity"], 3);
    assert_eq!(list[0]["default_lease_seconds"], 600.0);
    let holders = list[0]["holders"].as_array().expect("holders");
    let ids: Vec<i64> = holders.iter().map(|h| h["id"].as_i64().unwrap()).collect();
    assert_eq!(ids, [a.id(), b.id()]);
    assert_eq!(holders[0]["holder"], "worker-a");
    for h in holders {
        let age = h["age_seconds"].as_f64().unwrap();
        let left = h["lease_left_seconds"].as_f64().unwrap();
        assert!(age >= 0.0 && left > 0.0 && left <= 600.0, "{h}");
    }

    let out = run(&db, &["status", "no-such-semaphore"]).await;
    assert_status(&out, 3);
    a.release().await?;
    b.release().await?;
    Ok(())
}

/// `status` shows each lease holder's silence, the time since it last
/// renewed its lease: one that stopped renewing (built without a
/// heartbeat, as a dead process looks from the database) grows silent,
/// while a live one's heartbeat keeps its silence short.
#[tokio::test]
async fn status_shows_a_growing_silence_for_a_holder_that_stopped_renewing() -> TestResult {
    let db = support::migrated_db().await;
    let dead = Semaphore::builder("jobs", 3)
        .lease(Duration::from_secs(600))
        .without_heartbeat()
        .build(&db.client)
        .await?;
    let live = Semaphore::builder("jobs", 3)
        .heartbeat(Duration::from_millis(100))
        .build(&db.client)
        .await?;
    let stuck = dead.acquiring().holder("stuck").try_acquire().await?;
    let alive = live.acquiring().holder("alive").try_acquire().await?;

    let (before, _) = silences(&db).await?;
    assert!(before >= 0.0, "{before}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (after, renewing) = silences(&db).await?;
    assert!(
        after >= 2.0 && after >= before + 1.5,
        "silent {before} s, then {after} s after a 2 s sleep"
    );
    assert!(
        renewing < after,
        "the renewing holder is silent {renewing} s, the stuck one {after} s"
    );

    let out = run(&db, &["status"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    // CLAIM SLOT HOLDER AGE LEASE-LEFT SILENT
    let row = table_row(&text, "CLAIM", &stuck.id().to_string());
    assert_eq!(row[2], "stuck", "{text}");
    let silent: f64 = row[5]
        .strip_suffix('s')
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("SILENT is {:?}:\n{text}", row[5]));
    assert!(silent >= after, "{text}");
    stuck.release().await?;
    alive.release().await?;
    Ok(())
}

/// `status jobs --json`: the `silent_seconds` of the holders labelled
/// "stuck" and "alive".
async fn silences(db: &support::TestDb) -> TestResult<(f64, f64)> {
    let out = run(db, &["status", "jobs", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let silence = |holder: &str| {
        json[0]["holders"]
            .as_array()
            .and_then(|hs| hs.iter().find(|h| h["holder"] == holder))
            .and_then(|h| h["silent_seconds"].as_f64())
            .unwrap_or_else(|| panic!("no silent_seconds for {holder}: {json}"))
    };
    Ok((silence("stuck"), silence("alive")))
}

/// The cells of the table row whose first cell is `first`, in the table
/// under the header line that starts with `header`.
fn table_row(text: &str, header: &str, first: &str) -> Vec<String> {
    text.lines()
        .skip_while(|l| !l.trim_start().starts_with(header))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .find(|l| l.split_whitespace().next() == Some(first))
        .unwrap_or_else(|| panic!("no row {first:?} under {header:?}:\n{text}"))
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// The rows (cells split on whitespace) of the holders' table under the
/// line `heading`, or `None` when there is no such heading.
fn section(text: &str, heading: &str) -> Option<Vec<Vec<String>>> {
    let mut lines = text.lines().skip_while(|l| *l != heading);
    lines.next()?;
    Some(
        lines
            .skip(1) // the column headers
            .take_while(|l| !l.trim().is_empty())
            .map(|l| l.split_whitespace().map(str::to_owned).collect())
            .collect(),
    )
}

#[tokio::test]
async fn status_shows_advisory_semaphores_and_the_sessions_that_hold_them() -> TestResult {
    let db = support::migrated_db().await;
    let started: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT statement_timestamp()")
        .fetch_one(&db.pool)
        .await?;
    // The address the database sees for this test's connections (the
    // semaphore's sessions are made with the same options): `None` over a
    // Unix socket.
    let client: Option<String> = sqlx::query_scalar("SELECT host(inet_client_addr())")
        .fetch_one(&db.pool)
        .await?;
    let sem = AdvisorySemaphore::builder("exports", 3)
        .audit(false)
        .build(&db.client)
        .await?;

    // Only an advisory semaphore: it is listed, not "no semaphores yet".
    let out = run(&db, &["status"]).await;
    assert_status(&out, 0);
    assert_eq!(
        table_row(&stdout(&out), "ADVISORY SEMAPHORE", "exports")[1..4],
        ["3", "0", "3"]
    );

    let leased = Semaphore::builder("payments", 2).build(&db.client).await?;
    let a = sem.try_acquire().await?;
    let b = sem.try_acquire().await?;
    let lease_permit = leased.acquiring().holder("worker-a").try_acquire().await?;
    let pid_of = |slot: u32| {
        [&a, &b]
            .into_iter()
            .find(|p| p.slot() == slot)
            .map(|p| p.backend_pid())
            .unwrap_or_else(|| panic!("no permit holds slot {slot}"))
    };

    let out = run(&db, &["status"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    // Both kinds, each in its own table.
    assert_eq!(
        table_row(&text, "SEMAPHORE", "payments")[1..4],
        ["2", "1", "1"]
    );
    assert_eq!(
        table_row(&text, "ADVISORY SEMAPHORE", "exports")[1..4],
        ["3", "2", "1"]
    );
    // SLOT PID CLIENT CONNECTED-FOR APPLICATION: one row per held slot.
    let holders = section(&text, "exports (advisory):").expect("a holders table");
    let slots: Vec<&str> = holders.iter().map(|h| h[0].as_str()).collect();
    assert_eq!(slots, ["0", "1"], "{text}");
    for h in &holders {
        let slot: u32 = h[0].parse()?;
        assert_eq!(h[1], pid_of(slot).to_string(), "{text}");
        assert_eq!(h[2], client.as_deref().unwrap_or("local"), "{text}");
        assert_eq!(h[4..], ["pg-semaphore", "advisory"], "{text}");
    }

    // One name, of either kind.
    let out = run(&db, &["status", "exports"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    assert_eq!(
        table_row(&text, "ADVISORY SEMAPHORE", "exports")[1..4],
        ["3", "2", "1"]
    );
    assert!(!text.contains("payments"), "{text}");
    assert_eq!(
        section(&text, "exports (advisory):").map(|h| h.len()),
        Some(2)
    );

    // JSON: both kinds in one list, by name, each with its `kind`.
    let out = run(&db, &["status", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let list = json.as_array().expect("an array");
    assert_eq!(list.len(), 2, "{json}");
    assert_eq!(list[1]["name"], "payments");
    assert_eq!(list[1]["kind"], "lease", "{json}");
    assert_eq!(list[1]["holders"][0]["id"], lease_permit.id());
    let exports = &list[0];
    assert_eq!(exports.get("default_lease_seconds"), None, "{json}");
    assert_eq!(exports["kind"], "advisory");
    assert_eq!(exports["name"], "exports");
    assert_eq!(exports["capacity"], 3);
    assert_eq!(exports["held"], 2);
    let as_of: chrono::DateTime<chrono::Utc> = exports["as_of"].as_str().unwrap().parse()?;
    let holders = exports["holders"].as_array().expect("holders");
    assert_eq!(holders.len(), 2);
    for (h, slot) in holders.iter().zip([0, 1]) {
        assert_eq!(h["slot"], slot, "{h}");
        assert_eq!(h["kind"], "advisory", "{h}");
        assert_eq!(h.get("age_seconds"), None, "{h}");
        assert_eq!(h["pid"], pid_of(slot), "{h}");
        assert_eq!(h["application_name"], "pg-semaphore advisory", "{h}");
        assert_eq!(h["client_addr"].as_str(), client.as_deref(), "{h}");
        // The session was opened by this test, before the listing.
        let connected: chrono::DateTime<chrono::Utc> =
            h["backend_start"].as_str().expect("visible").parse()?;
        assert!(started <= connected && connected <= as_of, "{h}");
    }

    let out = run(&db, &["status", "exports", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json.as_array().map(Vec::len), Some(1), "{json}");
    assert_eq!(json[0]["kind"], "advisory");

    // Released: nothing held, no holders table.
    a.release().await?;
    b.release().await?;
    let out = run(&db, &["status"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    assert_eq!(
        table_row(&text, "ADVISORY SEMAPHORE", "exports")[1..4],
        ["3", "0", "3"]
    );
    assert_eq!(section(&text, "exports (advisory):"), None, "{text}");
    let out = run(&db, &["status", "exports", "--json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json[0]["held"], 0);
    assert_eq!(json[0]["holders"], serde_json::json!([]));
    lease_permit.release().await?;
    Ok(())
}

/// Three completed claims, one timed out, one live (holder label with a comma).
async fn some_history(db: &support::TestDb) -> Result<(Semaphore, pg_semaphore::Permit), Error> {
    let sem = Semaphore::builder("audited", 5)
        .lease(Duration::from_secs(600))
        .build(&pg_semaphore::Client::new(db.pool.clone()))
        .await?;
    for i in 0..3 {
        sem.acquiring()
            .holder(format!("job-{i}"))
            .try_acquire()
            .await?
            .release()
            .await?;
    }
    // A holder that died: nothing renews its lease, which alone frees the slot.
    let dead_process = Semaphore::builder("audited", 5)
        .without_heartbeat()
        .build(&pg_semaphore::Client::new(db.pool.clone()))
        .await?;
    let doomed = dead_process
        .acquiring()
        .holder("crashed")
        .lease(Duration::from_millis(10))
        .try_acquire()
        .await?;
    std::mem::forget(doomed);
    wait_until_expired(db).await;
    assert_eq!(pg_semaphore::admin::reap(&db.pool).await?, 1);
    let live = sem
        .acquiring()
        .holder("web-1, pid 7")
        .metadata(serde_json::json!({ "request": "r-1" }))
        .try_acquire()
        .await?;
    Ok((sem, live))
}

/// Waits (on the database clock) until every live claim with a short lease has expired.
async fn wait_until_expired(db: &support::TestDb) {
    for _ in 0..500 {
        let pending: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pgsemaphore.slots
              WHERE completed_at IS NULL AND timed_out_at IS NULL
                AND expires_at - created_at < interval '1 second'
                AND expires_at > clock_timestamp()",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if pending == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("a 10 ms lease never expired");
}

#[tokio::test]
async fn audit_prints_the_window_as_a_table_json_or_csv() -> TestResult {
    let db = support::migrated_db().await;
    let (_sem, live) = some_history(&db).await?;

    let out = run(&db, &["audit", "audited"]).await; // default: the last hour
    assert_status(&out, 0);
    let text = stdout(&out);
    for holder in ["job-0", "job-1", "job-2", "crashed", "web-1, pid 7"] {
        assert!(text.contains(holder), "{holder} missing:\n{text}");
    }
    assert!(text.contains("timed_out"), "{text}");
    assert!(
        text.contains("5 claims: 3 completed, 1 timed out, 1 live"),
        "{text}"
    );
    assert!(text.contains("p50") && text.contains("p95"), "{text}");

    let out = run(&db, &["audit", "audited", "--last", "1h", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let claims = json["claims"].as_array().expect("claims");
    assert_eq!(claims.len(), 5);
    let outcomes: Vec<&str> = claims
        .iter()
        .map(|c| c["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(
        outcomes,
        ["completed", "completed", "completed", "timed_out", "live"]
    );
    assert_eq!(claims[4]["id"], live.id());
    assert_eq!(claims[4]["metadata"]["request"], "r-1");
    assert_eq!(claims[4]["ended_at"], serde_json::Value::Null);
    let summary = &json["summary"];
    assert_eq!(
        (
            summary["total"].clone(),
            summary["completed"].clone(),
            summary["timed_out"].clone(),
            summary["live"].clone()
        ),
        (5.into(), 3.into(), 1.into(), 1.into())
    );
    let p50 = summary["p50_hold_seconds"]
        .as_f64()
        .expect("p50 over 4 finished claims");
    let p95 = summary["p95_hold_seconds"].as_f64().expect("p95");
    assert!(p50 <= p95, "{summary}");

    let out = run(&db, &["audit", "audited", "--csv"]).await;
    assert_status(&out, 0);
    let csv = stdout(&out);
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(
        lines[0],
        "id,slot,holder,claimed_at,expires_at,ended_at,outcome,held_seconds,metadata"
    );
    assert_eq!(lines.len(), 6, "{csv}");
    let last = lines[5];
    assert!(last.starts_with(&format!("{},", live.id())), "{last}");
    assert!(last.contains(",\"web-1, pid 7\","), "{last}");
    assert!(last.contains(",live,"), "{last}");
    assert!(
        last.ends_with("\"{\"\"request\"\":\"\"r-1\"\"}\""),
        "{last}"
    );

    // A window that ended before any of it.
    let out = run(
        &db,
        &[
            "audit", "audited", "--since", "3d", "--until", "2d", "--json",
        ],
    )
    .await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["claims"].as_array().unwrap().len(), 0);
    assert_eq!(json["summary"]["total"], 0);
    assert_eq!(json["summary"]["p50_hold_seconds"], serde_json::Value::Null);

    let out = run(&db, &["audit", "audited", "--since", "1d", "--until", "2d"]).await;
    assert_status(&out, 2);
    assert!(
        stderr(&out).contains("before it starts"),
        "{}",
        stderr(&out)
    );

    let out = run(&db, &["audit", "never-built"]).await;
    assert_status(&out, 3);
    assert!(stderr(&out).contains("never-built"), "{}", stderr(&out));
    live.release().await?;
    Ok(())
}

/// `audit` of a family key that nobody holds (`status` no longer lists it)
/// reads its history, as `report` does: the reaper keeps a key while it has
/// claims on record. A key with none, which the reaper removed, and a key
/// of no family, each say so (exit status 3).
#[tokio::test]
async fn audit_of_an_idle_family_key_lists_its_history() -> TestResult {
    let db = support::migrated_db().await;
    let tenants = SemaphoreFamily::builder("tenants", 2)
        .idle_after(Duration::ZERO)
        .build(&db.client.clone().holder("worker-1"))
        .await?;
    for _ in 0..2 {
        tenants.try_acquire("t1").await?.release().await?;
    }
    tenants.key("t-unused").await?;
    pg_semaphore::admin::reap(&db.pool).await?;
    let families = pg_semaphore::admin::families(&db.pool).await?;
    assert_eq!(families[0].keys, 1, "t1 stays, t-unused is removed");
    let out = run(&db, &["status"]).await;
    assert!(!stdout(&out).contains("@tenants/t1"), "{}", stdout(&out));

    let out = run(&db, &["audit", "@tenants/t1"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    assert!(text.contains("worker-1"), "{text}");
    assert!(text.contains("2 claims: 2 completed"), "{text}");
    let out = run(&db, &["audit", "@tenants/t1", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["claims"].as_array().map(Vec::len), Some(2), "{json}");
    assert_eq!(json["summary"]["completed"], 2);
    let out = run(&db, &["audit", "@tenants/t1", "--csv"]).await;
    assert_status(&out, 0);
    assert_eq!(stdout(&out).lines().count(), 3, "{}", stdout(&out));

    let out = run(&db, &["audit", "@tenants/t-unused"]).await;
    assert_status(&out, 3);
    assert!(
        stderr(&out).contains("no history of key \"t-unused\" of family \"tenants\""),
        "{}",
        stderr(&out)
    );
    let out = run(&db, &["report", "@tenants/t-unused", "--html", "-"]).await;
    assert_status(&out, 3);
    assert!(
        stderr(&out).contains("no history of key"),
        "{}",
        stderr(&out)
    );
    let out = run(&db, &["audit", "@nobody/t1"]).await;
    assert_status(&out, 3);
    assert!(
        stderr(&out).contains("no semaphore family named \"nobody\""),
        "{}",
        stderr(&out)
    );
    Ok(())
}

/// An advisory semaphore "exports" (capacity 3, holder "batch-1") with
/// three finished permits in its audit log, the writer flushed: one
/// released on slot 0, one of two slots dropped, and one lost 10 minutes
/// ago on slot 2 (3 s, metadata `{"job": "j-9"}`, as a dead session's
/// writer left it); and a fourth permit, still held, returned.
async fn advisory_history(
    db: &support::TestDb,
) -> TestResult<(AdvisorySemaphore, pg_semaphore::AdvisoryPermit)> {
    let sem = AdvisorySemaphore::builder("exports", 3)
        .build(&pg_semaphore::Client::new(db.pool.clone()).holder("batch-1"))
        .await?;
    sem.try_acquire().await?.release().await?;
    drop(sem.try_acquire_many(2).await?);
    sqlx::query(
        "SELECT pgsemaphore.advisory_log(
             p_semaphores => '{exports}', p_holders => '{\"crashed, pid 7\"}',
             p_slot_counts => '{1}', p_slots => '{2}',
             p_metadata => ARRAY[jsonb_build_object('job', 'j-9')],
             p_acquired_at => ARRAY[now() - interval '10 minutes'],
             p_ended_at => ARRAY[now() - interval '10 minutes' + interval '3 seconds'],
             p_outcomes => '{lost}')",
    )
    .execute(&db.pool)
    .await?;
    let logged = support::advisory_rows_logged(&db.pool, "exports", 3).await;
    assert!(logged, "the audit writer did not log both permits");
    let live = sem.try_acquire().await?;
    Ok((sem, live))
}

#[tokio::test]
async fn audit_of_an_advisory_semaphore_lists_its_finished_permits() -> TestResult {
    let db = support::migrated_db().await;
    let (_sem, live) = advisory_history(&db).await?;

    let out = run(&db, &["audit", "exports"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    assert!(
        text.starts_with("finished permits of \"exports\" (advisory)"),
        "{text}"
    );
    // SLOTS HOLDER CLAIMED ENDED OUTCOME HELD, in the order acquired.
    assert_eq!(
        table_row(&text, "SLOTS", "2")[1..3],
        ["crashed,", "pid"],
        "{text}"
    );
    assert_eq!(
        table_row(&text, "SLOTS", "2")[6..],
        ["lost", "3.0s"],
        "{text}"
    );
    assert_eq!(table_row(&text, "SLOTS", "0")[1], "batch-1", "{text}");
    assert_eq!(table_row(&text, "SLOTS", "0")[4], "released", "{text}");
    assert_eq!(table_row(&text, "SLOTS", "0,1")[4], "dropped", "{text}");
    assert!(
        text.contains("3 permits: 1 released, 1 dropped, 1 lost"),
        "{text}"
    );
    // What the log does not hold, and where to look.
    assert!(text.contains("pg-semaphore status"), "{text}");
    assert!(text.contains("no claim id and no lease"), "{text}");

    let out = run(&db, &["audit", "exports", "--last", "1h", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["semaphore"], "exports");
    assert_eq!(json["kind"], "advisory");
    let claims = json["claims"].as_array().expect("claims");
    let seen: Vec<(serde_json::Value, &str)> = claims
        .iter()
        .map(|c| (c["slots"].clone(), c["outcome"].as_str().unwrap()))
        .collect();
    assert_eq!(
        seen,
        [
            (serde_json::json!([2]), "timed_out"),
            (serde_json::json!([0]), "completed"),
            (serde_json::json!([0, 1]), "dropped"),
        ]
    );
    // The lease's field names and outcomes; no id, no lease.
    let lost = claims[0].as_object().unwrap();
    let mut keys: Vec<&str> = lost.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "claimed_at",
            "ended_at",
            "held_seconds",
            "holder",
            "kind",
            "metadata",
            "outcome",
            "slots"
        ]
    );
    assert_eq!(lost["holder"], "crashed, pid 7");
    assert_eq!(lost["metadata"]["job"], "j-9");
    assert_eq!(lost["held_seconds"], 3.0);
    let summary = &json["summary"];
    let counts: Vec<Option<u64>> = ["total", "completed", "dropped", "timed_out", "live"]
        .iter()
        .map(|key| summary[key].as_u64())
        .collect();
    assert_eq!(
        counts,
        [Some(3), Some(1), Some(1), Some(1), None],
        "{summary}"
    );
    assert_eq!(summary["max_hold_seconds"], 3.0);

    let out = run(&db, &["audit", "exports", "--csv"]).await;
    assert_status(&out, 0);
    let csv = stdout(&out);
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(
        lines[0],
        "slots,holder,claimed_at,ended_at,outcome,held_seconds,metadata"
    );
    assert_eq!(lines.len(), 4, "{csv}");
    assert!(lines[1].starts_with("2,\"crashed, pid 7\","), "{csv}");
    assert!(lines[3].starts_with("0 1,batch-1,"), "{csv}");

    // A window before any of it.
    let out = run(&db, &["audit", "exports", "--since", "3d", "--until", "2d"]).await;
    assert_status(&out, 0);
    assert!(stdout(&out).contains("(none)"), "{}", stdout(&out));
    live.release().await?;
    Ok(())
}

#[tokio::test]
async fn reap_times_out_expired_claims() -> TestResult {
    let db = support::migrated_db().await;
    // No heartbeat: the forgotten claim below stands for a process that died.
    let sem = Semaphore::builder("reaped", 2)
        .without_heartbeat()
        .build(&db.client)
        .await?;
    let keep = sem
        .acquiring()
        .lease(Duration::from_secs(600))
        .try_acquire()
        .await?;
    std::mem::forget(
        sem.acquiring()
            .lease(Duration::from_millis(10))
            .try_acquire()
            .await?,
    );
    wait_until_expired(&db).await;

    let out = run(&db, &["reap"]).await;
    assert_status(&out, 0);
    assert_eq!(stdout(&out).trim(), "reaped 1 expired claim");
    let out = run(&db, &["reap"]).await;
    assert_status(&out, 0);
    assert_eq!(stdout(&out).trim(), "reaped 0 expired claims");
    assert_eq!(sem.available_permits().await?, 1);
    keep.release().await?;
    Ok(())
}

#[tokio::test]
async fn release_frees_a_stuck_slot_and_its_holder_learns_it() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("stuck", 1)
        .lease(Duration::from_secs(3600))
        .build(&db.client)
        .await?;
    let stuck = sem.try_acquire().await?;
    assert!(matches!(
        sem.try_acquire().await,
        Err(Error::NoSlotsAvailable { .. })
    ));

    let id = stuck.id().to_string();
    let out = run(&db, &["release", "--id", &id]).await;
    assert_status(&out, 0);
    assert!(
        stdout(&out).contains(&format!("released claim {id} of \"stuck\"")),
        "{}",
        stdout(&out)
    );
    let next = sem.try_acquire().await?; // the slot is free at once
    match stuck.release().await {
        Err(Error::PermitLost {
            reason: LostReason::AlreadyReleased { .. },
            ..
        }) => {}
        other => panic!("the stuck holder must learn it lost its slot: {other:?}"),
    }

    let out = run(&db, &["release", "--id", &id]).await; // again: nothing to do
    assert_status(&out, 0);
    assert!(
        stdout(&out).contains("already been released"),
        "{}",
        stdout(&out)
    );

    let out = run(&db, &["release", "--id", "987654321"]).await;
    assert_status(&out, 3);
    assert!(
        stderr(&out).contains("no claim 987654321"),
        "{}",
        stderr(&out)
    );
    next.release().await?;
    Ok(())
}

#[tokio::test]
async fn set_capacity_changes_the_capacity_and_keeps_the_lease() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("resized", 1)
        .lease(Duration::from_secs(45))
        .build(&db.client)
        .await?;
    let held = sem.try_acquire().await?;
    // A waiter is woken by the capacity growing, not by a release.
    let waiter = {
        let sem = sem.clone();
        tokio::spawn(async move {
            sem.acquiring()
                .timeout(Duration::from_secs(60))
                .acquire()
                .await
        })
    };

    let out = run(&db, &["set-capacity", "resized", "3"]).await;
    assert_status(&out, 0);
    assert_eq!(stdout(&out).trim(), "resized: capacity 1 -> 3");
    let second = waiter.await??;
    let info = pg_semaphore::admin::semaphores(&db.pool).await?;
    assert_eq!(info[0].capacity, 3);
    assert_eq!(info[0].default_lease, Some(Duration::from_secs(45)));
    assert_eq!(info[0].holders.len(), 2);

    let out = run(&db, &["set-capacity", "missing", "3"]).await;
    assert_status(&out, 3);
    let out = run(&db, &["set-capacity", "resized", "0"]).await;
    assert_status(&out, 2);
    assert!(stderr(&out).contains("capacity"), "{}", stderr(&out));
    assert_eq!(
        pg_semaphore::admin::semaphores(&db.pool).await?[0].capacity,
        3
    );
    held.release().await?;
    second.release().await?;
    Ok(())
}

#[tokio::test]
async fn clear_queue_removes_every_waiter() -> TestResult {
    let db = support::migrated_db().await;
    let sem = Semaphore::builder("cleared", 1).build(&db.client).await?;
    for tag in ["squatter-one-tok", "squatter-two-tok"] {
        sqlx::query(
            "SELECT * FROM pgsemaphore.enqueue(p_semaphore => 'cleared', p_permits => 1, p_priority => 1::smallint, p_holder => 'squatter', p_limit => NULL, p_waiter_lease => '60 s', p_token => $1)",
        )
        .bind(tag.as_bytes())
        .execute(&db.pool)
        .await?;
    }
    assert!(
        sem.try_acquire().await.is_err(),
        "the queue blocks plain claims"
    );
    let out = run(&db, &["clear-queue", "cleared"]).await;
    assert_status(&out, 0);
    assert_eq!(
        stdout(&out).trim(),
        "cleared: removed 2 waiters from the queue"
    );
    sem.try_acquire().await?.release().await?;
    let out = run(&db, &["clear-queue", "missing"]).await;
    assert_status(&out, 3);
    Ok(())
}

/// `fair-weight`: the operator weighs a fairness key; the queue's next
/// waiters of that key are placed by the new weight (two in one turn);
/// an unknown semaphore is exit status 3, a weight of 0 a usage error.
#[tokio::test]
async fn fair_weight_sets_a_keys_weight_in_the_queue() -> TestResult {
    let db = support::migrated_db().await;
    Semaphore::builder("weighed", 1).build(&db.client).await?;
    let out = run(&db, &["fair-weight", "weighed", "--key", "tenant-7", "2"]).await;
    assert_status(&out, 0);
    assert_eq!(
        stdout(&out).trim(),
        "weighed: key \"tenant-7\": weight 1 -> 2"
    );
    let mut turns = Vec::new();
    for tag in ["weighed-waiter-1", "weighed-waiter-2", "weighed-waiter-3"] {
        let (turn,): (i64,) = sqlx::query_as(
            "SELECT o_turn FROM pgsemaphore.enqueue(p_semaphore => 'weighed', p_permits => 1, \
             p_priority => 1::smallint, p_holder => 'w', p_limit => NULL, \
             p_waiter_lease => '60 s', p_token => $1, p_fair_key => 'tenant-7')",
        )
        .bind(tag.as_bytes())
        .fetch_one(&db.pool)
        .await?;
        turns.push(turn);
    }
    assert_eq!(
        turns,
        [0, 0, 1],
        "weight 2: two waiters of the key per turn"
    );
    let out = run(&db, &["fair-weight", "weighed", "1"]).await;
    assert_status(&out, 0);
    assert_eq!(
        stdout(&out).trim(),
        "weighed: the default key: weight 1 -> 1"
    );
    assert_status(&run(&db, &["fair-weight", "missing", "2"]).await, 3);
    assert_status(&run(&db, &["fair-weight", "weighed", "0"]).await, 2);
    Ok(())
}

#[tokio::test]
async fn prune_deletes_finished_claims_only() -> TestResult {
    let db = support::migrated_db().await;
    let (sem, live) = some_history(&db).await?;

    let out = run(&db, &["prune", "--older-than", "30d"]).await;
    assert_status(&out, 0);
    assert_eq!(
        stdout(&out).trim(),
        "deleted 0 finished claims that ended more than 30d00h ago"
    );
    let out = run(&db, &["prune", "--older-than", "0s"]).await;
    assert_status(&out, 0);
    assert!(
        stdout(&out).starts_with("deleted 4 finished claims"),
        "{}",
        stdout(&out)
    );
    let holders = sem.holders().await?;
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0].id, Some(live.id()));
    live.release().await?;
    Ok(())
}

#[tokio::test]
async fn doctor_names_the_session_that_holds_back_vacuum() -> TestResult {
    let db = support::migrated_db().await;
    let out = run(&db, &["doctor"]).await;
    assert_status(&out, 0);
    assert!(
        stdout(&out).starts_with("xmin horizon: not held"),
        "{}",
        stdout(&out)
    );
    let out = run(&db, &["doctor", "--json"]).await;
    assert_status(&out, 0);
    assert_eq!(stdout(&out).trim(), "null");

    let (mut idle, pid) = support::idle_in_transaction(&db.options, "cron-export").await?;
    let out = run(&db, &["doctor"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    assert!(text.starts_with("xmin horizon: held for "), "{text}");
    assert!(
        text.contains(&format!("by pid {pid} (application \"cron-export\", user ")),
        "{text}"
    );
    assert!(text.contains(", idle in transaction), "), "{text}");
    assert!(
        text.contains(&format!("SELECT pg_terminate_backend({pid});")),
        "{text}"
    );
    let out = run(&db, &["doctor", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_str(&stdout(&out))?;
    assert_eq!(json["kind"], "session");
    assert_eq!(json["pid"], pid);
    assert_eq!(json["application_name"], "cron-export");
    assert_eq!(json["state"], "idle in transaction");
    assert!(json["held_for_seconds"].as_f64().is_some(), "{json}");
    sqlx::raw_sql("ROLLBACK").execute(&mut idle).await?;
    Ok(())
}

#[tokio::test]
async fn audit_shows_which_claims_a_multi_limit_permit_took_together() -> TestResult {
    let db = support::migrated_db().await;
    let global = Semaphore::builder("linked-global", 4)
        .build(&db.client)
        .await?;
    let merchant = Semaphore::builder("linked-merchant", 2)
        .build(&db.client)
        .await?;
    let single = global.try_acquire().await?;
    let both = Semaphore::try_acquire_all(&[(&merchant, 1), (&global, 1)]).await?;
    let group = both.id();

    let out = run(&db, &["audit", "linked-global"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    assert!(text.contains("GROUP"), "no GROUP column:\n{text}");
    let row = text
        .lines()
        .find(|line| line.starts_with(&group.to_string()))
        .unwrap_or_else(|| panic!("no row of claim {group}:\n{text}"));
    assert!(row.trim_end().ends_with(&group.to_string()), "{row}");

    let out = run(&db, &["audit", "linked-merchant", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["claims"][0]["group_id"], group);
    let out = run(&db, &["audit", "linked-global", "--json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(
        json["claims"][0].get("group_id"),
        None,
        "a single claim has no group"
    );
    both.release().await?;
    single.release().await?;
    Ok(())
}

/// `limits`: the operator stores a limit, a pause, lists them, and the
/// limiters of the application obey; clear and resume undo them; a bad
/// combination of flags is a usage error.
#[tokio::test]
async fn limits_stores_lists_pauses_and_clears_rate_limits() -> TestResult {
    let db = support::migrated_db().await;
    let limiter = pg_semaphore::RateLimiter::builder(
        "partner-api",
        pg_semaphore::RatePolicy::token_bucket(0.001, 10),
    )
    .build(&db.client)?;
    let out = run(
        &db,
        &[
            "limits",
            "set",
            "token-bucket",
            "partner-api",
            "--rate",
            "0.001",
            "--burst",
            "2",
        ],
    )
    .await;
    assert_status(&out, 0);
    assert_eq!(
        stdout(&out).trim(),
        "token_bucket partner-api: stored rate 0.001/s, burst 2"
    );
    let allowed = [
        limiter.check("k", 1).await?.allowed,
        limiter.check("k", 1).await?.allowed,
        limiter.check("k", 1).await?.allowed,
    ];
    assert_eq!(
        allowed,
        [true, true, false],
        "the stored burst of 2 applies"
    );

    let out = run(
        &db,
        &[
            "limits",
            "pause",
            "token-bucket",
            "partner-api",
            "--key",
            "tenant-7",
            "--for",
            "30s",
        ],
    )
    .await;
    assert_status(&out, 0);
    assert!(stdout(&out).starts_with("token_bucket partner-api key \"tenant-7\": paused until "));
    assert!(!limiter.check("tenant-7", 1).await?.allowed);

    let out = run(&db, &["limits", "list"]).await;
    assert_status(&out, 0);
    let listed = stdout(&out);
    assert!(listed.contains("rate 0.001/s, burst 2"), "{listed}");
    assert!(listed.contains("(all keys)"), "{listed}");
    assert!(
        listed.contains("tenant-7") && listed.contains("left)"),
        "{listed}"
    );
    let out = run(&db, &["limits", "list", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_str(&stdout(&out))?;
    assert_eq!(json[0]["kind"], "token_bucket");
    assert_eq!(json[0]["limit"]["burst"], 2);
    assert_eq!(json[0]["limit"]["kind"], "token_bucket");
    assert_eq!(json[1]["key"], "tenant-7");

    let out = run(
        &db,
        &[
            "limits",
            "resume",
            "token-bucket",
            "partner-api",
            "--key",
            "tenant-7",
        ],
    )
    .await;
    assert_status(&out, 0);
    assert_eq!(
        stdout(&out).trim(),
        "token_bucket partner-api key \"tenant-7\": resumed"
    );
    assert!(limiter.check("tenant-7", 1).await?.allowed);
    let out = run(&db, &["limits", "clear", "token-bucket", "partner-api"]).await;
    assert_status(&out, 0);
    assert_eq!(
        stdout(&out).trim(),
        "token_bucket partner-api: stored limits cleared"
    );
    let out = run(&db, &["limits", "list"]).await;
    assert!(
        stdout(&out).starts_with("no stored rate limits"),
        "{}",
        stdout(&out)
    );

    for bad in [
        &[
            "limits",
            "set",
            "token-bucket",
            "x",
            "--permit-limit",
            "5",
            "--window",
            "1h",
        ][..],
        &[
            "limits",
            "set",
            "fixed-window",
            "x",
            "--rate",
            "1",
            "--burst",
            "1",
        ],
        &["limits", "pause", "token-bucket", "x", "--for", "2h"],
        &[
            "limits",
            "set",
            "leaky-bucket",
            "x",
            "--rate",
            "1",
            "--burst",
            "1",
        ],
    ] {
        let out = run(&db, bad).await;
        assert_status(&out, 2);
    }
    Ok(())
}

/// `families`, `family NAME`, `rule set/remove` and `tier set/remove`: an
/// operator sees each family with its rules, the busiest keys with their
/// holders, and changes rules at run time, for existing keys too.
#[tokio::test]
async fn families_show_rules_and_busiest_keys_and_rules_change_at_run_time() -> TestResult {
    let db = support::migrated_db().await;
    let out = run(&db, &["families"]).await;
    assert_status(&out, 0);
    assert_eq!(stdout(&out).trim(), "no semaphore families yet");

    let tenants = SemaphoreFamily::builder("tenants", 10)
        .build(&db.client.clone().holder("worker-1"))
        .await?;
    let out = run(&db, &["rule", "set", "tenants", "--tier", "premium", "50"]).await;
    assert_status(&out, 0);
    let out = run(&db, &["tier", "set", "tenants", "t-42", "premium"]).await;
    assert_status(&out, 0);
    let busy = [
        tenants.try_acquire("t-42").await?,
        tenants.try_acquire("t-42").await?,
        tenants.try_acquire("t-1").await?,
    ];
    assert_eq!(tenants.key("t-42").await?.capacity(), 50);

    let out = run(&db, &["rule", "set", "tenants", "--key", "t-1", "1"]).await;
    assert_status(&out, 0);
    assert_eq!(
        stdout(&out).trim(),
        "tenants: key \"t-1\" -> capacity 1 (1 existing key changed)"
    );
    assert!(matches!(
        tenants.try_acquire("t-1").await,
        Err(Error::NoSlotsAvailable { .. })
    ));

    let out = run(&db, &["families"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    assert!(
        text.contains("FAMILY") && text.contains("tenants"),
        "{text}"
    );
    // `status` lists a family's keys only while they are held.
    tenants.key("t-idle").await?;
    let out = run(&db, &["status"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    assert!(
        text.contains("@tenants/t-42") && !text.contains("t-idle"),
        "{text}"
    );

    let out = run(&db, &["family", "tenants", "--top", "1"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    assert!(
        text.contains("premium") && text.contains("t-1"),
        "rules: {text}"
    );
    assert!(
        text.contains("t-42") && text.contains("worker-1"),
        "busiest: {text}"
    );
    let busiest = text.split("busiest keys:").nth(1).unwrap_or_default();
    assert!(
        !busiest.contains("t-1"),
        "--top 1 shows the busiest key only: {text}"
    );

    let out = run(&db, &["family", "tenants", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_str(&stdout(&out))?;
    assert_eq!(json["family"]["default_capacity"], 10);
    assert_eq!(json["busiest_keys"][0]["key"], "t-42");
    assert_eq!(json["busiest_keys"][0]["held"], 2);
    assert_eq!(json["busiest_keys"][0]["holders"][0]["holder"], "worker-1");

    let out = run(&db, &["rule", "remove", "tenants", "--key", "t-1"]).await;
    assert_status(&out, 0);
    let out = run(&db, &["tier", "remove", "tenants", "t-42"]).await;
    assert_status(&out, 0);
    assert_eq!(
        pg_semaphore::admin::busiest_keys(&db.pool, "tenants", 10).await?[0].capacity,
        10,
        "t-42 is back to the default"
    );
    let out = run(&db, &["family", "nobody"]).await;
    assert_status(&out, 3);
    let out = run(&db, &["rule", "set", "nobody", "--key", "k", "2"]).await;
    assert_status(&out, 3);
    let out = run(&db, &["rule", "set", "tenants", "--key", "k", "0"]).await;
    assert_status(&out, 2);
    for permit in busy {
        permit.release().await?;
    }
    Ok(())
}

/// A URL for `db` as `role` (a test role's password).
fn url_as(db: &support::TestDb, role: &str) -> String {
    format!(
        "postgres://{role}:{}@{}:{}/{}",
        support::roles::PASSWORD,
        db.options.get_host(),
        db.options.get_port(),
        db.name
    )
}

#[tokio::test]
async fn grant_gives_a_role_its_part_in_one_command() -> TestResult {
    let db = support::migrated_db().await;
    let roles = support::roles::Roles::create(&db, &["app"]).await?;
    let app = roles.name("app");

    let out = run(&db, &["grant"]).await;
    assert_status(&out, 2); // one of --application, --operator
    let out = run(&db, &["grant", "--application", &app]).await;
    assert_status(&out, 0);
    assert!(
        stdout(&out).contains(&format!("granted the application part to {app:?}")),
        "{}",
        stdout(&out)
    );

    // The application works with that grant alone...
    let pool = roles.pool(&db, "app").await?;
    let sem = Semaphore::builder("granted", 1)
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await?;
    sem.try_acquire().await?.release().await?;
    pool.close().await;
    // ...and an operator's command run with it says which grant it lacks.
    let out = run_in(
        None,
        Some(&url_as(&db, &app)),
        &["set-capacity", "granted", "3"],
    )
    .await;
    assert_ne!(out.status.code(), Some(0));
    let error = stderr(&out);
    assert!(error.contains("operator's function"), "{error}");
    assert!(error.contains("pg-semaphore grant --operator"), "{error}");

    // Only the schema's owner grants.
    let out = run_in(
        None,
        Some(&url_as(&db, &app)),
        &["grant", "--operator", &app],
    )
    .await;
    assert_ne!(out.status.code(), Some(0));
    roles.drop_all().await?;
    Ok(())
}

#[tokio::test]
async fn the_reaper_command_frees_an_abandoned_slot_and_stops_on_sigterm() -> TestResult {
    let db = support::migrated_db().await;
    Semaphore::builder("abandoned", 1).build(&db.client).await?;
    // A holder that vanished: a claim with a 200 ms lease, never renewed.
    support::claim_with_token(&db.pool, "abandoned", "200 ms", &support::token("gone")).await?;

    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_pg-semaphore"))
        .args(["reaper", "--every", "100ms"])
        .current_dir(support::cli::bare_dir())
        .env("DATABASE_URL", support::server::url_for(&db.name))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // Nobody claims "abandoned" again: only the reaper can free the slot.
    let freed = support::eventually(Duration::from_secs(20), || async {
        support::live_rows(&db.pool, "abandoned").await == 0
    })
    .await;
    let pid = child.id().expect("running").to_string();
    let killed = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await?;
    assert!(killed.success());
    let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("the reaper stops on SIGTERM")?;
    assert!(freed, "the reaper did not free the abandoned slot");
    assert_status(&out, 0);
    assert!(stdout(&out).contains("reaper stopped"), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("reaper running every 100ms"),
        "{}",
        stderr(&out)
    );
    Ok(())
}

#[tokio::test]
async fn status_lists_held_mutexes_by_name_and_not_advisory_semaphore_slots() -> TestResult {
    let db = support::migrated_db().await;
    let advisory = AdvisorySemaphore::builder("slots", 2)
        .build(&db.client)
        .await?;
    let slot = advisory.try_acquire().await?;
    let leader = pg_semaphore::Mutex::new("nightly-report")
        .locking()
        .lock_session(&db.client)
        .await?;
    let guard = pg_semaphore::Mutex::with_key_pair(-7, 9)
        .locking()
        .shared()
        .lock(&db.client)
        .await?;

    let out = run(&db, &["status", "--mutex", "nightly-report"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    let mutex_lines: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("MUTEX (ADVISORY LOCK)"))
        .skip(1)
        .collect();
    assert_eq!(
        mutex_lines.len(),
        2,
        "two locks, no semaphore slot:\n{text}"
    );
    assert!(
        mutex_lines.iter().any(|l| l.starts_with("nightly-report")
            && l.contains("held")
            && l.contains("exclusive")),
        "{text}"
    );
    assert!(
        mutex_lines
            .iter()
            .any(|l| l.starts_with("(-7, 9)") && l.contains("shared")),
        "{text}"
    );

    guard.commit().await?;
    leader.unlock().await?;
    slot.release().await?;
    let out = run(&db, &["status"]).await;
    assert!(!stdout(&out).contains("MUTEX"), "{}", stdout(&out));
    Ok(())
}

/// `status` shows what every semaphore, advisory semaphore, family and
/// rate limiter refused and timed out (and a limiter admitted) in the
/// minutes that overlap the last 60 s, from the outcome counters the
/// client wrote at its shutdown; and each rate limiter's stored limits,
/// pause, paused keys and keys.
#[tokio::test]
async fn status_shows_refusals_timeouts_and_the_rate_limiters() -> TestResult {
    let db = support::migrated_db().await;
    let client = pg_semaphore::Client::new(db.pool.clone());
    let api = Semaphore::builder("api", 1).build(&client).await?;
    let held = api.try_acquire().await?;
    for _ in 0..3 {
        assert!(api.try_acquire().await.is_err());
    }
    let waited = api
        .acquiring()
        .timeout(Duration::from_millis(20))
        .acquire()
        .await;
    assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");
    let exports = AdvisorySemaphore::builder("exports", 1)
        .audit(false)
        .build(&client)
        .await?;
    let exporting = exports.try_acquire().await?;
    assert!(exports.try_acquire().await.is_err());
    let tenants = SemaphoreFamily::builder("tenants", 1)
        .build(&client)
        .await?;
    let tenant = tenants.try_acquire("t1").await?;
    assert!(tenants.try_acquire("t1").await.is_err());
    assert!(tenants.try_acquire("t1").await.is_err());
    let partner = pg_semaphore::RateLimiter::builder(
        "partner",
        pg_semaphore::RatePolicy::token_bucket(0.001, 2),
    )
    .build(&client)?;
    for key in ["a", "a", "a", "b"] {
        let _ = partner.check(key, 1).await?;
    }
    partner.pause("b", Duration::from_secs(600)).await?;
    client.shutdown().await?;

    let out = run(&db, &["status"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    // SEMAPHORE CAPACITY HELD FREE LEASE REFUSED TIMED-OUT
    assert_eq!(
        table_row(&text, "SEMAPHORE", "api")[5..7],
        ["3", "1"],
        "{text}"
    );
    // A family key's row: counted under its family.
    assert_eq!(
        table_row(&text, "SEMAPHORE", "@tenants/t1")[5..7],
        ["-", "-"],
        "{text}"
    );
    // ADVISORY SEMAPHORE CAPACITY HELD FREE REFUSED TIMED-OUT
    let row = table_row(&text, "ADVISORY SEMAPHORE", "exports");
    assert_eq!(row[4..6], ["1", "0"], "{text}");
    // FAMILY DEFAULT KEYS REFUSED TIMED-OUT
    assert_eq!(
        table_row(&text, "FAMILY", "tenants")[1..5],
        ["1", "1", "2", "0"],
        "{text}"
    );
    // RATE LIMITER KIND LIMIT PAUSED PAUSED-KEYS KEYS ADMITTED REFUSED TIMED-OUT
    let row = table_row(&text, "RATE LIMITER", "partner");
    assert_eq!(
        row[1..],
        [
            "token_bucket",
            "0.001/s,burst=2",
            "-",
            "1",
            "2",
            "3",
            "1",
            "0"
        ],
        "{text}"
    );
    assert!(
        text.contains("REFUSED, TIMED OUT, ADMITTED: the minutes since"),
        "{text}"
    );

    // A limiter-wide pause shows with its end.
    pg_semaphore::admin::pause_rate_limit(
        &db.pool,
        pg_semaphore::admin::LimiterKind::TokenBucket,
        "partner",
        None,
        Duration::from_secs(300),
    )
    .await?;
    let out = run(&db, &["status", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let element = |kind: &str, name: &str| {
        json.as_array()
            .expect("an array")
            .iter()
            .find(|e| e["kind"] == kind && e["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}: {json}"))
            .clone()
    };
    let api = element("lease", "api");
    assert_eq!(
        (api["refused"].as_u64(), api["timed_out"].as_u64()),
        (Some(3), Some(1))
    );
    assert!(api["counted_since"].is_string());
    assert_eq!(
        element("lease", "@tenants/t1")["refused"],
        serde_json::Value::Null
    );
    assert_eq!(element("advisory", "exports")["refused"], 1);
    assert_eq!(element("family", "tenants")["refused"], 2);
    let limiter = element("rate_limiter", "partner");
    assert_eq!(limiter["limiter_kind"], "token_bucket");
    assert_eq!(limiter["limit"]["burst"], 2);
    assert!(limiter["paused_until"].is_string(), "{limiter}");
    assert_eq!(
        (
            limiter["paused_keys"].as_u64(),
            limiter["keys"].as_u64(),
            limiter["admitted"].as_u64(),
            limiter["refused"].as_u64(),
            limiter["timed_out"].as_u64()
        ),
        (Some(1), Some(2), Some(3), Some(1), Some(0))
    );
    // One semaphore's status: no family, no rate limiter.
    let out = run(&db, &["status", "api"]).await;
    assert_status(&out, 0);
    assert!(!stdout(&out).contains("RATE LIMITER"), "{}", stdout(&out));

    held.release().await?;
    exporting.release().await?;
    tenant.release().await?;
    Ok(())
}

/// `audit --limiter` prints a rate limiter's decisions per minute with its
/// stored limits (as a table, JSON or CSV); `report --limiter` draws them;
/// an unknown limiter is exit status 3, a name of several kinds needs
/// `--kind` (2); and a semaphore's audit says what it refused and timed out.
#[tokio::test]
async fn audit_and_report_show_a_rate_limiters_decisions_per_minute() -> TestResult {
    let db = support::migrated_db().await;
    let client = pg_semaphore::Client::new(db.pool.clone());
    let bucket = pg_semaphore::RateLimiter::builder(
        "partner",
        pg_semaphore::RatePolicy::token_bucket(0.001, 2),
    )
    .build(&client)?;
    for _ in 0..5 {
        let _ = bucket.check("k", 1).await?;
    }
    let waited = bucket
        .acquire_timeout("k", 1, Duration::from_millis(10))
        .await;
    assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");
    let api = Semaphore::builder("api", 1).build(&client).await?;
    let held = api.try_acquire().await?;
    assert!(api.try_acquire().await.is_err());
    client.shutdown().await?;

    let out = run(&db, &["audit", "--limiter", "partner", "--last", "10m"]).await;
    assert_status(&out, 0);
    let text = stdout(&out);
    assert!(
        text.starts_with("decisions of token_bucket rate limiter \"partner\""),
        "{text}"
    );
    assert!(
        text.contains("total: 2 admitted, 3 refused, 1 timed out"),
        "{text}"
    );
    assert!(
        text.contains("stored: limit rate 0.001/s, burst 2; not paused; 1 key"),
        "{text}"
    );

    let out = run(&db, &["audit", "--limiter", "partner", "--json"]).await;
    assert_status(&out, 0);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["kind"], "token_bucket");
    assert_eq!(
        json["total"],
        serde_json::json!({"admitted": 2, "refused": 3, "timed_out": 1})
    );
    assert_eq!(json["info"]["keys"], 1);
    let minutes = json["minutes"].as_array().expect("minutes");
    assert!(!minutes.is_empty() && minutes.len() <= 2, "{json}");

    let out = run(&db, &["audit", "--limiter", "partner", "--csv"]).await;
    assert_status(&out, 0);
    let csv = stdout(&out);
    assert!(
        csv.starts_with("minute,admitted,refused,timed_out\n"),
        "{csv}"
    );
    let sum: u64 = csv
        .lines()
        .skip(1)
        .map(|l| {
            l.split(',')
                .skip(1)
                .map(|n| n.parse::<u64>().unwrap())
                .sum::<u64>()
        })
        .sum();
    assert_eq!(sum, 6);

    let out = run(&db, &["report", "--limiter", "partner", "--html", "-"]).await;
    assert_status(&out, 0);
    let page = stdout(&out);
    assert!(page.contains("id=\"decisions\""), "the page has its chart");
    assert_eq!(page.matches("<script").count(), 2, "its data and its code");
    assert!(
        !page.contains("http://")
            || page.matches("http://").count()
                == page.matches("http://www.w3.org/2000/svg").count()
    );

    // The same name as a fixed window: --kind picks one.
    let window = pg_semaphore::RateLimiter::builder(
        "partner",
        pg_semaphore::RatePolicy::fixed_window(1, Duration::from_secs(60)),
    )
    .build(&client)?;
    let _ = window.check("k", 1).await?;
    let out = run(&db, &["audit", "--limiter", "partner"]).await;
    assert_status(&out, 2);
    assert!(stderr(&out).contains("pass --kind"), "{}", stderr(&out));
    let out = run(
        &db,
        &["audit", "--limiter", "partner", "--kind", "token-bucket"],
    )
    .await;
    assert_status(&out, 0);
    let out = run(&db, &["audit", "--limiter", "nobody"]).await;
    assert_status(&out, 3);
    let out = run(&db, &["report", "--limiter", "nobody", "--html", "-"]).await;
    assert_status(&out, 3);
    let out = run(&db, &["audit", "api", "--limiter", "partner"]).await;
    assert_status(&out, 2);

    // A semaphore's audit: its refusals and timeouts in the window.
    let out = run(&db, &["audit", "api", "--last", "10m"]).await;
    assert_status(&out, 0);
    assert!(
        stdout(&out).contains("requests refused at once: 1, timed out: 0"),
        "{}",
        stdout(&out)
    );
    let out = run(&db, &["audit", "api", "--json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["outcomes"][0]["refused"], 1, "{json}");
    held.release().await?;
    Ok(())
}
