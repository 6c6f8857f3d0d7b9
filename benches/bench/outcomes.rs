//! Workload 18, what counting outcomes costs. Every refusal, timeout and
//! rate decision is counted by the client in memory and written every 5 s
//! (`pgsemaphore.record_outcomes`); there is no switch to turn it off, so
//! the baseline of the refusal loops is a build of the commit before the
//! counters, run apart with this same file (the loops use only what both
//! builds have):
//!
//! - 8 clients `try_acquire` a full semaphore (capacity 1, held): every
//!   call is a refusal, counted;
//! - 8 clients check an empty token bucket key: every decision is a
//!   refusal, counted.
//!
//! One client per server runs every repetition, so its writer writes
//! during them, as in a long-lived process. Then, where the schema has it,
//! the writer's statement timed on its own: 1, 100 and 1,000 names per
//! call (the same names every call, as a process's every 5 s); and one row
//! written 1,200 times within one minute (100 processes' writes in a
//! minute: each row's versions end with its minute), with and without a
//! session holding the xmin horizon.

use std::time::{Duration, Instant};

use pg_semaphore::{Error, RateLimiter, RatePolicy, Semaphore};
use serde_json::json;
use sqlx::{Connection, PgConnection};

use crate::load::{Outcome, pool, run_load};
use crate::report::{Cell, fmt_int, fmt_opt, fmt_rate_spread, markdown_table, percentile};
use crate::{Ctx, POOL_SPARE, Res, Workload};

pub const REFUSED_TRY_ACQUIRE: &str = "try_acquire of a full semaphore";
pub const REFUSED_CHECK: &str = "token bucket check of an empty key";

const CLIENTS: usize = 8;

/// Adds `$1` to `$2` names' refusals (`$3`: their names), as the writer does.
const RECORD: &str = "SELECT pgsemaphore.record_outcomes(p_kinds => array_fill('semaphore'::text, ARRAY[$1]), \
                      p_names => $2, p_admitted => array_fill(0::int8, ARRAY[$1]), \
                      p_refused => array_fill(1::int8, ARRAY[$1]), \
                      p_timed_out => array_fill(0::int8, ARRAY[$1]))";

