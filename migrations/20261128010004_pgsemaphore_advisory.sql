-- pg-semaphore's schema, version 1 (the 0.1 baseline), part 4 of 7: the
-- advisory semaphore, whose slots are advisory locks.
--
-- A lease semaphore (pgsemaphore.claim) writes a row per claim and makes it
-- dead at release; while a long transaction anywhere in the database holds
-- the xmin horizon, VACUUM can remove none of those versions, every claim
-- visits them, and the semaphore slows down. An *advisory* semaphore writes
-- nothing on its claim and release path: each slot is a session-level
-- advisory lock, held by the holder process's dedicated connection.
-- Advisory locks live in shared memory and have no versions, so a held
-- horizon does not touch them. What it reads per claim is its own row of
-- pgsemaphore.advisory_semaphores, which changes only when an operator
-- changes its capacity (configure_advisory, 7: operator functions), and
-- the sequence pgsemaphore.advisory_epoch, which such a change moves. An
-- advisory lock belongs to one database (pg_locks.database): two databases
-- of one cluster may each have an advisory semaphore of the same name and
-- never share a slot; everything here reads this database's locks only.
-- Its audit log, pgsemaphore.advisory_claims, is insert-only, written in
-- batches off the hot path (advisory_log).

CREATE FUNCTION pgsemaphore.open_advisory(p_name text, p_capacity integer)
RETURNS TABLE (o_capacity integer, o_created boolean, o_key_base bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- Opens an advisory semaphore: creates it with this capacity if it does
-- not exist; an existing one keeps its capacity (the operator's
-- configure_advisory changes it). Returns the capacity in force, whether it
-- was created, and the base of its advisory keys.
--   p_name 1..200 characters, not the name of a lease semaphore (22023,
--   p_name); p_capacity 1..100000
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
    SELECT a.capacity, a.key_base INTO o_capacity, o_key_base
      FROM pgsemaphore.advisory_semaphores a WHERE a.name = p_name;
    IF FOUND THEN
        o_created := false;
        RETURN NEXT;
        RETURN;
    END IF;
    INSERT INTO pgsemaphore.advisory_semaphores (name, capacity, peak_capacity)
    VALUES (p_name, p_capacity, p_capacity)
    ON CONFLICT (name) DO NOTHING;
    o_created := FOUND;
    SELECT a.capacity, a.key_base INTO o_capacity, o_key_base
      FROM pgsemaphore.advisory_semaphores a WHERE a.name = p_name;
    RETURN NEXT;
END;
$$;

CREATE FUNCTION pgsemaphore.advisory_claim(p_semaphore text, p_permits integer, p_mine integer[],
                                           OUT o_status text, OUT o_slots integer[],
                                           OUT o_capacity integer, OUT o_at timestamptz)
LANGUAGE plpgsql
AS $$
-- THE ADVISORY CLAIM. Takes p_permits slots of the advisory semaphore
-- p_semaphore as session-level advisory locks of the caller's session, all
-- or nothing, and writes nothing. The caller must keep its session (its
-- dedicated connection) for as long as it holds them, and end them with
-- advisory_release on that session; the server frees them if the session
-- ends.
--   p_semaphore  an advisory semaphore (else P0002)
--   p_permits    1..100000
--   p_mine       the slots of this semaphore this session already holds
--                (for other permits), 0..100000 of them, no NULLs: an
--                advisory lock is re-entrant, so without this list a second
--                claim on the same session would take a slot it holds again
-- Returns one row: o_status 'claimed' (o_slots, lowest first, and o_at, the
-- database clock), 'full' (nothing taken), or 'too_many' (more permits than
-- the capacity); o_capacity, the capacity in force.
-- READ COMMITTED only (else 0A000, taking nothing): step 3 needs a
-- snapshot taken after step 2's locks, which only READ COMMITTED gives a
-- new statement. Waits for nothing: try-locks, plain reads of the
-- semaphore's row (never blocked by a row lock) and of pg_locks, and
-- advisory_drained, which skips a locked row. An error or a cancellation
-- (statement_timeout, pg_cancel_backend) after step 2 took locks gives
-- them back before it is raised again (the EXCEPTION block): a claim that
-- fails holds nothing.
--
-- Steps:
--   1. read capacity, peak_capacity, key_base (one statement);
--   2. try-lock the lowest free slots below that capacity (none: 'full');
--   3. in a NEW statement (so a snapshot taken after every lock of step
--      2), read capacity and peak_capacity again; if p_permits exceed the
--      new capacity, or a slot taken is at or above it, give everything
--      back and go to 1 with these values (at most three rounds, then
--      'full');
--   4. if a drop is pending (peak_capacity > capacity, as step 3 read
--      them), count once, from pg_locks of this database, the distinct
--      keys in [key_base, key_base + peak_capacity) that any session holds
--      in any mode (this one's included); more than the capacity: give
--      back, 'full'; none at or above the capacity: the drop is over
--      (advisory_drained, which checks again itself);
--   5. if no drop is pending and the row's epoch (step 3) is behind the
--      sequence pgsemaphore.advisory_epoch, advisory_rearm (so that the
--      crate's one-statement claim, which this call stands in for, works
--      again);
--   6. 'claimed'.
--
-- Invariant: at any instant, the holders of a semaphore's slots that its
-- claims admitted number at most its capacity C (the committed one).
-- Proof. A claim is admitted at step 5 only on what step 3 read, with a
-- snapshot S taken after its last lock L. Take any committed state, and a
-- holder h admitted by this claim.
--   (a) No drop seen pending (peak = capacity = C in S): every slot of h is
--   below C (step 3). Slots below C are C locks, one holder each. A holder
--   at or above C could only be (i) an old holder of a capacity > C: then
--   the drop to C ended, i.e. advisory_drained committed before S having
--   read pg_locks, under the row lock, after that drop committed, and seen
--   no key in [C, peak) held; so that holder had gone, and (ii) a claim
--   that locked such a slot after that read: its own step 3 sees either the
--   drop pending (the drain not yet committed: it counts, (b), and its slot
--   is at or above C: it gives back) or peak = C (its slot is at or above
--   C: it gives back). Neither is admitted. If a later drop to C' < C
--   commits after S, h is linearised before it: h's lock L came before S,
--   so before the drop's commit, so before the pg_locks read of every
--   advisory_drained that could end that drop; that drain sees h if h sits
--   at or above C', and the drop stays pending (case (b) for every later
--   claim) until h releases.
--   (b) A drop seen pending in S (capacity C < peak P): h's slots are below
--   C (step 3), and step 4 counted, after L, every key below P held in this
--   database. Every admitted holder sits below P: claims take slots only
--   below a capacity they re-read (step 3), and the drop to C was committed
--   after every capacity above P had drained. Of any set of admitted
--   claims and old holders holding at one instant, the claim whose step-4
--   read came last read after every other one's locks (each claim locks at
--   step 2, before its own read; old holders locked before the drop):
--   pg_locks is read as one snapshot of the lock table (every partition
--   locked at once), so that read counted them all, and the claim was
--   refused if they were more than C. A lock granted after a claim's read
--   is either an admitted claim's (which reads after it, and counts this
--   claim's locks) or a foreign lock, admitted by nobody. Foreign locks
--   (pg_advisory_lock on these keys, in any mode) and locks of claims that
--   will give back only raise a count: a refusal, never an admission.
--   Locks of other databases are on other keys (a key belongs to one
--   database) and are not counted.
--   A refusal or a give-back is always safe. Capacity growth: a claim that
--   read the old capacity is linearised before it.
-- Meets: other claims (the locks themselves, above); releases (an unlock is
-- seen at once by the next try or pg_locks read); configure_advisory (a
-- capacity change; never waits for it: it reads the row without locking
-- it); advisory_drained, in any transaction of any role (never waits for
-- it: step 4 calls it, and it skips a locked row); a session that dies
-- (the server frees its locks when it notices); anyone taking these keys
-- with pg_advisory_lock or pg_advisory_lock_shared directly (any role may:
-- it only makes the semaphore look fuller).
-- With the caller's rights (SECURITY INVOKER, no SET clause: a SET clause
-- costs more than the rest of the function): it only reads the semaphore's
-- row (SELECT, which the application's grants give) and pg_locks, and
-- takes and frees the caller's own session locks, which any role may. A
-- caller that redirects its own search_path, or skips the claim, can only
-- exceed the limit itself, as any client that does not use a semaphore
-- can; it cannot free or take over another session's slots. The one write,
-- lowering peak_capacity when a drop is over, is
-- pgsemaphore.advisory_drained's; advisory_rearm's epoch is the other.
DECLARE
    v_capacity integer;
    v_peak     integer;
    v_base     bigint;
    v_slots    integer[] := '{}';
    v_try      integer;
    v_held     integer;
    v_above    integer;
    v_round    integer := 0;
    v_again    boolean;
    v_epoch    bigint;
    s          integer;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- (pgsemaphore.refuse_isolation's error, raised here: this runs
        -- with the caller's rights, and the helper is granted to nobody.)
        RAISE EXCEPTION 'pgsemaphore.advisory_claim needs READ COMMITTED, this transaction is %',
            upper(current_setting('transaction_isolation'))
            USING ERRCODE = 'feature_not_supported',
                  HINT = 'call it outside the transaction, or in a READ COMMITTED one: '
                         'an older snapshot could miss a capacity drop';
    END IF;
    IF p_semaphore IS NULL THEN
        RAISE EXCEPTION 'invalid p_semaphore: %', 'a semaphore name, got NULL'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'p_semaphore';
    END IF;
    IF p_permits IS NULL OR p_permits NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'invalid p_permits: %', format('1 to 100000, got %s', coalesce(p_permits::text, 'NULL'))
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'p_permits';
    END IF;
    IF p_mine IS NULL OR cardinality(p_mine) > 100000 OR array_position(p_mine, NULL) IS NOT NULL
       OR (cardinality(p_mine) > 0 AND array_ndims(p_mine) <> 1) THEN
        RAISE EXCEPTION 'invalid p_mine: %', 'zero to 100000 slots, in a one-dimensional array without NULLs'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'p_mine';
    END IF;
    -- 1.
    SELECT a.capacity, a.peak_capacity, a.key_base INTO v_capacity, v_peak, v_base
      FROM pgsemaphore.advisory_semaphores a WHERE a.name = p_semaphore;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'advisory semaphore % does not exist', quote_literal(p_semaphore)
            USING ERRCODE = 'no_data_found';
    END IF;
    LOOP
        v_round := v_round + 1;
        v_again := false;
        o_capacity := v_capacity;
        IF p_permits > v_capacity THEN
            o_status := 'too_many';
            RETURN;
        END IF;
        BEGIN
            -- 2. The lowest free slots below the capacity. (Nested IFs: SQL
            -- does not promise the order in which an AND evaluates its
            -- operands, and a try on a slot this session holds would take
            -- it a second time.) v_try names the slot being tried, for the
            -- handler below.
            FOR s IN 0 .. v_capacity - 1 LOOP
                IF s <> ALL (p_mine) THEN
                    v_try := s;
                    IF pg_try_advisory_lock(v_base + s) THEN
                        v_slots := v_slots || s;
                        v_try := NULL;
                        EXIT WHEN cardinality(v_slots) = p_permits;
                    END IF;
                    v_try := NULL;
                END IF;
            END LOOP;
            IF cardinality(v_slots) < p_permits THEN
                PERFORM pg_advisory_unlock(v_base + t) FROM unnest(v_slots) AS t;
                v_slots := '{}';
                o_status := 'full';
                RETURN;
            END IF;
            -- 3. A new statement: a snapshot taken after every lock above.
            SELECT a.capacity, a.peak_capacity, a.epoch INTO v_capacity, v_peak, v_epoch
              FROM pgsemaphore.advisory_semaphores a
             WHERE a.name = p_semaphore AND a.key_base = v_base;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'advisory semaphore % does not exist', quote_literal(p_semaphore)
                    USING ERRCODE = 'no_data_found';
            END IF;
            IF p_permits > v_capacity OR v_slots[cardinality(v_slots)] >= v_capacity THEN
                -- The capacity dropped under the slots taken (they are in
                -- ascending order): give them back, and again.
                PERFORM pg_advisory_unlock(v_base + t) FROM unnest(v_slots) AS t;
                v_slots := '{}';
                v_again := true;
            ELSIF v_peak > v_capacity THEN
                -- 4. A drop is pending: count the held keys below the peak,
                -- once.
                SELECT count(DISTINCT k.key), count(DISTINCT k.key) FILTER (WHERE k.key >= v_base + v_capacity)
                  INTO v_held, v_above
                  FROM (SELECT (l.classid::bigint << 32) | l.objid::bigint AS key
                          FROM pg_catalog.pg_locks l
                         WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
                           AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                              WHERE d.datname = pg_catalog.current_database())) k
                 WHERE k.key >= v_base AND k.key < v_base + v_peak;
                IF v_held > v_capacity THEN
                    PERFORM pg_advisory_unlock(v_base + t) FROM unnest(v_slots) AS t;
                    v_slots := '{}';
                    o_status := 'full';
                    RETURN;
                END IF;
                -- Every slot above the capacity was free, and no claim keeps
                -- one again: the drop is over. One write, once per drop.
                IF v_above = 0 THEN
                    PERFORM pgsemaphore.advisory_drained(p_semaphore);
                END IF;
            END IF;
            -- 5. The row's epoch is behind the sequence (a change of any
            -- advisory semaphore, since): the one-statement claim gives
            -- every slot back until it is read again.
            IF NOT v_again AND v_peak = v_capacity
               AND v_epoch <> pg_sequence_last_value('pgsemaphore.advisory_epoch') THEN
                PERFORM pgsemaphore.advisory_rearm(p_semaphore);
            END IF;
        EXCEPTION WHEN query_canceled OR others THEN
            -- Nothing taken here stays taken: the slots in v_slots were
            -- locked by this call; v_try, if set, was being tried, and is
            -- held only if the try took it (pg_locks says).
            PERFORM pg_advisory_unlock(v_base + t) FROM unnest(v_slots) AS t;
            IF v_try IS NOT NULL AND EXISTS (
                   SELECT 1 FROM pg_catalog.pg_locks l
                    WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
                      AND l.pid = pg_catalog.pg_backend_pid() AND l.mode = 'ExclusiveLock'
                      AND ((l.classid::bigint << 32) | l.objid::bigint) = v_base + v_try) THEN
                PERFORM pg_advisory_unlock(v_base + v_try);
            END IF;
            RAISE;
        END;
        EXIT WHEN NOT v_again;
        IF v_round >= 3 THEN
            o_capacity := v_capacity;
            o_status := 'full';
            RETURN;
        END IF;
    END LOOP;
    o_status := 'claimed';
    o_slots := v_slots;
    o_at := clock_timestamp();
