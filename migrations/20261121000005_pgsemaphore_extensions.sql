-- Semaphore extensions: weighted permits, reserved capacity for critical
-- traffic, a fair queue of waiters shared by every process.
--
--   * pgsemaphore.waiters: the queue. A row per queued acquire, in arrival
--     order (id). Its lease (expires_at) is renewed by the waiting process;
--     a waiter whose process crashed stops being renewed and is ignored, then
--     deleted, once its lease has ended. A cancelled waiter deletes its row.
--   * pgsemaphore.claim_many: the claim for everything the fast
--     pgsemaphore.claim does not do: n slots at once (all or nothing), a
--     reserve that low-priority claims must leave free, and the queue (only
--     the waiter at the head may claim).
--   * pgsemaphore.release_many: ends every claim of a weighted permit at once.
--   * pgsemaphore.claim is replaced by the same function plus one check: it
--     refuses while waiters are queued, so no claim jumps the queue. The
--     check costs one column read for semaphores whose queue was never used
--     (semaphores.queue_used), one index probe for the others.

CREATE TABLE pgsemaphore.waiters (
    -- Arrival order: FIFO serves the smallest id first, LIFO the largest.
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    semaphore   text        NOT NULL REFERENCES pgsemaphore.semaphores (name),
    permits     integer     NOT NULL,
    -- 1 = high (may use every slot), 0 = low (must leave the reserve free).
    -- High-priority waiters are served before low-priority ones.
    priority    smallint    NOT NULL,
    holder      text        NOT NULL,
    enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at  timestamptz NOT NULL,
    CONSTRAINT waiters_permits_positive CHECK (permits >= 1),
    CONSTRAINT waiters_priority_range CHECK (priority IN (0, 1)),
    CONSTRAINT waiters_holder_length CHECK (char_length(holder) BETWEEN 1 AND 1000)
);

-- The head of a semaphore's queue, and "is anyone queued?", by index.
CREATE INDEX waiters_queue_idx ON pgsemaphore.waiters (semaphore, priority, id);

-- A hint that keeps the fast path of pgsemaphore.claim free of the queue:
-- false guarantees that the semaphore has no waiter row. Set by enqueue and
-- cleared by claim_many when it finds the queue empty, both with the
-- semaphore's row locked; true only means "look at pgsemaphore.waiters".
ALTER TABLE pgsemaphore.semaphores ADD COLUMN queue_used boolean NOT NULL DEFAULT false;

-- A queue churns: one insert and one delete per queued acquire.
ALTER TABLE pgsemaphore.waiters SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);

