-- pg-semaphore, schema version 4: advisory holders of this database only.
--
-- An advisory lock belongs to one database (pg_locks.database): two
-- databases of one cluster can each have an advisory semaphore of the same
-- name, with the same keys, and never share a slot. Version 3 read pg_locks
-- of the whole cluster, so:
--   * pgsemaphore.advisory_holders (hence available_permits, the CLI's
--     status) listed the other database's holders as this one's;
--   * pgsemaphore.advisory_drained kept a capacity drop in force while the
--     other database held keys above the new capacity (safe, never over:
--     claims kept counting those keys, but the drop never ended).
-- Both now read this database's locks only. (Since schema version 12,
-- edited in place: advisory_holders lists shared holds too, with a mode
-- column; advisory_drained refuses isolation levels but READ COMMITTED
-- and never waits for the semaphore's row, see its comment.) Nothing else
-- changes;
-- schema_version() returns (4, 2): code built for version 2 or 3 works
-- against it unchanged. Grants are kept (CREATE OR REPLACE keeps them).

CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 4, 2 $$;

-- The live holders of this database's advisory semaphores' slots, from
-- pg_locks (shared memory: nothing in a table says who holds a slot). A
-- 64-bit advisory key shows in pg_locks as classid (its high 32 bits) and
-- objid (its low 32 bits), objsubid 1, in the database that took it. Every
-- granted hold is listed, exclusive (a claim's) or shared (a key taken
-- with pg_advisory_lock_shared: it admits nobody, but blocks claims of that
-- slot, so it is shown); mode says which, and a slot held shared by
-- several sessions is listed once per session. The session's backend pid,
-- application_name and client address identify the holder's process
-- (pg_stat_activity shows them for sessions of other roles only to members
-- of pg_read_all_stats).
CREATE OR REPLACE VIEW pgsemaphore.advisory_holders AS
    SELECT a.name AS semaphore,
           (k.key - a.key_base)::integer AS slot,
           k.pid,
           p.application_name,
           p.client_addr,
           p.backend_start,
           k.mode
      FROM pgsemaphore.advisory_semaphores a
      JOIN (SELECT l.pid, ((l.classid::bigint << 32) | l.objid::bigint) AS key,
                   CASE WHEN l.mode = 'ExclusiveLock' THEN 'exclusive' ELSE 'shared' END AS mode
              FROM pg_catalog.pg_locks l
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
               AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                  WHERE d.datname = pg_catalog.current_database())) k
        ON k.key >= a.key_base AND k.key < a.key_base + a.peak_capacity
      LEFT JOIN pg_catalog.pg_stat_activity p ON p.pid = k.pid;

CREATE OR REPLACE FUNCTION pgsemaphore.advisory_drained(p_semaphore text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
-- A capacity drop of p_semaphore may be over (advisory_claim found every
-- slot at or above the capacity free): if pg_locks shows no lock, of any
-- session of this database, in any mode, granted or awaited, on a key
-- between the capacity and the peak, claims stop counting them (none is
-- ever taken again). Decides from pg_locks itself, under the semaphore's
-- row lock (serialised with configure_advisory), never from what its
-- caller says: any role may call it, and calling it early changes nothing.
-- Returns whether the drop is over: true also for a semaphore that does
-- not exist, or has no drop pending; false while a key above the capacity
-- is held, or while another transaction holds the row (a
-- configure_advisory, or another advisory_drained, still open: a later
-- claim ends the drop then). With the owner's rights: the application may
-- not write the table.
-- READ COMMITTED only (else 0A000). Waits for nothing: it reads the row
-- first without locking it (no drop pending: done, nothing locked), then
-- locks it SKIP LOCKED. A caller that leaves this in an open transaction
-- holds the row only while a drop is pending, delays no claim (claims
-- never wait for the row), and delays configure_advisory by at most its
-- lock_timeout (2 s, then 55P03). (lock_timeout here bounds what is left:
-- the table's own relation lock, which only DDL could hold.)
DECLARE
    v_capacity integer;
    v_peak     integer;
    v_base     bigint;
BEGIN
    IF p_semaphore IS NULL THEN
        PERFORM pgsemaphore.refuse('p_semaphore', 'a semaphore name, got NULL');
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'advisory_drained needs READ COMMITTED, this transaction is %',
            upper(current_setting('transaction_isolation'))
            USING ERRCODE = 'feature_not_supported';
    END IF;
    SELECT a.capacity, a.peak_capacity INTO v_capacity, v_peak
      FROM pgsemaphore.advisory_semaphores a WHERE a.name = p_semaphore;
    IF NOT FOUND OR v_peak <= v_capacity THEN
        RETURN true;
    END IF;
    SELECT a.capacity, a.peak_capacity, a.key_base INTO v_capacity, v_peak, v_base
      FROM pgsemaphore.advisory_semaphores a WHERE a.name = p_semaphore
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NOT EXISTS (SELECT 1 FROM pgsemaphore.advisory_semaphores a WHERE a.name = p_semaphore);
    END IF;
    IF v_peak <= v_capacity THEN
        RETURN true;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_locks l
                WHERE l.locktype = 'advisory' AND l.objsubid = 1
                  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                     WHERE d.datname = pg_catalog.current_database())
                  AND ((l.classid::bigint << 32) | l.objid::bigint)
                      BETWEEN v_base + v_capacity AND v_base + v_peak - 1) THEN
        RETURN false;
    END IF;
    UPDATE pgsemaphore.advisory_semaphores a
       SET peak_capacity = a.capacity
     WHERE a.name = p_semaphore;
    RETURN true;
END;
$$;
