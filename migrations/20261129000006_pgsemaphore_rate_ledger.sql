-- pg-semaphore, schema version 12: the rate limiters keep their state in an
-- insert-only ledger, so a long transaction elsewhere no longer slows them.
--
-- Until now a key's state was one row of pgsemaphore.rate_limits, locked
-- (SELECT ... FOR UPDATE) and updated in place by every check. Every update
-- leaves a dead version behind, and while any transaction holds the xmin
-- horizon back (a long query, pg_dump, a replica's hot_standby_feedback)
-- none of them can be removed: a hot key's checks walked an ever longer
-- chain of versions and fell to 0.08x-0.14x of their rate within minutes
-- (BENCHMARKS.md, the pressure workload). Now:
--   * table pgsemaphore.rate_ledger holds a key's states as rows numbered by
--     seq; the newest (highest seq) is the key's state. An admitted check
--     INSERTs the new state as seq + 1; a refused one writes nothing (its
--     refill or roll forward is recomputed from the same row by the next
--     check, with the same result). A check reads the newest row with a
--     backward scan of the primary key, which meets the live newest entry
--     first: no dead version is on its path whatever the horizon;
--   * the checks of one key are serialised by a transaction-level advisory
--     lock, pg_advisory_xact_lock(1885828967, hashtext(kind/limiter/key)),
--     taken before the newest row is read, in an earlier statement: in READ
--     COMMITTED each statement takes a new snapshot, and a lock is released
--     only after its holder's commit is visible, so the read sees the state
--     the previous holder left. The lock has no row version, so waiting for
--     it costs nothing under pressure. (1885828965 and 1885828966 are the
--     semaphores' two-key advisory spaces; two keys whose hashes collide
--     only share a lock, they never share a state.) A check in REPEATABLE
--     READ or SERIALIZABLE would read with its transaction's first snapshot
--     and could miss the previous holder's row: every check raises 0A000
--     there, before it takes anything;
--   * old rows go in batches: the admission that writes a seq divisible by
--     16 deletes the key's rows 16 to 32 behind it (the range, not "all
--     older": under a held horizon the older ones are deleted but not yet
--     removed, and a scan of "all older" would visit every one of them). A
--     key keeps at most 32 rows whatever its traffic; prune_rate_limits
--     deletes the rest of every key it scans, and keys at rest entirely, as
--     before (it takes no lock: it deletes only up to the newest row it
--     read);
--   * pgsemaphore.rate_limits becomes a view of the newest row per key, with
--     the table's columns; the table's rows are moved into the ledger (seq
--     1), so every key keeps its state across the upgrade;
--   * every check, reservation and check_limits runs on one engine
--     (rate_take, and rate_take_all for several limits), with the
--     arithmetic of versions 1-11 in pure functions (bucket_step,
--     fixed_step, sliding_step): the decisions are unchanged. check_limits
--     no longer calls each limit's function in a subtransaction: it locks
--     the keys in one statement, reads their rows in one, decides, and
--     inserts every new state in one statement only when all admit;
--   * application function check_limits_reserve: check_limits that waits,
--     for LimiterSet::acquire (granted to whoever may run check_limits);
--   * schema_version() returns (12, 2): code built for versions 2 to 11
--     works against it unchanged (it calls the same functions).
-- Hostile callers (issue 32), decided in this version:
--   * a limiter's limits belong to the database, never to one caller: a
--     check that finds no stored pair in force (key's, else limiter's)
--     stores its caller's pair as the limiter's (rate_limit_settings, key
--     '', by rate_limit_first_use under the functions' owner: INSERT ... ON
--     CONFLICT, then a re-read, so two racing first uses decide under the
--     same pair); from then on every check, whatever it passes, is decided
--     under the stored pair, which only the operator changes
--     (set_rate_limit, clear_rate_limit, per limiter or per key). A deploy
--     that changes limits in code must store them (set_rate_limit, or the
--     CLI's `pg-semaphore limits set`); the crate warns once per limiter
--     and process when its pair differs from the stored one. After
--     clear_rate_limit of a limiter, its next check is a first use again
--     and stores its caller's pair. Keys of earlier versions keep their
--     state; their limiter's first check afterwards stores its pair;
--   * a reservation books no further ahead than the limits in force allow:
--     p_max_wait is clamped to burst / rate (a bucket) or one window (a
--     window; for several limits, the least of theirs), never refused, so
--     callers passing a longer wait (up to 366 days) keep working and are
--     refused with the instant when it lies beyond. A bucket's level
--     therefore never goes below -burst, and the refill clamps it there
--     (a deeper level can only come from an operator lowering the pair
--     under bookings of the old one): every wait stays within 2 x 366 days
--     and no arithmetic on a key overflows. A window's permit limit is at
--     most 1e15, as a bucket's burst (check_window; the p_n casts and the
--     remaining counts stay exact);
--   * every wait is bounded: each rate check, reservation, check_limits
--     (_reserve), and the settings functions (set_rate_limit,
--     clear_rate_limit, pause_rate_limit, resume_rate_limit) run with SET
--     lock_timeout = '2s', as the semaphore functions: a key's advisory lock
--     held by a check left in an open transaction, or by any role (PUBLIC
--     may call pg_advisory_lock on the documented key), a settings row held
--     by an open pause or first use, answer 55P03 after 2 s (the crate's
--     Error::Stalled; waiting acquires retry within their deadline).

CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 12, 2 $$;

-- ---------------------------------------------------------------------------
-- The ledger
-- ---------------------------------------------------------------------------

-- A key's states, newest last. Written only by the functions below: an
-- admission inserts, a trim or a prune deletes; no row is ever updated.
-- The columns mean what they meant in rate_limits (version 1):
--   tokens        token_bucket: the level after the decision (below zero
--                 while reservations are owed)
--   hits          windows: permits booked in stamp's window
--   previous_hits sliding_window: permits of the window before it
--   stamp         token_bucket: when tokens was computed; windows: the
--                 start of the latest window with bookings
--   idle_at       from this instant the key is at rest (a full bucket, or
--                 every window that counted a permit has ended): deleting
--                 it then never admits more
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
    PRIMARY KEY (kind, limiter, key, seq),
    CONSTRAINT rate_ledger_kind CHECK (kind IN ('token_bucket', 'fixed_window', 'sliding_window')),
    CONSTRAINT rate_ledger_limiter_length CHECK (char_length(limiter) BETWEEN 1 AND 200),
    CONSTRAINT rate_ledger_key_length CHECK (char_length(key) BETWEEN 1 AND 256)
);

-- Insert-only with batch deletes: vacuum after 2% changed, as the queues.
ALTER TABLE pgsemaphore.rate_ledger SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);

-- Every key keeps its state across the upgrade.
INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, tokens, hits, previous_hits, stamp, idle_at)
SELECT r.kind, r.limiter, r.key, 1, r.tokens, r.hits, r.previous_hits, r.stamp, r.idle_at
  FROM pgsemaphore.rate_limits r;

DROP TABLE pgsemaphore.rate_limits;

-- What rate_limits was: each key's state, one row per key (its newest).
CREATE VIEW pgsemaphore.rate_limits AS
SELECT DISTINCT ON (l.kind, l.limiter, l.key)
       l.kind, l.limiter, l.key, l.tokens, l.hits, l.previous_hits, l.stamp, l.idle_at
  FROM pgsemaphore.rate_ledger l
 ORDER BY l.kind, l.limiter, l.key, l.seq DESC;

REVOKE ALL ON pgsemaphore.rate_limits FROM PUBLIC;

-- Whoever may read the semaphores (the README grants SELECT on every table
-- to both roles, which covered the old table) may read the ledger and the view.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS grantee
          FROM pg_class t
         CROSS JOIN LATERAL aclexplode(t.relacl) a
         WHERE t.oid = 'pgsemaphore.semaphores'::regclass
           AND a.privilege_type = 'SELECT'
           AND a.grantee <> t.relowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT SELECT ON pgsemaphore.rate_ledger, pgsemaphore.rate_limits TO %s', r.grantee);
    END LOOP;
END;
$$;

