//! Rendering the library's data for a terminal or a script: aligned tables,
//! JSON and CSV, the short human forms of times and durations, and (in
//! `report`) the HTML report.

pub(crate) mod report;

use std::fmt::Write as _;
use std::ops::Range;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use pg_semaphore::{
    RatePolicy,
    admin::{
        FamilyInfo, FamilyKeyInfo, HorizonHolder, HorizonHolderKind, RateLimitSetting, RuleKind,
        SemaphoreInfo,
    },
    audit::{ClaimRecord, Holder, Outcome, SemaphoreKind, Summary},
};
use serde::Serialize;

/// `pg-semaphore status`: one row per lease semaphore, then each one's
/// holders; then one row per advisory semaphore, then each one's holders.
pub(crate) fn status_table(all: &[SemaphoreInfo]) -> String {
    let (list, advisory): (Vec<&SemaphoreInfo>, Vec<&SemaphoreInfo>) =
        all.iter().partition(|s| s.kind == SemaphoreKind::Lease);
    let (list, advisory) = (&list[..], &advisory[..]);
    if list.is_empty() && advisory.is_empty() {
        return "no semaphores yet\n".to_owned();
    }
    let mut out = String::new();
    if !list.is_empty() {
        lease_table(&mut out, list);
    }
    if !advisory.is_empty() {
        if !out.is_empty() {
            out.push('\n');
        }
        advisory_table(&mut out, advisory);
    }
    out
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
fn lease_table(out: &mut String, list: &[&SemaphoreInfo]) {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|sem| {
            let held = sem.held();
            vec![
                sem.name.clone(),
                sem.capacity.to_string(),
                held.to_string(),
                sem.capacity.saturating_sub(held).to_string(),
                sem.default_lease.map_or_else(|| "-".to_owned(), human),
            ]
        })
        .collect();
    table(
        out,
        "",
        &["SEMAPHORE", "CAPACITY", "HELD", "FREE", "LEASE"],
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

fn advisory_table(out: &mut String, list: &[&SemaphoreInfo]) {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|sem| {
            let held = sem.held();
            vec![
                sem.name.clone(),
                sem.capacity.to_string(),
                held.to_string(),
                sem.capacity.saturating_sub(held).to_string(),
            ]
        })
        .collect();
    table(
        out,
        "",
        &["ADVISORY SEMAPHORE", "CAPACITY", "HELD", "FREE"],
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

/// `pg-semaphore status --json`: one array of both kinds, by name, each
/// as the library serializes it (with its `kind`).
pub(crate) fn status_json(list: &[SemaphoreInfo]) -> String {
    json(&list)
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
) -> String {
    if summary.kind == SemaphoreKind::Advisory {
        return advisory_audit_table(name, window, claims, summary);
    }
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
) -> String {
    #[derive(Serialize)]
    struct Audit<'a> {
        semaphore: &'a str,
        kind: SemaphoreKind,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        claims: &'a [ClaimRecord],
        summary: &'a Summary,
    }
    json(&Audit {
        semaphore: name,
        kind: summary.kind,
        since: window.start,
        until: window.end,
        claims,
        summary,
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
