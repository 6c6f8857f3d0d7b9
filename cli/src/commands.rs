//! One function per command: call the library, hand its data to `render`,
//! return the text to print. Failures carry their exit status.

use std::ops::Range;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use pg_semaphore::{
    Error,
    admin::{LimiterKind, OutcomeCounts, OutcomeKind, RateLimiterInfo, ReleaseOutcome, RuleKind},
    audit::{AuditLog, SemaphoreKind},
};
use sqlx::PgPool;

use crate::render::{self, human, plural, rfc3339};
use crate::{AuditArgs, EXIT_FAILURE, Failure, LimitsCommand, ReportArgs, parse};

pub(crate) async fn migrate(pool: &PgPool) -> Result<String, Failure> {
    pg_semaphore::migrate(pool).await?;
    let migrator = pg_semaphore::schema::migrator();
    let latest = migrator.iter().last();
    Ok(match latest {
        Some(m) => format!(
            "pg-semaphore schema is up to date: {} migrations, latest {} ({})\n",
            migrator.iter().count(),
            m.version,
            m.description
        ),
        None => "pg-semaphore schema is up to date\n".to_owned(),
    })
}

pub(crate) async fn status(
    pool: &PgPool,
    name: Option<&str>,
    json: bool,
    mutex_names: &[String],
) -> Result<String, Failure> {
    let mut list = pg_semaphore::admin::semaphores(pool).await?;
    if let Some(name) = name {
        list.retain(|s| s.name == name);
        if list.is_empty() {
            return Err(Failure::not_found(format!("no semaphore named {name:?}")));
        }
    }
    let now = Utc::now();
    let since = now - TimeDelta::seconds(60);
    let counted = render::Counted::new(
        pg_semaphore::admin::outcomes(pool, since..now).await?,
        since,
    );
    // With a name, only that semaphore; without, the families and the
    // rate limiters too.
    let (families, limiters) = match name {
        Some(_) => (Vec::new(), Vec::new()),
        None => (
            pg_semaphore::admin::families(pool).await?,
            pg_semaphore::admin::rate_limiters(pool).await?,
        ),
    };
    let status = render::Status {
        semaphores: &list,
        families: &families,
        limiters: &limiters,
        counted: &counted,
        whole: name.is_none(),
    };
    if json {
        return Ok(render::status_json(&status));
    }
    let mut out = render::status_table(&status);
    if name.is_none() {
        let locks = pg_semaphore::admin::mutexes(pool).await?;
        if !locks.is_empty() {
            let named: Vec<(sqlx::postgres::PgAdvisoryLockKey, &str)> = mutex_names
                .iter()
                .map(|n| (pg_semaphore::Mutex::new(n).key(), n.as_str()))
                .collect();
            out.push('\n');
            out.push_str(&render::mutexes_table(&locks, &named, Utc::now()));
        }
    }
    Ok(out)
}

pub(crate) async fn doctor(pool: &PgPool, json: bool) -> Result<String, Failure> {
    let holder = pg_semaphore::admin::horizon(pool).await?;
    Ok(if json {
        render::doctor_json(holder.as_ref())
    } else {
        render::doctor_text(holder.as_ref())
    })
}

