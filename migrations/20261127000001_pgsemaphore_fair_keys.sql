-- pg-semaphore, schema version 5: fairness keys in the fair queue.
--
-- In a FIFO queue, one tenant that queued 10,000 waiters made a tenant with
-- one waiter wait behind all of them. A waiter now carries a fairness key
-- (a tenant, say; NULL is the one shared default key), and waiters of
-- different keys take turns: a key with one waiter is served within one
-- turn of the rotation, however many waiters another key has; within a
-- key, arrival order; priority first, as before. The rule (start-time fair
-- queuing with integer turns), kept by pgsemaphore.enqueue and read by
-- pgsemaphore.claim:
--   * each waiter has a turn, fixed when it queues: the larger of the
--     smallest turn queued at its priority (0 if none) and one more than
--     the largest turn of its own key at its priority (0 if none);
--   * a FIFO queue serves high priority first, then the smallest turn,
--     then the smallest id. Turns within a key ascend, so a key's waiters
--     keep their arrival order; a key with nobody queued starts at the
--     smallest turn queued, so it waits behind at most one waiter of each
--     other key (the one at that turn, if it arrived earlier). Without
--     fairness keys (every waiter NULL) turns ascend with ids: the order is
--     arrival order, exactly as before;
--   * a LIFO queue serves the newest first and ignores keys and turns.
-- What changes for a caller:
--   * pgsemaphore.waiters gains fair_key (NULL or 1..200 characters) and
--     turn; waiters queued before this migration get turns in their
--     arrival order (per semaphore and priority), so no place changes;
--   * pgsemaphore.enqueue gains p_fair_key text DEFAULT NULL (NULL or 1..200
--     characters, else 22023 naming p_fair_key) and returns o_turn. The
--     seven-argument signature is dropped, so every call of version 2's
--     shape (positional or named) resolves to the new one, unambiguously;
--     it keeps the old signature's grants (copied below): no grants to
--     re-run;
--   * pgsemaphore.claim orders FIFO queues by (priority, turn, id); its
--     signature and grants are unchanged;
--   * the queue's index is now (semaphore, priority, turn, id), the FIFO
--     order, and a second one finds a key's last turn;
--   * schema_version() returns (5, 2): code built for versions 2 to 4 works
--     against it unchanged (its waiters all carry the NULL key).

CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 5, 2 $$;

-- ---------------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------------

-- fair_key: the waiter's fairness key (NULL: the shared default key).
-- turn: its place in the rotation of keys, fixed when it queues (see
-- pgsemaphore.enqueue). Existing waiters: 0, 1, 2, ... in id order per
-- semaphore and priority, which is the order they are served in now. The
-- default, 0, is only for a row written without pgsemaphore.enqueue (which
-- only the owner can): it goes to the front of the rotation.
ALTER TABLE pgsemaphore.waiters
    ADD COLUMN fair_key text,
    ADD COLUMN turn     bigint NOT NULL DEFAULT 0,
    ADD CONSTRAINT waiters_fair_key_length
        CHECK (fair_key IS NULL OR char_length(fair_key) BETWEEN 1 AND 200);
UPDATE pgsemaphore.waiters w
   SET turn = o.turn
  FROM (SELECT d.id,
               row_number() OVER (PARTITION BY d.semaphore, d.priority ORDER BY d.id) - 1 AS turn
          FROM pgsemaphore.waiters d) o
 WHERE w.id = o.id AND w.turn <> o.turn;

-- The FIFO order of a semaphore's queue (its head, and the smallest turn
-- queued, by index), and "is anyone queued?".
DROP INDEX pgsemaphore.waiters_queue_idx;
CREATE INDEX waiters_queue_idx
    ON pgsemaphore.waiters (semaphore, priority, turn, id);

-- A key's last turn in a semaphore's queue (pgsemaphore.enqueue).
CREATE INDEX waiters_fair_key_idx
    ON pgsemaphore.waiters (semaphore, priority, fair_key, turn);

