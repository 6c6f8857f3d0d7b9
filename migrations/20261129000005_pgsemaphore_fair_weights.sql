-- pg-semaphore, schema version 11: weighted fairness keys.
--
-- Version 5's fair queue serves the fairness keys of a semaphore round-robin,
-- one waiter of each key per turn. An operator may now give a key a weight:
-- a key of weight w is served up to w waiters per turn of the rotation
-- (a paying tenant 3 grants for every 1 of a free one), set at run time per
-- semaphore and key, never by the application. The rule, kept by
-- pgsemaphore.enqueue (pgsemaphore.claim is unchanged: it still serves a
-- FIFO queue in (priority, turn, id) order):
--   * a new waiter's turn is the smallest turn queued at its priority (0 if
--     none) if its key has no waiter queued at that priority; else its key's
--     largest turn L if fewer than w of the key's waiters are queued at L,
--     else L + 1 (w = the key's weight, 1 when none is set: exactly version
--     5's rule);
--   * so each turn holds at most w waiters of a key of weight w, and a key
--     with nobody queued waits behind at most w_k waiters of each other key
--     k (those at the smallest turn, if they arrived earlier);
--   * a weight change applies to waiters queued after it; the turns of
--     waiters already queued never change (no one queued moves back).
-- What changes for a caller:
--   * new table pgsemaphore.fair_weights (semaphore, fair_key, weight
--     1..1000); a row whose semaphore is deleted goes with it;
--   * new operator function set_fair_weight(p_semaphore, p_fair_key,
--     p_weight): sets the weight of a key (NULL: the shared default key),
--     or removes it (p_weight 1, the default, or NULL); granted to every
--     role that may run configure (copied below), never to the application;
--   * pgsemaphore.enqueue reads the weight of the waiter's key (one more
--     index probe while it holds the semaphore's row); its signature,
--     result and grants are unchanged;
--   * schema_version() returns (11, 2): code built for versions 2 to 10
--     works against it unchanged.

CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 11, 2 $$;

-- ---------------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------------

-- The weight of a fairness key in a semaphore's fair queue: how many of its
-- waiters one turn of the rotation serves. A key without a row has weight
-- 1. fair_key '' stands for the shared default key (NULL), so that the
-- primary key covers it ('' is never a fairness key: they are 1 to 200
-- characters).
CREATE TABLE pgsemaphore.fair_weights (
    semaphore  text        NOT NULL REFERENCES pgsemaphore.semaphores (name) ON DELETE CASCADE,
    fair_key   text        NOT NULL,
    weight     integer     NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (semaphore, fair_key),
    CONSTRAINT fair_weights_fair_key_length CHECK (char_length(fair_key) BETWEEN 0 AND 200),
    CONSTRAINT fair_weights_weight_range CHECK (weight BETWEEN 2 AND 1000)
);

-- ---------------------------------------------------------------------------
-- Application functions
-- ---------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION pgsemaphore.enqueue(
    p_semaphore    text,
    p_permits      integer,
    p_priority     smallint,
    p_holder       text,
    p_limit        integer,
    p_waiter_lease interval,
    p_token        bytea,
    p_fair_key     text DEFAULT NULL
)
RETURNS TABLE (o_ticket bigint, o_wake boolean, o_turn bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- Joins the queue: returns the waiter's id (its ticket) and its turn (its
-- place: see below), or NULLs when p_limit live waiters are queued
-- already, and whether it removed dead waiters (the caller then runs
-- pgsemaphore.wake after this commits).
--   p_semaphore an existing semaphore (else P0002); p_permits 1..100000;
--   p_priority 0 or 1; p_holder 1..1000 characters; p_limit NULL (no limit)
--   or 0..2147483647; p_waiter_lease 1 s..60 s (the row is ignored, and
--   deleted by the next claim, enqueue or reap, unless renewed within it:
--   pgsemaphore.keep_waiting, or a claim with the ticket); p_token 16..64
--   bytes (only its holder may claim with, renew or leave the ticket);
--   p_fair_key NULL (the shared default key) or 1..200 characters: the
--   waiter's fairness key (a tenant, say)
-- Every bad argument raises SQLSTATE 22023 naming it in COLUMN.
-- Serialised with claims on the semaphore's row (waited for at most
-- lock_timeout, 2 s, then 55P03), so the limit is exact. A waiter row is a
-- hint, not a claim: its commit does not wait for a WAL flush (a crash loses
-- at most a place in the queue, which the waiter notices as 'no_ticket' and
-- takes again).
--
-- Invariant (the fairness rule): with w the weight of the new waiter's key
-- (pgsemaphore.fair_weights, 1 if none), its turn is the smallest turn
-- queued at its priority (0 if none: the head's turn in a FIFO queue) when
-- its key has no waiter queued at that priority; else its key's largest
-- turn L when fewer than w of the key's waiters are queued at L; else
-- L + 1. A turn never changes, and a FIFO queue serves (priority, turn, id)
-- in ascending order (pgsemaphore.claim, step 3). So: a new waiter never
-- goes ahead of the head of its priority (its turn is at least the head's,
-- its id larger); a key's waiters keep their arrival order (their turns
-- never descend, and ids break ties); each turn holds at most w waiters of
-- a key of weight w; and a key with nobody queued waits behind at most w_k
-- waiters of each other key k (those at the smallest turn): with waiters
-- of one other key of weight 1 queued, it is served within the next two
-- grants. Without fairness keys and weights, turns ascend with ids:
-- arrival order.
-- Meets: claims and other enqueues (serialised on the semaphore row, FOR NO
-- KEY UPDATE: each reads the queue as every earlier one committed it, so
-- no turn gets more than w waiters of one key, and a head claiming
-- meanwhile either claims first, and has left the queue when this reads
-- the turns, or claims after this waiter queued behind it); clear_queue
-- (the same row); set_fair_weight (the same row, FOR NO KEY UPDATE: a
-- weight change and an enqueue are ordered, and this waiter's turn uses
-- the weight committed before it);
-- keep_waiting (row locks on waiter rows: deleting an expired row it
-- renews waits for it and keeps the row if renewed); leave_queue and the
-- reaper (they delete waiters without the semaphore's row: a turn read
-- while one is uncommitted counts the leaving waiter, as if this waiter
-- had queued just before it left).
DECLARE
    v_now     timestamptz;
    v_count   integer;
    v_dropped integer;
    v_floor   bigint;
    v_last    bigint;
    v_at_last integer;
    v_weight  integer;