pub(crate) async fn audit(pool: &PgPool, args: AuditArgs) -> Result<String, Failure> {
    let w = &args.window;
    let window = parse::window(w.last, w.since, w.until, Utc::now()).map_err(Failure::usage)?;
    let Some(name) = args.name else {
        let limiter = args.limiter.limiter.as_deref().unwrap_or_default();
        let (kind, info) = resolve_limiter(pool, limiter, args.limiter.kind, &window).await?;
        let minutes =
            pg_semaphore::admin::outcomes_of(pool, kind.into(), limiter, window.clone()).await?;
        let history = render::LimiterHistory {
            limiter,
            kind,
            window: &window,
            info: info.as_ref(),
            minutes: &minutes,
        };
        return Ok(if args.csv {
            render::limiter_audit_csv(&minutes)
        } else if args.json {
            render::limiter_audit_json(&history)
        } else {
            render::limiter_audit_table(&history)
        });
    };
    let log = AuditLog::new(pool);
    // The name is resolved as `report` resolves it: a lease semaphore's row
    // (a named semaphore, or a family key, idle or not, while it has
    // history), else an advisory semaphore. An unknown name would just give
    // an empty log: say so instead.
    let summary = log.summary(&name, window.clone()).await?;
    let kind = summary.kind;
    if kind == SemaphoreKind::Advisory
        && !pg_semaphore::admin::semaphores(pool)
            .await?
            .iter()
            .any(|s| s.kind == kind && s.name == name)
    {
        return Err(not_found(pool, &name).await);
    }
    let claims = log.history(&name, window.clone()).await?;
    if args.csv {
        return Ok(render::audit_csv(kind, &claims));
    }
    let outcomes = semaphore_outcomes(pool, kind, &name, &window).await?;
    Ok(if args.json {
        render::audit_json(&name, &window, &claims, &summary, outcomes.as_deref())
    } else {
        render::audit_table(&name, &window, &claims, &summary, outcomes.as_deref())
    })
}

/// A semaphore's outcome counters in `window`; `None` for a family key,
/// whose refusals and timeouts count under its family.
async fn semaphore_outcomes(
    pool: &PgPool,
    kind: SemaphoreKind,
    name: &str,
    window: &Range<DateTime<Utc>>,
) -> Result<Option<Vec<OutcomeCounts>>, Failure> {
    if name.starts_with('@') {
        return Ok(None);
    }
    let kind = match kind {
        SemaphoreKind::Advisory => OutcomeKind::Advisory,
        _ => OutcomeKind::Semaphore,
    };
    Ok(Some(
        pg_semaphore::admin::outcomes_of(pool, kind, name, window.clone()).await?,
    ))
}

/// The kind of the rate limiter `name` (the one given, else the one kind
/// that has the name: stored limits, keys, or counts in `window`), and
/// what the database stores of it.
async fn resolve_limiter(
    pool: &PgPool,
    name: &str,
    kind: Option<LimiterKind>,
    window: &Range<DateTime<Utc>>,
) -> Result<(LimiterKind, Option<RateLimiterInfo>), Failure> {
    let known: Vec<RateLimiterInfo> = pg_semaphore::admin::rate_limiters(pool)
        .await?
        .into_iter()
        .filter(|l| l.name == name)
        .collect();
    let mut kinds: Vec<LimiterKind> = known.iter().map(|l| l.kind).collect();
    for candidate in [
        LimiterKind::TokenBucket,
        LimiterKind::FixedWindow,
        LimiterKind::SlidingWindow,
    ] {
        if !kinds.contains(&candidate)
            && !pg_semaphore::admin::outcomes_of(pool, candidate.into(), name, window.clone())
                .await?
                .is_empty()
        {
            kinds.push(candidate);
        }
    }
    let kind = match (kind, kinds.as_slice()) {
        (Some(kind), _) if kinds.contains(&kind) => kind,
        (Some(kind), _) => {
            return Err(Failure::not_found(format!(
                "no {kind} rate limiter named {name:?} (no stored limits, keys, or counts in the window)"
            )));
        }
        (None, [kind]) => *kind,
        (None, []) => {
            return Err(Failure::not_found(format!(
                "no rate limiter named {name:?} (no stored limits, keys, or counts in the window)"
            )));
        }
        (None, several) => {
            let names: Vec<&str> = several.iter().map(|k| k.as_str()).collect();
            return Err(Failure::usage(format!(
                "rate limiters of several kinds are named {name:?} ({}): pass --kind",
                names.join(", ")
            )));
        }
    };
    let info = known.into_iter().find(|l| l.kind == kind);
    Ok((kind, info))
}

