//! schema/pgsemaphore.sql, the one file to read the schema in, is exactly
//! what the migrations build: applied to an empty database it gives the
//! same catalog (tables with their privileges, columns, indexes,
//! constraints, functions with their bodies, SECURITY DEFINER and
//! search_path, their privileges, triggers, and the comments on all of
//! them).

mod support;

use sqlx::AssertSqlSafe;
use support::TestResult;

#[tokio::test]
async fn the_checked_in_schema_is_what_the_migrations_build() -> TestResult {
    let migrated = support::migrated_db().await;
    let from_file = support::empty_db().await;
    let dump = include_str!("../schema/pgsemaphore.sql");
    sqlx::raw_sql(AssertSqlSafe(dump))
        .execute(&from_file.pool)
        .await
        .map_err(|e| format!("schema/pgsemaphore.sql does not apply: {e}"))?;
    // A mismatch means a migration changed without the dump: regenerate it
    // with `bash schema/dump.sh`.
    support::catalog::assert_same(&migrated.pool, &from_file.pool).await;
    Ok(())
}
