-- pg-semaphore's schema, version 1 (the 0.1 baseline), part 7 of 7: the
-- operator's functions for semaphores (configure, force_release,
-- clear_queue, fair weights), the outcome counters (record_outcomes, the
-- application's, and their retention), the reaper and retention, and
-- schema_version(), last: a schema reports its version only once every
-- file of the baseline is in.
--
-- Grants. No routine of the schema is executable by PUBLIC (each file
-- revokes it from the routines it defines). grant_access, run by the
-- schema's owner, gives a role the application's part or the operator's:
-- the schema, its tables to read, and EXECUTE on exactly that part's
-- routines; it records the role in pgsemaphore.grantees, and regrant()
-- gives every recorded role its part again. Each migration after the
-- baseline redefines grant_access with its new routines and ends with
-- SELECT pgsemaphore.regrant(), so an upgrade keeps the grants current.

CREATE FUNCTION pgsemaphore.configure(p_name text, p_capacity integer, p_lease interval,
                                      p_create boolean DEFAULT true,
                                      p_queue_lifo boolean DEFAULT NULL)
RETURNS TABLE (o_capacity integer, o_default_lease interval, o_previous_capacity integer,
               o_queue_lifo boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET plan_cache_mode = force_generic_plan
AS $$
-- Creates a semaphore or changes its capacity, default lease and queue
-- order (a NULL keeps the current value; p_create false: an unknown name is
-- an error, P0002, not a new semaphore; creating needs a capacity and a
-- lease). Holders above a reduced capacity keep their slots until they
-- release; claims see the new capacity and order at once (they lock the
-- same row). Wakes waiters (wake_at_commit) when the capacity grew or the
-- order changed. Returns the settings now and the previous capacity (NULL
-- when it was created).
--   p_name 1..200 characters; p_capacity NULL or 1..100000; p_lease NULL
--   or 10 ms..366 days; p_create not NULL
DECLARE
    v_old_capacity integer;
    v_old_lease    interval;
    v_old_lifo     boolean;
    v_capacity     integer;
    v_lease        interval;
    v_lifo         boolean;
BEGIN
    PERFORM pgsemaphore.checked_text(p_name, 'p_name', 200);
    IF p_capacity NOT BETWEEN 1 AND 100000 THEN
        PERFORM pgsemaphore.refuse('p_capacity', format('NULL or 1 to 100000, got %s', p_capacity));
    END IF;
    PERFORM pgsemaphore.checked_interval(p_lease, 'p_lease', interval '10 ms', interval '366 days', true);
    IF p_create IS NULL THEN
        PERFORM pgsemaphore.refuse('p_create', 'true or false, got NULL');
    END IF;
    LOOP
        SELECT s.capacity, s.default_lease, s.queue_lifo INTO v_old_capacity, v_old_lease, v_old_lifo
          FROM pgsemaphore.semaphores s
         WHERE s.name = p_name
           FOR NO KEY UPDATE;
        IF FOUND THEN
            v_capacity := coalesce(p_capacity, v_old_capacity);
            v_lease := coalesce(p_lease, v_old_lease);
            v_lifo := coalesce(p_queue_lifo, v_old_lifo);
            IF v_old_capacity <> v_capacity OR v_old_lease <> v_lease OR v_old_lifo <> v_lifo THEN
                UPDATE pgsemaphore.semaphores s
                   SET capacity = v_capacity, default_lease = v_lease, queue_lifo = v_lifo,
                       updated_at = clock_timestamp()
                 WHERE s.name = p_name;
            END IF;
            IF v_capacity > v_old_capacity OR v_lifo <> v_old_lifo THEN
                -- Rare: an operator's action.
                PERFORM pgsemaphore.wake_at_commit(p_name);
            END IF;
            RETURN QUERY SELECT v_capacity, v_lease, v_old_capacity, v_lifo;
            RETURN;
        END IF;
        IF NOT p_create THEN
            RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_name)
                USING ERRCODE = 'no_data_found';
        END IF;
        IF p_capacity IS NULL THEN
            PERFORM pgsemaphore.refuse('p_capacity', 'a new semaphore needs a capacity, got NULL');
        END IF;
        IF p_lease IS NULL THEN
            PERFORM pgsemaphore.refuse('p_lease', 'a new semaphore needs a lease, got NULL');
        END IF;
        INSERT INTO pgsemaphore.semaphores (name, capacity, default_lease, queue_lifo)
        VALUES (p_name, p_capacity, p_lease, coalesce(p_queue_lifo, false))
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT p_capacity, p_lease, NULL::integer, coalesce(p_queue_lifo, false);
            RETURN;
        END IF;
        -- Lost a race with a concurrent creator: the next SELECT sees its row.
    END LOOP;
END;
$$;

CREATE FUNCTION pgsemaphore.force_release(p_id bigint)
RETURNS TABLE (o_outcome text, o_semaphore text, o_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET plan_cache_mode = force_generic_plan
AS $$
-- Ends a claim by id, whoever holds it (an operator freeing a stuck slot).
-- Returns 'released' (ended now), 'timed_out' or 'completed' (already ended,
-- at o_at) or 'missing', and wakes the semaphore's waiters (wake_at_commit).
--   p_id not NULL
-- Durable. Meets: the holder's release, renewal or fence (the row lock:
-- this waits for them, and the clock is read after it).
DECLARE
    v_semaphore    text;
    v_completed_at timestamptz;
    v_timed_out_at timestamptz;
BEGIN
    IF p_id IS NULL THEN
        PERFORM pgsemaphore.refuse('p_id', 'a claim id, got NULL');
    END IF;
    PERFORM pgsemaphore.durable_commit();
    PERFORM 1 FROM pgsemaphore.slots s WHERE s.id = p_id FOR UPDATE;
    UPDATE pgsemaphore.slots s
       SET completed_at = clock_timestamp()
     WHERE s.id = p_id
       AND s.completed_at IS NULL AND s.timed_out_at IS NULL
    RETURNING s.semaphore, s.completed_at INTO v_semaphore, v_completed_at;
    IF FOUND THEN
        PERFORM pgsemaphore.wake_at_commit(v_semaphore);
        RETURN QUERY SELECT 'released'::text, v_semaphore, v_completed_at;
        RETURN;
    END IF;
    SELECT s.semaphore, s.completed_at, s.timed_out_at
      INTO v_semaphore, v_completed_at, v_timed_out_at
      FROM pgsemaphore.slots s
     WHERE s.id = p_id;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'missing'::text, NULL::text, NULL::timestamptz;
    ELSIF v_timed_out_at IS NOT NULL THEN
        RETURN QUERY SELECT 'timed_out'::text, v_semaphore, v_timed_out_at;
    ELSE
        RETURN QUERY SELECT 'completed'::text, v_semaphore, v_completed_at;
    END IF;
END;
$$;

CREATE FUNCTION pgsemaphore.clear_queue(p_semaphore text)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET plan_cache_mode = force_generic_plan
AS $$
-- Removes every waiter of p_semaphore's queue (a waiter that blocks the
-- queue: a process that renews its place but never claims), and wakes the
-- semaphore's waiters (wake_at_commit). Returns how many it removed. A
-- waiter of a live process notices at its next claim ('no_ticket') and
-- queues again, at the back. Serialised with claims and enqueues on the
-- semaphore's row. P0002 for an unknown semaphore.
--   p_semaphore 1..200 characters
DECLARE
    v_count bigint;