-- ---------------------------------------------------------------------------
-- The arithmetic: pure functions of a key's state, the clock and the limits
-- (no table, no grants). Each takes the state read (NULL when the key has
-- none: a full bucket, empty windows), the clock p_now, and p_from, the
-- earliest instant the caller may be admitted (p_now, but for a check of
-- several limits looking for an instant they all admit). Each returns
-- o_allowed (admitted at an instant within p_max_wait of p_now), o_wait_us
-- (microseconds from p_now to that instant; refused: to the instant it
-- would have been), o_remaining (what is left after the decision), and the
-- state to write when admitted. The arithmetic and its invariants are those
-- of versions 1 to 11: token_bucket_reserve (version 6,
-- migrations/20261128000001_pgsemaphore_waiting_bucket.sql) and
-- fixed_window_book, sliding_window_book (version 10,
-- migrations/20261129000004_pgsemaphore_limiter_ledger.sql).
-- An instant later than p_now is booked conservatively: the bucket holds
-- the tokens back from every check before that instant (it admits less
-- before it, never more), a window closes the windows before it.
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.bucket_step(
    p_tokens double precision, p_stamp timestamptz, p_now timestamptz, p_from timestamptz,
    p_rate double precision, p_burst double precision, p_n double precision, p_max_wait interval,
    OUT o_allowed boolean, OUT o_wait_us bigint, OUT o_remaining bigint,
    OUT o_tokens double precision, OUT o_stamp timestamptz, OUT o_idle_at timestamptz)
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_wait double precision;
BEGIN
    -- Refill (from below zero too: what is owed is paid first); the clock
    -- a key sees never goes back.
    IF p_stamp IS NULL THEN
        o_tokens := p_burst;
        o_stamp := p_now;
    ELSE
        -- Never below -p_burst: no reservation books deeper (rate_take
        -- bounds it to burst / rate ahead); a deeper level was booked under
        -- a larger pair an operator has since lowered, and keeping it would
        -- put every later wait beyond any bound (22003 in the microseconds).
        o_tokens := least(p_burst, greatest(-p_burst,
                          p_tokens + greatest(0, extract(epoch FROM p_now - p_stamp)::double precision) * p_rate));
        o_stamp := greatest(p_stamp, p_now);
    END IF;
    -- The seconds until p_n tokens are there, and not before p_from.
    v_wait := greatest(0, (p_n - o_tokens) / p_rate,
                       extract(epoch FROM p_from - p_now)::double precision);
    o_wait_us := ceil(v_wait * 1e6)::bigint;
    o_allowed := v_wait <= extract(epoch FROM p_max_wait)::double precision;
    IF o_allowed THEN
        -- Taken at the admission instant, now + v_wait, as GCRA books it
        -- (the theoretical arrival time, stamp + (p_burst - tokens) /
        -- p_rate, moves to the later of itself and that instant, plus p_n /
        -- p_rate): the level left is the lesser of the level now and what a
        -- full bucket would hold minus the refill until that instant. With
        -- p_from = p_now this is the level minus p_n, as in versions 1 to
        -- 11; with a later p_from it holds back what that admission will
        -- spend from every check before it, so over any interval of length
        -- d the admissions, at their instants and in whatever order they
        -- were decided, take at most p_burst + p_rate x d.
        o_tokens := least(o_tokens, p_burst - p_rate * v_wait) - p_n;
    END IF;
    o_remaining := floor(o_tokens)::bigint;
    o_idle_at := o_stamp + make_interval(secs => (p_burst - o_tokens) / p_rate);
END;
$$;

CREATE FUNCTION pgsemaphore.fixed_step(
    p_hits bigint, p_start timestamptz, p_now timestamptz, p_from timestamptz,
    p_limit bigint, p_window interval, p_n bigint, p_max_wait interval,
    OUT o_allowed boolean, OUT o_wait_us bigint, OUT o_remaining bigint,
    OUT o_hits bigint, OUT o_start timestamptz, OUT o_idle_at timestamptz)
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_at      timestamptz;
    v_b_start timestamptz;
    v_b_hits  bigint;
BEGIN
    -- stamp's window, rolled forward to the window containing now once it
    -- has ended (the key's own grid).
    IF p_start IS NULL THEN
        o_hits := 0;
        o_start := p_now;
    ELSIF p_now >= p_start + p_window THEN
        o_start := date_bin(p_window, p_now, p_start);
        o_hits := 0;
    ELSE
        o_start := p_start;
        o_hits := p_hits;
    END IF;
    -- The first window, from p_from's, with room: stamp's window if it has
    -- room, else the next (empty) one; admitted when it opens.
    IF p_from >= o_start + p_window THEN
        v_b_start := date_bin(p_window, p_from, o_start);
        v_b_hits := 0;
    ELSE
        v_b_start := o_start;
        v_b_hits := o_hits;
    END IF;
    IF v_b_hits <= p_limit - p_n THEN  -- (no sum that could overflow)
        v_at := greatest(p_from, v_b_start);
    ELSE
        v_b_start := v_b_start + p_window;
        v_b_hits := 0;
        v_at := v_b_start;
    END IF;
    o_wait_us := ceil(extract(epoch FROM v_at - p_now) * 1e6)::bigint;
    o_allowed := v_at - p_now <= p_max_wait;
    IF o_allowed THEN
        o_start := v_b_start;
        o_hits := v_b_hits + p_n;
    END IF;
    o_remaining := CASE WHEN o_start > p_now THEN 0 ELSE greatest(0, p_limit - o_hits) END;
    o_idle_at := o_start + p_window;
END;
$$;

CREATE FUNCTION pgsemaphore.sliding_step(
    p_hits bigint, p_previous bigint, p_start timestamptz, p_now timestamptz, p_from timestamptz,
    p_limit bigint, p_window interval, p_n bigint, p_max_wait interval,
    OUT o_allowed boolean, OUT o_wait_us bigint, OUT o_remaining bigint,
    OUT o_hits bigint, OUT o_previous bigint, OUT o_start timestamptz, OUT o_idle_at timestamptz)
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_window  double precision := extract(epoch FROM p_window)::double precision;
    v_elapsed double precision;
    v_need    double precision;
    v_b_start timestamptz;
    v_b_hits  bigint;
    v_b_prev  bigint;
    v_wait    double precision;
BEGIN
    -- Roll stamp's window forward to the one containing now, once it has ended.
    IF p_start IS NULL THEN
        o_hits := 0;
        o_previous := 0;
        o_start := p_now;
    ELSIF p_now >= p_start + 2 * p_window THEN
        o_start := date_bin(p_window, p_now, p_start);
        o_previous := 0;
        o_hits := 0;
    ELSIF p_now >= p_start + p_window THEN
        o_start := p_start + p_window;
        o_previous := p_hits;
        o_hits := 0;
    ELSE
        o_start := p_start;
        o_previous := p_previous;
        o_hits := p_hits;
    END IF;
    -- The same roll from there to the window containing p_from.
    v_b_start := o_start;
    v_b_hits := o_hits;
    v_b_prev := o_previous;
    IF p_from >= v_b_start + 2 * p_window THEN
        v_b_start := date_bin(p_window, p_from, v_b_start);
        v_b_prev := 0;
        v_b_hits := 0;
    ELSIF p_from >= v_b_start + p_window THEN
        v_b_start := v_b_start + p_window;
        v_b_prev := v_b_hits;
        v_b_hits := 0;
    END IF;
    -- The earliest instant, window by window: the elapsed fraction it needs
    -- (previous x (1 - e) + hits + p_n <= p_limit), no earlier than p_from;
    -- a window where it is 1 or more has no room.
    FOR i IN 1..3 LOOP
        v_elapsed := greatest(0, extract(epoch FROM p_from - v_b_start)::double precision / v_window);
        IF v_b_hits > p_limit - p_n THEN
            v_need := 1;
        ELSIF v_b_prev = 0 THEN
            v_need := 0;
        ELSE
            v_need := greatest(0, 1 - (p_limit - p_n - v_b_hits)::double precision / v_b_prev);
        END IF;
        EXIT WHEN greatest(v_need, v_elapsed) < 1;
        v_b_start := v_b_start + p_window;
        v_b_prev := v_b_hits;
        v_b_hits := 0;
    END LOOP;
    -- Microseconds from now until that instant, rounded up, never early.
    IF v_need <= v_elapsed THEN
        o_wait_us := ceil(greatest(0, extract(epoch FROM greatest(p_from, v_b_start) - p_now)::double precision) * 1e6)::bigint;
    ELSE
        v_wait := extract(epoch FROM v_b_start - p_now)::double precision + v_need * v_window;
        o_wait_us := greatest(1, ceil(v_wait * 1e6))::bigint;
    END IF;
    o_allowed := o_wait_us <= extract(epoch FROM p_max_wait) * 1e6;
    IF o_allowed THEN
        o_start := v_b_start;
        o_previous := v_b_prev;
        o_hits := v_b_hits + p_n;
    END IF;
    IF o_start > p_now THEN
        o_remaining := 0;
    ELSE
        v_elapsed := least(1, greatest(0, extract(epoch FROM p_now - o_start)::double precision / v_window));
        o_remaining := greatest(0, floor(p_limit - (o_previous * (1 - v_elapsed) + o_hits)))::bigint;
    END IF;
    o_idle_at := o_start + 2 * p_window;
END;
$$;

-- Raised by every check outside READ COMMITTED (see the header).
CREATE FUNCTION pgsemaphore.refuse_isolation()
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'rate limiter checks need READ COMMITTED, this transaction is %',
        upper(current_setting('transaction_isolation'))
        USING ERRCODE = 'feature_not_supported',
              HINT = 'call it outside the transaction, or in a READ COMMITTED one: '
                     'its snapshot could not see the previous check''s state';
END;
$$;

-- Deletes the rows of a key with p_from <= seq < p_to, skipping any row
-- another transaction is deleting (a check's trim or a prune not yet
-- committed): nobody ever waits for it, and the row goes with that
-- transaction or with a later trim or prune. Never called with a range
-- that holds the key's newest row, unless that row is at rest (prune).
CREATE FUNCTION pgsemaphore.rate_trim(p_kind text, p_limiter text, p_key text, p_from bigint, p_to bigint)
RETURNS void
LANGUAGE plpgsql  -- (not sql: its plan is kept for the session)
AS $$
BEGIN
    DELETE FROM pgsemaphore.rate_ledger l
     WHERE l.ctid = ANY (ARRAY(
            SELECT d.ctid
              FROM pgsemaphore.rate_ledger d
             WHERE d.kind = p_kind AND d.limiter = p_limiter AND d.key = p_key
               AND d.seq >= p_from AND d.seq < p_to
               FOR UPDATE SKIP LOCKED));
END;
$$;

-- FIRST USE: stores the caller's pair (p_rate, p_burst for a token bucket;
-- p_limit, p_window for a window) as the limiter's (key ''), unless a pair
-- is stored already, and returns the limiter's stored pair. Called by the
-- engine, as the owner, when a check finds no pair in force: a limiter's
-- limits then belong to the database, as a semaphore's capacity does, and
-- no later caller's arguments redefine the state every caller of a key
-- shares. A pause-only row gets the pair; a stored pair is never replaced.
-- Meets: another first use of the limiter (any key): the upsert waits for
-- its uncommitted row (lock_timeout of the calling function: 2 s, 55P03),
-- then keeps the committed one, and the re-read, a new statement, returns
-- it: both decide under the same pair; the operator's set_rate_limit: the
-- same, whichever commits first stays until the operator's own write;
-- clear_rate_limit committed between the upsert and the re-read: NULLs, and
-- the caller's pair applies to this one check (the next stores it again).
CREATE FUNCTION pgsemaphore.rate_limit_first_use(
    p_kind text, p_limiter text,
    p_rate double precision, p_burst double precision, p_limit bigint, p_window interval,
    OUT o_rate double precision, OUT o_burst double precision, OUT o_limit bigint, OUT o_window interval)