-- THE EXTENDED CLAIM. One call, one round trip, one transaction.
--   p_permits  slots to hold at once: all of them or none;
--   p_priority 1 high, 0 low: a low-priority claim only succeeds if at least
--              p_reserve slots stay free after it;
--   p_ticket   NULL for a claim outside the queue (refused while a waiter of
--              the same or higher priority is queued), else the caller's
--              waiter id: only the head of the queue may claim, and its row
--              is deleted when it does; a waiter that is not served has its
--              lease renewed by p_waiter_lease;
--   p_lifo     the queue's order for p_ticket: newest first instead of oldest.
-- o_status: 'claimed' (o_ids/o_slots set, lowest id first), 'full' (not
-- enough free slots), 'behind' (a waiter is ahead), 'no_ticket' (the
-- caller's waiter row is gone: its lease ended), 'too_many' (p_permits
-- exceeds what the capacity and reserve could ever allow).
CREATE FUNCTION pgsemaphore.claim_many(
    p_semaphore    text,
    p_holder       text,
    p_lease        interval,
    p_metadata     jsonb,
    p_permits      integer,
    p_priority     smallint,
    p_reserve      integer,
    p_ticket       bigint,
    p_lifo         boolean,
    p_waiter_lease interval
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
    v_queue    boolean;
    v_reaped   integer;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pg_semaphore.claim_many needs READ COMMITTED isolation, the session uses %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    PERFORM pgsemaphore.durable_commit();

    SELECT s.capacity, s.default_lease, s.queue_used INTO v_capacity, v_lease, v_queue
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

    -- The queue: drop waiters whose process stopped renewing them, then make
    -- sure nobody is ahead of this claim (a caller with a ticket has set
    -- queue_used, by enqueue).
    v_now := clock_timestamp();
    IF v_queue THEN
        DELETE FROM pgsemaphore.waiters w
         WHERE w.semaphore = p_semaphore AND w.expires_at <= v_now;
    END IF;
    IF p_ticket IS NOT NULL THEN
        UPDATE pgsemaphore.waiters w
           SET expires_at = v_now + p_waiter_lease
         WHERE w.id = p_ticket;
        IF NOT FOUND THEN
            o_status := 'no_ticket';
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    IF v_queue THEN
        IF EXISTS (SELECT 1
                     FROM pgsemaphore.waiters w
                    WHERE w.semaphore = p_semaphore
                      AND w.priority >= p_priority
                      AND (p_ticket IS NULL
                           OR w.priority > p_priority
                           OR (NOT p_lifo AND w.id < p_ticket)
                           OR (p_lifo AND w.id > p_ticket))) THEN
            o_status := 'behind';
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;

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
        GET DIAGNOSTICS v_reaped = ROW_COUNT;
        IF v_reaped > 0 THEN
            -- Freed slots this claim may not take: tell other waiters.
            PERFORM pg_notify('pgsemaphore', p_semaphore);
        END IF;
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

    IF p_ticket IS NOT NULL THEN
        DELETE FROM pgsemaphore.waiters w WHERE w.id = p_ticket;
    END IF;
    o_status := 'claimed';
    o_free := v_capacity - v_live - p_permits;
    IF v_queue THEN
        IF EXISTS (SELECT 1 FROM pgsemaphore.waiters w WHERE w.semaphore = p_semaphore) THEN
            -- Slots are left and others wait: the next head should look.
            IF o_free > 0 THEN
                PERFORM pg_notify('pgsemaphore', p_semaphore);
            END IF;
        ELSE
            -- The queue is empty: plain claims can skip it again, and those
            -- refused while it was not must look again if slots are left.
            UPDATE pgsemaphore.semaphores s SET queue_used = false WHERE s.name = p_semaphore;
            IF o_free > 0 THEN
                PERFORM pg_notify('pgsemaphore', p_semaphore);
            END IF;
        END IF;
    END IF;
    RETURN NEXT;
END;
$$;

-- Joins the queue: returns the waiter's id (its place), or NULL when
-- p_limit waiters are queued already. Serialised with claims on the
-- semaphore's row, so the limit is exact.
CREATE FUNCTION pgsemaphore.enqueue(
    p_semaphore    text,
    p_permits      integer,
    p_priority     smallint,
    p_holder       text,
    p_limit        integer,
    p_waiter_lease interval
)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_now   timestamptz;
    v_count integer;
    v_id    bigint;
BEGIN
    PERFORM 1 FROM pgsemaphore.semaphores s WHERE s.name = p_semaphore FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_semaphore)
            USING ERRCODE = 'no_data_found';
    END IF;
    v_now := clock_timestamp();
    DELETE FROM pgsemaphore.waiters w
     WHERE w.semaphore = p_semaphore AND w.expires_at <= v_now;
    IF p_limit IS NOT NULL THEN
        SELECT count(*) INTO v_count FROM pgsemaphore.waiters w WHERE w.semaphore = p_semaphore;
        IF v_count >= p_limit THEN
            RETURN NULL;
        END IF;
    END IF;
    INSERT INTO pgsemaphore.waiters (semaphore, permits, priority, holder, enqueued_at, expires_at)
    VALUES (p_semaphore, p_permits, p_priority, p_holder, v_now, v_now + p_waiter_lease)
    RETURNING id INTO v_id;
    UPDATE pgsemaphore.semaphores s SET queue_used = true WHERE s.name = p_semaphore AND NOT s.queue_used;
    RETURN v_id;
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
    PERFORM pgsemaphore.durable_commit();
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