BEGIN
    PERFORM pgsemaphore.checked_text(p_semaphore, 'p_semaphore', 200);
    PERFORM 1 FROM pgsemaphore.semaphores s WHERE s.name = p_semaphore FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_semaphore)
            USING ERRCODE = 'no_data_found';
    END IF;
    DELETE FROM pgsemaphore.waiters w WHERE w.semaphore = p_semaphore;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    UPDATE pgsemaphore.semaphores s SET queue_used = false WHERE s.name = p_semaphore AND s.queue_used;
    PERFORM pgsemaphore.wake_at_commit(p_semaphore);
    RETURN v_count;
END;
$$;

CREATE FUNCTION pgsemaphore.set_fair_weight(p_semaphore text, p_fair_key text, p_weight integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
-- Sets the weight of fairness key p_fair_key (NULL: the shared default key)
-- in p_semaphore's fair queue: how many of its waiters one turn of the
-- rotation serves (pgsemaphore.enqueue). Returns the previous weight (1 if
-- none was set). Waiters queued after this commits get turns by the new
-- weight; those queued already keep theirs.
--   p_semaphore an existing semaphore (else P0002); p_fair_key NULL or
--   1..200 characters; p_weight NULL or 1..1000 (NULL and 1: the default,
--   the row is removed)
-- Every bad argument raises SQLSTATE 22023 naming it in COLUMN. Locks the
-- semaphore's row (FOR NO KEY UPDATE, at most lock_timeout, 2 s, then
-- 55P03), so that an enqueue reads the weight as of before or after this,
-- never half.
DECLARE
    v_previous integer;
