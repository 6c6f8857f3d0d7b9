//! Creating, upgrading and adopting pg-semaphore's schema.
//!
//! Three ways put the schema in a database, all from the same files of
//! `migrations/`: [`migrate`] (or sqlx-cli with `migrations/sqlx.toml`),
//! history in [`MIGRATIONS_TABLE`]; the application's own sqlx history, into
//! which it copied our files; refinery (feature `refinery`), history in
//! `pgsemaphore.refinery_schema_history`. Whichever was used, the schema
//! says which version it is: `pgsemaphore.schema_version()` returns
//! `(o_version, o_compatible_from)`. [`migrate`] reads that first, without
//! writing anything, and only runs migrations when the schema is missing or
//! older and this role may upgrade it; otherwise it succeeds (up to date, or
//! newer and compatible) or says what to do, still without writing.
//!
//! **The baseline and the rule for every new migration file**: the first
//! seven files (in sqlx's order) are the 0.1 baseline, one per concept; only
//! the last of them defines `pgsemaphore.schema_version()`, which returns
//! version 1, so a baseline stopped between its files (each commits on its
//! own) reports no version and is completed by the next run of the tool
//! that started it. A released file is never edited
//! (`tests/fixtures/migrations-0.1/` keeps the baseline as released, and
//! `tests/migrations.rs` checks that `migrations/` still holds it). A schema
//! change after a release is a new file: the `k`-th file after the baseline
//! brings the schema to version `k + 1`, so it redefines
//! `pgsemaphore.schema_version()` to return `k + 1` and the oldest version
//! whose code can still use the schema (`k + 1` if older code would break,
//! else the previous `o_compatible_from`), and [`SCHEMA_VERSION`] becomes
//! `k + 1` (`tests/migrations.rs` checks both). A file that adds a routine
//! an application or an operator calls also redefines
//! `pgsemaphore.grant_access` with it and ends with
//! `SELECT pgsemaphore.regrant()`, so that the roles given access keep
//! their part with nothing re-run by hand.

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::{PgConnection, PgPool};

use crate::error::{Error, MigrationHistory, Result, SchemaError};

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

/// The schema version this version of the crate builds and uses: what
/// `pgsemaphore.schema_version()` returns once every file of `migrations/`
/// is applied (version 1 is the baseline's files, each later file one more).
pub const SCHEMA_VERSION: i32 = 1;

/// How many files of `migrations/` make the baseline, schema version 1.
const BASELINE_FILES: usize = 7;

/// The SQL files of `migrations/`, embedded at compile time.
static EMBEDDED: Migrator = sqlx::migrate!("./migrations");

/// A [`Migrator`] for pg-semaphore's schema, configured to keep its history in
/// [`MIGRATIONS_TABLE`].
///
/// Use it to run the migrations on a connection or transaction of your own.
/// It is sqlx's migrator as is (which, when it fails, returns without
/// releasing its advisory lock: run it on a connection you close
/// afterwards, not a pooled one): unlike [`migrate`], it does not look at the
/// schema's version first, so it needs the owner's privileges even when
/// there is nothing to do, fails on a schema applied through the
/// application's own history (`relation ... already exists`), and on one
/// migrated by a newer version of the crate reports the newer migration as
/// missing unless you call `set_ignore_missing(true)` on it.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = pool.acquire().await?;
/// pg_semaphore::schema::migrator().run(&mut *conn).await?;
/// for m in pg_semaphore::schema::migrator().iter() {
///     println!("{} {}", m.version, m.description);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
pub fn migrator() -> Migrator {
    let mut migrator = bare_migrator();
    migrator.create_schema(SCHEMA);
    migrator
}

/// The migrator without `CREATE SCHEMA IF NOT EXISTS`, which needs `CREATE`
/// on the database even when the schema exists.
fn bare_migrator() -> Migrator {
    let mut migrator = Migrator::with_migrations(EMBEDDED.iter().cloned().collect());
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
}