-- pgsemaphore.claim as in 20261121000001, with a durable commit (see
-- pgsemaphore.durable_commit in 20261121000003), plus the queue check in its
-- first (unlocked) step: while a live waiter is queued on the semaphore, a claim
-- outside the queue is refused like a full one. Free unless the semaphore's
-- queue is in use (queue_used), then one index probe.
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
    v_queue    boolean;
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
    -- While waiters are queued (high-priority ones: this claim is high
    -- priority), it counts as full too: no claim jumps the queue. The queue
    -- is looked at, in a statement of its own, only if the semaphore's
    -- queue_used says it may be in use: semaphores without a queue pay
    -- nothing for it (a waiters subquery in the first statement would cost
    -- opening that table and index on every call, even unexecuted).
    v_now := clock_timestamp();
    SELECT s.capacity,
           (SELECT count(*)
              FROM pgsemaphore.slots l
             WHERE l.semaphore = s.name
               AND l.completed_at IS NULL AND l.timed_out_at IS NULL
               AND l.expires_at > v_now),
           s.queue_used
      INTO v_capacity, v_live, v_queue
      FROM pgsemaphore.semaphores s
     WHERE s.name = p_semaphore;
    -- (Two IFs: the outer one is a simple expression, evaluated without the
    -- executor; the query only runs when the queue may be in use.)
    IF v_queue AND v_live < v_capacity THEN
        IF EXISTS (SELECT 1
                     FROM pgsemaphore.waiters w
                    WHERE w.semaphore = p_semaphore AND w.priority >= 1
                      AND w.expires_at > v_now) THEN
            v_live := v_capacity;
        END IF;
    END IF;
    IF FOUND AND v_live >= v_capacity THEN
        RETURN QUERY SELECT NULL::bigint, NULL::integer, NULL::timestamptz, NULL::timestamptz,
                            v_capacity, 0;
        RETURN;
    END IF;

    SELECT s.capacity, s.default_lease, s.queue_used INTO v_capacity, v_lease, v_queue
      FROM pgsemaphore.semaphores s
     WHERE s.name = p_semaphore
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_semaphore)
            USING ERRCODE = 'no_data_found';
    END IF;
    -- Waiters may have queued while this claim waited for the lock (enqueue
    -- sets queue_used under the same lock): look again, so that no claim
    -- jumps the queue.
    IF v_queue THEN
        IF EXISTS (SELECT 1
                     FROM pgsemaphore.waiters w
                    WHERE w.semaphore = p_semaphore AND w.priority >= 1
                      AND w.expires_at > clock_timestamp()) THEN
            RETURN QUERY SELECT NULL::bigint, NULL::integer, NULL::timestamptz, NULL::timestamptz,
                                v_capacity, 0;
            RETURN;
        END IF;
    END IF;

    v_now := clock_timestamp();
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
        GET DIAGNOSTICS v_reaped = ROW_COUNT;
        IF v_reaped > 1 THEN
            PERFORM pg_notify('pgsemaphore', p_semaphore);
        END IF;
    END IF;

    o_capacity := v_capacity;
    o_free := 0;
    IF v_live < v_capacity THEN
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

-- pgsemaphore.reap as in 20261121000001, and it also removes dead waiters.
-- Marks every expired live slot (of every semaphore) timed out, notifies the
-- semaphores that gained free slots, and returns how many were reaped.
CREATE OR REPLACE FUNCTION pgsemaphore.reap()
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_now       timestamptz := clock_timestamp();
    v_total     bigint := 0;
    v_semaphore text;
    v_count     bigint;
BEGIN
    FOR v_semaphore, v_count IN
        WITH expired AS (
            SELECT e.id
              FROM pgsemaphore.slots e
             WHERE e.completed_at IS NULL AND e.timed_out_at IS NULL
               AND e.expires_at <= v_now
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
        PERFORM pg_notify('pgsemaphore', v_semaphore);
        v_total := v_total + v_count;
    END LOOP;
    -- Waiters whose process stopped renewing them (it crashed): remove them,
    -- and wake the semaphores they were holding up.
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
        PERFORM pg_notify('pgsemaphore', v_semaphore);
    END LOOP;
    RETURN v_total;
END;
$$;
