-- pg-semaphore, schema version 2: the application functions as a security
-- boundary.
--
-- Version 1 trusted its arguments more than a boundary may. An application
-- role calling the functions directly (or a buggy client of the same
-- schema) could end or lock another caller's claim, exceed the capacity
-- with a negative reserve, jump a queue with another semaphore's ticket,
-- stall a semaphore with a 100-year waiter lease, and lose a wake-up in
-- leave_queue and reap. This migration replaces every application function
-- and most operator ones. What changes for a caller:
--
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
--   * claim no longer takes p_lifo: the queue's order is the semaphore's
--     (semaphores.queue_lifo, set by open when it creates the semaphore and
--     by configure). open and configure take it as a new last argument.
--   * release_by_token returns (o_ended, o_wake) and leaves a tombstone of
--     the token, so that a claim with that token still in flight (waiting
--     for the semaphore's row) is refused when it gets there.
--   * Functions that lock a semaphore's row or its wake-up gate bound their
--     wait with lock_timeout (2 s): a transaction left open after a claim or
--     an enqueue delays every other claim of that semaphore by at most that,
--     and they fail with SQLSTATE 55P03 instead of hanging.
--   * New operator function clear_queue(semaphore).
--   * schema_version() returns (2, 2): code built for version 1 calls
--     signatures that no longer exist.
--
-- Grants. open, claim, release_by_token, configure are dropped and created
-- again with new signatures, and clear_queue is new: re-run the README's
-- grants after upgrading (the other functions are replaced in place and
-- keep theirs).
--
-- Where each function's contract is: in its body, as the first lines, so
-- that it survives in pg_dump's output (schema/pgsemaphore.sql) and in
-- `\sf` from psql.

-- ---------------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------------

-- The order of a semaphore's queue (FIFO unless true), a property of the
-- semaphore rather than of each call.
ALTER TABLE pgsemaphore.semaphores
    ADD COLUMN queue_lifo boolean NOT NULL DEFAULT false;

-- Tokens released by pgsemaphore.release_by_token: a claim that comes with
-- one of them is refused (its client gave up on it and released it before
-- it committed). Kept until `until`, then deleted by pgsemaphore.reap. Rare:
-- written only when a claim's reply was lost.
CREATE TABLE pgsemaphore.released_tokens (
    token_hash  bytea       PRIMARY KEY,
    semaphore   text        NOT NULL,
    released_at timestamptz NOT NULL,
    until       timestamptz NOT NULL
);

-- ---------------------------------------------------------------------------
-- Internal helpers (not granted to anyone)
-- ---------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 2, 2 $$;

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

CREATE FUNCTION pgsemaphore.gate(p_semaphore text)
RETURNS boolean
LANGUAGE plpgsql
AS $$
-- THE WAKE-UP GATE, the one mechanism by which a transaction that frees
-- capacity or moves a queue's head decides, inside itself, whether a
-- waiter may need a wake-up. Call it after the transaction's changes; it
-- returns true when one may: a registration is in force, or one is being
-- written right now, or the check cannot be trusted (not READ COMMITTED).
--
-- The race it closes: a transaction R that freed a slot and looked for
-- registered waiters inside itself could miss a waiter W that registers and
-- then claims while R is uncommitted: R's check does not see W's
-- registration, W's claim does not see R's change, and W sleeps until its
-- fallback re-check. The gate is a transaction-scoped advisory lock per
-- semaphore (key: the class 1885828965, 'pgse', and hashtext of the name;
-- the README asks Mutex users to keep out of that class).
-- pgsemaphore.keep_waiting takes it in exclusive mode after writing a
-- registration, and holds it until that commits. R *tries* it in shared
-- mode, never waiting:
--   * R gets it: any registration W not yet at the gate waits for R to end,
--     so W commits after R, and W's claim, which follows its registration,
--     sees R's change; any W that passed the gate committed before R took
--     it, and R's check (a statement of its own, so a snapshot taken after
--     the gate under READ COMMITTED) sees W's registration.
--   * R does not get it: a registration is being written right now, so
--     R answers true: its wake-up then goes out (at R's commit, or from the
--     check after it, pgsemaphore.notify_if_waited), at the cost of one
--     spurious notification at worst.
-- Under REPEATABLE READ or SERIALIZABLE a statement gets no new snapshot,
-- so the check cannot be trusted: true.
-- Any role may take an advisory lock: a session holding the gate
-- exclusively makes every release of that semaphore notify (it cannot make
-- one miss a waiter), and one holding it shared makes registrations wait
-- for their lock_timeout and fail (the waiters then fall back to polling).
-- Neither can admit too many.
--
-- Every path that frees capacity or moves a queue's head, and how it wakes:
--   release          gate inside; o_wake: the caller (release_then_wake)
--                    sends pgsemaphore.wake(o_semaphore) after its commit
--   release_by_token gate inside; o_wake: the caller sends pgsemaphore.wake
--                    after its commit
--   claim            (reaps expired claims, drops dead waiters, leaves
--                    slots for the next head) o_wake: the caller sends
--                    pgsemaphore.wake after its commit, which checks in a
--                    transaction of its own (notify_if_waited: after the
--                    commit, a registration it misses was written after the
--                    change, and its claim sees the change)
--   enqueue          (drops dead waiters) o_wake, the same
--   reap             gate inside, NOTIFY at its commit (wake_at_commit)
--   leave_queue      gate inside, NOTIFY at its commit (wake_at_commit)
--   force_release    gate inside, NOTIFY at its commit (wake_at_commit)
--   configure        (capacity raised, order changed) wake_at_commit
--   clear_queue      wake_at_commit
--   a waiter's lease ending (its process died): nobody is notified; every
--                    claim refused behind it was told when that lease ends
--                    (o_retry_in) and looks again then
--   a claim's lease ending: the same (o_retry_in is the earliest lease end)
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN true;
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(1885828965, hashtext(p_semaphore)) THEN
        RETURN true;
    END IF;
    -- A statement of its own: its snapshot is taken after the gate.
    RETURN EXISTS (SELECT 1 FROM pgsemaphore.wakeups w
                    WHERE w.semaphore = p_semaphore AND w.until > clock_timestamp());
