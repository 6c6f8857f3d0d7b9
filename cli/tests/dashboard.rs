//! `pg-semaphore dashboard`, end to end: the real binary serves the live
//! dashboard on a loopback port, stops on SIGTERM, refuses a public address
//! without a token and checks the token it is given; headless Chromium
//! (driven over the DevTools protocol, `support::cdp`) shows a claim that
//! this test process makes within 2 s, and its release, shows a hostile
//! holder label as text, with no console error. Screenshots go to `target/dashboard/`.
//!
//! The browser test needs Chromium (the Debian package `chromium`); without
//! it, it prints how to get it and passes, unless
//! `PGSEMAPHORE_REQUIRE_TOOLS=1`.

mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use pg_semaphore::admin::{self, LimiterKind, RuleKind};
use pg_semaphore::{
    Client, Error, Mutex, QueueOrder, RateLimiter, RatePolicy, Semaphore, SemaphoreFamily,
};
use support::TestResult;
use support::cdp::Browser;
use support::cli::{assert_status, run, stderr};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// A holder label that would run if the page ever wrote one as markup.
const HOSTILE: &str = "<img src=x onerror=\"document.body.dataset.pwned='holder'\">";

/// `target/dashboard/`.
fn screenshots() -> PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory")
        .join("dashboard")
}

/// The binary serving the dashboard of `db` with `args`, and the base URL
/// it printed.
async fn serve(db: &support::TestDb, args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pg-semaphore"))
        .args(["dashboard", "--listen", "127.0.0.1:0"])
        .args(args)
        .current_dir(support::cli::bare_dir())
        .env("DATABASE_URL", support::server::url_for(&db.name))
        .env_remove("PGSEMAPHORE_DASHBOARD_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start pg-semaphore dashboard");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("it says where it listens within 30 s")
        .expect("its stderr")
        .expect("a line");
    let url = line
        .split("dashboard at ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    (child, url)
}

/// SIGTERM: the binary stops, with status 0.
async fn terminate(mut child: Child) -> TestResult {
    let pid = child.id().expect("running");
    let killed = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await?;
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("it stops within 10 s of SIGTERM")?;
    assert!(status.success(), "{status}");
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut out)
        .await?;
    assert_eq!(out, "dashboard stopped\n");
    Ok(())
}

/// `GET url` with extra header lines: the status code and the body.
async fn get(url: &str, headers: &str) -> TestResult<(u16, String)> {
    let rest = url.strip_prefix("http://").expect("an http URL");
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_owned()), |(h, p)| (h, format!("/{p}")));
    let mut stream = TcpStream::connect(host).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{headers}\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let code = response.get(9..12).unwrap_or_default().parse()?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((code, body))
}

#[tokio::test]
async fn it_serves_the_dashboard_and_stops_on_sigterm() -> TestResult {
    let db = support::migrated_db().await;
    let (child, url) = serve(&db, &[]).await;
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let (code, page) = get(&url, "").await?;
    assert_eq!(code, 200);
    assert!(page.contains("<title>pg-semaphore dashboard</title>"));
    let (code, snapshot) = get(&format!("{url}snapshot.json"), "").await?;
    assert_eq!(code, 200);
    let snapshot: serde_json::Value = serde_json::from_str(&snapshot)?;
    assert!(
        snapshot["semaphores"].is_array() && snapshot["error"].is_null(),
        "{snapshot}"
    );
    terminate(child).await
}

#[tokio::test]
async fn a_token_is_required_of_every_request_when_given() -> TestResult {
    let db = support::migrated_db().await;
    let (child, url) = serve(&db, &["--token", "s3cret-Token"]).await;
    assert_eq!(get(&url, "").await?.0, 401);
    assert_eq!(get(&format!("{url}snapshot.json"), "").await?.0, 401);
    assert_eq!(get(&url, "Authorization: Bearer wrong\r\n").await?.0, 401);
    assert_eq!(
        get(&url, "Authorization: Bearer s3cret-Token\r\n").await?.0,
        200
    );
    assert_eq!(
        get(&format!("{url}snapshot.json?token=s3cret-Token"), "")
            .await?
            .0,
        200
    );
    terminate(child).await
}

#[tokio::test]
async fn a_public_address_is_refused_without_a_token() -> TestResult {
    let db = support::migrated_db().await;
    let out = run(&db, &["dashboard", "--listen", "0.0.0.0:0"]).await;
    assert_status(&out, 2);
    assert!(stderr(&out).contains("without a token"), "{}", stderr(&out));
    let out = run(
        &db,
        &[
            "dashboard",
            "--listen",
            "127.0.0.1:0",
            "--token",
            "not a token",
        ],
    )
    .await;
    assert_status(&out, 2);
    Ok(())
}

/// What the page draws of semaphore `name`'s row, cell `n` (1-based).
fn cell(name: &str, n: u32) -> String {
    format!(
        "(document.querySelector('tr[data-semaphore=\"{name}\"] td:nth-child({n})') || {{}}).textContent"
    )
}