BEGIN
    PERFORM pgsemaphore.checked_text(p_semaphore, 'p_semaphore', 200);
    IF char_length(p_fair_key) NOT BETWEEN 1 AND 200 THEN
        PERFORM pgsemaphore.refuse('p_fair_key',
            format('NULL (the shared default key) or 1 to 200 characters, got %s characters',
                   char_length(p_fair_key)));
    END IF;
    IF p_weight NOT BETWEEN 1 AND 1000 THEN
        PERFORM pgsemaphore.refuse('p_weight', format('NULL or 1 to 1000, got %s', p_weight));
    END IF;
    PERFORM 1 FROM pgsemaphore.semaphores s WHERE s.name = p_semaphore FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_semaphore)
            USING ERRCODE = 'no_data_found';
    END IF;
    SELECT f.weight INTO v_previous
      FROM pgsemaphore.fair_weights f
     WHERE f.semaphore = p_semaphore AND f.fair_key = coalesce(p_fair_key, '');
    IF coalesce(p_weight, 1) = 1 THEN
        DELETE FROM pgsemaphore.fair_weights f
         WHERE f.semaphore = p_semaphore AND f.fair_key = coalesce(p_fair_key, '');
    ELSE
        INSERT INTO pgsemaphore.fair_weights AS f (semaphore, fair_key, weight)
        VALUES (p_semaphore, coalesce(p_fair_key, ''), p_weight)
        ON CONFLICT (semaphore, fair_key)
        DO UPDATE SET weight = excluded.weight, updated_at = clock_timestamp();
    END IF;
    RETURN coalesce(v_previous, 1);
END;
$$;

CREATE FUNCTION pgsemaphore.configure_advisory(p_name text, p_capacity integer)
RETURNS TABLE (o_capacity integer, o_previous_capacity integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- Changes the capacity of an existing advisory semaphore (P0002 if there is
-- none). Holders above a reduced capacity keep their slots until they
-- release, and are counted by every claim until then (peak_capacity, see
-- advisory_claim); claims see the new capacity at once. Wakes the
-- semaphore's waiters when the capacity grew (the NOTIFY goes out at this
-- transaction's commit). A change moves the sequence
-- pgsemaphore.advisory_epoch (the row's trigger, under the row's lock), so
-- a one-statement claim whose snapshot predates it gives its slot back.
--   p_name 1..200 characters; p_capacity 1..100000
-- READ COMMITTED only (else 0A000, changing nothing). The one wait it can
-- meet is for the semaphore's row (another configure_advisory, or an
-- advisory_drained ending a drop, in a transaction still open): at most
-- lock_timeout, 2 s, then 55P03 (Error::Stalled), nothing changed.
DECLARE
    v_old integer;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgsemaphore.refuse_isolation('pgsemaphore.configure_advisory',
            'an older snapshot could miss a change of the semaphore committed meanwhile');
    END IF;
    PERFORM pgsemaphore.checked_text(p_name, 'p_name', 200);
    IF p_capacity IS NULL OR p_capacity NOT BETWEEN 1 AND 100000 THEN
        PERFORM pgsemaphore.refuse('p_capacity', format('1 to 100000, got %s', coalesce(p_capacity::text, 'NULL')));
    END IF;
    SELECT a.capacity INTO v_old FROM pgsemaphore.advisory_semaphores a
     WHERE a.name = p_name FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'advisory semaphore % does not exist', quote_literal(p_name)
            USING ERRCODE = 'no_data_found';
    END IF;
    IF p_capacity <> v_old THEN
        UPDATE pgsemaphore.advisory_semaphores a
           SET capacity = p_capacity, peak_capacity = greatest(a.peak_capacity, p_capacity),
               updated_at = clock_timestamp()
         WHERE a.name = p_name;
    END IF;
    IF p_capacity > v_old THEN
        PERFORM pg_notify('pgsemaphore', p_name);
    END IF;
    RETURN QUERY SELECT p_capacity, v_old;
END;
$$;

-- The reaper (its contract opens its body).
CREATE FUNCTION pgsemaphore.reap()
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Marks every expired live claim (of every semaphore) timed out, deletes
-- queue waiters whose process stopped renewing them, wakes the semaphores
-- that gained room or lost a waiter (through the wake-up gate,
-- wake_at_commit: a waiter registering while this is uncommitted is never
-- missed), deletes ended registrations and tombstones, removes idle keys
-- of families among the next 1000 of each (pgsemaphore.reap_family_keys),
-- and returns how many claims it reaped.
-- SKIP LOCKED: a row locked by a release, renewal or fence is left (and
-- counted as held by every claim) until that transaction ends.
DECLARE
    v_now       timestamptz := clock_timestamp();
    v_total     bigint := 0;
    v_semaphore text;
    v_count     bigint;