/// Creates or upgrades pg-semaphore's schema in the pool's database, or
/// checks that it can be used as it is.
///
/// Call it at start-up from every process. It first reads the schema's
/// version (`pgsemaphore.schema_version()`), writing nothing, and then:
///
/// - **up to date** (however it was applied: by this function, sqlx-cli,
///   the application's own migration history or refinery): returns `Ok`
///   at once. Needs only the application's grants ([the guide's "Privileges"](crate::guide::operations#privileges)),
///   no DDL privilege;
/// - **missing or older**, applied by this function or sqlx-cli (history in
///   [`MIGRATIONS_TABLE`]): applies the missing migrations, holding sqlx's
///   migration lock, if this role may (it owns the schema's objects, or may
///   create the schema); else [`SchemaError::NotPermitted`], naming the
///   role that must run it;
/// - **older, applied elsewhere** (the application's own history, refinery):
///   [`SchemaError::Outdated`], saying which migrations to apply where;
/// - **newer** (migrated by a later version of this crate): `Ok` if that
///   schema declares itself compatible with this version
///   (`o_compatible_from <= SCHEMA_VERSION`), else [`SchemaError::TooNew`].
///
/// Safe to call from many processes at once: migrations are applied under
/// sqlx's advisory lock (the one `sqlx migrate run` takes), and the schema is
/// examined again once it is held.
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
/// Each with a message that says what to do; none writes anything:
/// [`SchemaError::NotPermitted`], [`SchemaError::Outdated`],
/// [`SchemaError::TooNew`], [`SchemaError::Unrecognized`] (a `pgsemaphore`
/// schema that pg-semaphore did not create).
/// [`SchemaError::Migrate`] when a migration fails or an applied one was modified;
/// [`Error::Database`] when the database cannot be reached.
///
/// # Cancel safety
///
/// Each migration runs in its own transaction: cancelling leaves the schema at
/// a migration boundary, and the next call carries on. The connection that
/// held the migration lock is closed rather than returned to the pool.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    let mut conn = pool.acquire().await?;
    if let Plan::UpToDate = inspect(&mut conn).await?.plan(Tool::Sqlx)? {
        return Ok(());
    }
    // A session-level advisory lock must never go back to the pool, even if
    // this future is dropped half-way.
    conn.close_on_drop();
    use sqlx::migrate::Migrate as _;
    conn.lock().await?;
    let result: Result<()> = async {
        // Another process may have migrated while this one waited.
        match inspect(&mut conn).await?.plan(Tool::Sqlx)? {
            Plan::UpToDate => Ok(()),
            Plan::Run { create_schema } => {
                let mut migrator = if create_schema {
                    migrator()
                } else {
                    bare_migrator()
                };
                migrator.set_locking(false); // held already
                // `run(&mut *conn)` would make this future's `Send` depend on
                // a higher-ranked `Acquire` bound that callers spawning it
                // cannot satisfy; `run_direct` is sqlx's way around that.
                migrator.run_direct(None, &mut *conn, false).await?;
                Ok(())
            }
        }
    }
    .await;
    let unlocked = conn.unlock().await;
    result?;
    unlocked?;
    Ok(())
}

/// Which tool is asking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tool {
    /// [`migrate`]: history in [`MIGRATIONS_TABLE`].
    Sqlx,
    /// `refinery_migrate`: history in `pgsemaphore.refinery_schema_history`.
    #[cfg_attr(not(feature = "refinery"), allow(dead_code))]
    Refinery,
}

/// What to do about the schema.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Nothing: it can be used as it is.
    UpToDate,
    /// Apply migrations (creating the schema first if `create_schema`).
    Run { create_schema: bool },
}

/// A history table: absent, present but not readable by this role, or its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum History<T> {
    Absent,
    Unreadable,
    Rows(Vec<T>),
}

