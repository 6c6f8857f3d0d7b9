//! Rendering the library's data for a terminal or a script: aligned tables,
//! JSON and CSV, the short human forms of times and durations, and (in
//! `report`) the HTML report.

pub(crate) mod report;

use std::fmt::Write as _;
use std::ops::Range;
use std::time::Duration;

use chrono::{DateTime, DurationRound, SecondsFormat, TimeDelta, Utc};
use pg_semaphore::{
    RatePolicy,
    admin::{
        FamilyInfo, FamilyKeyInfo, HorizonHolder, HorizonHolderKind, LimiterKind, OutcomeCounts,
        OutcomeKind, RateLimitSetting, RateLimiterInfo, RuleKind, SemaphoreInfo,
    },
    audit::{ClaimRecord, Holder, Outcome, SemaphoreKind, Summary},
};
use serde::Serialize;
use std::collections::BTreeMap;

/// Admitted, refused and timed-out requests added up (of a name, over
/// minutes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Totals {
    pub(crate) admitted: u64,
    pub(crate) refused: u64,
    pub(crate) timed_out: u64,
}

impl Totals {
    fn add(&mut self, row: &OutcomeCounts) {
        self.admitted += row.admitted;
        self.refused += row.refused;
        self.timed_out += row.timed_out;
    }
}

/// The minutes' counts added up.
pub(crate) fn total(minutes: &[OutcomeCounts]) -> Totals {
    let mut total = Totals::default();
    for row in minutes {
        total.add(row);
    }
    total
}

/// The outcome counters `status` shows: each name's counts in the minutes
/// that overlap the last 60 s, added up.
#[derive(Debug)]
pub(crate) struct Counted {
    by_name: BTreeMap<(OutcomeKind, String), Totals>,
    /// The start of the first minute counted.
    since: DateTime<Utc>,
}

impl Counted {
    /// `rows`: the minutes that overlap the window starting at `since`.
    pub(crate) fn new(rows: Vec<OutcomeCounts>, since: DateTime<Utc>) -> Counted {
        let mut by_name: BTreeMap<(OutcomeKind, String), Totals> = BTreeMap::new();
        for row in &rows {
            by_name
                .entry((row.kind, row.name.clone()))
                .or_default()
                .add(row);
        }
        Counted {
            by_name,
            since: since.duration_trunc(TimeDelta::minutes(1)).unwrap_or(since),
        }
    }

    fn of(&self, kind: OutcomeKind, name: &str) -> Totals {
        self.by_name
            .get(&(kind, name.to_owned()))
            .copied()
            .unwrap_or_default()
    }

    /// A semaphore's counts; `None` for a family key, counted under its family.
    fn of_semaphore(&self, sem: &SemaphoreInfo) -> Option<Totals> {
        if sem.name.starts_with('@') {
            return None;
        }
        Some(match sem.kind {
            SemaphoreKind::Advisory => self.of(OutcomeKind::Advisory, &sem.name),
            _ => self.of(OutcomeKind::Semaphore, &sem.name),
        })
    }

    /// The rate limiters with counts, by kind and name.
    fn limiters(&self) -> impl Iterator<Item = (LimiterKind, &str)> {
        self.by_name
            .keys()
            .filter_map(|(kind, name)| Some((kind.limiter()?, name.as_str())))
    }
}

/// What `status` shows.
pub(crate) struct Status<'a> {
    pub(crate) semaphores: &'a [SemaphoreInfo],
    pub(crate) families: &'a [FamilyInfo],
    pub(crate) limiters: &'a [RateLimiterInfo],
    pub(crate) counted: &'a Counted,
    /// Whether it shows every semaphore (no name given), and so the
    /// families and the rate limiters too.
    pub(crate) whole: bool,
}

impl Status<'_> {
    /// Every rate limiter to show: those the database stores, and those
    /// with counts only (their keys pruned and limits cleared), by name;
    /// none for one semaphore's status.
    fn limiter_rows(&self) -> Vec<(LimiterKind, &str, Option<&RateLimiterInfo>)> {
        if !self.whole {
            return Vec::new();
        }
        let mut rows: Vec<(LimiterKind, &str, Option<&RateLimiterInfo>)> = self
            .limiters
            .iter()
            .map(|l| (l.kind, l.name.as_str(), Some(l)))
            .collect();
        for (kind, name) in self.counted.limiters() {
            if !rows.iter().any(|(k, n, _)| *k == kind && *n == name) {
                rows.push((kind, name, None));
            }
        }
        rows.sort_by(|a, b| (a.1, a.0.as_str()).cmp(&(b.1, b.0.as_str())));
        rows
    }
}

/// A count for a table cell: `-` where it is counted elsewhere.
fn cell(count: Option<u64>) -> String {
    count.map_or_else(|| "-".to_owned(), |n| n.to_string())
}

