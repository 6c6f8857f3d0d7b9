-- pg-semaphore's schema, version 1 (the 0.1 baseline), part 1 of 7: the
-- tables, their indexes, the views over them and the triggers that keep
-- them consistent.
--
-- The baseline is seven files, one per concept, applied in order; each
-- function, table, index, trigger and grant is defined once, in the file of
-- its concept:
--   1. tables (this file);
--   2. admission: lease semaphores' open, claim, release, renew, fence;
--   3. the fair queue and wake-ups;
--   4. the advisory semaphore;
--   5. semaphore families;
--   6. rate limits;
--   7. operator functions, and schema_version(), written last: a schema
--      reports its version only once every file of the baseline is in.
-- A released file is never edited: a schema change after a release is a
-- new migration file, which brings the schema to the next version.
--
-- Every object lives in the `pgsemaphore` schema (PostgreSQL reserves the
-- `pg_` prefix), including this crate's migration history
-- (`pgsemaphore._sqlx_migrations`), so nothing collides with the
-- application's tables or its own `_sqlx_migrations`.
--
-- Privileges. Every function the crate calls runs with its owner's rights
-- (SECURITY DEFINER) and a pinned search_path (pg_catalog, then pg_temp
-- last), and refers to every object by its qualified name, so a role that
-- calls them needs no table privileges and cannot redirect them with objects
-- of its own. No function is executable by PUBLIC (each file revokes it from
-- the routines it defines before it commits): the README grants EXECUTE to
-- an application role and an operator role, and SELECT on the tables (the
-- audit log) to whoever reads them. The application ends or renews only its
-- own claims: each claim stores the SHA-256 of a random token that only its
-- holder knows, and release, renew and fence check it.
--
-- Plans. Every function also pins plan_cache_mode = force_generic_plan: its
-- statements run with the plan made once per session for any arguments.
-- Under the default (auto), PostgreSQL re-plans a statement on every call
-- when the generic plan's estimate is worse than a plan for the actual
-- arguments (generate_series with unknown bounds, `= ANY` of an unknown
-- array), and re-planning the claim's INSERT cost about 120 us per claim,
-- more than executing it. So every statement is written to have a good
-- generic plan: an index probe per candidate, a primary-key lookup.
--
-- Contracts. Each function's contract is in its body, as its first lines,
-- so that it survives in pg_dump's output (schema/pgsemaphore.sql) and in
-- `\sf` from psql; each admission decision names its *Invariant* and every
-- transaction it *Meets*. schema/pgsemaphore.sql (checked by a test) shows
-- the whole schema in one file.

CREATE SCHEMA IF NOT EXISTS pgsemaphore;

-- ---------------------------------------------------------------------------
-- Semaphore families (first: a family key's semaphore row references its
-- family)
-- ---------------------------------------------------------------------------