BEGIN
    -- Reaped rows were certainly not held: nothing here needs a WAL flush
    -- before the wake-ups (which hold an instance-wide lock until commit).
    PERFORM pgsemaphore.fast_commit();
    FOR v_semaphore, v_count IN
        WITH expired AS (
            SELECT e.id
              FROM pgsemaphore.live_slots e
             WHERE e.expires_at <= v_now
               FOR UPDATE SKIP LOCKED
        ), reaped AS (
            UPDATE pgsemaphore.slots s
               SET timed_out_at = v_now
              FROM expired
             WHERE s.id = expired.id
            RETURNING s.semaphore
        )
        SELECT r.semaphore, count(*) FROM reaped r GROUP BY r.semaphore
    LOOP
        PERFORM pgsemaphore.wake_at_commit(v_semaphore);
        v_total := v_total + v_count;
    END LOOP;
    FOR v_semaphore IN
        WITH dead AS (
            DELETE FROM pgsemaphore.waiters w
             WHERE w.id IN (SELECT d.id FROM pgsemaphore.waiters d
                             WHERE d.expires_at <= v_now
                               FOR UPDATE SKIP LOCKED)
            RETURNING w.semaphore
        )
        SELECT DISTINCT d.semaphore FROM dead d
    LOOP
        PERFORM pgsemaphore.wake_at_commit(v_semaphore);
    END LOOP;
    DELETE FROM pgsemaphore.wakeups k WHERE k.until <= v_now;
    DELETE FROM pgsemaphore.released_tokens t WHERE t.until <= v_now;
    PERFORM pgsemaphore.reap_family_keys(1000);
    RETURN v_total;
END;
$$;

CREATE FUNCTION pgsemaphore.prune(p_older_than interval, p_batch integer)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Retention: deletes finished claims of lease semaphores that ended before
-- now - p_older_than (see pgsemaphore.prune_unchecked), then, with what is
-- left of the batch, finished permits of advisory semaphores
-- (pgsemaphore.prune_advisory_claims), then the outcome counters' minutes
-- that ended before it (pgsemaphore.prune_outcomes): at most p_batch rows
-- in all per call; a caller repeats it until it returns less than p_batch.
--   p_older_than 0..100 years; p_batch 1..1000000
DECLARE
    v_count bigint;
BEGIN
    PERFORM pgsemaphore.checked_interval(p_older_than, 'p_older_than', interval '0', interval '100 years');
    IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 1000000 THEN
        PERFORM pgsemaphore.refuse('p_batch', format('1 to 1000000, got %s', coalesce(p_batch::text, 'NULL')));
    END IF;
    v_count := pgsemaphore.prune_unchecked(p_older_than, p_batch);
    IF v_count < p_batch THEN
        v_count := v_count + pgsemaphore.prune_advisory_claims(p_older_than, (p_batch - v_count)::integer);
    END IF;
    IF v_count < p_batch THEN
        v_count := v_count + pgsemaphore.prune_outcomes(p_older_than, (p_batch - v_count)::integer);
    END IF;
    RETURN v_count;
END;
$$;

-- Retention's first step, called by pgsemaphore.prune with checked
-- arguments (granted to nobody): deletes finished claims (completed or
-- timed out) that ended before now - p_older_than, at most p_batch rows per call, oldest first per
-- semaphore, so a large backlog is removed in short transactions. Live claims
-- are never touched. Driven by the history index: a claim ended after it
-- began, so only claims *created* before the cutoff are looked at, and with
-- nothing old enough it reads next to nothing, however long the log.
CREATE FUNCTION pgsemaphore.prune_unchecked(p_older_than interval, p_batch integer)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_cutoff timestamptz := clock_timestamp() - p_older_than;
    v_ids    bigint[];
    v_count  bigint;