/// `pg-semaphore status`: one row per lease semaphore, then each one's
/// holders; then one row per advisory semaphore, then each one's holders;
/// then the families and the rate limiters; then which minutes the
/// REFUSED and TIMED OUT columns count.
pub(crate) fn status_table(status: &Status<'_>) -> String {
    let (list, advisory): (Vec<&SemaphoreInfo>, Vec<&SemaphoreInfo>) = status
        .semaphores
        .iter()
        .partition(|s| s.kind == SemaphoreKind::Lease);
    let (list, advisory) = (&list[..], &advisory[..]);
    let limiters = status.limiter_rows();
    let mut out = String::new();
    if list.is_empty() && advisory.is_empty() {
        out.push_str("no semaphores yet\n");
    }
    if !list.is_empty() {
        lease_table(&mut out, list, status.counted);
    }
    if !advisory.is_empty() {
        if !out.is_empty() {
            out.push('\n');
        }
        advisory_table(&mut out, advisory, status.counted);
    }
    if !status.families.is_empty() {
        out.push('\n');
        status_families(&mut out, status.families, status.counted);
    }
    if !limiters.is_empty() {
        out.push('\n');
        status_limiters(&mut out, &limiters, status.counted);
    }
    if !(list.is_empty()
        && advisory.is_empty()
        && status.families.is_empty()
        && limiters.is_empty())
    {
        let _ = writeln!(
            out,
            "\nREFUSED, TIMED OUT, ADMITTED: the minutes since {} (this one so far and the previous: \
             the last 60 s at least), as every process writes them every 5 s",
            rfc3339(status.counted.since)
        );
    }
    out
}

/// The families, each with its keys' refusals and timeouts together.
fn status_families(out: &mut String, families: &[FamilyInfo], counted: &Counted) {
    let rows: Vec<Vec<String>> = families
        .iter()
        .map(|f| {
            let counts = counted.of(OutcomeKind::Family, &f.name);
            vec![
                f.name.clone(),
                f.default_capacity.to_string(),
                f.keys.to_string(),
                counts.refused.to_string(),
                counts.timed_out.to_string(),
            ]
        })
        .collect();
    table(
        out,
        "",
        &["FAMILY", "DEFAULT", "KEYS", "REFUSED", "TIMED OUT"],
        &rows,
    );
}

/// The rate limiters: kind, limits and pause for all their keys, keys
/// paused on their own, keys, and their decisions.
fn status_limiters(
    out: &mut String,
    limiters: &[(LimiterKind, &str, Option<&RateLimiterInfo>)],
    counted: &Counted,
) {
    let rows: Vec<Vec<String>> = limiters
        .iter()
        .map(|(kind, name, info)| {
            let counts = counted.of((*kind).into(), name);
            let (limit, paused, paused_keys, keys) = match info {
                Some(info) => (
                    info.policy
                        .as_ref()
                        .map_or_else(|| "-".to_owned(), compact_policy),
                    match info.paused_until {
                        Some(until) if info.is_paused() => format!("until {}", rfc3339(until)),
                        _ => "-".to_owned(),
                    },
                    info.paused_keys.to_string(),
                    info.keys.to_string(),
                ),
                None => (
                    "-".to_owned(),
                    "-".to_owned(),
                    "0".to_owned(),
                    "0".to_owned(),
                ),
            };
            vec![
                (*name).to_owned(),
                kind.as_str().to_owned(),
                limit,
                paused,
                paused_keys,
                keys,
                counts.admitted.to_string(),
                counts.refused.to_string(),
                counts.timed_out.to_string(),
            ]
        })
        .collect();
    table(
        out,
        "",
        &[
            "RATE LIMITER",
            "KIND",
            "LIMIT",
            "PAUSED",
            "PAUSED KEYS",
            "KEYS",
            "ADMITTED",
            "REFUSED",
            "TIMED OUT",
        ],
        &rows,
    );
}

/// A policy's limits in one word, for a table cell: `50/s,burst=100`,
/// `1000/1d`.
fn compact_policy(policy: &RatePolicy) -> String {
    match *policy {
        RatePolicy::TokenBucket { rate, burst } => format!("{rate}/s,burst={burst}"),
        RatePolicy::FixedWindow {
            permit_limit,
            window,
        }
        | RatePolicy::SlidingWindow {
            permit_limit,
            window,
        } => format!("{permit_limit}/{}", human(window)),
        _ => "?".to_owned(),
    }
}

