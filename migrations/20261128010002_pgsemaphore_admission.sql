-- pg-semaphore's schema, version 1 (the 0.1 baseline), part 2 of 7:
-- admission to lease semaphores: open, claim (one semaphore or several at
-- once), release, renew, fence, and the argument checks every function
-- shares.
--
-- The application functions are a security boundary:
--   * Every argument is checked. A bad one raises SQLSTATE 22023
--     (invalid_parameter_value) with the argument's name in the error's
--     COLUMN field (`p_permits`, `p_token`, ...); NULL where a value is
--     required is refused the same way. The crate maps it to
--     Error::InvalidArgument.
--   * A token is 16 to 64 bytes, never NULL or empty, and every statement
--     that locks or changes a claim (or a waiter, or a registration) carries
--     the condition that the row's token is the caller's. A row whose token
--     does not match is never locked and never changed, only reported
--     ('not_holder').
--   * The queue's order is the semaphore's (semaphores.queue_lifo, set by
--     open when it creates the semaphore and by configure), not the call's.
--   * release_by_token leaves a tombstone of the token
--     (pgsemaphore.released_tokens), so that a claim with that token still
--     in flight (waiting for the semaphore's row) is refused when it gets
--     there.
--   * Functions that lock a semaphore's row or its wake-up gate bound their
--     wait with lock_timeout (2 s): a transaction left open after a claim or
--     an enqueue delays every other claim of that semaphore by at most that,
--     and they fail with SQLSTATE 55P03 instead of hanging.
-- Several limits at once: pgsemaphore.claim_all claims permits of up to 16
-- semaphores in one call and one transaction, all or nothing, locking their
-- rows in one canonical order (by name, byte order), so callers never
-- deadlock whatever order they name them in; refused, it holds nothing.

-- ---------------------------------------------------------------------------
-- Internal helpers (not granted to anyone)
-- ---------------------------------------------------------------------------

-- They are called only from the functions that run with a pinned
-- search_path, and nobody else may call them: so they carry no SET clause
-- of their own (a SET clause costs about 7 µs per call, measured, on every
-- claim).

-- A claim, renewal or release that a client was told about must survive a
-- database crash. A lost claim or renewal would make the slot look free while
-- its holder works and admit a second holder; a lost release would leave the
-- audit log contradicting what the holder was told. Under
-- `synchronous_commit = off` (a common throughput setting) a commit is
-- acknowledged before its WAL is flushed, and a crash loses it: the torture
-- test saw both. With a synchronous standby, `local` and `remote_write`
-- acknowledge a commit before the standby has flushed it, so a failover can
-- lose it the same way. So the functions that decide admission upgrade
-- `off`, `local` and `remote_write` to `on` for their own transaction
-- (`remote_apply`, stricter, is left as it is; without a synchronous
-- standby `on` only waits for the local flush).
-- Returns the setting now in force. A single SELECT in SQL, VOLATILE, with no
-- SET clause: the planner inlines it into the caller, a call costs what the
-- expression costs (a PL/pgSQL function costs a few microseconds to enter).
CREATE FUNCTION pgsemaphore.durable_commit()
RETURNS text
LANGUAGE sql VOLATILE
AS $$
    SELECT CASE WHEN current_setting('synchronous_commit') IN ('off', 'local', 'remote_write')
                THEN set_config('synchronous_commit', 'on', true)
                ELSE current_setting('synchronous_commit') END
$$;

-- The reverse, for transactions that only carry hints (a NOTIFY, a waiter
-- row, a wake-up registration): losing them in a crash costs a re-check, and
-- their commit must not wait for a WAL flush. A NOTIFY holds an
-- instance-wide lock from before its commit until the commit ends, so a
-- notifying transaction must commit fast.
-- Returns the new setting (inlined like durable_commit: a SQL function
-- returning void is not inlined, and costs more than a PL/pgSQL one).
CREATE FUNCTION pgsemaphore.fast_commit()
RETURNS text
LANGUAGE sql VOLATILE
AS $$ SELECT set_config('synchronous_commit', 'off', true) $$;

-- Raises the error every argument check raises: SQLSTATE 22023, the
-- argument's name in COLUMN (the crate reads it), and a message that says
-- what is accepted. Called only on the error path.
CREATE FUNCTION pgsemaphore.refuse(p_argument text, p_message text)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'invalid %: %', p_argument, p_message
        USING ERRCODE = 'invalid_parameter_value', COLUMN = p_argument;
END;
$$;

-- Raises the refusal of every function whose decision needs a snapshot
-- taken after its locks, called in a REPEATABLE READ or SERIALIZABLE
-- transaction: SQLSTATE 0A000, what was called (p_subject) in the message,
-- and what an older snapshot could miss (p_why) in the hint. Called only on
-- the error path, before anything is taken. advisory_claim, which runs with
-- its caller's rights (this is granted to nobody), raises the same error
-- itself.
CREATE FUNCTION pgsemaphore.refuse_isolation(p_subject text, p_why text)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION '% needs READ COMMITTED, this transaction is %',
        p_subject, upper(current_setting('transaction_isolation'))
        USING ERRCODE = 'feature_not_supported',
              HINT = 'call it outside the transaction, or in a READ COMMITTED one: ' || p_why;
END;
$$;

-- The checks every function shares. Each returns its argument (so it can
-- be used inline) or raises through pgsemaphore.refuse.

-- A holder's secret: 16 to 64 bytes.
CREATE FUNCTION pgsemaphore.checked_token(p_token bytea, p_argument text DEFAULT 'p_token')
RETURNS bytea
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_token IS NULL OR octet_length(p_token) NOT BETWEEN 16 AND 64 THEN
        PERFORM pgsemaphore.refuse(p_argument,
            format('a token is 16 to 64 bytes, got %s',
                   coalesce(octet_length(p_token) || ' bytes', 'NULL')));
    END IF;
    RETURN p_token;
END;
$$;

-- The ids of one permit's claims: 1 to 100000 of them (a permit never
-- holds more than a capacity), none NULL, a one-dimensional array.
CREATE FUNCTION pgsemaphore.checked_ids(p_ids bigint[])
RETURNS bigint[]
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_ids IS NULL OR array_ndims(p_ids) IS DISTINCT FROM 1
       OR cardinality(p_ids) NOT BETWEEN 1 AND 100000
       OR array_position(p_ids, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.refuse('p_ids',
            'one to 100000 claim ids, in a one-dimensional array without NULLs');
    END IF;
    RETURN p_ids;
END;
$$;

-- A name, holder or key: 1 to p_max characters.
CREATE FUNCTION pgsemaphore.checked_text(p_value text, p_argument text, p_max integer)
RETURNS text
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_value IS NULL OR char_length(p_value) NOT BETWEEN 1 AND p_max THEN
        PERFORM pgsemaphore.refuse(p_argument,
            format('1 to %s characters, got %s', p_max,
                   coalesce(char_length(p_value) || ' characters', 'NULL')));
    END IF;
    RETURN p_value;
END;
$$;

-- An interval between p_min and p_max (NULL refused unless p_nullable).
CREATE FUNCTION pgsemaphore.checked_interval(p_value interval, p_argument text,
                                             p_min interval, p_max interval,
                                             p_nullable boolean DEFAULT false)
RETURNS interval
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_value IS NULL THEN
        IF NOT p_nullable THEN
            PERFORM pgsemaphore.refuse(p_argument, format('%s to %s, got NULL', p_min, p_max));
        END IF;
    ELSIF p_value < p_min OR p_value > p_max THEN
        PERFORM pgsemaphore.refuse(p_argument, format('%s to %s, got %s', p_min, p_max, p_value));
    END IF;
    RETURN p_value;
END;
$$;

-- ---------------------------------------------------------------------------
-- Application functions
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.open(p_name text, p_capacity integer, p_lease interval,
                                 p_queue_lifo boolean DEFAULT false)
RETURNS TABLE (o_capacity integer, o_default_lease interval, o_created boolean,
               o_queue_lifo boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET plan_cache_mode = force_generic_plan
AS $$
-- Opens a semaphore: creates it with this capacity, default lease and queue
-- order if it does not exist; an existing one keeps its settings (changing
-- them is the operator's pgsemaphore.configure), so processes of two
-- versions of an application never fight over them. Returns the settings in
-- force.
-- Arguments: p_name 1..200 characters; p_capacity 1..100000; p_lease
-- 10 ms..366 days; p_queue_lifo not NULL.
-- Opening an existing semaphore reads its row and waits for nothing.
-- Creating one takes the name's creation lock (one_kind_per_name: the
-- advisory key (1885828966, hashtext(name)), which any role can also take
-- with pg_advisory_lock) and may wait for a concurrent creator of the same
-- name: at most lock_timeout, 2 s, then 55P03, nothing created.
BEGIN
    PERFORM pgsemaphore.checked_text(p_name, 'p_name', 200);
    IF p_capacity IS NULL OR p_capacity NOT BETWEEN 1 AND 100000 THEN
        PERFORM pgsemaphore.refuse('p_capacity', format('1 to 100000, got %s', coalesce(p_capacity::text, 'NULL')));
    END IF;
    PERFORM pgsemaphore.checked_interval(p_lease, 'p_lease', interval '10 ms', interval '366 days');
    IF p_queue_lifo IS NULL THEN
        PERFORM pgsemaphore.refuse('p_queue_lifo', 'true or false, got NULL');
    END IF;
    -- An existing semaphore: its row, and no creation lock to wait for.
    -- (A name beginning with '@' goes on to the insert, whose trigger
    -- refuses a family key's name: such names are families'.)
    RETURN QUERY SELECT s.capacity, s.default_lease, false, s.queue_lifo
                   FROM pgsemaphore.semaphores s
                  WHERE s.name = p_name AND left(p_name, 1) <> '@';
    IF FOUND THEN
        RETURN;
    END IF;
    INSERT INTO pgsemaphore.semaphores (name, capacity, default_lease, queue_lifo)
    VALUES (p_name, p_capacity, p_lease, p_queue_lifo)
    ON CONFLICT (name) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT p_capacity, p_lease, true, p_queue_lifo;
        RETURN;
    END IF;
    -- Exists (a concurrent creator's row is visible once its insert committed:
    -- ON CONFLICT waited for it).
    RETURN QUERY SELECT s.capacity, s.default_lease, false, s.queue_lifo
                   FROM pgsemaphore.semaphores s WHERE s.name = p_name;
END;
$$;

CREATE FUNCTION pgsemaphore.claim(
    p_semaphore    text,
    p_holder       text,
    p_lease        interval,
    p_metadata     jsonb,
    p_token        bytea,
    p_permits      integer DEFAULT 1,
    p_priority     smallint DEFAULT 1,
    p_reserve      integer DEFAULT 0,
    p_ticket       bigint DEFAULT NULL,
    p_ticket_token bytea DEFAULT NULL,
    p_waiter_lease interval DEFAULT NULL
)
RETURNS TABLE (
    o_status     text,
    o_ids        bigint[],
    o_slots      integer[],
    o_created_at timestamptz,
    o_expires_at timestamptz,
    o_capacity   integer,
    o_free       integer,
    o_retry_in   interval,
    o_wake       boolean
)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- THE CLAIM. One call, one round trip, one transaction, for every kind of
-- claim: one permit or p_permits at once (all or nothing), high or low
-- priority, inside or outside the fair queue.
--   p_semaphore    an existing semaphore (else SQLSTATE P0002)
--   p_holder       1..1000 characters, recorded in the audit log
--   p_lease        10 ms..366 days, or NULL for the semaphore's default
--   p_metadata     NULL or a jsonb value of at most 64 kB
--   p_token        the holder's secret, 16..64 bytes, fresh for each claim:
--                  its SHA-256 is stored with the claim, and only a caller
--                  that knows it may release, renew or fence the claim
--   p_permits      slots to hold at once, 1..100000
--   p_priority     1 high, 0 low: a low-priority claim succeeds only if at
--                  least p_reserve slots stay free after it
--   p_reserve      0..100000 (used by low priority only)
--   p_ticket       NULL for a claim outside the queue (refused while a live
--                  waiter of the same or higher priority is queued), else the
--                  caller's waiter id on this semaphore, proven by
--                  p_ticket_token and queued with the same p_permits and
--                  p_priority: only the head of the queue may claim, its row
--                  is deleted when it does, and it is renewed by
--                  p_waiter_lease (1 s..60 s, required with a ticket) when
--                  it does not. The queue's order is the semaphore's
--                  (queue_lifo): FIFO serves high priority first, then the
--                  smallest turn, then the smallest id (waiters of
--                  different fairness keys take turns: see
--                  pgsemaphore.enqueue); LIFO serves high priority first,
--                  then the largest id, and ignores turns.
-- Every bad argument raises SQLSTATE 22023 naming it in COLUMN.
--
-- Returns one row. o_status:
--   'claimed'   o_ids/o_slots hold the claims (lowest id first), o_free the
--               slots still free after them
--   'full'      not enough free slots (or the reserve would be touched)
--   'behind'    a waiter is ahead in the queue
--   'no_ticket' the caller's waiter row is gone (its lease ended, an
--               operator cleared the queue) or is not this caller's, this
--               semaphore's, for these permits and priority: queue again
--   'too_many'  p_permits exceeds what the capacity and reserve ever allow
-- o_retry_in (when refused): when to look again without a wake-up: the
--   earliest held lease's end, or a queued waiter's ahead of the caller
--   (a crashed holder or waiter frees its place then), 100 ms when a lease
--   has ended but its row is locked, NULL when only a release can help.
-- o_wake: other waiters may claim now (the caller sends the wake-up, after
--   this transaction committed, with pgsemaphore.wake).
-- A token released by pgsemaphore.release_by_token is refused (22023,
-- p_token). The semaphore's row is waited for at most lock_timeout (2 s):
-- then SQLSTATE 55P03, and nothing was claimed.
--
-- Invariant: a claim is admitted only while held + p_permits <= capacity
-- (minus the reserve), where held counts every live row this claim did not
-- reap itself (step 4, the count of held slots); the partial unique index
-- forbids two live rows on one slot. Claims on one semaphore serialise on
-- its row (FOR NO KEY UPDATE), never a table lock. Under READ COMMITTED
-- every statement of a VOLATILE function takes a fresh snapshot, so each
-- sees every claim committed before the row lock was granted. Queue: a
-- ticket claims only when no live waiter is ahead of it in the semaphore's
-- order (step 3), and a waiter's place (priority, turn, id) never changes
-- once queued.
-- Meets: other claims (serialised on the semaphore row); releases in flight
-- (their row is still live in our snapshot: counted, the slot looks taken;
-- a waiter that registers after this refusal is covered by the wake-up
-- gate, see pgsemaphore.gate); renewals in flight and fences past their
-- lease (locked rows: counted, step 4); the reaper (SKIP LOCKED on both
-- sides: a row is reaped once); a capacity or order change
-- (pgsemaphore.configure locks the same row); enqueue, queue renewals and
-- clear_queue (the waiter rows; enqueue and clear_queue also lock the
-- semaphore row, so the queue check under the lock sees every waiter); a
-- waiter of another fairness key enqueueing while the head claims (it
-- locks the same row: it queues before this claim's check or after its
-- commit, and unless its priority is higher, either way behind the head,
-- whose turn is the smallest queued at its priority and whose id is
-- smaller: see pgsemaphore.enqueue);
-- release_by_token of this claim's token (it share-locks the semaphore row
-- before writing its tombstone: either it waits for this claim to commit
-- and ends it, or this claim waits for its tombstone and refuses, step 2);
-- a hostile caller holding the semaphore row in an open transaction
-- (lock_timeout).
DECLARE
    v_hash     bytea;
    v_capacity integer;
    v_lease    interval;
    v_queue    boolean;
    v_lifo     boolean;
    v_now      timestamptz;
    v_live     integer;
    v_held     integer;
    v_next_end timestamptz;
    v_stuck    boolean;
    v_expired  integer;
    v_reaped   integer;
    v_reserve  integer;
    v_ahead    timestamptz;
    v_dropped  integer := 0;
    v_turn     bigint;
