//! What one failover (or several, summed) showed: the counts the checker
//! made, which the tests assert on and print.

use std::collections::BTreeMap;

use crate::Scenario;

/// What one failover (or several, summed) showed.
#[derive(Debug)]
pub struct Report {
    pub scenario: Scenario,
    pub runs: u32,
    /// Claims workers (and the driver) were given.
    pub acknowledged: usize,
    /// Of those, given before the primary was stopped.
    pub acknowledged_before: usize,
    /// Of those, created after the replication link was partitioned.
    pub acknowledged_partitioned: usize,
    /// Acknowledged claims not on the new primary (no row with their id, or
    /// the id was handed out again to another claim).
    pub missing: usize,
    /// Of the missing, ids the new primary handed out again.
    pub ids_reused: usize,
    /// Releases acknowledged `ok` whose claim is not completed on the new primary.
    pub releases_acknowledged: usize,
    pub releases_lost: usize,
    /// Claims whose row on the new primary ended before their holder
    /// stopped (a lost renewal), and of those, claims whose holder was never
    /// told the permit was lost.
    pub ended_early: usize,
    pub ended_early_untold: usize,
    /// Over-admissions on the workers' clocks: episodes with more holders
    /// than capacity, and with a slot held twice; their total lengths; and
    /// what each was.
    pub over_capacity: usize,
    pub over_capacity_us: i64,
    pub slots_twice: usize,
    pub slots_twice_us: i64,
    pub episodes: Vec<String>,
    /// Sentinels renewed on the new primary, and reported lost.
    pub sentinels_renewed: usize,
    pub sentinels_lost: usize,
    pub sentinels_missing: usize,
    /// The driver's claim made while the standby was cut off (partition
    /// runs): acknowledged, and of those missing on the new primary; or not
    /// acknowledged.
    pub cut_off_acknowledged: usize,
    pub cut_off_missing: usize,
    pub cut_off_refused: usize,
    /// Claims served after the switch; acquires begun before it and served after.
    pub served_after: usize,
    pub waited_through: usize,
    pub errors: usize,
    /// The kinds of those errors (their first words), with counts.
    pub error_kinds: BTreeMap<String, usize>,
    /// ms from stopping the primary: promoted, router switched, mutex reported lost.
    pub promote_ms: i64,
    pub switch_ms: i64,
    pub mutex_lost_ms: i64,
}

impl Default for Report {
    fn default() -> Report {
        Report {
            scenario: Scenario::Crash,
            runs: 0,
            acknowledged: 0,
            acknowledged_before: 0,
            acknowledged_partitioned: 0,
            missing: 0,
            ids_reused: 0,
            releases_acknowledged: 0,
            releases_lost: 0,
            ended_early: 0,
            ended_early_untold: 0,
            over_capacity: 0,
            over_capacity_us: 0,
            slots_twice: 0,
            slots_twice_us: 0,
            episodes: Vec::new(),
            sentinels_renewed: 0,
            sentinels_lost: 0,
            sentinels_missing: 0,
            cut_off_acknowledged: 0,
            cut_off_missing: 0,
            cut_off_refused: 0,
            served_after: 0,
            waited_through: 0,
            errors: 0,
            error_kinds: BTreeMap::new(),
            promote_ms: 0,
            switch_ms: 0,
            mutex_lost_ms: 0,
        }
    }
}

impl Report {
    /// Adds `other`'s counts (and keeps the larger of the timings).
    pub fn add(&mut self, other: &Report) {
        self.runs += other.runs;
        self.acknowledged += other.acknowledged;
        self.acknowledged_before += other.acknowledged_before;
        self.acknowledged_partitioned += other.acknowledged_partitioned;
        self.missing += other.missing;
        self.ids_reused += other.ids_reused;
        self.releases_acknowledged += other.releases_acknowledged;
        self.releases_lost += other.releases_lost;
        self.ended_early += other.ended_early;
        self.ended_early_untold += other.ended_early_untold;
        self.over_capacity += other.over_capacity;
        self.over_capacity_us += other.over_capacity_us;
        self.slots_twice += other.slots_twice;
        self.slots_twice_us += other.slots_twice_us;
        self.episodes.extend(other.episodes.iter().cloned());
        self.sentinels_renewed += other.sentinels_renewed;
        self.sentinels_lost += other.sentinels_lost;
        self.sentinels_missing += other.sentinels_missing;
        self.cut_off_acknowledged += other.cut_off_acknowledged;
        self.cut_off_missing += other.cut_off_missing;
        self.cut_off_refused += other.cut_off_refused;
        self.served_after += other.served_after;
        self.waited_through += other.waited_through;
        self.errors += other.errors;
        for (kind, n) in &other.error_kinds {
            *self.error_kinds.entry(kind.clone()).or_default() += n;
        }
        self.promote_ms = self.promote_ms.max(other.promote_ms);
        self.switch_ms = self.switch_ms.max(other.switch_ms);
        self.mutex_lost_ms = self.mutex_lost_ms.max(other.mutex_lost_ms);
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let max = if self.runs > 1 { " (max)" } else { "" };
        writeln!(
            f,
            "{} acknowledged claims ({} before the primary stopped, {} after the standby was cut \
             off); {} missing on the new primary ({} ids handed out again); {} acknowledged \
             releases, {} lost; {} leases ended on the new primary while their holders worked \
             ({} holders never told)",
            self.acknowledged,
            self.acknowledged_before,
            self.acknowledged_partitioned,
            self.missing,
            self.ids_reused,
            self.releases_acknowledged,
            self.releases_lost,
            self.ended_early,
            self.ended_early_untold,
        )?;
        writeln!(
            f,
            "    over-admissions: {} over capacity ({} ms in all), {} slots held twice ({} ms); \
             sentinels: {} renewed on the new primary, {} reported lost, {} missing; claims made \
             while the standby was cut off: {} acknowledged ({} missing), {} never acknowledged",
            self.over_capacity,
            self.over_capacity_us / 1000,
            self.slots_twice,
            self.slots_twice_us / 1000,
            self.sentinels_renewed,
            self.sentinels_lost,
            self.sentinels_missing,
            self.cut_off_acknowledged,
            self.cut_off_missing,
            self.cut_off_refused,
        )?;
        write!(
            f,
            "    {} claims served after the switch ({} by acquires begun before it); {} database \
             errors seen by workers {:?}; promoted {} ms and switched {} ms after the stop{max}, \
             session mutex reported lost after {} ms{max}",
            self.served_after,
            self.waited_through,
            self.errors,
            self.error_kinds,
            self.promote_ms,
            self.switch_ms,
            self.mutex_lost_ms,
        )?;
        for episode in &self.episodes {
            write!(f, "\n    over-admission: {episode}")?;
        }
        Ok(())
    }
}
