-- pg-semaphore's schema, version 1 (the 0.1 baseline), part 5 of 7:
-- semaphore families.
--
-- "Each tenant may run 10 at once, premium tenants 50, and one tenant in
-- particular 200." Built from named semaphores (format!("tenant:{id}")),
-- every tenant became a row of pgsemaphore.semaphores forever, with the
-- capacity that whichever process came first chose. A FAMILY is a name
-- plus a key -> one semaphore, with a default capacity and lease, capacity
-- rules the operator changes at run time, keys created on first use and
-- idle keys removed by the reaper.
--
-- Decisions:
--   * A key of a family IS an ordinary row of pgsemaphore.semaphores,
--     named '@' || family || '/' || key, with its family and key in its
--     family and family_key columns. Every claim, queue, wake-up, lease, reaper, fence and audit
--     path works on it unchanged, and a claim on a key costs what a claim
--     on a named semaphore costs (the same function, the same row lock).
--     Family names are 1..64 characters of [A-Za-z0-9_.:-] (no '/'), so
--     the name is injective; keys are 1..128 characters (no NUL), so a
--     name is at most 194 characters, within the 200 a semaphore allows.
--   * Names beginning with '@' are reserved for family keys: creating a
--     named (lease or advisory) semaphore with such a name is refused
--     (22023, p_name) by the one_kind_per_name trigger. A family key whose
--     name a named semaphore has is refused (22023, p_key), never adopted.
--     So a family key and a named semaphore never share a row.
--   * Capacity of a key, first match wins: an exact-key rule
--     (family_rules kind 'key'), else the rule of the key's tier
--     (family_rules kind 'tier', for the tier pgsemaphore.family_tiers
--     assigns to the key), else the family's default_capacity. The lease
--     of every key is the family's default_lease.
--   * Tiers are stored by the operator (family_tiers: key -> tier), never
--     chosen by the application: the application role is hostile, and its
--     only input is the key's name, so no argument it passes can give a
--     key more than the operator's rules give that key. (No pattern rules:
--     the application chooses a key's name, so a rule matching on the
--     name's shape would let it choose its capacity by choosing a name.)
--     An application may of course claim on any key it can name, as it may
--     claim on any named semaphore: a family bounds each key, not the
--     application's total.
--   * Rules, tiers and defaults are the operator's (configure_family,
--     set_family_rule, set_family_tier, not granted to the application).
--     Each change recomputes the capacity (and lease) of the family's
--     existing keys in the same transaction, by updating the very rows
--     claims lock, as pgsemaphore.configure does: a claim sees the old or
--     the new capacity, never a mix, and a lowered capacity lets holders
--     above it keep their slots until they release while no claim is
--     admitted until the held count is below it (the claim counts held
--     slots under that lock). The application may create a family that
--     does not exist (open_family, as open creates a named semaphore) but
--     never change one.
--   * First use: open_family_key (application) creates the key's row with
--     the capacity the rules give it. First uses share-lock the family's
--     row and rule changes lock it exclusively, so a key created while a
--     rule changes gets the rule in force after it (see its Meets).
--   * Idle keys: pgsemaphore.reap_family_keys (and reap, which calls it)
--     deletes a key's row once nothing references it: no claim row, live
--     or in the audit log, no waiter, no wake-up registration, and its row
--     was created or last changed more than the family's idle_after ago.
--     The slot table is also the audit log and references the semaphore by
--     name, so a key is kept until prune_claims has pruned its history:
--     the audit history is never lost, and the table holds the keys used
--     within the retention (or idle_after, whichever is longer). Named
--     semaphores are never removed.
--   * The advisory semaphore has no families (see the README).
--   * The operator's functions (configure_family, set_family_rule,
--     set_family_tier, reap_family_keys) are here with the application's
--     (open_family, open_family_key); the README grants each to its role.

