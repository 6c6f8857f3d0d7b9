//! Semaphore families: a semaphore per key, with capacities from the
//! operator's rules. Each test names the promise it pins: rules and their
//! precedence, a rule change that reaches existing keys, one key however
//! many processes use it first, the hard limit while rules change under
//! load, idle keys reaped only when nothing references them, and a claim
//! that meets the removal of its key.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use pg_semaphore::{Error, SemaphoreFamily, admin::RuleKind};
use sqlx::PgPool;
use support::TestResult;

async fn family(pool: &PgPool, name: &str, capacity: u32) -> pg_semaphore::Result<SemaphoreFamily> {
    SemaphoreFamily::builder(name, capacity)
        .lease(Duration::from_secs(60))
        .idle_after(Duration::ZERO)
        .without_heartbeat()
        .build(&pg_semaphore::Client::new(pool.clone()))
        .await
}

async fn stored_capacity(pool: &PgPool, name: &str) -> sqlx::Result<Option<i32>> {
    sqlx::query_scalar("SELECT capacity FROM pgsemaphore.semaphores WHERE name = $1")
        .bind(name)
        .fetch_optional(pool)
        .await
}

/// An exact-key rule wins over the rule of the key's tier, which wins over
/// the family's default; a key in a tier without a rule gets the default.
#[tokio::test]
async fn a_key_rule_beats_its_tier_rule_which_beats_the_default() -> TestResult {
    let db = support::migrated_db().await;
    let tenants = family(&db.pool, "tenants", 10).await?;
    pg_semaphore::admin::set_family_rule(&db.pool, "tenants", RuleKind::Tier, "premium", Some(50))
        .await?;
    pg_semaphore::admin::set_family_tier(&db.pool, "tenants", "t-42", Some("premium")).await?;
    pg_semaphore::admin::set_family_tier(&db.pool, "tenants", "t-7", Some("premium")).await?;
    pg_semaphore::admin::set_family_tier(&db.pool, "tenants", "t-9", Some("no-such-rule")).await?;
    pg_semaphore::admin::set_family_rule(&db.pool, "tenants", RuleKind::Key, "t-7", Some(200))
        .await?;

    assert_eq!(tenants.key("t-1").await?.capacity(), 10, "the default");
    assert_eq!(tenants.key("t-42").await?.capacity(), 50, "the tier's rule");
    assert_eq!(
        tenants.key("t-7").await?.capacity(),
        200,
        "the key's rule, over its tier's"
    );
    assert_eq!(
        tenants.key("t-9").await?.capacity(),
        10,
        "a tier without a rule"
    );
    assert_eq!(tenants.key("t-1").await?.name(), "@tenants/t-1");

    // The application's builder never changes an existing family.
    let greedy = family(&db.pool, "tenants", 1000).await?;
    assert_eq!(greedy.capacity(), 10);
    assert_eq!(greedy.key("t-new").await?.capacity(), 10);
    Ok(())
}