/// The advisory locks that are no semaphore's (mutexes): key (or the name
/// given for it), state, mode, backend, application, client, since when.
pub(crate) fn mutexes_table(
    locks: &[pg_semaphore::admin::MutexHolder],
    named: &[(sqlx::postgres::PgAdvisoryLockKey, &str)],
    now: DateTime<Utc>,
) -> String {
    let rows: Vec<Vec<String>> = locks
        .iter()
        .map(|lock| {
            let key = match named.iter().find(|(key, _)| *key == lock.key) {
                Some((_, name)) => (*name).to_owned(),
                None => match &lock.key {
                    sqlx::postgres::PgAdvisoryLockKey::BigInt(key) => key.to_string(),
                    sqlx::postgres::PgAdvisoryLockKey::IntPair(a, b) => format!("({a}, {b})"),
                    other => format!("{other:?}"),
                },
            };
            vec![
                key,
                if lock.granted { "held" } else { "waiting" }.to_owned(),
                if lock.shared { "shared" } else { "exclusive" }.to_owned(),
                lock.pid.to_string(),
                lock.application_name
                    .clone()
                    .unwrap_or_else(|| "-".to_owned()),
                lock.client_addr.clone().unwrap_or_else(|| "-".to_owned()),
                lock.since.map_or_else(
                    || "-".to_owned(),
                    |at| human((now - at).to_std().unwrap_or_default()),
                ),
            ]
        })
        .collect();
    let mut out = String::new();
    table(
        &mut out,
        "",
        &[
            "MUTEX (ADVISORY LOCK)",
            "STATE",
            "MODE",
            "PID",
            "APPLICATION",
            "CLIENT",
            "FOR",
        ],
        &rows,
    );
    out
}

/// The lease semaphores' table and their holders' tables.
fn lease_table(out: &mut String, list: &[&SemaphoreInfo], counted: &Counted) {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|sem| {
            let held = sem.held();
            let counts = counted.of_semaphore(sem);
            vec![
                sem.name.clone(),
                sem.capacity.to_string(),
                held.to_string(),
                sem.capacity.saturating_sub(held).to_string(),
                sem.default_lease.map_or_else(|| "-".to_owned(), human),
                cell(counts.map(|c| c.refused)),
                cell(counts.map(|c| c.timed_out)),
            ]
        })
        .collect();
    table(
        out,
        "",
        &[
            "SEMAPHORE",
            "CAPACITY",
            "HELD",
            "FREE",
            "LEASE",
            "REFUSED",
            "TIMED OUT",
        ],
        &rows,
    );
    for sem in list.iter().filter(|s| !s.holders.is_empty()) {
        let _ = writeln!(out, "\n{}:", sem.name);
        let rows: Vec<Vec<String>> = sem
            .holders
            .iter()
            .map(|h| {
                let (created_at, expires_at) = lease_times(h, sem.as_of);
                let left = expires_at - sem.as_of;
                vec![
                    h.id.unwrap_or_default().to_string(),
                    h.slot.to_string(),
                    h.holder.clone().unwrap_or_default(),
                    human(signed(sem.as_of - created_at)),
                    if left > TimeDelta::zero() {
                        human(signed(left))
                    } else {
                        format!("expired {} ago", human(signed(-left)))
                    },
                    sem.silence(h).map_or_else(|| "-".to_owned(), human),
                ]
            })
            .collect();
        table(
            out,
            "  ",
            &["CLAIM", "SLOT", "HOLDER", "AGE", "LEASE LEFT", "SILENT"],
            &rows,
        );
    }
}

/// The advisory semaphores' table and, for each held one, its holders: the
/// sessions whose advisory locks its slots are.
/// A lease holder's claim and lease end (`at` for either, never missing
/// from a lease holder).
fn lease_times(h: &Holder, at: DateTime<Utc>) -> (DateTime<Utc>, DateTime<Utc>) {
    (h.created_at.unwrap_or(at), h.expires_at.unwrap_or(at))
}

fn advisory_table(out: &mut String, list: &[&SemaphoreInfo], counted: &Counted) {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|sem| {
            let held = sem.held();
            let counts = counted.of_semaphore(sem);
            vec![
                sem.name.clone(),
                sem.capacity.to_string(),
                held.to_string(),
                sem.capacity.saturating_sub(held).to_string(),
                cell(counts.map(|c| c.refused)),
                cell(counts.map(|c| c.timed_out)),
            ]
        })
        .collect();
    table(
        out,
        "",
        &[
            "ADVISORY SEMAPHORE",
            "CAPACITY",
            "HELD",
            "FREE",
            "REFUSED",
            "TIMED OUT",
        ],
        &rows,
    );
    for sem in list.iter().filter(|s| !s.holders.is_empty()) {
        let _ = writeln!(out, "\n{} (advisory):", sem.name);
        let rows: Vec<Vec<String>> = sem
            .holders
            .iter()
            .map(|h| {
                vec![
                    if h.shared == Some(true) {
                        format!("{} (shared)", h.slot)
                    } else {
                        h.slot.to_string()
                    },
                    h.pid.map_or_else(|| "-".to_owned(), |pid| pid.to_string()),
                    client(h),
                    h.backend_start
                        .map_or_else(|| "-".to_owned(), |at| human(signed(sem.as_of - at))),
                    match h.application_name.as_deref() {
                        None | Some("") => "-".to_owned(),
                        Some(name) => name.to_owned(),
                    },
                ]
            })
            .collect();
        table(
            out,
            "  ",
            &["SLOT", "PID", "CLIENT", "CONNECTED FOR", "APPLICATION"],
            &rows,
        );
    }
}