LANGUAGE plpgsql
AS $$
DECLARE
    v_bucket boolean := p_kind = 'token_bucket';
BEGIN
    INSERT INTO pgsemaphore.rate_limit_settings AS s
           (kind, limiter, key, rate, burst, permit_limit, window_length, updated_at)
    VALUES (p_kind, p_limiter, '',
            CASE WHEN v_bucket THEN p_rate END, CASE WHEN v_bucket THEN p_burst END,
            CASE WHEN NOT v_bucket THEN p_limit END, CASE WHEN NOT v_bucket THEN p_window END, now())
    ON CONFLICT (kind, limiter, key) DO UPDATE
       SET rate = excluded.rate, burst = excluded.burst,
           permit_limit = excluded.permit_limit, window_length = excluded.window_length,
           updated_at = now()
     WHERE s.rate IS NULL AND s.permit_limit IS NULL
    RETURNING s.rate, s.burst, s.permit_limit, s.window_length
         INTO o_rate, o_burst, o_limit, o_window;
    IF NOT FOUND THEN
        -- Another first use or the operator stored one first: that one.
        SELECT s.rate, s.burst, s.permit_limit, s.window_length
          INTO o_rate, o_burst, o_limit, o_window
          FROM pgsemaphore.rate_limit_settings s
         WHERE s.kind = p_kind AND s.limiter = p_limiter AND s.key = '';
    END IF;
END;
$$;

-- ---------------------------------------------------------------------------
-- The engine (caller's rights, no grants): one key
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.rate_take(
    p_kind text, p_limiter text, p_key text,
    p_rate double precision, p_burst double precision, p_limit bigint, p_window interval,
    p_n double precision, p_max_wait interval, p_stored boolean)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql
AS $$
-- ONE KEY: p_n permits of key p_key of limiter (p_kind, p_limiter), with the
-- kind's limits (p_rate, p_burst for a token bucket; p_limit, p_window for a
-- window), admitted at once or within p_max_wait; p_stored: the stored
-- limits and pauses of version 9 apply (false only for the _unchecked
-- functions). The arguments were checked by the caller.
-- Steps:
--   1. READ COMMITTED, or 0A000;
--   2. one statement: the key's advisory lock (waited for at most the
--      calling function's lock_timeout, 2 s, then 55P03), and the stored
--      limits and pause (read with that statement's snapshot, taken before
--      the lock: the pair in force when the check began); a pause refuses,
--      taking nothing; no stored pair: the first use stores the caller's as
--      the limiter's (rate_limit_first_use); the stored pair replaces the
--      caller's (p_n above it: 22023); p_max_wait is clamped to what the
--      pair allows ahead: burst / rate, or one window;
--   3. a new statement, so a new snapshot: the key's newest row, as its
--      previous holder committed it (none: a full bucket, empty windows);
--   4. the kind's step function decides, with the clock read after the lock;
--   5. admitted: the new state as row seq + 1; refused: nothing written.
--      On a seq divisible by 16, the rows 16 to 32 behind it go.
-- Invariant: once a limiter has been used, every decision of its keys is
-- made under its stored pair (or a key's override), never under a
-- caller's own; a booking lies at most burst / rate or one window ahead,
-- so a bucket's level stays within [-burst, burst]; the decisions are
-- those of the row-locked versions (the same
-- step, on the state the previous decision left, in the order the lock
-- serves them); a refused decision's writes there (refill, roll forward)
-- are recomputed here by the next decision from the same row, with the same
-- result, since both are functions of the row, the clock and the limits (a
-- stored limit changed in between applies from the row's instant rather
-- than from the refused check's: the difference is the refill of that
-- interval at the old rate or the new one).
-- Meets:
--   * checks, reservations and multi-limit checks of the key: they queue on
--     the advisory lock (a multi-limit check holds it to its end, as a
--     caller's open transaction does); each reads the state the one before
--     left. A rolled-back holder's row was never committed: the next one
--     reads the row before it, so nothing was charged;
--   * a check in another isolation level: refused in step 1;
--   * the key's first use by two callers: the lock orders them; the second
--     reads the first's row;
--   * the limiter's first use by two callers with different pairs (any
--     keys): the second's insert of the limiter's pair waits for the
--     first's uncommitted one (at most 2 s, then 55P03), then keeps it, and
--     the re-read returns it: both decide under one pair; after a rollback
--     the second stores its own (tests/isolation/specs/rate-first-use.spec).
--     A first use left in an open transaction so holds back the limiter's
--     other first checks, for at most 2 s each;
--   * a session holding the key's advisory lock (a check left in an open
--     transaction; any role's pg_advisory_lock(1885828967, hashtext(...)),
--     which PUBLIC may call): we wait at most 2 s, then 55P03, having
--     taken nothing (tests/isolation/specs/rate-key-lock-held.spec);
--   * the trim of step 5 or prune_rate_limits deleting old rows: never the
--     newest, which is all a check reads; neither waits for the other
--     (rate_trim skips rows another transaction is deleting). Prune
--     deleting a key at rest deletes only up to the newest row it read, so
--     a check reads that row
--     (at rest) or none (a full bucket, empty windows: the same admissions),
--     and a row a check commits after prune's read stays, as the state;
--   * a stored limit's change or a pause committed after step 2's snapshot:
--     this check applies the pair read there, in force when it began
--     (tests/isolation/specs/limits-multi-settings.spec);
--   * a reader of the ledger under a held xmin horizon: the newest row is
--     the first entry of a backward scan; the dead versions behind it are
--     never visited.
DECLARE
    v_rate   double precision;
    v_burst  double precision;
    v_limit  bigint;
    v_window interval;
    v_paused timestamptz;
    v_seq    bigint;
    v_tokens double precision;
    v_hits   bigint;
    v_prev   bigint;
    v_stamp  timestamptz;
    v_now    timestamptz;
    b        record;
    f        record;
    w        record;
