-- Semaphore extensions: weighted permits, reserved capacity for critical
-- traffic.
--
--   * pgsemaphore.claim_many: n slots at once, all or nothing, inserted in
--     one statement under the semaphore's row lock (the partial unique index
--     still guarantees the hard limit for each of them); a low-priority
--     claim must leave a reserve of slots free.
--   * pgsemaphore.release_many: ends every claim of a weighted permit at once.

-- THE EXTENDED CLAIM. One call, one round trip, one transaction.
--   p_permits  slots to hold at once: all of them or none;
--   p_priority 1 high, 0 low: a low-priority claim only succeeds if at least
--              p_reserve slots stay free after it.
-- o_status: 'claimed' (o_ids/o_slots set, lowest id first), 'full' (not
-- enough free slots), 'too_many' (p_permits exceeds what the capacity and
-- reserve could ever allow).
CREATE FUNCTION pgsemaphore.claim_many(
    p_semaphore    text,
    p_holder       text,
    p_lease        interval,
    p_metadata     jsonb,
    p_permits      integer,
    p_priority     smallint,
    p_reserve      integer
)
RETURNS TABLE (
    o_status     text,
    o_ids        bigint[],
    o_slots      integer[],
    o_created_at timestamptz,
    o_expires_at timestamptz,
    o_capacity   integer,
    o_free       integer
)
LANGUAGE plpgsql
AS $$
DECLARE
    v_capacity integer;
    v_lease    interval;
    v_now      timestamptz;
    v_live     integer;
    v_expired  integer;
    v_reserve  integer := CASE WHEN p_priority = 0 THEN p_reserve ELSE 0 END;
    v_pick     integer[] := '{}';
    v_next     integer := 0;
    v_taken    integer;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pg_semaphore.claim_many needs READ COMMITTED isolation, the session uses %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;

    SELECT s.capacity, s.default_lease INTO v_capacity, v_lease
      FROM pgsemaphore.semaphores s
     WHERE s.name = p_semaphore
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_semaphore)
            USING ERRCODE = 'no_data_found';
    END IF;
    o_capacity := v_capacity;
    o_free := 0;
    IF p_permits + v_reserve > v_capacity THEN
        o_status := 'too_many';
        RETURN NEXT;
        RETURN;
    END IF;

    v_now := clock_timestamp();
    -- Live slots, split by whether their lease has expired; reap the expired.
    SELECT count(*) FILTER (WHERE l.expires_at > v_now),
           count(*) FILTER (WHERE l.expires_at <= v_now)
      INTO v_live, v_expired
      FROM pgsemaphore.slots l
     WHERE l.semaphore = p_semaphore
       AND l.completed_at IS NULL AND l.timed_out_at IS NULL;
    IF v_expired > 0 THEN
        UPDATE pgsemaphore.slots s
           SET timed_out_at = v_now
          FROM (SELECT e.id
                  FROM pgsemaphore.slots e
                 WHERE e.semaphore = p_semaphore
                   AND e.completed_at IS NULL AND e.timed_out_at IS NULL
                   AND e.expires_at <= v_now
                   FOR UPDATE SKIP LOCKED) expired
         WHERE s.id = expired.id;
    END IF;

    IF v_capacity - v_live - p_permits < v_reserve THEN
        o_status := 'full';
        o_free := greatest(v_capacity - v_live, 0);
        RETURN NEXT;
        RETURN;
    END IF;

    -- The p_permits lowest free slot numbers below capacity: walk the live
    -- slots in order (the partial index), collecting the gaps. O(live slots),
    -- whatever the audit log's length.
    FOR v_taken IN
        SELECT l.slot
          FROM pgsemaphore.slots l
         WHERE l.semaphore = p_semaphore
           AND l.completed_at IS NULL AND l.timed_out_at IS NULL
         ORDER BY l.slot
    LOOP
        WHILE v_next < v_taken AND v_next < v_capacity AND cardinality(v_pick) < p_permits LOOP
            v_pick := v_pick || v_next;
            v_next := v_next + 1;
        END LOOP;
        EXIT WHEN cardinality(v_pick) >= p_permits OR v_next >= v_capacity;
        v_next := greatest(v_next, v_taken + 1);
    END LOOP;
    WHILE v_next < v_capacity AND cardinality(v_pick) < p_permits LOOP
        v_pick := v_pick || v_next;
        v_next := v_next + 1;
    END LOOP;
    IF cardinality(v_pick) < p_permits THEN
        -- An expired slot being released right now still looks taken.
        o_status := 'full';
        o_free := cardinality(v_pick);
        RETURN NEXT;
        RETURN;
    END IF;

    -- All rows in one statement; created_at read inside it, after its
    -- snapshot (see pgsemaphore.claim).
    WITH inserted AS (
        INSERT INTO pgsemaphore.slots AS n (semaphore, slot, holder, metadata, created_at, expires_at)
        SELECT p_semaphore, u.slot, p_holder, p_metadata, t.now, t.now + coalesce(p_lease, v_lease)
          FROM (SELECT clock_timestamp() AS now) AS t,
               unnest(v_pick) WITH ORDINALITY AS u(slot, ord)
         ORDER BY u.ord
        RETURNING n.id, n.slot, n.created_at, n.expires_at
    )
    SELECT array_agg(i.id ORDER BY i.id), array_agg(i.slot ORDER BY i.id),
           min(i.created_at), min(i.expires_at)
      INTO o_ids, o_slots, o_created_at, o_expires_at
      FROM inserted i;

    o_status := 'claimed';
    o_free := v_capacity - v_live - p_permits;
    RETURN NEXT;