/// An advisory holder's client: its address, `local` for a Unix socket
/// (the session is visible but has no address), `-` when this role may not
/// see it.
fn client(holder: &Holder) -> String {
    match (&holder.client_addr, holder.backend_start) {
        (Some(addr), _) => addr.clone(),
        (None, Some(_)) => "local".to_owned(),
        (None, None) => "-".to_owned(),
    }
}

/// `pg-semaphore status --json`: one array: the semaphores of both kinds,
/// by name, each as the library serializes it (with its `kind`) and its
/// counts; then the families (`"kind": "family"`) and the rate limiters
/// (`"kind": "rate_limiter"`), with theirs. Every element carries
/// `counted_since`, the start of the minutes its counts add up.
pub(crate) fn status_json(status: &Status<'_>) -> String {
    /// An element with its counts after its own fields.
    #[derive(Serialize)]
    struct WithCounts<T> {
        #[serde(flatten)]
        item: T,
        #[serde(skip_serializing_if = "Option::is_none")]
        admitted: Option<u64>,
        refused: Option<u64>,
        timed_out: Option<u64>,
        counted_since: DateTime<Utc>,
    }
    #[derive(Serialize)]
    struct Family<'a> {
        kind: &'static str,
        name: &'a str,
        default_capacity: u32,
        keys: u64,
    }
    #[derive(Serialize)]
    struct Limiter<'a> {
        kind: &'static str,
        limiter_kind: LimiterKind,
        name: &'a str,
        limit: Option<RatePolicy>,
        paused_until: Option<DateTime<Utc>>,
        paused_keys: u64,
        keys: u64,
    }
    #[derive(Serialize)]
    #[serde(untagged)]
    enum Element<'a> {
        Semaphore(WithCounts<&'a SemaphoreInfo>),
        Family(WithCounts<Family<'a>>),
        Limiter(WithCounts<Limiter<'a>>),
    }
    let since = status.counted.since;
    fn with<T>(
        item: T,
        counts: Option<Totals>,
        admitted: bool,
        since: DateTime<Utc>,
    ) -> WithCounts<T> {
        WithCounts {
            item,
            admitted: counts.filter(|_| admitted).map(|c| c.admitted),
            refused: counts.map(|c| c.refused),
            timed_out: counts.map(|c| c.timed_out),
            counted_since: since,
        }
    }
    let mut all: Vec<Element<'_>> = Vec::new();
    for sem in status.semaphores {
        all.push(Element::Semaphore(with(
            sem,
            status.counted.of_semaphore(sem),
            false,
            since,
        )));
    }
    for family in status.families {
        let counts = status.counted.of(OutcomeKind::Family, &family.name);
        let item = Family {
            kind: "family",
            name: &family.name,
            default_capacity: family.default_capacity,
            keys: family.keys,
        };
        all.push(Element::Family(with(item, Some(counts), false, since)));
    }
    for (kind, name, info) in status.limiter_rows() {
        let counts = status.counted.of(kind.into(), name);
        let item = Limiter {
            kind: "rate_limiter",
            limiter_kind: kind,
            name,
            limit: info.and_then(|i| i.policy),
            paused_until: info.and_then(|i| i.paused_until.filter(|_| i.is_paused())),
            paused_keys: info.map_or(0, |i| i.paused_keys),
            keys: info.map_or(0, |i| i.keys),
        };
        all.push(Element::Limiter(with(item, Some(counts), true, since)));
    }
    json(&all)
}

/// A rate limiter's decisions per minute over a window (`audit --limiter`,
/// `report --limiter`).
pub(crate) struct LimiterHistory<'a> {
    pub(crate) limiter: &'a str,
    pub(crate) kind: LimiterKind,
    pub(crate) window: &'a Range<DateTime<Utc>>,
    /// What the database stores of it, if anything.
    pub(crate) info: Option<&'a RateLimiterInfo>,
    pub(crate) minutes: &'a [OutcomeCounts],
}

/// What the database stores of a limiter, in one line.
fn limiter_line(info: Option<&RateLimiterInfo>) -> String {
    let Some(info) = info else {
        return "no stored limits, pause or keys".to_owned();
    };
    let limit = info.policy.as_ref().map_or_else(
        || "no stored limits".to_owned(),
        |p| format!("limit {}", policy(p)),
    );
    let paused = match info.paused_until {
        Some(until) if info.is_paused() => format!("paused until {}", rfc3339(until)),
        _ => "not paused".to_owned(),
    };
    format!(
        "{limit}; {paused}; {} key{}, {} paused on its own",
        info.keys,
        plural(info.keys),
        info.paused_keys
    )
}

