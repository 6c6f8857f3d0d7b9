//! Workload 13, several limits at once: `Semaphore::try_acquire_all` of two
//! semaphores (a global limit and a per-merchant one) + release, against a
//! single `try_acquire` + release of one semaphore, in the same run.

use pg_semaphore::{Error, Semaphore};
use serde_json::{Value, json};

use crate::load::{Outcome, pool, run_load};
use crate::report::{
    Cell, fmt_int, fmt_opt, fmt_rate_spread, fmt_ratio, markdown_table, throughput_ratios,
};
use crate::{Ctx, POOL_SPARE, Res, Server, Settings, Workload};

pub const MULTI_SINGLE: &str = "one semaphore (try_acquire)";
pub const MULTI_TWO: &str = "two semaphores (try_acquire_all)";

/// Capacity 32 everywhere (nobody is refused at 8 clients): the cost of
/// claiming and releasing two limits in one call against one.
pub async fn multi_workload(ctx: &mut Ctx) -> Res<()> {
    let mut all = Vec::new();
    let servers = ctx.servers.clone();
    let s = ctx.settings.clone();
    for clients in [1usize, 8] {
        for server in &servers {
            let config = json!({ "server": server.label, "clients": clients });
            let mut reps: [Vec<Cell>; 2] = Default::default();
            for _ in 0..s.reps {
                reps[0].push(cycle(server, &s, clients, false, config.clone()).await?);
                reps[1].push(cycle(server, &s, clients, true, config.clone()).await?);
            }
            let mut group: Vec<Cell> = reps.into_iter().map(|r| Cell::from_reps(r, &[])).collect();
            throughput_ratios(&mut group, "vs_single", 0);
            all.extend(group);
        }
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
                fmt_ratio(c.ratio("vs_single")),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 13. Several limits at once: try_acquire_all of two semaphores + release\n\n\
         Each client loops: claim a permit of a global semaphore and of one of 4 per-merchant \
         semaphores in one call (`pgsemaphore.claim_all`), then release both in one call; the \
         baseline claims and releases one semaphore. Capacity 32 each. cycles/s: median of {} \
         runs of {} s (min–max); the ratio divides by the single claim's median, same server, \
         same clients, same run.\n",
        s.reps,
        s.cell.as_secs_f64()
    ));
    ctx.report.print(&markdown_table(
        &[
            "implementation",
            "server",
            "clients",
            "cycles/s (min–max)",
            "p50 cycle",
            "p99 cycle",
            "÷ one semaphore",
            "errors",
        ],
        &rows,
    ));
    ctx.report.add_cells(all);
    Ok(())
}

async fn cycle(
    server: &Server,
    s: &Settings,
    clients: usize,
    two: bool,
    config: Value,
) -> Res<Cell> {
    let pool = pool(&server.opts, clients as u32 + POOL_SPARE).await?;
    let ours = pg_semaphore::Client::new(pool.clone());
    let global = Semaphore::builder(format!("bench-multi-global-c{clients}"), 32)
        .build(&ours)
        .await?;
    let mut merchants = Vec::new();
    for m in 0..4 {
        merchants.push(
            Semaphore::builder(format!("bench-multi-merchant-{m}-c{clients}"), 32)
                .build(&ours)
                .await?,
        );
    }
    let load = run_load(clients, s.warmup, s.cell, move |client, seq| {
        let (global, merchant) = (
            global.clone(),
            merchants[(client + seq as usize) % 4].clone(),
        );
        async move {
            let permit = if two {
                Semaphore::try_acquire_all(&[(&global, 1), (&merchant, 1)]).await
            } else {
                global.try_acquire().await
            };
            match permit {
                Ok(permit) => {
                    permit.release().await?;
                    Ok(Outcome::Done)
                }
                Err(Error::NoSlotsAvailable { .. }) => Ok(Outcome::Refused),
                Err(error) => Err(error.into()),
            }
        }
    })
    .await?;
    pool.close().await;
    let name = if two { MULTI_TWO } else { MULTI_SINGLE };
    let cell = Cell::from_load(Workload::Multi, name, config, load);
    eprintln!("{}", cell.progress());
    Ok(cell)
}