BEGIN
    -- 0. The arguments. (Inline IFs: a call to a checking function costs
    -- more than the test, on every claim.)
    IF p_semaphore IS NULL THEN
        PERFORM pgsemaphore.refuse('p_semaphore', 'a semaphore name, got NULL');
    END IF;
    IF p_holder IS NULL OR char_length(p_holder) NOT BETWEEN 1 AND 1000 THEN
        PERFORM pgsemaphore.checked_text(p_holder, 'p_holder', 1000);
    END IF;
    IF p_lease IS NOT NULL AND (p_lease < interval '10 ms' OR p_lease > interval '366 days') THEN
        PERFORM pgsemaphore.checked_interval(p_lease, 'p_lease', interval '10 ms', interval '366 days');
    END IF;
    IF p_metadata IS NOT NULL AND pg_column_size(p_metadata) > 65536 THEN
        PERFORM pgsemaphore.refuse('p_metadata',
            format('at most 64 kB of jsonb, got %s bytes', pg_column_size(p_metadata)));
    END IF;
    IF p_token IS NULL OR octet_length(p_token) NOT BETWEEN 16 AND 64 THEN
        PERFORM pgsemaphore.checked_token(p_token);
    END IF;
    IF p_permits IS NULL OR p_permits NOT BETWEEN 1 AND 100000 THEN
        PERFORM pgsemaphore.refuse('p_permits', format('1 to 100000, got %s', coalesce(p_permits::text, 'NULL')));
    END IF;
    IF p_priority IS NULL OR p_priority NOT IN (0, 1) THEN
        PERFORM pgsemaphore.refuse('p_priority', format('0 (low) or 1 (high), got %s', coalesce(p_priority::text, 'NULL')));
    END IF;
    IF p_reserve IS NULL OR p_reserve NOT BETWEEN 0 AND 100000 THEN
        PERFORM pgsemaphore.refuse('p_reserve', format('0 to 100000, got %s', coalesce(p_reserve::text, 'NULL')));
    END IF;
    IF p_ticket IS NOT NULL THEN
        PERFORM pgsemaphore.checked_token(p_ticket_token, 'p_ticket_token');
        PERFORM pgsemaphore.checked_interval(p_waiter_lease, 'p_waiter_lease', interval '1 s', interval '60 s');
    ELSIF p_ticket_token IS NOT NULL THEN
        PERFORM pgsemaphore.refuse('p_ticket_token', 'only with a ticket (p_ticket)');
    END IF;
    -- Every statement below must take a fresh snapshot after the locks it
    -- waited for: READ COMMITTED only.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgsemaphore.refuse_isolation('pgsemaphore.claim',
            'an older snapshot could miss slots taken, freed or reaped meanwhile');
    END IF;
    v_hash := sha256(p_token);
    v_reserve := CASE WHEN p_priority = 0 THEN p_reserve ELSE 0 END;
    PERFORM pgsemaphore.durable_commit();
    o_wake := false;

    -- 1. Fail fast without queueing behind other claims (not for a queued
    -- waiter, whose ticket must be renewed under the lock): if, as of this
    -- snapshot, the unexpired live claims alone leave too few slots, the
    -- semaphore was too full at that instant. Claims in flight would only make
    -- it fuller; expired rows are left to the locked path, which reaps.
    IF p_ticket IS NULL THEN
        v_now := clock_timestamp();
        SELECT s.capacity, s.queue_used, c.live, c.next_end
          INTO v_capacity, v_queue, v_live, v_next_end
          FROM pgsemaphore.semaphores s,
               LATERAL (SELECT count(*) AS live, min(l.expires_at) AS next_end
                          FROM pgsemaphore.live_slots l
                         WHERE l.semaphore = s.name AND l.expires_at > v_now) c
         WHERE s.name = p_semaphore;
        IF FOUND AND v_live + p_permits + v_reserve > v_capacity
           AND p_permits + v_reserve <= v_capacity THEN
            RETURN QUERY SELECT 'full'::text, NULL::bigint[], NULL::integer[], NULL::timestamptz,
                                NULL::timestamptz, v_capacity, greatest(v_capacity - v_live, 0),
                                v_next_end - clock_timestamp(), false;
            RETURN;
        END IF;
        -- A live waiter of at least this priority is queued: no claim jumps
        -- the queue. (Two IFs: the outer one is evaluated without the
        -- executor, so semaphores without a queue never open its table.)
        IF v_queue THEN
            SELECT min(w.expires_at) INTO v_ahead
              FROM pgsemaphore.waiters w
             WHERE w.semaphore = p_semaphore AND w.priority >= p_priority
               AND w.expires_at > v_now;
            IF v_ahead IS NOT NULL THEN
                RETURN QUERY SELECT 'behind'::text, NULL::bigint[], NULL::integer[], NULL::timestamptz,
                                    NULL::timestamptz, v_capacity, 0, v_ahead - clock_timestamp(), false;
                RETURN;
            END IF;
        END IF;
    END IF;

    -- 2. Lock the semaphore's row: claims on it serialise from here. Then
    -- refuse a token that release_by_token has released (a statement of its
    -- own, after the lock: it sees every tombstone committed before).
    SELECT s.capacity, s.default_lease, s.queue_used, s.queue_lifo
      INTO v_capacity, v_lease, v_queue, v_lifo
      FROM pgsemaphore.semaphores s
     WHERE s.name = p_semaphore
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_semaphore)
            USING ERRCODE = 'no_data_found';
    END IF;
    IF EXISTS (SELECT 1 FROM pgsemaphore.released_tokens t WHERE t.token_hash = v_hash) THEN
        PERFORM pgsemaphore.refuse('p_token',
            'this token was released by release_by_token: every claim needs a fresh token');
    END IF;
    o_capacity := v_capacity;
    o_free := 0;
    IF p_permits + v_reserve > v_capacity THEN
        o_status := 'too_many';
        RETURN NEXT;
        RETURN;
    END IF;

    -- 3. The queue: drop waiters whose process stopped renewing them (and
    -- wake those behind them), renew the caller's ticket, and make sure
    -- nobody is ahead of this claim: in a FIFO queue nobody of higher
    -- priority, or of this priority with a smaller (turn, id); in a LIFO
    -- queue nobody of higher priority, or of this priority with a larger
    -- id. Without fairness keys turns ascend with ids within a priority, so
    -- FIFO is arrival order. enqueue sets queue_used under this lock, so a
    -- false here means no waiter row exists.
    v_now := clock_timestamp();
    IF v_queue THEN
        DELETE FROM pgsemaphore.waiters w
         WHERE w.semaphore = p_semaphore AND w.expires_at <= v_now;
        GET DIAGNOSTICS v_dropped = ROW_COUNT;
        o_wake := v_dropped > 0;
    END IF;
    IF p_ticket IS NOT NULL THEN
        -- Only the caller's own waiter row of this semaphore, queued for
        -- this claim: a ticket of another semaphore, or for another
        -- priority, proves nothing here.
        UPDATE pgsemaphore.waiters w
           SET expires_at = greatest(w.expires_at, v_now + p_waiter_lease)
         WHERE w.id = p_ticket AND w.semaphore = p_semaphore
           AND w.token_hash = sha256(p_ticket_token)
           AND w.priority = p_priority AND w.permits = p_permits
        RETURNING w.turn INTO v_turn;
        IF NOT FOUND THEN
            o_status := 'no_ticket';
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    IF v_queue THEN
        SELECT min(w.expires_at) INTO v_ahead
          FROM pgsemaphore.waiters w
         WHERE w.semaphore = p_semaphore
           AND w.priority >= p_priority
           AND (p_ticket IS NULL
                OR w.priority > p_priority
                OR (NOT v_lifo AND (w.turn, w.id) < (v_turn, p_ticket))
                OR (v_lifo AND w.id > p_ticket));
        IF v_ahead IS NOT NULL THEN
            o_status := 'behind';
            o_retry_in := v_ahead - clock_timestamp();
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;

    -- 4. THE COUNT OF HELD SLOTS, the one every claim decides on. With the
    -- semaphore's row locked (so no claim inserts meanwhile), reap this
    -- semaphore's live claims whose lease ended at v_now, and count as held
    -- every live claim this statement did NOT reap. A live row it could not
    -- reap (locked: a release or renewal in flight, a Permit::fence
    -- transaction past its lease) still holds its slot and is counted, so
    -- the hard limit holds whatever those transactions do next. v_stuck: an
    -- expired row could not be reaped (it is locked), so a waiter should
    -- look again soon. v_next_end: when the earliest unexpired held lease
    -- ends. (Inline: this is the only place that counts held slots.)
    SELECT count(*), count(*) FILTER (WHERE l.expires_at <= v_now),
           min(l.expires_at) FILTER (WHERE l.expires_at > v_now)
      INTO v_held, v_expired, v_next_end
      FROM pgsemaphore.live_slots l
     WHERE l.semaphore = p_semaphore;
    v_stuck := false;
    IF v_expired > 0 THEN
        UPDATE pgsemaphore.slots s
           SET timed_out_at = v_now
          FROM (SELECT e.id
                  FROM pgsemaphore.live_slots e
                 WHERE e.semaphore = p_semaphore AND e.expires_at <= v_now
                   FOR UPDATE SKIP LOCKED) expired
         WHERE s.id = expired.id;
        GET DIAGNOSTICS v_reaped = ROW_COUNT;
        v_held := v_held - v_reaped;
        v_stuck := v_reaped < v_expired;
    END IF;
    IF v_capacity - v_held - p_permits < v_reserve THEN
        o_status := 'full';
        o_free := greatest(v_capacity - v_held, 0);
        o_retry_in := CASE WHEN v_stuck THEN interval '100 milliseconds'
                           ELSE v_next_end - clock_timestamp() END;
        RETURN NEXT;
        RETURN;
    END IF;

    -- 5. The p_permits lowest free slot numbers. Every live row left holds a
    -- slot, and at most v_held of them exist, so among the v_held + p_permits
    -- candidates 0 .. v_held + p_permits - 1 (all below capacity, by the
    -- check above) at least p_permits are free. Each candidate, in
    -- ascending order, is one probe of the partial unique index, and the
    -- scan stops at the p_permits-th free one: O(live slots) whatever the
    -- audit log's length. (OFFSET 0 keeps the NOT EXISTS a per-candidate
    -- probe: as an anti-join the generic plan hashes every live row of the
    -- semaphore first. No ORDER BY: the candidates come in order, and any
    -- p_permits free ones would do.) The inserted rows come back in insertion
    -- order, which is identity order: o_ids ascend. created_at is read inside
    -- this statement, after its snapshot was taken: every release this claim
    -- relies on committed before that, and stamped its completed_at after
    -- its row locks (pgsemaphore.release), so that completed_at is earlier
    -- than our created_at and the audit log never shows two claims
    -- overlapping on a slot.
    WITH inserted AS (
        INSERT INTO pgsemaphore.slots AS n
               (semaphore, slot, holder, metadata, created_at, expires_at, token_hash)
        SELECT p_semaphore, f.slot, p_holder, p_metadata, t.now,
               t.now + coalesce(p_lease, v_lease), v_hash
          FROM (SELECT clock_timestamp() AS now) AS t,
               (SELECT g.slot
                  FROM generate_series(0, least(v_held + p_permits, v_capacity) - 1) AS g(slot)
                 WHERE NOT EXISTS (SELECT 1 FROM pgsemaphore.live_slots z
                                    WHERE z.semaphore = p_semaphore AND z.slot = g.slot
                                   OFFSET 0)
                 LIMIT p_permits) AS f
        RETURNING n.id, n.slot, n.created_at, n.expires_at
    )
    SELECT array_agg(i.id), array_agg(i.slot),
           min(i.created_at), min(i.expires_at)
      INTO o_ids, o_slots, o_created_at, o_expires_at
      FROM inserted i;
    IF cardinality(o_ids) IS DISTINCT FROM p_permits THEN
        -- Cannot happen (see above); never half a weighted claim.
        RAISE EXCEPTION 'pg_semaphore.claim found % of % free slots on %',
            coalesce(cardinality(o_ids), 0), p_permits, quote_literal(p_semaphore)
            USING ERRCODE = 'internal_error';
    END IF;
    o_status := 'claimed';
    o_free := v_capacity - v_held - p_permits;

    -- 6. Leave the queue, and keep the queue_used hint exact.
    IF p_ticket IS NOT NULL THEN
        DELETE FROM pgsemaphore.waiters w WHERE w.id = p_ticket AND w.semaphore = p_semaphore;
    END IF;
    IF v_queue THEN
        IF NOT EXISTS (SELECT 1 FROM pgsemaphore.waiters w WHERE w.semaphore = p_semaphore) THEN
            -- Plain claims can skip the queue again.
            UPDATE pgsemaphore.semaphores s SET queue_used = false WHERE s.name = p_semaphore;
        END IF;
        -- Slots are left: the next head, or claims refused while the queue
        -- was in use, should look.
        o_wake := o_wake OR o_free > 0;
    END IF;
    RETURN NEXT;