/// `pg-semaphore audit --limiter`: the minutes as a table, then the totals
/// and the stored limits.
pub(crate) fn limiter_audit_table(history: &LimiterHistory<'_>) -> String {
    let mut out = format!(
        "decisions of {} rate limiter {:?} per minute between {} and {}\n\n",
        history.kind,
        history.limiter,
        rfc3339(history.window.start),
        rfc3339(history.window.end)
    );
    if history.minutes.is_empty() {
        out.push_str("(none)\n");
    } else {
        let rows: Vec<Vec<String>> = history
            .minutes
            .iter()
            .map(|m| {
                vec![
                    rfc3339(m.minute),
                    m.admitted.to_string(),
                    m.refused.to_string(),
                    m.timed_out.to_string(),
                ]
            })
            .collect();
        table(
            &mut out,
            "",
            &["MINUTE", "ADMITTED", "REFUSED", "TIMED OUT"],
            &rows,
        );
    }
    let total = total(history.minutes);
    let decided = total.admitted + total.refused + total.timed_out;
    let share = if decided == 0 {
        String::new()
    } else {
        format!(
            " ({:.1}% refused or timed out)",
            (total.refused + total.timed_out) as f64 * 100.0 / decided as f64
        )
    };
    let _ = writeln!(
        out,
        "\ntotal: {} admitted, {} refused, {} timed out{share}\nstored: {}\n\
         counted as every process reported them, in the minute it wrote them (every 5 s)",
        total.admitted,
        total.refused,
        total.timed_out,
        limiter_line(history.info),
    );
    out
}

/// `pg-semaphore audit --limiter --json`.
pub(crate) fn limiter_audit_json(history: &LimiterHistory<'_>) -> String {
    #[derive(Serialize)]
    struct Audit<'a> {
        limiter: &'a str,
        kind: LimiterKind,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        info: Option<&'a RateLimiterInfo>,
        minutes: &'a [OutcomeCounts],
        total: Totals,
    }
    json(&Audit {
        limiter: history.limiter,
        kind: history.kind,
        since: history.window.start,
        until: history.window.end,
        info: history.info,
        minutes: history.minutes,
        total: total(history.minutes),
    })
}

/// `pg-semaphore audit --limiter --csv`: a header line, then one line per
/// minute with counts.
pub(crate) fn limiter_audit_csv(minutes: &[OutcomeCounts]) -> String {
    let mut out = String::from("minute,admitted,refused,timed_out\n");
    for m in minutes {
        let _ = writeln!(
            out,
            "{},{},{},{}",
            rfc3339(m.minute),
            m.admitted,
            m.refused,
            m.timed_out
        );
    }
    out
}

/// A rate policy's limits, as the CLI prints them (its kind is printed
/// beside them).
pub(crate) fn policy(policy: &RatePolicy) -> String {
    match *policy {
        RatePolicy::TokenBucket { rate, burst } => format!("rate {rate}/s, burst {burst}"),
        RatePolicy::FixedWindow {
            permit_limit,
            window,
        }
        | RatePolicy::SlidingWindow {
            permit_limit,
            window,
        } => format!("{permit_limit} per {}", human(window)),
        _ => "?".to_owned(),
    }
}

/// `pg-semaphore limits list`: one line per limiter or key with stored
/// limits or a pause.
pub(crate) fn limits_table(settings: &[RateLimitSetting]) -> String {
    if settings.is_empty() {
        return "no stored rate limits or pauses: every limiter applies its code's limits\n"
            .to_owned();
    }
    let mut out = format!(
        "{:<15} {:<24} {:<20} {:<28} {}\n",
        "KIND", "LIMITER", "KEY", "LIMIT", "PAUSED"
    );
    for s in settings {
        let limit = s.policy.as_ref().map_or_else(|| "-".to_owned(), policy);
        let paused = match s.paused_until {
            Some(until) if s.is_paused() => format!(
                "until {} ({} left)",
                rfc3339(until),
                human((until - s.as_of).to_std().unwrap_or_default())
            ),
            _ => "-".to_owned(),
        };
        let _ = writeln!(
            out,
            "{:<15} {:<24} {:<20} {:<28} {}",
            s.kind.as_str(),
            s.limiter,
            s.key.as_deref().unwrap_or("(all keys)"),
            limit,
            paused
        );
    }
    out
}

/// `pg-semaphore families`: one row per family.
pub(crate) fn families_table(list: &[FamilyInfo]) -> String {
    if list.is_empty() {
        return "no semaphore families yet\n".to_owned();
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|f| {
            vec![
                f.name.clone(),
                f.default_capacity.to_string(),
                human(f.default_lease),
                human(f.idle_after),
                f.keys.to_string(),
                f.rules.len().to_string(),
                f.tiered_keys.to_string(),
            ]
        })
        .collect();
    let mut out = String::new();
    table(
        &mut out,
        "",
        &[
            "FAMILY",
            "DEFAULT",
            "LEASE",
            "IDLE AFTER",
            "KEYS",
            "RULES",
            "TIERED KEYS",
        ],
        &rows,
    );
    out
}

