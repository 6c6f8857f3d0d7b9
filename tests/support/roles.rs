//! Login roles for least-privilege tests: an application role, an
//! operator role, a role with no grants at all, as a test names them.

use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};
use testkit::TestDb;

/// The password of every test role.
pub const PASSWORD: &str = "least-privilege-pw";

/// Login roles without superuser or DDL rights, dropped (with what they
/// own) by [`Roles::drop_all`].
pub struct Roles {
    admin: PgConnection,
    names: Vec<String>,
}

impl Roles {
    pub async fn create(db: &TestDb, suffixes: &[&str]) -> Result<Roles, sqlx::Error> {
        let mut admin = PgConnection::connect_with(&db.options).await?;
        let mut names = Vec::new();
        for suffix in suffixes {
            let role = format!("{}_{suffix}", db.name);
            admin
                .execute(AssertSqlSafe(format!(
                    r#"CREATE ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '{PASSWORD}'"#
                )))
                .await?;
            names.push(role);
        }
        Ok(Roles { admin, names })
    }

    /// Roles `app` and `op` with the README's grants (the application's and
    /// the operator's), and `others` with none.
    pub async fn documented(db: &TestDb, others: &[&str]) -> Result<Roles, sqlx::Error> {
        let suffixes: Vec<&str> = ["app", "op"].iter().chain(others).copied().collect();
        let mut roles = Roles::create(db, &suffixes).await?;
        let grants = super::documented_grants(&roles.name("app"), &roles.name("op"));
        roles.admin.execute(AssertSqlSafe(grants)).await?;
        Ok(roles)
    }

    pub fn name(&self, suffix: &str) -> String {
        self.names
            .iter()
            .find(|n| n.ends_with(&format!("_{suffix}")))
            .expect("a role of that suffix")
            .clone()
    }

    pub async fn pool(&self, db: &TestDb, suffix: &str) -> sqlx::Result<PgPool> {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(
                db.options
                    .clone()
                    .username(&self.name(suffix))
                    .password(PASSWORD),
            )
            .await
    }

    pub async fn drop_all(mut self) -> sqlx::Result<()> {
        for role in &self.names {
            self.admin
                .execute(AssertSqlSafe(format!(
                    r#"DROP OWNED BY "{role}"; DROP ROLE "{role}""#
                )))
                .await?;
        }
        Ok(())
    }
}
