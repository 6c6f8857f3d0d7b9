-- pg-semaphore, schema version 1: the baseline.
--
-- Read in order: tables, indexes, the view of live claims, internal helpers,
-- then the functions the crate calls, grouped by who may call them (the
-- application, the operator). Every object lives in the `pgsemaphore` schema
-- (PostgreSQL reserves the `pg_` prefix), including this crate's migration
-- history (`pgsemaphore._sqlx_migrations`), so nothing collides with the
-- application's tables or its own `_sqlx_migrations`.
--
-- Privileges. Every function runs with its owner's rights (SECURITY DEFINER)
-- and a pinned search_path (pg_catalog, then pg_temp last), and refers to
-- every object by its qualified name, so a role that calls them needs no
-- table privileges and cannot redirect them with objects of its own. No
-- function is executable by PUBLIC: the README grants EXECUTE to an
-- application role and an operator role, and SELECT on the tables (the audit
-- log) to whoever reads them. The application ends or renews only its own
-- claims: each claim stores the SHA-256 of a random token that only its
-- holder knows, and release, renew and fence check it.
--
-- Plans. Every function also pins plan_cache_mode = force_generic_plan: its
-- statements run with the plan made once per session for any arguments.
-- Under the default (auto), PostgreSQL re-plans a statement on every call
-- when the generic plan's estimate is worse than a plan for the actual
-- arguments (generate_series with unknown bounds, `= ANY` of an unknown
-- array), and re-planning the claim's INSERT cost about 120 us per claim,
-- more than executing it. So every statement below is written to have a
-- good generic plan: an index probe per candidate, a primary-key lookup.
--
-- A later migration that replaces a function says so in its header, and
-- schema/pgsemaphore.sql (checked by a test) always shows the whole schema.

CREATE SCHEMA IF NOT EXISTS pgsemaphore;

-- ---------------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------------

-- One row per semaphore: the counter row that its claims serialise on.
CREATE TABLE pgsemaphore.semaphores (
    name          text        PRIMARY KEY,
    capacity      integer     NOT NULL,
    default_lease interval    NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- A hint that keeps the queue out of claims that never use it: false
    -- guarantees that the semaphore has no row in pgsemaphore.waiters. Set by
    -- enqueue and cleared by a claim that finds the queue empty, both with
    -- this row locked; true only means "look at pgsemaphore.waiters".
    queue_used    boolean     NOT NULL DEFAULT false,
    CONSTRAINT semaphores_name_length CHECK (char_length(name) BETWEEN 1 AND 200),
    CONSTRAINT semaphores_capacity_range CHECK (capacity BETWEEN 1 AND 100000),
    CONSTRAINT semaphores_lease_positive CHECK (default_lease > interval '0')
);

-- One row per claim, kept after it ends: the audit log. A claim is *live*
-- while completed_at and timed_out_at are both NULL (pgsemaphore.live_slots).
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
    -- SHA-256 of the holder's secret token (NULL: only an operator can end it).
    token_hash   bytea,
    CONSTRAINT slots_slot_non_negative CHECK (slot >= 0),
    CONSTRAINT slots_holder_length CHECK (char_length(holder) BETWEEN 1 AND 1000),
    CONSTRAINT slots_expires_after_created CHECK (expires_at > created_at),
    CONSTRAINT slots_one_outcome CHECK (completed_at IS NULL OR timed_out_at IS NULL)
);

-- The fair queue: a row per queued acquire, in arrival order (id). Its lease
-- (expires_at) is renewed by the waiting process; a waiter whose process
-- crashed stops being renewed, is ignored once its lease has ended, and is
-- deleted by the next claim, enqueue or reap that sees it.
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
    -- SHA-256 of the waiting process's token: only it may renew or leave.
    token_hash  bytea,
    CONSTRAINT waiters_permits_positive CHECK (permits >= 1),
    CONSTRAINT waiters_priority_range CHECK (priority IN (0, 1)),
    CONSTRAINT waiters_holder_length CHECK (char_length(holder) BETWEEN 1 AND 1000)
);

-- Wake-up registrations: a process has acquires (or wait_idle calls)
-- waiting on this semaphore, until `until` unless it renews that while it
-- waits, and deletes its row when its last waiter leaves. Only while a
-- registration is in force does ending a claim send a NOTIFY (see
-- pgsemaphore.notify_if_waited): a release nobody waits for costs no
-- notification, which PostgreSQL serialises across the whole instance.
CREATE TABLE pgsemaphore.wakeups (
    semaphore text        NOT NULL REFERENCES pgsemaphore.semaphores (name),
    -- SHA-256 of the process's token: one row per waiting process.
    process   bytea       NOT NULL,
    -- Which of the process's waiting spells wrote the row: a late delete of
    -- an earlier spell never removes a newer one.
    spell     bigint      NOT NULL,
    until     timestamptz NOT NULL,
    PRIMARY KEY (semaphore, process)
);

-- Rate limiters: one row per (kind, limiter, key) holds a key's state; it is
-- created by the key's first check. The limits themselves (rate, burst,
-- permit limit, window) are not stored: every check passes them.
--   * every check of one key serialises on that key's row (SELECT ... FOR
--     UPDATE; a first use inserts it, and a concurrent first use waits on the
--     insert and then takes the update path), so concurrent checks never
--     admit more than the limit; checks of other keys never wait (under
--     REPEATABLE READ or SERIALIZABLE a race on a key ends in a
--     serialization failure instead, never in over-admission);
--   * time is the database's: clock_timestamp() read *after* the row lock is
--     granted, so the clock a key sees only moves forward while checks queue
--     on it (greatest() guards against the server clock being set back);
--   * idle_at is the instant from which the row is at rest: the bucket is
--     full again, or every window that counted a permit has ended. Deleting a
--     row at rest never admits more (a missing row is a full bucket, an empty
--     window; windows restart from the next check).
CREATE TABLE pgsemaphore.rate_limits (
    kind          text        NOT NULL,
    limiter       text        NOT NULL,
    key           text        NOT NULL,
    -- token_bucket: tokens left after the last check (fractional: refills are continuous).
    tokens        double precision,
    -- windows: permits granted in the current window, and (sliding) in the previous one.
    hits          bigint,
    previous_hits bigint,
    -- token_bucket: when `tokens` was computed; windows: when the current window began.
    stamp         timestamptz NOT NULL,
    -- From this instant on the row is at rest (see above).
    idle_at       timestamptz NOT NULL,
    PRIMARY KEY (kind, limiter, key),
    CONSTRAINT rate_limits_kind CHECK (kind IN ('token_bucket', 'fixed_window', 'sliding_window')),
    CONSTRAINT rate_limits_limiter_length CHECK (char_length(limiter) BETWEEN 1 AND 200),
    CONSTRAINT rate_limits_key_length CHECK (char_length(key) BETWEEN 1 AND 256)
);