END;
$$;

CREATE FUNCTION pgsemaphore.advisory_release(p_semaphore text, p_key_base bigint, p_slots integer[])
RETURNS integer
LANGUAGE plpgsql
AS $$
-- Ends a permit of the advisory semaphore p_semaphore whose keys start at
-- p_key_base (as open_advisory returned it): unlocks its slots p_slots on
-- the caller's session, then wakes waiters of other sessions if any wait.
-- Returns how many of the slots this session held (and so released);
-- negative (minus that) when it sent the semaphore's NOTIFY.
--   p_semaphore 1..200 characters; p_key_base not NULL; p_slots 1..100000
--   slots below 1048560, no NULLs
-- Waking without a gate: a waiter holds every one of the semaphore's 16
-- waiting keys (key_base + 1048560 + 0..15) in shared mode while it waits,
-- all taken before its claim. After unlocking, this tries one of them (the
-- stripe of its first slot: releases of different slots do not contend on
-- one lock) in exclusive mode:
--   * it gets it: no other session waits now (a waiter holds every stripe;
--     and a lock of the caller's own session never conflicts with it: the
--     caller's process wakes its own waiters itself); it unlocks it at
--     once and sends nothing. A waiter that takes that stripe after this
--     completes its announcement after the unlocks above, and its claim,
--     which comes after, sees the free slots;
--   * it does not: someone waits; the NOTIFY is sent when this statement's
--     transaction commits (it writes nothing else).
-- Advisory locks are visible to every session the moment they are taken or
-- freed, so unlike the lease semaphore's release, no snapshot can hide a
-- waiter here. With the caller's rights, as advisory_claim: it touches only
-- the caller's own session locks.
DECLARE
    v_released integer := 0;
    v_stripe   bigint;
    s          integer;
BEGIN
    IF p_semaphore IS NULL OR char_length(p_semaphore) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'invalid p_semaphore: 1 to 200 characters'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'p_semaphore';
    END IF;
    IF p_key_base IS NULL THEN
        RAISE EXCEPTION 'invalid p_key_base: %', 'the key base open_advisory returned, got NULL'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'p_key_base';
    END IF;
    IF p_slots IS NULL OR array_ndims(p_slots) IS DISTINCT FROM 1
       OR cardinality(p_slots) NOT BETWEEN 1 AND 100000 OR array_position(p_slots, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'invalid p_slots: %', 'one to 100000 slots, in a one-dimensional array without NULLs'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'p_slots';
    END IF;
    FOREACH s IN ARRAY p_slots LOOP
        IF s BETWEEN 0 AND 1048559 THEN
            IF pg_advisory_unlock(p_key_base + s) THEN
                v_released := v_released + 1;
            END IF;
        END IF;
    END LOOP;
    v_stripe := p_key_base + 1048560 + (abs(p_slots[1]) % 16);
    IF pg_try_advisory_lock(v_stripe) THEN
        PERFORM pg_advisory_unlock(v_stripe);
        RETURN v_released;
    END IF;
    PERFORM pg_notify('pgsemaphore', p_semaphore);
    RETURN -v_released;
END;
$$;

-- The release of a one-slot permit, as one expression: a LANGUAGE sql
-- function that the planner inlines into the caller's statement, so it
-- costs what a plain statement costs (a PL/pgSQL function rebuilds its
-- expressions in every transaction: advisory_release's overhead, measured,
-- was a third of the cycle). Unlocks p_key (a slot), then, as
-- advisory_release does, tries p_stripe (one of the semaphore's waiting
-- keys) and either gives it back (nobody waits: returns 1) or sends the
-- semaphore's NOTIFY (returns -1); returns 0 when this session did not
-- hold p_key (and then does nothing else). CASE fixes the order: SQL
-- promises to evaluate a CASE's condition before its branches.
CREATE FUNCTION pgsemaphore.advisory_release_one(p_semaphore text, p_key bigint, p_stripe bigint)
RETURNS integer
LANGUAGE sql VOLATILE
AS $$
    SELECT CASE WHEN pg_catalog.pg_advisory_unlock(p_key)
                THEN CASE WHEN pg_catalog.pg_try_advisory_lock(p_stripe)
                          THEN CASE WHEN pg_catalog.pg_advisory_unlock(p_stripe) THEN 1 ELSE 1 END
                          ELSE CASE WHEN pg_catalog.pg_notify('pgsemaphore', p_semaphore) IS NULL
                                    THEN -1 ELSE -1 END
                     END
                ELSE 0 END
$$;

CREATE FUNCTION pgsemaphore.advisory_drained(p_semaphore text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
-- A capacity drop of p_semaphore may be over (advisory_claim found every
-- slot at or above the capacity free): if pg_locks shows no lock, of any
-- session of this database, in any mode, granted or awaited, on a key
-- between the capacity and the peak, claims stop counting them (none is
-- ever taken again). Decides from pg_locks itself, under the semaphore's
-- row lock (serialised with configure_advisory), never from what its
-- caller says: any role may call it, and calling it early changes nothing.
-- Returns whether the drop is over: true also for a semaphore that does
-- not exist, or has no drop pending; false while a key above the capacity
-- is held, or while another transaction holds the row (a
-- configure_advisory, or another advisory_drained, still open: a later
-- claim ends the drop then). With the owner's rights: the application may
-- not write the table.
-- READ COMMITTED only (else 0A000). Waits for nothing: it reads the row
-- first without locking it (no drop pending: done, nothing locked), then
-- locks it SKIP LOCKED. A caller that leaves this in an open transaction
-- holds the row only while a drop is pending, delays no claim (claims
-- never wait for the row), and delays configure_advisory by at most its
-- lock_timeout (2 s, then 55P03). (lock_timeout here bounds what is left:
-- the table's own relation lock, which only DDL could hold.)
DECLARE
    v_capacity integer;
    v_peak     integer;
    v_base     bigint;
BEGIN
    IF p_semaphore IS NULL THEN
        PERFORM pgsemaphore.refuse('p_semaphore', 'a semaphore name, got NULL');
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgsemaphore.refuse_isolation('pgsemaphore.advisory_drained',
            'an older snapshot could miss a capacity change committed meanwhile');
    END IF;
    SELECT a.capacity, a.peak_capacity INTO v_capacity, v_peak
      FROM pgsemaphore.advisory_semaphores a WHERE a.name = p_semaphore;
    IF NOT FOUND OR v_peak <= v_capacity THEN
        RETURN true;
    END IF;
    SELECT a.capacity, a.peak_capacity, a.key_base INTO v_capacity, v_peak, v_base
      FROM pgsemaphore.advisory_semaphores a WHERE a.name = p_semaphore
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NOT EXISTS (SELECT 1 FROM pgsemaphore.advisory_semaphores a WHERE a.name = p_semaphore);
    END IF;
    IF v_peak <= v_capacity THEN
        RETURN true;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_locks l
                WHERE l.locktype = 'advisory' AND l.objsubid = 1
                  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                     WHERE d.datname = pg_catalog.current_database())
                  AND ((l.classid::bigint << 32) | l.objid::bigint)
                      BETWEEN v_base + v_capacity AND v_base + v_peak - 1) THEN
        RETURN false;
    END IF;
    UPDATE pgsemaphore.advisory_semaphores a
       SET peak_capacity = a.capacity
     WHERE a.name = p_semaphore;
    RETURN true;
END;
$$;

-- Sets an advisory semaphore's epoch to the value the sequence
-- pgsemaphore.advisory_epoch reads now, so that the crate's one-statement
-- claim (which gives its slot back while the two differ: see the sequence
-- in part 1) works again after another semaphore's change moved the
-- sequence. advisory_claim calls it when it finds the epoch behind. Returns
-- whether it wrote. p_semaphore not NULL (22023); READ COMMITTED only
-- (0A000). Waits for nothing: it locks the row SKIP LOCKED (held: another
-- transaction is changing or re-arming it, which ends the same way or
-- moves the sequence again; nothing written), and writes only when the
-- epoch is behind, so a caller can write at most once per move of the
-- sequence, which only the owner's functions make. (lock_timeout bounds
-- the table's own relation lock, which only DDL could hold.)
-- Why the value is safe: it is read in a statement after the row's lock.
-- Every change of the capacity locks the row before it moves the sequence
-- (the trigger runs during its UPDATE or DELETE) and keeps the lock to its
-- commit; so while this holds the lock, no change of this semaphore has
-- moved the sequence without having committed (its capacity is the one
-- this UPDATE keeps, READ COMMITTED updating the newest version), and the
-- moves it reads are other semaphores' or of rolled-back changes. A claim
-- that compares the new epoch then meets the argument of the sequence's
-- comment as with any epoch a change wrote. With the owner's rights: the
-- application may not write the table.
CREATE FUNCTION pgsemaphore.advisory_rearm(p_semaphore text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
BEGIN
    IF p_semaphore IS NULL THEN
        PERFORM pgsemaphore.refuse('p_semaphore', 'a semaphore name, got NULL');
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgsemaphore.refuse_isolation('pgsemaphore.advisory_rearm',
            'an older snapshot could miss a capacity change committed meanwhile');
    END IF;
    PERFORM 1 FROM pgsemaphore.advisory_semaphores a
     WHERE a.name = p_semaphore AND a.epoch <> pg_sequence_last_value('pgsemaphore.advisory_epoch')
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    -- A hint: losing it in a crash costs a claim a fallback.
    PERFORM pgsemaphore.fast_commit();
    UPDATE pgsemaphore.advisory_semaphores a
       SET epoch = pg_sequence_last_value('pgsemaphore.advisory_epoch')
     WHERE a.name = p_semaphore;
    RETURN true;
END;
$$;

CREATE FUNCTION pgsemaphore.advisory_log(
    p_semaphores text[], p_holders text[], p_slot_counts integer[], p_slots integer[],
    p_metadata jsonb[], p_acquired_at timestamptz[], p_ended_at timestamptz[],
    p_outcomes text[])
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- Appends finished permits of advisory semaphores to the audit log
-- (pgsemaphore.advisory_claims), a batch at a time, as parallel arrays (no
-- JSON to build or parse: arrays arrive in binary): entry i is permit i of
-- p_semaphores, p_holders, p_metadata, p_acquired_at, p_ended_at and
-- p_outcomes, and its slots are the next p_slot_counts[i] elements of
-- p_slots (the permits' slots one after another). Insert-only: nothing it
-- writes is ever updated. Returns how many rows it wrote. A fast commit:
-- losing a batch in a crash loses audit rows, never a slot.
-- The shape: one-dimensional arrays of the same length, at most 1000
-- entries; p_slot_counts and p_slots without NULLs, p_slots as long as the
-- counts' sum and at most 100000 slots; else 22023 naming the argument. A
-- NULL in another array fails its entry's check (below), except in
-- p_metadata, where it means no metadata.
-- The log records what holders reported: any role granted this function
-- can write a row for a permit it never held. What it checks is what a
-- holder could have reported; a batch with one entry that fails a check is
-- refused whole (22023, naming the argument, the entry's position from 1
-- and the check), writing nothing:
--   semaphore  an advisory semaphore that exists;
--   slots      1 or more distinct slots, each in [0, highest_capacity) of
--              that semaphore (every slot ever held lies there);
--   holder     1..1000 characters;
--   metadata   NULL or jsonb of at most 64 kB (as pgsemaphore.claim);
--   acquired_at not after ended_at;
--   ended_at   not later than the database's clock at the call plus one
--              minute (the crate writes acquired_at, the database's clock at
--              the claim, plus the hold its process measured on a monotonic
--              clock);
--   outcome    'released', 'lost' or 'dropped'.
-- One pass: each entry is read once, with the first check it fails, and
-- the rows are inserted by the same statement only if none fails; a
-- one-slot entry (the usual permit) skips the subqueries over its slots.
-- Bounded: at most 1000 rows and 100000 slots per call, each row at most
-- 64 kB of metadata. The log is pruned with the lease semaphore's history
-- (pgsemaphore.prune, the reaper's retention).
DECLARE
    v_n      integer := cardinality(p_semaphores);
    v_latest timestamptz := clock_timestamp() + interval '1 minute';
    v_done   record;
BEGIN
    IF p_semaphores IS NULL OR array_ndims(p_semaphores) > 1 OR v_n > 1000 THEN
        PERFORM pgsemaphore.refuse('p_semaphores', 'a one-dimensional array of at most 1000 semaphore names');
    END IF;
    IF p_holders IS NULL OR array_ndims(p_holders) > 1 OR cardinality(p_holders) <> v_n THEN
        PERFORM pgsemaphore.refuse('p_holders', 'one holder per entry of p_semaphores');
    END IF;
    IF p_slot_counts IS NULL OR array_ndims(p_slot_counts) > 1 OR cardinality(p_slot_counts) <> v_n
       OR array_position(p_slot_counts, NULL) IS NOT NULL THEN
        PERFORM pgsemaphore.refuse('p_slot_counts', 'one count of slots per entry of p_semaphores, without NULLs');
    END IF;
    IF p_metadata IS NULL OR array_ndims(p_metadata) > 1 OR cardinality(p_metadata) <> v_n THEN
        PERFORM pgsemaphore.refuse('p_metadata', 'one metadata (or NULL) per entry of p_semaphores');
    END IF;
    IF p_acquired_at IS NULL OR array_ndims(p_acquired_at) > 1 OR cardinality(p_acquired_at) <> v_n THEN
        PERFORM pgsemaphore.refuse('p_acquired_at', 'one timestamp per entry of p_semaphores');
    END IF;
    IF p_ended_at IS NULL OR array_ndims(p_ended_at) > 1 OR cardinality(p_ended_at) <> v_n THEN
        PERFORM pgsemaphore.refuse('p_ended_at', 'one timestamp per entry of p_semaphores');
    END IF;
    IF p_outcomes IS NULL OR array_ndims(p_outcomes) > 1 OR cardinality(p_outcomes) <> v_n THEN
        PERFORM pgsemaphore.refuse('p_outcomes', 'one outcome per entry of p_semaphores');
    END IF;
    IF p_slots IS NULL OR array_ndims(p_slots) > 1 OR cardinality(p_slots) > 100000
       OR array_position(p_slots, NULL) IS NOT NULL
       OR cardinality(p_slots) IS DISTINCT FROM
          (SELECT coalesce(sum(k::bigint), 0) FROM unnest(p_slot_counts) AS u(k))
       OR (SELECT min(k) FROM unnest(p_slot_counts) AS u(k)) < 1 THEN
        PERFORM pgsemaphore.refuse('p_slots',
            'each entry''s slots in turn (p_slot_counts[i] of them, at least 1), at most 100000 in all, without NULLs');
    END IF;
    -- Subscripts from 1, whatever bounds the caller gave.
    p_slots := p_slots[:];
    PERFORM pgsemaphore.fast_commit();
    WITH c AS (
        SELECT u.*, (sum(u.k) OVER (ORDER BY u.n) - u.k)::integer AS first
          FROM unnest(p_semaphores, p_holders, p_slot_counts, p_metadata, p_acquired_at, p_ended_at, p_outcomes)
               WITH ORDINALITY AS u(semaphore, holder, k, metadata, acquired_at, ended_at, outcome, n)),
    e AS MATERIALIZED (
        SELECT c.n, c.semaphore, p_slots[c.first + 1 : c.first + c.k] AS slots, c.holder, c.metadata,
               c.acquired_at, c.ended_at, c.outcome,
               -- The first check the entry fails, as 'argument|reason'.
               CASE
               WHEN c.semaphore IS NULL OR char_length(c.semaphore) NOT BETWEEN 1 AND 200
                   THEN 'p_semaphores|1 to 200 characters'
               WHEN a.name IS NULL
                   THEN format('p_semaphores|%s: no such advisory semaphore', quote_literal(c.semaphore))
               WHEN CASE WHEN c.k = 1
                         THEN p_slots[c.first + 1] NOT BETWEEN 0 AND a.highest_capacity - 1
                         ELSE c.k > a.highest_capacity
                              OR EXISTS (SELECT 1 FROM unnest(p_slots[c.first + 1 : c.first + c.k]) AS t(slot)
                                          WHERE t.slot NOT BETWEEN 0 AND a.highest_capacity - 1)
                    END
                   THEN format('p_slots|each 0 to %s (below the highest capacity %s has had)',
                               a.highest_capacity - 1, quote_literal(a.name))
               WHEN c.k > 1
                    AND (SELECT count(DISTINCT t.slot) FROM unnest(p_slots[c.first + 1 : c.first + c.k]) AS t(slot)) <> c.k
                   THEN 'p_slots|a slot appears twice'
               WHEN c.holder IS NULL OR char_length(c.holder) NOT BETWEEN 1 AND 1000
                   THEN 'p_holders|1 to 1000 characters'
               WHEN c.metadata IS NOT NULL AND pg_column_size(c.metadata) > 65536
                   THEN format('p_metadata|at most 64 kB of jsonb, got %s bytes', pg_column_size(c.metadata))
               WHEN c.acquired_at IS NULL
                   THEN 'p_acquired_at|a timestamp, got NULL'
               WHEN c.ended_at IS NULL
                   THEN 'p_ended_at|a timestamp, got NULL'
               WHEN c.ended_at < c.acquired_at
                   THEN 'p_ended_at|not before acquired_at'
               WHEN c.ended_at > v_latest
                   THEN 'p_ended_at|in the future'
               WHEN c.outcome IS NULL OR c.outcome NOT IN ('released', 'lost', 'dropped')
                   THEN 'p_outcomes|released, lost or dropped'
               END AS why
          FROM c LEFT JOIN pgsemaphore.advisory_semaphores a ON a.name = c.semaphore),
    bad AS (SELECT e.n, e.why FROM e WHERE e.why IS NOT NULL ORDER BY e.n LIMIT 1),
    written AS (
        INSERT INTO pgsemaphore.advisory_claims
               (semaphore, slots, holder, metadata, acquired_at, ended_at, outcome)
        SELECT e.semaphore, e.slots, e.holder, e.metadata, e.acquired_at, e.ended_at, e.outcome
          FROM e
         WHERE NOT EXISTS (SELECT FROM bad)
        RETURNING 1)
    SELECT b.n, b.why, (SELECT count(*) FROM written)::integer AS count
      INTO v_done
      FROM (SELECT) AS one LEFT JOIN bad b ON true;
    IF v_done.n IS NOT NULL THEN
        PERFORM pgsemaphore.refuse(split_part(v_done.why, '|', 1),
                                   format('entry %s: %s', v_done.n, substr(v_done.why, strpos(v_done.why, '|') + 1)));
    END IF;
    RETURN v_done.count;
END;
$$;

-- Retention of the advisory semaphores' audit log (pgsemaphore.prune, the
-- operator's retention, calls it with what is left of its batch after the
-- lease semaphores' history): deletes finished permits that ended before
-- now - p_older_than, at most p_batch, and returns how many. Read through
-- the log's BRIN index (acquired_at, which precedes ended_at), skipping
-- rows another prune is deleting, so two prunes never wait for each other.
-- The arguments were checked by the caller; granted to nobody.
CREATE FUNCTION pgsemaphore.prune_advisory_claims(p_older_than interval, p_batch integer)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_cutoff timestamptz := clock_timestamp() - p_older_than;
    v_count  bigint;
BEGIN
    DELETE FROM pgsemaphore.advisory_claims c
     WHERE c.ctid = ANY (ARRAY(
            SELECT d.ctid
              FROM pgsemaphore.advisory_claims d
             WHERE d.acquired_at < v_cutoff AND d.ended_at < v_cutoff
             LIMIT p_batch
               FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