END;
$$;

CREATE FUNCTION pgsemaphore.claim_all(
    p_semaphores text[],
    p_holder     text,
    p_lease      interval,
    p_metadata   jsonb,
    p_token      bytea,
    p_permits    integer[] DEFAULT NULL,
    p_rate_kinds    text[] DEFAULT NULL,
    p_rate_limiters text[] DEFAULT NULL,
    p_rate_keys     text[] DEFAULT NULL,
    p_rate_rates    double precision[] DEFAULT NULL,
    p_rate_bursts   double precision[] DEFAULT NULL,
    p_rate_limits   bigint[] DEFAULT NULL,
    p_rate_windows  interval[] DEFAULT NULL
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
    o_wake       text[],
    o_rate_limit integer
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
--   p_rate_*     NULL (all seven: no rate limit), or rate limits that the
--                same call charges one permit each, as
--                pgsemaphore.check_limits takes them (p_rate_kinds as
--                p_kinds, p_rate_limiters as p_limiters, and so on; 1 to 16
--                limits, no key twice; checked as it checks them, with
--                p_n 1, a refusal naming the p_rate_ argument): the request is admitted only when every semaphore
--                and every rate limit admit it, and takes nothing from any
--                otherwise
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
--   'rate_limited': every semaphore admitted but a rate limit refused:
--              o_rate_limit is its index (from 1, in the order of
--              p_rate_kinds; the refusing limit with the longest wait),
--              o_retry_in when it would admit (a pause: until it ends);
--              nothing is claimed and no limit is charged
-- o_rate_limit is NULL unless 'rate_limited'.
-- Claims are high priority (no reserve applies) and outside the fair
-- queue: a semaphore with a live high-priority waiter queued refuses them
-- ('behind'), as it refuses any claim without a ticket.
--
-- Invariant: for each semaphore, the claim made is exactly one
-- pgsemaphore.claim (its invariant: admitted only while held + permits <=
-- capacity, held counting every live row the claim did not reap, under the
-- semaphore's row lock), and those claims commit together or not at all:
-- every claim runs in one subtransaction, rolled back as a whole at the
-- first refusal, which also releases the row locks it took. With rate
-- limits, after every claim succeeded, one pgsemaphore.rate_take_all
-- (check_limits' engine, its invariant: each limit admits only what its
-- own step admits) runs in the same subtransaction: admitted, every limit
-- is charged and the claims stand; refused, it wrote nothing, and the
-- subtransaction's rollback undoes the claims. So a request counts
-- against a semaphore only if every limit admitted it, and against a rate
-- limit only if every semaphore admitted it. The rows are
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
-- With rate limits, also what rate_take_all meets, per key: its advisory
-- locks are taken after our row locks, in hash order; every caller that
-- takes both (another claim_all) takes rows first, then keys, and a plain
-- rate check or set takes keys only and waits on no row, so no cycle can
-- form; a key's lock held by a stuck transaction: refused at once
-- ('rate_limited') if the key's committed state refuses, else 2 s, then
-- 55P03, nothing claimed or charged (the rows stay locked meanwhile, as
-- above).
DECLARE
    v_count    integer;
    v_order    integer[];
    v_rate     record;
    v_column   text;
    v_message  text;
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
    IF p_rate_kinds IS NOT NULL THEN
        -- Checked before anything is claimed, as check_limits checks its
        -- arrays; a refusal names our argument (p_kinds -> p_rate_kinds,
        -- p_key -> p_rate_keys, ...). The limits' canonical order.
        BEGIN
            v_order := pgsemaphore.checked_limits(p_rate_kinds, p_rate_limiters, p_rate_keys, p_rate_rates,
                                                  p_rate_bursts, p_rate_limits, p_rate_windows, 1);
        EXCEPTION WHEN invalid_parameter_value THEN
            GET STACKED DIAGNOSTICS v_column = COLUMN_NAME, v_message = MESSAGE_TEXT;
            PERFORM pgsemaphore.refuse(
                CASE WHEN v_column IN ('p_kinds', 'p_limiters', 'p_keys', 'p_rates', 'p_bursts', 'p_limits',
                                       'p_windows')
                     THEN 'p_rate_' || substr(v_column, 3)
                     WHEN v_column IN ('p_limiter', 'p_key', 'p_rate', 'p_burst', 'p_limit', 'p_window')
                     THEN 'p_rate_' || substr(v_column, 3) || 's'
                     ELSE 'p_rate_limits' END,
                regexp_replace(v_message, '^invalid [a-z_]+: ', ''));
        END;
    ELSIF num_nonnulls(p_rate_limiters, p_rate_keys, p_rate_rates, p_rate_bursts, p_rate_limits,
                       p_rate_windows) > 0 THEN
        PERFORM pgsemaphore.refuse('p_rate_kinds',
            'NULL with other p_rate_ arguments given: pass all seven, or none');
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
        -- 3. The rate limits, once every semaphore admitted: charged only
        -- if all admit; a refusal wrote nothing and undoes the claims.
        IF p_rate_kinds IS NOT NULL THEN
            SELECT r.o_allowed, r.o_wait_us, r.o_deciding INTO v_rate
              FROM pgsemaphore.rate_take_all(p_rate_kinds, p_rate_limiters, p_rate_keys, p_rate_rates,
                                             p_rate_bursts, p_rate_limits, p_rate_windows, 1,
                                             interval '0', v_order) r;
            IF NOT v_rate.o_allowed THEN
                o_rate_limit := v_rate.o_deciding;
                o_retry_in := make_interval(secs => v_rate.o_wait_us / 1e6);
                RAISE EXCEPTION 'claim_all refused by rate limit %', v_rate.o_deciding
                    USING ERRCODE = 'PGSA1';
            END IF;
        END IF;
        -- 4. Link the claims in the audit log: the first id names the group.
        UPDATE pgsemaphore.slots s SET group_id = o_ids[1] WHERE s.id = ANY (o_ids);
        o_status := 'claimed';
    EXCEPTION WHEN SQLSTATE 'PGSA1' THEN
        -- (Variables keep what the block set: a rate refusal set
        -- o_rate_limit and o_retry_in, a semaphore's set v_refusal.)
        IF o_rate_limit IS NOT NULL THEN
            o_status := 'rate_limited';
        ELSE
            o_status := v_refusal.o_status;
            o_capacity := v_refusal.o_capacity;
            o_free := v_refusal.o_free;
            o_retry_in := v_refusal.o_retry_in;
        END IF;
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

CREATE FUNCTION pgsemaphore.release(p_ids bigint[], p_token bytea, p_lost boolean DEFAULT false)
RETURNS TABLE (o_outcome text, o_id bigint, o_at timestamptz, o_wake boolean, o_semaphore text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Ends the claims p_ids of one permit (a weighted permit has several) that
-- carry p_token; never locks, changes or ends a claim that does not.
--   p_ids    1..100000 ids of claims of ONE semaphore (ids of claims of two
--            semaphores: 22023), no NULLs
--   p_token  16..64 bytes
--   p_lost   the holder was already told the permit is lost (its lease
--            could not be guaranteed), so its claims end as timed out,
--            never as completed: the audit log and the holder agree
-- Returns one row:
--   'released'   every id was the caller's live claim with its lease
--                running, and this call completed them (o_id NULL, o_at
--                when)
--   otherwise the outcome of the first id (by id) that was not (every live
--   claim of the caller among p_ids was still ended, as timed out when its
--   lease had ended or p_lost), o_id its id:
--   'not_holder' no claim with this id carries p_token (changed nothing
--                of it, locked nothing of it)
--   'timed_out'  reaped at o_at, or its lease had already ended (reaped now,
--                at o_at: a release after the lease never counts as one),
--                or p_lost
--   'completed'  already released at o_at
--   'missing'    no such claim
-- and o_wake: whether the caller must run pgsemaphore.wake(o_semaphore)
-- after this transaction commits, because a waiter may be registered (the
-- wake-up gate, pgsemaphore.gate); o_semaphore: the semaphore of the
-- caller's claims (NULL when none of p_ids was the caller's). Sends no NOTIFY itself: a NOTIFY would
-- hold its instance-wide lock through this durable commit.
-- Time is read after the row locks are granted: a release that waited for a
-- fence (Permit::fence) is stamped after the fenced work committed, and one
-- whose lease ended while it waited is a time-out.
-- Meets: renewals and fences of the same claims (row locks, taken in id
-- order by all three, so no deadlock); the reaper and claims reaping (SKIP
-- LOCKED on their side: a row this call has locked is never reaped under
-- it); a waiter registering (the gate); other callers' releases naming
-- these ids with another token (they lock nothing of them); a claim
-- committing an id that p_ids named in advance (not the caller's token: not
-- touched). Durable.
DECLARE
    v_hash      bytea;
    v_now       timestamptz;
    v_mine      bigint[];
    v_semaphore text;
    v_other     text;
    v_done      bigint[];
    v_ended     integer;
    r           record;
BEGIN
    IF p_ids IS NULL OR array_ndims(p_ids) IS DISTINCT FROM 1
       OR cardinality(p_ids) NOT BETWEEN 1 AND 100000 OR array_position(p_ids, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.checked_ids(p_ids);
    END IF;
    IF p_token IS NULL OR octet_length(p_token) NOT BETWEEN 16 AND 64 THEN
        PERFORM pgsemaphore.checked_token(p_token);
    END IF;
    IF p_lost IS NULL THEN
        PERFORM pgsemaphore.refuse('p_lost', 'true or false, got NULL');
    END IF;
    v_hash := sha256(p_token);
    PERFORM pgsemaphore.durable_commit();
    o_wake := false;

    -- 1. Lock the caller's own claims among p_ids, in id order (the order
    -- renew and fence lock in). The token condition is part of the scan:
    -- a row of anyone else is never locked.
    SELECT coalesce(array_agg(m.id), '{}'), min(m.semaphore), max(m.semaphore)
      INTO v_mine, v_semaphore, v_other
      FROM (SELECT s.id, s.semaphore
              FROM pgsemaphore.slots s
             WHERE s.id = ANY (p_ids) AND s.token_hash = v_hash
             ORDER BY s.id
               FOR UPDATE) m;
    IF v_semaphore <> v_other THEN
        PERFORM pgsemaphore.refuse('p_ids',
            format('claims of one semaphore, got claims of %s and %s',
                   quote_literal(v_semaphore), quote_literal(v_other)));
    END IF;

    -- 2. The clock, after the locks.
    v_now := clock_timestamp();

    -- 3. End every live claim of the caller's: completed if its lease runs
    -- and the holder was not told it was lost, else timed out.
    WITH ended AS (
        UPDATE pgsemaphore.slots s
           SET completed_at = CASE WHEN NOT p_lost AND s.expires_at > v_now THEN v_now END,
               timed_out_at = CASE WHEN p_lost OR s.expires_at <= v_now THEN v_now END
         WHERE s.id = ANY (v_mine) AND s.token_hash = v_hash
           AND s.completed_at IS NULL AND s.timed_out_at IS NULL
        RETURNING s.id, s.completed_at
    )
    SELECT coalesce(array_agg(e.id) FILTER (WHERE e.completed_at IS NOT NULL), '{}'), count(*)
      INTO v_done, v_ended
      FROM ended e;

    IF cardinality(v_done) = cardinality(p_ids) THEN
        o_outcome := 'released';
        o_at := v_now;
    ELSE
        -- 4. Say what stood in the way: the first id (by id) not completed
        -- now. Rows of others are read, never locked.
        SELECT i.id, s.id AS found, s.token_hash = v_hash AS mine, s.completed_at, s.timed_out_at
          INTO r
          FROM unnest(p_ids) AS i(id)
          LEFT JOIN pgsemaphore.slots s ON s.id = i.id
         WHERE i.id <> ALL (v_done)
         ORDER BY i.id
         LIMIT 1;
        IF r.id IS NULL THEN
            -- Only repeated ids were left: all released.
            o_outcome := 'released';
            o_at := v_now;
        ELSIF r.found IS NULL THEN
            o_outcome := 'missing';
            o_id := r.id;
        ELSIF NOT coalesce(r.mine, false) THEN
            o_outcome := 'not_holder';
            o_id := r.id;
        ELSIF r.timed_out_at IS NOT NULL THEN
            o_outcome := 'timed_out';
            o_id := r.id;
            o_at := r.timed_out_at;
        ELSE
            o_outcome := 'completed';
            o_id := r.id;
            o_at := r.completed_at;
        END IF;
    END IF;
    -- 5. Slots were freed: may a waiter need waking? (The gate.)
    o_semaphore := v_semaphore;
    IF v_ended > 0 THEN
        o_wake := pgsemaphore.gate(v_semaphore);
    END IF;
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

CREATE FUNCTION pgsemaphore.release_by_token(p_semaphore text, p_token bytea)
RETURNS TABLE (o_ended integer, o_wake boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- For a client whose claim's reply was lost (the connection broke after the
-- claim was sent): ends whatever live claims of p_semaphore carry p_token,
-- including one still in flight, so that a claim the client never saw does
-- not hold its slot for a whole lease. Returns how many it ended, and
-- o_wake: run pgsemaphore.wake(p_semaphore) after this commits.
--   p_semaphore  1..200 characters; p_token 16..64 bytes
-- A claim in flight: this share-locks the semaphore's row first (the row
-- every claim locks before it inserts), so a claim that holds it now has
-- committed (or failed) before this looks for its rows, and then writes a
-- tombstone of the token, so a claim that gets the row after this refuses
-- the token (pgsemaphore.claim, step 2). Either way no claim with this
-- token holds a slot once this has committed. The tombstone lasts a day
-- (pgsemaphore.reap deletes it then). The semaphore's row is waited for at
-- most lock_timeout (2 s): then SQLSTATE 55P03; call again.
-- Meets: claims (the semaphore row, above); renewals and fences of these
-- claims (row locks in id order); the reaper (SKIP LOCKED on its side).
-- Durable.
DECLARE
    v_hash  bytea;
    v_now   timestamptz;
BEGIN
    PERFORM pgsemaphore.checked_text(p_semaphore, 'p_semaphore', 200);
    PERFORM pgsemaphore.checked_token(p_token);
    v_hash := sha256(p_token);
    PERFORM pgsemaphore.durable_commit();
    o_wake := false;
    PERFORM 1 FROM pgsemaphore.semaphores s WHERE s.name = p_semaphore FOR SHARE;
    IF NOT FOUND THEN
        o_ended := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    v_now := clock_timestamp();
    INSERT INTO pgsemaphore.released_tokens (token_hash, semaphore, released_at, until)
    VALUES (v_hash, p_semaphore, v_now, v_now + interval '1 day')
    ON CONFLICT (token_hash) DO NOTHING;
    PERFORM 1 FROM pgsemaphore.live_slots l
     WHERE l.semaphore = p_semaphore AND l.token_hash = v_hash
     ORDER BY l.id FOR UPDATE;
    v_now := clock_timestamp();
    UPDATE pgsemaphore.slots s
       SET completed_at = CASE WHEN s.expires_at > v_now THEN v_now END,
           timed_out_at = CASE WHEN s.expires_at <= v_now THEN v_now END
     WHERE s.semaphore = p_semaphore AND s.token_hash = v_hash
       AND s.completed_at IS NULL AND s.timed_out_at IS NULL;
    GET DIAGNOSTICS o_ended = ROW_COUNT;
    IF o_ended > 0 THEN
        o_wake := pgsemaphore.gate(p_semaphore);
    END IF;
    RETURN NEXT;
END;
$$;

CREATE FUNCTION pgsemaphore.renew(p_ids bigint[], p_token bytea, p_lease interval)
RETURNS TABLE (o_id bigint, o_outcome text, o_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Renews the caller's claims p_ids (those carrying p_token) to end p_lease
-- from now, never earlier than they already end.
--   p_ids 1..100000 ids, no NULLs; p_token 16..64 bytes; p_lease 10 ms..366 days
-- Exactly one row per distinct id of p_ids:
--   'renewed'    live and unexpired; o_at = its expires_at now
--   'timed_out'  reaped (now, because its lease had ended, or earlier);
--                o_at = timed_out_at
--   'completed'  released; o_at = completed_at
--   'missing'    no such claim
--   'not_holder' the token does not match (nothing locked or changed)
-- A client must treat every outcome but 'renewed', and any id it does not
-- get back, as the permit lost.
-- The clock is read after the row locks are granted, and a lease only moves
-- forward (greatest): two renewals of one claim that reach its lock out of
-- order (a retry while the first still runs on the server) never shorten it.
-- Meets: releases and fences (row locks in id order); the reaper and claims
-- reaping (SKIP LOCKED: a row locked here is counted as held by them, never
-- reaped under it); other callers naming these ids with another token
-- (they lock nothing of them). Durable.
DECLARE
    v_hash bytea;
    v_now  timestamptz;
BEGIN
    IF p_ids IS NULL OR array_ndims(p_ids) IS DISTINCT FROM 1
       OR cardinality(p_ids) NOT BETWEEN 1 AND 100000 OR array_position(p_ids, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.checked_ids(p_ids);
    END IF;
    IF p_token IS NULL OR octet_length(p_token) NOT BETWEEN 16 AND 64 THEN
        PERFORM pgsemaphore.checked_token(p_token);
    END IF;
    IF p_lease IS NULL OR p_lease < interval '10 ms' OR p_lease > interval '366 days' THEN
        PERFORM pgsemaphore.checked_interval(p_lease, 'p_lease', interval '10 ms', interval '366 days');
    END IF;
    v_hash := sha256(p_token);
    PERFORM pgsemaphore.durable_commit();
    PERFORM 1 FROM pgsemaphore.slots s
     WHERE s.id = ANY (p_ids) AND s.token_hash = v_hash
     ORDER BY s.id FOR UPDATE;
    -- One instant for every claim of the permit, read after the locks.
    v_now := clock_timestamp();
    RETURN QUERY
        UPDATE pgsemaphore.slots s
           SET expires_at = greatest(s.expires_at, v_now + p_lease)
         WHERE s.id = ANY (p_ids) AND s.token_hash = v_hash
           AND s.completed_at IS NULL AND s.timed_out_at IS NULL
           AND s.expires_at > v_now
        RETURNING s.id, 'renewed'::text, s.expires_at;
    -- Live claims whose lease already ended: reaped now, never revived.
    UPDATE pgsemaphore.slots s
       SET timed_out_at = v_now
     WHERE s.id = ANY (p_ids) AND s.token_hash = v_hash
       AND s.completed_at IS NULL AND s.timed_out_at IS NULL
       AND s.expires_at <= v_now;
    RETURN QUERY
        SELECT i.id,
               CASE WHEN s.id IS NULL THEN 'missing'
                    WHEN s.token_hash IS DISTINCT FROM v_hash THEN 'not_holder'
                    WHEN s.timed_out_at IS NOT NULL THEN 'timed_out'
                    ELSE 'completed' END,
               CASE WHEN s.token_hash IS DISTINCT FROM v_hash THEN NULL
                    ELSE coalesce(s.timed_out_at, s.completed_at) END
          FROM (SELECT DISTINCT u.id FROM unnest(p_ids) AS u(id)) AS i
          LEFT JOIN pgsemaphore.slots s ON s.id = i.id
         WHERE s.id IS NULL OR s.token_hash IS DISTINCT FROM v_hash
            OR s.completed_at IS NOT NULL OR s.timed_out_at IS NOT NULL;
END;
$$;

CREATE FUNCTION pgsemaphore.fence(p_ids bigint[], p_token bytea)
RETURNS TABLE (o_id bigint, o_outcome text, o_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Fences a write: inside the caller's transaction, share-locks each of the
-- caller's claims among p_ids (those carrying p_token; in id order) and
-- reports it. While that transaction lasts a release waits for it and
-- reapers and claims skip the rows and count them as held, so work
-- committed in it happened while the permit held its slots.
--   p_ids 1..100000 ids, no NULLs; p_token 16..64 bytes
-- Exactly one row per distinct id: 'held' (live, lease running), 'expired'
-- (live, lease ended: any reaper may take it once this transaction ends),
-- 'timed_out', 'completed' (o_at set), 'missing', 'not_holder' (not
-- locked). A client must treat every outcome but 'held', and any id it does
-- not get back, as the permit lost.
-- Meets: releases and renewals of the same claims (row locks in id order);
-- the reaper and claims (SKIP LOCKED: they count a fenced row as held).
DECLARE
    v_hash bytea;
BEGIN
    IF p_ids IS NULL OR array_ndims(p_ids) IS DISTINCT FROM 1
       OR cardinality(p_ids) NOT BETWEEN 1 AND 100000 OR array_position(p_ids, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.checked_ids(p_ids);
    END IF;
    IF p_token IS NULL OR octet_length(p_token) NOT BETWEEN 16 AND 64 THEN
        PERFORM pgsemaphore.checked_token(p_token);
    END IF;
    v_hash := sha256(p_token);
    PERFORM 1 FROM pgsemaphore.slots s
     WHERE s.id = ANY (p_ids) AND s.token_hash = v_hash
     ORDER BY s.id FOR SHARE;
    RETURN QUERY
        SELECT i.id,
               CASE WHEN s.id IS NULL THEN 'missing'
                    WHEN s.token_hash IS DISTINCT FROM v_hash THEN 'not_holder'
                    WHEN s.timed_out_at IS NOT NULL THEN 'timed_out'
                    WHEN s.completed_at IS NOT NULL THEN 'completed'
                    WHEN s.expires_at <= clock_timestamp() THEN 'expired'
                    ELSE 'held' END,
               CASE WHEN s.token_hash IS DISTINCT FROM v_hash THEN NULL
                    ELSE coalesce(s.timed_out_at, s.completed_at) END
          FROM (SELECT DISTINCT u.id FROM unnest(p_ids) AS u(id)) AS i
          LEFT JOIN pgsemaphore.slots s ON s.id = i.id
         ORDER BY i.id;
END;
$$;

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