-- A family: a name, the default capacity and lease of its keys, and how
-- long a key must be unreferenced before the reaper removes it.
CREATE TABLE pgsemaphore.families (
    name             text PRIMARY KEY,
    default_capacity integer NOT NULL,
    default_lease    interval NOT NULL,
    idle_after       interval NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT families_name_shape CHECK (name ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    CONSTRAINT families_capacity_range CHECK (default_capacity BETWEEN 1 AND 100000),
    CONSTRAINT families_lease_range CHECK (default_lease BETWEEN interval '10 ms' AND interval '366 days'),
    CONSTRAINT families_idle_after_range CHECK (idle_after BETWEEN interval '0' AND interval '366 days')
);

-- A capacity rule: kind 'key' matches one key exactly, kind 'tier' every
-- key that family_tiers puts in that tier. An exact-key rule wins over a
-- tier rule, which wins over the family's default.
CREATE TABLE pgsemaphore.family_rules (
    family     text NOT NULL REFERENCES pgsemaphore.families (name),
    kind       text NOT NULL,
    match      text NOT NULL,
    capacity   integer NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (family, kind, match),
    CONSTRAINT family_rules_kind CHECK (kind IN ('key', 'tier')),
    CONSTRAINT family_rules_match_length CHECK (
        char_length(match) BETWEEN 1 AND CASE kind WHEN 'key' THEN 128 ELSE 64 END),
    CONSTRAINT family_rules_capacity_range CHECK (capacity BETWEEN 1 AND 100000)
);

-- The operator's assignment of keys to tiers (a key in no tier, or in a
-- tier without a rule, gets the family's default).
CREATE TABLE pgsemaphore.family_tiers (
    family     text NOT NULL REFERENCES pgsemaphore.families (name),
    key        text NOT NULL,
    tier       text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (family, key),
    CONSTRAINT family_tiers_key_length CHECK (char_length(key) BETWEEN 1 AND 128),
    CONSTRAINT family_tiers_tier_length CHECK (char_length(tier) BETWEEN 1 AND 64)
);

-- Where reap_family_keys goes on in each family's keys (in key order), so
-- that each call examines a bounded number of keys however many there are
-- (NULL: from the first). No foreign key: the reaper writes here without
-- touching the family's row, which first uses share-lock.
CREATE TABLE pgsemaphore.family_reap_cursors (
    family text PRIMARY KEY,
    after  text
);

-- ---------------------------------------------------------------------------
-- Lease semaphores
-- ---------------------------------------------------------------------------

-- One row per semaphore: the counter row that its claims serialise on.
-- A key of a family (5: families) is a semaphore with family and family_key
-- set, named '@' || family || '/' || family_key; claims never write those
-- two columns, so they never check the foreign key.
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
    -- The order of a semaphore's queue (FIFO unless true), a property of the
    -- semaphore rather than of each call.
    queue_lifo    boolean     NOT NULL DEFAULT false,
    family        text        REFERENCES pgsemaphore.families (name),
    family_key    text,
    CONSTRAINT semaphores_name_length CHECK (char_length(name) BETWEEN 1 AND 200),
    CONSTRAINT semaphores_capacity_range CHECK (capacity BETWEEN 1 AND 100000),
    CONSTRAINT semaphores_lease_positive CHECK (default_lease > interval '0'),
    CONSTRAINT semaphores_family_key CHECK (
        (family IS NULL AND family_key IS NULL)
        OR (family IS NOT NULL AND family_key IS NOT NULL
            AND name = '@' || family || '/' || family_key))
);

-- One row per claim, kept after it ends: the audit log. A claim is *live*
-- while completed_at and timed_out_at are both NULL (pgsemaphore.live_slots).
-- It churns like a queue: autovacuum reclaims dead rows after 2% of the
-- table changed instead of the default 20%.
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
    -- The claims one pgsemaphore.claim_all call made together share it: the
    -- id of the first (lowest) of them. NULL for a claim of
    -- pgsemaphore.claim. Not indexed: the audit log reads it with the rows it
    -- lists; a permit's claims are found by their ids.
    group_id     bigint,
    CONSTRAINT slots_slot_non_negative CHECK (slot >= 0),
    CONSTRAINT slots_holder_length CHECK (char_length(holder) BETWEEN 1 AND 1000),
    CONSTRAINT slots_expires_after_created CHECK (expires_at > created_at),
    CONSTRAINT slots_one_outcome CHECK (completed_at IS NULL OR timed_out_at IS NULL)
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);

-- The hard limit: no slot of a semaphore is ever held twice. Also the index
-- every claim scans: live rows are few (at most the sum of the capacities,
-- plus expired ones awaiting a reap), however long the audit log grows.
CREATE UNIQUE INDEX slots_live_slot_key
    ON pgsemaphore.slots (semaphore, slot)
    WHERE completed_at IS NULL AND timed_out_at IS NULL;

-- Audit queries and retention: one semaphore's history by time.
CREATE INDEX slots_history_idx
    ON pgsemaphore.slots (semaphore, created_at);

-- A family's keys (5: families).
CREATE INDEX semaphores_family_idx ON pgsemaphore.semaphores (family, family_key)
    WHERE family IS NOT NULL;

-- Live claims: those that hold a slot. A plain view (inlined by the
-- planner): its condition is exactly the partial unique index's, so every
-- query through it scans only live rows.
CREATE VIEW pgsemaphore.live_slots AS
    SELECT s.*
      FROM pgsemaphore.slots s
     WHERE s.completed_at IS NULL AND s.timed_out_at IS NULL;

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
-- The fair queue and wake-ups
-- ---------------------------------------------------------------------------

