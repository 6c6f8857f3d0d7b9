-- pg-semaphore, schema version 10: the windows wait too.
--
-- A caller that would rather wait for a window's permits than be refused
-- had to poll fixed_window or sliding_window, sleeping o_retry_after_us
-- between checks: a thousand waiters on one key made a thousand round trips
-- each time a window opened, and all but a few were refused again. As
-- token_bucket_reserve does for the token bucket (version 6), a window now
-- takes a *booking*: one call books the permits in the first window (of the
-- key's own grid) that has room for them, and answers how long the caller
-- must wait until that window opens (sliding: until enough of the previous
-- window has slid out). Each admission costs one round trip, and waiters
-- are admitted in the order they booked.
-- What this migration changes, and nothing else:
--   * application functions fixed_window_reserve and sliding_window_reserve
--     (p_limiter, p_key, p_limit, p_window, p_n, p_max_wait), granted here to
--     every role that may run fixed_window (copied below), so an upgrade asks
--     for no new grants;
--   * internal functions fixed_window_book and sliding_window_book: the
--     windows' arithmetic, now able to book ahead; fixed_window_unchecked and
--     sliding_window_unchecked (the plain checks' arithmetic) become a booking
--     that may not wait, so plain checks and bookings share one arithmetic
--     and one row per key (fixed_window and sliding_window call the booking
--     directly, after reading the stored limits and pauses of version 9, as
--     the reservations do);
--   * a key of a window limiter may now have its row's window (stamp) in the
--     future: the latest window with bookings. Until that window opens, a
--     plain check is refused (bookings are served first) and its
--     retry-after is the wait a booking would get; the row is at rest when
--     that window (sliding: the one after it) has ended, as before;
--   * schema_version() returns (10, 2): code built for versions 2 to 9
--     works against it unchanged.
-- The storage is unchanged: one row per key in pgsemaphore.rate_limits.
-- (An insert-only ledger of per-key states, serialised by an advisory lock,
-- was measured against it under a held xmin horizon as a prototype,
-- benches/bench/ledger.rs and BENCHMARKS.md; it is not part of this version.)

CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 10, 2 $$;

-- ---------------------------------------------------------------------------
-- Internal functions: the arithmetic (the caller's rights, no grants)
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.fixed_window_book(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql
AS $$
-- FIXED WINDOW BOOKING: p_n permits of key p_key of the fixed window
-- p_limiter, in the first window of the key's grid (windows of p_window
-- back to back from the key's first check) that has room for them and opens
-- within p_max_wait of the database's clock, read after the key's row lock.
-- The arguments are checked by the caller (fixed_window, fixed_window_reserve).
-- Returns one row:
--   o_allowed   true: booked; false: the first window with room opens after
--               p_max_wait, and nothing is booked
--   o_wait_us   microseconds from the decision until the booked window
--               opens (0: the current window, at once); refused, until the
--               window with room would have opened
--   o_remaining the permits left in the window containing now (0 while a
--               later window has bookings)
--
-- The row: stamp, the start of the latest window with bookings (in the
-- past: the current window or an ended one; in the future: a window booked
-- ahead); hits, the permits booked in it. Every window before stamp's is
-- closed: nothing is booked in it any more.
-- Invariant: at most p_limit permits are admitted in any one window of the
-- key's grid, counting each booking in the window it was booked in, where it
-- is admitted (at the later of the decision and the window's start, both
-- within that window). A booking goes only into stamp's window (if it has
-- room and has not ended) or the one after it (which is empty: p_n <=
-- p_limit fits), so the count of every window is the sum of the hits it was
-- given, each time checked against p_limit under the row lock.
-- Meets:
--   * plain checks (fixed_window, a booking with p_max_wait 0) and other
--     bookings of the key: they queue on the key's row lock and each sees
--     the row the one before left; while stamp is in the future a plain
--     check is refused (it could only be admitted in a closed window);
--   * the key's first use by anyone: a concurrent insert of the row makes
--     our insert do nothing, and the loop's next SELECT waits for it;
--   * prune_rate_limits: it deletes only a row at rest (idle_at, the end of
--     stamp's window, booked ones included) and skips a row we hold; a row it
--     deleted before our lock is gone, and our booking starts a new grid at
--     now, in which nothing was admitted yet;
--   * a caller that abandons a booking (its process stops waiting): the
--     permits stay booked, so the window admits less, never more.
DECLARE
    v_hits  bigint;
    v_start timestamptz;
    v_now   timestamptz;
    v_found boolean;
    v_at    timestamptz;
BEGIN
    LOOP
        -- 1. The key's row, locked; then the clock.
        SELECT r.hits, r.stamp INTO v_hits, v_start
          FROM pgsemaphore.rate_limits r
         WHERE r.kind = 'fixed_window' AND r.limiter = p_limiter AND r.key = p_key
           FOR UPDATE;
        v_found := FOUND;
        v_now := clock_timestamp();
        -- 2. The window to book in: stamp's, rolled forward to the window
        -- containing now once stamp's has ended.
        IF NOT v_found THEN
            v_hits := 0;
            v_start := v_now;
        ELSIF v_now >= v_start + p_window THEN
            v_start := date_bin(p_window, v_now, v_start);
            v_hits := 0;
        END IF;
        -- 3. Decide: stamp's window if it has room, else the next (empty)
        -- one; admitted when that window opens (now, if it is open).
        IF v_hits <= p_limit - p_n THEN  -- (no sum that could overflow)
            v_at := greatest(v_now, v_start);
        ELSE
            v_at := v_start + p_window;
        END IF;
        o_wait_us := ceil(extract(epoch FROM v_at - v_now) * 1e6)::bigint;
        o_allowed := v_at - v_now <= p_max_wait;
        IF o_allowed THEN
            IF v_at >= v_start + p_window THEN
                v_start := v_start + p_window;
                v_hits := 0;
            END IF;
            v_hits := v_hits + p_n;
        END IF;
        o_remaining := CASE WHEN v_start > v_now THEN 0 ELSE greatest(0, p_limit - v_hits) END;
        -- 4. Write the row back (refused: only the roll forward).
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
        -- A concurrent first use inserted the row: the next SELECT waits for it.
    END LOOP;
END;
$$;

CREATE FUNCTION pgsemaphore.sliding_window_book(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql
AS $$
-- SLIDING WINDOW BOOKING: p_n permits of key p_key of the sliding window
-- p_limiter (a weighted previous + current window, as before: the permits of
-- the last p_window are estimated as previous_hits x (1 - elapsed / p_window)
-- + hits, elapsed counted from the start of the current window of the key's
-- grid), admitted at the earliest instant at or after the database's clock
-- (read after the key's row lock) when the estimate plus p_n is within
-- p_limit, provided that instant is within p_max_wait.
-- The arguments are checked by the caller (sliding_window, sliding_window_reserve).
-- Returns one row:
--   o_allowed   true: booked; false: the instant is after p_max_wait, and
--               nothing is booked
--   o_wait_us   microseconds from the decision until that instant (0: at
--               once); refused, until it would have been
--   o_remaining the permits left now, the floor of p_limit - estimate (0
--               while a later window has bookings)
--
-- The row: stamp, the start of the latest window with bookings (past or
-- future); hits, the permits booked in it; previous_hits, those of the window
-- before it. Every window before stamp's is closed.
-- Invariant: at every admission instant t of a booking in window W,
-- previous(W) x (1 - elapsed(t)) + (the permits of W admitted at or before t)
-- <= p_limit; and at most p_limit permits are booked in one window of the
-- grid. Of the bookings of W admitted by t, the one booked last saw all the
-- others in hits (they were booked before it) and checked the estimate at its
-- own instant, no later than t; the weight of previous(W) only falls with
-- time, so the estimate at t is no higher. previous(W) is final when W gets
-- its first booking: bookings go only into stamp's window or later ones.
-- A booking goes into stamp's window, or else the next (previous := hits),
-- or else the one after (previous := 0), where it always fits.
-- Meets:
--   * plain checks (sliding_window, a booking with p_max_wait 0) and other
--     bookings of the key: they queue on the key's row lock and each sees
--     the row the one before left; while stamp is in the future, a plain
--     check is refused (its instant is at stamp or later);
--   * the key's first use by anyone: a concurrent insert of the row makes
--     our insert do nothing, and the loop's next SELECT waits for it;
--   * prune_rate_limits: it deletes only a row at rest (idle_at, the end of
--     the window after stamp's) and skips a row we hold; a row it deleted
--     before our lock is gone, and our booking starts a new grid at now
--     with both windows empty, which is what they were;
--   * a caller that abandons a booking (its process stops waiting): the
--     permits stay booked, so the key admits less, never more.
DECLARE
    v_hits     bigint;
    v_previous bigint;
    v_start    timestamptz;
    v_now      timestamptz;
    v_found    boolean;
    v_window   double precision := extract(epoch FROM p_window)::double precision;
    v_elapsed  double precision;
    v_need     double precision;
    v_b_start  timestamptz;
    v_b_hits   bigint;
    v_b_prev   bigint;
    v_wait     double precision;
BEGIN
    LOOP
        -- 1. The key's row, locked; then the clock.
        SELECT r.hits, r.previous_hits, r.stamp INTO v_hits, v_previous, v_start
          FROM pgsemaphore.rate_limits r
         WHERE r.kind = 'sliding_window' AND r.limiter = p_limiter AND r.key = p_key
           FOR UPDATE;
        v_found := FOUND;
        v_now := clock_timestamp();
        -- 2. Roll stamp's window forward to the one containing now, once
        -- stamp's has ended.
        IF NOT v_found THEN
            v_hits := 0;
            v_previous := 0;
            v_start := v_now;
        ELSIF v_now >= v_start + 2 * p_window THEN
            v_start := date_bin(p_window, v_now, v_start);
            v_previous := 0;
            v_hits := 0;
        ELSIF v_now >= v_start + p_window THEN
            v_start := v_start + p_window;
            v_previous := v_hits;
            v_hits := 0;
        END IF;
        -- 3. The earliest instant, window by window from stamp's: the
        -- elapsed fraction it needs (previous x (1 - e) + hits + p_n <=
        -- p_limit), no earlier than now; a window where it is 1 or more
        -- has no room.
        v_b_start := v_start;
        v_b_hits := v_hits;
        v_b_prev := v_previous;
        FOR i IN 1..3 LOOP
            v_elapsed := greatest(0, extract(epoch FROM v_now - v_b_start)::double precision / v_window);
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
        -- Seconds from now until that instant: the window's start plus the
        -- fraction it needs (none when it is open and has room now), rounded
        -- up to the microsecond, never early.
        IF v_need <= v_elapsed THEN
            o_wait_us := ceil(greatest(0, extract(epoch FROM v_b_start - v_now)::double precision) * 1e6)::bigint;
        ELSE
            v_wait := extract(epoch FROM v_b_start - v_now)::double precision + v_need * v_window;
            o_wait_us := greatest(1, ceil(v_wait * 1e6))::bigint;
        END IF;
        o_allowed := o_wait_us <= extract(epoch FROM p_max_wait) * 1e6;
        IF o_allowed THEN
            v_start := v_b_start;
            v_previous := v_b_prev;
            v_hits := v_b_hits + p_n;
        END IF;
        IF v_start > v_now THEN
            o_remaining := 0;
        ELSE
            v_elapsed := least(1, greatest(0, extract(epoch FROM v_now - v_start)::double precision / v_window));
            o_remaining := greatest(0, floor(p_limit - (v_previous * (1 - v_elapsed) + v_hits)))::bigint;
        END IF;
        -- 4. Write the row back (refused: only the roll forward).
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
        -- A concurrent first use inserted the row: the next SELECT waits for it.
    END LOOP;
END;
$$;

-- The plain checks' arithmetic: a booking that may not wait. Admitted only
-- in the window open now with room now; refused, the retry-after is the
-- wait a booking would get (as before when nothing is booked ahead: the end
-- of the window for a fixed window, the instant enough has slid out for a
-- sliding one). Their arguments and results are unchanged; nothing calls
-- them any more (the checked functions below call the booking directly),
-- they stay for whatever an operator built on them.
CREATE OR REPLACE FUNCTION pgsemaphore.fixed_window_unchecked(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE sql
AS $$
    SELECT b.o_allowed, b.o_remaining, CASE WHEN b.o_allowed THEN 0 ELSE b.o_wait_us END
      FROM pgsemaphore.fixed_window_book(p_limiter, p_key, p_limit, p_window, p_n, interval '0') b
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.sliding_window_unchecked(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE sql
AS $$
    SELECT b.o_allowed, b.o_remaining, CASE WHEN b.o_allowed THEN 0 ELSE b.o_wait_us END
      FROM pgsemaphore.sliding_window_book(p_limiter, p_key, p_limit, p_window, p_n, interval '0') b
$$;

-- The plain checks themselves call the booking directly (one function call
-- less per check than through *_unchecked); their arguments, checks,
-- results and grants are unchanged.
CREATE OR REPLACE FUNCTION pgsemaphore.fixed_window(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- FIXED WINDOW, per key: a booking that may not wait, see
-- pgsemaphore.fixed_window_book for the arithmetic and its invariant.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_limit at least
--   1; p_window 1 ms..366 days; p_n 1 to p_limit
-- Since version 9: p_limit and p_window are defaults, the stored pair (key,
-- else limiter) applies instead, and a pause refuses, as in token_bucket
-- (migrations/20261129000003_pgsemaphore_limiter_settings.sql: the
-- settings are read by their own statement before the key's row is
-- locked, and the whole pair read applies).
DECLARE
    v record;
BEGIN
    PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    -- The limits in force (version 9): the pair stored for the key, else
    -- for the limiter, else the caller's; a pause refuses, nothing booked.
    SELECT * INTO v FROM pgsemaphore.rate_limit_stored('fixed_window', p_limiter, p_key);
    IF v.o_paused_until > clock_timestamp() THEN
        RETURN QUERY SELECT false, 0::bigint, pgsemaphore.us_until(v.o_paused_until);
        RETURN;
    END IF;
    IF v.o_limit IS NOT NULL THEN
        PERFORM pgsemaphore.check_n_stored(p_n, v.o_limit);
        p_limit := v.o_limit;
        p_window := v.o_window;
    END IF;
    RETURN QUERY
        SELECT b.o_allowed, b.o_remaining, CASE WHEN b.o_allowed THEN 0::bigint ELSE b.o_wait_us END
          FROM pgsemaphore.fixed_window_book(p_limiter, p_key, p_limit, p_window, p_n, interval '0') b;
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.sliding_window(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- SLIDING WINDOW, per key: a booking that may not wait, see
-- pgsemaphore.sliding_window_book for the arithmetic and its invariant.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_limit at least
--   1; p_window 1 ms..366 days; p_n 1 to p_limit
-- Since version 9: p_limit and p_window are defaults, the stored pair (key,
-- else limiter) applies instead, and a pause refuses, as in token_bucket
-- (migrations/20261129000003_pgsemaphore_limiter_settings.sql: the
-- settings are read by their own statement before the key's row is
-- locked, and the whole pair read applies).
DECLARE
    v record;
BEGIN
    PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    -- The limits in force (version 9): the pair stored for the key, else
    -- for the limiter, else the caller's; a pause refuses, nothing booked.
    SELECT * INTO v FROM pgsemaphore.rate_limit_stored('sliding_window', p_limiter, p_key);
    IF v.o_paused_until > clock_timestamp() THEN
        RETURN QUERY SELECT false, 0::bigint, pgsemaphore.us_until(v.o_paused_until);
        RETURN;
    END IF;
    IF v.o_limit IS NOT NULL THEN
        PERFORM pgsemaphore.check_n_stored(p_n, v.o_limit);
        p_limit := v.o_limit;
        p_window := v.o_window;
    END IF;
    RETURN QUERY
        SELECT b.o_allowed, b.o_remaining, CASE WHEN b.o_allowed THEN 0::bigint ELSE b.o_wait_us END
          FROM pgsemaphore.sliding_window_book(p_limiter, p_key, p_limit, p_window, p_n, interval '0') b;
END;
$$;

-- ---------------------------------------------------------------------------
-- Application functions
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.fixed_window_reserve(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- FIXED WINDOW RESERVATION: books p_n permits of key p_key in the first
-- window of the key's grid with room for them, if it opens within
-- p_max_wait; the caller waits o_wait_us, then acts. The invariant, the
-- transactions it meets and the steps: pgsemaphore.fixed_window_book.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_limit at least
--   1; p_window 1 ms..366 days; p_n 1 to p_limit (as fixed_window);
--   p_max_wait 0 to 366 days, not NULL
-- Every bad argument raises 22023 naming it in COLUMN.
-- Returns one row: o_allowed (false: nothing booked), o_wait_us (until the
-- booked window opens; refused, until the window with room would have),
-- o_remaining (the permits left in the window open now).
-- As the plain check, the limits stored in pgsemaphore.rate_limit_settings
-- (key, else limiter) apply instead of p_limit and p_window; while the key
-- or the limiter is paused the booking is refused, nothing booked, with
-- o_wait_us the time until the pause ends and o_remaining 0 (a refusal
-- with o_wait_us within p_max_wait is a pause: call again when it ends).
DECLARE
    v record;
BEGIN
    PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    PERFORM pgsemaphore.checked_interval(p_max_wait, 'p_max_wait', interval '0', interval '366 days');
    -- The limits in force (version 9): the pair stored for the key, else
    -- for the limiter, else the caller's; a pause refuses, nothing booked.
    SELECT * INTO v FROM pgsemaphore.rate_limit_stored('fixed_window', p_limiter, p_key);
    IF v.o_paused_until > clock_timestamp() THEN
        o_allowed := false;
        o_wait_us := pgsemaphore.us_until(v.o_paused_until);
        o_remaining := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    IF v.o_limit IS NOT NULL THEN
        PERFORM pgsemaphore.check_n_stored(p_n, v.o_limit);
        p_limit := v.o_limit;
        p_window := v.o_window;
    END IF;
    RETURN QUERY SELECT * FROM pgsemaphore.fixed_window_book(p_limiter, p_key, p_limit, p_window, p_n, p_max_wait);
END;
$$;

CREATE FUNCTION pgsemaphore.sliding_window_reserve(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- SLIDING WINDOW RESERVATION: books p_n permits of key p_key at the earliest
-- instant the weighted estimate admits them, if that is within p_max_wait;
-- the caller waits o_wait_us, then acts. The invariant, the transactions it
-- meets and the steps: pgsemaphore.sliding_window_book.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_limit at least
--   1; p_window 1 ms..366 days; p_n 1 to p_limit (as sliding_window);
--   p_max_wait 0 to 366 days, not NULL
-- Every bad argument raises 22023 naming it in COLUMN.
-- Returns one row: o_allowed (false: nothing booked), o_wait_us (until the
-- booked instant; refused, until it would have been), o_remaining (the
-- permits left now).
-- As the plain check, the limits stored in pgsemaphore.rate_limit_settings
-- (key, else limiter) apply instead of p_limit and p_window; while the key
-- or the limiter is paused the booking is refused, nothing booked, with
-- o_wait_us the time until the pause ends and o_remaining 0 (a refusal
-- with o_wait_us within p_max_wait is a pause: call again when it ends).
DECLARE
    v record;
BEGIN
    PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    PERFORM pgsemaphore.checked_interval(p_max_wait, 'p_max_wait', interval '0', interval '366 days');
    -- The limits in force (version 9): the pair stored for the key, else
    -- for the limiter, else the caller's; a pause refuses, nothing booked.
    SELECT * INTO v FROM pgsemaphore.rate_limit_stored('sliding_window', p_limiter, p_key);
    IF v.o_paused_until > clock_timestamp() THEN
        o_allowed := false;
        o_wait_us := pgsemaphore.us_until(v.o_paused_until);
        o_remaining := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    IF v.o_limit IS NOT NULL THEN
        PERFORM pgsemaphore.check_n_stored(p_n, v.o_limit);
        p_limit := v.o_limit;
        p_window := v.o_window;
    END IF;
    RETURN QUERY SELECT * FROM pgsemaphore.sliding_window_book(p_limiter, p_key, p_limit, p_window, p_n, p_max_wait);
END;
$$;

-- ---------------------------------------------------------------------------
-- Privileges: nobody but the owner runs anything until granted; whoever may
-- run fixed_window (an application role granted as the README says) may
-- reserve in either window, so an upgrade asks for no new grants. The
-- internal functions (*_book) are granted to nobody.
-- ---------------------------------------------------------------------------

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
DO $$
DECLARE
    r record;
    f text;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS grantee, a.is_grantable
          FROM pg_proc p
         CROSS JOIN LATERAL aclexplode(p.proacl) a
         WHERE p.oid = 'pgsemaphore.fixed_window(text, text, bigint, interval, bigint)'::regprocedure
           AND a.privilege_type = 'EXECUTE'
           AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        FOREACH f IN ARRAY ARRAY['fixed_window_reserve', 'sliding_window_reserve'] LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION pgsemaphore.%I(text, text, bigint, interval, bigint, interval) TO %s%s',
                           f, r.grantee, CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
    END LOOP;
END;
$$;