-- Tables that churn like queues: let autovacuum reclaim dead rows after 2%
-- of the table changed instead of the default 20%. Rate-limit rows are
-- updated in place (no indexed column changes): leave room for HOT updates.
ALTER TABLE pgsemaphore.slots SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);
ALTER TABLE pgsemaphore.waiters SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);
ALTER TABLE pgsemaphore.rate_limits SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);

-- ---------------------------------------------------------------------------
-- Indexes
-- ---------------------------------------------------------------------------

-- The hard limit: no slot of a semaphore is ever held twice. Also the index
-- every claim scans: live rows are few (at most the sum of the capacities,
-- plus expired ones awaiting a reap), however long the audit log grows.
CREATE UNIQUE INDEX slots_live_slot_key
    ON pgsemaphore.slots (semaphore, slot)
    WHERE completed_at IS NULL AND timed_out_at IS NULL;

-- Audit queries and retention: one semaphore's history by time.
CREATE INDEX slots_history_idx
    ON pgsemaphore.slots (semaphore, created_at);

-- The head of a semaphore's queue, and "is anyone queued?", by index.
CREATE INDEX waiters_queue_idx
    ON pgsemaphore.waiters (semaphore, priority, id);

-- ---------------------------------------------------------------------------
-- The view of live claims
-- ---------------------------------------------------------------------------

-- Live claims: those that hold a slot. A plain view (inlined by the
-- planner): its condition is exactly the partial unique index's, so every
-- query through it scans only live rows.
CREATE VIEW pgsemaphore.live_slots AS
    SELECT s.*
      FROM pgsemaphore.slots s
     WHERE s.completed_at IS NULL AND s.timed_out_at IS NULL;

-- ---------------------------------------------------------------------------
-- Internal helpers (not granted to anyone)
-- ---------------------------------------------------------------------------

-- They are called only from the functions below, which run with a pinned
-- search_path, and nobody else may call them: so they carry no SET clause
-- of their own (a SET clause costs about 7 µs per call, measured, on every
-- claim).

-- The schema's version (1 here), and the oldest version whose code still
-- works against it: a process built for schema version v may use a
-- database whose version is >= v if compatible_from <= v.
CREATE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 1, 1 $$;

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

-- ---------------------------------------------------------------------------
-- Application functions: open, claim, release, renew, fence, the queue,
-- wake-ups, rate limits
-- ---------------------------------------------------------------------------