END;
$$;

-- For transactions that may NOTIFY before their commit (hint transactions,
-- operator actions): asks the gate, and if a waiter may need it, queues the
-- semaphore's NOTIFY, which PostgreSQL sends when this transaction commits.
-- Returns whether it did.
CREATE FUNCTION pgsemaphore.wake_at_commit(p_semaphore text)
RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_semaphore IS NOT NULL AND pgsemaphore.gate(p_semaphore) THEN
        PERFORM pg_notify('pgsemaphore', p_semaphore);
        RETURN true;
    END IF;
    RETURN false;
END;
$$;

-- notify_if_waited (version 1, unchanged) is the other half: the check
-- after the commit, in a transaction of its own, used by wake and
-- wake_claimed.

-- ---------------------------------------------------------------------------
-- Application functions
-- ---------------------------------------------------------------------------

DROP FUNCTION pgsemaphore.open(text, integer, interval);

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
    -- refuses a family key's name: since version 7 they are families'.)
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

DROP FUNCTION pgsemaphore.claim(text, text, interval, jsonb, bytea, integer, smallint, integer,
                                bigint, bytea, boolean, interval);

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
--                  (queue_lifo).
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
-- sees every claim committed before the row lock was granted.
-- Meets: other claims (serialised on the semaphore row); releases in flight
-- (their row is still live in our snapshot: counted, the slot looks taken;
-- a waiter that registers after this refusal is covered by the wake-up
-- gate, see pgsemaphore.gate); renewals in flight and fences past their
-- lease (locked rows: counted, step 4); the reaper (SKIP LOCKED on both
-- sides: a row is reaped once); a capacity or order change
-- (pgsemaphore.configure locks the same row); enqueue, queue renewals and
-- clear_queue (the waiter rows; enqueue and clear_queue also lock the
-- semaphore row, so the queue check under the lock sees every waiter);
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
        RAISE EXCEPTION 'pg_semaphore.claim needs READ COMMITTED isolation, the session uses %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
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
    -- nobody is ahead of this claim. enqueue sets queue_used under this
    -- lock, so a false here means no waiter row exists.
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
           AND w.priority = p_priority AND w.permits = p_permits;
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
                OR (NOT v_lifo AND w.id < p_ticket)
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