impl<T> History<T> {
    /// Whether migrations were recorded in it (an unreadable one counts as
    /// used: only someone else's history is unreadable).
    fn used(&self) -> bool {
        match self {
            History::Absent => false,
            History::Unreadable => true,
            History::Rows(rows) => !rows.is_empty(),
        }
    }

    fn rows(&self) -> &[T] {
        match self {
            History::Rows(rows) => rows,
            _ => &[],
        }
    }
}

/// A row of [`MIGRATIONS_TABLE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SqlxApplied {
    pub(crate) version: i64,
    pub(crate) success: bool,
    pub(crate) checksum: Vec<u8>,
}

/// A row of `pgsemaphore.refinery_schema_history`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RefineryApplied {
    pub(crate) version: i64,
    pub(crate) name: String,
}

/// What the database says about pg-semaphore's schema, read without writing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Facts {
    /// `current_user`.
    pub(crate) role: String,
    /// The owner of schema `pgsemaphore`, if it exists.
    pub(crate) schema_owner: Option<String>,
    /// `CREATE` on the database: may create the schema.
    pub(crate) can_create_schema: bool,
    /// `CREATE` on schema `pgsemaphore`.
    pub(crate) can_create_in_schema: bool,
    /// Relations and functions in the schema other than the history tables.
    pub(crate) objects: i64,
    /// The owner of `pgsemaphore.schema_version()`: the role that ran the
    /// migrations and owns their objects.
    pub(crate) objects_owner: Option<String>,
    /// Whether this role is (or may act as) [`objects_owner`](Self::objects_owner).
    pub(crate) may_own: bool,
    /// `pgsemaphore.schema_version()`, if it exists.
    pub(crate) version: Option<(i32, i32)>,
    pub(crate) sqlx: History<SqlxApplied>,
    pub(crate) refinery: History<RefineryApplied>,
}

/// One row of facts from the catalogs (readable by every role; nothing here
/// looks a name up through the schema, which would need `USAGE` on it).
pub(crate) const FACTS_SQL: &str = "\
SELECT current_user::text AS role,
       pg_get_userbyid(n.nspowner)::text AS schema_owner,
       has_database_privilege(current_database(), 'CREATE') AS can_create_schema,
       coalesce(has_schema_privilege(n.oid, 'CREATE'), false) AS can_create_in_schema,
       coalesce((SELECT count(*) FROM pg_class c
                  WHERE c.relnamespace = n.oid AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
                    AND c.relname NOT IN ('_sqlx_migrations', 'refinery_schema_history'))
              + (SELECT count(*) FROM pg_proc p WHERE p.pronamespace = n.oid), 0)::int8 AS objects,
       pg_get_userbyid(v.proowner)::text AS objects_owner,
       coalesce(pg_has_role(v.proowner, 'USAGE'), false) AS may_own,
       v.oid IS NOT NULL AS has_version,
       s.oid IS NOT NULL AS has_sqlx,
       coalesce(has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(s.oid, 'SELECT'), false)
           AS sqlx_readable,
       r.oid IS NOT NULL AS has_refinery,
       coalesce(has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(r.oid, 'SELECT'), false)
           AS refinery_readable
  FROM (SELECT 1) AS one
  LEFT JOIN pg_namespace n ON n.nspname = 'pgsemaphore'
  LEFT JOIN pg_proc v ON v.pronamespace = n.oid AND v.proname = 'schema_version' AND v.pronargs = 0
  LEFT JOIN pg_class s ON s.relnamespace = n.oid AND s.relname = '_sqlx_migrations'
  LEFT JOIN pg_class r ON r.relnamespace = n.oid AND r.relname = 'refinery_schema_history'";

/// The row of [`FACTS_SQL`]: the catalogs' answers as [`Facts`] keeps them,
/// and whether each history exists and can be read.
#[derive(sqlx::FromRow)]
pub(crate) struct FactsRow {
    role: String,
    schema_owner: Option<String>,
    can_create_schema: bool,
    can_create_in_schema: bool,
    objects: i64,
    objects_owner: Option<String>,
    may_own: bool,
    has_version: bool,
    has_sqlx: bool,
    sqlx_readable: bool,
    has_refinery: bool,
    refinery_readable: bool,
}