-- The fair queue: a row per queued acquire. Its lease (expires_at) is
-- renewed by the waiting process; a waiter whose process crashed stops
-- being renewed, is ignored once its lease has ended, and is deleted by the
-- next claim, enqueue or reap that sees it. Vacuumed after 2% changed, as
-- the slots.
CREATE TABLE pgsemaphore.waiters (
    -- Arrival order: FIFO serves the smallest id first (within a turn),
    -- LIFO the largest.
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
    -- The waiter's fairness key (NULL: the shared default key).
    fair_key    text,
    -- Its place in the rotation of keys, fixed when it queues (see
    -- pgsemaphore.enqueue). The default, 0, is only for a row written
    -- without pgsemaphore.enqueue (which only the owner can): it goes to the
    -- front of the rotation.
    turn        bigint      NOT NULL DEFAULT 0,
    CONSTRAINT waiters_permits_positive CHECK (permits >= 1),
    CONSTRAINT waiters_priority_range CHECK (priority IN (0, 1)),
    CONSTRAINT waiters_holder_length CHECK (char_length(holder) BETWEEN 1 AND 1000),
    CONSTRAINT waiters_fair_key_length
        CHECK (fair_key IS NULL OR char_length(fair_key) BETWEEN 1 AND 200)
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);

-- The FIFO order of a semaphore's queue (its head, and the smallest turn
-- queued, by index), and "is anyone queued?".
CREATE INDEX waiters_queue_idx
    ON pgsemaphore.waiters (semaphore, priority, turn, id);

-- A key's last turn in a semaphore's queue (pgsemaphore.enqueue).
CREATE INDEX waiters_fair_key_idx
    ON pgsemaphore.waiters (semaphore, priority, fair_key, turn);

-- The weight of a fairness key in a semaphore's fair queue: how many of its
-- waiters one turn of the rotation serves. A key without a row has weight
-- 1. fair_key '' stands for the shared default key (NULL), so that the
-- primary key covers it ('' is never a fairness key: they are 1 to 200
-- characters).
CREATE TABLE pgsemaphore.fair_weights (
    semaphore  text        NOT NULL REFERENCES pgsemaphore.semaphores (name) ON DELETE CASCADE,
    fair_key   text        NOT NULL,
    weight     integer     NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (semaphore, fair_key),
    CONSTRAINT fair_weights_fair_key_length CHECK (char_length(fair_key) BETWEEN 0 AND 200),
    CONSTRAINT fair_weights_weight_range CHECK (weight BETWEEN 2 AND 1000)
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

-- ---------------------------------------------------------------------------
-- Advisory semaphores
-- ---------------------------------------------------------------------------

-- One row per advisory semaphore. Its slots are the advisory locks
-- key_base + 0 .. key_base + capacity - 1 (64-bit keys: PostgreSQL's
-- one-bigint key space); key_base + 1048560 .. key_base + 1048575 are its
-- 16 "waiting" keys (a waiter holds all of them in shared mode; a release
-- tries one; see advisory_release). key_base is the name's
-- hashtextextended (stable: hash partitioning depends on it) with its low
-- 20 bits cleared (capacities stay below 2^20). Two names whose bases
-- collide share their slots: each still admits at most its own capacity,
-- and the other's holders only make it look fuller, never emptier.
--   peak_capacity: the highest capacity whose slots may still be held. A
--   capacity change never moves a holder, so after a drop, holders may sit
--   on slots at or above the new capacity until they release; while
--   peak_capacity > capacity, a claim counts every held slot below
--   peak_capacity (see advisory_claim), and the claim that finds all of
--   them above capacity free lowers it back.
--   highest_capacity: the highest capacity the semaphore has had, kept by a
--   trigger (advisory_highest_capacity): every slot ever held lies below
--   it, so the audit log (advisory_log) accepts only slots below it. A
--   holder's row may be written after a drop has ended (peak_capacity
--   lowered again), so peak_capacity alone would refuse an honest row.
--   epoch: a value of the sequence pgsemaphore.advisory_epoch at which no
--   change of this row's capacity was in flight (see advisory_epoch below);
--   the one-statement claim, on a view of the row read earlier, keeps its
--   slot only while the sequence still reads the view's value after its
--   lock.
CREATE TABLE pgsemaphore.advisory_semaphores (
    name          text        PRIMARY KEY,
    capacity      integer     NOT NULL,
    peak_capacity integer     NOT NULL,
    highest_capacity integer  NOT NULL,
    epoch         bigint      NOT NULL,
    key_base      bigint      NOT NULL GENERATED ALWAYS AS
                  (hashtextextended(name, 0) & ~1048575::bigint) STORED,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT advisory_semaphores_name_length CHECK (char_length(name) BETWEEN 1 AND 200),
    CONSTRAINT advisory_semaphores_capacity_range CHECK (capacity BETWEEN 1 AND 100000),
    CONSTRAINT advisory_semaphores_peak CHECK (peak_capacity BETWEEN capacity AND 100000),
    CONSTRAINT advisory_semaphores_highest CHECK (highest_capacity BETWEEN peak_capacity AND 100000)
);