/// A rule changed at run time reaches the keys that exist already, in the
/// operator's transaction: a lowered capacity admits nothing above it
/// (holders above it keep their slots), a raised one admits at once.
#[tokio::test]
async fn a_rule_change_applies_to_existing_keys() -> TestResult {
    let db = support::migrated_db().await;
    let tenants = family(&db.pool, "tenants", 3).await?;
    let a = tenants.try_acquire("t-1").await?;
    let b = tenants.try_acquire("t-1").await?;
    let changed =
        pg_semaphore::admin::set_family_rule(&db.pool, "tenants", RuleKind::Key, "t-1", Some(1))
            .await?;
    assert_eq!(changed, 1);
    assert_eq!(stored_capacity(&db.pool, "@tenants/t-1").await?, Some(1));
    assert!(matches!(
        tenants.try_acquire("t-1").await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    a.release().await?;
    assert!(
        matches!(
            tenants.try_acquire("t-1").await,
            Err(Error::NoSlotsAvailable { .. })
        ),
        "one holder left at capacity 1"
    );
    b.release().await?;
    let c = tenants.try_acquire("t-1").await?;

    // Removing the rule brings the default back; the default itself changes too.
    pg_semaphore::admin::set_family_rule(&db.pool, "tenants", RuleKind::Key, "t-1", None).await?;
    assert_eq!(stored_capacity(&db.pool, "@tenants/t-1").await?, Some(3));
    pg_semaphore::admin::configure_family(&db.pool, "tenants", Some(5), None, None).await?;
    assert_eq!(stored_capacity(&db.pool, "@tenants/t-1").await?, Some(5));
    let more: Vec<_> = futures_join(&tenants, "t-1", 4).await?;
    assert!(matches!(
        tenants.try_acquire("t-1").await,
        Err(Error::NoSlotsAvailable { .. })
    ));
    for p in more {
        p.release().await?;
    }
    c.release().await?;

    // A tier change moves the key too.
    pg_semaphore::admin::set_family_rule(&db.pool, "tenants", RuleKind::Tier, "gold", Some(7))
        .await?;
    assert_eq!(
        pg_semaphore::admin::set_family_tier(&db.pool, "tenants", "t-1", Some("gold")).await?,
        1
    );
    assert_eq!(stored_capacity(&db.pool, "@tenants/t-1").await?, Some(7));
    assert!(matches!(
        pg_semaphore::admin::set_family_rule(&db.pool, "nobody", RuleKind::Key, "k", Some(1)).await,
        Err(Error::FamilyNotFound { .. })
    ));
    Ok(())
}

async fn futures_join(
    family: &SemaphoreFamily,
    key: &str,
    n: usize,
) -> pg_semaphore::Result<Vec<pg_semaphore::Permit>> {
    let mut permits = Vec::new();
    for _ in 0..n {
        permits.push(family.try_acquire(key).await?);
    }
    Ok(permits)
}

/// Two processes using a key for the first time at once create one
/// semaphore, with the capacity of the rules, and share it.
#[tokio::test]
async fn a_key_used_first_by_two_processes_at_once_is_one_semaphore() -> TestResult {
    let db = support::migrated_db().await;
    let first = family(&db.pool, "jobs", 2).await?;
    let other_pool = support::another_pool(&db, 4).await;
    let second = family(&other_pool, "jobs", 2).await?;
    pg_semaphore::admin::set_family_rule(&db.pool, "jobs", RuleKind::Key, "k-0", Some(1)).await?;
    for round in 0..20 {
        let key = format!("k-{round}");
        let (a, b) = tokio::join!(first.try_acquire(&key), second.try_acquire(&key));
        let rows: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.semaphores WHERE family_key = $1")
                .bind(&key)
                .fetch_one(&db.pool)
                .await?;
        assert_eq!(rows, 1, "{key}");
        if round == 0 {
            // Capacity 1: exactly one of the two was admitted.
            assert!(a.is_ok() != b.is_ok(), "{key}: {a:?} {b:?}");
        } else {
            assert!(a.is_ok() && b.is_ok(), "{key}: {a:?} {b:?}");
        }
        for permit in [a, b].into_iter().flatten() {
            permit.release().await?;
        }
    }
    Ok(())
}

/// When did an operator's change run (database clock before the call and
/// after its commit), and which capacity did it give the key.
struct Change {
    key: &'static str,
    before: DateTime<Utc>,
    after: DateTime<Utc>,
    capacity: u32,
}

async fn now(pool: &PgPool) -> sqlx::Result<DateTime<Utc>> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
}

/// The hard limit, under concurrency: three pools claim on four keys of a
/// family while an operator keeps changing a key rule, a tier rule and the
/// default. Every claim, at the instant the database admitted it, had at
/// most the capacity in force then live on its key (itself included),
/// checked over the audit log's own timestamps; for a claim admitted while
/// a change was in flight, the larger of the two capacities.
#[tokio::test]
async fn no_key_goes_over_its_capacity_while_rules_change_under_load() -> TestResult {
    let db = support::migrated_db().await;
    let keys = ["k0", "k1", "k2", "k3"];
    // k0: a key rule 1 <-> 4; k1, k2: tier gold 2 <-> 5; k3: the default 3 <-> 2.
    let setup = family(&db.pool, "load", 3).await?;
    pg_semaphore::admin::set_family_rule(&db.pool, "load", RuleKind::Key, "k0", Some(1)).await?;
    pg_semaphore::admin::set_family_rule(&db.pool, "load", RuleKind::Tier, "gold", Some(2)).await?;
    pg_semaphore::admin::set_family_tier(&db.pool, "load", "k1", Some("gold")).await?;
    pg_semaphore::admin::set_family_tier(&db.pool, "load", "k2", Some("gold")).await?;
    for key in keys {
        setup.key(key).await?;
    }
    let initial: HashMap<&str, u32> = [("k0", 1), ("k1", 2), ("k2", 2), ("k3", 3)].into();

    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for p in 0..3 {
        let pool = support::another_pool(&db, 4).await;
        let fam = family(&pool, "load", 3).await?;
        for w in 0..4 {
            let fam = fam.clone();
            let stop = Arc::clone(&stop);
            workers.push(tokio::spawn(async move {
                let mut admitted = 0u32;
                let mut i = p * 7 + w;
                while !stop.load(Ordering::Relaxed) {
                    let key = keys[i % keys.len()];
                    i += 1;
                    match fam.try_acquire(key).await {
                        Ok(permit) => {
                            admitted += 1;
                            tokio::time::sleep(Duration::from_millis(3 + (i % 5) as u64)).await;
                            permit.release().await?;
                        }
                        Err(Error::NoSlotsAvailable { .. }) => {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok::<u32, Error>(admitted)
            }));
        }
    }

    let mut changes = Vec::new();
    for round in 0..24u32 {
        let high = round % 2 == 0;
        let (key, capacity): (&'static str, u32) = match round % 3 {
            0 => ("k0", if high { 4 } else { 1 }),
            1 => ("k1", if high { 5 } else { 2 }),
            _ => ("k3", if high { 2 } else { 3 }),
        };
        let before = now(&db.pool).await?;
        match key {
            "k0" => {
                pg_semaphore::admin::set_family_rule(
                    &db.pool,
                    "load",
                    RuleKind::Key,
                    "k0",
                    Some(capacity),
                )
                .await?;
            }
            "k1" => {
                pg_semaphore::admin::set_family_rule(
                    &db.pool,
                    "load",
                    RuleKind::Tier,
                    "gold",
                    Some(capacity),
                )
                .await?;
            }
            _ => {
                pg_semaphore::admin::configure_family(&db.pool, "load", Some(capacity), None, None)
                    .await?;
            }
        }
        let after = now(&db.pool).await?;
        let affected: &[&'static str] = match key {
            "k1" => &["k1", "k2"],
            other => {
                if other == "k0" {
                    &["k0"]
                } else {
                    &["k3"]
                }
            }
        };
        for &k in affected {
            changes.push(Change {
                key: k,
                before,
                after,
                capacity,
            });
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut admitted = 0;
    for worker in workers {
        admitted += worker.await??;
    }
    assert!(
        admitted > 100,
        "only {admitted} claims: the test proves little"
    );

    let rows = support::chaos::slot_rows(&db.pool).await?;
    let mut checked = 0;
    for key in keys {
        let name = format!("@load/{key}");
        let mine: Vec<_> = rows.iter().filter(|r| r.semaphore == name).collect();
        for claim in &mine {
            let at = claim.created_at;
            // The capacity in force at `at`: the last change committed before
            // it; while a change was in flight, the larger of the two.
            let mut capacity = initial[key];
            let mut allowed = capacity;
            for change in changes.iter().filter(|c| c.key == key) {
                if change.after < at {
                    capacity = change.capacity;
                    allowed = capacity;
                } else if change.before <= at {
                    allowed = capacity.max(change.capacity);
                    break;
                } else {
                    break;
                }
            }
            let live = mine
                .iter()
                .filter(|o| o.created_at <= at && support::chaos::us(at) < o.end())
                .count();
            assert!(
                live <= allowed as usize,
                "{name}: claim #{} admitted with {live} live at capacity {allowed}",
                claim.id
            );
            checked += 1;
        }
    }
    assert_eq!(checked, rows.len());
    Ok(())
}

/// The reaper removes a key only when nothing references it: not while a
/// claim is live, not while its history is in the audit log (the log is
/// never lost), not before the family's idle time; and never a named
/// semaphore.
#[tokio::test]
async fn idle_keys_are_reaped_once_nothing_references_them() -> TestResult {
    let db = support::migrated_db().await;
    let quick = family(&db.pool, "quick", 2).await?;
    let slow = SemaphoreFamily::builder("slow", 2)
        .idle_after(Duration::from_secs(3600))
        .without_heartbeat()
        .build(&db.client)
        .await?;
    pg_semaphore::Semaphore::builder("named", 1)
        .build(&db.client)
        .await?;
    quick.key("never-claimed").await?;
    slow.key("recent").await?;
    let permit = quick.try_acquire("held").await?;
    quick.try_acquire("done").await?.release().await?;

    pg_semaphore::admin::reap(&db.pool).await?;
    let names = |pool: PgPool| async move {
        sqlx::query_scalar::<_, String>("SELECT name FROM pgsemaphore.semaphores ORDER BY name")
            .fetch_all(&pool)
            .await
    };
    assert_eq!(
        names(db.pool.clone()).await?,
        ["@quick/done", "@quick/held", "@slow/recent", "named"],
        "an unclaimed key past idle_after goes; history, a live claim and idle_after keep keys"
    );

    pg_semaphore::admin::prune_claims(&db.pool, Duration::ZERO).await?;
    pg_semaphore::admin::reap(&db.pool).await?;
    assert_eq!(
        names(db.pool.clone()).await?,
        ["@quick/held", "@slow/recent", "named"],
        "its history pruned, the released key goes"
    );
    permit.release().await?;
    pg_semaphore::admin::prune_claims(&db.pool, Duration::ZERO).await?;
    pg_semaphore::admin::reap(&db.pool).await?;
    assert_eq!(names(db.pool.clone()).await?, ["@slow/recent", "named"]);

    // The next use creates the key again, with the rules in force now.
    pg_semaphore::admin::set_family_rule(&db.pool, "quick", RuleKind::Key, "held", Some(1)).await?;
    assert_eq!(quick.key("held").await?.capacity(), 2, "the cached handle");
    let again = quick.try_acquire("held").await?;
    assert_eq!(stored_capacity(&db.pool, "@quick/held").await?, Some(1));
    again.release().await?;
    Ok(())
}

/// Interleaving: the reaper deletes a key (uncommitted) while a claim on
/// the key, from a process whose cached handle says it exists, arrives. The
/// claim waits for the key's row, finds it gone ("semaphore does not
/// exist") having claimed nothing, and the family opens the key again and
/// claims: the caller sees one successful acquire.
#[tokio::test]
async fn a_claim_that_meets_the_removal_of_its_key_opens_it_again() -> TestResult {
    let db = support::migrated_db().await;
    let tenants = family(&db.pool, "tenants", 2).await?;
    let handle = tenants.key("t-1").await?;

    let mut reaper = db.pool.begin().await?;
    let removed: i64 = sqlx::query_scalar("SELECT pgsemaphore.reap_family_keys(10)")
        .fetch_one(&mut *reaper)
        .await?;
    assert_eq!(removed, 1);
    let claim = tokio::spawn({
        let tenants = tenants.clone();
        async move { tenants.try_acquire("t-1").await }
    });
    // The claim is blocked on the deleted row (its step 2).
    let blocked = support::eventually(Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND query LIKE '%pgsemaphore.claim%')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap_or(false)
    })
    .await;
    assert!(blocked, "the claim should wait for the reaper's lock");
    reaper.commit().await?;

    let permit = claim.await??;
    assert_eq!(permit.slot(), 0);
    assert_eq!(stored_capacity(&db.pool, "@tenants/t-1").await?, Some(2));
    permit.release().await?;
    // A handle kept from before claims on the key's new row (same name).
    handle.try_acquire().await?.release().await?;
    Ok(())
}

/// The reaper's work per call is bounded: each call examines the next keys
/// of each family from where the last one stopped, so all idle keys go in
/// turn, however many keys there are.
#[tokio::test]
async fn each_reap_examines_a_bounded_batch_of_keys_in_turn() -> TestResult {
    let db = support::migrated_db().await;
    let quick = family(&db.pool, "quick", 2).await?;
    for key in ["a", "b", "c", "d", "e"] {
        quick.key(key).await?;
    }
    let mut removed = Vec::new();
    for _ in 0..4 {
        let n: i64 = sqlx::query_scalar("SELECT pgsemaphore.reap_family_keys(2)")
            .fetch_one(&db.pool)
            .await?;
        removed.push(n);
    }
    assert_eq!(removed, [2, 2, 1, 0]);
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pgsemaphore.semaphores WHERE family = 'quick'")
            .fetch_one(&db.pool)
            .await?;
    assert_eq!(left, 0);
    Ok(())
}

/// A family created in a transaction left open (its row not committed)
/// delays another process's opening of that family by at most the
/// functions' bound (2 s of `lock_timeout`), which answers
/// [`Error::Stalled`] having created nothing; after the rollback it opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_family_left_uncreated_in_an_open_transaction_delays_others_by_at_most_the_bound()
-> TestResult {
    let db = support::migrated_db().await;
    let mut squatter = db.pool.acquire().await?;
    sqlx::query("BEGIN").execute(&mut *squatter).await?;
    sqlx::query("SELECT * FROM pgsemaphore.open_family('pending', 2, '10 s', '0')")
        .execute(&mut *squatter)
        .await?;
    let started = std::time::Instant::now();
    let opened = tokio::time::timeout(
        Duration::from_secs(10),
        SemaphoreFamily::builder("pending", 3).build(&db.client),
    )
    .await
    .expect("opening waited without bound");
    let waited = started.elapsed();
    assert!(matches!(opened, Err(Error::Stalled { .. })), "{opened:?}");
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
    sqlx::query("ROLLBACK").execute(&mut *squatter).await?;
    let family = SemaphoreFamily::builder("pending", 3)
        .build(&db.client)
        .await?;
    assert_eq!(family.capacity(), 3);
    Ok(())
}