#[cfg(feature = "refinery")]
impl FactsRow {
    /// The row as tokio-postgres reads it, by column name.
    pub(crate) fn from_tokio(row: &tokio_postgres::Row) -> FactsRow {
        FactsRow {
            role: row.get("role"),
            schema_owner: row.get("schema_owner"),
            can_create_schema: row.get("can_create_schema"),
            can_create_in_schema: row.get("can_create_in_schema"),
            objects: row.get("objects"),
            objects_owner: row.get("objects_owner"),
            may_own: row.get("may_own"),
            has_version: row.get("has_version"),
            has_sqlx: row.get("has_sqlx"),
            sqlx_readable: row.get("sqlx_readable"),
            has_refinery: row.get("has_refinery"),
            refinery_readable: row.get("refinery_readable"),
        }
    }
}

pub(crate) const VERSION_SQL: &str =
    "SELECT o_version, o_compatible_from FROM pgsemaphore.schema_version()";
pub(crate) const SQLX_HISTORY_SQL: &str =
    "SELECT version, success, checksum FROM pgsemaphore._sqlx_migrations ORDER BY version";
pub(crate) const REFINERY_HISTORY_SQL: &str =
    "SELECT version::int8, name::text FROM pgsemaphore.refinery_schema_history ORDER BY version";

/// Which of the follow-up queries [`FACTS_SQL`] says can run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reads {
    pub(crate) version: bool,
    pub(crate) sqlx: bool,
    pub(crate) refinery: bool,
}

impl Facts {
    /// The facts of [`FACTS_SQL`]'s row, before the follow-up queries.
    pub(crate) fn from_row(row: FactsRow) -> (Facts, Reads) {
        fn history<T>(present: bool, readable: bool) -> (History<T>, bool) {
            match (present, readable) {
                (false, _) => (History::Absent, false),
                (true, false) => (History::Unreadable, false),
                (true, true) => (History::Rows(Vec::new()), true),
            }
        }
        let (sqlx, read_sqlx) = history(row.has_sqlx, row.sqlx_readable);
        let (refinery, read_refinery) = history(row.has_refinery, row.refinery_readable);
        (
            Facts {
                role: row.role,
                schema_owner: row.schema_owner,
                can_create_schema: row.can_create_schema,
                can_create_in_schema: row.can_create_in_schema,
                objects: row.objects,
                objects_owner: row.objects_owner,
                may_own: row.may_own,
                version: None,
                sqlx,
                refinery,
            },
            Reads {
                version: row.has_version,
                sqlx: read_sqlx,
                refinery: read_refinery,
            },
        )
    }