/// `pg-semaphore families --json`.
pub(crate) fn families_json(list: &[FamilyInfo]) -> String {
    json(&list)
}

/// `pg-semaphore family NAME`: its settings, its rules, its busiest keys
/// and their holders.
pub(crate) fn family_text(family: &FamilyInfo, busiest: &[FamilyKeyInfo]) -> String {
    let mut out = families_table(std::slice::from_ref(family));
    out.push_str("\nrules (a key's own rule, else its tier's, else the default):\n");
    if family.rules.is_empty() {
        out.push_str("  none: every key has the default\n");
    } else {
        let rows: Vec<Vec<String>> = family
            .rules
            .iter()
            .map(|r| {
                vec![
                    match r.kind {
                        RuleKind::Key => "key".to_owned(),
                        _ => "tier".to_owned(),
                    },
                    r.matches.clone(),
                    r.capacity.to_string(),
                ]
            })
            .collect();
        table(&mut out, "  ", &["KIND", "MATCH", "CAPACITY"], &rows);
    }
    out.push_str("\nbusiest keys:\n");
    if busiest.is_empty() {
        out.push_str("  no key is held\n");
        return out;
    }
    let rows: Vec<Vec<String>> = busiest
        .iter()
        .map(|k| {
            vec![
                k.key.clone(),
                k.capacity.to_string(),
                k.held.to_string(),
                k.capacity.saturating_sub(k.held).to_string(),
            ]
        })
        .collect();
    table(&mut out, "  ", &["KEY", "CAPACITY", "HELD", "FREE"], &rows);
    for key in busiest {
        let _ = writeln!(out, "\n  {}:", key.key);
        let rows: Vec<Vec<String>> = key
            .holders
            .iter()
            .map(|h| {
                vec![
                    h.id.unwrap_or_default().to_string(),
                    h.slot.to_string(),
                    h.holder.clone().unwrap_or_default(),
                    h.created_at.map(rfc3339).unwrap_or_default(),
                ]
            })
            .collect();
        table(
            &mut out,
            "    ",
            &["CLAIM", "SLOT", "HOLDER", "CLAIMED AT"],
            &rows,
        );
    }
    out
}

/// `pg-semaphore limits list --json`.
pub(crate) fn limits_json(settings: &[RateLimitSetting]) -> String {
    json(&settings)
}

/// `pg-semaphore family NAME --json`.
pub(crate) fn family_json(family: &FamilyInfo, busiest: &[FamilyKeyInfo]) -> String {
    #[derive(Serialize)]
    struct Out<'a> {
        family: &'a FamilyInfo,
        busiest_keys: &'a [FamilyKeyInfo],
    }
    json(&Out {
        family,
        busiest_keys: busiest,
    })
}

/// `pg-semaphore doctor`: who holds the xmin horizon, for how long, and
/// what to do.
pub(crate) fn doctor_text(holder: Option<&HorizonHolder>) -> String {
    let Some(h) = holder else {
        return "xmin horizon: not held (no other session, replication slot or prepared \
                transaction has a snapshot or a transaction id in this database)\n"
            .to_owned();
    };
    let mut out = match h.held_for {
        Some(d) => format!("xmin horizon: held for {} by {h}", human(d)),
        None => format!(
            "xmin horizon: held by {h}; for how long is not visible to this role \
             (grant it pg_read_all_stats)"
        ),
    };
    let _ = writeln!(
        out,
        ", {} transaction id{} behind",
        h.age_xids,
        plural(h.age_xids.max(0) as u64)
    );
    if let Some(since) = h.since {
        let _ = writeln!(out, "  since {}", rfc3339(since));
    }
    let _ = writeln!(
        out,
        "  {}",
        match h.kind {
            HorizonHolderKind::Session => match h.pid {
                Some(pid) =>
                    format!("ends with its transaction, or: SELECT pg_terminate_backend({pid});"),
                None => "ends with its transaction".to_owned(),
            },
            HorizonHolderKind::ReplicationSlot =>
                "ends when its consumer catches up, or: SELECT pg_drop_replication_slot(name);"
                    .to_owned(),
            HorizonHolderKind::PreparedTransaction =>
                "ends with COMMIT PREPARED or ROLLBACK PREPARED of its gid".to_owned(),
            _ => "ends when it does".to_owned(),
        }
    );
    out.push_str(
        "  while a holder stays for minutes, the lease semaphore slows down (AdvisorySemaphore \
         and Mutex write no rows, the rate limiters read only each key's newest row: they do \
         not)\n",
    );
    out
}

/// `pg-semaphore doctor --json`: the holder as the library serializes it,
/// or `null`.
pub(crate) fn doctor_json(holder: Option<&HorizonHolder>) -> String {
    json(&holder)
}

