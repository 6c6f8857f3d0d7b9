-- pg-semaphore, schema version 8: several limits claimed at once.
--
-- "At most 100 calls to the payment API in total and at most 5 per
-- merchant": a caller needs a permit of two semaphores (or more) together.
-- Claiming them one after the other holds the first while it waits for the
-- second (everyone else waiting on the first starves meanwhile), and two
-- callers that name them in opposite orders can each hold what the other
-- waits for. pgsemaphore.claim_all claims permits of up to 16 semaphores in
-- one call and one transaction, all or nothing, locking their rows in one
-- canonical order (by name, byte order), so callers never deadlock whatever
-- order they name them in; refused, it holds nothing (its waiting is the
-- caller's, with nothing held: poll and wake-ups of any of them).
-- What this migration adds, and nothing else changes:
--   * pgsemaphore.slots (and the view live_slots) gains group_id: NULL for
--     a claim made by pgsemaphore.claim, and for every claim made by one
--     claim_all call the id of the first of them (the lowest), so the
--     audit log links them;
--   * application function claim_all(p_semaphores, p_holder, p_lease,
--     p_metadata, p_token, p_permits): for each semaphore, in canonical
--     order, exactly pgsemaphore.claim (same checks, same count of held
--     slots, same refusal while waiters are queued), inside one
--     subtransaction that is rolled back if any of them refuses;
--   * application function release_all(p_ids, p_token, p_lost): release
--     for the claims of one permit spanning several semaphores (release
--     refuses ids of two semaphores), and procedure release_all_then_wake,
--     its one-round-trip form as release_then_wake is release's;
--   * claim_all and release_all are granted to every role that may run
--     claim, release_all_then_wake to every role that may run
--     release_then_wake (copied below), so an upgrade asks for no new grants;
--   * schema_version() returns (8, 2): code built for versions 2 to 7 works
--     against it unchanged (a column with a NULL default, new functions).

CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 8, 2 $$;

-- ---------------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------------

-- group_id: the claims one pgsemaphore.claim_all call made together share
-- it: the id of the first (lowest) of them. NULL for a claim of
-- pgsemaphore.claim. Not indexed: the audit log reads it with the rows it
-- lists; a permit's claims are found by their ids.
ALTER TABLE pgsemaphore.slots ADD COLUMN group_id bigint;

-- The live claims show it too (the view's columns were fixed when it was
-- created; CREATE OR REPLACE appends the new one and keeps every grant).
CREATE OR REPLACE VIEW pgsemaphore.live_slots AS
    SELECT s.*
      FROM pgsemaphore.slots s
     WHERE s.completed_at IS NULL AND s.timed_out_at IS NULL;

-- ---------------------------------------------------------------------------
-- Application functions
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.claim_all(
    p_semaphores text[],
    p_holder     text,
    p_lease      interval,
    p_metadata   jsonb,
    p_token      bytea,
    p_permits    integer[] DEFAULT NULL
)
RETURNS TABLE (
    o_status     text,
    o_semaphore  text,
    o_ids        bigint[],
    o_semaphores text[],
    o_slots      integer[],
    o_created_at timestamptz,
    o_expires_at timestamptz,
    o_capacity   integer,
    o_free       integer,
    o_retry_in   interval,
    o_wake       text[]
)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- THE MULTI-LIMIT CLAIM. Permits of several semaphores (or family keys,
-- which are semaphores too) in one call, one transaction: all or nothing.
--   p_semaphores 1..16 distinct names of existing semaphores, no NULLs (a
--                name twice: 22023, merge its permits instead); any order
--   p_holder, p_metadata, p_token: as pgsemaphore.claim; every claim made
--                carries them (one token for all: one release, one renewal)
--   p_lease      10 ms..366 days, or NULL for the SHORTEST default lease of
--                the named semaphores: every claim gets the same lease
--   p_permits    NULL (one permit of each), or one count per semaphore, in
--                the order of p_semaphores, each 1..100000, no NULLs
-- Every bad argument raises SQLSTATE 22023 naming it in COLUMN; an unknown
-- semaphore P0002; a semaphore's row held past lock_timeout (2 s) 55P03.
-- Nothing is claimed then.
--
-- Returns one row. o_status, as pgsemaphore.claim's (no ticket, so never
-- 'no_ticket'):
--   'claimed'  o_ids/o_semaphores/o_slots list every claim (the semaphores
--              in canonical order, each one's ids ascending: o_ids
--              ascends), o_created_at/o_expires_at the earliest, o_wake
--              the semaphores whose waiters may claim now (run
--              pgsemaphore.wake for each after this transaction commits);
--              o_semaphore, o_capacity, o_free, o_retry_in NULL
--   'full', 'behind', 'too_many': the first semaphore (in canonical order)
--              that refused, in o_semaphore, with its o_capacity, o_free
--              and o_retry_in as claim returned them; nothing is claimed
--              and nothing is held (o_ids NULL, o_wake empty)
-- Claims are high priority (no reserve applies) and outside the fair
-- queue: a semaphore with a live high-priority waiter queued refuses them
-- ('behind'), as it refuses any claim without a ticket.
--
-- Invariant: for each semaphore, the claim made is exactly one
-- pgsemaphore.claim (its invariant: admitted only while held + permits <=
-- capacity, held counting every live row the claim did not reap, under the
-- semaphore's row lock), and those claims commit together or not at all:
-- every claim runs in one subtransaction, rolled back as a whole at the
-- first refusal, which also releases the row locks it took. The rows are
-- locked in ascending byte order of their names (COLLATE "C", the same in
-- every session), each held until this transaction ends; every other
-- function locks at most one semaphore row, and another claim_all locks in
-- the same order, so no cycle of waits can form between them.
-- Meets: everything pgsemaphore.claim meets, per semaphore (other claims,
-- releases, renewals and fences in flight, the reaper, configure,
-- enqueue/keep_waiting/clear_queue, release_by_token of this token); other
-- claim_all calls (the canonical order above: one waits for the other's
-- commit on the first row they share, never the reverse); a plain claim
-- holding one of the rows (it locks no other: it commits, we go on); a
-- hostile caller holding one of the rows in an open transaction (we wait
-- lock_timeout, 2 s, then 55P03 and nothing claimed; the rows we locked
-- before it are held meanwhile, so their claims wait too, each at most its
-- own lock_timeout); a hostile caller holding one row in an open
-- transaction and then asking, in it, for a row we hold: a deadlock only
-- that caller's transactions can close, which PostgreSQL's detector
-- breaks (40P01 to one of the two; nothing half-claimed either way).
DECLARE
    v_count    integer;
    v_names    text[];
    v_permits  integer[];
    v_lease    interval;
    v_claim    record;
    v_refusal  record;
    i          integer;
BEGIN
    -- 0. The arrays, hostile-proof; claim checks the rest (same names).
    IF p_semaphores IS NULL OR array_ndims(p_semaphores) IS DISTINCT FROM 1
       OR cardinality(p_semaphores) NOT BETWEEN 1 AND 16
       OR array_position(p_semaphores, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.refuse('p_semaphores',
            '1 to 16 semaphore names, in a one-dimensional array without NULLs');
    END IF;
    v_count := cardinality(p_semaphores);
    IF EXISTS (SELECT 1 FROM unnest(p_semaphores) AS u(name)
                WHERE char_length(u.name) NOT BETWEEN 1 AND 200) THEN
        PERFORM pgsemaphore.refuse('p_semaphores', 'each name 1 to 200 characters');
    END IF;
    IF (SELECT count(DISTINCT u.name) FROM unnest(p_semaphores) AS u(name)) <> v_count THEN
        PERFORM pgsemaphore.refuse('p_semaphores',
            'a semaphore named twice: name it once, with the sum of its permits');
    END IF;
    IF p_permits IS NOT NULL AND (array_ndims(p_permits) IS DISTINCT FROM 1
       OR cardinality(p_permits) <> v_count
       OR array_position(p_permits, NULL) IS NOT NULL) THEN
        PERFORM pgsemaphore.refuse('p_permits',
            format('NULL, or %s counts (one per semaphore) without NULLs', v_count));
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_permits) AS u(n) WHERE u.n NOT BETWEEN 1 AND 100000) THEN
        PERFORM pgsemaphore.refuse('p_permits', 'each count 1 to 100000');
    END IF;
    IF p_lease IS NOT NULL AND (p_lease < interval '10 ms' OR p_lease > interval '366 days') THEN
        PERFORM pgsemaphore.checked_interval(p_lease, 'p_lease', interval '10 ms', interval '366 days');
    END IF;

    -- 1. The canonical order, and one lease for every claim.
    SELECT array_agg(u.name ORDER BY u.name COLLATE "C"),
           array_agg(coalesce(p_permits[u.n::integer], 1) ORDER BY u.name COLLATE "C")
      INTO v_names, v_permits
      FROM unnest(p_semaphores) WITH ORDINALITY AS u(name, n);
    v_lease := coalesce(p_lease,
                        (SELECT min(s.default_lease) FROM pgsemaphore.semaphores s
                          WHERE s.name = ANY (v_names)));
    o_wake := '{}';

    -- 2. Claim each, in that order, all in one subtransaction: the first
    -- refusal rolls back every claim before it, and their row locks.
    BEGIN
        FOR i IN 1 .. v_count LOOP
            SELECT c.o_status, c.o_ids, c.o_slots, c.o_created_at, c.o_expires_at,
                   c.o_capacity, c.o_free, c.o_retry_in, c.o_wake
              INTO v_claim
              FROM pgsemaphore.claim(p_semaphore => v_names[i], p_holder => p_holder,
                                     p_lease => v_lease, p_metadata => p_metadata,
                                     p_token => p_token, p_permits => v_permits[i]) c;
            IF v_claim.o_status <> 'claimed' THEN
                v_refusal := v_claim;
                o_semaphore := v_names[i];
                RAISE EXCEPTION 'claim_all refused by %', quote_literal(v_names[i])
                    USING ERRCODE = 'PGSA1';
            END IF;
            o_ids := o_ids || v_claim.o_ids;
            o_slots := o_slots || v_claim.o_slots;
            o_semaphores := o_semaphores || array_fill(v_names[i], ARRAY[cardinality(v_claim.o_ids)]);
            o_created_at := least(o_created_at, v_claim.o_created_at);
            o_expires_at := least(o_expires_at, v_claim.o_expires_at);
            IF v_claim.o_wake THEN
                o_wake := o_wake || v_names[i];
            END IF;
        END LOOP;
        -- 3. Link the claims in the audit log: the first id names the group.
        UPDATE pgsemaphore.slots s SET group_id = o_ids[1] WHERE s.id = ANY (o_ids);
        o_status := 'claimed';
    EXCEPTION WHEN SQLSTATE 'PGSA1' THEN
        o_status := v_refusal.o_status;
        o_capacity := v_refusal.o_capacity;
        o_free := v_refusal.o_free;
        o_retry_in := v_refusal.o_retry_in;
        o_ids := NULL;
        o_slots := NULL;
        o_semaphores := NULL;
        o_created_at := NULL;
        o_expires_at := NULL;
        o_wake := '{}';
    END;
    RETURN NEXT;
