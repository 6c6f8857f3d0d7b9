-- pg-semaphore: lease renewal (heartbeat), and durable claims.
--
-- A holder renews its claims' leases before they end. Renewal uses the
-- database clock, like the claim, so client clocks never matter. A claim whose
-- lease has already ended is not revived: it is reaped on the spot (any claim
-- or reaper could have done so already) and reported as timed out, so the
-- holder stops work instead of carrying on beside a new holder.

-- A claim or a renewal that a client was told about must survive a database
-- crash: if a crash lost it, the slot would look free while its holder works,
-- and a second holder would be admitted. Under `synchronous_commit = off`
-- (a common throughput setting) a commit is acknowledged before its WAL is
-- flushed, and an immediate shutdown or crash loses it (the torture test saw
-- exactly that). So claims and renewals upgrade `off` to `on` for their own
-- transaction; any stricter setting is left as it is.
CREATE FUNCTION pgsemaphore.durable_commit()
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF current_setting('synchronous_commit') = 'off' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END;
$$;

-- THE CLAIM, as in the first migration, now with a durable commit.
CREATE OR REPLACE FUNCTION pgsemaphore.claim(p_semaphore text, p_holder text, p_lease interval, p_metadata jsonb)
RETURNS TABLE (
    o_id         bigint,
    o_slot       integer,
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
    v_reaped   integer;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pg_semaphore.claim needs READ COMMITTED isolation, the session uses %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    PERFORM pgsemaphore.durable_commit();

    -- Fail fast without queueing behind other claims: if, as of this
    -- snapshot, every slot is held by an unexpired claim, the semaphore was
    -- full at that instant and the answer is no. (Claims in flight would only
    -- make it fuller; expired slots are left to the locked path, which reaps.)
    v_now := clock_timestamp();
    SELECT s.capacity,
           (SELECT count(*)
              FROM pgsemaphore.slots l
             WHERE l.semaphore = s.name
               AND l.completed_at IS NULL AND l.timed_out_at IS NULL
               AND l.expires_at > v_now)
      INTO v_capacity, v_live
      FROM pgsemaphore.semaphores s
     WHERE s.name = p_semaphore;
    IF FOUND AND v_live >= v_capacity THEN
        RETURN QUERY SELECT NULL::bigint, NULL::integer, NULL::timestamptz, NULL::timestamptz,
                            v_capacity, 0;
        RETURN;
    END IF;

    SELECT s.capacity, s.default_lease INTO v_capacity, v_lease
      FROM pgsemaphore.semaphores s
     WHERE s.name = p_semaphore
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_semaphore)
            USING ERRCODE = 'no_data_found';
    END IF;

    -- Live slots, split by whether their lease has expired (clock read after the lock).
    v_now := clock_timestamp();
    SELECT count(*) FILTER (WHERE l.expires_at > v_now),
           count(*) FILTER (WHERE l.expires_at <= v_now)
      INTO v_live, v_expired
      FROM pgsemaphore.slots l
     WHERE l.semaphore = p_semaphore
       AND l.completed_at IS NULL AND l.timed_out_at IS NULL;

    IF v_expired > 0 THEN
        -- SKIP LOCKED: a row being released or reaped right now is about to be
        -- freed anyway, and waiting on it could deadlock with the global reaper.
        UPDATE pgsemaphore.slots s
           SET timed_out_at = v_now
          FROM (SELECT e.id
                  FROM pgsemaphore.slots e
                 WHERE e.semaphore = p_semaphore
                   AND e.completed_at IS NULL AND e.timed_out_at IS NULL
                   AND e.expires_at <= v_now
                   FOR UPDATE SKIP LOCKED) expired
         WHERE s.id = expired.id;
        GET DIAGNOSTICS v_reaped = ROW_COUNT;
        IF v_reaped > 1 THEN
            -- We take at most one of the freed slots; tell other waiters.
            PERFORM pg_notify('pgsemaphore', p_semaphore);
        END IF;
    END IF;

    o_capacity := v_capacity;
    o_free := 0;
    IF v_live < v_capacity THEN
        -- The lowest free slot is 0 if 0 is free, else one past a live slot
        -- whose successor is free. Capped below capacity: an expired slot
        -- skipped above (being released right now) still looks taken.
        -- created_at is read *inside* this statement, after its snapshot was
        -- taken: every release this claim relies on committed before that, so
        -- its completed_at is earlier than our created_at and the audit log
        -- never shows two claims overlapping on one slot.
        INSERT INTO pgsemaphore.slots AS n (semaphore, slot, holder, metadata, created_at, expires_at)
        SELECT p_semaphore, free.slot, p_holder, p_metadata, t.now, t.now + coalesce(p_lease, v_lease)
          FROM (SELECT clock_timestamp() AS now) AS t,
               (SELECT min(c.slot) AS slot
                  FROM (SELECT 0 AS slot
                         WHERE NOT EXISTS (
                                   SELECT 1 FROM pgsemaphore.slots z
                                    WHERE z.semaphore = p_semaphore AND z.slot = 0
                                      AND z.completed_at IS NULL AND z.timed_out_at IS NULL)
                        UNION ALL
                        SELECT l.slot + 1
                          FROM pgsemaphore.slots l
                         WHERE l.semaphore = p_semaphore
                           AND l.completed_at IS NULL AND l.timed_out_at IS NULL
                           AND NOT EXISTS (
                                   SELECT 1 FROM pgsemaphore.slots m
                                    WHERE m.semaphore = p_semaphore AND m.slot = l.slot + 1
                                      AND m.completed_at IS NULL AND m.timed_out_at IS NULL)
                       ) c
                 WHERE c.slot < v_capacity) AS free
         WHERE free.slot IS NOT NULL
        RETURNING n.id, n.slot, n.created_at, n.expires_at
             INTO o_id, o_slot, o_created_at, o_expires_at;
        IF FOUND THEN
            o_free := v_capacity - v_live - 1;
        END IF;
    END IF;
    RETURN NEXT;
