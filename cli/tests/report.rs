//! `pg-semaphore report --html`, end to end: claims on a real database, the
//! real binary writes the page, headless Chromium loads it and runs its
//! script, and the test reads the DOM Chromium dumps: the bars or buckets
//! drawn, the time axis, the numbers, hostile holder and metadata strings
//! shown as text and never run. A screenshot of each page is saved under
//! `target/test-artifacts/`.
//!
//! Chromium is the Debian package `chromium`. Without it these tests print
//! how to get it and pass, unless `PGSEMAPHORE_REQUIRE_TOOLS=1` (CI sets it),
//! where a missing Chromium fails them.

mod support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chrono::{DateTime, DurationRound, SecondsFormat, TimeDelta, Utc};
use pg_semaphore::{AdvisorySemaphore, Semaphore, audit::AuditLog};
use support::TestResult;
use support::cli::{assert_status, run, stderr, stdout};
use tokio::process::Command;

/// A holder that would run if the page ever wrote a holder as markup.
const SCRIPT_HOLDER: &str = "<script>alert(1)</script>";
/// A holder that tries to close the page's data element and add a script.
const BREAKOUT_HOLDER: &str = "</script><script>document.body.dataset.pwned='holder'</script>";
/// Metadata that would load (and run an attribute) if written as markup.
const IMG_NOTE: &str = "<img src=x onerror=\"document.body.dataset.pwned='metadata'\">";

/// The page's own `<script>` elements: its data and its code.
const PAGE_SCRIPTS: usize = 2;

/// Where pages and screenshots go: `target/test-artifacts/`.
fn artifacts() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory")
        .join("test-artifacts");
    std::fs::create_dir_all(&dir).expect("create target/test-artifacts");
    dir
}

/// Chromium's path, or `None` (after saying how to install it) when it is
/// missing and tools are not required.
fn chromium() -> Option<PathBuf> {
    support::require_tool("chromium", "apt-get install chromium")
}

/// Runs headless Chromium on `page` with `args`, in a fresh profile; its stdout.
async fn headless(chromium: &Path, page: &Path, args: &[&str]) -> String {
    static PROFILES: AtomicU32 = AtomicU32::new(0);
    let profile = std::env::temp_dir().join(format!(
        "pgsem-chromium-{}-{}",
        std::process::id(),
        PROFILES.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&profile);
    let url = format!(
        "file://{}",
        page.canonicalize().expect("the page").display()
    );
    let mut command = Command::new(chromium);
    command
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(&url)
        .kill_on_drop(true);
    // A page loads in a second or two. One that never finishes has usually
    // opened a dialog: an injected `alert` ran.
    let out = tokio::time::timeout(Duration::from_secs(60), command.output()).await;
    let _ = std::fs::remove_dir_all(&profile);
    let out = out
        .unwrap_or_else(|_| {
            panic!(
                "chromium {args:?} {url} did not finish in 60 s: \
                 did an injected script open a dialog?"
            )
        })
        .expect("run chromium");
    assert!(
        out.status.success(),
        "chromium {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 DOM")
}

/// The DOM of `page` after its scripts ran, and a 1400x1000 screenshot of it
/// saved as `screenshot`.
async fn render(chromium: &Path, page: &Path, screenshot: &Path) -> String {
    let dom = headless(chromium, page, &["--dump-dom"]).await;
    let _ = std::fs::remove_file(screenshot);
    headless(
        chromium,
        page,
        &[
            &format!("--screenshot={}", screenshot.display()),
            "--window-size=1400,1000",
        ],
    )
    .await;
    let png = std::fs::read(screenshot).expect("chromium wrote the screenshot");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "{} is not a screenshot of a drawn page ({} bytes)",
        screenshot.display(),
        png.len()
    );
    dom
}

fn count(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

/// The text of the first element whose opening tag ends with `tag_end`
/// (e.g. `class="edge axis-start">`).
fn text_after<'a>(dom: &'a str, tag_end: &str) -> &'a str {
    let start = dom
        .find(tag_end)
        .unwrap_or_else(|| panic!("no {tag_end} in the DOM"))
        + tag_end.len();
    let end = dom[start..].find('<').map_or(dom.len(), |i| start + i);
    &dom[start..end]
}

