-- pg-semaphore's schema, version 1 (the 0.1 baseline), part 3 of 7: the
-- fair queue and wake-ups.
--
-- The queue. A waiter carries a fairness key (a tenant, say; NULL is the
-- one shared default key), and waiters of different keys take turns: a key
-- with one waiter is served within one turn of the rotation, however many
-- waiters another key has; within a key, arrival order; priority first.
-- The rule (start-time fair queuing with integer turns), kept by
-- pgsemaphore.enqueue and read by pgsemaphore.claim:
--   * each waiter has a turn, fixed when it queues: the smallest turn
--     queued at its priority (0 if none) if its key has no waiter queued at
--     that priority; else its key's largest turn L if fewer than w of the
--     key's waiters are queued at L, else L + 1 (w = the key's weight in
--     pgsemaphore.fair_weights, set by the operator, 1 when none is set);
--   * so each turn holds at most w waiters of a key of weight w, and a key
--     with nobody queued waits behind at most w_k waiters of each other key
--     k (those at the smallest turn, if they arrived earlier); a weight
--     change applies to waiters queued after it;
--   * a FIFO queue serves high priority first, then the smallest turn,
--     then the smallest id. Without fairness keys (every waiter NULL) turns
--     ascend with ids: the order is arrival order;
--   * a LIFO queue serves the newest first and ignores keys and turns.
--
-- Wake-ups. A NOTIFY on channel 'pgsemaphore' is a hint backed by a
-- re-check, never a correctness device: sent only while a waiter is
-- registered (pgsemaphore.wakeups), and never making a durable commit wait
-- on it (PostgreSQL serialises notifying commits instance-wide).

-- ---------------------------------------------------------------------------
-- Internal helpers (not granted to anyone)
-- ---------------------------------------------------------------------------

-- Sends the wake-up for `p_semaphore` if a waiter is registered for it.
-- Callers run it in a transaction of its own *after* the transaction that
-- freed slots has committed. Why after, not inside:
--   a transaction R that freed a slot and looked for registered waiters
--   inside itself could miss a waiter W that registers and then claims
--   while R is uncommitted: R's check does not see W's registration, W's
--   claim does not see R's release, and W sleeps until its fallback
--   re-check. Checked after R's commit, either the check sees W's
--   registration (and notifies), or W registered after R's commit, so W's
--   claim, which comes after its registration, sees R's release.
-- (pgsemaphore.release checks inside its own transaction instead, which
-- saves the second transaction on every release nobody waits for; it closes
-- the same race with the wake-up gate: see there.)
-- Returns whether it notified.
CREATE FUNCTION pgsemaphore.notify_if_waited(p_semaphore text)
RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_semaphore IS NOT NULL
       AND EXISTS (SELECT 1 FROM pgsemaphore.wakeups w
                    WHERE w.semaphore = p_semaphore AND w.until > clock_timestamp()) THEN
        PERFORM pgsemaphore.fast_commit();
        PERFORM pg_notify('pgsemaphore', p_semaphore);
        RETURN true;
    END IF;
    RETURN false;
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
        PERFORM pgsemaphore.refuse_isolation('pgsemaphore.enqueue',
            'an older snapshot could miss a waiter queued meanwhile');
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

CREATE FUNCTION pgsemaphore.leave_queue(p_ticket bigint, p_token bytea)
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

CREATE FUNCTION pgsemaphore.keep_waiting(p_semaphore text, p_lease interval,
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

CREATE FUNCTION pgsemaphore.stop_waiting(p_semaphore text, p_token bytea, p_spell bigint)
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

CREATE FUNCTION pgsemaphore.wake(p_semaphore text)
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

CREATE FUNCTION pgsemaphore.wake_claimed(p_claim bigint)
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

CREATE PROCEDURE pgsemaphore.release_then_wake(
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

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
