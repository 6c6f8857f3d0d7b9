//! One function per command: call the library, hand its data to `render`,
//! return the text to print. Failures carry their exit status.

use std::time::Duration;

use chrono::Utc;
use pg_semaphore::{
    Error,
    admin::{ReleaseOutcome, RuleKind},
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
    if json {
        return Ok(render::status_json(&list));
    }
    let mut out = render::status_table(&list);
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
    let log = AuditLog::new(pool);
    // The name is resolved as `report` resolves it: a lease semaphore's row
    // (a named semaphore, or a family key, idle or not, while it has
    // history), else an advisory semaphore. An unknown name would just give
    // an empty log: say so instead.
    let summary = log.summary(&args.name, window.clone()).await?;
    let kind = summary.kind;
    if kind == SemaphoreKind::Advisory
        && !pg_semaphore::admin::semaphores(pool)
            .await?
            .iter()
            .any(|s| s.kind == kind && s.name == args.name)
    {
        return Err(not_found(pool, &args.name).await);
    }
    let claims = log.history(&args.name, window.clone()).await?;
    if args.csv {
        return Ok(render::audit_csv(kind, &claims));
    }
    Ok(if args.json {
        render::audit_json(&args.name, &window, &claims, &summary)
    } else {
        render::audit_table(&args.name, &window, &claims, &summary)
    })
}

pub(crate) async fn report(pool: &PgPool, args: ReportArgs) -> Result<String, Failure> {
    let w = &args.window;
    let window = parse::window(w.last, w.since, w.until, Utc::now()).map_err(Failure::usage)?;
    let report = match AuditLog::new(pool)
        .report_shaped(&args.name, window, render::report::SHAPE)
        .await
    {
        Err(Error::SemaphoreNotFound { .. }) => return Err(not_found(pool, &args.name).await),
        other => other?,
    };
    let page = render::report::html(&report);
    if args.html.as_os_str() == "-" {
        return Ok(page);
    }
    std::fs::write(&args.html, page).map_err(|e| {
        Failure::new(
            EXIT_FAILURE,
            format!("cannot write {}: {e}", args.html.display()),
        )
    })?;
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
    Ok(format!(
        "wrote {}: {} {what}{} of {:?} between {} and {} ({drawn})\n",
        args.html.display(),
        report.summary.total(),
        plural(report.summary.total()),
        report.semaphore,
        rfc3339(report.since),
        rfc3339(report.until),
    ))
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