END;
$$;

-- Renews every given claim to end `p_lease` from now. One row per id:
--   'renewed'   the claim was live and unexpired; o_at = its new expires_at;
--   'timed_out' it was reaped (now, or earlier); o_at = timed_out_at;
--   'completed' it had been released; o_at = completed_at;
--   'missing'   no such claim (its audit row was deleted).
CREATE FUNCTION pgsemaphore.renew(p_ids bigint[], p_lease interval)
RETURNS TABLE (o_id bigint, o_outcome text, o_at timestamptz)
LANGUAGE plpgsql
AS $$
DECLARE
    v_semaphore text;
BEGIN
    IF p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'pg_semaphore.renew needs a positive lease, got %', p_lease
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pgsemaphore.durable_commit();

    -- Unexpired live claims: extend (row locks serialise with release and reap).
    RETURN QUERY
        UPDATE pgsemaphore.slots s
           SET expires_at = clock_timestamp() + p_lease
         WHERE s.id = ANY (p_ids)
           AND s.completed_at IS NULL AND s.timed_out_at IS NULL
           AND s.expires_at > clock_timestamp()
        RETURNING s.id, 'renewed'::text, s.expires_at;

    -- Live claims whose lease already ended: reap them now and wake waiters.
    FOR v_semaphore IN
        UPDATE pgsemaphore.slots s
           SET timed_out_at = clock_timestamp()
         WHERE s.id = ANY (p_ids)
           AND s.completed_at IS NULL AND s.timed_out_at IS NULL
           AND s.expires_at <= clock_timestamp()
        RETURNING s.semaphore
    LOOP
        PERFORM pg_notify('pgsemaphore', v_semaphore);
    END LOOP;

    -- Everything not renewed above, as it now stands.
    RETURN QUERY
        SELECT i.id,
               CASE WHEN s.id IS NULL THEN 'missing'
                    WHEN s.timed_out_at IS NOT NULL THEN 'timed_out'
                    ELSE 'completed' END,
               coalesce(s.timed_out_at, s.completed_at)
          FROM unnest(p_ids) AS i(id)
          LEFT JOIN pgsemaphore.slots s ON s.id = i.id
         WHERE s.id IS NULL OR s.completed_at IS NOT NULL OR s.timed_out_at IS NOT NULL;
END;
$$;