-- ---------------------------------------------------------------------------
-- Application functions
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.enqueue(
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
-- Invariant (the fairness rule): the new waiter's turn is the larger of
-- the smallest turn queued at its priority (0 if none: the head's turn in a
-- FIFO queue) and one more than the largest turn of its key at its
-- priority (0 if none); a turn never changes, and a FIFO queue serves
-- (priority, turn, id) in ascending order (pgsemaphore.claim, step 3). So:
-- a new waiter never goes ahead of the head of its priority (its turn is
-- at least the head's, its id larger); a key's waiters keep their arrival
-- order (their turns ascend); and a key with nobody queued waits behind at
-- most one waiter of each other key (at most one of each key has the
-- smallest turn): with waiters of one other key queued, it is served
-- within the next two grants. Without fairness keys, turns ascend with
-- ids: arrival order.
-- Meets: claims and other enqueues (serialised on the semaphore row, FOR NO
-- KEY UPDATE: each reads the queue as every earlier one committed it, so
-- two waiters of one key never share a turn, and a head claiming meanwhile
-- either claims first, and has left the queue when this reads the turns,
-- or claims after this waiter queued behind it); clear_queue (the same row); keep_waiting (row locks on waiter
-- rows: deleting an expired row it renews waits for it and keeps the row
-- if renewed); leave_queue and the reaper (they delete waiters without the
-- semaphore's row: a turn read while one is uncommitted counts the leaving
-- waiter, as if this waiter had queued just before it left).
DECLARE
    v_now     timestamptz;
    v_count   integer;
    v_dropped integer;
    v_floor   bigint;
    v_last    bigint;
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
    IF char_length(p_fair_key) NOT BETWEEN 1 AND 200 THEN
        PERFORM pgsemaphore.refuse('p_fair_key',
            format('NULL (the shared default key) or 1 to 200 characters, got %s characters',
                   char_length(p_fair_key)));
    END IF;
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
    -- The turn (the fairness rule above). Two statements, each one probe of
    -- an index: the smallest turn queued at this priority
    -- (waiters_queue_idx), and this key's largest (waiters_fair_key_idx;
    -- one branch per kind of key, so that each is a plain index condition).
    SELECT w.turn INTO v_floor
      FROM pgsemaphore.waiters w
     WHERE w.semaphore = p_semaphore AND w.priority = p_priority
     ORDER BY w.turn
     LIMIT 1;
    IF p_fair_key IS NULL THEN
        SELECT max(w.turn) INTO v_last
          FROM pgsemaphore.waiters w
         WHERE w.semaphore = p_semaphore AND w.priority = p_priority AND w.fair_key IS NULL;
    ELSE
        SELECT max(w.turn) INTO v_last
          FROM pgsemaphore.waiters w
         WHERE w.semaphore = p_semaphore AND w.priority = p_priority AND w.fair_key = p_fair_key;
    END IF;
    o_turn := greatest(coalesce(v_floor, 0), coalesce(v_last + 1, 0));
    INSERT INTO pgsemaphore.waiters
           (semaphore, permits, priority, holder, enqueued_at, expires_at, token_hash, fair_key, turn)
    VALUES (p_semaphore, p_permits, p_priority, p_holder, v_now, v_now + p_waiter_lease,
            sha256(p_token), p_fair_key, o_turn)
    RETURNING id INTO o_ticket;
    UPDATE pgsemaphore.semaphores s SET queue_used = true WHERE s.name = p_semaphore AND NOT s.queue_used;
    RETURN NEXT;
END;
$$;

-- Whoever could run the old enqueue can run the new one (an application
-- role granted as the README says), so an upgrade asks for no new grants;
-- then the old signature goes, and no call of its shape is ambiguous.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS grantee, a.is_grantable
          FROM pg_proc p
         CROSS JOIN LATERAL aclexplode(p.proacl) a
         WHERE p.oid = 'pgsemaphore.enqueue(text, integer, smallint, text, integer, interval, bytea)'::regprocedure
           AND a.privilege_type = 'EXECUTE'
           AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION '
                       'pgsemaphore.enqueue(text, integer, smallint, text, integer, interval, bytea, text) '
                       'TO %s%s',
                       r.grantee, CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END;
$$;
DROP FUNCTION pgsemaphore.enqueue(text, integer, smallint, text, integer, interval, bytea);

CREATE OR REPLACE FUNCTION pgsemaphore.claim(
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

-- ---------------------------------------------------------------------------
-- Privileges: as before, nobody but the owner runs anything until granted.
-- ---------------------------------------------------------------------------

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
