//! Prototypes of limiter storage for the MVCC-pressure workload (issue 24,
//! item 6), measured beside today's limiters on one hot key: plain SQL in
//! the bench's own schema (`bench_proto`), never `pgsemaphore`.
//!
//! - `gcra-row`: GCRA, one timestamp (the theoretical arrival time) per key,
//!   updated in place by one `UPDATE ... RETURNING` (no `SELECT ... FOR
//!   UPDATE` first): the token bucket's decisions with one statement;
//! - `gcra-ledger`: GCRA as an insert-only ledger: each admission inserts a
//!   row (key, seq, tat); a check reads the newest by a backward index scan,
//!   serialised per key by a transaction-level advisory lock instead of a
//!   row lock, so no row is ever updated and the hot path never meets a dead
//!   version (old rows would be deleted in batches by the reaper);
//! - `sliding-ledger`: the sliding window's state (window start, hits,
//!   previous hits) as the same kind of ledger.
//!
//! All three admit every check in the workload (the limits are far above
//! the load), so each check writes, as today's limiters' checks do.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::Res;
use crate::load::{Outcome, run_load, unique};
use crate::pressure::{CLIENTS, Op};

/// The prototypes' objects; idempotent.
const PROTO_SQL: &str = r#"
CREATE SCHEMA IF NOT EXISTS bench_proto;

CREATE TABLE IF NOT EXISTS bench_proto.counter (key text PRIMARY KEY, n bigint NOT NULL);

CREATE TABLE IF NOT EXISTS bench_proto.gcra (
    limiter text NOT NULL, key text NOT NULL, tat timestamptz NOT NULL,
    PRIMARY KEY (limiter, key)
) WITH (fillfactor = 80);

CREATE OR REPLACE FUNCTION bench_proto.gcra_row(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision, p_n double precision)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_inc interval := make_interval(secs => p_n / p_rate);
    v_tau interval := make_interval(secs => p_burst / p_rate);
    v_tat timestamptz;
BEGIN
    LOOP
        -- The clock is read before the row lock: a stale clock only refuses more.
        UPDATE bench_proto.gcra g SET tat = greatest(g.tat, v_now) + v_inc
         WHERE g.limiter = p_limiter AND g.key = p_key
           AND greatest(g.tat, v_now) + v_inc <= v_now + v_tau
        RETURNING g.tat INTO v_tat;
        IF FOUND THEN
            RETURN true;
        END IF;
        PERFORM 1 FROM bench_proto.gcra g WHERE g.limiter = p_limiter AND g.key = p_key;
        IF FOUND THEN
            RETURN false;
        END IF;
        INSERT INTO bench_proto.gcra VALUES (p_limiter, p_key, v_now + v_inc) ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN true;
        END IF;
    END LOOP;
END;
$$;

CREATE TABLE IF NOT EXISTS bench_proto.gcra_ledger (
    limiter text NOT NULL, key text NOT NULL, seq bigint NOT NULL, tat timestamptz NOT NULL,
    PRIMARY KEY (limiter, key, seq)
);

CREATE OR REPLACE FUNCTION bench_proto.gcra_ledger(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision, p_n double precision)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_seq bigint;
    v_tat timestamptz;
    v_now timestamptz;
    v_new timestamptz;
BEGIN
    -- The key's lock (no row version): held to the end of the transaction,
    -- released after the commit is visible.
    PERFORM pg_advisory_xact_lock(hashtextextended(p_limiter || '/' || p_key, 24));
    -- A new statement, a new snapshot: it sees the previous holder's row.
    SELECT l.seq, l.tat INTO v_seq, v_tat
      FROM bench_proto.gcra_ledger l
     WHERE l.limiter = p_limiter AND l.key = p_key
     ORDER BY l.seq DESC LIMIT 1;
    v_now := clock_timestamp();
    v_new := greatest(coalesce(v_tat, v_now), v_now) + make_interval(secs => p_n / p_rate);
    IF v_new > v_now + make_interval(secs => p_burst / p_rate) THEN
        RETURN false;
    END IF;
    INSERT INTO bench_proto.gcra_ledger VALUES (p_limiter, p_key, coalesce(v_seq, 0) + 1, v_new);
    RETURN true;
END;
$$;

CREATE TABLE IF NOT EXISTS bench_proto.sliding_ledger (
    limiter text NOT NULL, key text NOT NULL, seq bigint NOT NULL,
    stamp timestamptz NOT NULL, hits bigint NOT NULL, previous_hits bigint NOT NULL,
    PRIMARY KEY (limiter, key, seq)
);