pub(crate) async fn report(pool: &PgPool, args: ReportArgs) -> Result<String, Failure> {
    let w = &args.window;
    let window = parse::window(w.last, w.since, w.until, Utc::now()).map_err(Failure::usage)?;
    let Some(name) = args.name else {
        let limiter = args.limiter.limiter.as_deref().unwrap_or_default();
        let (kind, info) = resolve_limiter(pool, limiter, args.limiter.kind, &window).await?;
        let minutes =
            pg_semaphore::admin::outcomes_of(pool, kind.into(), limiter, window.clone()).await?;
        let history = render::LimiterHistory {
            limiter,
            kind,
            window: &window,
            info: info.as_ref(),
            minutes: &minutes,
        };
        let page = render::report::limiter_html(&history, Utc::now());
        let total = render::total(&minutes);
        return write_page(
            &args.html,
            page,
            format!(
                "decisions of {kind} rate limiter {limiter:?} between {} and {} \
                 ({} admitted, {} refused, {} timed out, in {} minute{} with counts)",
                rfc3339(window.start),
                rfc3339(window.end),
                total.admitted,
                total.refused,
                total.timed_out,
                minutes.len(),
                plural(minutes.len() as u64),
            ),
        );
    };
    let report = match AuditLog::new(pool)
        .report_shaped(&name, window.clone(), render::report::SHAPE)
        .await
    {
        Err(Error::SemaphoreNotFound { .. }) => return Err(not_found(pool, &name).await),
        other => other?,
    };
    let outcomes = semaphore_outcomes(pool, report.kind, &name, &window).await?;
    let page = render::report::html(&report, outcomes.as_deref());
    let drawn = if report.aggregated {
        format!(
            "aggregated into {} buckets of {}",
            report.occupancy.len(),
            human(report.bucket_width)
        )
    } else {
        "one bar each".to_owned()
    };
    let what = match report.kind {
        SemaphoreKind::Advisory => "finished permit",
        _ => "claim",
    };
    write_page(
        &args.html,
        page,
        format!(
            "{} {what}{} of {:?} between {} and {} ({drawn})",
            report.summary.total(),
            plural(report.summary.total()),
            report.semaphore,
            rfc3339(report.since),
            rfc3339(report.until),
        ),
    )
}

/// Writes a report's `page` to `file` (`-`: returns it, for stdout), and
/// says what it drew.
fn write_page(file: &std::path::Path, page: String, drew: String) -> Result<String, Failure> {
    if file.as_os_str() == "-" {
        return Ok(page);
    }
    std::fs::write(file, page).map_err(|e| {
        Failure::new(
            EXIT_FAILURE,
            format!("cannot write {}: {e}", file.display()),
        )
    })?;
    Ok(format!("wrote {}: {drew}\n", file.display()))
}

/// Why `audit` or `report` has nothing for `name`: no such semaphore; for
/// a family key (`@family/key`), no such family, or no history of the key
/// (a key's row lives while it has claims on record, then the reaper
/// removes it).
async fn not_found(pool: &PgPool, name: &str) -> Failure {
    let Some((family, key)) = name.strip_prefix('@').and_then(|n| n.split_once('/')) else {
        return Failure::not_found(format!("no semaphore named {name:?}"));
    };
    match pg_semaphore::admin::families(pool).await {
        Ok(families) if families.iter().any(|f| f.name == family) => Failure::not_found(format!(
            "no history of key {key:?} of family {family:?}: it has no claim on record \
             (never claimed, or its claims were pruned and the idle key removed)"
        )),
        Ok(_) => Failure::not_found(format!(
            "no semaphore family named {family:?} (so no key {name:?})"
        )),
        Err(error) => error.into(),
    }
}

pub(crate) async fn reap(pool: &PgPool) -> Result<String, Failure> {
    let reaped = pg_semaphore::admin::reap(pool).await?;
    Ok(format!("reaped {reaped} expired claim{}\n", plural(reaped)))
}