    /// What to do, for `tool`, or why nothing can be done.
    pub(crate) fn plan(&self, tool: Tool) -> Result<Plan> {
        let Some(schema_owner) = &self.schema_owner else {
            return if self.can_create_schema {
                Ok(Plan::Run {
                    create_schema: true,
                })
            } else {
                Err(Error::Schema(SchemaError::NotPermitted {
                    role: self.role.clone(),
                    owner: None,
                    found: None,
                    required: SCHEMA_VERSION,
                }))
            };
        };

        let Some((found, compatible_from)) = self.version else {
            // The baseline's files commit one by one and only its last one
            // defines schema_version(): objects without a version, with
            // part of the baseline in this tool's own history, are a
            // baseline stopped half-way, which this run completes.
            let partial = match tool {
                Tool::Sqlx => !self.sqlx.rows().is_empty(),
                Tool::Refinery => !self.refinery.rows().is_empty(),
            };
            if self.objects > 0 && !partial {
                return Err(Error::Schema(SchemaError::Unrecognized {
                    objects: self.objects,
                }));
            }
            if partial && tool == Tool::Sqlx {
                verify_sqlx_history(self.sqlx.rows())?;
            }
            // An empty schema (made for the owner by an administrator, or
            // left behind), or a baseline stopped half-way: a fresh start.
            // The baseline's first file runs `CREATE SCHEMA IF NOT EXISTS`,
            // which needs CREATE on the database even when the schema
            // exists; its later files need CREATE in the schema.
            return if self.can_create_schema && self.can_create_in_schema {
                Ok(Plan::Run {
                    create_schema: false,
                })
            } else {
                Err(Error::Schema(SchemaError::NotPermitted {
                    role: self.role.clone(),
                    owner: Some(schema_owner.clone()),
                    found: None,
                    required: SCHEMA_VERSION,
                }))
            };
        };

        if tool == Tool::Sqlx {
            verify_sqlx_history(self.sqlx.rows())?;
        }

        if found > SCHEMA_VERSION {
            return if compatible_from <= SCHEMA_VERSION {
                tracing::info!(
                    schema_version = found,
                    compatible_from,
                    supported = SCHEMA_VERSION,
                    "pg-semaphore's schema was migrated by a newer version that is compatible with this one: using it as it is"
                );
                Ok(Plan::UpToDate)
            } else {
                Err(Error::Schema(SchemaError::TooNew {
                    found,
                    compatible_from,
                    supported: SCHEMA_VERSION,
                }))
            };
        }
        if found == SCHEMA_VERSION {
            return Ok(Plan::UpToDate);
        }

        // Older: whoever applied it must upgrade it.
        let history = match tool {
            Tool::Sqlx if self.sqlx.used() => MigrationHistory::Sqlx,
            Tool::Refinery if self.refinery.used() => MigrationHistory::Refinery,
            _ if self.sqlx.used() => MigrationHistory::Sqlx,
            _ if self.refinery.used() => MigrationHistory::Refinery,
            _ => MigrationHistory::Application,
        };
        let ours = matches!(
            (tool, history),
            (Tool::Sqlx, MigrationHistory::Sqlx) | (Tool::Refinery, MigrationHistory::Refinery)
        );
        if !ours {
            return Err(Error::Schema(SchemaError::Outdated {
                found,
                required: SCHEMA_VERSION,
                history,
                pending: pending_files(found),
            }));
        }
        if self.may_own {
            Ok(Plan::Run {
                create_schema: false,
            })
        } else {
            Err(Error::Schema(SchemaError::NotPermitted {
                role: self.role.clone(),
                owner: Some(
                    self.objects_owner
                        .clone()
                        .unwrap_or_else(|| schema_owner.clone()),
                ),
                found: Some(found),
                required: SCHEMA_VERSION,
            }))
        }
    }
}

/// What sqlx's migrator would refuse in our own history, without running it
/// (which needs DDL privileges): a failed migration, or an applied one whose
/// file has changed since.
fn verify_sqlx_history(rows: &[SqlxApplied]) -> Result<()> {
    for row in rows {
        if !row.success {
            return Err(MigrateError::Dirty(row.version).into());
        }
        let changed = EMBEDDED
            .iter()
            .any(|m| m.version == row.version && *m.checksum != *row.checksum);
        if changed {
            return Err(MigrateError::VersionMismatch(row.version).into());
        }
    }
    Ok(())
}

/// The files that bring a schema at version `found` up to [`SCHEMA_VERSION`].
fn pending_files(found: i32) -> Vec<String> {
    pending_in(
        EMBEDDED
            .iter()
            .map(|m| format!("{}_{}.sql", m.version, m.description.replace(' ', "_")))
            .collect(),
        found,
    )
}