BEGIN
    -- 1.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgsemaphore.refuse_isolation();
    END IF;
    -- 2. (Two primary-key lookups: the key's row, the limiter's row.)
    SELECT CASE WHEN k.rate IS NOT NULL THEN k.rate ELSE l.rate END,
           CASE WHEN k.rate IS NOT NULL THEN k.burst ELSE l.burst END,
           CASE WHEN k.permit_limit IS NOT NULL THEN k.permit_limit ELSE l.permit_limit END,
           CASE WHEN k.permit_limit IS NOT NULL THEN k.window_length ELSE l.window_length END,
           greatest(k.paused_until, l.paused_until)
      INTO v_rate, v_burst, v_limit, v_window, v_paused
      FROM pg_advisory_xact_lock(1885828967, hashtext(p_kind || '/' || p_limiter || '/' || p_key)) AS lock
      LEFT JOIN pgsemaphore.rate_limit_settings k
        ON p_stored AND k.kind = p_kind AND k.limiter = p_limiter AND k.key = p_key
      LEFT JOIN pgsemaphore.rate_limit_settings l
        ON p_stored AND l.kind = p_kind AND l.limiter = p_limiter AND l.key = '';
    IF v_paused > clock_timestamp() THEN
        o_allowed := false;
        o_wait_us := pgsemaphore.us_until(v_paused);
        o_remaining := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    -- 2b. No pair in force: the first use stores the caller's as the
    -- limiter's (or finds the one a concurrent first use stored).
    IF p_stored AND (CASE WHEN p_kind = 'token_bucket' THEN v_rate IS NULL ELSE v_limit IS NULL END) THEN
        SELECT u.o_rate, u.o_burst, u.o_limit, u.o_window
          INTO v_rate, v_burst, v_limit, v_window
          FROM pgsemaphore.rate_limit_first_use(p_kind, p_limiter, p_rate, p_burst, p_limit, p_window) u;
    END IF;
    IF v_rate IS NOT NULL AND p_kind = 'token_bucket' THEN
        IF p_n > v_burst THEN
            PERFORM pgsemaphore.check_n_stored(p_n, v_burst);
        END IF;
        p_rate := v_rate;
        p_burst := v_burst;
    ELSIF v_limit IS NOT NULL AND p_kind <> 'token_bucket' THEN
        IF p_n > v_limit THEN
            PERFORM pgsemaphore.check_n_stored(p_n, v_limit);
        END IF;
        p_limit := v_limit;
        p_window := v_window;
    END IF;
    -- 2c. The reservation bound: no further ahead than burst / rate (a
    -- bucket) or one window, under the limits in force; a longer p_max_wait
    -- is clamped to it.
    IF p_max_wait > interval '0' THEN
        p_max_wait := least(p_max_wait,
                            CASE WHEN p_kind = 'token_bucket' THEN make_interval(secs => p_burst / p_rate)
                                 ELSE p_window END);
    END IF;
    -- 3. A new statement: the newest row (a new snapshot, after the lock).
    SELECT l.seq, l.tokens, l.hits, l.previous_hits, l.stamp
      INTO v_seq, v_tokens, v_hits, v_prev, v_stamp
      FROM pgsemaphore.rate_ledger l
     WHERE l.kind = p_kind AND l.limiter = p_limiter AND l.key = p_key
     ORDER BY l.seq DESC
     LIMIT 1;
    v_seq := coalesce(v_seq, 0) + 1;
    -- 4. and 5. The step, with the clock read now; admitted, the new state
    -- as row seq + 1.
    v_now := clock_timestamp();
    IF p_kind = 'token_bucket' THEN
        b := pgsemaphore.bucket_step(v_tokens, v_stamp, v_now, v_now, p_rate, p_burst, p_n, p_max_wait);
        o_allowed := b.o_allowed;
        o_wait_us := b.o_wait_us;
        o_remaining := b.o_remaining;
        IF o_allowed THEN
            INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, tokens, stamp, idle_at)
            VALUES (p_kind, p_limiter, p_key, v_seq, b.o_tokens, b.o_stamp, b.o_idle_at);
        END IF;
    ELSIF p_kind = 'fixed_window' THEN
        f := pgsemaphore.fixed_step(v_hits, v_stamp, v_now, v_now, p_limit, p_window, p_n::bigint, p_max_wait);
        o_allowed := f.o_allowed;
        o_wait_us := f.o_wait_us;
        o_remaining := f.o_remaining;
        IF o_allowed THEN
            INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, hits, stamp, idle_at)
            VALUES (p_kind, p_limiter, p_key, v_seq, f.o_hits, f.o_start, f.o_idle_at);
        END IF;
    ELSE
        w := pgsemaphore.sliding_step(v_hits, v_prev, v_stamp, v_now, v_now, p_limit, p_window, p_n::bigint, p_max_wait);
        o_allowed := w.o_allowed;
        o_wait_us := w.o_wait_us;
        o_remaining := w.o_remaining;
        IF o_allowed THEN
            INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, hits, previous_hits, stamp, idle_at)
            VALUES (p_kind, p_limiter, p_key, v_seq, w.o_hits, w.o_previous, w.o_start, w.o_idle_at);
        END IF;
    END IF;
    -- The trim: every 16th row of a key.
    IF o_allowed AND v_seq % 16 = 0 THEN
        PERFORM pgsemaphore.rate_trim(p_kind, p_limiter, p_key, v_seq - 32, v_seq - 16);
    END IF;
    RETURN NEXT;
END;
$$;