BEGIN
    -- Per semaphore, the oldest claims created before the cutoff (the
    -- history index), those that ended before it, locked; rows a reaper,
    -- release or fence holds right now are left for the next round.
    SELECT array_agg(o.id) INTO v_ids
      FROM (SELECT d.id
              FROM pgsemaphore.semaphores m,
                   LATERAL (SELECT h.id
                              FROM pgsemaphore.slots h
                             WHERE h.semaphore = m.name AND h.created_at < v_cutoff
                               AND coalesce(h.completed_at, h.timed_out_at) < v_cutoff
                             ORDER BY h.created_at
                             LIMIT p_batch
                               FOR UPDATE SKIP LOCKED) d
             LIMIT p_batch) o;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    DELETE FROM pgsemaphore.slots s WHERE s.id = ANY (v_ids);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;

-- ---------------------------------------------------------------------------
-- Outcome counters
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.record_outcomes(p_kinds text[], p_names text[], p_admitted bigint[],
                                            p_refused bigint[], p_timed_out bigint[])
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET plan_cache_mode = force_generic_plan
AS $$
-- Adds a process's counts to the outcome counters (pgsemaphore.outcomes)
-- of the current minute: entry i adds p_admitted[i], p_refused[i] and
-- p_timed_out[i] to the row (p_kinds[i], p_names[i], the minute now, on
-- the database's clock), creating it if needed. One statement, one row
-- per entry (an entry of three zeros writes nothing). Returns how many
-- rows it wrote. The crate's tally calls it every 5 s with what it counted
-- since, and keeps the counts to try again when the call fails.
--   p_kinds, p_names, p_admitted, p_refused, p_timed_out: one-dimensional
--   arrays of the same length, 1..1000, without NULLs;
--   each kind 'semaphore', 'advisory', 'family', 'token_bucket',
--   'fixed_window' or 'sliding_window'; each name 1..200 characters; no
--   (kind, name) twice; each count 0..1000000000.
-- Every bad argument raises 22023 naming it in COLUMN (and the entry's
-- position from 1 in the message), writing nothing. READ COMMITTED only
-- (else 0A000): a later snapshot would make ON CONFLICT fail against a
-- row updated since it began.
-- Invariant: no count is lost or counted twice. Each entry's addition is
-- one INSERT ... ON CONFLICT DO UPDATE of its row under the row's lock,
-- and the update reads the row as the last committed writer left it
-- (READ COMMITTED re-reads a row it waited for), so concurrent additions
-- to the same row add up.
-- Meets:
--   * another record_outcomes adding to some of the same rows (another
--     process's tally, or this process's): rows are written in one order,
--     by (kind, name), so two calls wait for each other in that order and
--     never deadlock, whatever order their arrays list the entries in; two
--     calls creating the same row: the second waits for the first's insert,
--     then adds to it;
--   * a call left uncommitted (a hostile or stuck session) holding rows of
--     this minute: the wait is bounded by lock_timeout (2 s, then 55P03,
--     nothing written; the crate keeps its counts and tries again);
--   * pgsemaphore.prune deleting old minutes: it deletes only minutes that
--     ended before its cutoff (now - its retention), never the current
--     one, and skips the rows this call holds rather than wait for them;
--   * readers: never block it, nor it them.
-- Bounded: at most 1000 rows per call. No arithmetic overflows: a call adds
-- at most 10^9 to each count, and each sum saturates at the largest bigint
-- (least(count, max - added) + added) instead of raising; 9.2e18 would
-- take 9 billion calls within one minute.
-- A fast commit (fast_commit): the counts are statistics; a database crash
-- may lose the last seconds of them, never a slot or a decision.
-- Trust: the counts are the caller's own report. Any role granted this
-- function (the application) can add to any name's counters, inflate them,
-- or write names nothing uses (as it can open semaphores of any name);
-- roles without the grant cannot call it, and no role writes the table
-- directly. Read the counters as the applications' account.
DECLARE
    v_n      integer;
    v_bad    record;
    v_minute timestamptz;
    v_count  integer;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgsemaphore.refuse_isolation('pgsemaphore.record_outcomes',
            'an older snapshot could miss a count added meanwhile');
    END IF;
    IF p_kinds IS NULL OR array_ndims(p_kinds) IS DISTINCT FROM 1
       OR cardinality(p_kinds) NOT BETWEEN 1 AND 1000
       OR array_position(p_kinds, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.refuse('p_kinds',
            '1 to 1000 kinds, in a one-dimensional array without NULLs');
    END IF;
    v_n := cardinality(p_kinds);
    IF p_names IS NULL OR array_ndims(p_names) IS DISTINCT FROM 1
       OR cardinality(p_names) <> v_n OR array_position(p_names, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.refuse('p_names',
            format('%s names (one per kind), in a one-dimensional array without NULLs', v_n));
    END IF;
    IF p_admitted IS NULL OR array_ndims(p_admitted) IS DISTINCT FROM 1
       OR cardinality(p_admitted) <> v_n OR array_position(p_admitted, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.refuse('p_admitted',
            format('%s counts (one per kind), in a one-dimensional array without NULLs', v_n));
    END IF;
    IF p_refused IS NULL OR array_ndims(p_refused) IS DISTINCT FROM 1
       OR cardinality(p_refused) <> v_n OR array_position(p_refused, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.refuse('p_refused',
            format('%s counts (one per kind), in a one-dimensional array without NULLs', v_n));
    END IF;
    IF p_timed_out IS NULL OR array_ndims(p_timed_out) IS DISTINCT FROM 1
       OR cardinality(p_timed_out) <> v_n OR array_position(p_timed_out, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.refuse('p_timed_out',
            format('%s counts (one per kind), in a one-dimensional array without NULLs', v_n));
    END IF;
    -- The first entry that fails a check, and which argument.
    SELECT e.n, e.argument, e.why INTO v_bad
      FROM (SELECT u.n,
                   CASE
                   WHEN u.kind NOT IN ('semaphore', 'advisory', 'family',
                                       'token_bucket', 'fixed_window', 'sliding_window')
                       THEN 'p_kinds'
                   WHEN char_length(u.name) NOT BETWEEN 1 AND 200 THEN 'p_names'
                   WHEN u.admitted NOT BETWEEN 0 AND 1000000000 THEN 'p_admitted'
                   WHEN u.refused NOT BETWEEN 0 AND 1000000000 THEN 'p_refused'
                   WHEN u.timed_out NOT BETWEEN 0 AND 1000000000 THEN 'p_timed_out'
                   WHEN row_number() OVER (PARTITION BY u.kind, u.name ORDER BY u.n) > 1 THEN 'p_names'
                   END AS argument,
                   CASE
                   WHEN u.kind NOT IN ('semaphore', 'advisory', 'family',
                                       'token_bucket', 'fixed_window', 'sliding_window')
                       THEN format('%s: semaphore, advisory, family, token_bucket, fixed_window or sliding_window',
                                   quote_literal(u.kind))
                   WHEN char_length(u.name) NOT BETWEEN 1 AND 200
                       THEN format('1 to 200 characters, got %s', char_length(u.name))
                   WHEN u.admitted NOT BETWEEN 0 AND 1000000000
                       THEN format('0 to 1000000000, got %s', u.admitted)
                   WHEN u.refused NOT BETWEEN 0 AND 1000000000
                       THEN format('0 to 1000000000, got %s', u.refused)
                   WHEN u.timed_out NOT BETWEEN 0 AND 1000000000
                       THEN format('0 to 1000000000, got %s', u.timed_out)
                   ELSE format('%s %s is listed twice', u.kind, quote_literal(u.name))
                   END AS why
              FROM unnest(p_kinds, p_names, p_admitted, p_refused, p_timed_out)
                   WITH ORDINALITY AS u(kind, name, admitted, refused, timed_out, n)) e
     WHERE e.argument IS NOT NULL
     ORDER BY e.n
     LIMIT 1;
    IF v_bad.n IS NOT NULL THEN
        PERFORM pgsemaphore.refuse(v_bad.argument, format('entry %s: %s', v_bad.n, v_bad.why));
    END IF;
    PERFORM pgsemaphore.fast_commit();
    v_minute := date_bin(interval '1 minute', now(), timestamptz '2000-01-01 00:00:00+00');
    INSERT INTO pgsemaphore.outcomes AS o (kind, name, minute, admitted, refused, timed_out)
    SELECT u.kind, u.name, v_minute, u.admitted, u.refused, u.timed_out
      FROM unnest(p_kinds, p_names, p_admitted, p_refused, p_timed_out)
           AS u(kind, name, admitted, refused, timed_out)
     WHERE u.admitted > 0 OR u.refused > 0 OR u.timed_out > 0
     ORDER BY u.kind, u.name
    ON CONFLICT (kind, name, minute) DO UPDATE
       SET admitted = least(o.admitted, 9223372036854775807 - excluded.admitted) + excluded.admitted,
           refused = least(o.refused, 9223372036854775807 - excluded.refused) + excluded.refused,
           timed_out = least(o.timed_out, 9223372036854775807 - excluded.timed_out) + excluded.timed_out;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;

-- Retention of the outcome counters (pgsemaphore.prune calls it with what
-- is left of its batch after the audit logs): deletes the minutes that
-- ended before now - p_older_than, oldest first, at most p_batch rows, and
-- returns how many. Rows another transaction holds (a record_outcomes in
-- flight holds rows of the minute it began in, old enough only for a
-- retention of under a minute) are skipped, never waited for. The
-- arguments were checked by the caller; granted to nobody.
CREATE FUNCTION pgsemaphore.prune_outcomes(p_older_than interval, p_batch integer)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_cutoff timestamptz := clock_timestamp() - p_older_than - interval '1 minute';
    v_count  bigint;
BEGIN
    DELETE FROM pgsemaphore.outcomes o
     WHERE o.ctid = ANY (ARRAY(
            SELECT d.ctid
              FROM pgsemaphore.outcomes d
             WHERE d.minute < v_cutoff
             ORDER BY d.minute
             LIMIT p_batch
               FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;

CREATE FUNCTION pgsemaphore.grant_access(p_role regrole, p_part text)
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s'
AS $$
-- Gives p_role the application's part ('application') or the operator's
-- ('operator') of the schema: USAGE on it, SELECT on its tables and views
-- and on the advisory semaphores' epoch (a sequence: read, never moved),
-- EXECUTE on exactly that part's routines; records the role in grantees.
-- Returns how many routines it granted. Idempotent.
--   p_role an existing role other than the owner's; p_part 'application'
--   or 'operator'.
-- Who: the schema's owner (or a member of its role, or a superuser), with
-- the caller's rights (SECURITY INVOKER): anyone else is refused (42501)
-- before anything is granted, never left with a GRANT that silently did
-- nothing.
-- Meets: another grant_access or regrant (GRANTs on the same routines
-- update the same catalog rows: the second waits, bounded by lock_timeout,
-- 55P03); a migration's DDL (the same); never an admission function (it
-- locks no row of the schema's tables but grantees').
DECLARE
    v_owner    oid;
    v_routines text[];
    v_routine  text;
BEGIN
    IF p_role IS NULL THEN
        RAISE EXCEPTION 'p_role must name a role' USING ERRCODE = '22023';
    END IF;
    IF p_part IS NULL OR p_part NOT IN ('application', 'operator') THEN
        RAISE EXCEPTION 'p_part must be ''application'' or ''operator'', not %',
            coalesce(quote_literal(p_part), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    SELECT n.nspowner INTO v_owner FROM pg_namespace n WHERE n.nspname = 'pgsemaphore';
    IF NOT pg_has_role(current_user, v_owner, 'USAGE') THEN
        RAISE EXCEPTION 'only the owner of schema pgsemaphore (%) can grant access to it',
            v_owner::regrole
            USING ERRCODE = '42501',
                  HINT = 'Run it as the role that ran the migrations.';
    END IF;
    IF p_role = v_owner THEN
        RAISE EXCEPTION 'role % owns schema pgsemaphore and needs no grant', p_role
            USING ERRCODE = '22023';
    END IF;
    v_routines := CASE p_part
        WHEN 'application' THEN ARRAY[
            'pgsemaphore.schema_version()',
            'pgsemaphore.open(text, integer, interval, boolean)',
            'pgsemaphore.claim(text, text, interval, jsonb, bytea, integer, smallint, integer, bigint, bytea, interval)',
            'pgsemaphore.release(bigint[], bytea, boolean)',
            'pgsemaphore.claim_all(text[], text, interval, jsonb, bytea, integer[], text[], text[], text[], double precision[], double precision[], bigint[], interval[])',
            'pgsemaphore.release_all(bigint[], bytea, boolean)',
            'pgsemaphore.release_by_token(text, bytea)',
            'pgsemaphore.renew(bigint[], bytea, interval)',
            'pgsemaphore.fence(bigint[], bytea)',
            'pgsemaphore.enqueue(text, integer, smallint, text, integer, interval, bytea, text)',
            'pgsemaphore.leave_queue(bigint, bytea)',
            'pgsemaphore.keep_waiting(text, interval, bigint[], bytea, boolean, bigint)',
            'pgsemaphore.stop_waiting(text, bytea, bigint)',
            'pgsemaphore.wake(text)',
            'pgsemaphore.wake_claimed(bigint)',
            'pgsemaphore.release_then_wake(bigint[], bytea, boolean, text, bigint, timestamptz)',
            'pgsemaphore.release_all_then_wake(bigint[], bytea, boolean, text, bigint, timestamptz)',
            'pgsemaphore.token_bucket(text, text, double precision, double precision, double precision)',
            'pgsemaphore.token_bucket_reserve(text, text, double precision, double precision, double precision, interval)',
            'pgsemaphore.fixed_window(text, text, bigint, interval, bigint)',
            'pgsemaphore.sliding_window(text, text, bigint, interval, bigint)',
            'pgsemaphore.fixed_window_reserve(text, text, bigint, interval, bigint, interval)',
            'pgsemaphore.sliding_window_reserve(text, text, bigint, interval, bigint, interval)',
            'pgsemaphore.check_limits(text[], text[], text[], double precision[], double precision[], bigint[], interval[], bigint)',
            'pgsemaphore.check_limits_reserve(text[], text[], text[], double precision[], double precision[], bigint[], interval[], bigint, interval)',
            'pgsemaphore.pause_rate_limit(text, text, text, interval)',
            'pgsemaphore.rate_limit_in_force(text, text, text)',
            'pgsemaphore.open_advisory(text, integer)',
            'pgsemaphore.advisory_claim(text, integer, integer[])',
            'pgsemaphore.advisory_release(text, bigint, integer[])',
            'pgsemaphore.advisory_release_one(text, bigint, bigint)',
            'pgsemaphore.advisory_drained(text)',
            'pgsemaphore.advisory_rearm(text)',
            'pgsemaphore.advisory_log(text[], text[], integer[], integer[], jsonb[], timestamptz[], timestamptz[], text[])',
            'pgsemaphore.open_family(text, integer, interval, interval)',
            'pgsemaphore.open_family_key(text, text)',
            'pgsemaphore.record_outcomes(text[], text[], bigint[], bigint[], bigint[])']
        ELSE ARRAY[
            'pgsemaphore.schema_version()',
            'pgsemaphore.configure(text, integer, interval, boolean, boolean)',
            'pgsemaphore.force_release(bigint)',
            'pgsemaphore.clear_queue(text)',
            'pgsemaphore.reap()',
            'pgsemaphore.prune(interval, integer)',
            'pgsemaphore.prune_rate_limits(interval, text, text, text, integer)',
            'pgsemaphore.configure_advisory(text, integer)',
            'pgsemaphore.set_fair_weight(text, text, integer)',
            'pgsemaphore.set_rate_limit(text, text, text, double precision, double precision, bigint, interval)',
            'pgsemaphore.clear_rate_limit(text, text, text)',
            'pgsemaphore.resume_rate_limit(text, text, text)',
            'pgsemaphore.pause_rate_limit(text, text, text, interval)',
            'pgsemaphore.configure_family(text, integer, interval, interval, boolean)',
            'pgsemaphore.set_family_rule(text, text, text, integer)',
            'pgsemaphore.set_family_tier(text, text, text)',
            'pgsemaphore.reap_family_keys(integer)']
    END;
    EXECUTE format('GRANT USAGE ON SCHEMA pgsemaphore TO %s', p_role);
    EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA pgsemaphore TO %s', p_role);
    EXECUTE format('GRANT SELECT ON SEQUENCE pgsemaphore.advisory_epoch TO %s', p_role);
    FOREACH v_routine IN ARRAY v_routines LOOP
        EXECUTE format('GRANT EXECUTE ON ROUTINE %s TO %s', v_routine, p_role);
    END LOOP;
    INSERT INTO pgsemaphore.grantees AS g (role, part) VALUES (p_role, p_part)
        ON CONFLICT (role, part) DO UPDATE SET granted_at = now();
    RETURN cardinality(v_routines);
END;
$$;

CREATE FUNCTION pgsemaphore.regrant()
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s'
AS $$
-- Gives every role in grantees its part again, as grant_access defines it
-- now (a migration that adds routines ends by calling it), and forgets
-- the roles dropped since. Returns how many roles it granted.
-- Who and meets: as grant_access.
DECLARE
    v_count integer := 0;
    v_row   record;
BEGIN
    DELETE FROM pgsemaphore.grantees g
     WHERE NOT EXISTS (SELECT 1 FROM pg_roles r WHERE r.oid = g.role);
    FOR v_row IN SELECT g.role, g.part FROM pgsemaphore.grantees g ORDER BY g.role, g.part LOOP
        PERFORM pgsemaphore.grant_access(v_row.role::regrole, v_row.part);
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END;
$$;

-- The schema's version, and the oldest version whose code still works
-- against it: a process built for schema version v may use a database
-- whose version is >= v if compatible_from <= v. The baseline is version 1;
-- each migration file after it brings the schema to the next version and
-- redefines this function (src/migrate.rs says how).
CREATE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 1, 1 $$;

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