/// `pg-semaphore audit`: the claims as a table, then the summary line (an
/// advisory semaphore's: its finished permits, and what its log does not
/// hold).
pub(crate) fn audit_table(
    name: &str,
    window: &Range<DateTime<Utc>>,
    claims: &[ClaimRecord],
    summary: &Summary,
    outcomes: Option<&[OutcomeCounts]>,
) -> String {
    let mut out = if summary.kind == SemaphoreKind::Advisory {
        advisory_audit_table(name, window, claims, summary)
    } else {
        lease_audit_table(name, window, claims, summary)
    };
    let counted = outcomes.map(total);
    let _ = writeln!(
        out,
        "{}",
        match counted {
            Some(t) => format!(
                "requests refused at once: {}, timed out: {} (the outcome counters' minutes that overlap the window)",
                t.refused, t.timed_out
            ),
            None =>
                "requests refused and timed out: counted under the family, not per key (status)"
                    .to_owned(),
        }
    );
    out
}

fn lease_audit_table(
    name: &str,
    window: &Range<DateTime<Utc>>,
    claims: &[ClaimRecord],
    summary: &Summary,
) -> String {
    let mut out = format!(
        "claims of {:?} held between {} and {}\n\n",
        name,
        rfc3339(window.start),
        rfc3339(window.end)
    );
    if claims.is_empty() {
        out.push_str("(none)\n");
    } else {
        // A GROUP column (the claims of one multi-limit permit share it)
        // only when some claim has one.
        let grouped = claims.iter().any(|c| c.group_id.is_some());
        let rows: Vec<Vec<String>> = claims
            .iter()
            .map(|c| {
                let mut row = vec![
                    c.id.unwrap_or_default().to_string(),
                    slots(&c.slots),
                    c.holder.clone(),
                    rfc3339(c.created_at),
                    c.ended_at.map(rfc3339).unwrap_or_else(|| "-".to_owned()),
                    outcome(c.kind, c.outcome).to_owned(),
                    human(c.held_for),
                ];
                if grouped {
                    row.push(c.group_id.map_or_else(|| "-".to_owned(), |g| g.to_string()));
                }
                row
            })
            .collect();
        let mut header = vec![
            "ID", "SLOT", "HOLDER", "CLAIMED", "ENDED", "OUTCOME", "HELD",
        ];
        if grouped {
            header.push("GROUP");
        }
        table(&mut out, "", &header, &rows);
    }
    let hold = |d: Option<Duration>| d.map_or_else(|| "-".to_owned(), human);
    let _ = writeln!(
        out,
        "\nsummary: {} claims: {} completed, {} timed out, {} live; \
         hold time (finished claims) p50 {}, p95 {}, max {}",
        summary.total(),
        summary.completed,
        summary.timed_out,
        summary.live.unwrap_or(0),
        hold(summary.p50_hold),
        hold(summary.p95_hold),
        hold(summary.max_hold),
    );
    out
}

/// `pg-semaphore audit --json`: the window, its claims and the summary (an
/// advisory semaphore's claims are its finished permits).
pub(crate) fn audit_json(
    name: &str,
    window: &Range<DateTime<Utc>>,
    claims: &[ClaimRecord],
    summary: &Summary,
    outcomes: Option<&[OutcomeCounts]>,
) -> String {
    #[derive(Serialize)]
    struct Audit<'a> {
        semaphore: &'a str,
        kind: SemaphoreKind,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        claims: &'a [ClaimRecord],
        summary: &'a Summary,
        /// The outcome counters' minutes (`null` for a family key).
        outcomes: Option<&'a [OutcomeCounts]>,
    }
    json(&Audit {
        semaphore: name,
        kind: summary.kind,
        since: window.start,
        until: window.end,
        claims,
        summary,
        outcomes,
    })
}

/// What an advisory semaphore's audit shows and does not, under its table.
const ADVISORY_AUDIT_NOTE: &str = "\
advisory semaphore: its log holds finished permits only, written in batches after they end; \
live holders are in `pg-semaphore status`. An advisory permit has no claim id and no lease.";

/// `pg-semaphore audit` of an advisory semaphore: its finished permits as a
/// table, then the summary line and what the log does not hold.
fn advisory_audit_table(
    name: &str,
    window: &Range<DateTime<Utc>>,
    permits: &[ClaimRecord],
    summary: &Summary,
) -> String {
    let mut out = format!(
        "finished permits of {:?} (advisory) held between {} and {}\n\n",
        name,
        rfc3339(window.start),
        rfc3339(window.end)
    );
    if permits.is_empty() {
        out.push_str("(none)\n");
    } else {
        let rows: Vec<Vec<String>> = permits
            .iter()
            .map(|p| {
                vec![
                    slots(&p.slots),
                    p.holder.clone(),
                    rfc3339(p.created_at),
                    p.ended_at.map(rfc3339).unwrap_or_else(|| "-".to_owned()),
                    outcome(p.kind, p.outcome).to_owned(),
                    human(p.held_for),
                ]
            })
            .collect();
        table(
            &mut out,
            "",
            &["SLOTS", "HOLDER", "CLAIMED", "ENDED", "OUTCOME", "HELD"],
            &rows,
        );
    }
    let hold = |d: Option<Duration>| d.map_or_else(|| "-".to_owned(), human);
    let _ = writeln!(
        out,
        "\nsummary: {} permits: {} released, {} dropped, {} lost; \
         hold time p50 {}, p95 {}, max {}\n{ADVISORY_AUDIT_NOTE}",
        summary.total(),
        summary.completed,
        summary.dropped.unwrap_or(0),
        summary.timed_out,
        hold(summary.p50_hold),
        hold(summary.p95_hold),
        hold(summary.max_hold),
    );
    out
}