/// How the page writes a time: `2026-11-21 08:00:00.000Z`.
fn page_time(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S%.3fZ").to_string()
}

fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Waits until claim `id`'s lease has ended on the database clock.
async fn wait_until_expired(db: &support::TestDb, id: i64) -> sqlx::Result<()> {
    for _ in 0..500 {
        let expired: bool = sqlx::query_scalar(
            "SELECT expires_at <= clock_timestamp() FROM pgsemaphore.slots WHERE id = $1",
        )
        .bind(id)
        .fetch_one(&db.pool)
        .await?;
        if expired {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the lease of claim {id} never ended");
}

/// Checks that hostile strings were shown as text and nothing ran or loaded.
#[track_caller]
fn assert_nothing_injected(dom: &str) {
    assert_eq!(
        count(dom, "data-rendered=\"true\""),
        1,
        "the page's script did not finish"
    );
    assert_eq!(count(dom, "<script"), PAGE_SCRIPTS, "an injected <script>");
    for element in ["<img", "<iframe", "<object", "<embed", "<link"] {
        assert_eq!(count(dom, element), 0, "an injected {element} element");
    }
    assert!(!dom.contains("data-pwned"), "an injected script ran");
    assert!(
        dom.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "the holder {SCRIPT_HOLDER:?} is not shown as text"
    );
}

/// The page loads nothing: the only URL in it is the SVG namespace.
#[track_caller]
fn assert_self_contained(page: &str) {
    let svg_namespace = "http://www.w3.org/2000/svg";
    assert_eq!(
        count(page, "http://"),
        count(page, svg_namespace),
        "the page refers to a URL"
    );
    assert_eq!(count(page, "https://"), 0, "the page refers to a URL");
    assert!(page.contains("Content-Security-Policy\" content=\"default-src 'none'"));
}

#[tokio::test]
async fn a_report_draws_each_claim_and_shows_holders_as_text() -> TestResult {
    let Some(chromium) = chromium() else {
        return Ok(());
    };
    let db = support::migrated_db().await;
    let name = "checkout <b>&amp;</b>";
    let sem = Semaphore::builder(name, 3)
        .lease(Duration::from_secs(600))
        .build(&db.client)
        .await?;
    let since = Utc::now().duration_trunc(TimeDelta::seconds(1))? - TimeDelta::seconds(1);

    let mut completed = Vec::new();
    for i in 0..4 {
        let permit = sem
            .acquiring()
            .holder(format!("job-{i}"))
            .try_acquire()
            .await?;
        completed.push(permit.id());
        tokio::time::sleep(Duration::from_millis(30)).await;
        permit.release().await?;
    }
    // Two held at once: the peak.
    let a = sem.acquiring().holder(SCRIPT_HOLDER).try_acquire().await?;
    let b = sem
        .acquiring()
        .holder(BREAKOUT_HOLDER)
        .metadata(serde_json::json!({ "note": IMG_NOTE }))
        .try_acquire()
        .await?;
    tokio::time::sleep(Duration::from_millis(30)).await;
    completed.extend([a.id(), b.id()]);
    a.release().await?;
    b.release().await?;
    // A holder that died (no heartbeat, never released): its lease ends and
    // the reaper times it out.
    let doomed = Semaphore::builder(name, 3)
        .lease(Duration::from_secs(600))
        .without_heartbeat()
        .build(&db.client)
        .await?
        .acquiring()
        .holder("crashed")
        .lease(Duration::from_millis(20))
        .try_acquire()
        .await?;
    let timed_out = doomed.id();
    std::mem::forget(doomed);
    wait_until_expired(&db, timed_out).await?;
    assert_eq!(pg_semaphore::admin::reap(&db.pool).await?, 1);
    let live = sem
        .acquiring()
        .holder("still-working")
        .try_acquire()
        .await?;
    let until = Utc::now().duration_trunc(TimeDelta::seconds(1))? + TimeDelta::seconds(2);

    let page = artifacts().join("report-claims.html");
    let out = run(
        &db,
        &[
            "report",
            name,
            "--since",
            &rfc3339(since),
            "--until",
            &rfc3339(until),
            "--html",
            page.to_str().unwrap(),
        ],
    )
    .await;
    assert_status(&out, 0);
    let claims = completed.len() + 2;
    assert!(
        stdout(&out).contains(&format!("{claims} claims")),
        "{}",
        stdout(&out)
    );
    assert_self_contained(&std::fs::read_to_string(&page)?);

    let dom = render(&chromium, &page, &artifacts().join("report-claims.png")).await;
    assert_nothing_injected(&dom);
    // One bar per claim, colored by its outcome, on its claim's id.
    assert_eq!(count(&dom, "<rect class=\"bar "), claims, "bars");
    assert_eq!(count(&dom, "<rect class=\"bar completed"), completed.len());
    assert_eq!(count(&dom, "<rect class=\"bar timed_out"), 1);
    assert_eq!(count(&dom, "<rect class=\"bar live"), 1);
    for id in completed.iter().chain([&timed_out, &live.id()]) {
        assert!(
            dom.contains(&format!("data-id=\"{id}\"")),
            "no bar for #{id}"
        );
    }
    assert_eq!(count(&dom, "class=\"cell\""), 0, "not aggregated");
    assert!(
        dom.contains("id=\"notice\" hidden"),
        "no aggregation notice"
    );
    // The time axis spans exactly the window asked for.
    assert_eq!(
        text_after(&dom, "class=\"edge axis-start\">"),
        page_time(since)
    );
    assert_eq!(
        text_after(&dom, "class=\"edge axis-end\">"),
        page_time(until)
    );
    // One lane per slot of the capacity.
    assert_eq!(count(&dom, "class=\"lane-label\""), 3);
    // The numbers.
    assert_eq!(
        text_after(&dom, "<span id=\"name\">"),
        "checkout &lt;b&gt;&amp;amp;&lt;/b&gt;"
    );
    assert!(dom.contains(&format!(
        "<div class=\"value\">{claims}</div><div class=\"label\">claims"
    )));
    assert!(
        dom.contains("<div class=\"value\">2 / 3</div><div class=\"label\">peak held / capacity")
    );
    // Holder and metadata are in each bar's tooltip, as text.
    assert!(dom.contains("holder: job-3"));
    assert!(dom.contains("&lt;/script&gt;&lt;script&gt;document.body.dataset.pwned"));
    assert!(dom.contains("&lt;img src=x onerror="), "metadata not shown");
    live.release().await?;
    Ok(())
}

/// The shape of the busy window: `CLAIMS` claims on `SLOTS` slots, each slot
/// claimed every `SPACING_MS` for `HOLD_MS`, every `TIMEOUT_EVERY`-th claim
/// (all on one slot) reaped after `TIMED_OUT_HOLD_MS` instead.
const CLAIMS: i64 = 100_000;
const SLOTS: i64 = 10;
const SPACING_MS: i64 = 360;
const HOLD_MS: i64 = 300;
const TIMEOUT_EVERY: i64 = 50;
const TIMED_OUT_HOLD_MS: i64 = 340;
/// The slot whose holder is `SCRIPT_HOLDER`.
const SCRIPT_SLOT: i64 = 3;

#[tokio::test]
async fn a_busy_window_is_aggregated_by_the_database() -> TestResult {
    let db = support::migrated_db().await;
    Semaphore::builder("busy", SLOTS as u32)
        .lease(Duration::from_secs(30))
        .build(&db.client)
        .await?;
    let since = Utc::now().duration_trunc(TimeDelta::hours(1))? - TimeDelta::hours(3);
    let length = TimeDelta::milliseconds(CLAIMS / SLOTS * SPACING_MS);
    let until = since + length;
    sqlx::query(
        "INSERT INTO pgsemaphore.slots
             (semaphore, slot, holder, metadata, created_at, expires_at, completed_at, timed_out_at)
         SELECT 'busy', i % $2,
                CASE WHEN i % $2 = $7 THEN $8 ELSE 'worker-' || i % $2 END,
                jsonb_build_object('i', i),
                at, at + interval '30 seconds',
                CASE WHEN i % $5 <> $5 - 1 THEN at + $4 * interval '1 ms' END,
                CASE WHEN i % $5 = $5 - 1 THEN at + $6 * interval '1 ms' END
           FROM generate_series(0, $1 - 1) AS i,
                LATERAL (SELECT $9::timestamptz + (i / $2) * $3 * interval '1 ms' AS at) AS t",
    )
    .bind(CLAIMS)
    .bind(SLOTS)
    .bind(SPACING_MS)
    .bind(HOLD_MS)
    .bind(TIMEOUT_EVERY)
    .bind(TIMED_OUT_HOLD_MS)
    .bind(SCRIPT_SLOT)
    .bind(SCRIPT_HOLDER)
    .bind(since)
    .execute(&db.pool)
    .await?;
    let timed_out = CLAIMS / TIMEOUT_EVERY;

    // The library: aggregates only, each computed in the database.
    let report = AuditLog::new(&db.pool).report("busy", since..until).await?;
    assert!(report.aggregated && report.claims.is_empty());
    assert_eq!(report.summary.total(), CLAIMS as u64);
    assert_eq!(report.summary.timed_out, timed_out as u64);
    assert_eq!(report.lanes, SLOTS as u32);
    let buckets = report.occupancy.len();
    // Every slot is claimed many times per bucket: every cell is there.
    assert_eq!(report.cells.len(), SLOTS as usize * buckets);
    assert!(report.bucket_width > Duration::from_millis(10 * SPACING_MS as u64));
    let held_ms = (CLAIMS - timed_out) * HOLD_MS + timed_out * TIMED_OUT_HOLD_MS;
    let expected_mean = held_ms as f64 / length.num_milliseconds() as f64;
    for bucket in &report.occupancy {
        // A group of claims starts together on every slot: all are held at once.
        assert_eq!(bucket.peak, SLOTS as u32, "{bucket:?}");
        assert!(
            (bucket.mean - expected_mean).abs() < 0.1,
            "mean {} in {bucket:?}, expected {expected_mean}",
            bucket.mean
        );
    }
    let binned: u64 = report
        .hold_times
        .iter()
        .map(|b| b.completed + b.timed_out)
        .sum();
    assert_eq!(binned, CLAIMS as u64);
    let longest = report.hold_times.last().map(|b| b.to.as_secs_f64());
    assert!(
        longest.is_some_and(|s| (s * 1000.0 - TIMED_OUT_HOLD_MS as f64).abs() < 1e-3),
        "the histogram ends at {longest:?} s"
    );
    let script_lane: Vec<_> = report
        .cells
        .iter()
        .filter(|c| c.lane == SCRIPT_SLOT as u32)
        .collect();
    assert_eq!(script_lane.len(), buckets);
    assert!(script_lane.iter().all(|c| c.top_holder == SCRIPT_HOLDER));

    // The page.
    let Some(chromium) = chromium() else {
        return Ok(());
    };
    let page = artifacts().join("report-aggregated.html");
    let out = run(
        &db,
        &[
            "report",
            "busy",
            "--since",
            &rfc3339(since),
            "--until",
            &rfc3339(until),
            "--html",
            page.to_str().unwrap(),
        ],
    )
    .await;
    assert_status(&out, 0);
    assert!(stdout(&out).contains("aggregated"), "{}", stdout(&out));
    let html = std::fs::read_to_string(&page)?;
    assert_self_contained(&html);
    assert!(
        html.len() < 2_000_000,
        "a page of {} bytes for an aggregated window",
        html.len()
    );

    let dom = render(&chromium, &page, &artifacts().join("report-aggregated.png")).await;
    assert_nothing_injected(&dom);
    assert_eq!(count(&dom, "<rect class=\"bar "), 0, "no bar per claim");
    assert_eq!(count(&dom, "<rect class=\"cell\""), report.cells.len());
    assert_eq!(count(&dom, "<rect class=\"occ-mean\""), buckets);
    assert_eq!(
        count(
            &dom,
            "most frequent holder: &lt;script&gt;alert(1)&lt;/script&gt;"
        ),
        buckets
    );
    let notice = text_after(&dom, "<p class=\"notice\" id=\"notice\">");
    assert!(
        notice.starts_with(&format!("Aggregated: {} claims", grouped(CLAIMS))),
        "the page does not say it aggregated: {notice:?}"
    );
    assert_eq!(
        text_after(&dom, "class=\"edge axis-start\">"),
        page_time(since)
    );
    assert_eq!(
        text_after(&dom, "class=\"edge axis-end\">"),
        page_time(until)
    );
    assert!(dom.contains(&format!(
        "<div class=\"value\">{}</div><div class=\"label\">timed out",
        grouped(timed_out)
    )));
    assert!(dom.contains(&format!("<div class=\"value\">{SLOTS} / {SLOTS}</div>")));
    Ok(())
}

/// 100000 as the page writes it: 100,000.
fn grouped(n: i64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The report's data, as the page carries it (its `report-data` element).
fn page_data(page: &str) -> serde_json::Value {
    let start = page
        .find("id=\"report-data\">")
        .expect("the page has its data")
        + "id=\"report-data\">".len();
    let end = start + page[start..].find("</script>").expect("its data ends");
    serde_json::from_str(&page[start..end]).expect("the page's data is JSON")
}

/// An advisory semaphore's report is drawn from its log of finished
/// permits (a bar on each slot of each), and says that the picture ends at
/// the last finished permit: a live permit is not in the log.
#[tokio::test]
async fn an_advisory_semaphore_s_report_draws_its_finished_permits() -> TestResult {
    let db = support::migrated_db().await;
    let sem = AdvisorySemaphore::builder("exports", 3)
        .build(&db.client.clone().holder(SCRIPT_HOLDER))
        .await?;
    sem.try_acquire().await?.release().await?;
    drop(sem.try_acquire_many(2).await?);
    let logged = support::advisory_rows_logged(&db.pool, "exports", 2).await;
    assert!(logged, "the audit writer did not log both permits");
    let live = sem.try_acquire().await?; // not in the log, so not drawn

    let out = run(&db, &["report", "exports", "--last", "1h", "--html", "-"]).await;
    assert_status(&out, 0);
    let page = stdout(&out);
    assert_self_contained(&page);
    let data = page_data(&page);
    assert_eq!(data["kind"], "advisory");
    assert_eq!(data["capacity"], 3);
    assert_eq!(data.get("permits"), None);
    let permits = data["claims"].as_array().expect("claims");
    let seen: Vec<(serde_json::Value, &str, &str)> = permits
        .iter()
        .map(|p| {
            (
                p["slots"].clone(),
                p["outcome"].as_str().unwrap(),
                p["holder"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (serde_json::json!([0]), "completed", SCRIPT_HOLDER),
            (serde_json::json!([0, 1]), "dropped", SCRIPT_HOLDER),
        ]
    );
    assert_eq!(data["summary"]["total"], 2);
    assert_eq!(data["summary"]["kind"], "advisory");
    assert_eq!(data["summary"]["dropped"], 1);
    assert_eq!(data["summary"].get("live"), None);
    let peak = data["occupancy"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["peak"].as_u64())
        .max();
    assert_eq!(peak, Some(2), "the two-slot permit holds two at once");

    let file = artifacts().join("report-advisory.html");
    let out = run(
        &db,
        &[
            "report",
            "exports",
            "--last",
            "1h",
            "--html",
            file.to_str().unwrap(),
        ],
    )
    .await;
    assert_status(&out, 0);
    assert!(
        stdout(&out).contains("2 finished permits of \"exports\""),
        "{}",
        stdout(&out)
    );

    if let Some(chromium) = chromium() {
        let dom = render(&chromium, &file, &artifacts().join("report-advisory.png")).await;
        assert_nothing_injected(&dom);
        // A bar on each slot of each permit: 1 + 2.
        assert_eq!(count(&dom, "data-permit="), 3, "bars");
        assert_eq!(count(&dom, "data-outcome=\"dropped\""), 2);
        assert_eq!(count(&dom, "class=\"lane-label\""), 3);
        let notice = text_after(&dom, "<p class=\"notice\" id=\"notice\">");
        assert!(
            notice.contains("the picture ends at the last finished permit"),
            "{notice:?}"
        );
    }
    live.release().await?;
    Ok(())
}

#[tokio::test]
async fn report_errors_have_the_documented_exit_statuses() -> TestResult {
    let db = support::migrated_db().await;
    Semaphore::builder("quiet", 2).build(&db.client).await?;
    let page = artifacts().join("report-quiet.html");
    let page = page.to_str().unwrap();

    let out = run(&db, &["report", "never-built", "--html", page]).await;
    assert_status(&out, 3);
    assert!(stderr(&out).contains("never-built"), "{}", stderr(&out));

    for args in [
        &[
            "report",
            "quiet",
            "--since",
            "yesterday-ish",
            "--html",
            page,
        ][..],
        &["report", "quiet", "--since", "1h"], // no --html
        &[
            "report", "quiet", "--last", "1h", "--until", "2h", "--html", page,
        ],
    ] {
        let out = run(&db, args).await;
        assert_status(&out, 2);
        assert!(!stderr(&out).is_empty(), "{args:?}: no message");
    }
    let out = run(
        &db,
        &[
            "report", "quiet", "--since", "1h", "--until", "2h", "--html", page,
        ],
    )
    .await;
    assert_status(&out, 2);
    assert!(
        stderr(&out).contains("before it starts"),
        "{}",
        stderr(&out)
    );
    let now = rfc3339(Utc::now());
    let out = run(
        &db,
        &[
            "report", "quiet", "--since", &now, "--until", &now, "--html", page,
        ],
    )
    .await;
    assert_status(&out, 2);
    assert!(stderr(&out).contains("window"), "{}", stderr(&out));

    let missing_dir = artifacts().join("no-such-dir").join("report.html");
    let out = run(
        &db,
        &["report", "quiet", "--html", missing_dir.to_str().unwrap()],
    )
    .await;
    assert_status(&out, 1);
    assert!(stderr(&out).contains("cannot write"), "{}", stderr(&out));

    // An empty window still makes a page; `-` prints it.
    let out = run(&db, &["report", "quiet", "--last", "10m", "--html", "-"]).await;
    assert_status(&out, 0);
    let html = stdout(&out);
    assert!(html.starts_with("<!DOCTYPE html>"), "{html}");
    assert!(html.contains("\"semaphore\":\"quiet\""), "{html}");

    let unmigrated = support::empty_db().await;
    let out = run(&unmigrated, &["report", "quiet", "--html", page]).await;
    assert_status(&out, 4);

    let help = run(&db, &["report", "--help"]).await;
    assert_status(&help, 0);
    for option in ["--since", "--until", "--last", "--html"] {
        assert!(
            stdout(&help).contains(option),
            "report --help lacks {option}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_semaphore_with_many_slots_shares_lanes() -> TestResult {
    let db = support::migrated_db().await;
    let capacity = 250;
    let sem = Semaphore::builder("wide", capacity)
        .build(&db.client)
        .await?;
    let since = Utc::now() - TimeDelta::seconds(1);
    let held = [
        sem.try_acquire().await?,
        sem.try_acquire().await?,
        sem.try_acquire().await?,
    ];
    tokio::time::sleep(Duration::from_millis(50)).await;
    for permit in held {
        permit.release().await?;
    }
    let until = Utc::now() + TimeDelta::seconds(1);

    let report = AuditLog::new(&db.pool).report("wide", since..until).await?;
    // At most 100 lanes (the documented limit): three claims, but aggregated.
    let per_lane = capacity.div_ceil(100);
    assert!(report.aggregated && report.claims.is_empty());
    assert_eq!(report.slots_per_lane, per_lane);
    assert_eq!(report.lanes, capacity.div_ceil(per_lane));
    assert_eq!(report.summary.completed, 3);
    // Slots 0, 1 and 2 share lane 0; the peak saw all three.
    assert!(!report.cells.is_empty());
    assert!(report.cells.iter().all(|c| c.lane == 0));
    let most = report.occupancy.iter().map(|b| b.peak).max();
    assert_eq!(most, Some(3));
    // A lane's slot time in a bucket is at most its slots times the bucket
    // (to the nanosecond the seconds become a Duration at).
    let lane_time = report.bucket_width * per_lane + Duration::from_nanos(per_lane.into());
    assert!(
        report.cells.iter().all(|c| c.busy <= lane_time),
        "{:?}",
        report.cells
    );
    Ok(())
}

/// `report --limiter` draws a rate limiter's decisions per minute (a bar of
/// each of admitted, refused and timed out per minute with counts), with
/// the totals and what the database stores of it; a hostile limiter name
/// reads as text. A semaphore's page draws its refusals and timeouts per
/// minute under the rest.
#[tokio::test]
async fn a_rate_limiter_s_report_draws_its_decisions_per_minute() -> TestResult {
    let db = support::migrated_db().await;
    let client = pg_semaphore::Client::new(db.pool.clone());
    let limiter = pg_semaphore::RateLimiter::builder(
        SCRIPT_HOLDER,
        pg_semaphore::RatePolicy::token_bucket(0.001, 3),
    )
    .build(&client)?;
    for _ in 0..5 {
        let _ = limiter.check("k", 1).await?;
    }
    let waited = limiter
        .acquire_timeout("k", 1, Duration::from_millis(10))
        .await;
    assert!(waited.is_err(), "{waited:?}");
    let sem = Semaphore::builder("api", 1).build(&client).await?;
    let held = sem.try_acquire().await?;
    for _ in 0..4 {
        assert!(sem.try_acquire().await.is_err());
    }
    client.shutdown().await?;

    let file = artifacts().join("report-limiter.html");
    let out = run(
        &db,
        &[
            "report",
            "--limiter",
            SCRIPT_HOLDER,
            "--last",
            "10m",
            "--html",
            file.to_str().unwrap(),
        ],
    )
    .await;
    assert_status(&out, 0);
    assert!(
        stdout(&out).contains("(3 admitted, 2 refused, 1 timed out"),
        "{}",
        stdout(&out)
    );
    let page = std::fs::read_to_string(&file)?;
    assert_self_contained(&page);
    let data = page_data(&page);
    assert_eq!(data["kind"], "rate_limiter");
    assert_eq!(data["limiter"], SCRIPT_HOLDER);
    assert_eq!(data["total"]["refused"], 2);

    let sem_file = artifacts().join("report-refusals.html");
    let out = run(
        &db,
        &[
            "report",
            "api",
            "--last",
            "10m",
            "--html",
            sem_file.to_str().unwrap(),
        ],
    )
    .await;
    assert_status(&out, 0);
    let sem_page = std::fs::read_to_string(&sem_file)?;
    let sem_data = page_data(&sem_page);
    let refused: u64 = sem_data["outcomes"]
        .as_array()
        .expect("the semaphore's counters")
        .iter()
        .filter_map(|m| m["refused"].as_u64())
        .sum();
    assert_eq!(refused, 4);

    let Some(chromium) = chromium() else {
        held.release().await?;
        return Ok(());
    };
    let dom = render(&chromium, &file, &artifacts().join("report-limiter.png")).await;
    assert_nothing_injected(&dom);
    let drawn = |dom: &str, series: &str| -> u64 {
        dom.split(&format!("data-series=\"{series}\" data-count=\""))
            .skip(1)
            .filter_map(|rest| rest.split('"').next()?.parse::<u64>().ok())
            .sum()
    };
    assert_eq!(
        (
            drawn(&dom, "admitted"),
            drawn(&dom, "refused"),
            drawn(&dom, "timed_out")
        ),
        (3, 2, 1),
        "the bars drawn"
    );
    assert!(
        text_after(&dom, "<p class=\"sub\" id=\"stored\">").contains("burst 3"),
        "the stored limits"
    );
    let dom = render(
        &chromium,
        &sem_file,
        &artifacts().join("report-refusals.png"),
    )
    .await;
    assert_eq!(count(&dom, "data-rendered=\"true\""), 1);
    assert_eq!((drawn(&dom, "refused"), drawn(&dom, "timed_out")), (4, 0));
    held.release().await?;
    Ok(())
}