-- ---------------------------------------------------------------------------
-- The engine: several limits at once
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.rate_take_all(
    p_kinds text[], p_limiters text[], p_keys text[],
    p_rates double precision[], p_bursts double precision[],
    p_limits bigint[], p_windows interval[], p_n bigint, p_max_wait interval, p_order integer[])
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint, o_deciding integer)
LANGUAGE plpgsql
AS $$
-- SEVERAL LIMITS: p_n permits against limit i = (p_kinds[i], p_limiters[i],
-- p_keys[i]) with its kind's limits (p_rates[i], p_bursts[i] or p_limits[i],
-- p_windows[i]) for every i, at one instant, the earliest at or after the
-- clock at which every limit admits them, provided it is within p_max_wait;
-- then charged to every limit, else to none. The arguments were checked by
-- the caller (pgsemaphore.checked_limits: shapes, elements, no key twice;
-- p_order, the limits' indexes in the canonical order it returns).
-- Steps:
--   1. READ COMMITTED, or 0A000;
--   2. one statement: every key's advisory lock, in the order of the lock's
--      hash (the same order for every caller, so two of these never wait on
--      each other in a cycle; a single check holds one lock and cannot close
--      a cycle either), and each limit's stored limits and pause, read with
--      that statement's snapshot; any pause refuses, taking nothing;
--   3. one statement: every key's newest row (new snapshot, after the locks);
--   4. the step functions decide at an instant t: from the clock, t moves to
--      the latest instant any limit needs, and the limits decide again from
--      there, until all admit at t (at most 8 rounds; each round only moves
--      t later, and a bucket or a fixed window that admits at t admits at
--      any later instant, so only a sliding window's previous window can
--      make a round more);
--   5. admitted: every new state in one INSERT; refused: nothing written.
-- Invariant: each limit admits only what its own step admits on the state
-- the previous decision on its key left (as a single check would, at the
-- instant t), and a refused call writes nothing, so no limit counts a
-- refused call.
-- Step 2 also stores, for every limit with no pair in force, the caller's
-- pair as its limiter's (as rate_take), and clamps p_max_wait to the least
-- of what the limits in force allow ahead (burst / rate, one window).
-- Meets: what rate_take meets, for every key (each lock waited for at most
-- 2 s, then 55P03: the whole call fails, nothing charged); a multi-limit
-- check holding some of our keys: it holds their locks, we wait in hash
-- order.
DECLARE
    v_count   integer := cardinality(p_kinds);
    v_bound   interval := interval '366 days';
    v_paused  timestamptz[];
    v_srates  double precision[];
    v_sbursts double precision[];
    v_slimits bigint[];
    v_swins   interval[];
    v_seq     bigint[];
    v_tokens  double precision[];
    v_hits    bigint[];
    v_prev    bigint[];
    v_stamp   timestamptz[];
    n_tokens  double precision[];
    n_hits    bigint[];
    n_prev    bigint[];
    n_stamp   timestamptz[];
    n_idle    timestamptz[];
    v_now     timestamptz;
    v_from    timestamptz;
    v_at_us   bigint;
    v_latest  bigint;
    v_refused bigint;
    v_all     boolean;
    v_ok      boolean;
    v_wait    bigint;
    v_left    bigint;
    v_i       integer;
    r         record;
    u         record;
    b         record;
    f         record;
    w         record;
BEGIN
    -- 1.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgsemaphore.refuse_isolation();
    END IF;
    -- 2. (A loop over the statement's rows, each put at its limit's index:
    -- no aggregate, whose sorts cost more than the rows.)
    FOR r IN
        SELECT o.i, st.rate, st.burst, st.lim, st.win, st.paused
          FROM (SELECT g.i, hashtext(p_kinds[g.i] || '/' || p_limiters[g.i] || '/' || p_keys[g.i]) AS h
                  FROM generate_subscripts(p_kinds, 1) AS g(i)
                 ORDER BY 2
                OFFSET 0) AS o
         CROSS JOIN LATERAL pg_advisory_xact_lock(1885828967, o.h) AS lock
          LEFT JOIN LATERAL (
                SELECT CASE WHEN k.rate IS NOT NULL THEN k.rate ELSE l.rate END AS rate,
                       CASE WHEN k.rate IS NOT NULL THEN k.burst ELSE l.burst END AS burst,
                       CASE WHEN k.permit_limit IS NOT NULL THEN k.permit_limit ELSE l.permit_limit END AS lim,
                       CASE WHEN k.permit_limit IS NOT NULL THEN k.window_length ELSE l.window_length END AS win,
                       greatest(k.paused_until, l.paused_until) AS paused
                  FROM (SELECT 1) AS one
                  LEFT JOIN pgsemaphore.rate_limit_settings k
                    ON k.kind = p_kinds[o.i] AND k.limiter = p_limiters[o.i] AND k.key = p_keys[o.i]
                  LEFT JOIN pgsemaphore.rate_limit_settings l
                    ON l.kind = p_kinds[o.i] AND l.limiter = p_limiters[o.i] AND l.key = '') AS st
            ON true
    LOOP
        v_srates[r.i] := r.rate;
        v_sbursts[r.i] := r.burst;
        v_slimits[r.i] := r.lim;
        v_swins[r.i] := r.win;
        v_paused[r.i] := r.paused;
    END LOOP;
    v_now := clock_timestamp();
    o_allowed := true;
    o_wait_us := 0;
    FOR v_i IN 1 .. v_count LOOP
        IF v_paused[v_i] > v_now THEN
            -- Refused: the longest pause decides.
            v_at_us := pgsemaphore.us_until(v_paused[v_i]);
            IF o_allowed OR v_at_us > o_wait_us THEN
                o_wait_us := v_at_us;
                o_deciding := v_i;
            END IF;
            o_allowed := false;
        ELSE
            -- No pair in force: the first use stores the caller's (as in
            -- rate_take).
            IF (CASE WHEN p_kinds[v_i] = 'token_bucket' THEN v_srates[v_i] IS NULL ELSE v_slimits[v_i] IS NULL END) THEN
                u := pgsemaphore.rate_limit_first_use(p_kinds[v_i], p_limiters[v_i], p_rates[v_i], p_bursts[v_i],
                                                      p_limits[v_i], p_windows[v_i]);
                v_srates[v_i] := u.o_rate;
                v_sbursts[v_i] := u.o_burst;
                v_slimits[v_i] := u.o_limit;
                v_swins[v_i] := u.o_window;
            END IF;
            IF p_kinds[v_i] = 'token_bucket' THEN
                IF v_srates[v_i] IS NOT NULL THEN
                    PERFORM pgsemaphore.check_n_stored(p_n, v_sbursts[v_i]);
                    p_rates[v_i] := v_srates[v_i];
                    p_bursts[v_i] := v_sbursts[v_i];
                END IF;
                v_bound := least(v_bound, make_interval(secs => p_bursts[v_i] / p_rates[v_i]));
            ELSE
                IF v_slimits[v_i] IS NOT NULL THEN
                    PERFORM pgsemaphore.check_n_stored(p_n, v_slimits[v_i]);
                    p_limits[v_i] := v_slimits[v_i];
                    p_windows[v_i] := v_swins[v_i];
                END IF;
                v_bound := least(v_bound, p_windows[v_i]);
            END IF;
        END IF;
    END LOOP;
    -- The reservation bound: no further ahead than every limit in force
    -- allows (burst / rate, one window); a longer p_max_wait is clamped.
    p_max_wait := least(p_max_wait, v_bound);
    IF NOT o_allowed THEN
        o_remaining := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    -- 3. (The same kind of loop.)
    FOR r IN
        SELECT g.i, l.seq, l.tokens, l.hits, l.previous_hits, l.stamp
          FROM generate_subscripts(p_kinds, 1) AS g(i)
          JOIN LATERAL (
                SELECT q.seq, q.tokens, q.hits, q.previous_hits, q.stamp
                  FROM pgsemaphore.rate_ledger q
                 WHERE q.kind = p_kinds[g.i] AND q.limiter = p_limiters[g.i] AND q.key = p_keys[g.i]
                 ORDER BY q.seq DESC
                 LIMIT 1) AS l
            ON true
    LOOP
        v_seq[r.i] := r.seq;
        v_tokens[r.i] := r.tokens;
        v_hits[r.i] := r.hits;
        v_prev[r.i] := r.previous_hits;
        v_stamp[r.i] := r.stamp;
    END LOOP;
    -- 4.
    v_now := clock_timestamp();
    v_from := v_now;
    v_at_us := 0;
    FOR v_round IN 1 .. 8 LOOP
        v_all := true;
        v_latest := v_at_us;
        v_refused := 0;
        o_remaining := NULL;
        o_deciding := NULL;
        -- In the canonical order, as version 9 did: ties decide the same.
        FOREACH v_i IN ARRAY p_order LOOP
            IF p_kinds[v_i] = 'token_bucket' THEN
                b := pgsemaphore.bucket_step(v_tokens[v_i], v_stamp[v_i], v_now, v_from,
                                             p_rates[v_i], p_bursts[v_i], p_n, p_max_wait);
                v_ok := b.o_allowed;
                v_wait := b.o_wait_us;
                v_left := b.o_remaining;
                n_tokens[v_i] := b.o_tokens;
                n_stamp[v_i] := b.o_stamp;
                n_idle[v_i] := b.o_idle_at;
            ELSIF p_kinds[v_i] = 'fixed_window' THEN
                f := pgsemaphore.fixed_step(v_hits[v_i], v_stamp[v_i], v_now, v_from,
                                            p_limits[v_i], p_windows[v_i], p_n, p_max_wait);
                v_ok := f.o_allowed;
                v_wait := f.o_wait_us;
                v_left := f.o_remaining;
                n_hits[v_i] := f.o_hits;
                n_stamp[v_i] := f.o_start;
                n_idle[v_i] := f.o_idle_at;
            ELSE
                w := pgsemaphore.sliding_step(v_hits[v_i], v_prev[v_i], v_stamp[v_i], v_now, v_from,
                                              p_limits[v_i], p_windows[v_i], p_n, p_max_wait);
                v_ok := w.o_allowed;
                v_wait := w.o_wait_us;
                v_left := w.o_remaining;
                n_hits[v_i] := w.o_hits;
                n_prev[v_i] := w.o_previous;
                n_stamp[v_i] := w.o_start;
                n_idle[v_i] := w.o_idle_at;
            END IF;
            -- The fewest left (admitted: that limit decides); refused, the
            -- refusing limit with the longest wait decides.
            IF o_remaining IS NULL OR v_left < o_remaining THEN
                o_remaining := v_left;
                IF v_all AND v_ok THEN
                    o_deciding := v_i;
                END IF;
            END IF;
            IF NOT v_ok AND (v_all OR v_wait > v_refused) THEN
                v_all := false;
                v_refused := v_wait;
                o_deciding := v_i;
            END IF;
            IF v_ok AND v_wait > v_latest THEN
                v_latest := v_wait;
            END IF;
        END LOOP;
        EXIT WHEN NOT v_all OR v_latest <= v_at_us;
        -- Some limit admits only later: every limit again, from there.
        v_at_us := v_latest;
        v_from := v_now + make_interval(secs => v_latest / 1e6);
    END LOOP;
    IF NOT v_all THEN
        o_allowed := false;
        o_wait_us := v_refused;
        RETURN NEXT;
        RETURN;
    END IF;
    -- Not settled in 8 rounds: refused with the latest instant found (the
    -- caller may try again then).
    o_allowed := v_latest <= v_at_us;
    o_wait_us := v_latest;
    IF NOT o_allowed THEN
        RETURN NEXT;
        RETURN;
    END IF;
    -- 5.
    INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, tokens, hits, previous_hits, stamp, idle_at)
    SELECT p_kinds[g.i], p_limiters[g.i], p_keys[g.i], coalesce(v_seq[g.i], 0) + 1,
           n_tokens[g.i], n_hits[g.i], n_prev[g.i], n_stamp[g.i], n_idle[g.i]
      FROM generate_subscripts(p_kinds, 1) AS g(i);
    FOR v_i IN 1 .. v_count LOOP
        IF (coalesce(v_seq[v_i], 0) + 1) % 16 = 0 THEN
            PERFORM pgsemaphore.rate_trim(p_kinds[v_i], p_limiters[v_i], p_keys[v_i],
                                          v_seq[v_i] + 1 - 32, v_seq[v_i] + 1 - 16);
        END IF;
    END LOOP;
    RETURN NEXT;
END;
$$;

-- The arguments of several limits at once (check_limits,
-- check_limits_reserve), as version 9 checked them: the arrays' shapes, then
-- each element as its kind's own function checks it (22023 naming p_rate,
-- p_burst, p_limit, p_window or p_n, as that function did), no key twice.
-- Returns the limits' indexes in the canonical order (kind, limiter, key,
-- by byte), the order in which they decide.
CREATE FUNCTION pgsemaphore.checked_limits(
    p_kinds text[], p_limiters text[], p_keys text[],
    p_rates double precision[], p_bursts double precision[],
    p_limits bigint[], p_windows interval[], p_n bigint)