-- Opens a semaphore: creates it with this capacity and default lease if it
-- does not exist; an existing one keeps its settings (changing them is the
-- operator's pgsemaphore.configure), so processes of two versions of an
-- application never fight over them. Returns the settings in force.
CREATE FUNCTION pgsemaphore.open(p_name text, p_capacity integer, p_lease interval)
RETURNS TABLE (o_capacity integer, o_default_lease interval, o_created boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    INSERT INTO pgsemaphore.semaphores (name, capacity, default_lease)
    VALUES (p_name, p_capacity, p_lease)
    ON CONFLICT (name) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT p_capacity, p_lease, true;
        RETURN;
    END IF;
    -- Exists (a concurrent creator's row is visible once its insert committed:
    -- ON CONFLICT waited for it).
    RETURN QUERY SELECT s.capacity, s.default_lease, false
                   FROM pgsemaphore.semaphores s WHERE s.name = p_name;
END;
$$;

-- THE CLAIM. One call, one round trip, one transaction, for every kind of
-- claim: one permit or p_permits at once (all or nothing), high or low
-- priority, inside or outside the fair queue.
--   p_token        the holder's secret; its SHA-256 is stored with the claim
--   p_permits      slots to hold at once
--   p_priority     1 high, 0 low: a low-priority claim succeeds only if at
--                  least p_reserve slots stay free after it
--   p_ticket       NULL for a claim outside the queue (refused while a live
--                  waiter of the same or higher priority is queued), else the
--                  caller's waiter id, proven by p_ticket_token: only the
--                  head of the queue may claim, its row is deleted when it
--                  does, and it is renewed by p_waiter_lease when it does not
--   p_lifo         the queue's order for p_ticket: newest first
--
-- Returns one row. o_status:
--   'claimed'   o_ids/o_slots hold the claims (lowest id first), o_free the
--               slots still free after them
--   'full'      not enough free slots (or the reserve would be touched)
--   'behind'    a waiter is ahead in the queue
--   'no_ticket' the caller's waiter row is gone (its lease ended): queue again
--   'too_many'  p_permits exceeds what the capacity and reserve ever allow
-- o_retry_in (when refused): when to look again without a wake-up: the
--   earliest held lease's end, or a queued waiter's ahead of the caller
--   (a crashed holder or waiter frees its place then), 100 ms when a lease
--   has ended but its row is locked, NULL when only a release can help.
-- o_wake: other waiters may claim now (the caller sends the wake-up, after
--   this transaction committed, with pgsemaphore.wake).
--
-- Invariant: a claim is admitted only while held + p_permits <= capacity
-- (minus the reserve), where held counts every live row this claim did not
-- reap itself (step 4, the count of held slots); the partial unique index forbids two
-- live rows on one slot. Claims on one semaphore serialise on its row
-- (FOR NO KEY UPDATE), never a table lock. Under READ COMMITTED every
-- statement of a VOLATILE function takes a fresh snapshot, so each sees every
-- claim committed before the row lock was granted.
-- Meets: other claims (serialised on the semaphore row); releases in flight
-- (their row is still live in our snapshot: counted, the slot looks taken;
-- a waiter that registers after this refusal waits for them at the wake-up
-- gate, see pgsemaphore.release); renewals in flight and fences past
-- their lease (locked rows: counted, step 4); the reaper (SKIP LOCKED on
-- both sides: a row is reaped once); a capacity change
-- (pgsemaphore.configure locks the same row);
-- enqueue and queue renewals (the waiter rows; enqueue also locks the
-- semaphore row, so the queue check under the lock sees every waiter).
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
    p_lifo         boolean DEFAULT false,
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
AS $$
DECLARE
    v_capacity integer;
    v_lease    interval;
    v_queue    boolean;
    v_now      timestamptz;
    v_live     integer;
    v_held     integer;
    v_next_end timestamptz;
    v_stuck    boolean;
    v_expired  integer;
    v_reaped   integer;
    v_reserve  integer := CASE WHEN p_priority = 0 THEN p_reserve ELSE 0 END;
    v_ahead    timestamptz;
    v_dropped  integer := 0;
BEGIN
    -- Every statement below must take a fresh snapshot after the locks it
    -- waited for: READ COMMITTED only.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pg_semaphore.claim needs READ COMMITTED isolation, the session uses %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
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

    -- 2. Lock the semaphore's row: claims on it serialise from here.
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
        UPDATE pgsemaphore.waiters w
           SET expires_at = greatest(w.expires_at, v_now + p_waiter_lease)
         WHERE w.id = p_ticket AND w.token_hash = sha256(p_ticket_token);
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
                OR (NOT p_lifo AND w.id < p_ticket)
                OR (p_lifo AND w.id > p_ticket));
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
    -- order, which is identity order: o_ids ascend. created_at is read inside this statement,
    -- after its snapshot was taken: every release this claim relies on
    -- committed before that, so its completed_at is earlier than our
    -- created_at and the audit log never shows two claims overlapping on a slot.
    WITH inserted AS (
        INSERT INTO pgsemaphore.slots AS n
               (semaphore, slot, holder, metadata, created_at, expires_at, token_hash)
        SELECT p_semaphore, f.slot, p_holder, p_metadata, t.now,
               t.now + coalesce(p_lease, v_lease), sha256(p_token)
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
        DELETE FROM pgsemaphore.waiters w WHERE w.id = p_ticket;
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

-- Ends the claims p_ids of one permit (a weighted permit has several), if
-- p_token is theirs. p_lost: the holder was already told the permit is lost
-- (its lease could not be guaranteed), so its claims end as timed out, never
-- as completed: the audit log and the holder agree. Returns one row:
--   'released'   every claim was live with its lease running; this call
--                ended them (o_id NULL)
--   otherwise the outcome of the first claim (by id) that was not, o_id its id:
--   'not_holder' the token does not match: nothing was changed
--   'timed_out'  reaped at o_at, or its lease had already ended (reaped now,
--                at o_at: a release after the lease never counts as one)
--   'completed'  already released at o_at
--   'missing'    no such claim
-- and o_wake: whether the caller must run pgsemaphore.wake_claimed(p_ids[1])
-- after this transaction commits, because a waiter is registered. Sends no
-- NOTIFY itself: a NOTIFY would hold its instance-wide lock through this
-- durable commit.
--
-- THE WAKE-UP GATE. The release looks for registered waiters inside its own
-- transaction, so that a release nobody waits for commits once and is done.
-- Checked there alone, it could miss a waiter W that registers and then
-- claims while the release R is uncommitted (see
-- pgsemaphore.notify_if_waited). The gate closes that race: a
-- transaction-scoped advisory lock per semaphore (key: the class
-- 1885828965, 'pgse', and hashtext of the name; the README asks Mutex users
-- to keep out of that class). R takes it in shared mode, after its row
-- locks (so releases never wait for each other, and no deadlock with
-- anything that waits for a slot row), and only then, in a statement of its
-- own (a new snapshot under READ COMMITTED), looks for a registration.
-- pgsemaphore.keep_waiting takes it in exclusive mode after writing a
-- registration, before that commits. So either:
--   * W's registration took the gate first: R waited for W's commit, and
--     R's check sees the registration; or
--   * R took the gate first: W's registration commits only after R has
--     ended, and W's claim, which comes after its registration, sees the
--     slots R freed.
-- R holds the gate until its commit ends (a WAL flush at most), so a
-- registration waits at most that long. Under REPEATABLE READ or
-- SERIALIZABLE a statement gets no new snapshot, so the check cannot be
-- trusted: o_wake is then true whenever slots were freed, and the check
-- after the commit (notify_if_waited) decides. Any role may take an
-- advisory lock: a session holding the gate delays the semaphore's
-- releases, and cannot make anything admit too many.
-- Meets: renewals and fences (row locks, taken in id order by all three, so
-- no deadlock); the reaper and claims reaping (SKIP LOCKED on their side: a
-- row this call has locked is never reaped under it); a waiter registering
-- (the gate, above). Durable.
CREATE FUNCTION pgsemaphore.release(p_ids bigint[], p_token bytea, p_lost boolean DEFAULT false)
RETURNS TABLE (o_outcome text, o_id bigint, o_at timestamptz, o_wake boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_hash      bytea := sha256(p_token);
    v_now       timestamptz;
    v_done      bigint[] := '{}';
    v_semaphore text;
    r           record;
BEGIN
    PERFORM pgsemaphore.durable_commit();
    o_wake := false;
    -- The common case, one statement: every claim ours, live, its lease
    -- running. The UPDATE locks the rows in id order (the primary key's).
    IF NOT p_lost THEN
        v_now := clock_timestamp();
        WITH done AS (
            UPDATE pgsemaphore.slots s
               SET completed_at = v_now
             WHERE s.id = ANY (p_ids) AND s.token_hash = v_hash
               AND s.completed_at IS NULL AND s.timed_out_at IS NULL AND s.expires_at > v_now
            RETURNING s.id, s.semaphore
        )
        SELECT coalesce(array_agg(d.id), '{}'), min(d.semaphore) INTO v_done, v_semaphore FROM done d;
    END IF;
    IF NOT p_lost AND cardinality(v_done) = cardinality(p_ids) THEN
        o_outcome := 'released';
        o_at := v_now;
    ELSE
        -- Otherwise lock the rest, in id order, and say what stood in the way.
        PERFORM 1 FROM pgsemaphore.slots s WHERE s.id = ANY (p_ids) ORDER BY s.id FOR UPDATE;
        SELECT min(s.id) INTO o_id
          FROM pgsemaphore.slots s
         WHERE s.id = ANY (p_ids) AND s.token_hash IS DISTINCT FROM v_hash;
        IF o_id IS NOT NULL THEN
            o_outcome := 'not_holder';
        END IF;
    END IF;
    IF o_outcome IS NULL THEN
        v_now := clock_timestamp();
        -- (Claims the statement above just completed are fine: skip them.)
        SELECT i.id, s.id AS found, s.completed_at, s.timed_out_at
          INTO r
          FROM unnest(p_ids) AS i(id)
          LEFT JOIN pgsemaphore.slots s ON s.id = i.id
         WHERE i.id <> ALL (v_done)
           AND (s.id IS NULL OR s.completed_at IS NOT NULL OR s.timed_out_at IS NOT NULL
                OR s.expires_at <= v_now OR p_lost)
         ORDER BY i.id
         LIMIT 1;
        -- End every claim still live: timed out, since its lease had ended or
        -- its holder was told it was lost. (v_semaphore: set if this call
        -- freed any slot, by either statement.)
        WITH ended AS (
            UPDATE pgsemaphore.slots s
               SET timed_out_at = v_now
             WHERE s.id = ANY (p_ids) AND s.completed_at IS NULL AND s.timed_out_at IS NULL
            RETURNING s.semaphore
        )
        SELECT coalesce(v_semaphore, min(e.semaphore)) INTO v_semaphore FROM ended e;
        IF r.id IS NULL THEN
            o_outcome := 'released';
            o_at := v_now;
        ELSIF r.found IS NULL THEN
            o_outcome := 'missing';
            o_id := r.id;
        ELSIF r.timed_out_at IS NOT NULL THEN
            o_outcome := 'timed_out';
            o_id := r.id;
            o_at := r.timed_out_at;
        ELSIF r.completed_at IS NOT NULL THEN
            o_outcome := 'completed';
            o_id := r.id;
            o_at := r.completed_at;
        ELSE
            o_outcome := 'timed_out';
            o_id := r.id;
            o_at := v_now;
        END IF;
    END IF;
    -- Slots were freed (v_semaphore is set): look for waiters, under the gate.
    IF v_semaphore IS NOT NULL THEN
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            o_wake := true;
        ELSE
            PERFORM pg_advisory_xact_lock_shared(1885828965, hashtext(v_semaphore));
            -- A statement of its own: its snapshot is taken after the gate.
            o_wake := EXISTS (SELECT 1 FROM pgsemaphore.wakeups w
                               WHERE w.semaphore = v_semaphore AND w.until > clock_timestamp());
        END IF;
    END IF;
    RETURN NEXT;
END;
$$;

-- Ends whatever live claims of p_semaphore carry p_token: for a client whose
-- claim's reply was lost (the connection broke after the claim was sent), so
-- that a claim it never saw does not hold its slot for a whole lease.
-- Returns how many it ended. Durable; the caller wakes waiters after.
CREATE FUNCTION pgsemaphore.release_by_token(p_semaphore text, p_token bytea)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_count integer;
BEGIN
    PERFORM pgsemaphore.durable_commit();
    UPDATE pgsemaphore.slots s
       SET completed_at = clock_timestamp()
      FROM (SELECT l.id FROM pgsemaphore.live_slots l
             WHERE l.semaphore = p_semaphore AND l.token_hash = sha256(p_token)
             ORDER BY l.id FOR UPDATE) mine
     WHERE s.id = mine.id;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;

-- Renews the claims p_ids of one permit to end p_lease from now, never
-- earlier than they already end. One row per id:
--   'renewed'    live and unexpired; o_at = its expires_at now
--   'timed_out'  reaped (now, because its lease had ended, or earlier);
--                o_at = timed_out_at
--   'completed'  released; o_at = completed_at
--   'missing'    no such claim
--   'not_holder' the token does not match (nothing changed)
-- The clock is read after the row locks are granted, and a lease only moves
-- forward (greatest): two renewals of one claim that reach its lock out of
-- order (a retry while the first still runs on the server) never shorten it.
-- Meets: releases and fences (row locks in id order); the reaper and claims
-- reaping (SKIP LOCKED: a row locked here is counted as held by them, never
-- reaped under it). Durable.
CREATE FUNCTION pgsemaphore.renew(p_ids bigint[], p_token bytea, p_lease interval)
RETURNS TABLE (o_id bigint, o_outcome text, o_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_hash bytea := sha256(p_token);
    v_now  timestamptz;
BEGIN
    IF p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'pg_semaphore.renew needs a positive lease, got %', p_lease
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
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
          FROM unnest(p_ids) AS i(id)
          LEFT JOIN pgsemaphore.slots s ON s.id = i.id
         WHERE s.id IS NULL OR s.token_hash IS DISTINCT FROM v_hash
            OR s.completed_at IS NOT NULL OR s.timed_out_at IS NOT NULL;
END;
$$;

-- Fences a write: inside the caller's transaction, share-locks each claim's
-- row (in id order) and reports it. While that transaction lasts a release
-- waits for it and reapers and claims skip the row and count it as held, so
-- work committed in it happened while the permit held its slots. One row
-- per id: 'held' (live, lease running), 'expired' (live, lease ended: any
-- reaper may take it once this transaction ends), 'timed_out', 'completed'
-- (o_at set), 'missing', 'not_holder'.
CREATE FUNCTION pgsemaphore.fence(p_ids bigint[], p_token bytea)
RETURNS TABLE (o_id bigint, o_outcome text, o_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_hash bytea := sha256(p_token);
BEGIN
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
          FROM unnest(p_ids) AS i(id)
          LEFT JOIN pgsemaphore.slots s ON s.id = i.id
         ORDER BY i.id;
END;
$$;

-- Joins the queue: returns the waiter's id (its place), or NULL when p_limit
-- live waiters are queued already, and whether it removed dead waiters (the
-- caller then wakes the others). Serialised with claims on the semaphore's
-- row, so the limit is exact. A waiter row is a hint, not a claim: its
-- commit does not wait for a WAL flush (a crash loses at most a place in the
-- queue, which the waiter notices as 'no_ticket' and takes again).
CREATE FUNCTION pgsemaphore.enqueue(
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
AS $$
DECLARE
    v_now     timestamptz;
    v_count   integer;
    v_dropped integer;
BEGIN
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

-- Leaves the queue (a cancelled waiter) and wakes the semaphore's waiters,
-- so the next head looks. A hint transaction: no WAL flush awaited, so the
-- NOTIFY in it holds its lock only briefly.
CREATE FUNCTION pgsemaphore.leave_queue(p_ticket bigint, p_token bytea)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_semaphore text;
BEGIN
    PERFORM pgsemaphore.fast_commit();
    DELETE FROM pgsemaphore.waiters w
     WHERE w.id = p_ticket AND w.token_hash = sha256(p_token)
    RETURNING w.semaphore INTO v_semaphore;
    IF v_semaphore IS NULL THEN
        RETURN false;
    END IF;
    PERFORM pgsemaphore.notify_if_waited(v_semaphore);
    RETURN true;
END;
$$;

-- A process that has acquires (or wait_idle calls) waiting on p_semaphore
-- registers for wake-ups until p_lease from now, for its waiting spell
-- p_spell (unless p_register is false: behind a transaction pooler nothing
-- can LISTEN), and renews the leases of its queued waiters p_tickets (those
-- whose lease has not ended: a waiter whose lease ended is gone for
-- everyone else and stays gone). Called before the claim that precedes a
-- process's first wait, then every third of p_lease while anyone there
-- waits. A registration is written only when it would otherwise end within
-- two thirds of p_lease. Ticket rows are locked in id order, skipping any a
-- claim holds right now, so it never deadlocks with a claim deleting them.
-- A registration written here takes the wake-up gate in exclusive mode last
-- (see pgsemaphore.release): it commits only after every release of
-- p_semaphore that checked for waiters without seeing it has ended, so the
-- claim that follows sees what those releases freed. A hint transaction.
CREATE FUNCTION pgsemaphore.keep_waiting(p_semaphore text, p_lease interval,
                                         p_tickets bigint[], p_token bytea,
                                         p_register boolean, p_spell bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_until timestamptz;
BEGIN
    PERFORM pgsemaphore.fast_commit();
    v_until := clock_timestamp() + p_lease;
    IF p_register THEN
        INSERT INTO pgsemaphore.wakeups AS k (semaphore, process, spell, until)
        VALUES (p_semaphore, sha256(p_token), p_spell, v_until)
        ON CONFLICT (semaphore, process) DO UPDATE SET until = excluded.until, spell = excluded.spell
         WHERE k.until < excluded.until - p_lease / 3 OR k.spell <> excluded.spell;
    END IF;
    IF cardinality(p_tickets) > 0 THEN
        UPDATE pgsemaphore.waiters w
           SET expires_at = greatest(w.expires_at, v_until)
          FROM (SELECT d.id FROM pgsemaphore.waiters d
                 WHERE d.id = ANY (p_tickets) AND d.token_hash = sha256(p_token)
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

-- The process's last waiter on p_semaphore left: it stops registering, so
-- releases stop notifying (unless another process waits). Only the row of
-- the spell p_spell: a newer spell's registration stays. A hint transaction.
CREATE FUNCTION pgsemaphore.stop_waiting(p_semaphore text, p_token bytea, p_spell bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM pgsemaphore.fast_commit();
    DELETE FROM pgsemaphore.wakeups k
     WHERE k.semaphore = p_semaphore AND k.process = sha256(p_token) AND k.spell = p_spell;
END;
$$;

-- Sends the semaphore's wake-up if anyone waits for it (see
-- pgsemaphore.notify_if_waited); run it in a transaction of its own after
-- the one that freed slots. Returns whether it notified.
CREATE FUNCTION pgsemaphore.wake(p_semaphore text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN pgsemaphore.notify_if_waited(p_semaphore);
END;
$$;

-- The same for the semaphore of claim p_claim: what a release sends, in the
-- same round trip as its own (committed) transaction, knowing only the id.
-- (PL/pgSQL, like every function on a hot path here: a LANGUAGE sql
-- function that cannot be inlined is planned again on every call.)
CREATE FUNCTION pgsemaphore.wake_claimed(p_claim bigint)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN pgsemaphore.notify_if_waited(
        (SELECT s.semaphore FROM pgsemaphore.slots s WHERE s.id = p_claim));
END;
$$;

-- The release as the crate sends it, one statement: pgsemaphore.release,
-- and only if it says a waiter was registered (o_wake), COMMIT (durable)
-- and pgsemaphore.wake_claimed in a transaction of its own (fast), so the
-- NOTIFY is sent after the release committed and never holds its
-- instance-wide lock through the release's WAL flush. A release nobody
-- waits for is one transaction: its check ran inside it, under the wake-up
-- gate (see pgsemaphore.release). One statement can be prepared once
-- per connection; the same steps as a simple-protocol batch (BEGIN; SELECT
-- release; COMMIT; SELECT wake_claimed) were parsed and planned on every
-- release: a claim + release cycle took 0.64-0.80 ms against 0.53-0.60 ms
-- with a procedure (pgbench, one client, this machine).
-- A procedure, because only a procedure may commit; and so with the
-- caller's rights, because a procedure that commits may have neither
-- SECURITY DEFINER nor a SET clause. It only calls two functions that the
-- application may call anyway, by their qualified names, so a caller's
-- search_path cannot change what it runs. CALL it outside a transaction
-- block (it may commit). Meets: what release and notify_if_waited meet.
CREATE PROCEDURE pgsemaphore.release_then_wake(
    p_ids bigint[], p_token bytea, p_lost boolean,
    INOUT o_outcome text DEFAULT NULL, INOUT o_id bigint DEFAULT NULL,
    INOUT o_at timestamptz DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    v_wake boolean;
BEGIN
    SELECT r.o_outcome, r.o_id, r.o_at, r.o_wake INTO o_outcome, o_id, o_at, v_wake
      FROM pgsemaphore.release(p_ids, p_token, p_lost) r;
    IF v_wake THEN
        COMMIT;
        PERFORM pgsemaphore.wake_claimed(p_ids[1]);
    END IF;
END;
$$;

-- Rate limiters: TOKEN BUCKET (Stripe's request rate limiter, with the
-- database's clock). The bucket holds up to p_burst tokens and refills
-- continuously at p_rate tokens per second; a check takes p_n tokens if that
-- many are there, else takes nothing. A key's first check finds a full
-- bucket. Returns whether it was admitted, the whole tokens left, and
-- (refused) how many microseconds until p_n tokens will be there, 0 when
-- admitted.
CREATE FUNCTION pgsemaphore.token_bucket(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision, p_n double precision)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_tokens double precision;
    v_stamp  timestamptz;
    v_now    timestamptz;
    v_found  boolean;
BEGIN
    IF NOT (p_rate > 0 AND p_burst >= 1 AND p_n >= 1 AND p_n <= p_burst) THEN
        RAISE EXCEPTION 'token bucket: need rate > 0 and 1 <= n <= burst (rate %, burst %, n %)',
            p_rate, p_burst, p_n USING ERRCODE = 'invalid_parameter_value';
    END IF;
    LOOP
        SELECT r.tokens, r.stamp INTO v_tokens, v_stamp
          FROM pgsemaphore.rate_limits r
         WHERE r.kind = 'token_bucket' AND r.limiter = p_limiter AND r.key = p_key
           FOR UPDATE;
        v_found := FOUND;
        v_now := clock_timestamp();
        IF v_found THEN
            v_tokens := least(p_burst,
                              v_tokens + greatest(0, extract(epoch FROM v_now - v_stamp)::double precision) * p_rate);
            v_stamp := greatest(v_stamp, v_now);
        ELSE
            v_tokens := p_burst;
            v_stamp := v_now;
        END IF;
        o_allowed := v_tokens >= p_n;
        IF o_allowed THEN
            v_tokens := v_tokens - p_n;
            o_retry_after_us := 0;
        ELSE
            o_retry_after_us := ceil((p_n - v_tokens) / p_rate * 1e6)::bigint;
        END IF;
        o_remaining := floor(v_tokens)::bigint;
        IF v_found THEN
            UPDATE pgsemaphore.rate_limits r
               SET tokens = v_tokens,
                   stamp = v_stamp,
                   idle_at = v_stamp + make_interval(secs => (p_burst - v_tokens) / p_rate)
             WHERE r.kind = 'token_bucket' AND r.limiter = p_limiter AND r.key = p_key;
            RETURN NEXT;
            RETURN;
        END IF;
        INSERT INTO pgsemaphore.rate_limits (kind, limiter, key, tokens, stamp, idle_at)
        VALUES ('token_bucket', p_limiter, p_key, v_tokens, v_stamp,
                v_stamp + make_interval(secs => (p_burst - v_tokens) / p_rate))
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN NEXT;
            RETURN;
        END IF;
        -- A concurrent first check inserted the row: the next SELECT waits for it.
    END LOOP;
END;
$$;

-- FIXED WINDOW. At most p_limit permits per window of p_window. A key's
-- first check starts its first window; later windows follow back to back on
-- that key's own grid (keys do not all reset at the same instant).
-- Returns whether it was admitted, the permits left in this window, and
-- (refused) the microseconds until this window ends, 0 when admitted.
CREATE FUNCTION pgsemaphore.fixed_window(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_hits  bigint;
    v_start timestamptz;
    v_now   timestamptz;
    v_found boolean;
BEGIN
    IF NOT (p_limit >= 1 AND p_window > interval '0' AND p_n >= 1 AND p_n <= p_limit) THEN
        RAISE EXCEPTION 'fixed window: need window > 0 and 1 <= n <= limit (limit %, window %, n %)',
            p_limit, p_window, p_n USING ERRCODE = 'invalid_parameter_value';
    END IF;
    LOOP
        SELECT r.hits, r.stamp INTO v_hits, v_start
          FROM pgsemaphore.rate_limits r
         WHERE r.kind = 'fixed_window' AND r.limiter = p_limiter AND r.key = p_key
           FOR UPDATE;
        v_found := FOUND;
        v_now := clock_timestamp();
        IF NOT v_found THEN
            v_hits := 0;
            v_start := v_now;
        ELSIF v_now >= v_start + p_window THEN
            -- The window containing now, on this key's grid.
            v_start := date_bin(p_window, v_now, v_start);
            v_hits := 0;
        END IF;
        o_allowed := v_hits + p_n <= p_limit;
        IF o_allowed THEN
            v_hits := v_hits + p_n;
            o_retry_after_us := 0;
        ELSE
            o_retry_after_us := ceil(extract(epoch FROM v_start + p_window - v_now) * 1e6)::bigint;
        END IF;
        o_remaining := greatest(0, p_limit - v_hits);
        IF v_found THEN
            UPDATE pgsemaphore.rate_limits r
               SET hits = v_hits, stamp = v_start, idle_at = v_start + p_window
             WHERE r.kind = 'fixed_window' AND r.limiter = p_limiter AND r.key = p_key;
            RETURN NEXT;
            RETURN;
        END IF;
        INSERT INTO pgsemaphore.rate_limits (kind, limiter, key, hits, stamp, idle_at)
        VALUES ('fixed_window', p_limiter, p_key, v_hits, v_start, v_start + p_window)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN NEXT;
            RETURN;
        END IF;
    END LOOP;
END;
$$;

-- SLIDING WINDOW, as a weighted previous + current window (one row per key,
-- O(1) per check). Windows follow back to back on the key's grid as above.
-- The permits counted for the last p_window are estimated as
--     previous_hits * (1 - elapsed / p_window) + hits
-- where elapsed is the time since the current window began: the previous
-- window's permits are assumed spread evenly over it and slide out linearly.
-- A check is admitted when estimate + p_n <= p_limit. Never more than p_limit
-- permits are granted in one window of the grid.
-- Returns whether it was admitted, the permits left now (floor of
-- p_limit - estimate), and (refused) the microseconds until p_n permits
-- would be admitted if nothing else happened, 0 when admitted.
CREATE FUNCTION pgsemaphore.sliding_window(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_hits     bigint;
    v_previous bigint;
    v_start    timestamptz;
    v_now      timestamptz;
    v_found    boolean;
    v_window   double precision := extract(epoch FROM p_window)::double precision;
    v_elapsed  double precision;
    v_estimate double precision;
    v_wait     double precision;
BEGIN
    IF NOT (p_limit >= 1 AND p_window > interval '0' AND p_n >= 1 AND p_n <= p_limit) THEN
        RAISE EXCEPTION 'sliding window: need window > 0 and 1 <= n <= limit (limit %, window %, n %)',
            p_limit, p_window, p_n USING ERRCODE = 'invalid_parameter_value';
    END IF;
    LOOP
        SELECT r.hits, r.previous_hits, r.stamp INTO v_hits, v_previous, v_start
          FROM pgsemaphore.rate_limits r
         WHERE r.kind = 'sliding_window' AND r.limiter = p_limiter AND r.key = p_key
           FOR UPDATE;
        v_found := FOUND;
        v_now := clock_timestamp();
        IF NOT v_found THEN
            v_hits := 0;
            v_previous := 0;
            v_start := v_now;
        ELSIF v_now >= v_start + 2 * p_window THEN
            -- Both counted windows are over.
            v_start := date_bin(p_window, v_now, v_start);
            v_previous := 0;
            v_hits := 0;
        ELSIF v_now >= v_start + p_window THEN
            -- The next window: the current one becomes the previous one.
            v_start := v_start + p_window;
            v_previous := v_hits;
            v_hits := 0;
        END IF;
        v_elapsed := least(1, greatest(0, extract(epoch FROM v_now - v_start)::double precision / v_window));
        v_estimate := v_previous * (1 - v_elapsed) + v_hits;
        o_allowed := v_estimate + p_n <= p_limit;
        IF o_allowed THEN
            v_hits := v_hits + p_n;
            v_estimate := v_estimate + p_n;
            o_retry_after_us := 0;
        ELSIF v_hits + p_n <= p_limit THEN
            -- Admitted later in this window, once enough of the previous one slid out:
            -- previous * (1 - t) + hits + n <= limit.
            v_wait := (1 - (p_limit - v_hits - p_n)::double precision / v_previous - v_elapsed) * v_window;
            o_retry_after_us := greatest(1, ceil(v_wait * 1e6))::bigint;
        ELSE
            -- Only in the next window, once enough of this one slid out:
            -- hits * (1 - t) + n <= limit.
            v_wait := (1 - v_elapsed) * v_window
                      + (1 - (p_limit - p_n)::double precision / v_hits) * v_window;
            o_retry_after_us := greatest(1, ceil(v_wait * 1e6))::bigint;
        END IF;
        o_remaining := greatest(0, floor(p_limit - v_estimate))::bigint;
        IF v_found THEN
            UPDATE pgsemaphore.rate_limits r
               SET hits = v_hits, previous_hits = v_previous, stamp = v_start,
                   idle_at = v_start + 2 * p_window
             WHERE r.kind = 'sliding_window' AND r.limiter = p_limiter AND r.key = p_key;
            RETURN NEXT;
            RETURN;
        END IF;
        INSERT INTO pgsemaphore.rate_limits (kind, limiter, key, hits, previous_hits, stamp, idle_at)
        VALUES ('sliding_window', p_limiter, p_key, v_hits, v_previous, v_start, v_start + 2 * p_window)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN NEXT;
            RETURN;
        END IF;
    END LOOP;
END;
$$;

-- ---------------------------------------------------------------------------
-- Operator functions: configure, force_release, reap, prune
-- ---------------------------------------------------------------------------

-- Creates a semaphore or changes its capacity and default lease (a NULL
-- keeps the current value; p_create false: an unknown name is an error, not
-- a new semaphore). Holders above a reduced capacity keep their slots until
-- they release; claims see the new capacity at once (they lock the same
-- row). Wakes waiters when the capacity grew. Returns the settings now and
-- the previous capacity (NULL when it was created).
CREATE FUNCTION pgsemaphore.configure(p_name text, p_capacity integer, p_lease interval,
                                      p_create boolean DEFAULT true)
RETURNS TABLE (o_capacity integer, o_default_lease interval, o_previous_capacity integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_old_capacity integer;
    v_old_lease    interval;
    v_capacity     integer;
    v_lease        interval;
BEGIN
    LOOP
        SELECT s.capacity, s.default_lease INTO v_old_capacity, v_old_lease
          FROM pgsemaphore.semaphores s
         WHERE s.name = p_name
           FOR NO KEY UPDATE;
        IF FOUND THEN
            v_capacity := coalesce(p_capacity, v_old_capacity);
            v_lease := coalesce(p_lease, v_old_lease);
            IF v_old_capacity <> v_capacity OR v_old_lease <> v_lease THEN
                UPDATE pgsemaphore.semaphores s
                   SET capacity = v_capacity, default_lease = v_lease, updated_at = clock_timestamp()
                 WHERE s.name = p_name;
            END IF;
            IF v_capacity > v_old_capacity THEN
                -- Rare: an operator's action. The notification waits for
                -- this commit; nothing else does.
                PERFORM pg_notify('pgsemaphore', p_name);
            END IF;
            RETURN QUERY SELECT v_capacity, v_lease, v_old_capacity;
            RETURN;
        END IF;
        IF NOT p_create THEN
            RAISE EXCEPTION 'semaphore % does not exist', quote_literal(p_name)
                USING ERRCODE = 'no_data_found';
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

-- Ends a claim by id, whoever holds it (an operator freeing a stuck slot).
-- Returns 'released' (ended now), 'timed_out' or 'completed' (already ended,
-- at o_at) or 'missing', and wakes the semaphore's waiters.
CREATE FUNCTION pgsemaphore.force_release(p_id bigint)
RETURNS TABLE (o_outcome text, o_semaphore text, o_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_semaphore    text;
    v_completed_at timestamptz;
    v_timed_out_at timestamptz;
BEGIN
    PERFORM pgsemaphore.durable_commit();
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

-- Marks every expired live claim (of every semaphore) timed out, deletes
-- queue waiters whose process stopped renewing them, wakes the semaphores
-- that gained room and have waiters, and returns how many claims it reaped.
-- SKIP LOCKED: a row locked by a release, renewal or fence is left (and
-- counted as held by every claim) until that transaction ends.
CREATE FUNCTION pgsemaphore.reap()
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
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
        PERFORM pgsemaphore.notify_if_waited(v_semaphore);
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
        PERFORM pgsemaphore.notify_if_waited(v_semaphore);
    END LOOP;
    DELETE FROM pgsemaphore.wakeups k WHERE k.until <= v_now;
    RETURN v_total;
END;
$$;

-- Retention: deletes finished claims (completed or timed out) that ended
-- before now - p_older_than, at most p_batch rows per call, oldest first per
-- semaphore, so a large backlog is removed in short transactions. Live claims
-- are never touched. Driven by the history index: a claim ended after it
-- began, so only claims *created* before the cutoff are looked at, and with
-- nothing old enough it reads next to nothing, however long the log.
CREATE FUNCTION pgsemaphore.prune(p_older_than interval, p_batch integer)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_cutoff timestamptz := clock_timestamp() - p_older_than;
    v_ids    bigint[];
    v_count  bigint;
BEGIN
    -- Per semaphore, the oldest claims created before the cutoff (the
    -- history index), those that ended before it, locked; rows a reaper,
    -- release or fence holds right now are left for the next round.
    SELECT array_agg(o.id) INTO v_ids
      FROM (SELECT d.id
              FROM pgsemaphore.semaphores m,
                   LATERAL (SELECT h.id
                              FROM pgsemaphore.slots h
                             WHERE h.semaphore = m.name AND h.created_at < v_cutoff
                               AND coalesce(h.completed_at, h.timed_out_at) < v_cutoff
                             ORDER BY h.created_at
                             LIMIT p_batch
                               FOR UPDATE SKIP LOCKED) d
             LIMIT p_batch) o;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    DELETE FROM pgsemaphore.slots s WHERE s.id = ANY (v_ids);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;

-- Deletes rate-limit keys at rest since at least p_idle_for (see idle_at):
-- never a key whose state still limits anyone. Walks the primary key from
-- just after (p_kind, p_limiter, p_key), looking at p_batch rows per call so
-- that each call is a short transaction, and skips rows a check holds right
-- now. Returns how many rows it deleted and the last row it looked at, NULLs
-- when it reached the end: pass that row back to continue.
CREATE FUNCTION pgsemaphore.prune_rate_limits(
    p_idle_for interval, p_kind text, p_limiter text, p_key text, p_batch integer)
RETURNS TABLE (o_deleted bigint, o_kind text, o_limiter text, o_key text)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH scanned AS (
        SELECT r.kind, r.limiter, r.key
          FROM pgsemaphore.rate_limits r
         WHERE (r.kind, r.limiter, r.key) > (p_kind, p_limiter, p_key)
         ORDER BY r.kind, r.limiter, r.key
         LIMIT p_batch
    ), doomed AS (
        -- The idle test is re-evaluated on the row as locked: a check that
        -- committed meanwhile keeps its key.
        SELECT r.kind, r.limiter, r.key
          FROM pgsemaphore.rate_limits r
          JOIN scanned s ON (r.kind, r.limiter, r.key) = (s.kind, s.limiter, s.key)
         WHERE r.idle_at <= clock_timestamp() - p_idle_for
           FOR UPDATE OF r SKIP LOCKED
    ), deleted AS (
        DELETE FROM pgsemaphore.rate_limits r
         USING doomed d
         WHERE (r.kind, r.limiter, r.key) = (d.kind, d.limiter, d.key)
        RETURNING 1
    ), last AS (
        SELECT s.kind, s.limiter, s.key, count(*) OVER () AS scanned
          FROM scanned s
         ORDER BY s.kind DESC, s.limiter DESC, s.key DESC
         LIMIT 1
    )
    SELECT (SELECT count(*) FROM deleted),
           CASE WHEN l.scanned >= p_batch THEN l.kind END,
           CASE WHEN l.scanned >= p_batch THEN l.limiter END,
           CASE WHEN l.scanned >= p_batch THEN l.key END
      FROM (SELECT 1) AS one
      LEFT JOIN last l ON true
$$;

-- ---------------------------------------------------------------------------
-- Privileges: nobody but the owner runs anything until granted (see the
-- README for the application and operator grants).
-- ---------------------------------------------------------------------------

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