BEGIN
    -- The turn is computed from the queue as committed before the
    -- semaphore's row lock was granted: READ COMMITTED only (an older
    -- snapshot could miss a waiter queued meanwhile).
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pg_semaphore.enqueue needs READ COMMITTED isolation, the session uses %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    PERFORM pgsemaphore.checked_text(p_semaphore, 'p_semaphore', 200);
    IF p_permits IS NULL OR p_permits NOT BETWEEN 1 AND 100000 THEN
        PERFORM pgsemaphore.refuse('p_permits', format('1 to 100000, got %s', coalesce(p_permits::text, 'NULL')));
    END IF;
    IF p_priority IS NULL OR p_priority NOT IN (0, 1) THEN
        PERFORM pgsemaphore.refuse('p_priority', format('0 (low) or 1 (high), got %s', coalesce(p_priority::text, 'NULL')));
    END IF;
    PERFORM pgsemaphore.checked_text(p_holder, 'p_holder', 1000);
    IF p_limit < 0 THEN
        PERFORM pgsemaphore.refuse('p_limit', format('NULL or at least 0, got %s', p_limit));
    END IF;
    PERFORM pgsemaphore.checked_interval(p_waiter_lease, 'p_waiter_lease', interval '1 s', interval '60 s');
    PERFORM pgsemaphore.checked_token(p_token);
    IF char_length(p_fair_key) NOT BETWEEN 1 AND 200 THEN
        PERFORM pgsemaphore.refuse('p_fair_key',
            format('NULL (the shared default key) or 1 to 200 characters, got %s characters',
                   char_length(p_fair_key)));
    END IF;
    PERFORM pgsemaphore.fast_commit();
    -- 1. The semaphore's row: serialises this with claims, other enqueues
    -- and weight changes.
    PERFORM 1 FROM pgsemaphore.semaphores s WHERE s.name = p_semaphore FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_semaphore)
            USING ERRCODE = 'no_data_found';
    END IF;
    -- 2. Dead waiters go; the queue limit.
    v_now := clock_timestamp();
    DELETE FROM pgsemaphore.waiters w
     WHERE w.semaphore = p_semaphore AND w.expires_at <= v_now;
    GET DIAGNOSTICS v_dropped = ROW_COUNT;
    o_wake := v_dropped > 0;
    IF p_limit IS NOT NULL THEN
        SELECT count(*) INTO v_count FROM pgsemaphore.waiters w WHERE w.semaphore = p_semaphore;
        IF v_count >= p_limit THEN
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    -- 3. The turn (the fairness rule above). Each statement one probe of an
    -- index: the smallest turn queued at this priority (waiters_queue_idx);
    -- this key's largest turn and how many of its waiters are queued there
    -- (waiters_fair_key_idx; one branch per kind of key, so that each is a
    -- plain index condition); the key's weight (fair_weights' key).
    SELECT w.turn INTO v_floor
      FROM pgsemaphore.waiters w
     WHERE w.semaphore = p_semaphore AND w.priority = p_priority
     ORDER BY w.turn
     LIMIT 1;
    IF p_fair_key IS NULL THEN
        SELECT w.turn, count(*) INTO v_last, v_at_last
          FROM pgsemaphore.waiters w
         WHERE w.semaphore = p_semaphore AND w.priority = p_priority AND w.fair_key IS NULL
         GROUP BY w.turn
         ORDER BY w.turn DESC
         LIMIT 1;
    ELSE
        SELECT w.turn, count(*) INTO v_last, v_at_last
          FROM pgsemaphore.waiters w
         WHERE w.semaphore = p_semaphore AND w.priority = p_priority AND w.fair_key = p_fair_key
         GROUP BY w.turn
         ORDER BY w.turn DESC
         LIMIT 1;
    END IF;
    IF v_last IS NULL THEN
        o_turn := coalesce(v_floor, 0);
    ELSE
        SELECT f.weight INTO v_weight
          FROM pgsemaphore.fair_weights f
         WHERE f.semaphore = p_semaphore AND f.fair_key = coalesce(p_fair_key, '');
        o_turn := CASE WHEN v_at_last < coalesce(v_weight, 1) THEN v_last ELSE v_last + 1 END;
        -- (v_last >= v_floor: the floor is the smallest turn of every key.)
        o_turn := greatest(o_turn, coalesce(v_floor, 0));
    END IF;
    -- 4. The waiter.
    INSERT INTO pgsemaphore.waiters
           (semaphore, permits, priority, holder, enqueued_at, expires_at, token_hash, fair_key, turn)
    VALUES (p_semaphore, p_permits, p_priority, p_holder, v_now, v_now + p_waiter_lease,
            sha256(p_token), p_fair_key, o_turn)
    RETURNING id INTO o_ticket;
    UPDATE pgsemaphore.semaphores s SET queue_used = true WHERE s.name = p_semaphore AND NOT s.queue_used;
    RETURN NEXT;
END;
$$;

-- ---------------------------------------------------------------------------
-- Operator functions
-- ---------------------------------------------------------------------------

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

-- Whoever may run configure (the operator, granted as the README says) may
-- set weights: an upgrade asks for no new grants.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS grantee, a.is_grantable
          FROM pg_proc p
         CROSS JOIN LATERAL aclexplode(p.proacl) a
         WHERE p.oid = 'pgsemaphore.configure(text, integer, interval, boolean, boolean)'::regprocedure
           AND a.privilege_type = 'EXECUTE'
           AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgsemaphore.set_fair_weight(text, text, integer) TO %s%s',
                       r.grantee, CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END;
$$;

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