DROP FUNCTION pgsemaphore.release(bigint[], bytea, boolean);

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

DROP FUNCTION pgsemaphore.release_by_token(text, bytea);

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

CREATE OR REPLACE FUNCTION pgsemaphore.renew(p_ids bigint[], p_token bytea, p_lease interval)
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

CREATE OR REPLACE FUNCTION pgsemaphore.fence(p_ids bigint[], p_token bytea)
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

CREATE OR REPLACE FUNCTION pgsemaphore.enqueue(
    p_semaphore    text,
    p_permits      integer,
    p_priority     smallint,
    p_holder       text,
    p_limit        integer,
    p_waiter_lease interval,
    p_token        bytea
)
RETURNS TABLE (o_ticket bigint, o_wake boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- Joins the queue: returns the waiter's id (its ticket, its place), or NULL
-- when p_limit live waiters are queued already, and whether it removed dead
-- waiters (the caller then runs pgsemaphore.wake after this commits).
--   p_semaphore an existing semaphore (else P0002); p_permits 1..100000;
--   p_priority 0 or 1; p_holder 1..1000 characters; p_limit NULL (no limit)
--   or 0..2147483647; p_waiter_lease 1 s..60 s (the row is ignored, and
--   deleted by the next claim, enqueue or reap, unless renewed within it:
--   pgsemaphore.keep_waiting, or a claim with the ticket); p_token 16..64
--   bytes (only its holder may claim with, renew or leave the ticket)
-- Serialised with claims on the semaphore's row (waited for at most
-- lock_timeout, 2 s, then 55P03), so the limit is exact. A waiter row is a
-- hint, not a claim: its commit does not wait for a WAL flush (a crash loses
-- at most a place in the queue, which the waiter notices as 'no_ticket' and
-- takes again).
DECLARE
    v_now     timestamptz;
    v_count   integer;
    v_dropped integer;
BEGIN
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
    PERFORM pgsemaphore.fast_commit();
    PERFORM 1 FROM pgsemaphore.semaphores s WHERE s.name = p_semaphore FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_semaphore)
            USING ERRCODE = 'no_data_found';
    END IF;
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
    INSERT INTO pgsemaphore.waiters (semaphore, permits, priority, holder, enqueued_at, expires_at, token_hash)
    VALUES (p_semaphore, p_permits, p_priority, p_holder, v_now, v_now + p_waiter_lease, sha256(p_token))
    RETURNING id INTO o_ticket;
    UPDATE pgsemaphore.semaphores s SET queue_used = true WHERE s.name = p_semaphore AND NOT s.queue_used;
    RETURN NEXT;
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.leave_queue(p_ticket bigint, p_token bytea)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Leaves the queue (a cancelled waiter): deletes the caller's waiter row
-- p_ticket (if p_token is its token) and, since the head may have moved,
-- wakes the semaphore's waiters through the wake-up gate (pgsemaphore.gate:
-- a waiter registering while this is uncommitted is never missed). Returns
-- whether the row was the caller's and is gone now.
--   p_ticket not NULL; p_token 16..64 bytes
-- A hint transaction: no WAL flush awaited, so the NOTIFY holds its lock
-- only briefly.
DECLARE
    v_semaphore text;