RETURNS integer[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_count integer;
    v_order integer[];
    v_i     integer;
BEGIN
    IF p_kinds IS NULL OR array_ndims(p_kinds) IS DISTINCT FROM 1 OR array_lower(p_kinds, 1) <> 1
       OR array_length(p_kinds, 1) > 16 THEN
        PERFORM pgsemaphore.refuse('p_kinds', 'a one-dimensional array of 1 to 16 kinds, from index 1');
    END IF;
    v_count := array_length(p_kinds, 1);
    IF p_limiters IS NULL OR array_ndims(p_limiters) IS DISTINCT FROM 1 OR array_lower(p_limiters, 1) <> 1
       OR array_length(p_limiters, 1) <> v_count THEN
        PERFORM pgsemaphore.refuse('p_limiters', format('a one-dimensional array of %s names, from index 1', v_count));
    END IF;
    IF p_keys IS NULL OR array_ndims(p_keys) IS DISTINCT FROM 1 OR array_lower(p_keys, 1) <> 1
       OR array_length(p_keys, 1) <> v_count THEN
        PERFORM pgsemaphore.refuse('p_keys', format('a one-dimensional array of %s keys, from index 1', v_count));
    END IF;
    IF p_rates IS NULL OR array_ndims(p_rates) IS DISTINCT FROM 1 OR array_lower(p_rates, 1) <> 1
       OR array_length(p_rates, 1) <> v_count THEN
        PERFORM pgsemaphore.refuse('p_rates', format('a one-dimensional array of %s elements, from index 1', v_count));
    END IF;
    IF p_bursts IS NULL OR array_ndims(p_bursts) IS DISTINCT FROM 1 OR array_lower(p_bursts, 1) <> 1
       OR array_length(p_bursts, 1) <> v_count THEN
        PERFORM pgsemaphore.refuse('p_bursts', format('a one-dimensional array of %s elements, from index 1', v_count));
    END IF;
    IF p_limits IS NULL OR array_ndims(p_limits) IS DISTINCT FROM 1 OR array_lower(p_limits, 1) <> 1
       OR array_length(p_limits, 1) <> v_count THEN
        PERFORM pgsemaphore.refuse('p_limits', format('a one-dimensional array of %s elements, from index 1', v_count));
    END IF;
    IF p_windows IS NULL OR array_ndims(p_windows) IS DISTINCT FROM 1 OR array_lower(p_windows, 1) <> 1
       OR array_length(p_windows, 1) <> v_count THEN
        PERFORM pgsemaphore.refuse('p_windows', format('a one-dimensional array of %s elements, from index 1', v_count));
    END IF;
    IF p_n IS NULL OR p_n < 1 THEN
        PERFORM pgsemaphore.refuse('p_n', format('at least 1, got %s', coalesce(p_n::text, 'NULL')));
    END IF;
    FOR v_i IN 1 .. v_count LOOP
        IF p_kinds[v_i] IS NULL OR p_kinds[v_i] NOT IN ('token_bucket', 'fixed_window', 'sliding_window') THEN
            PERFORM pgsemaphore.refuse('p_kinds', format('element %s: token_bucket, fixed_window or sliding_window', v_i));
        END IF;
        -- (Plain expressions; a helper is called only to raise.)
        IF p_limiters[v_i] IS NULL OR char_length(p_limiters[v_i]) NOT BETWEEN 1 AND 200
           OR p_keys[v_i] IS NULL OR char_length(p_keys[v_i]) NOT BETWEEN 1 AND 256 THEN
            PERFORM pgsemaphore.check_limiter_key(p_limiters[v_i], p_keys[v_i]);
        END IF;
        IF p_kinds[v_i] = 'token_bucket' THEN
            IF p_rates[v_i] IS NULL OR NOT (p_rates[v_i] > 0 AND p_rates[v_i] <= 1e9)
               OR p_bursts[v_i] IS NULL OR NOT (p_bursts[v_i] >= 1 AND p_bursts[v_i] <= 1e15)
               OR p_bursts[v_i] / p_rates[v_i] > 366 * 86400 THEN
                PERFORM pgsemaphore.check_bucket(p_rates[v_i], p_bursts[v_i]);
            END IF;
            IF NOT (p_n <= p_bursts[v_i]) THEN
                PERFORM pgsemaphore.refuse('p_n', format('1 to the burst (%s), got %s', p_bursts[v_i], p_n));
            END IF;
        ELSIF p_limits[v_i] IS NULL OR p_limits[v_i] NOT BETWEEN 1 AND 1000000000000000 OR p_windows[v_i] IS NULL
              OR p_windows[v_i] < interval '1 ms' OR p_windows[v_i] > interval '366 days'
              OR p_n NOT BETWEEN 1 AND p_limits[v_i] THEN
            PERFORM pgsemaphore.check_window(p_limits[v_i], p_windows[v_i], p_n);
        END IF;
    END LOOP;
    SELECT array_agg(i ORDER BY p_kinds[i] COLLATE "C", p_limiters[i] COLLATE "C", p_keys[i] COLLATE "C")
      INTO v_order
      FROM generate_subscripts(p_kinds, 1) i;
    FOR v_i IN 2 .. v_count LOOP
        IF p_kinds[v_order[v_i]] = p_kinds[v_order[v_i - 1]]
           AND p_limiters[v_order[v_i]] = p_limiters[v_order[v_i - 1]]
           AND p_keys[v_order[v_i]] = p_keys[v_order[v_i - 1]] THEN
            PERFORM pgsemaphore.refuse('p_limiters',
                format('limit %s and limit %s are the same key of the same limiter', v_order[v_i - 1], v_order[v_i]));
        END IF;
    END LOOP;
    RETURN v_order;
END;
$$;

-- ---------------------------------------------------------------------------
-- The application's functions: same signatures, results, checks and grants
-- as before; each checks its arguments with plain expressions (a helper is
-- called only to raise) and calls the engine once.
-- ---------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION pgsemaphore.token_bucket(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision, p_n double precision)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- TOKEN BUCKET (Stripe's request rate limiter, with the database's clock),
-- per key: p_burst tokens at most, refilled continuously at p_rate per
-- second; a check of p_n is admitted when p_n tokens are there, and takes
-- them. The steps, the invariant and what it meets: pgsemaphore.rate_take
-- (version 12) and pgsemaphore.bucket_step.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_rate finite,
--   above 0, at most 1e9 tokens per second; p_burst finite, 1 to 1e15, and
--   refilled from empty within 366 days; p_n finite, 1 to p_burst
-- Every bad argument raises 22023 naming it in COLUMN; outside READ
-- COMMITTED, 0A000; the key's lock held by another transaction for more
-- than 2 s (lock_timeout), 55P03, nothing taken. p_rate and p_burst are
-- stored by the limiter's first use (when no pair is stored for the key or
-- the limiter, they become the limiter's); after that the stored pair in
-- pgsemaphore.rate_limit_settings for the key, else for the limiter,
-- applies whatever is passed (p_n above a stored burst raises 22023 p_n),
-- and only the operator changes it. While the key or the limiter is paused
-- the check is refused (o_remaining 0, o_retry_after_us until the pause
-- ends), taking nothing.
-- Returns o_allowed, o_remaining (whole tokens left), o_retry_after_us
-- (refused: until p_n tokens are there; 0 when admitted).
BEGIN
    IF p_limiter IS NULL OR char_length(p_limiter) NOT BETWEEN 1 AND 200
       OR p_key IS NULL OR char_length(p_key) NOT BETWEEN 1 AND 256 THEN
        PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    END IF;
    IF p_rate IS NULL OR NOT (p_rate > 0 AND p_rate <= 1e9)
       OR p_burst IS NULL OR NOT (p_burst >= 1 AND p_burst <= 1e15) OR p_burst / p_rate > 366 * 86400 THEN
        PERFORM pgsemaphore.check_bucket(p_rate, p_burst);
    END IF;
    IF p_n IS NULL OR NOT (p_n >= 1 AND p_n <= p_burst) THEN
        PERFORM pgsemaphore.refuse('p_n', format('1 to the burst (%s), got %s', p_burst, coalesce(p_n::text, 'NULL')));
    END IF;
    RETURN QUERY
        SELECT t.o_allowed, t.o_remaining, CASE WHEN t.o_allowed THEN 0::bigint ELSE t.o_wait_us END
          FROM pgsemaphore.rate_take('token_bucket', p_limiter, p_key, p_rate, p_burst, NULL, NULL,
                                     p_n, interval '0', true) t;
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.token_bucket_reserve(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision,
    p_n double precision, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- TOKEN BUCKET RESERVATION (version 6): p_n tokens taken now even if they
-- are not there yet, provided they will be within p_max_wait; the caller
-- waits o_wait_us, then acts: that instant is its admission. The invariant
-- (over any interval of length d, the admissions of a key at their admitted
-- instants, plain checks included, take at most p_burst + p_rate x d tokens):
-- migrations/20261128000001_pgsemaphore_waiting_bucket.sql; the steps and
-- what it meets: pgsemaphore.rate_take.
--   as token_bucket, and p_max_wait 0 to 366 days, not NULL; a p_max_wait
--   beyond burst / rate of the pair in force is clamped to it (a
--   reservation books at most that far ahead)
-- Returns o_allowed (false: nothing taken), o_wait_us (until the tokens are
-- there; refused, how long it would have been), o_remaining (whole tokens
-- left; below zero, the tokens reserved ahead). Stored limits apply as in
-- token_bucket; while paused it is refused, nothing taken, with o_wait_us
-- until the pause ends and o_remaining 0 (a refusal with o_wait_us within
-- p_max_wait is a pause: call again when it ends).
BEGIN
    IF p_limiter IS NULL OR char_length(p_limiter) NOT BETWEEN 1 AND 200
       OR p_key IS NULL OR char_length(p_key) NOT BETWEEN 1 AND 256 THEN
        PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    END IF;
    IF p_rate IS NULL OR NOT (p_rate > 0 AND p_rate <= 1e9)
       OR p_burst IS NULL OR NOT (p_burst >= 1 AND p_burst <= 1e15) OR p_burst / p_rate > 366 * 86400 THEN
        PERFORM pgsemaphore.check_bucket(p_rate, p_burst);
    END IF;
    IF p_n IS NULL OR NOT (p_n >= 1 AND p_n <= p_burst) THEN
        PERFORM pgsemaphore.refuse('p_n', format('1 to the burst (%s), got %s', p_burst, coalesce(p_n::text, 'NULL')));
    END IF;
    IF p_max_wait IS NULL OR p_max_wait < interval '0' OR p_max_wait > interval '366 days' THEN
        PERFORM pgsemaphore.checked_interval(p_max_wait, 'p_max_wait', interval '0', interval '366 days');
    END IF;
    RETURN QUERY
        SELECT * FROM pgsemaphore.rate_take('token_bucket', p_limiter, p_key, p_rate, p_burst, NULL, NULL,
                                            p_n, p_max_wait, true);
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.fixed_window(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- FIXED WINDOW, per key: at most p_limit permits per window of p_window, on
-- the key's own grid (windows back to back from its first check); a check
-- is a booking that may not wait. The arithmetic and its invariant:
-- pgsemaphore.fixed_step (version 12; version 10's fixed_window_book); the
-- steps and what it meets: pgsemaphore.rate_take.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_limit at least
--   1; p_window 1 ms..366 days; p_n 1 to p_limit
-- Every bad argument raises 22023 naming it in COLUMN; outside READ
-- COMMITTED, 0A000; a held key lock, 55P03 after 2 s. p_limit and p_window
-- are stored by the limiter's first use, after which the stored pair (key,
-- else limiter) applies whatever is passed, and a pause refuses, as in
-- token_bucket.
-- Returns o_allowed, o_remaining (left in the window open now; 0 while a
-- later window has bookings), o_retry_after_us (refused: until a window
-- has room; 0 when admitted).
BEGIN
    IF p_limiter IS NULL OR char_length(p_limiter) NOT BETWEEN 1 AND 200
       OR p_key IS NULL OR char_length(p_key) NOT BETWEEN 1 AND 256 THEN
        PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    END IF;
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 1000000000000000 OR p_window IS NULL OR p_window < interval '1 ms'
       OR p_window > interval '366 days' OR p_n IS NULL OR p_n NOT BETWEEN 1 AND p_limit THEN
        PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    END IF;
    RETURN QUERY
        SELECT t.o_allowed, t.o_remaining, CASE WHEN t.o_allowed THEN 0::bigint ELSE t.o_wait_us END
          FROM pgsemaphore.rate_take('fixed_window', p_limiter, p_key, NULL, NULL, p_limit, p_window,
                                     p_n, interval '0', true) t;
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.sliding_window(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- SLIDING WINDOW, per key: the permits of the last p_window, estimated as
-- previous x (1 - elapsed / p_window) + current (windows on the key's own
-- grid), at most p_limit; a check is a booking that may not wait. The
-- arithmetic and its invariant: pgsemaphore.sliding_step (version 12;
-- version 10's sliding_window_book); the steps and what it meets:
-- pgsemaphore.rate_take.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_limit at least
--   1; p_window 1 ms..366 days; p_n 1 to p_limit
-- Every bad argument raises 22023 naming it in COLUMN; outside READ
-- COMMITTED, 0A000; a held key lock, 55P03 after 2 s. p_limit and p_window
-- are stored by the limiter's first use, after which the stored pair (key,
-- else limiter) applies whatever is passed, and a pause refuses, as in
-- token_bucket.
-- Returns o_allowed, o_remaining (the floor of p_limit - estimate; 0 while
-- a later window has bookings), o_retry_after_us (refused: until enough
-- has slid out; 0 when admitted).
BEGIN
    IF p_limiter IS NULL OR char_length(p_limiter) NOT BETWEEN 1 AND 200
       OR p_key IS NULL OR char_length(p_key) NOT BETWEEN 1 AND 256 THEN
        PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    END IF;
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 1000000000000000 OR p_window IS NULL OR p_window < interval '1 ms'
       OR p_window > interval '366 days' OR p_n IS NULL OR p_n NOT BETWEEN 1 AND p_limit THEN
        PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    END IF;
    RETURN QUERY
        SELECT t.o_allowed, t.o_remaining, CASE WHEN t.o_allowed THEN 0::bigint ELSE t.o_wait_us END
          FROM pgsemaphore.rate_take('sliding_window', p_limiter, p_key, NULL, NULL, p_limit, p_window,
                                     p_n, interval '0', true) t;
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.fixed_window_reserve(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- FIXED WINDOW RESERVATION (version 10): books p_n permits in the first
-- window of the key's grid with room for them, if it opens within
-- p_max_wait; the caller waits o_wait_us, then acts. As fixed_window, and
-- p_max_wait 0 to 366 days, not NULL, clamped to one window of the pair in
-- force (a booking is at most one window ahead). Returns o_allowed (false: nothing
-- booked), o_wait_us (until the booked window opens; refused, until the
-- window with room would have), o_remaining (left in the window open now).
-- Stored limits and pauses as in fixed_window; a pause refuses with
-- o_wait_us until it ends and o_remaining 0.
BEGIN
    IF p_limiter IS NULL OR char_length(p_limiter) NOT BETWEEN 1 AND 200
       OR p_key IS NULL OR char_length(p_key) NOT BETWEEN 1 AND 256 THEN
        PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    END IF;
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 1000000000000000 OR p_window IS NULL OR p_window < interval '1 ms'
       OR p_window > interval '366 days' OR p_n IS NULL OR p_n NOT BETWEEN 1 AND p_limit THEN
        PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    END IF;
    IF p_max_wait IS NULL OR p_max_wait < interval '0' OR p_max_wait > interval '366 days' THEN
        PERFORM pgsemaphore.checked_interval(p_max_wait, 'p_max_wait', interval '0', interval '366 days');
    END IF;
    RETURN QUERY
        SELECT * FROM pgsemaphore.rate_take('fixed_window', p_limiter, p_key, NULL, NULL, p_limit, p_window,
                                            p_n, p_max_wait, true);
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.sliding_window_reserve(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- SLIDING WINDOW RESERVATION (version 10): books p_n permits at the earliest
-- instant the weighted estimate admits them, if that is within p_max_wait;
-- the caller waits o_wait_us, then acts. As sliding_window, and p_max_wait
-- 0 to 366 days, not NULL, clamped to one window of the pair in force.
-- Returns o_allowed (false: nothing booked),
-- o_wait_us (until the booked instant; refused, until it would have been),
-- o_remaining (left now). Stored limits and pauses as in sliding_window; a
-- pause refuses with o_wait_us until it ends and o_remaining 0.
BEGIN
    IF p_limiter IS NULL OR char_length(p_limiter) NOT BETWEEN 1 AND 200
       OR p_key IS NULL OR char_length(p_key) NOT BETWEEN 1 AND 256 THEN
        PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    END IF;
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 1000000000000000 OR p_window IS NULL OR p_window < interval '1 ms'
       OR p_window > interval '366 days' OR p_n IS NULL OR p_n NOT BETWEEN 1 AND p_limit THEN
        PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    END IF;
    IF p_max_wait IS NULL OR p_max_wait < interval '0' OR p_max_wait > interval '366 days' THEN
        PERFORM pgsemaphore.checked_interval(p_max_wait, 'p_max_wait', interval '0', interval '366 days');
    END IF;
    RETURN QUERY
        SELECT * FROM pgsemaphore.rate_take('sliding_window', p_limiter, p_key, NULL, NULL, p_limit, p_window,
                                            p_n, p_max_wait, true);
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.check_limits(
    p_kinds text[], p_limiters text[], p_keys text[],
    p_rates double precision[], p_bursts double precision[],
    p_limits bigint[], p_windows interval[], p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint, o_deciding integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- SEVERAL LIMITS IN ONE CHECK (version 9): p_n permits against limit i =
-- (p_kinds[i], p_limiters[i], p_keys[i]) for every i, admitted only if every
-- limit admits now, and then charged to every one; refused if any refuses,
-- and then charged to none. Each limit decides as its kind's check would
-- (stored limits and pauses apply). The steps, the invariant and what it
-- meets: pgsemaphore.rate_take_all (version 12: one statement locks every
-- key, one reads them, one writes them, where version 9 called each
-- limit's function in a subtransaction).
--   p_kinds: a one-dimensional array of 1 to 16 kinds, from index 1, no
--   NULL; the six other arrays: one-dimensional, from index 1, as long
--   (elements as each kind's function takes them; the other kind's may be
--   NULL); no (kind, limiter, key) twice (22023 p_limiters); p_n at least 1
--   and at most every limit (pgsemaphore.checked_limits)
-- Returns one row:
--   o_allowed        every limit admitted (and all are charged)
--   o_remaining      the fewest permits any limit has left after its own
--                    decision
--   o_retry_after_us refused: the longest wait of the refusing limits (a
--                    pause: until it ends); 0 when admitted
--   o_deciding       the index (from 1, in the caller's order) of the limit
--                    that decided: refused, the refusing one with the
--                    longest wait; admitted, the one with the fewest left
DECLARE
    v_order integer[];
BEGIN
    v_order := pgsemaphore.checked_limits(p_kinds, p_limiters, p_keys, p_rates, p_bursts, p_limits, p_windows, p_n);
    RETURN QUERY
        SELECT t.o_allowed, t.o_remaining, CASE WHEN t.o_allowed THEN 0::bigint ELSE t.o_wait_us END, t.o_deciding
          FROM pgsemaphore.rate_take_all(p_kinds, p_limiters, p_keys, p_rates, p_bursts, p_limits, p_windows,
                                         p_n, interval '0', v_order) t;
END;
$$;

CREATE FUNCTION pgsemaphore.check_limits_reserve(
    p_kinds text[], p_limiters text[], p_keys text[],
    p_rates double precision[], p_bursts double precision[],
    p_limits bigint[], p_windows interval[], p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint, o_deciding integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- SEVERAL LIMITS THAT WAIT (version 12): books p_n permits in every limit
-- at one instant, the earliest at which all admit them, if it is within
-- p_max_wait; the caller waits o_wait_us, then acts: that instant is its
-- admission in every limit. As check_limits, and p_max_wait 0 to 366 days,
-- not NULL, clamped to the least of the limits' bounds (burst / rate, one
-- window). Each limit books as its kind's reservation would at that
-- instant (a bucket takes the tokens at once, a window books the window of
-- that instant); the steps, the invariant and what it meets:
-- pgsemaphore.rate_take_all.
-- Returns one row: o_allowed (false: nothing booked anywhere), o_wait_us
-- (until the instant; refused, the wait of the limit that refused, or until
-- a pause ends: a refusal with o_wait_us within p_max_wait is a pause, or
-- limits that did not settle on an instant, and the caller may call again
-- then), o_remaining (the fewest left), o_deciding (as in check_limits;
-- admitted, the limit with the fewest left).
DECLARE
    v_order integer[];
BEGIN
    v_order := pgsemaphore.checked_limits(p_kinds, p_limiters, p_keys, p_rates, p_bursts, p_limits, p_windows, p_n);
    IF p_max_wait IS NULL OR p_max_wait < interval '0' OR p_max_wait > interval '366 days' THEN
        PERFORM pgsemaphore.checked_interval(p_max_wait, 'p_max_wait', interval '0', interval '366 days');
    END IF;
    RETURN QUERY
        SELECT * FROM pgsemaphore.rate_take_all(p_kinds, p_limiters, p_keys, p_rates, p_bursts, p_limits,
                                                p_windows, p_n, p_max_wait, v_order);
END;
$$;

-- ---------------------------------------------------------------------------
-- The internal functions of earlier versions (no grants), on the engine:
-- the caller's limits, no stored ones, no pause.
-- ---------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION pgsemaphore.token_bucket_unchecked(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision, p_n double precision)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE sql
AS $$
    SELECT t.o_allowed, t.o_remaining, CASE WHEN t.o_allowed THEN 0::bigint ELSE t.o_wait_us END
      FROM pgsemaphore.rate_take('token_bucket', p_limiter, p_key, p_rate, p_burst, NULL, NULL,
                                 p_n, interval '0', false) t
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.fixed_window_book(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE sql
AS $$
    SELECT * FROM pgsemaphore.rate_take('fixed_window', p_limiter, p_key, NULL, NULL, p_limit, p_window,
                                        p_n, p_max_wait, false)
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.sliding_window_book(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE sql
AS $$
    SELECT * FROM pgsemaphore.rate_take('sliding_window', p_limiter, p_key, NULL, NULL, p_limit, p_window,
                                        p_n, p_max_wait, false)
$$;

-- (fixed_window_unchecked and sliding_window_unchecked call the two above,
-- as since version 10.)

-- ---------------------------------------------------------------------------
-- Pruning (operator)
-- ---------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION pgsemaphore.prune_rate_limits_unchecked(
    p_idle_for interval, p_kind text, p_limiter text, p_key text, p_batch integer)
RETURNS TABLE (o_deleted bigint, o_kind text, o_limiter text, o_key text)
LANGUAGE plpgsql
AS $$
-- Looks at up to p_batch keys after the cursor (p_kind, p_limiter, p_key)
-- (three NULLs or empty strings: from the first), in key order. Of each, it
-- reads the newest row, then deletes the rows up to and including it if it
-- is at rest since at least p_idle_for (the key is gone: counted in
-- o_deleted), else the rows behind it. Returns the keys deleted, and the
-- cursor to pass next (NULLs: the end was reached).
-- It takes no lock of a key and never waits for a check: it deletes only
-- rows up to the newest it read, so whatever a check commits after that
-- read (a row seq + 1) stays, and is the key's state.
-- Meets:
--   * a check of the key, committed before our read: we see its row (a key
--     at rest is deleted only if that row is); committed after: its row
--     stays, and it decided either on the row we delete (at rest: a full
--     bucket, ended windows) or on none (the same for what it admits);
--   * a check's own trim deleting some of the same rows, not yet committed:
--     we skip them (rate_trim), never waiting for its transaction; they go
--     with it;
--   * another prune: the same;
--   * any isolation level: a stale read only deletes less.
DECLARE
    v_key     record;
    v_idle    timestamptz;
    v_newest  bigint;
    v_scanned integer := 0;
    v_last    record;
    v_cut     timestamptz := clock_timestamp() - p_idle_for;
BEGIN
    o_deleted := 0;
    FOR v_key IN
        -- The distinct keys after the cursor: a walk of the primary key, one
        -- key at a time.
        WITH RECURSIVE k AS (
            (SELECT l.kind, l.limiter, l.key
               FROM pgsemaphore.rate_ledger l
              WHERE (l.kind, l.limiter, l.key) > (coalesce(p_kind, ''), coalesce(p_limiter, ''), coalesce(p_key, ''))
              ORDER BY l.kind, l.limiter, l.key
              LIMIT 1)
            UNION ALL
            SELECT n.kind, n.limiter, n.key
              FROM k
             CROSS JOIN LATERAL (
                    SELECT l.kind, l.limiter, l.key
                      FROM pgsemaphore.rate_ledger l
                     WHERE (l.kind, l.limiter, l.key) > (k.kind, k.limiter, k.key)
                     ORDER BY l.kind, l.limiter, l.key
                     LIMIT 1) n
        )
        SELECT * FROM k LIMIT p_batch
    LOOP
        v_scanned := v_scanned + 1;
        v_last := v_key;
        SELECT l.seq, l.idle_at INTO v_newest, v_idle
          FROM pgsemaphore.rate_ledger l
         WHERE l.kind = v_key.kind AND l.limiter = v_key.limiter AND l.key = v_key.key
         ORDER BY l.seq DESC
         LIMIT 1;
        CONTINUE WHEN NOT FOUND;
        IF v_idle <= v_cut THEN
            PERFORM pgsemaphore.rate_trim(v_key.kind, v_key.limiter, v_key.key, 0, v_newest + 1);
            o_deleted := o_deleted + 1;
        ELSE
            PERFORM pgsemaphore.rate_trim(v_key.kind, v_key.limiter, v_key.key, 0, v_newest);
        END IF;
    END LOOP;
    IF v_scanned >= p_batch THEN
        o_kind := v_last.kind;
        o_limiter := v_last.limiter;
        o_key := v_last.key;
    END IF;
    RETURN NEXT;
END;
$$;

-- ---------------------------------------------------------------------------
-- Privileges: nobody but the owner runs anything until granted; whoever may
-- run check_limits may run check_limits_reserve, so an upgrade asks for no
-- new grants. The engine and the step functions are granted to nobody.
-- ---------------------------------------------------------------------------

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS grantee, a.is_grantable
          FROM pg_proc p
         CROSS JOIN LATERAL aclexplode(p.proacl) a
         WHERE p.oid = 'pgsemaphore.check_limits(text[], text[], text[], double precision[], double precision[], bigint[], interval[], bigint)'::regprocedure
           AND a.privilege_type = 'EXECUTE'
           AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgsemaphore.check_limits_reserve(text[], text[], text[], double precision[], double precision[], bigint[], interval[], bigint, interval) TO %s%s',
                       r.grantee, CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END;
$$;
