//! Workload 9, a waiter behind an expired lease: a holder claims with a short lease
//! and no heartbeat, then vanishes without releasing (its permit is
//! forgotten, as a killed process forgets it); a waiter is already waiting.
//! No reaper runs. Measured: from the lease's end (`expires_at`, on the
//! database's clock) to the waiter's `acquire()` returning (this machine's
//! clock; the server runs on the same machine).

use std::time::Duration;

use chrono::Utc;
use pg_semaphore::Semaphore;
use serde_json::json;

use crate::load::{pool, unique};
use crate::report::{Cell, Target, fmt_dur, fmt_int, fmt_opt, markdown_table};
use crate::wakeup::WAKE_SETTLE;
use crate::{Ctx, Res, Server, Settings, Workload};

/// The target: served within this long of the lease's end.
const WITHIN: Duration = Duration::from_millis(50);

pub async fn lease_workload(ctx: &mut Ctx) -> Res<()> {
    let s = ctx.settings.clone();
    let mut all = Vec::new();
    for server in &ctx.servers.clone() {
        let cell = lease_cell(server, &s).await?;
        let p50 = cell.p50();
        ctx.report.targets.push(Target::at_most(
            Workload::Lease,
            format!(
                "{}: a waiter behind an expired lease (no reaper) served ≤ {} after the lease's \
                 end (median of {})",
                server.label,
                fmt_dur(WITHIN),
                cell.samples.len() + cell.errors as usize
            ),
            p50.map(|d| d.as_secs_f64() * 1e3),
            WITHIN.as_secs_f64() * 1e3,
            format!(
                "p50 {}, max {}",
                fmt_opt(p50),
                fmt_opt(cell.samples.last().copied())
            ),
        ));
        all.push(cell);
    }
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                c.config["server"].as_str().unwrap_or("").to_owned(),
                fmt_dur(s.lease),
                fmt_int(c.ops),
                fmt_opt(c.samples.first().copied()),
                fmt_opt(c.p50()),
                fmt_opt(c.samples.last().copied()),
                fmt_int(c.errors),
            ]
        })
        .collect();
    ctx.report.print(&format!(
        "## 9. A waiter behind an expired lease, without a reaper\n\n\
         A holder claims a capacity-1 semaphore with a {} lease and no heartbeat, and is \
         forgotten without releasing; {} ms later a waiter (another pool) calls acquire(). No \
         reaper runs. Latency = when acquire() returns − the permit's expires_at; each a \
         separate semaphore, {} times per server. errors: a waiter served before the lease \
         ended (a broken guarantee), or not within its patience.\n",
        fmt_dur(s.lease),
        WAKE_SETTLE.as_millis(),
        s.lease_reps
    ));
    ctx.report.print(&markdown_table(
        &["server", "lease", "served", "min", "p50", "max", "errors"],
        &rows,
    ));
    ctx.report.add_cells(all);
    Ok(())
}

async fn lease_cell(server: &Server, s: &Settings) -> Res<Cell> {
    let holder_pool = pool(&server.opts, 2).await?;
    let waiter_pool = pool(&server.opts, 2).await?;
    let patience = s.lease + Duration::from_secs(30);
    let mut samples = Vec::with_capacity(s.lease_reps);
    let mut errors = 0u64;
    for _ in 0..s.lease_reps {
        let name = unique("bench-lease");
        let holder = Semaphore::builder(name.clone(), 1)
            .lease(s.lease)
            .without_heartbeat()
            .build(&pg_semaphore::Client::new(holder_pool.clone()))
            .await?;
        let waiter = Semaphore::builder(name, 1)
            .lease(s.lease)
            .without_heartbeat()
            .build(&pg_semaphore::Client::new(waiter_pool.clone()))
            .await?;
        let permit = holder.try_acquire().await?;
        let expires_at = permit.expires_at();
        // The holder vanishes: no release, no heartbeat, nothing on drop.
        std::mem::forget(permit);
        let task = tokio::spawn(async move {
            let permit = waiter.acquiring().timeout(patience).acquire().await?;
            let served_at = Utc::now();
            permit.release().await?;
            Ok::<_, pg_semaphore::Error>(served_at)
        });
        tokio::time::sleep(WAKE_SETTLE).await;
        match task.await? {
            Ok(served_at) => match (served_at - expires_at).to_std() {
                Ok(late) => samples.push(late),
                Err(_) => {
                    errors += 1;
                    eprintln!(
                        "  lease: a waiter was served {} before the holder's lease ended",
                        served_at - expires_at
                    );
                }
            },
            Err(error) => {
                errors += 1;
                eprintln!("  lease: the waiter failed: {error}");
            }
        }
    }
    holder_pool.close().await;
    waiter_pool.close().await;
    let config = json!({
        "server": server.label,
        "lease_ms": s.lease.as_millis() as u64,
        "reps": s.lease_reps,
    });
    let mut cell = Cell::from_samples(Workload::Lease, "ours", config, samples);
    cell.errors = errors;
    eprintln!("{}", cell.progress());
    Ok(cell)
}