END;
$$;

-- Ends every claim of a weighted permit in one statement and wakes waiters.
-- 'released' when all were live; otherwise the outcome of the first that
-- was not ('timed_out', 'completed', 'missing'), as pgsemaphore.release.
CREATE FUNCTION pgsemaphore.release_many(p_ids bigint[])
RETURNS TABLE (o_outcome text, o_id bigint, o_at timestamptz)
LANGUAGE plpgsql
AS $$
DECLARE
    v_semaphore text;
    v_count     integer;
    v_id        bigint;
    v_completed timestamptz;
    v_timed_out timestamptz;
    v_now       timestamptz := clock_timestamp();
BEGIN
    -- One completed_at for all: the claims were one permit.
    WITH done AS (
        UPDATE pgsemaphore.slots s
           SET completed_at = v_now
         WHERE s.id = ANY (p_ids)
           AND s.completed_at IS NULL AND s.timed_out_at IS NULL
        RETURNING s.semaphore
    )
    SELECT min(d.semaphore), count(*) INTO v_semaphore, v_count FROM done d;
    IF v_count > 0 THEN
        PERFORM pg_notify('pgsemaphore', v_semaphore);
    END IF;
    IF v_count = cardinality(p_ids) THEN
        RETURN QUERY SELECT 'released'::text, NULL::bigint, NULL::timestamptz;
        RETURN;
    END IF;
    FOREACH v_id IN ARRAY p_ids LOOP
        SELECT s.completed_at, s.timed_out_at INTO v_completed, v_timed_out
          FROM pgsemaphore.slots s WHERE s.id = v_id;
        IF NOT FOUND THEN
            RETURN QUERY SELECT 'missing'::text, v_id, NULL::timestamptz;
            RETURN;
        ELSIF v_timed_out IS NOT NULL THEN
            RETURN QUERY SELECT 'timed_out'::text, v_id, v_timed_out;
            RETURN;
        ELSIF v_completed IS NOT NULL AND v_count = 0 THEN
            RETURN QUERY SELECT 'completed'::text, v_id, v_completed;
            RETURN;
        END IF;
    END LOOP;
    -- Some were completed by someone else while others were released now.
    RETURN QUERY SELECT 'completed'::text, p_ids[1], v_completed;
END;
$$;