-- Keeps advisory_semaphores.highest_capacity, whoever writes the row
-- (open_advisory creates it, configure_advisory changes the capacity,
-- advisory_drained lowers the peak): it is raised to the peak, never
-- lowered.
CREATE FUNCTION pgsemaphore.advisory_highest_capacity()
RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        NEW.highest_capacity := greatest(OLD.highest_capacity, NEW.peak_capacity);
    ELSE
        NEW.highest_capacity := NEW.peak_capacity;
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER advisory_semaphores_highest_capacity
    BEFORE INSERT OR UPDATE ON pgsemaphore.advisory_semaphores
    FOR EACH ROW EXECUTE FUNCTION pgsemaphore.advisory_highest_capacity();

-- THE CAPACITY EPOCH. The crate's one-statement claim of one slot
-- (CLAIM_ONE in src/semaphore/advisory/session.rs) reads no table: the
-- process read the semaphore's row (capacity, peak_capacity, epoch) once,
-- in an earlier statement, and passes its capacity and epoch; the claim
-- try-locks a slot below that capacity. A capacity drop committed since
-- that read would be missed, so after the lock, in the same statement, it
-- reads this sequence, which is not transactional (pg_sequence_last_value
-- reads the value in place, whatever the snapshot), and keeps the slot only
-- if it still equals the epoch read; else it gives the slot back, and the
-- process reads the row again or falls back to advisory_claim, which
-- re-reads after its locks.
-- The trigger below moves the sequence (nextval) whenever a row's capacity
-- or name changes, or a row is deleted: during that statement, after the
-- row's lock and before the commit. A new row takes the value in force
-- (creating a semaphore moves nothing: the application may create them).
-- Why a claim that finds the value unchanged is safe, however old its
-- read of the row: let the process read row version V (epoch e) with
-- snapshot S, and the claim lock a slot at L and read the
-- sequence at R > L. A change of the capacity committed after S locked
-- the row after V's writer had released it, so its nextval came after V
-- was written and returned more than e (and more than every value read
-- before it). If that nextval came before R, R reads more than e: the
-- claim gives back. If it came after R, L came before the change's
-- commit: the claim is a holder from before the change, which
-- advisory_claim's proof (case (a)) already covers (a drop's drain sees it
-- in pg_locks). A drain (advisory_drained lowers peak_capacity) needs no
-- move: a process whose read shows a drop pending sends no fast claim.
-- The argument needs no snapshot taken after the lock, so it holds at any
-- isolation level and for a read of the row of any age: a claim whose read
-- predates a change gives its slot back like any other
-- (tests/security.rs).
-- The sequence is shared by every advisory semaphore, so a change of one
-- sends the others' fast claims to advisory_claim until their epoch is
-- read again: advisory_rearm, which advisory_claim calls when it finds the
-- row's epoch behind, sets it under the row's lock (see there why that is
-- safe). A value that moves for any other reason (a rolled-back change,
-- the values a crash skips) costs the same one fallback, never a slot.
-- Only the owner moves it: the application may read it (SELECT), not
-- call nextval or setval on it (USAGE, UPDATE).
CREATE SEQUENCE pgsemaphore.advisory_epoch;
SELECT setval('pgsemaphore.advisory_epoch', 1);

CREATE FUNCTION pgsemaphore.advisory_epoch()
RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.epoch := pg_sequence_last_value('pgsemaphore.advisory_epoch');
        RETURN NEW;
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM nextval('pgsemaphore.advisory_epoch');
        RETURN OLD;
    END IF;
    IF NEW.capacity IS DISTINCT FROM OLD.capacity OR NEW.name IS DISTINCT FROM OLD.name THEN
        NEW.epoch := nextval('pgsemaphore.advisory_epoch');
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER advisory_semaphores_epoch
    BEFORE INSERT OR UPDATE OR DELETE ON pgsemaphore.advisory_semaphores
    FOR EACH ROW EXECUTE FUNCTION pgsemaphore.advisory_epoch();