/// Of `files` (all of `migrations/`, in order), those a schema at version
/// `found` lacks: every file for none (version 0), else those after the
/// baseline's [`BASELINE_FILES`] and the `found - 1` files that followed it.
fn pending_in(files: Vec<String>, found: i32) -> Vec<String> {
    let applied = match usize::try_from(found) {
        Ok(0) | Err(_) => 0,
        Ok(found) => BASELINE_FILES + found - 1,
    };
    files.into_iter().skip(applied).collect()
}

/// Reads [`Facts`] on a sqlx connection.
async fn inspect(conn: &mut PgConnection) -> Result<Facts> {
    let row: FactsRow = sqlx::query_as(FACTS_SQL).fetch_one(&mut *conn).await?;
    let (mut facts, reads) = Facts::from_row(row);
    if reads.version {
        facts.version = Some(sqlx::query_as(VERSION_SQL).fetch_one(&mut *conn).await?);
    }
    if reads.sqlx {
        let rows: Vec<(i64, bool, Vec<u8>)> = sqlx::query_as(SQLX_HISTORY_SQL)
            .fetch_all(&mut *conn)
            .await?;
        facts.sqlx = History::Rows(
            rows.into_iter()
                .map(|(version, success, checksum)| SqlxApplied {
                    version,
                    success,
                    checksum,
                })
                .collect(),
        );
    }
    if reads.refinery {
        let rows: Vec<(i64, String)> = sqlx::query_as(REFINERY_HISTORY_SQL)
            .fetch_all(&mut *conn)
            .await?;
        facts.refinery = History::Rows(
            rows.into_iter()
                .map(|(version, name)| RefineryApplied { version, name })
                .collect(),
        );
    }
    Ok(facts)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An up-to-date schema migrated by `migrate()`, seen by its owner.
    fn owner_view() -> Facts {
        Facts {
            role: "owner".into(),
            schema_owner: Some("owner".into()),
            can_create_schema: true,
            can_create_in_schema: true,
            objects: 40,
            objects_owner: Some("owner".into()),
            may_own: true,
            version: Some((SCHEMA_VERSION, 1)),
            sqlx: History::Rows(
                EMBEDDED
                    .iter()
                    .map(|m| SqlxApplied {
                        version: m.version,
                        success: true,
                        checksum: m.checksum.to_vec(),
                    })
                    .collect(),
            ),
            refinery: History::Absent,
        }
    }

    /// The same schema seen by the application role (the guide's grants).
    fn app_view() -> Facts {
        Facts {
            role: "app".into(),
            can_create_schema: false,
            can_create_in_schema: false,
            may_own: false,
            ..owner_view()
        }
    }

    /// The plan that runs the migrations, creating the schema or not.
    fn run(create_schema: bool) -> Plan {
        Plan::Run { create_schema }
    }

    /// Gives the `row`th applied migration of `facts` another checksum:
    /// the plan reports it as sqlx would.
    fn assert_modified_is_reported(mut facts: Facts, row: usize) {
        if let History::Rows(rows) = &mut facts.sqlx {
            rows[row].checksum = vec![1, 2, 3];
        }
        assert!(matches!(
            facts.plan(Tool::Sqlx),
            Err(Error::Schema(SchemaError::Migrate(
                MigrateError::VersionMismatch(_)
            )))
        ));
    }

    fn older(mut facts: Facts) -> Facts {
        facts.version = Some((SCHEMA_VERSION - 1, SCHEMA_VERSION - 1));
        facts
    }

    #[test]
    fn an_empty_database_is_created_by_whoever_may() {
        let fresh = Facts {
            schema_owner: None,
            objects: 0,
            objects_owner: None,
            version: None,
            sqlx: History::Absent,
            ..owner_view()
        };
        assert_eq!(fresh.plan(Tool::Sqlx).unwrap(), run(true));
        let denied = Facts {
            can_create_schema: false,
            role: "app".into(),
            ..fresh.clone()
        };
        match denied.plan(Tool::Sqlx) {
            Err(Error::Schema(SchemaError::NotPermitted {
                role, owner: None, ..
            })) => assert_eq!(role, "app"),
            other => panic!("{other:?}"),
        }
        // A schema created for the owner by an administrator, or an empty
        // history left behind: the baseline still needs CREATE on the
        // database (`CREATE SCHEMA IF NOT EXISTS`).
        let made_for_us = Facts {
            schema_owner: Some("owner".into()),
            sqlx: History::Rows(vec![]),
            ..fresh
        };
        assert_eq!(made_for_us.plan(Tool::Sqlx).unwrap(), run(false));
        let without_create = Facts {
            can_create_schema: false,
            ..made_for_us
        };
        assert!(matches!(
            without_create.plan(Tool::Sqlx),
            Err(Error::Schema(SchemaError::NotPermitted { found: None, .. }))
        ));
    }

    #[test]
    fn an_up_to_date_schema_needs_nothing_whoever_applied_it() {
        assert_eq!(owner_view().plan(Tool::Sqlx).unwrap(), Plan::UpToDate);
        assert_eq!(app_view().plan(Tool::Sqlx).unwrap(), Plan::UpToDate);
        assert_eq!(app_view().plan(Tool::Refinery).unwrap(), Plan::UpToDate);
        let own_history = Facts {
            sqlx: History::Absent,
            ..app_view()
        };
        assert_eq!(own_history.plan(Tool::Sqlx).unwrap(), Plan::UpToDate);
        let unreadable = Facts {
            sqlx: History::Unreadable,
            ..app_view()
        };
        assert_eq!(unreadable.plan(Tool::Sqlx).unwrap(), Plan::UpToDate);
    }

    #[test]
    fn an_older_schema_is_upgraded_only_by_its_owner_with_its_own_tool() {
        assert_eq!(older(owner_view()).plan(Tool::Sqlx).unwrap(), run(false));
        let err = older(app_view()).plan(Tool::Sqlx).unwrap_err();
        assert!(
            matches!(&err, Error::Schema(SchemaError::NotPermitted { role, owner: Some(owner), .. })
                if role == "app" && owner == "owner"),
            "{err:?}"
        );
        assert!(err.to_string().contains("as role \"owner\""), "{err}");

        // Applied with sqlx: refinery does not touch it, and says who does.
        let err = older(owner_view()).plan(Tool::Refinery).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Schema(SchemaError::Outdated {
                    history: MigrationHistory::Sqlx,
                    ..
                })
            ),
            "{err:?}"
        );

        // Applied through the application's own history.
        let own = Facts {
            sqlx: History::Absent,
            ..older(owner_view())
        };
        let err = own.plan(Tool::Sqlx).unwrap_err();
        match &err {
            Error::Schema(SchemaError::Outdated {
                history: MigrationHistory::Application,
                pending,
                ..
            }) => assert_eq!(pending.len(), BASELINE_FILES),
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("your own history"), "{err}");

        // Applied with refinery.
        let by_refinery = Facts {
            sqlx: History::Absent,
            refinery: History::Rows(vec![RefineryApplied {
                version: 1,
                name: "pgsemaphore".into(),
            }]),
            ..older(owner_view())
        };
        assert_eq!(by_refinery.plan(Tool::Refinery).unwrap(), run(false));
        assert!(
            by_refinery
                .plan(Tool::Sqlx)
                .unwrap_err()
                .to_string()
                .contains("refinery_migrate")
        );
    }

    #[test]
    fn a_newer_schema_is_used_if_it_says_it_is_compatible() {
        let compatible = Facts {
            version: Some((SCHEMA_VERSION + 1, SCHEMA_VERSION)),
            ..app_view()
        };
        assert_eq!(compatible.plan(Tool::Sqlx).unwrap(), Plan::UpToDate);
        let incompatible = Facts {
            version: Some((SCHEMA_VERSION + 2, SCHEMA_VERSION + 1)),
            ..owner_view()
        };
        assert!(matches!(
            incompatible.plan(Tool::Sqlx),
            Err(Error::Schema(SchemaError::TooNew { .. }))
        ));
    }

    #[test]
    fn foreign_schemas_are_refused() {
        let foreign = Facts {
            version: None,
            objects_owner: None,
            sqlx: History::Absent,
            refinery: History::Absent,
            ..owner_view()
        };
        assert!(matches!(
            foreign.plan(Tool::Sqlx),
            Err(Error::Schema(SchemaError::Unrecognized { objects: 40 }))
        ));
    }

    #[test]
    fn a_modified_or_failed_migration_is_reported_as_sqlx_would() {
        assert_modified_is_reported(app_view(), 0);
        let mut dirty = app_view();
        if let History::Rows(rows) = &mut dirty.sqlx {
            rows[0].success = false;
        }
        assert!(matches!(
            dirty.plan(Tool::Sqlx),
            Err(Error::Schema(SchemaError::Migrate(MigrateError::Dirty(_))))
        ));
    }

    #[test]
    fn the_baseline_is_version_1_and_each_later_file_one_more() {
        assert_eq!(
            EMBEDDED.iter().count(),
            BASELINE_FILES + SCHEMA_VERSION as usize - 1
        );
        assert_eq!(
            pending_files(0),
            [
                "20261128010001_pgsemaphore_tables.sql",
                "20261128010002_pgsemaphore_admission.sql",
                "20261128010003_pgsemaphore_queue.sql",
                "20261128010004_pgsemaphore_advisory.sql",
                "20261128010005_pgsemaphore_families.sql",
                "20261128010006_pgsemaphore_rate_limits.sql",
                "20261128010007_pgsemaphore_operator.sql"
            ],
            "pending files are named as in migrations/"
        );
        assert!(pending_files(SCHEMA_VERSION).is_empty());
        // With two files after the baseline (versions 2 and 3):
        let files: Vec<String> = (1..=BASELINE_FILES + 2)
            .map(|k| format!("{k}_file.sql"))
            .collect();
        assert_eq!(pending_in(files.clone(), 0).len(), BASELINE_FILES + 2);
        assert_eq!(pending_in(files.clone(), 1), ["8_file.sql", "9_file.sql"]);
        assert_eq!(pending_in(files.clone(), 2), ["9_file.sql"]);
        assert!(pending_in(files, 3).is_empty());
    }

    #[test]
    fn a_baseline_stopped_between_its_files_is_completed_by_its_own_tool() {
        // Three of the baseline's files applied: objects, no version.
        let partial = Facts {
            version: None,
            objects_owner: None,
            may_own: false,
            sqlx: History::Rows(
                EMBEDDED
                    .iter()
                    .take(3)
                    .map(|m| SqlxApplied {
                        version: m.version,
                        success: true,
                        checksum: m.checksum.to_vec(),
                    })
                    .collect(),
            ),
            ..owner_view()
        };
        assert_eq!(partial.plan(Tool::Sqlx).unwrap(), run(false));
        // Another tool's, or nobody's: not ours to complete.
        assert!(matches!(
            partial.plan(Tool::Refinery),
            Err(Error::Schema(SchemaError::Unrecognized { objects: 40 }))
        ));
        let by_refinery = Facts {
            sqlx: History::Absent,
            refinery: History::Rows(vec![RefineryApplied {
                version: 1,
                name: "pgsemaphore_tables".into(),
            }]),
            ..partial.clone()
        };
        assert_eq!(by_refinery.plan(Tool::Refinery).unwrap(), run(false));
        // Only by a role that may create in the schema.
        let denied = Facts {
            role: "app".into(),
            can_create_schema: false,
            can_create_in_schema: false,
            ..partial.clone()
        };
        assert!(matches!(
            denied.plan(Tool::Sqlx),
            Err(Error::Schema(SchemaError::NotPermitted { found: None, .. }))
        ));
        // A modified file in the history is reported as sqlx would.
        assert_modified_is_reported(partial, 1);
    }
}