pub async fn outcomes_workload(ctx: &mut Ctx) -> Res<()> {
    let servers = ctx.servers.clone();
    let s = ctx.settings.clone();
    let mut all = Vec::new();
    let mut statements: Vec<Vec<String>> = Vec::new();
    let mut timed: Vec<Cell> = Vec::new();
    for server in &servers {
        let pool = pool(&server.opts, CLIENTS as u32 + POOL_SPARE).await?;
        let client = pg_semaphore::Client::new(pool.clone());
        let sem = Semaphore::builder("bench-outcomes-full", 1)
            .build(&client)
            .await?;
        let held = sem.try_acquire().await?;
        let bucket =
            RateLimiter::builder("bench-outcomes-empty", RatePolicy::token_bucket(0.001, 1))
                .build(&client)?;
        let _ = bucket.check("k", 1).await?;
        let config = json!({ "server": server.label, "clients": CLIENTS });
        let mut reps: [Vec<Cell>; 2] = Default::default();
        for _ in 0..s.reps {
            let sem = sem.clone();
            let load = run_load(CLIENTS, s.warmup, s.cell, move |_, _| {
                let sem = sem.clone();
                async move {
                    match sem.try_acquire().await {
                        Err(Error::NoSlotsAvailable { .. }) => Ok(Outcome::Done),
                        Ok(permit) => {
                            permit.release().await?;
                            Err("the full semaphore admitted".into())
                        }
                        Err(error) => Err(error.into()),
                    }
                }
            })
            .await?;
            let cell = Cell::from_load(
                Workload::Outcomes,
                REFUSED_TRY_ACQUIRE,
                config.clone(),
                load,
            );
            eprintln!("{}", cell.progress());
            reps[0].push(cell);
            let bucket = bucket.clone();
            let load = run_load(CLIENTS, s.warmup, s.cell, move |_, _| {
                let bucket = bucket.clone();
                async move {
                    let decision = bucket.check("k", 1).await?;
                    if decision.allowed {
                        return Err("the empty bucket admitted".into());
                    }
                    Ok(Outcome::Done)
                }
            })
            .await?;
            let cell = Cell::from_load(Workload::Outcomes, REFUSED_CHECK, config.clone(), load);
            eprintln!("{}", cell.progress());
            reps[1].push(cell);
        }
        held.release().await?;
        client.shutdown().await?;
        all.extend(reps.into_iter().map(|r| Cell::from_reps(r, &[])));

        let mut conn = PgConnection::connect_with(&server.opts).await?;
        let has_counters: bool = sqlx::query_scalar(
            "SELECT to_regprocedure('pgsemaphore.record_outcomes(text[],text[],int8[],int8[],int8[])') IS NOT NULL",
        )
        .fetch_one(&mut conn)
        .await?;
        if has_counters {
            for names in [1usize, 100, 1_000] {
                let list: Vec<String> =
                    (0..names).map(|i| format!("bench-record-{i:04}")).collect();
                let times = record(&mut conn, &list, 200).await?;
                let call = format!("{names} name(s) per call");
                statements.push(row(server.label, &call, "none", &times));
                timed.push(statement_cell(server.label, &call, "none", &times));
            }
            for held in [false, true] {
                let horizon = if held {
                    let mut holder = PgConnection::connect_with(&server.opts).await?;
                    sqlx::query("BEGIN").execute(&mut holder).await?;
                    sqlx::query("SELECT txid_current()")
                        .execute(&mut holder)
                        .await?;
                    Some(holder)
                } else {
                    None
                };
                // Within one minute, so the 1,200 versions are one row's.
                let second: f64 =
                    sqlx::query_scalar("SELECT extract(second FROM clock_timestamp())::float8")
                        .fetch_one(&mut conn)
                        .await?;
                if second > 50.0 {
                    tokio::time::sleep(Duration::from_secs_f64(60.5 - second)).await;
                }
                let name = vec![format!("bench-one-row-{held}")];
                let times = record(&mut conn, &name, 1_200).await?;
                let label = if held {
                    "an idle transaction with an xid"
                } else {
                    "none"
                };
                for (call, times) in [
                    ("one row, 1,200 calls in a minute (all)", &times[..]),
                    (
                        "one row, 1,200 calls in a minute (last 200)",
                        &times[1_000..],
                    ),
                ] {
                    statements.push(row(server.label, call, label, times));
                    timed.push(statement_cell(server.label, call, label, times));
                }
                if let Some(holder) = horizon {
                    holder.close().await?;
                }
            }
        } else {
            eprintln!("no pgsemaphore.record_outcomes in this schema: the statement is not timed");
        }
        conn.close().await?;
        pool.close().await;
    }
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.implementation.clone(),
                c.config["server"].as_str().unwrap_or("").to_owned(),
                c.config["clients"].to_string(),
                fmt_rate_spread(c),
                fmt_opt(c.p50()),
                fmt_opt(c.p99()),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 18. Outcome counters: refusal loops, and the writer's statement\n\n\
         Each of {CLIENTS} clients loops on a refusal, which the client counts in memory; its \
         writer adds the counts to `pgsemaphore.outcomes` every 5 s during the runs. There is no \
         baseline in the run: compare with this workload built at the commit before the counters. \
         refusals/s: median of {} runs of {} s (min–max).\n",
        s.reps,
        s.cell.as_secs_f64()
    ));
    ctx.report.print(&markdown_table(
        &[
            "loop",
            "server",
            "clients",
            "refusals/s (min–max)",
            "p50",
            "p99",
            "errors",
        ],
        &rows,
    ));
    if !statements.is_empty() {
        ctx.report.print(
            "`record_outcomes` on its own, one connection, one call after another (each a \
             transaction of its own):\n",
        );
        ctx.report.print(&markdown_table(
            &[
                "server",
                "call",
                "xmin horizon held by",
                "calls",
                "p50",
                "p99",
            ],
            &statements,
        ));
    }
    ctx.report.add_cells(all);
    ctx.report.add_cells(timed);
    Ok(())
}

/// The statement's times as a cell of the JSON report.
fn statement_cell(server: &str, call: &str, horizon: &str, times: &[Duration]) -> Cell {
    Cell::from_samples(
        Workload::Outcomes,
        "record_outcomes",
        json!({ "server": server, "call": call, "horizon_held_by": horizon }),
        times.to_vec(),
    )
}

/// `calls` calls adding a refusal to each of `names`; each call's time.
async fn record(conn: &mut PgConnection, names: &[String], calls: usize) -> Res<Vec<Duration>> {
    let mut times = Vec::with_capacity(calls);
    for _ in 0..calls {
        let started = Instant::now();
        sqlx::query(RECORD)
            .bind(names.len() as i32)
            .bind(names)
            .execute(&mut *conn)
            .await?;
        times.push(started.elapsed());
    }
    Ok(times)
}

fn row(server: &str, call: &str, horizon: &str, times: &[Duration]) -> Vec<String> {
    let mut sorted = times.to_vec();
    sorted.sort_unstable();
    vec![
        server.to_owned(),
        call.to_owned(),
        horizon.to_owned(),
        fmt_int(times.len() as u64),
        fmt_opt(percentile(&sorted, 50.0)),
        fmt_opt(percentile(&sorted, 99.0)),
    ]
}