-- The audit log of advisory semaphores: one row per finished permit,
-- written by the holder's process in batches after the release (never on
-- the claim or release path), insert-only. A permit whose process died
-- before writing its row is missing from it: the live holders are in
-- pg_locks, not here.
--   outcome: 'released' (its holder released it), 'lost' (its connection
--   died or stopped answering: the slots were freed by the server),
--   'dropped' (released by the permit's Drop).
CREATE TABLE pgsemaphore.advisory_claims (
    semaphore   text        NOT NULL,
    slots       integer[]   NOT NULL,
    holder      text        NOT NULL,
    metadata    jsonb,
    acquired_at timestamptz NOT NULL,
    ended_at    timestamptz NOT NULL,
    outcome     text        NOT NULL,
    CONSTRAINT advisory_claims_outcome CHECK (outcome IN ('released', 'lost', 'dropped'))
);

-- Rows arrive in about acquired_at order, and a BRIN index costs next to
-- nothing to keep on insert (a B-tree here cost a third of the claims'
-- throughput on a 2-core machine, measured): queries by time window read
-- the matching block ranges and filter by semaphore. A block range is
-- summarised when it fills (autosummarize: autovacuum does it at its next
-- round), so a query, and pgsemaphore.prune with nothing old enough, reads
-- only the ranges that match and the newest ones not summarised yet,
-- however long the log.
CREATE INDEX advisory_claims_history_idx
    ON pgsemaphore.advisory_claims USING brin (acquired_at) WITH (autosummarize = on);

-- The live holders of this database's advisory semaphores' slots, from
-- pg_locks (shared memory: nothing in a table says who holds a slot). A
-- 64-bit advisory key shows in pg_locks as classid (its high 32 bits) and
-- objid (its low 32 bits), objsubid 1, in the database that took it. Every
-- granted hold is listed, exclusive (a claim's) or shared (a key taken
-- with pg_advisory_lock_shared: it admits nobody, but blocks claims of that
-- slot, so it is shown); mode says which, and a slot held shared by
-- several sessions is listed once per session. The session's backend pid,
-- application_name and client address identify the holder's process
-- (pg_stat_activity shows them for sessions of other roles only to members
-- of pg_read_all_stats).
CREATE VIEW pgsemaphore.advisory_holders AS
    SELECT a.name AS semaphore,
           (k.key - a.key_base)::integer AS slot,
           k.pid,
           p.application_name,
           p.client_addr,
           p.backend_start,
           k.mode
      FROM pgsemaphore.advisory_semaphores a
      JOIN (SELECT l.pid, ((l.classid::bigint << 32) | l.objid::bigint) AS key,
                   CASE WHEN l.mode = 'ExclusiveLock' THEN 'exclusive' ELSE 'shared' END AS mode
              FROM pg_catalog.pg_locks l
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
               AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                  WHERE d.datname = pg_catalog.current_database())) k
        ON k.key >= a.key_base AND k.key < a.key_base + a.peak_capacity
      LEFT JOIN pg_catalog.pg_stat_activity p ON p.pid = k.pid;

-- ---------------------------------------------------------------------------
-- Rate limits
-- ---------------------------------------------------------------------------

-- Stored limits and pauses, per (kind, limiter) (key '') and per key. Written
-- only by the rate limits' functions (6: rate limits); read by every check
-- in its own statement.
CREATE TABLE pgsemaphore.rate_limit_settings (
    kind          text        NOT NULL,
    limiter       text        NOT NULL,
    -- '' = every key of the limiter; else one key's override.
    key           text        NOT NULL DEFAULT '',
    -- token_bucket: tokens per second and capacity, both or neither.
    rate          double precision,
    burst         double precision,
    -- windows: permits per window and the window's length, both or neither.
    permit_limit  bigint,
    window_length interval,
    -- Checks are refused until this instant (NULL or past: not paused).
    paused_until  timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, limiter, key),
    CONSTRAINT rate_limit_settings_kind CHECK (kind IN ('token_bucket', 'fixed_window', 'sliding_window')),
    CONSTRAINT rate_limit_settings_limiter_length CHECK (char_length(limiter) BETWEEN 1 AND 200),
    CONSTRAINT rate_limit_settings_key_length CHECK (char_length(key) <= 256),
    CONSTRAINT rate_limit_settings_bucket_pair CHECK ((rate IS NULL) = (burst IS NULL)),
    CONSTRAINT rate_limit_settings_window_pair CHECK ((permit_limit IS NULL) = (window_length IS NULL)),
    CONSTRAINT rate_limit_settings_kind_columns CHECK (
        CASE WHEN kind = 'token_bucket' THEN permit_limit IS NULL ELSE rate IS NULL END)
);

