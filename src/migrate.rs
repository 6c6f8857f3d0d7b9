//! Migrations: the SQL files of `migrations/`, embedded, applied with
//! sqlx's migrator and recorded in pg-semaphore's own history table
//! ([`MIGRATIONS_TABLE`]), apart from the application's.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::Result;

/// The PostgreSQL schema that holds every pg-semaphore object.
///
/// (PostgreSQL reserves the `pg_` prefix for schemas, hence no underscore.)
pub const SCHEMA: &str = "pgsemaphore";

/// The table that records which pg-semaphore migrations were applied.
///
/// It lives in [`SCHEMA`], apart from the application's own `_sqlx_migrations`,
/// so the two histories never clash. `migrations/sqlx.toml` sets the same name
/// for `sqlx migrate run`.
pub const MIGRATIONS_TABLE: &str = "pgsemaphore._sqlx_migrations";

/// The SQL files of `migrations/`, embedded at compile time.
static EMBEDDED: Migrator = sqlx::migrate!("./migrations");

/// A [`Migrator`] for pg-semaphore's schema, configured to keep its history in
/// [`MIGRATIONS_TABLE`].
///
/// Use it to run the migrations on a connection or transaction of your own;
/// [`migrate`] is the shortcut for a pool.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = pool.acquire().await?;
/// pg_semaphore::migrator().run(&mut *conn).await?;
/// for m in pg_semaphore::migrator().iter() {
///     println!("{} {}", m.version, m.description);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
pub fn migrator() -> Migrator {
    let mut migrator = Migrator::with_migrations(EMBEDDED.iter().cloned().collect());
    migrator.create_schema(SCHEMA);
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
}

/// Creates or upgrades pg-semaphore's schema in the pool's database.
///
/// Idempotent and safe to call from many processes at start-up at once (sqlx
/// serialises migrators with an advisory lock). The history is kept in
/// [`MIGRATIONS_TABLE`], so it does not interfere with the application's own
/// sqlx migrations in the same database.
///
/// The same SQL files can be applied with sqlx-cli instead:
///
/// ```text
/// sqlx migrate run --source <pg-semaphore>/migrations --config <pg-semaphore>/migrations/sqlx.toml
/// ```
///
/// # Example
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
/// pg_semaphore::migrate(&pool).await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::Migrate`](crate::Error::Migrate) when a migration fails or the
/// recorded history does not match these files (for example a database
/// migrated by a newer version of this crate).
///
/// # Cancel safety
///
/// Each migration runs in its own transaction: cancelling leaves the schema at
/// a migration boundary, and the next call carries on.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    migrator().run(pool).await?;
    Ok(())
}
