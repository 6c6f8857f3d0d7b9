//! The catalog of the `pgsemaphore` schema, to compare two databases that
//! should hold the same schema (built by sqlx, by refinery, from
//! schema/pgsemaphore.sql), or one database before and after something
//! that should not write to it.

use sqlx::PgPool;

/// History tables, which differ by design (each tool its own).
const HISTORY: &str = "(_sqlx_migrations|refinery_schema_history)";

/// The catalog of the `pgsemaphore` schema, one sorted list of definitions
/// per kind of object (privileges and comments included).
pub async fn catalog(pool: &PgPool) -> Vec<(&'static str, Vec<String>)> {
    let queries = [
        (
            "relations",
            "SELECT c.relname || ' kind=' || c.relkind::text || ' options=' || coalesce(array_to_string(c.reloptions, ','), '')
                    || ' acl=' || coalesce(c.relacl, acldefault((CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END)::\"char\", c.relowner))::text
               FROM pg_class c
              WHERE c.relnamespace = 'pgsemaphore'::regnamespace AND c.relname !~ $1",
        ),
        (
            "columns",
            "SELECT c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                    || ' notnull=' || a.attnotnull || ' identity=' || a.attidentity::text
                    || ' generated=' || a.attgenerated::text || ' position=' || a.attnum
                    || ' default=' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
               FROM pg_attribute a
               JOIN pg_class c ON c.oid = a.attrelid
               LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
              WHERE c.relnamespace = 'pgsemaphore'::regnamespace AND c.relname !~ $1
                AND c.relkind IN ('r', 'p', 'v', 'm') AND a.attnum > 0 AND NOT a.attisdropped",
        ),
        (
            "indexes",
            "SELECT pg_get_indexdef(i.indexrelid)
               FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
              WHERE c.relnamespace = 'pgsemaphore'::regnamespace AND c.relname !~ $1",
        ),
        (
            "constraints",
            "SELECT t.relname || ' ' || k.conname || ' ' || pg_get_constraintdef(k.oid)
               FROM pg_constraint k JOIN pg_class t ON t.oid = k.conrelid
              WHERE k.connamespace = 'pgsemaphore'::regnamespace AND t.relname !~ $1",
        ),
        (
            "functions",
            "SELECT pg_get_functiondef(p.oid) FROM pg_proc p
              WHERE p.pronamespace = 'pgsemaphore'::regnamespace AND $1 <> ''",
        ),
        (
            "function privileges",
            "SELECT p.oid::regprocedure::text || ' definer=' || p.prosecdef || ' acl=' || coalesce(p.proacl::text, 'default')
               FROM pg_proc p
              WHERE p.pronamespace = 'pgsemaphore'::regnamespace AND $1 <> ''",
        ),
        (
            "triggers",
            "SELECT pg_get_triggerdef(g.oid) FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid
              WHERE c.relnamespace = 'pgsemaphore'::regnamespace AND NOT g.tgisinternal AND c.relname !~ $1",
        ),
        (
            "comments",
            // COMMENT ON every object of the schema (obj_description and
            // col_description read these rows): tables, views, columns,
            // functions, indexes, constraints, triggers, the schema itself.
            "SELECT pg_describe_object(d.classoid, d.objoid, d.objsubid) || ' = ' || d.description
               FROM pg_description d
              WHERE ((pg_identify_object(d.classoid, d.objoid, d.objsubid)).schema = 'pgsemaphore'
                     OR (d.classoid = 'pg_namespace'::regclass AND d.objoid = 'pgsemaphore'::regnamespace))
                AND pg_describe_object(d.classoid, d.objoid, d.objsubid) !~ $1",
        ),
    ];
    let mut catalog = Vec::new();
    for (kind, sql) in queries {
        let mut rows: Vec<String> = sqlx::query_scalar(sql)
            .bind(HISTORY)
            .fetch_all(pool)
            .await
            .unwrap_or_else(|e| panic!("read {kind}: {e}"));
        rows.sort();
        catalog.push((kind, rows));
    }
    catalog
}

/// Asserts that two databases hold the same `pgsemaphore` schema (history
/// tables aside), kind by kind.
pub async fn assert_same(expected: &PgPool, actual: &PgPool) {
    let expected = catalog(expected).await;
    let actual = catalog(actual).await;
    for ((kind, expected), (_, actual)) in expected.iter().zip(&actual) {
        assert!(
            !expected.is_empty() || *kind == "triggers",
            "no {kind} at all"
        );
        assert_eq!(actual, expected, "{kind} differ");
    }
}

/// The schema's relations and functions (a function's definition by hash),
/// sorted: a snapshot to compare before and after something that should
/// leave the schema alone.
pub async fn objects(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text || ' ' || c.relkind::text FROM pg_class c
           JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'pgsemaphore'
         UNION ALL
         SELECT p.oid::regprocedure::text || ' ' || md5(pg_get_functiondef(p.oid)) FROM pg_proc p
           JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'pgsemaphore'
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .expect("list the schema's objects")
}