pub(crate) async fn reaper(
    pool: &PgPool,
    every: Duration,
    retention: Option<Duration>,
    rate_limits: Option<Duration>,
) -> Result<String, Failure> {
    let mut builder = pg_semaphore::admin::Reaper::builder().interval(every);
    if let Some(retention) = retention {
        builder = builder.retention(retention);
    }
    if let Some(idle_for) = rate_limits {
        builder = builder.rate_limits(idle_for);
    }
    let reaper = builder.spawn(pool)?;
    eprintln!(
        "pg-semaphore: reaper running every {} (Ctrl-C or SIGTERM stops it)",
        human(every)
    );
    stopped().await;
    reaper.shutdown().await;
    Ok("reaper stopped\n".to_owned())
}

/// Returns on Ctrl-C, or on SIGTERM on Unix.
async fn stopped() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// Refuses what `dashboard` must not serve: a non-loopback address
/// without a token (unless `allow_unauthenticated`), a token that cannot
/// travel in a URL.
pub(crate) fn check_dashboard(
    listen: std::net::SocketAddr,
    token: Option<&str>,
    allow_unauthenticated: bool,
) -> Result<(), Failure> {
    if let Some(token) = token {
        let url_safe = |c: char| c.is_ascii_alphanumeric() || "-_.~".contains(c);
        if token.is_empty() || !token.chars().all(url_safe) {
            return Err(Failure::usage(
                "--token must be letters, digits, '-', '_', '.' or '~' (it may travel in a URL)",
            ));
        }
    } else if !listen.ip().is_loopback() && !allow_unauthenticated {
        return Err(Failure::usage(format!(
            "refusing to serve the dashboard on {listen} without a token: pass --token \
             (or PGSEMAPHORE_DASHBOARD_TOKEN), listen on 127.0.0.1, or pass \
             --allow-unauthenticated if something in front of it authenticates"
        )));
    }
    Ok(())
}

