//! The xmin horizon: `pg_semaphore::admin::horizon` names the session that holds
//! back VACUUM on this database, and only this database's (a session of
//! another database does not hold its tables' horizon). The reaper's warning
//! is tested in tests/tracing.rs, its metrics in tests/metrics.rs, the
//! `doctor` command in cli/tests/cli.rs. Last, the lease semaphore in a
//! database of its own, as the guide suggests (docs/guide/guarantees.md) to keep it out of the
//! application's horizon.

mod support;

use std::time::Duration;

use pg_semaphore::{Error, Semaphore, admin::HorizonHolderKind, schema::SchemaError};
use support::TestResult;

/// `n` transactions that each take an xid, so the horizon's age grows.
async fn burn_xids(pool: &sqlx::PgPool, n: usize) -> Result<(), sqlx::Error> {
    for _ in 0..n {
        sqlx::query("SELECT pg_current_xact_id()")
            .execute(pool)
            .await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_quiet_database_has_no_holder() -> TestResult {
    let db = support::migrated_db().await;
    assert_eq!(pg_semaphore::admin::horizon(&db.pool).await?, None);
    Ok(())
}

#[tokio::test]
async fn an_idle_transaction_is_named_with_its_state_start_and_age() -> TestResult {
    let db = support::migrated_db().await;
    let (mut idle, pid) = support::idle_in_transaction(&db.options, "nightly-export").await?;
    burn_xids(&db.pool, 5).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;

    let holder = pg_semaphore::admin::horizon(&db.pool)
        .await?
        .expect("the idle transaction holds the horizon");
    assert_eq!(holder.kind, HorizonHolderKind::Session);
    assert_eq!(holder.pid, Some(pid));
    assert_eq!(holder.application_name.as_deref(), Some("nightly-export"));
    assert_eq!(holder.state.as_deref(), Some("idle in transaction"));
    assert!(holder.since.is_some());
    let held_for = holder.held_for.expect("visible to the superuser");
    assert!(held_for >= Duration::from_millis(200), "{holder:?}");
    assert!(holder.age_xids >= 5, "{holder:?}");

    // Its end ends the hold.
    sqlx::raw_sql("COMMIT").execute(&mut idle).await?;
    assert_eq!(pg_semaphore::admin::horizon(&db.pool).await?, None);
    Ok(())
}

#[tokio::test]
async fn a_session_of_another_database_does_not_hold_this_ones_horizon() -> TestResult {
    let db = support::migrated_db().await;
    let other = support::empty_db().await;
    let (idle, _) = support::idle_in_transaction(&other.options, "other-database").await?;
    burn_xids(&db.pool, 3).await?;
    assert_eq!(pg_semaphore::admin::horizon(&db.pool).await?, None);
    // ... while it holds the other database's.
    let holder = pg_semaphore::admin::horizon(&other.pool)
        .await?
        .expect("held there");
    assert_eq!(holder.application_name.as_deref(), Some("other-database"));
    drop(idle);
    Ok(())
}

/// The guide's "Avoid it" (docs/guide/guarantees.md): the lease semaphore in a database of its own.
/// The application's held snapshot does not hold the semaphore database's
/// horizon; a fence on a transaction of another database fails instead of
/// fencing nothing; on its own database's transaction it holds.
#[tokio::test]
async fn a_semaphore_in_a_database_of_its_own_is_out_of_the_applications_horizon() -> TestResult {
    let own = support::migrated_db().await;
    let app = support::empty_db().await;
    let app_with_schema = support::migrated_db().await;
    let sem = Semaphore::builder("own-database", 1)
        .build(&pg_semaphore::Client::new(own.pool.clone()))
        .await?;
    let permit = sem.try_acquire().await?;

    let (report, _) = support::idle_in_transaction(&app.options, "app-report").await?;
    burn_xids(&own.pool, 3).await?;
    assert_eq!(pg_semaphore::admin::horizon(&own.pool).await?, None);
    assert!(pg_semaphore::admin::horizon(&app.pool).await?.is_some());

    let mut tx = app.pool.begin().await?;
    let error = permit.fence(&mut tx).await.expect_err("no schema there");
    assert!(
        matches!(error, Error::Schema(SchemaError::Missing { .. })),
        "{error:?}"
    );
    tx.rollback().await?;
    let mut tx = app_with_schema.pool.begin().await?;
    let error = permit.fence(&mut tx).await.expect_err("not its claim");
    assert!(matches!(error, Error::PermitLost { .. }), "{error:?}");
    tx.rollback().await?;

    let mut tx = own.pool.begin().await?;
    permit.fence(&mut tx).await?;
    tx.commit().await?;
    permit.release().await?;
    drop(report);
    Ok(())
}