BEGIN
    IF p_ticket IS NULL THEN
        PERFORM pgsemaphore.refuse('p_ticket', 'a waiter id, got NULL');
    END IF;
    PERFORM pgsemaphore.checked_token(p_token);
    PERFORM pgsemaphore.fast_commit();
    DELETE FROM pgsemaphore.waiters w
     WHERE w.id = p_ticket AND w.token_hash = sha256(p_token)
    RETURNING w.semaphore INTO v_semaphore;
    IF v_semaphore IS NULL THEN
        RETURN false;
    END IF;
    PERFORM pgsemaphore.wake_at_commit(v_semaphore);
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.keep_waiting(p_semaphore text, p_lease interval,
                                                    p_tickets bigint[], p_token bytea,
                                                    p_register boolean, p_spell bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- A process that has acquires (or wait_idle calls) waiting on p_semaphore
-- registers for wake-ups until p_lease from now, for its waiting spell
-- p_spell (unless p_register is false: behind a transaction pooler nothing
-- can LISTEN), and renews the leases of its queued waiters p_tickets (those
-- carrying p_token whose lease has not ended: a waiter whose lease ended is
-- gone for everyone else and stays gone). Called before the claim that
-- precedes a process's first wait, then every third of p_lease while anyone
-- there waits. A registration is written only when it would otherwise end
-- within two thirds of p_lease.
--   p_semaphore 1..200 characters; p_lease 1 s..60 s; p_tickets 0..10000
--   ids, no NULLs; p_token 16..64 bytes (the process's: one registration per
--   process and semaphore); p_register, p_spell not NULL
-- Ticket rows are locked in id order, skipping any a claim holds right now,
-- so it never deadlocks with a claim deleting them. A registration written
-- here takes the wake-up gate in exclusive mode last (see pgsemaphore.gate):
-- it commits only after every release of p_semaphore that checked for
-- waiters without seeing it has ended, so the claim that follows sees what
-- those releases freed. The gate is waited for at most lock_timeout (2 s):
-- then 55P03, nothing is registered, and the process relies on its fallback
-- re-check until a renewal gets through. A hint transaction.
DECLARE
    v_until timestamptz;
    v_hash  bytea;
BEGIN
    PERFORM pgsemaphore.checked_text(p_semaphore, 'p_semaphore', 200);
    PERFORM pgsemaphore.checked_interval(p_lease, 'p_lease', interval '1 s', interval '60 s');
    IF p_tickets IS NULL OR cardinality(p_tickets) > 10000
       OR (cardinality(p_tickets) > 0 AND array_ndims(p_tickets) <> 1)
       OR array_position(p_tickets, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.refuse('p_tickets',
            'zero to 10000 waiter ids, in a one-dimensional array without NULLs');
    END IF;
    PERFORM pgsemaphore.checked_token(p_token);
    IF p_register IS NULL THEN
        PERFORM pgsemaphore.refuse('p_register', 'true or false, got NULL');
    END IF;
    IF p_spell IS NULL THEN
        PERFORM pgsemaphore.refuse('p_spell', 'a waiting spell, got NULL');
    END IF;
    v_hash := sha256(p_token);
    PERFORM pgsemaphore.fast_commit();
    v_until := clock_timestamp() + p_lease;
    IF p_register THEN
        INSERT INTO pgsemaphore.wakeups AS k (semaphore, process, spell, until)
        VALUES (p_semaphore, v_hash, p_spell, v_until)
        ON CONFLICT (semaphore, process) DO UPDATE SET until = excluded.until, spell = excluded.spell
         WHERE k.until < excluded.until - p_lease / 3 OR k.spell <> excluded.spell;
    END IF;
    IF cardinality(p_tickets) > 0 THEN
        UPDATE pgsemaphore.waiters w
           SET expires_at = greatest(w.expires_at, v_until)
          FROM (SELECT d.id FROM pgsemaphore.waiters d
                 WHERE d.id = ANY (p_tickets) AND d.token_hash = v_hash
                   AND d.expires_at > clock_timestamp()
                 ORDER BY d.id FOR UPDATE SKIP LOCKED) live
         WHERE w.id = live.id;
    END IF;
    IF p_register THEN
        -- Last, so the gate is held only for the commit.
        PERFORM pg_advisory_xact_lock(1885828965, hashtext(p_semaphore));
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.stop_waiting(p_semaphore text, p_token bytea, p_spell bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- The process's last waiter on p_semaphore left: it stops registering, so
-- releases stop notifying (unless another process waits). Only the row of
-- the caller's token and spell p_spell: a newer spell's registration stays.
--   p_semaphore 1..200 characters; p_token 16..64 bytes; p_spell not NULL
-- A hint transaction.
BEGIN
    PERFORM pgsemaphore.checked_text(p_semaphore, 'p_semaphore', 200);
    PERFORM pgsemaphore.checked_token(p_token);
    IF p_spell IS NULL THEN
        PERFORM pgsemaphore.refuse('p_spell', 'a waiting spell, got NULL');
    END IF;
    PERFORM pgsemaphore.fast_commit();
    DELETE FROM pgsemaphore.wakeups k
     WHERE k.semaphore = p_semaphore AND k.process = sha256(p_token) AND k.spell = p_spell;
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.wake(p_semaphore text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Sends the semaphore's wake-up if anyone waits for it (see
-- pgsemaphore.notify_if_waited); run it in a transaction of its own after
-- the one that freed slots (the o_wake of claim, enqueue,
-- release_by_token). Returns whether it notified. p_semaphore not NULL.
-- Anyone may NOTIFY anyway: this grants nothing new.
BEGIN
    IF p_semaphore IS NULL THEN
        PERFORM pgsemaphore.refuse('p_semaphore', 'a semaphore name, got NULL');
    END IF;
    RETURN pgsemaphore.notify_if_waited(p_semaphore);
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.wake_claimed(p_claim bigint)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- The same for the semaphore of claim p_claim: what a release sends, in the
-- same round trip as its own (committed) transaction, knowing only the id.
-- (PL/pgSQL, like every function on a hot path here: a LANGUAGE sql
-- function that cannot be inlined is planned again on every call.)
BEGIN
    IF p_claim IS NULL THEN
        PERFORM pgsemaphore.refuse('p_claim', 'a claim id, got NULL');
    END IF;
    RETURN pgsemaphore.notify_if_waited(
        (SELECT s.semaphore FROM pgsemaphore.slots s WHERE s.id = p_claim));
END;
$$;

CREATE OR REPLACE PROCEDURE pgsemaphore.release_then_wake(
    p_ids bigint[], p_token bytea, p_lost boolean,
    INOUT o_outcome text DEFAULT NULL, INOUT o_id bigint DEFAULT NULL,
    INOUT o_at timestamptz DEFAULT NULL)
LANGUAGE plpgsql
AS $$
-- The release as the crate sends it, one statement: pgsemaphore.release,
-- and only if it says a waiter may be registered (o_wake), COMMIT (durable)
-- and pgsemaphore.wake of the released claims' semaphore in a transaction
-- of its own (fast), so the NOTIFY is sent after the release committed and
-- never holds its instance-wide lock through the release's WAL flush. A
-- release nobody waits for is one transaction: its check ran inside it,
-- under the wake-up gate (pgsemaphore.gate). One statement can be prepared
-- once per connection; the same steps as a simple-protocol batch were
-- parsed and planned on every release.
-- A procedure, because only a procedure may commit; and so with the
-- caller's rights, because a procedure that commits may have neither
-- SECURITY DEFINER nor a SET clause. It only calls two functions that the
-- application may call anyway, by their qualified names, so a caller's
-- search_path cannot change what it runs. CALL it outside a transaction
-- block (it may commit). Arguments and outcomes: pgsemaphore.release.
-- Meets: what release and notify_if_waited meet.
DECLARE
    v_wake      boolean;
    v_semaphore text;
BEGIN
    SELECT r.o_outcome, r.o_id, r.o_at, r.o_wake, r.o_semaphore
      INTO o_outcome, o_id, o_at, v_wake, v_semaphore
      FROM pgsemaphore.release(p_ids => p_ids, p_token => p_token, p_lost => p_lost) r;
    IF v_wake THEN
        COMMIT;
        PERFORM pgsemaphore.wake(p_semaphore => v_semaphore);
    END IF;
END;
$$;

-- Rate limiters: the arithmetic of version 1 is unchanged. Each function
-- becomes <name>_unchecked, with the caller's rights and no SET clause of
-- its own (it runs inside the checked function's), reachable by nobody
-- else; the function of the old name checks every argument first, then
-- calls it.
ALTER FUNCTION pgsemaphore.token_bucket(text, text, double precision, double precision, double precision)
    RENAME TO token_bucket_unchecked;
ALTER FUNCTION pgsemaphore.fixed_window(text, text, bigint, interval, bigint)
    RENAME TO fixed_window_unchecked;
ALTER FUNCTION pgsemaphore.sliding_window(text, text, bigint, interval, bigint)
    RENAME TO sliding_window_unchecked;
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT p.oid::regprocedure AS fn, a.grantee::regrole AS grantee
          FROM pg_proc p
          JOIN pg_namespace n ON n.oid = p.pronamespace
         CROSS JOIN LATERAL aclexplode(p.proacl) a
         WHERE n.nspname = 'pgsemaphore'
           AND p.proname IN ('token_bucket_unchecked', 'fixed_window_unchecked', 'sliding_window_unchecked')
           AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM %s', r.fn, r.grantee);
    END LOOP;
END;
$$;
ALTER FUNCTION pgsemaphore.token_bucket_unchecked(text, text, double precision, double precision, double precision)
    SECURITY INVOKER RESET ALL;
ALTER FUNCTION pgsemaphore.fixed_window_unchecked(text, text, bigint, interval, bigint)
    SECURITY INVOKER RESET ALL;
ALTER FUNCTION pgsemaphore.sliding_window_unchecked(text, text, bigint, interval, bigint)
    SECURITY INVOKER RESET ALL;

-- The limiter's name and the key, as every check takes them.
CREATE FUNCTION pgsemaphore.check_limiter_key(p_limiter text, p_key text)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_limiter IS NULL OR char_length(p_limiter) NOT BETWEEN 1 AND 200 THEN
        PERFORM pgsemaphore.checked_text(p_limiter, 'p_limiter', 200);
    END IF;
    IF p_key IS NULL OR char_length(p_key) NOT BETWEEN 1 AND 256 THEN
        PERFORM pgsemaphore.checked_text(p_key, 'p_key', 256);
    END IF;
END;
$$;

-- A window limiter's limit, window and permits.
CREATE FUNCTION pgsemaphore.check_window(p_limit bigint, p_window interval, p_n bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    -- (At most 1e15, as a bucket's burst: every count and every sum of two
    -- stays exact in a double and far inside a bigint.)
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 1000000000000000 THEN
        PERFORM pgsemaphore.refuse('p_limit', format('1 to 1e15, got %s', coalesce(p_limit::text, 'NULL')));
    END IF;
    PERFORM pgsemaphore.checked_interval(p_window, 'p_window', interval '1 ms', interval '366 days');
    IF p_n IS NULL OR p_n NOT BETWEEN 1 AND p_limit THEN
        PERFORM pgsemaphore.refuse('p_n', format('1 to the limit (%s), got %s', p_limit, coalesce(p_n::text, 'NULL')));
    END IF;
END;
$$;

CREATE FUNCTION pgsemaphore.token_bucket(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision, p_n double precision)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- TOKEN BUCKET (Stripe's request rate limiter, with the database's clock),
-- per key: see pgsemaphore.token_bucket_unchecked for the arithmetic.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_rate finite,
--   above 0, at most 1e9 tokens per second; p_burst finite, 1 to 1e15, and
--   refilled from empty within 366 days; p_n finite, 1 to p_burst
-- Every bad argument raises 22023 naming it in COLUMN.
BEGIN
    PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    IF p_rate IS NULL OR NOT (p_rate > 0 AND p_rate <= 1e9) THEN
        PERFORM pgsemaphore.refuse('p_rate', format('above 0 and at most 1e9, got %s', coalesce(p_rate::text, 'NULL')));
    END IF;
    IF p_burst IS NULL OR NOT (p_burst >= 1 AND p_burst <= 1e15) OR p_burst / p_rate > 366 * 86400 THEN
        PERFORM pgsemaphore.refuse('p_burst',
            format('1 to 1e15, refilled within 366 days at the rate, got %s', coalesce(p_burst::text, 'NULL')));
    END IF;
    IF p_n IS NULL OR NOT (p_n >= 1 AND p_n <= p_burst) THEN
        PERFORM pgsemaphore.refuse('p_n', format('1 to the burst (%s), got %s', p_burst, coalesce(p_n::text, 'NULL')));
    END IF;
    RETURN QUERY SELECT * FROM pgsemaphore.token_bucket_unchecked(p_limiter, p_key, p_rate, p_burst, p_n);
END;
$$;

CREATE FUNCTION pgsemaphore.fixed_window(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- FIXED WINDOW, per key: see pgsemaphore.fixed_window_unchecked.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_limit at least
--   1; p_window 1 ms..366 days; p_n 1 to p_limit
BEGIN
    PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    RETURN QUERY SELECT * FROM pgsemaphore.fixed_window_unchecked(p_limiter, p_key, p_limit, p_window, p_n);
END;
$$;

CREATE FUNCTION pgsemaphore.sliding_window(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- SLIDING WINDOW, per key: see pgsemaphore.sliding_window_unchecked.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_limit at least
--   1; p_window 1 ms..366 days; p_n 1 to p_limit
BEGIN
    PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    RETURN QUERY SELECT * FROM pgsemaphore.sliding_window_unchecked(p_limiter, p_key, p_limit, p_window, p_n);
END;
$$;

-- ---------------------------------------------------------------------------
-- Operator functions
-- ---------------------------------------------------------------------------

DROP FUNCTION pgsemaphore.configure(text, integer, interval, boolean);

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

CREATE OR REPLACE FUNCTION pgsemaphore.force_release(p_id bigint)
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

CREATE OR REPLACE FUNCTION pgsemaphore.reap()
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Marks every expired live claim (of every semaphore) timed out, deletes
-- queue waiters whose process stopped renewing them, wakes the semaphores
-- that gained room or lost a waiter (through the wake-up gate,
-- wake_at_commit: a waiter registering while this is uncommitted is never
-- missed), deletes ended registrations and tombstones, and returns how many
-- claims it reaped.
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
    RETURN v_total;
END;
$$;

-- prune and prune_rate_limits: the same, with their arguments checked.
ALTER FUNCTION pgsemaphore.prune(interval, integer) RENAME TO prune_unchecked;
ALTER FUNCTION pgsemaphore.prune_unchecked(interval, integer) SECURITY INVOKER RESET ALL;
ALTER FUNCTION pgsemaphore.prune_rate_limits(interval, text, text, text, integer)
    RENAME TO prune_rate_limits_unchecked;
ALTER FUNCTION pgsemaphore.prune_rate_limits_unchecked(interval, text, text, text, integer)
    SECURITY INVOKER RESET ALL;
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT p.oid::regprocedure AS fn, a.grantee::regrole AS grantee
          FROM pg_proc p
          JOIN pg_namespace n ON n.oid = p.pronamespace
         CROSS JOIN LATERAL aclexplode(p.proacl) a
         WHERE n.nspname = 'pgsemaphore'
           AND p.proname IN ('prune_unchecked', 'prune_rate_limits_unchecked')
           AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM %s', r.fn, r.grantee);
    END LOOP;
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
-- (pgsemaphore.prune_advisory_claims, version 3): at most p_batch rows in
-- all per call; a caller repeats it until it returns less than p_batch.
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
    RETURN v_count;
END;
$$;

CREATE FUNCTION pgsemaphore.prune_rate_limits(
    p_idle_for interval, p_kind text, p_limiter text, p_key text, p_batch integer)
RETURNS TABLE (o_deleted bigint, o_kind text, o_limiter text, o_key text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Deletes rate-limit keys at rest since at least p_idle_for, p_batch rows
-- looked at per call, from the cursor (p_kind, p_limiter, p_key) on (see
-- pgsemaphore.prune_rate_limits_unchecked).
--   p_idle_for 0..100 years; the cursor: three NULLs or three values;
--   p_batch 1..1000000
BEGIN
    PERFORM pgsemaphore.checked_interval(p_idle_for, 'p_idle_for', interval '0', interval '100 years');
    IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 1000000 THEN
        PERFORM pgsemaphore.refuse('p_batch', format('1 to 1000000, got %s', coalesce(p_batch::text, 'NULL')));
    END IF;
    RETURN QUERY SELECT * FROM pgsemaphore.prune_rate_limits_unchecked(
        p_idle_for, p_kind, p_limiter, p_key, p_batch);
END;
$$;

-- ---------------------------------------------------------------------------
-- Privileges: as in version 1, nobody but the owner runs anything until
-- granted (the README lists the grants; re-run them after this migration).
-- ---------------------------------------------------------------------------

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