/// Serves the dashboard on `listen` until Ctrl-C or SIGTERM.
pub(crate) async fn dashboard(
    pool: &PgPool,
    listen: std::net::SocketAddr,
    token: Option<String>,
    every: Duration,
) -> Result<String, Failure> {
    let dashboard = pg_semaphore::dashboard::Dashboard::new(pool.clone()).interval(every);
    let mut app = dashboard.router();
    if let Some(token) = token {
        app = app.layer(axum::middleware::from_fn_with_state(
            std::sync::Arc::<str>::from(token),
            bearer,
        ));
    }
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| Failure::new(EXIT_FAILURE, format!("cannot listen on {listen}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Failure::new(EXIT_FAILURE, format!("cannot listen on {listen}: {e}")))?;
    eprintln!("pg-semaphore: dashboard at http://{bound}/ (Ctrl-C or SIGTERM stops it)");
    axum::serve(listener, app)
        .with_graceful_shutdown(stopped())
        .await
        .map_err(|e| Failure::new(EXIT_FAILURE, format!("the dashboard's server failed: {e}")))?;
    Ok("dashboard stopped\n".to_owned())
}

/// Lets through a request that carries the token: `Authorization: Bearer
/// TOKEN`, or `token=TOKEN` in its query (a browser's page and its events).
async fn bearer(
    axum::extract::State(token): axum::extract::State<std::sync::Arc<str>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let header = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let query = request
        .uri()
        .query()
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|pair| pair.strip_prefix("token="));
    let given = header.or(query).unwrap_or_default();
    if same(given.as_bytes(), token.as_bytes()) {
        return next.run(request).await;
    }
    (
        axum::http::StatusCode::UNAUTHORIZED,
        [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
        "this dashboard needs its token: Authorization: Bearer TOKEN, or ?token=TOKEN\n",
    )
        .into_response()
}

/// Compares without stopping at the first difference.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub(crate) async fn grant(
    pool: &PgPool,
    application: Option<&str>,
    operator: Option<&str>,
) -> Result<String, Failure> {
    use pg_semaphore::admin::{Access, grant_access};
    let mut out = String::new();
    for (role, access) in [
        (application, Access::Application),
        (operator, Access::Operator),
    ] {
        if let Some(role) = role {
            let routines = grant_access(pool, role, access).await?;
            out.push_str(&format!(
                "granted the {access} part to {role:?}: the schema, its tables to read, {routines} functions\n"
            ));
        }
    }
    Ok(out)
}

pub(crate) async fn release(pool: &PgPool, id: i64) -> Result<String, Failure> {
    Ok(match pg_semaphore::admin::force_release(pool, id).await? {
        ReleaseOutcome::Released { semaphore, at } => {
            format!("released claim {id} of {semaphore:?} at {}\n", rfc3339(at))
        }
        ReleaseOutcome::AlreadyTimedOut { semaphore, at } => format!(
            "claim {id} of {semaphore:?} had already timed out at {}: nothing to do\n",
            rfc3339(at)
        ),
        ReleaseOutcome::AlreadyCompleted { semaphore, at } => format!(
            "claim {id} of {semaphore:?} had already been released at {}: nothing to do\n",
            rfc3339(at)
        ),
        _ => return Err(Failure::not_found(format!("no claim {id}"))),
    })
}

pub(crate) async fn set_capacity(
    pool: &PgPool,
    name: &str,
    capacity: u32,
) -> Result<String, Failure> {
    let previous = pg_semaphore::admin::set_capacity(pool, name, capacity).await?;
    Ok(format!("{name}: capacity {previous} -> {capacity}\n"))
}

pub(crate) async fn fair_weight(
    pool: &PgPool,
    name: &str,
    key: Option<&str>,
    weight: u32,
) -> Result<String, Failure> {
    let previous = pg_semaphore::admin::set_fairness_weight(pool, name, key, weight).await?;
    let key = match key {
        Some(key) => format!("key {key:?}"),
        None => "the default key".to_owned(),
    };
    Ok(format!("{name}: {key}: weight {previous} -> {weight}\n"))
}

pub(crate) async fn clear_queue(pool: &PgPool, name: &str) -> Result<String, Failure> {
    let removed = pg_semaphore::admin::clear_queue(pool, name).await?;
    Ok(format!(
        "{name}: removed {removed} waiter{} from the queue\n",
        plural(removed)
    ))
}

pub(crate) async fn prune(pool: &PgPool, older_than: Duration) -> Result<String, Failure> {
    let deleted = pg_semaphore::admin::prune_claims(pool, older_than).await?;
    Ok(format!(
        "deleted {deleted} finished claim{} that ended more than {} ago\n",
        plural(deleted),
        human(older_than)
    ))
}

pub(crate) async fn limits(pool: &PgPool, command: LimitsCommand) -> Result<String, Failure> {
    use pg_semaphore::{RatePolicy, admin::LimiterKind};
    let what = |kind: LimiterKind, limiter: &str, key: Option<&str>| match key {
        Some(key) => format!("{kind} {limiter} key {key:?}"),
        None => format!("{kind} {limiter}"),
    };
    Ok(match command {
        LimitsCommand::List { json } => {
            let settings = pg_semaphore::admin::rate_limit_settings(pool).await?;
            if json {
                render::limits_json(&settings)
            } else {
                render::limits_table(&settings)
            }
        }
        LimitsCommand::Set {
            target,
            rate,
            burst,
            permit_limit,
            window,
        } => {
            let policy = match (target.kind, rate, burst, permit_limit, window) {
                (LimiterKind::TokenBucket, Some(rate), Some(burst), None, None) => {
                    RatePolicy::token_bucket(rate, burst)
                }
                (LimiterKind::TokenBucket, ..) => {
                    return Err(Failure::usage("a token bucket takes --rate and --burst"));
                }
                (LimiterKind::FixedWindow, None, None, Some(permit_limit), Some(window)) => {
                    RatePolicy::fixed_window(permit_limit, window)
                }
                (LimiterKind::SlidingWindow, None, None, Some(permit_limit), Some(window)) => {
                    RatePolicy::sliding_window(permit_limit, window)
                }
                _ => {
                    return Err(Failure::usage(
                        "a fixed or sliding window takes --permit-limit and --window",
                    ));
                }
            };
            let key = target.key.as_deref();
            pg_semaphore::admin::set_rate_limit(pool, &target.limiter, key, policy).await?;
            format!(
                "{}: stored {}\n",
                what(target.kind, &target.limiter, key),
                render::policy(&policy)
            )
        }
        LimitsCommand::Clear { target } => {
            let key = target.key.as_deref();
            let had =
                pg_semaphore::admin::clear_rate_limit(pool, target.kind, &target.limiter, key)
                    .await?;
            let what = what(target.kind, &target.limiter, key);
            if had {
                format!("{what}: stored limits cleared\n")
            } else {
                format!("{what}: no stored limits: nothing to do\n")
            }
        }
        LimitsCommand::Pause { target, duration } => {
            let key = target.key.as_deref();
            let until = pg_semaphore::admin::pause_rate_limit(
                pool,
                target.kind,
                &target.limiter,
                key,
                duration,
            )
            .await?;
            format!(
                "{}: paused until {}\n",
                what(target.kind, &target.limiter, key),
                rfc3339(until)
            )
        }
        LimitsCommand::Resume { target } => {
            let key = target.key.as_deref();
            let had =
                pg_semaphore::admin::resume_rate_limit(pool, target.kind, &target.limiter, key)
                    .await?;
            let what = what(target.kind, &target.limiter, key);
            if had {
                format!("{what}: resumed\n")
            } else {
                format!("{what}: not paused: nothing to do\n")
            }
        }
    })
}

pub(crate) async fn families(pool: &PgPool, json: bool) -> Result<String, Failure> {
    let list = pg_semaphore::admin::families(pool).await?;
    Ok(if json {
        render::families_json(&list)
    } else {
        render::families_table(&list)
    })
}

pub(crate) async fn family(
    pool: &PgPool,
    name: &str,
    top: u32,
    json: bool,
) -> Result<String, Failure> {
    let Some(family) = pg_semaphore::admin::families(pool)
        .await?
        .into_iter()
        .find(|f| f.name == name)
    else {
        return Err(Failure::not_found(format!(
            "no semaphore family named {name:?}"
        )));
    };
    let busiest = pg_semaphore::admin::busiest_keys(pool, name, top).await?;
    Ok(if json {
        render::family_json(&family, &busiest)
    } else {
        render::family_text(&family, &busiest)
    })
}

pub(crate) async fn rule(
    pool: &PgPool,
    family: &str,
    key: Option<String>,
    tier: Option<String>,
    capacity: Option<u32>,
) -> Result<String, Failure> {
    let (kind, matches, what) = match (key, tier) {
        (Some(key), _) => (RuleKind::Key, key, "key"),
        (None, Some(tier)) => (RuleKind::Tier, tier, "tier"),
        (None, None) => return Err(Failure::usage("a rule needs --key or --tier")),
    };
    let changed =
        pg_semaphore::admin::set_family_rule(pool, family, kind, &matches, capacity).await?;
    Ok(match capacity {
        Some(capacity) => format!(
            "{family}: {what} {matches:?} -> capacity {capacity} ({changed} existing key{} changed)\n",
            plural(changed)
        ),
        None => format!(
            "{family}: rule for {what} {matches:?} removed ({changed} existing key{} changed)\n",
            plural(changed)
        ),
    })
}

pub(crate) async fn tier(
    pool: &PgPool,
    family: &str,
    key: &str,
    tier: Option<&str>,
) -> Result<String, Failure> {
    let changed = pg_semaphore::admin::set_family_tier(pool, family, key, tier).await?;
    Ok(match tier {
        Some(tier) => format!(
            "{family}: key {key:?} in tier {tier:?} ({changed} existing key{} changed)\n",
            plural(changed)
        ),
        None => format!(
            "{family}: key {key:?} in no tier ({changed} existing key{} changed)\n",
            plural(changed)
        ),
    })
}