-- ---------------------------------------------------------------------------
-- Internal helpers (not granted to anyone)
-- ---------------------------------------------------------------------------

-- A family name: 1..64 characters of [A-Za-z0-9_.:-] (22023 naming p_argument).
CREATE FUNCTION pgsemaphore.checked_family(p_family text, p_argument text DEFAULT 'p_family')
RETURNS text
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_family IS NULL OR p_family !~ '^[A-Za-z0-9_.:-]{1,64}$' THEN
        PERFORM pgsemaphore.refuse(p_argument,
            format('1 to 64 characters of A-Z a-z 0-9 _ . : -, got %s',
                   coalesce(quote_literal(left(p_family, 80)), 'NULL')));
    END IF;
    RETURN p_family;
END;
$$;

-- The capacity the rules give key p_key of family p_family whose default
-- is p_default: its exact-key rule, else its tier's rule, else p_default.
CREATE FUNCTION pgsemaphore.family_capacity(p_family text, p_key text, p_default integer)
RETURNS integer
LANGUAGE sql STABLE
AS $$
    SELECT coalesce(
        (SELECT r.capacity FROM pgsemaphore.family_rules r
          WHERE r.family = p_family AND r.kind = 'key' AND r.match = p_key),
        (SELECT r.capacity FROM pgsemaphore.family_tiers t
           JOIN pgsemaphore.family_rules r
             ON r.family = t.family AND r.kind = 'tier' AND r.match = t.tier
          WHERE t.family = p_family AND t.key = p_key),
        p_default)
$$;

-- Sets every existing key of p_family (only p_key, if not NULL) to the
-- capacity the rules give it and to the family's lease, and wakes the keys
-- whose capacity grew (wake_at_commit). The caller holds the family's row
-- lock (FOR NO KEY UPDATE), so no first use of a key runs meanwhile. The
-- UPDATE locks each key's row as pgsemaphore.configure does (claims see
-- the old or the new capacity); a key the reaper deleted meanwhile is
-- skipped (READ COMMITTED re-checks a row it waited for). Returns how many
-- keys changed.
CREATE FUNCTION pgsemaphore.family_recompute(p_family text, p_key text)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_count bigint := 0;
    v_name  text;
    v_grew  boolean;
BEGIN
    FOR v_name, v_grew IN
        WITH changed AS (
            UPDATE pgsemaphore.semaphores s
               SET capacity = n.capacity, default_lease = f.default_lease,
                   updated_at = clock_timestamp()
              FROM pgsemaphore.families f,
                   pgsemaphore.semaphores o,
                   LATERAL (SELECT pgsemaphore.family_capacity(o.family, o.family_key,
                                                               f.default_capacity) AS capacity) n
             WHERE f.name = p_family AND o.family = p_family
               AND (p_key IS NULL OR o.family_key = p_key)
               AND s.name = o.name
               AND (s.capacity <> n.capacity OR s.default_lease <> f.default_lease)
            RETURNING s.name, n.capacity > o.capacity AS grew
        )
        SELECT c.name, c.grew FROM changed c
    LOOP
        v_count := v_count + 1;
        IF v_grew THEN
            PERFORM pgsemaphore.wake_at_commit(v_name);
        END IF;
    END LOOP;
    RETURN v_count;
END;
$$;

-- ---------------------------------------------------------------------------
-- Application functions
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.open_family(
    p_family text, p_capacity integer, p_lease interval, p_idle_after interval)
