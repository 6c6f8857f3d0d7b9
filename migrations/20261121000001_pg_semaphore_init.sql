-- pg-semaphore: counting semaphores on a slot table.
--
-- Everything lives in the `pgsemaphore` schema (PostgreSQL reserves the `pg_` prefix), including this crate's own
-- migration history (`pgsemaphore._sqlx_migrations`), so nothing collides with
-- the application's tables or with its own `_sqlx_migrations`.
--
-- Invariants:
--   * a claim is a row in `slots`; it is *live* while completed_at and
--     timed_out_at are both NULL;
--   * the partial unique index `slots_live_slot_key` makes it impossible for
--     two live rows to hold the same slot of the same semaphore;
--   * claims on one semaphore serialise on that semaphore's row in
--     `semaphores` (FOR NO KEY UPDATE), never on a table-wide lock, and only
--     admit while fewer than `capacity` live rows exist;
--   * finished rows stay: they are the audit log.

CREATE SCHEMA IF NOT EXISTS pgsemaphore;

-- One row per semaphore: the counter row that claims serialise on.
CREATE TABLE pgsemaphore.semaphores (
    name          text        PRIMARY KEY,
    capacity      integer     NOT NULL,
    default_lease interval    NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT semaphores_name_length CHECK (char_length(name) BETWEEN 1 AND 200),
    CONSTRAINT semaphores_capacity_range CHECK (capacity BETWEEN 1 AND 100000),
    CONSTRAINT semaphores_lease_positive CHECK (default_lease > interval '0')
);

-- One row per claim, kept after it ends as the audit log.
CREATE TABLE pgsemaphore.slots (
    -- Strictly increasing: usable as a fencing token.
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    semaphore    text        NOT NULL REFERENCES pgsemaphore.semaphores (name),
    slot         integer     NOT NULL,
    holder       text        NOT NULL,
    metadata     jsonb,
    created_at   timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    completed_at timestamptz,
    timed_out_at timestamptz,
    CONSTRAINT slots_slot_non_negative CHECK (slot >= 0),
    CONSTRAINT slots_holder_length CHECK (char_length(holder) BETWEEN 1 AND 1000),
    CONSTRAINT slots_expires_after_created CHECK (expires_at > created_at),
    CONSTRAINT slots_one_outcome CHECK (completed_at IS NULL OR timed_out_at IS NULL)
);

-- The hard limit: no slot of a semaphore is ever held twice. Also the index
-- every claim and the reaper scan: live rows are few (at most the sum of the
-- capacities, plus expired ones awaiting the reaper).
CREATE UNIQUE INDEX slots_live_slot_key
    ON pgsemaphore.slots (semaphore, slot)
    WHERE completed_at IS NULL AND timed_out_at IS NULL;

-- Audit queries: one semaphore's history by time.
CREATE INDEX slots_history_idx
    ON pgsemaphore.slots (semaphore, created_at);

-- Creates a semaphore or updates its capacity and default lease.
-- Notifies waiters when the capacity grew (new slots may be free).
CREATE FUNCTION pgsemaphore.configure(p_name text, p_capacity integer, p_lease interval)
RETURNS TABLE (o_capacity integer, o_default_lease interval, o_previous_capacity integer)
LANGUAGE plpgsql
AS $$
DECLARE
    v_old_capacity integer;
    v_old_lease    interval;
BEGIN
    LOOP
        SELECT s.capacity, s.default_lease INTO v_old_capacity, v_old_lease
          FROM pgsemaphore.semaphores s
         WHERE s.name = p_name
           FOR NO KEY UPDATE;
        IF FOUND THEN
            IF v_old_capacity <> p_capacity OR v_old_lease <> p_lease THEN
                UPDATE pgsemaphore.semaphores s
                   SET capacity = p_capacity, default_lease = p_lease, updated_at = clock_timestamp()
                 WHERE s.name = p_name;
            END IF;
            IF p_capacity > v_old_capacity THEN
                PERFORM pg_notify('pgsemaphore', p_name);
            END IF;
            RETURN QUERY SELECT p_capacity, p_lease, v_old_capacity;
            RETURN;
        END IF;
        INSERT INTO pgsemaphore.semaphores (name, capacity, default_lease)
        VALUES (p_name, p_capacity, p_lease)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT p_capacity, p_lease, NULL::integer;
            RETURN;
        END IF;
        -- Lost a race with a concurrent creator: the next SELECT sees its row.
    END LOOP;
END;
$$;

-- THE CLAIM. One call, one round trip, one transaction:
--   1. lock this semaphore's counter row (claims on other semaphores never wait);
--   2. count its live slots, and reap the expired ones if there are any;
--   3. if fewer than `capacity` unexpired slots are live, insert the lowest
--      free slot below capacity.
-- Under READ COMMITTED every statement of a VOLATILE plpgsql function takes a
-- fresh snapshot, so steps 2 and 3 see every claim committed before the lock
-- of step 1 was granted: the snapshot is never older than the lock.
-- Returns one row: o_id is NULL when no slot was free (o_capacity still set).
--
-- Every query here is driven by the partial index over live slots, so a claim
-- costs O(live slots), however long the audit log grows. (A generate_series
-- with a variable bound made the cached generic plan estimate 1,000 rows and
-- could scan history; the gap search below cannot.)
CREATE FUNCTION pgsemaphore.claim(p_semaphore text, p_holder text, p_lease interval, p_metadata jsonb)
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

-- Ends a claim. Returns what happened:
--   'released'  this call ended it (and waiters were notified);
--   'timed_out' it had already been reaped (o_at = timed_out_at);
--   'completed' it had already been released (o_at = completed_at);
--   'missing'   no such claim.
CREATE FUNCTION pgsemaphore.release(p_id bigint)
RETURNS TABLE (o_outcome text, o_semaphore text, o_at timestamptz)
LANGUAGE plpgsql
AS $$
DECLARE
    v_semaphore    text;
    v_completed_at timestamptz;
    v_timed_out_at timestamptz;
BEGIN
    UPDATE pgsemaphore.slots s
       SET completed_at = clock_timestamp()
     WHERE s.id = p_id
       AND s.completed_at IS NULL AND s.timed_out_at IS NULL
    RETURNING s.semaphore, s.completed_at INTO v_semaphore, v_completed_at;
    IF FOUND THEN
        PERFORM pg_notify('pgsemaphore', v_semaphore);
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

-- Marks every expired live slot (of every semaphore) timed out, notifies the
-- semaphores that gained free slots, and returns how many were reaped.
CREATE FUNCTION pgsemaphore.reap()
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
    RETURN v_total;
END;
$$;