#[tokio::test]
async fn the_page_shows_another_process_s_claim_and_release_within_two_seconds() -> TestResult {
    let Some(chromium) = support::require_tool("chromium", "apt-get install chromium") else {
        return Ok(());
    };
    let db = support::migrated_db().await;
    let client = Client::new(support::another_pool(&db, 4).await);
    let held = populate(&db, &client).await?;
    let (child, url) = serve(&db, &[]).await;
    let mut browser = Browser::start(&chromium, 1400, 1000).await;
    browser.navigate(&url).await;
    assert!(
        browser
            .until(
                Duration::from_secs(10),
                "document.getElementById('state')?.textContent.startsWith('live:') === true"
            )
            .await,
        "the page receives its first snapshot"
    );

    // A claim made by this process (the dashboard is another).
    let payments = Semaphore::builder("payments", 3).build(&client).await?;
    assert!(
        browser
            .until(
                Duration::from_secs(3),
                &format!("{} === '0'", cell("payments", 3))
            )
            .await,
        "a new semaphore shows"
    );
    let permit = payments
        .acquiring()
        .holder("worker-7")
        .try_acquire()
        .await?;
    let claimed = std::time::Instant::now();
    assert!(
        browser
            .until(
                Duration::from_secs(2),
                &format!("{} === '1'", cell("payments", 3))
            )
            .await,
        "the claim shows within 2 s"
    );
    println!("claim shown after {:?}", claimed.elapsed());
    // Its drill-down: the holder's label and claim id.
    browser
        .eval("document.querySelector('tr[data-semaphore=\"payments\"]').click(), true")
        .await;
    let detail = "(document.querySelector('tr[data-semaphore=\"payments\"] + tr.detail') || {}).textContent || ''";
    let id = permit.id();
    assert!(
        browser
            .until(
                Duration::from_secs(2),
                &format!("({detail}).includes('worker-7') && ({detail}).includes('{id}')")
            )
            .await,
        "the drill-down shows the holder and its claim"
    );
    browser
        .screenshot(&screenshots().join("dashboard.png"))
        .await;

    permit.release().await?;
    let released = std::time::Instant::now();
    assert!(
        browser
            .until(
                Duration::from_secs(2),
                &format!(
                    "{} === '0' && ({detail}).includes('nobody holds it')",
                    cell("payments", 3)
                )
            )
            .await,
        "the release shows within 2 s"
    );
    println!("release shown after {:?}", released.elapsed());
    browser
        .screenshot(&screenshots().join("dashboard-released.png"))
        .await;
    // A hostile holder label is text, never markup.
    browser
        .eval("document.querySelector('tr[data-semaphore=\"search-api\"]').click(), true")
        .await;
    let search = "(document.querySelector('tr[data-semaphore=\"search-api\"] + tr.detail') || {}).textContent || ''";
    let hostile = serde_json::to_string(HOSTILE)?;
    assert!(
        browser
            .until(
                Duration::from_secs(3),
                &format!("({search}).includes({hostile})")
            )
            .await,
        "the hostile holder shows as text"
    );
    assert_eq!(
        browser
            .eval("document.body.dataset.pwned === undefined && document.querySelectorAll('img').length === 0")
            .await,
        true
    );
    assert!(
        browser.errors.is_empty(),
        "console errors: {:#?}",
        browser.errors
    );
    browser.close().await;
    drop(held);
    terminate(child).await
}

/// Things to see: semaphores (one full with a waiter), a family with rules
/// and busy keys, a paused rate limiter with decisions, a mutex held, and
/// refusals counted. What must stay held is returned.
async fn populate(
    db: &support::TestDb,
    client: &Client,
) -> TestResult<Vec<Box<dyn std::any::Any + Send>>> {
    let mut held: Vec<Box<dyn std::any::Any + Send>> = Vec::new();
    // Counted by a client of its own, flushed by its shutdown.
    let counting = Client::new(db.pool.clone());
    let exports = Semaphore::builder("exports", 1)
        .queue(QueueOrder::OldestFirst)
        .build(client)
        .await?;
    held.push(Box::new(
        exports
            .acquiring()
            .holder("export-runner-1")
            .try_acquire()
            .await?,
    ));
    let counted_exports = Semaphore::builder("exports", 1).build(&counting).await?;
    for _ in 0..4 {
        assert!(matches!(
            counted_exports.try_acquire().await,
            Err(Error::NoSlotsAvailable { .. })
        ));
    }
    let waiter = exports.clone();
    held.push(Box::new(tokio::spawn(async move {
        let _ = waiter
            .acquiring()
            .fairness_key("tenant-42")
            .timeout(Duration::from_secs(600))
            .acquire()
            .await;
    })));
    let search = Semaphore::builder("search-api", 8).build(client).await?;
    held.push(Box::new(
        search.acquiring().holder(HOSTILE).try_acquire().await?,
    ));
    for n in 0..4 {
        held.push(Box::new(
            search
                .acquiring()
                .holder(format!("web-{n}"))
                .try_acquire()
                .await?,
        ));
    }
    let tenants = SemaphoreFamily::builder("tenants", 4).build(client).await?;
    admin::set_family_rule(&db.pool, "tenants", RuleKind::Key, "acme", Some(20)).await?;
    for key in ["acme", "acme", "acme", "globex", "initech"] {
        held.push(Box::new(tenants.try_acquire(key).await?));
    }
    let emails =
        RateLimiter::builder("emails", RatePolicy::token_bucket(5.0, 10)).build(&counting)?;
    for _ in 0..14 {
        let _ = emails.check("tenant-1", 1).await?;
    }
    counting.shutdown().await?;
    admin::pause_rate_limit(
        &db.pool,
        LimiterKind::TokenBucket,
        "emails",
        None,
        Duration::from_secs(900),
    )
    .await?;
    let _webhooks = RateLimiter::builder(
        "webhooks",
        RatePolicy::sliding_window(100, Duration::from_secs(60)),
    )
    .build(client)?
    .check("tenant-2", 1)
    .await?;
    held.push(Box::new(
        Mutex::new("nightly-rollup")
            .locking()
            .lock_session(client)
            .await?,
    ));
    Ok(held)
}