-- A key's states, newest last. Written only by the rate limits' functions:
-- an admission inserts, a trim or a prune deletes; no row is ever updated.
--   tokens        token_bucket: the level after the decision (below zero
--                 while reservations are owed)
--   hits          windows: permits booked in stamp's window
--   previous_hits sliding_window: permits of the window before it
--   stamp         token_bucket: when tokens was computed; windows: the
--                 start of the latest window with bookings
--   idle_at       from this instant the key is at rest (a full bucket, or
--                 every window that counted a permit has ended): deleting
--                 it then never admits more
-- Insert-only with batch deletes: vacuumed after 2% changed, as the queues.
-- No CHECK constraints: every check inserts a row, and an insert re-reads
-- and prepares each CHECK expression from its stored text, which cost a
-- check about a tenth of its time (measured). The only writers are the rate
-- limits' functions, which validate the kind, the limiter and the key before
-- they write (and rate_limit_settings, written far less often, keeps its).
CREATE TABLE pgsemaphore.rate_ledger (
    kind          text        NOT NULL,
    limiter       text        NOT NULL,
    key           text        NOT NULL,
    seq           bigint      NOT NULL,
    tokens        double precision,
    hits          bigint,
    previous_hits bigint,
    stamp         timestamptz NOT NULL,
    idle_at       timestamptz NOT NULL,
    PRIMARY KEY (kind, limiter, key, seq)
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);

-- Each key's state, one row per key (its newest in the ledger). Readable
-- only by the roles granted SELECT on it.
CREATE VIEW pgsemaphore.rate_limits AS
SELECT DISTINCT ON (l.kind, l.limiter, l.key)
       l.kind, l.limiter, l.key, l.tokens, l.hits, l.previous_hits, l.stamp, l.idle_at
  FROM pgsemaphore.rate_ledger l
 ORDER BY l.kind, l.limiter, l.key, l.seq DESC;

REVOKE ALL ON pgsemaphore.rate_limits FROM PUBLIC;

-- ---------------------------------------------------------------------------
-- Outcome counters
-- ---------------------------------------------------------------------------

-- How many requests each semaphore and rate limiter refused, timed out
-- and (rate limiters) admitted, per minute: one row per (kind, name,
-- minute), never one per request. Each process counts in memory and adds
-- its counts every few seconds (pgsemaphore.record_outcomes, the only
-- writer), so a busy minute is a handful of updates of one row per name.
--   kind: 'semaphore' (a lease semaphore, by its name), 'advisory', 'family'
--   (every key of a family counts under the family's name: keys are
--   unbounded), or a rate limiter's kind, 'token_bucket', 'fixed_window',
--   'sliding_window' (a limiter is its kind and name, as in
--   rate_limit_settings; its keys count under it).
--   minute: the minute (UTC, whole) in which the counts were written, on the
--   database's clock: a count lands in the minute its process flushed it,
--   at most a few seconds after the request (later after an outage).
-- The counts are what the applications reported: statistics, not an audit
-- log (a process that dies loses what it had not written; so may a crash
-- of the database, whose commits of these rows do not wait for the WAL).
-- Rows are kept until the operator's retention (pgsemaphore.prune) deletes
-- them with the audit log.
-- Updates change no indexed column, so with room left on each page
-- (fillfactor 70) they stay HOT: no index entry per update. A row is
-- updated only during its own minute, so under a held xmin horizon each
-- row's chain of versions ends with its minute.
CREATE TABLE pgsemaphore.outcomes (
    kind      text        NOT NULL,
    name      text        NOT NULL,
    minute    timestamptz NOT NULL,
    admitted  bigint      NOT NULL DEFAULT 0,
    refused   bigint      NOT NULL DEFAULT 0,
    timed_out bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (kind, name, minute),
    CONSTRAINT outcomes_kind CHECK (
        kind IN ('semaphore', 'advisory', 'family', 'token_bucket', 'fixed_window', 'sliding_window')),
    CONSTRAINT outcomes_name_length CHECK (char_length(name) BETWEEN 1 AND 200),
    CONSTRAINT outcomes_whole_minute CHECK (
        minute = date_bin(interval '1 minute', minute, timestamptz '2000-01-01 00:00:00+00')),
    CONSTRAINT outcomes_admitted_non_negative CHECK (admitted >= 0),
    CONSTRAINT outcomes_refused_non_negative CHECK (refused >= 0),
    CONSTRAINT outcomes_timed_out_non_negative CHECK (timed_out >= 0)
) WITH (fillfactor = 70);

-- Every name's counts in a time window (pg-semaphore status, a dashboard),
-- and retention, oldest first.
CREATE INDEX outcomes_minute_idx ON pgsemaphore.outcomes (minute);

-- ---------------------------------------------------------------------------
-- One kind per name
-- ---------------------------------------------------------------------------