RETURNS TABLE (o_capacity integer, o_default_lease interval, o_idle_after interval, o_created boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET plan_cache_mode = force_generic_plan
AS $$
-- Opens a family: creates it with this default capacity, lease and
-- idle_after if it does not exist; an existing one keeps its settings
-- (changing them is the operator's configure_family). Returns the settings
-- in force.
--   p_family 1..64 characters of [A-Za-z0-9_.:-]; p_capacity 1..100000;
--   p_lease 10 ms..366 days; p_idle_after 0..366 days
-- Every bad argument raises 22023 naming it in COLUMN. A concurrent
-- creator of the same family left uncommitted is waited for at most
-- lock_timeout (2 s), then 55P03, nothing created.
BEGIN
    PERFORM pgsemaphore.checked_family(p_family);
    IF p_capacity IS NULL OR p_capacity NOT BETWEEN 1 AND 100000 THEN
        PERFORM pgsemaphore.refuse('p_capacity', format('1 to 100000, got %s', coalesce(p_capacity::text, 'NULL')));
    END IF;
    PERFORM pgsemaphore.checked_interval(p_lease, 'p_lease', interval '10 ms', interval '366 days');
    PERFORM pgsemaphore.checked_interval(p_idle_after, 'p_idle_after', interval '0', interval '366 days');
    INSERT INTO pgsemaphore.families (name, default_capacity, default_lease, idle_after)
    VALUES (p_family, p_capacity, p_lease, p_idle_after)
    ON CONFLICT (name) DO NOTHING;
    o_created := FOUND;
    SELECT f.default_capacity, f.default_lease, f.idle_after
      INTO o_capacity, o_default_lease, o_idle_after
      FROM pgsemaphore.families f WHERE f.name = p_family;
    RETURN NEXT;
END;
$$;

CREATE FUNCTION pgsemaphore.open_family_key(p_family text, p_key text)
RETURNS TABLE (o_name text, o_capacity integer, o_default_lease interval, o_created boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- FIRST USE OF A KEY. Returns the name of the semaphore of key p_key of
-- family p_family ('@' || p_family || '/' || p_key: claim, wait and
-- release on it with the ordinary functions), creating it with the
-- capacity the family's rules give the key (its exact-key rule, else its
-- tier's rule, else the family's default) and the family's lease if it
-- does not exist. Returns its capacity and lease in force, and whether
-- this call created it.
--   p_family an existing family (else P0002), 1..64 characters of
--   [A-Za-z0-9_.:-]; p_key 1..128 characters, and not a name a named
--   semaphore already has (22023, p_key: see the migration's header)
-- Every bad argument raises 22023 naming it in COLUMN. The family's row is
-- waited for at most lock_timeout (2 s; 55P03) while an operator changes
-- its rules.
--
-- Invariant: every key's stored capacity is what the family's rules, as of
-- the last committed change, give it. A first use share-locks the
-- family's row (FOR SHARE) before it reads the rules, and every rule,
-- tier or default change locks that row exclusively (FOR NO KEY UPDATE)
-- before it changes them and recomputes the existing keys; so either the
-- change commits first and this call (a fresh statement after the lock)
-- reads the new rules, or this call commits first and the change's
-- recompute sees the new key.
-- Meets:
--   * a concurrent first use of the same key: its insert's ON CONFLICT
--     waits for ours and does nothing; each returns the one row;
--   * a rule, tier or default change (configure_family, set_family_rule,
--     set_family_tier): the family's row lock, above;
--   * the reaper removing the key (reap_family_keys, which deletes only a
--     key row it holds FOR UPDATE): our ON CONFLICT meets its row; we then
--     lock it FOR KEY SHARE, which waits for the reaper; if the reaper
--     deleted it, the row is gone and we insert it again (step 3 loops).
--     A claim that comes after this call returns may still meet a later
--     removal: it raises P0002 and the client opens the key again;
--   * claims on the key: they lock its row FOR NO KEY UPDATE, which our
--     FOR KEY SHARE does not conflict with: first use never delays claims;
--   * a hostile caller holding the family's row FOR SHARE (through this
--     function, in an open transaction): it delays the operator's rule
--     change, never another first use.
DECLARE
    v_name     text;
    v_default  integer;
    v_lease    interval;
    v_family   text;
BEGIN
    -- 1. The arguments.
    PERFORM pgsemaphore.checked_family(p_family);
    PERFORM pgsemaphore.checked_text(p_key, 'p_key', 128);
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgsemaphore.refuse_isolation('pgsemaphore.open_family_key',
            'an older snapshot could miss a rule or a key changed meanwhile');
    END IF;
    v_name := '@' || p_family || '/' || p_key;
    -- 2. The family's row, share-locked: no rule change runs until we commit.
    SELECT f.default_capacity, f.default_lease INTO v_default, v_lease
      FROM pgsemaphore.families f WHERE f.name = p_family
       FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore family % does not exist', quote_literal(p_family)
            USING ERRCODE = 'no_data_found';
    END IF;
    LOOP
        -- 3. The key's row if it exists (held FOR KEY SHARE until we commit:
        -- the reaper cannot remove it meanwhile), else a new one with the
        -- capacity the rules give it (read after the family's lock).
        SELECT s.capacity, s.default_lease, s.family INTO o_capacity, o_default_lease, v_family
          FROM pgsemaphore.semaphores s WHERE s.name = v_name
           FOR KEY SHARE;
        IF FOUND THEN
            IF v_family IS DISTINCT FROM p_family THEN
                PERFORM pgsemaphore.refuse('p_key',
                    format('%s is the name of a named semaphore, which a family key never takes over',
                           quote_literal(v_name)));
            END IF;
            o_name := v_name;
            o_created := false;
            RETURN NEXT;
            RETURN;
        END IF;
        o_capacity := pgsemaphore.family_capacity(p_family, p_key, v_default);
        INSERT INTO pgsemaphore.semaphores (name, capacity, default_lease, family, family_key)
        VALUES (v_name, o_capacity, v_lease, p_family, p_key)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            o_name := v_name;
            o_default_lease := v_lease;
            o_created := true;
            RETURN NEXT;
            RETURN;
        END IF;
        -- A concurrent first use inserted it: the next SELECT sees its row.
    END LOOP;
END;
$$;

-- ---------------------------------------------------------------------------
-- Operator functions
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.configure_family(
    p_family text, p_capacity integer, p_lease interval, p_idle_after interval,
    p_create boolean DEFAULT true)
RETURNS TABLE (o_capacity integer, o_default_lease interval, o_idle_after interval,
               o_keys_changed bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET plan_cache_mode = force_generic_plan
AS $$
-- Creates a family or changes its default capacity, lease and idle_after
-- (a NULL keeps the current value; p_create false: an unknown family is
-- an error, P0002; creating needs all three), and in the same transaction
-- sets every existing key to the capacity the rules now give it and to the
-- new lease (pgsemaphore.family_recompute: as configure does, holders above
-- a lowered capacity keep their slots until they release, and no claim is
-- admitted above it). Returns the settings now and how many keys changed.
--   p_family 1..64 characters of [A-Za-z0-9_.:-]; p_capacity NULL or
--   1..100000; p_lease NULL or 10 ms..366 days; p_idle_after NULL or
--   0..366 days; p_create not NULL
DECLARE
    v_found boolean;
BEGIN
    PERFORM pgsemaphore.checked_family(p_family);
    IF p_capacity NOT BETWEEN 1 AND 100000 THEN
        PERFORM pgsemaphore.refuse('p_capacity', format('NULL or 1 to 100000, got %s', p_capacity));
    END IF;
    PERFORM pgsemaphore.checked_interval(p_lease, 'p_lease', interval '10 ms', interval '366 days', true);
    PERFORM pgsemaphore.checked_interval(p_idle_after, 'p_idle_after', interval '0', interval '366 days', true);
    IF p_create IS NULL THEN
        PERFORM pgsemaphore.refuse('p_create', 'true or false, got NULL');
    END IF;
    LOOP
        PERFORM 1 FROM pgsemaphore.families f WHERE f.name = p_family FOR NO KEY UPDATE;
        v_found := FOUND;
        IF v_found THEN
            UPDATE pgsemaphore.families f
               SET default_capacity = coalesce(p_capacity, f.default_capacity),
                   default_lease = coalesce(p_lease, f.default_lease),
                   idle_after = coalesce(p_idle_after, f.idle_after),
                   updated_at = clock_timestamp()
             WHERE f.name = p_family;
            EXIT;
        END IF;
        IF NOT p_create THEN
            RAISE EXCEPTION 'semaphore family % does not exist', quote_literal(p_family)
                USING ERRCODE = 'no_data_found';
        END IF;
        IF p_capacity IS NULL THEN
            PERFORM pgsemaphore.refuse('p_capacity', 'a new family needs a capacity, got NULL');
        END IF;
        IF p_lease IS NULL THEN
            PERFORM pgsemaphore.refuse('p_lease', 'a new family needs a lease, got NULL');
        END IF;
        IF p_idle_after IS NULL THEN
            PERFORM pgsemaphore.refuse('p_idle_after', 'a new family needs an idle_after, got NULL');
        END IF;
        INSERT INTO pgsemaphore.families (name, default_capacity, default_lease, idle_after)
        VALUES (p_family, p_capacity, p_lease, p_idle_after)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            EXIT;
        END IF;
        -- Lost a race with a concurrent creator: the next SELECT sees its row.
    END LOOP;
    o_keys_changed := pgsemaphore.family_recompute(p_family, NULL);
    SELECT f.default_capacity, f.default_lease, f.idle_after
      INTO o_capacity, o_default_lease, o_idle_after
      FROM pgsemaphore.families f WHERE f.name = p_family;
    RETURN NEXT;
END;
$$;

CREATE FUNCTION pgsemaphore.set_family_rule(
    p_family text, p_kind text, p_match text, p_capacity integer)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET plan_cache_mode = force_generic_plan
AS $$
-- Sets (p_capacity not NULL) or removes (NULL) the capacity rule of kind
-- p_kind ('key': the key p_match; 'tier': every key in tier p_match) of
-- family p_family, and in the same transaction sets the family's existing
-- keys to the capacity the rules now give them (family_recompute: a key
-- whose capacity is lowered admits no claim above it; its holders above
-- it keep their slots until they release). Returns how many keys changed.
-- P0002 for an unknown family.
--   p_family 1..64 characters of [A-Za-z0-9_.:-]; p_kind 'key' or 'tier';
--   p_match 1..128 characters (a key) or 1..64 (a tier); p_capacity NULL
--   or 1..100000
BEGIN
    PERFORM pgsemaphore.checked_family(p_family);
    IF p_kind IS NULL OR p_kind NOT IN ('key', 'tier') THEN
        PERFORM pgsemaphore.refuse('p_kind', format('''key'' or ''tier'', got %s', coalesce(quote_literal(left(p_kind, 80)), 'NULL')));
    END IF;
    PERFORM pgsemaphore.checked_text(p_match, 'p_match', CASE p_kind WHEN 'key' THEN 128 ELSE 64 END);
    IF p_capacity NOT BETWEEN 1 AND 100000 THEN
        PERFORM pgsemaphore.refuse('p_capacity', format('NULL or 1 to 100000, got %s', p_capacity));
    END IF;
    -- The family's row, exclusively: first uses of its keys wait (see
    -- open_family_key's invariant).
    PERFORM 1 FROM pgsemaphore.families f WHERE f.name = p_family FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore family % does not exist', quote_literal(p_family)
            USING ERRCODE = 'no_data_found';
    END IF;
    IF p_capacity IS NULL THEN
        DELETE FROM pgsemaphore.family_rules r
         WHERE r.family = p_family AND r.kind = p_kind AND r.match = p_match;
    ELSE
        INSERT INTO pgsemaphore.family_rules AS r (family, kind, match, capacity)
        VALUES (p_family, p_kind, p_match, p_capacity)
        ON CONFLICT (family, kind, match)
        DO UPDATE SET capacity = EXCLUDED.capacity, updated_at = clock_timestamp();
    END IF;
    RETURN pgsemaphore.family_recompute(p_family, CASE p_kind WHEN 'key' THEN p_match END);
END;
$$;

CREATE FUNCTION pgsemaphore.set_family_tier(p_family text, p_key text, p_tier text)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
SET plan_cache_mode = force_generic_plan
AS $$
-- Puts key p_key of family p_family in tier p_tier (NULL: in no tier), and
-- in the same transaction sets the key, if it exists, to the capacity the
-- rules now give it (family_recompute). Returns how many keys changed (0
-- or 1). P0002 for an unknown family.
--   p_family 1..64 characters of [A-Za-z0-9_.:-]; p_key 1..128
--   characters; p_tier NULL or 1..64 characters
BEGIN
    PERFORM pgsemaphore.checked_family(p_family);
    PERFORM pgsemaphore.checked_text(p_key, 'p_key', 128);
    IF p_tier IS NOT NULL THEN
        PERFORM pgsemaphore.checked_text(p_tier, 'p_tier', 64);
    END IF;
    PERFORM 1 FROM pgsemaphore.families f WHERE f.name = p_family FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'semaphore family % does not exist', quote_literal(p_family)
            USING ERRCODE = 'no_data_found';
    END IF;
    IF p_tier IS NULL THEN
        DELETE FROM pgsemaphore.family_tiers t WHERE t.family = p_family AND t.key = p_key;
    ELSE
        INSERT INTO pgsemaphore.family_tiers AS t (family, key, tier)
        VALUES (p_family, p_key, p_tier)
        ON CONFLICT (family, key)
        DO UPDATE SET tier = EXCLUDED.tier, updated_at = clock_timestamp();
    END IF;
    RETURN pgsemaphore.family_recompute(p_family, p_key);
END;
$$;

CREATE FUNCTION pgsemaphore.reap_family_keys(p_batch integer)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- IDLE-KEY REMOVAL. Examines the next p_batch keys of each family (in key
-- order, from where the last call stopped: pgsemaphore.family_reap_cursors,
-- so a call's work is bounded however many keys exist, and every key is
-- examined in turn) and deletes those that nothing references: no claim
-- row (live, or history that prune_claims has not pruned yet: the audit
-- log is never lost), no queue waiter, no wake-up registration, and whose
-- row was created or last changed more than its family's idle_after ago.
-- Never a named semaphore. Returns how many keys it deleted. The next
-- first use of a removed key creates it again, with the capacity the rules
-- give it then.
--   p_batch 1..1000000
--
-- Invariant: a key's row is deleted only while this transaction holds it
-- FOR UPDATE and a statement whose snapshot was taken after that lock saw
-- nothing referencing it. FOR UPDATE conflicts with a claim's and an
-- enqueue's FOR NO KEY UPDATE, with open_family_key's FOR KEY SHARE, and
-- with the FOR KEY SHARE that the foreign key of every new claim, waiter
-- or registration row takes on it: so nothing can come to reference the
-- row between that check and our commit, and whatever referenced it
-- before the lock was committed (and is seen) or still holds a lock on
-- the row (and the row is skipped).
-- Meets:
--   * a claim or enqueue on the key in flight: it holds the row's lock, we
--     skip the row (SKIP LOCKED); one that comes after our lock waits for
--     it, then finds the row gone and raises P0002 ("semaphore does not
--     exist"), having claimed nothing: the client opens the key again
--     (open_family_key) and claims again;
--   * a first use of the key (open_family_key): it waits for our lock and
--     inserts the row again (its loop), or holds FOR KEY SHARE already and
--     we skip the row;
--   * a registration of a waiter (keep_waiting): its insert's foreign key
--     check waits for our lock and then fails (23503) if we deleted the
--     row: the process's waiters poll (a registration is a hint); a key
--     with a waiter has a claim row or a queue row, so this needs the
--     history pruned meanwhile;
--   * a release, renewal or fence of a claim of the key: the claim's row
--     references the key, so the key is not removed;
--   * prune_claims deleting the key's last history rows: their deletion is
--     committed before our snapshot (seen: the key may go) or not (the
--     rows are seen: the key stays until its next turn);
--   * a rule change (family_recompute): its UPDATE waits for our lock and
--     skips a row we deleted;
--   * another reap_family_keys: both may examine the same keys; each
--     deletes only rows it locked (SKIP LOCKED), and the cursor is the
--     last writer's.
DECLARE
    v_now      timestamptz := clock_timestamp();
    v_family   text;
    v_idle     interval;
    v_after    text;
    v_examined text[];
    v_last     text;
    v_n        bigint;
    v_names    text[];
    v_count    bigint;
    v_total    bigint := 0;
BEGIN
    IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 1000000 THEN
        PERFORM pgsemaphore.refuse('p_batch', format('1 to 1000000, got %s', coalesce(p_batch::text, 'NULL')));
    END IF;
    FOR v_family, v_idle, v_after IN
        SELECT f.name, f.idle_after, c.after
          FROM pgsemaphore.families f
          LEFT JOIN pgsemaphore.family_reap_cursors c ON c.family = f.name
         ORDER BY f.name
    LOOP
        -- 1. The next p_batch keys of the family (the family index), and
        -- where the next call goes on (from the first once this one reached
        -- the last key).
        SELECT array_agg(e.name), max(e.family_key), count(*)
          INTO v_examined, v_last, v_n
          FROM (SELECT s.name, s.family_key
                  FROM pgsemaphore.semaphores s
                 WHERE s.family = v_family AND (v_after IS NULL OR s.family_key > v_after)
                 ORDER BY s.family_key
                 LIMIT p_batch) e;
        INSERT INTO pgsemaphore.family_reap_cursors AS c (family, after)
        VALUES (v_family, CASE WHEN v_n >= p_batch THEN v_last END)
        ON CONFLICT (family) DO UPDATE SET after = EXCLUDED.after;
        CONTINUE WHEN v_examined IS NULL;
        -- 2. Candidates among them, locked: at rest for idle_after, nothing
        -- referencing them as of this snapshot. Rows someone holds are skipped.
        SELECT array_agg(c.name) INTO v_names
          FROM (SELECT s.name
                  FROM pgsemaphore.semaphores s
                 WHERE s.name = ANY (v_examined)
                   AND s.family = v_family
                   AND greatest(s.created_at, s.updated_at) <= v_now - v_idle
                   AND NOT EXISTS (SELECT 1 FROM pgsemaphore.slots h WHERE h.semaphore = s.name)
                   AND NOT EXISTS (SELECT 1 FROM pgsemaphore.waiters w WHERE w.semaphore = s.name)
                   AND NOT EXISTS (SELECT 1 FROM pgsemaphore.wakeups k WHERE k.semaphore = s.name)
                   FOR UPDATE OF s SKIP LOCKED) c;
        CONTINUE WHEN v_names IS NULL;
        -- 3. A fresh snapshot, after the locks: delete those still unreferenced.
        DELETE FROM pgsemaphore.semaphores s
         WHERE s.name = ANY (v_names)
           AND s.family IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM pgsemaphore.slots h WHERE h.semaphore = s.name)
           AND NOT EXISTS (SELECT 1 FROM pgsemaphore.waiters w WHERE w.semaphore = s.name)
           AND NOT EXISTS (SELECT 1 FROM pgsemaphore.wakeups k WHERE k.semaphore = s.name);
        GET DIAGNOSTICS v_count = ROW_COUNT;
        v_total := v_total + v_count;
    END LOOP;
    RETURN v_total;
END;
$$;

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
