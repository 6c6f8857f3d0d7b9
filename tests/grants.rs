//! Grants in one step: `grant_access` gives a role exactly the documented
//! part of the schema, only the schema's owner can run it, `regrant` keeps
//! recorded roles current, and a missing grant is an error that says which
//! part is missing and how to grant it.

mod support;

use std::time::Duration;

use pg_semaphore::admin::{self, Access};
use pg_semaphore::{Client, Error, Semaphore};
use sqlx::{AssertSqlSafe, PgPool};
use support::TestResult;
use support::roles::Roles;

/// For every routine and table of the schema, and the schema itself: the
/// privileges `role` has, as one line each.
async fn privileges(pool: &PgPool, role: &str) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT 'routine ' || p.oid::regprocedure::text || ' ' || has_function_privilege($1, p.oid, 'EXECUTE')
           FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
          WHERE n.nspname = 'pgsemaphore'
         UNION ALL
         SELECT 'table ' || c.relname || ' ' || has_table_privilege($1, c.oid, 'SELECT')
                || has_table_privilege($1, c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE')
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = 'pgsemaphore' AND c.relkind IN ('r', 'v', 'p')
         UNION ALL
         SELECT 'schema ' || has_schema_privilege($1, 'pgsemaphore', 'USAGE')
                || has_schema_privilege($1, 'pgsemaphore', 'CREATE')
         ORDER BY 1",
    )
    .bind(role)
    .fetch_all(pool)
    .await
}

#[tokio::test]
async fn the_rust_call_gives_each_part_what_the_documented_sql_gives() -> TestResult {
    let db = support::migrated_db().await;
    // app/op: the documented SQL (whose result tests/security.rs pins
    // routine by routine); app2/op2: admin::grant_access.
    let roles = Roles::documented(&db, &["app2", "op2"]).await?;
    let routines = admin::grant_access(&db.pool, &roles.name("app2"), Access::Application).await?;
    assert!(routines > 30, "{routines}");
    admin::grant_access(&db.pool, &roles.name("op2"), Access::Operator).await?;
    // Idempotent.
    admin::grant_access(&db.pool, &roles.name("op2"), Access::Operator).await?;
    for (documented, granted) in [("app", "app2"), ("op", "op2")] {
        assert_eq!(
            privileges(&db.pool, &roles.name(documented)).await?,
            privileges(&db.pool, &roles.name(granted)).await?,
            "{granted} differs from {documented}"
        );
    }
    let mut recorded: Vec<(String, String)> =
        sqlx::query_as("SELECT g.role::regrole::text, g.part FROM pgsemaphore.grantees g")
            .fetch_all(&db.pool)
            .await?;
    recorded.sort();
    let mut expected = vec![
        (roles.name("app"), "application".to_owned()),
        (roles.name("app2"), "application".to_owned()),
        (roles.name("op"), "operator".to_owned()),
        (roles.name("op2"), "operator".to_owned()),
    ];
    expected.sort();
    assert_eq!(recorded, expected);
    roles.drop_all().await?;
    Ok(())
}