/// A claim's slots: `3`, or `0,1,2`.
fn slots(slots: &[u32]) -> String {
    slots
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Pretty JSON and a newline.
fn json(value: &impl Serialize) -> String {
    // Serializing to a String fails only for maps with non-string keys, which
    // none of these types has.
    let mut text = serde_json::to_string_pretty(value).expect("JSON of plain data");
    text.push('\n');
    text
}

/// JSON on one line.
fn json_compact(value: &impl Serialize) -> String {
    serde_json::to_string(value).expect("JSON of plain data")
}

/// `pg-semaphore audit --csv`: a header line, then one line per claim (an
/// advisory semaphore's: per finished permit, its slots separated by
/// spaces, without the lease's id and lease end).
pub(crate) fn audit_csv(kind: SemaphoreKind, claims: &[ClaimRecord]) -> String {
    let lease = kind == SemaphoreKind::Lease;
    let mut out = String::from(if lease {
        "id,slot,holder,claimed_at,expires_at,ended_at,outcome,held_seconds,metadata\n"
    } else {
        "slots,holder,claimed_at,ended_at,outcome,held_seconds,metadata\n"
    });
    for c in claims {
        let mut fields = Vec::with_capacity(9);
        if lease {
            fields.push(c.id.unwrap_or_default().to_string());
        }
        fields.extend([
            c.slots
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(" "),
            c.holder.clone(),
            rfc3339(c.created_at),
        ]);
        if lease {
            fields.push(c.expires_at.map(rfc3339).unwrap_or_default());
        }
        fields.extend([
            c.ended_at.map(rfc3339).unwrap_or_default(),
            outcome(c.kind, c.outcome).to_owned(),
            format!("{:.6}", c.held_for.as_secs_f64()),
            c.metadata
                .as_ref()
                .map(|m| m.to_string())
                .unwrap_or_default(),
        ]);
        let line: Vec<String> = fields.iter().map(|f| csv_field(f)).collect();
        out.push_str(&line.join(","));
        out.push('\n');
    }
    out
}

/// RFC 4180: quote a field holding a comma, quote or line break; double its quotes.
fn csv_field(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_owned()
    }
}

/// An outcome in the words of its semaphore's kind: an advisory permit is
/// `released`, `dropped` or `lost`.
fn outcome(kind: SemaphoreKind, outcome: Outcome) -> &'static str {
    match (kind, outcome) {
        (SemaphoreKind::Advisory, Outcome::Completed) => "released",
        (SemaphoreKind::Advisory, Outcome::TimedOut) => "lost",
        (_, Outcome::Completed) => "completed",
        (_, Outcome::Dropped) => "dropped",
        (_, Outcome::TimedOut) => "timed_out",
        _ => "live",
    }
}

/// Appends an aligned table (columns padded to their widest cell).
fn table(out: &mut String, indent: &str, headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::from(indent);
        for (i, (cell, width)) in cells.zip(&widths).enumerate() {
            if i + 1 == widths.len() {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<width$}  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
}

pub(crate) fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Millis, true)
}

pub(crate) fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn signed(delta: TimeDelta) -> Duration {
    delta.to_std().unwrap_or(Duration::ZERO)
}

/// A short human form: 250ms, 4.2s, 3m07s, 2h05m, 3d04h.
pub(crate) fn human(d: Duration) -> String {
    let secs = d.as_secs();
    if secs < 1 {
        format!("{}ms", d.as_millis())
    } else if secs < 60 {
        format!("{:.1}s", d.as_secs_f64())
    } else if secs < 3600 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else if secs < 86_400 {
        format!("{}h{:02}m", secs / 3600, secs % 3600 / 60)
    } else {
        format!("{}d{:02}h", secs / 86_400, secs % 86_400 / 3600)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_fields_are_quoted_when_needed() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }

    #[test]
    fn human_durations() {
        assert_eq!(human(Duration::from_millis(250)), "250ms");
        assert_eq!(human(Duration::from_millis(4200)), "4.2s");
        assert_eq!(human(Duration::from_secs(187)), "3m07s");
        assert_eq!(human(Duration::from_secs(2 * 3600 + 300)), "2h05m");
        assert_eq!(human(Duration::from_secs(3 * 86_400 + 4 * 3600)), "3d04h");
    }
}