-- A name belongs to one kind of semaphore: a trigger on each table refuses
-- a name the other kind has (SQLSTATE 22023 naming p_name), and names
-- beginning with '@' are reserved for family keys.
CREATE FUNCTION pgsemaphore.one_kind_per_name()
RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    -- A name beginning with '@' is a family key's: only open_family_key
    -- creates one (family set). A named semaphore whose row already has
    -- such a name (written around this trigger) keeps working: its row
    -- exists, so the insert of an open meets it and does nothing.
    IF left(NEW.name, 1) = '@' THEN
        IF TG_TABLE_NAME = 'semaphores' THEN
            IF NEW.family IS NULL
               AND NOT EXISTS (SELECT 1 FROM pgsemaphore.semaphores s
                                WHERE s.name = NEW.name AND s.family IS NULL) THEN
                PERFORM pgsemaphore.refuse('p_name',
                    format('%s begins with @, which only keys of a family may (SemaphoreFamily)',
                           quote_literal(NEW.name)));
            END IF;
        ELSIF NOT EXISTS (SELECT 1 FROM pgsemaphore.advisory_semaphores a WHERE a.name = NEW.name) THEN
            PERFORM pgsemaphore.refuse('p_name',
                format('%s begins with @, which only keys of a family may (SemaphoreFamily)',
                       quote_literal(NEW.name)));
        END IF;
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- The check below needs a snapshot taken after the lock. Opening a
        -- semaphore that exists (the insert will meet its row and do
        -- nothing) needs no check; creating one is refused here.
        IF (TG_TABLE_NAME = 'semaphores'
            AND EXISTS (SELECT 1 FROM pgsemaphore.semaphores s WHERE s.name = NEW.name))
           OR (TG_TABLE_NAME = 'advisory_semaphores'
               AND EXISTS (SELECT 1 FROM pgsemaphore.advisory_semaphores a WHERE a.name = NEW.name)) THEN
            RETURN NEW;
        END IF;
        PERFORM pgsemaphore.refuse_isolation('creating a semaphore',
            'an older snapshot could miss a semaphore of the other kind created under the same name');
    END IF;
    PERFORM pg_advisory_xact_lock(1885828966, hashtext(NEW.name));
    IF TG_TABLE_NAME = 'semaphores'
       AND EXISTS (SELECT 1 FROM pgsemaphore.advisory_semaphores a WHERE a.name = NEW.name) THEN
        PERFORM pgsemaphore.refuse('p_name',
            format('%s is an advisory semaphore (AdvisorySemaphore): a lease semaphore cannot have its name',
                   quote_literal(NEW.name)));
    ELSIF TG_TABLE_NAME = 'advisory_semaphores'
       AND EXISTS (SELECT 1 FROM pgsemaphore.semaphores s WHERE s.name = NEW.name) THEN
        PERFORM pgsemaphore.refuse('p_name',
            format('%s is a lease semaphore (Semaphore): an advisory semaphore cannot have its name',
                   quote_literal(NEW.name)));
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER semaphores_one_kind_per_name
    BEFORE INSERT ON pgsemaphore.semaphores
    FOR EACH ROW EXECUTE FUNCTION pgsemaphore.one_kind_per_name();

CREATE TRIGGER advisory_semaphores_one_kind_per_name
    BEFORE INSERT ON pgsemaphore.advisory_semaphores
    FOR EACH ROW EXECUTE FUNCTION pgsemaphore.one_kind_per_name();

-- ---------------------------------------------------------------------------
-- What each table is, for \dt+ and the catalog
-- ---------------------------------------------------------------------------

COMMENT ON TABLE pgsemaphore.families IS
    'Semaphore families: a name plus a key gives one semaphore; default capacity, lease and idle time of its keys.';
COMMENT ON TABLE pgsemaphore.family_rules IS
    'Capacity rules of a family, by exact key or by tier; the operator''s.';
-- The roles given access with grant_access, so that a later migration can
-- give them what it adds (it ends by calling regrant()).
CREATE TABLE pgsemaphore.grantees (
    role       oid         NOT NULL,
    part       text        NOT NULL CHECK (part IN ('application', 'operator')),
    granted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (role, part)
);

COMMENT ON TABLE pgsemaphore.family_tiers IS
    'The operator''s assignment of a family''s keys to tiers.';
COMMENT ON TABLE pgsemaphore.family_reap_cursors IS
    'Where reap_family_keys goes on in each family''s keys.';
COMMENT ON TABLE pgsemaphore.semaphores IS
    'One row per lease semaphore: its capacity and default lease; the row its claims serialise on.';