END;
$$;

CREATE FUNCTION pgsemaphore.release_all(p_ids bigint[], p_token bytea, p_lost boolean DEFAULT false)
RETURNS TABLE (o_outcome text, o_id bigint, o_at timestamptz, o_wake text[])
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Ends the claims p_ids of one permit that carry p_token, whatever
-- semaphores they belong to (a permit of pgsemaphore.claim_all): for each
-- semaphore, exactly pgsemaphore.release of its claims among p_ids.
--   p_ids 1..100000 ids, no NULLs; p_token 16..64 bytes; p_lost as release
-- Returns one row: o_outcome 'released' (o_at when) if every id was the
-- caller's live claim with its lease running; otherwise the outcome of the
-- first id (by id) that was not, as release reports it ('not_holder',
-- 'timed_out', 'completed', 'missing'; every live claim of the caller's
-- among p_ids is still ended). o_wake: the semaphores to run
-- pgsemaphore.wake for after this transaction commits (the wake-up gate
-- of each said a waiter may be registered).
-- Meets: what release meets, for each semaphore. The caller's claims are
-- locked first, all of them, in id order (the order renew and fence lock
-- in, so no deadlock with the permit's own heartbeat); release then finds
-- them locked by this transaction already. Rows of others are never
-- locked. Durable.
DECLARE
    v_hash   bytea;
    v_rest   bigint[];
    v_one    record;
    r        record;
BEGIN
    IF p_ids IS NULL OR array_ndims(p_ids) IS DISTINCT FROM 1
       OR cardinality(p_ids) NOT BETWEEN 1 AND 100000 OR array_position(p_ids, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.checked_ids(p_ids);
    END IF;
    PERFORM pgsemaphore.checked_token(p_token);
    IF p_lost IS NULL THEN
        PERFORM pgsemaphore.refuse('p_lost', 'true or false, got NULL');
    END IF;
    v_hash := sha256(p_token);
    o_wake := '{}';
    v_rest := p_ids;
    -- 1. Lock the caller's claims among p_ids, in id order; then release
    -- them semaphore by semaphore.
    FOR r IN
        SELECT m.semaphore, array_agg(m.id ORDER BY m.id) AS ids
          FROM (SELECT s.id, s.semaphore
                  FROM pgsemaphore.slots s
                 WHERE s.id = ANY (p_ids) AND s.token_hash = v_hash
                 ORDER BY s.id
                   FOR UPDATE) m
         GROUP BY m.semaphore
         ORDER BY m.semaphore COLLATE "C"
    LOOP
        SELECT x.o_outcome, x.o_id, x.o_at, x.o_wake INTO v_one
          FROM pgsemaphore.release(p_ids => r.ids, p_token => p_token, p_lost => p_lost) x;
        v_rest := array(SELECT u.id FROM unnest(v_rest) AS u(id) WHERE u.id <> ALL (r.ids));
        IF v_one.o_wake THEN
            o_wake := o_wake || r.semaphore;
        END IF;
        IF v_one.o_outcome = 'released' THEN
            o_at := coalesce(o_at, v_one.o_at);
        ELSIF o_id IS NULL OR v_one.o_id < o_id THEN
            o_outcome := v_one.o_outcome;
            o_id := v_one.o_id;
            o_at := v_one.o_at;
        END IF;
    END LOOP;
    -- 2. Ids that are not the caller's (another's, or none): release says
    -- which, locking nothing of them.
    IF cardinality(v_rest) > 0 THEN
        SELECT x.o_outcome, x.o_id, x.o_at INTO v_one
          FROM pgsemaphore.release(p_ids => v_rest, p_token => p_token, p_lost => p_lost) x;
        IF v_one.o_outcome <> 'released' AND (o_id IS NULL OR v_one.o_id < o_id) THEN
            o_outcome := v_one.o_outcome;
            o_id := v_one.o_id;
            o_at := v_one.o_at;
        END IF;
    END IF;
    IF o_id IS NULL THEN
        o_outcome := 'released';
    END IF;
    RETURN NEXT;
END;
$$;

CREATE PROCEDURE pgsemaphore.release_all_then_wake(
    p_ids bigint[], p_token bytea, p_lost boolean,
    INOUT o_outcome text DEFAULT NULL, INOUT o_id bigint DEFAULT NULL,
    INOUT o_at timestamptz DEFAULT NULL)
LANGUAGE plpgsql
AS $$
-- The release of a permit of several semaphores as the crate sends it, one
-- statement: pgsemaphore.release_all, then, only if it says waiters may be
-- registered, COMMIT (durable) and pgsemaphore.wake of each such semaphore
-- in a transaction of its own. As pgsemaphore.release_then_wake (why a
-- procedure, with the caller's rights: see there). Arguments and outcomes:
-- pgsemaphore.release_all.
-- Meets: what release_all and notify_if_waited meet.
DECLARE
    v_wake      text[];
    v_semaphore text;
BEGIN
    SELECT r.o_outcome, r.o_id, r.o_at, r.o_wake
      INTO o_outcome, o_id, o_at, v_wake
      FROM pgsemaphore.release_all(p_ids => p_ids, p_token => p_token, p_lost => p_lost) r;
    IF cardinality(v_wake) > 0 THEN
        COMMIT;
        FOREACH v_semaphore IN ARRAY v_wake LOOP
            PERFORM pgsemaphore.wake(p_semaphore => v_semaphore);
        END LOOP;
    END IF;
END;
$$;

-- ---------------------------------------------------------------------------
-- Privileges: nobody but the owner runs anything until granted; whoever may
-- claim may claim several at once and release them, whoever may run
-- release_then_wake may run release_all_then_wake, so an upgrade asks for
-- no new grants.
-- ---------------------------------------------------------------------------

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS grantee, a.is_grantable
          FROM pg_proc p
         CROSS JOIN LATERAL aclexplode(p.proacl) a
         WHERE p.oid = 'pgsemaphore.claim(text, text, interval, jsonb, bytea, integer, smallint, integer, bigint, bytea, interval)'::regprocedure
           AND a.privilege_type = 'EXECUTE'
           AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION '
                       'pgsemaphore.claim_all(text[], text, interval, jsonb, bytea, integer[]), '
                       'pgsemaphore.release_all(bigint[], bytea, boolean) '
                       'TO %s%s',
                       r.grantee, CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    FOR r IN
        SELECT a.grantee::regrole AS grantee, a.is_grantable
          FROM pg_proc p
         CROSS JOIN LATERAL aclexplode(p.proacl) a
         WHERE p.oid = 'pgsemaphore.release_then_wake(bigint[], bytea, boolean, text, bigint, timestamptz)'::regprocedure
           AND a.privilege_type = 'EXECUTE'
           AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON PROCEDURE '
                       'pgsemaphore.release_all_then_wake(bigint[], bytea, boolean, text, bigint, timestamptz) '
                       'TO %s%s',
                       r.grantee, CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END;
$$;