CREATE OR REPLACE FUNCTION bench_proto.sliding_ledger(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_seq      bigint;
    v_start    timestamptz;
    v_hits     bigint;
    v_previous bigint;
    v_now      timestamptz;
    v_elapsed  double precision;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_limiter || '/' || p_key, 25));
    SELECT l.seq, l.stamp, l.hits, l.previous_hits INTO v_seq, v_start, v_hits, v_previous
      FROM bench_proto.sliding_ledger l
     WHERE l.limiter = p_limiter AND l.key = p_key
     ORDER BY l.seq DESC LIMIT 1;
    v_now := clock_timestamp();
    IF v_seq IS NULL THEN
        v_seq := 0; v_start := v_now; v_hits := 0; v_previous := 0;
    ELSIF v_now >= v_start + 2 * p_window THEN
        v_start := date_bin(p_window, v_now, v_start); v_hits := 0; v_previous := 0;
    ELSIF v_now >= v_start + p_window THEN
        v_start := v_start + p_window; v_previous := v_hits; v_hits := 0;
    END IF;
    v_elapsed := least(1, greatest(0, extract(epoch FROM v_now - v_start)::double precision
                                      / extract(epoch FROM p_window)::double precision));
    IF v_previous * (1 - v_elapsed) + v_hits + p_n > p_limit THEN
        RETURN false;
    END IF;
    INSERT INTO bench_proto.sliding_ledger VALUES (p_limiter, p_key, v_seq + 1, v_start, v_hits + p_n, v_previous);
    RETURN true;
END;
$$;
"#;

/// Installs the prototypes (once per database; idempotent).
pub async fn install(pool: &PgPool) -> Res<()> {
    sqlx::raw_sql(PROTO_SQL).execute(pool).await?;
    Ok(())
}

/// A bare single-row `UPDATE ... SET n = n + 1` on one hot key: the
/// baseline every limiter is held against.
pub async fn update_op(pool: &PgPool) -> Res<Op> {
    install(pool).await?;
    let key: Arc<str> = unique("hot").into();
    sqlx::query("INSERT INTO bench_proto.counter VALUES ($1, 0)")
        .bind(&*key)
        .execute(pool)
        .await?;
    let pool = pool.clone();
    Ok(Arc::new(move |_, _| {
        let (pool, key) = (pool.clone(), key.clone());
        Box::pin(async move {
            sqlx::query("UPDATE bench_proto.counter SET n = n + 1 WHERE key = $1")
                .bind(&*key)
                .execute(&pool)
                .await?;
            Ok(Outcome::Done)
        })
    }))
}

/// One prototype's check on one hot key, every check admitted.
pub async fn proto_op(pool: &PgPool, statement: &'static str) -> Res<Op> {
    install(pool).await?;
    let limiter: Arc<str> = unique("proto").into();
    let pool = pool.clone();
    Ok(Arc::new(move |_, _| {
        let (pool, limiter) = (pool.clone(), limiter.clone());
        Box::pin(async move {
            let allowed: bool = sqlx::query_scalar(statement)
                .bind(&*limiter)
                .fetch_one(&pool)
                .await?;
            Ok(if allowed {
                Outcome::Done
            } else {
                Outcome::Refused
            })
        })
    }))
}

/// `gcra-row`: a million per second, a burst of a million.
pub const GCRA_ROW: &str = "SELECT bench_proto.gcra_row($1, 'hot', 1e6, 1e6, 1)";
/// `gcra-ledger`: the same limits.
pub const GCRA_LEDGER: &str = "SELECT bench_proto.gcra_ledger($1, 'hot', 1e6, 1e6, 1)";
/// `sliding-ledger`: a billion per second.
pub const SLIDING_LEDGER: &str =
    "SELECT bench_proto.sliding_ledger($1, 'hot', 1000000000, interval '1 s', 1)";

/// `--interleave`: the designs measured in turns of `slice` each, rather
/// than one after the other, so that every design meets the same machine
/// (the bench shares it) and the same held horizon: rounds until `rounds`
/// are done or `minutes` have passed, whichever is first; the first slice of
/// each design after `warmup`. Returns each design's cycles/s per round.
pub async fn rounds(
    ops: &[(&'static str, Op)],
    slice: Duration,
    warmup: Duration,
    rounds: usize,
    minutes: f64,
    phase: &str,
) -> Res<Vec<Vec<f64>>> {
    let mut rates = vec![Vec::new(); ops.len()];
    let started = Instant::now();
    let mut round = 0;
    while round < rounds && started.elapsed().as_secs_f64() < minutes * 60.0 {
        for (i, (design, op)) in ops.iter().enumerate() {
            let op = op.clone();
            let warm = if round == 0 { warmup } else { Duration::ZERO };
            let load = run_load(CLIENTS, warm, slice, move |client, seq| op(client, seq)).await?;
            let rate = load.samples.len() as f64 / load.elapsed.as_secs_f64().max(1e-9);
            eprintln!(
                "  {phase} round {round} at {:.0} s: {design}: {rate:.0}/s{}",
                started.elapsed().as_secs_f64(),
                load.first_error
                    .map(|e| format!(" ({} errors: {e})", load.errors))
                    .unwrap_or_default()
            );
            rates[i].push(rate);
        }
        round += 1;
    }
    Ok(rates)
}

/// The median of `values` (0 for none).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}