#[tokio::test]
async fn only_the_schema_owner_can_grant_access_and_bad_arguments_grant_nothing() -> TestResult {
    let db = support::migrated_db().await;
    let roles = Roles::documented(&db, &["nobody"]).await?;
    let app = roles.pool(&db, "app").await?;
    let nobody = roles.name("nobody");
    let before = privileges(&db.pool, &nobody).await?;

    // PUBLIC may not run it; nor may the application or the operator.
    for suffix in ["app", "op"] {
        let pool = roles.pool(&db, suffix).await?;
        let error = admin::grant_access(&pool, &nobody, Access::Operator)
            .await
            .expect_err("not the owner");
        assert!(
            matches!(&error, Error::PermissionDenied { .. } | Error::Database(_)),
            "{error:?}"
        );
        pool.close().await;
    }
    // Even a role given EXECUTE on it grants nothing: it is not the owner.
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"GRANT EXECUTE ON FUNCTION pgsemaphore.grant_access(regrole, text) TO "{}""#,
        roles.name("app")
    )))
    .execute(&db.pool)
    .await?;
    let error = sqlx::query("SELECT pgsemaphore.grant_access($1::regrole, 'operator')")
        .bind(&nobody)
        .execute(&app)
        .await
        .expect_err("not the owner");
    let database = error.as_database_error().expect("a database error");
    assert_eq!(database.code().as_deref(), Some("42501"));
    assert!(
        database.message().starts_with("only the owner"),
        "{}",
        database.message()
    );
    assert_eq!(privileges(&db.pool, &nobody).await?, before);

    // Bad arguments.
    for (role, part) in [
        (Some(nobody.as_str()), None),
        (Some(nobody.as_str()), Some("root")),
        (None, Some("operator")),
    ] {
        let error = sqlx::query("SELECT pgsemaphore.grant_access($1::regrole, $2)")
            .bind(role)
            .bind(part)
            .execute(&db.pool)
            .await
            .expect_err("refused");
        let code = error
            .as_database_error()
            .and_then(|e| e.code())
            .map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("22023"), "{role:?} {part:?}: {error}");
    }
    let owner: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&db.pool)
        .await?;
    assert!(matches!(
        admin::grant_access(&db.pool, &owner, Access::Application).await,
        Err(Error::InvalidArgument {
            argument: "role",
            ..
        })
    ));
    assert!(matches!(
        admin::grant_access(&db.pool, "no such role", Access::Application).await,
        Err(Error::InvalidArgument {
            argument: "role",
            ..
        })
    ));
    assert_eq!(privileges(&db.pool, &nobody).await?, before);
    app.close().await;
    roles.drop_all().await?;
    Ok(())
}

/// A migration after the baseline ends with `regrant()`: what it adds
/// reaches the recorded roles with nothing re-run by hand. Here a revoked
/// grant stands in for a routine the migration added.
#[tokio::test]
async fn regrant_gives_recorded_roles_their_part_again_and_forgets_dropped_roles() -> TestResult {
    let db = support::migrated_db().await;
    let roles = Roles::create(&db, &["app", "gone"]).await?;
    let app = roles.name("app");
    admin::grant_access(&db.pool, &app, Access::Application).await?;
    admin::grant_access(&db.pool, &roles.name("gone"), Access::Operator).await?;
    let granted = privileges(&db.pool, &app).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"REVOKE EXECUTE ON FUNCTION pgsemaphore.renew(bigint[], bytea, interval) FROM "{app}""#
    )))
    .execute(&db.pool)
    .await?;
    assert_ne!(privileges(&db.pool, &app).await?, granted);
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"DROP OWNED BY "{0}"; DROP ROLE "{0}""#,
        roles.name("gone")
    )))
    .execute(&db.pool)
    .await?;

    let regranted: i32 = sqlx::query_scalar("SELECT pgsemaphore.regrant()")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(regranted, 1, "the dropped role is forgotten");
    assert_eq!(privileges(&db.pool, &app).await?, granted);
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"DROP OWNED BY "{app}"; DROP ROLE "{app}""#
    )))
    .execute(&db.pool)
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_missing_grant_names_the_part_and_the_command_that_gives_it() -> TestResult {
    let db = support::migrated_db().await;
    let roles = Roles::documented(&db, &["nobody"]).await?;
    let app = roles.pool(&db, "app").await?;
    let nobody = roles.pool(&db, "nobody").await?;

    // An operator's function called with the application's role.
    let error = admin::set_capacity(&app, "anything", 3)
        .await
        .expect_err("an operator's function");
    match &error {
        Error::PermissionDenied { access, denied } => {
            assert_eq!(*access, Access::Operator);
            assert!(denied.contains("configure"), "{denied}");
        }
        other => panic!("expected PermissionDenied, got {other:?}"),
    }
    let message = error.to_string();
    assert!(message.contains("operator's function"), "{message}");
    assert!(
        message.contains("pg-semaphore grant --operator"),
        "{message}"
    );

    // The application's part, missing altogether.
    let error = Semaphore::builder("ungranted", 1)
        .lease(Duration::from_secs(30))
        .build(&Client::new(nobody.clone()))
        .await
        .expect_err("no grants");
    match &error {
        Error::PermissionDenied { access, .. } => assert_eq!(*access, Access::Application),
        other => panic!("expected PermissionDenied, got {other:?}"),
    }
    assert!(
        error
            .to_string()
            .contains("pg-semaphore grant --application"),
        "{error}"
    );

    app.close().await;
    nobody.close().await;
    roles.drop_all().await?;
    Ok(())
}