COMMENT ON TABLE pgsemaphore.slots IS
    'One row per claim of a lease semaphore, kept after it ends: the audit log. Live while completed_at and timed_out_at are NULL.';
COMMENT ON VIEW pgsemaphore.live_slots IS
    'The live claims: those that hold a slot.';
COMMENT ON TABLE pgsemaphore.released_tokens IS
    'Tokens released by release_by_token: a claim still in flight with one of them is refused.';
COMMENT ON TABLE pgsemaphore.waiters IS
    'The fair queue: one row per queued acquire.';
COMMENT ON TABLE pgsemaphore.fair_weights IS
    'The operator''s weights of fairness keys in a semaphore''s queue (1 without a row).';
COMMENT ON TABLE pgsemaphore.wakeups IS
    'Wake-up registrations: processes with acquires waiting on a semaphore.';
COMMENT ON TABLE pgsemaphore.advisory_semaphores IS
    'One row per advisory semaphore: its capacity and the base of its advisory lock keys.';
COMMENT ON TABLE pgsemaphore.advisory_claims IS
    'The audit log of advisory semaphores: one row per finished permit, written after its release.';
COMMENT ON VIEW pgsemaphore.advisory_holders IS
    'The live holders of this database''s advisory semaphores'' slots, from pg_locks.';
COMMENT ON TABLE pgsemaphore.rate_limit_settings IS
    'Stored rate limits and pauses, per limiter (key '''') and per key.';
COMMENT ON TABLE pgsemaphore.rate_ledger IS
    'Rate limiters'' key states, insert-only, newest (highest seq) last.';
COMMENT ON TABLE pgsemaphore.outcomes IS
    'Refused, timed out and (rate limiters) admitted requests per semaphore, family and rate limiter, per minute, as the applications reported them (record_outcomes).';
COMMENT ON COLUMN pgsemaphore.outcomes.kind IS
    'semaphore (lease), advisory, family (every key under the family''s name), or a rate limiter''s kind: token_bucket, fixed_window, sliding_window.';
COMMENT ON COLUMN pgsemaphore.outcomes.name IS
    'The semaphore''s, family''s or rate limiter''s name (never a key).';
COMMENT ON COLUMN pgsemaphore.outcomes.minute IS
    'The whole minute (database clock) in which the counts were written: at most a few seconds after the requests, later if the process could not reach the database.';
COMMENT ON COLUMN pgsemaphore.outcomes.admitted IS
    'Rate limiters: checks and acquires admitted (a set''s admission counts for each of its limiters). 0 for semaphores, whose admissions are their claims in the audit log.';
COMMENT ON COLUMN pgsemaphore.outcomes.refused IS
    'Requests refused at once: a full semaphore (NoSlotsAvailable), a full fair queue (QueueFull), a rate check refused (a set''s refusal counts for the limiter that decided).';
COMMENT ON COLUMN pgsemaphore.outcomes.timed_out IS
    'Waiting acquires that gave up at their timeout (Timeout): a semaphore''s acquire with a timeout, a rate limiter''s acquire that could not be admitted within its wait.';
COMMENT ON TABLE pgsemaphore.grantees IS
    'The roles grant_access gave the application''s or the operator''s part, kept current by regrant().';
COMMENT ON VIEW pgsemaphore.rate_limits IS
    'Each rate limiter key''s state: its newest row in rate_ledger. The limits in force are in rate_limit_settings (per limiter, key '''', or per key).';
COMMENT ON COLUMN pgsemaphore.rate_limits.kind IS
    'token_bucket, fixed_window or sliding_window.';
COMMENT ON COLUMN pgsemaphore.rate_limits.tokens IS
    'token_bucket: the tokens left at stamp, refilling at the stored rate up to the burst. Below zero while waiting acquires have booked permits ahead: -n means n permits are owed, and the next check passes once n + 1 tokens have refilled.';
COMMENT ON COLUMN pgsemaphore.rate_limits.hits IS
    'fixed_window, sliding_window: the permits booked in the window that starts at stamp.';
COMMENT ON COLUMN pgsemaphore.rate_limits.previous_hits IS
    'sliding_window: the permits of the window before stamp''s, counted in proportion to how much of it still overlaps the sliding window.';
COMMENT ON COLUMN pgsemaphore.rate_limits.stamp IS
    'token_bucket: when tokens was computed; windows: the start of the latest window with bookings.';
COMMENT ON COLUMN pgsemaphore.rate_limits.idle_at IS
    'From this instant the key is at rest (a full bucket, or every window that counted a permit has ended): pruning deletes it then, which never admits more.';

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
