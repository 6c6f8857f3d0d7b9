-- pg-semaphore's schema, version 1 (the 0.1 baseline), part 6 of 7: rate
-- limits (a token bucket, a fixed window, a sliding window, and several
-- limits in one atomic check), with their stored limits and pauses.
--
-- Storage. pgsemaphore.rate_ledger holds a key's states as rows numbered by
-- seq; the newest (highest seq) is the key's state. An admitted check
-- INSERTs the new state as seq + 1; a refused one writes nothing (its
-- refill or roll forward is recomputed from the same row by the next check,
-- with the same result). A check reads the newest row with a backward scan
-- of the primary key, which meets the live newest entry first: no dead
-- version is on its path, however long another transaction holds the xmin
-- horizon back (a long query, pg_dump, a replica's hot_standby_feedback).
--   * The checks of one key are serialised by a transaction-level advisory
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
--     there, before it takes anything. A single key's plain check tries the
--     lock; when another transaction holds it, the check decides first on
--     the newest committed row: refused there, it is refused (a key's state
--     only ever admits less as admissions are added) without waiting, and
--     only a check that may admit waits for the lock and decides again.
--   * Old rows go in batches: the admission that writes a seq divisible by
--     16 deletes the key's rows 16 to 32 behind it (the range, not "all
--     older": under a held horizon the older ones are deleted but not yet
--     removed, and a scan of "all older" would visit every one of them). A
--     key keeps at most 32 rows whatever its traffic; prune_rate_limits
--     deletes the rest of every key it scans, and keys at rest entirely (it
--     takes no lock: it deletes only up to the newest row it read).
--   * Every check, reservation and check_limits runs on one engine
--     (rate_take, and rate_take_all for several limits), with the
--     arithmetic in pure functions (bucket_step, fixed_step, sliding_step).
--     check_limits locks the keys in one statement, reads their rows in one,
--     decides, and inserts every new state in one statement only when all
--     admit.
--   * Waiting: a reservation (token_bucket_reserve, fixed_window_reserve,
--     sliding_window_reserve, check_limits_reserve) takes the permits now,
--     even those not yet refilled or in a later window, and answers how long
--     the caller must wait before it may act, so each admission costs one
--     round trip and waiters are admitted in the order they reserved.
--
-- Limits belong to the database, never to one caller.
--   * Limits are stored in pairs (pgsemaphore.rate_limit_settings),
--     validated as the checks validate passed ones: a token bucket's rate
--     and burst together, a window's permit limit and window together. The
--     pair in force is the key's row's if it has one, else the limiter's
--     row's (key ''); pairs are never mixed, so every combination in force
--     was validated whole.
--   * A check that finds no stored pair in force stores its caller's pair
--     as the limiter's (rate_limit_first_use, under the functions' owner:
--     INSERT ... ON CONFLICT, then a re-read, so two racing first uses
--     decide under the same pair); from then on every check, whatever it
--     passes, is decided under the stored pair, which only the operator
--     changes (set_rate_limit, clear_rate_limit, per limiter or per key). A
--     deploy that changes limits in code must store them (set_rate_limit,
--     or the CLI's `pg-semaphore limits set`); the crate warns once per
--     limiter and process when its pair differs from the stored one. After
--     clear_rate_limit of a limiter, its next check is a first use again.
--   * A stored limit applies from each key's next check, to the key's
--     existing state: a lowered burst caps the stored tokens at the next
--     refill (least(burst, ...)), a raised rate refills the time since the
--     key's last check at the new rate, a window's new limit counts the
--     permits already granted in the current window, and a new window
--     length starts from the key's current window start.
--   * A check asking for more permits than the limit in force (p_n above the
--     stored burst or permit limit) could never be admitted: it raises 22023
--     naming p_n.
--   * A reservation books no further ahead than the limits in force allow:
--     p_max_wait is clamped to burst / rate (a bucket) or one window (a
--     window; for several limits, the least of theirs), never refused, so
--     callers passing a longer wait (up to 366 days) keep working and are
--     refused with the instant when it lies beyond. A bucket's level
--     therefore never goes below -burst, and the refill clamps it there
--     (a deeper level can only come from an operator lowering the pair
--     under bookings of the old one): every wait stays within 2 x 366 days
--     and no arithmetic on a key overflows. A window's permit limit is at
--     most 1e15, as a bucket's burst (check_window; the p_n casts and the
--     remaining counts stay exact).
--   * Every wait is bounded: each rate check, reservation, check_limits
--     (_reserve), and the settings functions (set_rate_limit,
--     clear_rate_limit, pause_rate_limit, resume_rate_limit) run with SET
--     lock_timeout = '2s', as the semaphore functions: a key's advisory lock
--     held by a check left in an open transaction, or by any role (PUBLIC
--     may call pg_advisory_lock on the documented key), a settings row held
--     by an open pause or first use, answer 55P03 after 2 s (the crate's
--     Error::Stalled; waiting acquires retry within their deadline).
--   * Pauses: the application sees the upstream's 429, so
--     pause_rate_limit is an application function. It only ever extends a
--     pause (greatest of the stored end and now + p_for; never shortens one
--     set by another process) and p_for is 1 ms to 1 hour, so a hostile
--     caller can hold a limiter back by at most an hour past its last call,
--     which it could as well by not calling. Only the operator shortens or
--     ends one (resume_rate_limit). A key is paused while its own pause or
--     its limiter's (key '') runs; a paused check is refused with
--     o_remaining 0 and o_retry_after_us until the pause ends, and takes
--     nothing. Pause-only rows whose pause has ended are deleted by the next
--     pause of the same limiter (100 at a time) or by the operator.
--   * Wake-ups: set_rate_limit, clear_rate_limit and resume_rate_limit send
--     NOTIFY on channel 'pgsemaphore_rate' with payload kind || '/' || limiter
--     at their commit. Waiting acquires re-read the limits in force when they
--     get one (rate_limit_in_force): a hint backed by a re-check, never a
--     correctness device (any role may NOTIFY any channel). They are rare
--     operator actions, so the instance-wide serialisation of notifying
--     commits costs nothing; pauses notify nobody (a pause only lengthens
--     waits).

-- ---------------------------------------------------------------------------
-- Internal helpers (not granted to anyone)
-- ---------------------------------------------------------------------------

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

-- A token bucket's pair, checked as token_bucket checks passed ones.
CREATE FUNCTION pgsemaphore.check_bucket(p_rate double precision, p_burst double precision)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_rate IS NULL OR NOT (p_rate > 0 AND p_rate <= 1e9) THEN
        PERFORM pgsemaphore.refuse('p_rate', format('above 0 and at most 1e9, got %s', coalesce(p_rate::text, 'NULL')));
    END IF;
    IF p_burst IS NULL OR NOT (p_burst >= 1 AND p_burst <= 1e15) OR p_burst / p_rate > 366 * 86400 THEN
        PERFORM pgsemaphore.refuse('p_burst',
            format('1 to 1e15, refilled within 366 days at the rate, got %s', coalesce(p_burst::text, 'NULL')));
    END IF;
END;
$$;

-- p_n against the limit in force when it is a stored one.
CREATE FUNCTION pgsemaphore.check_n_stored(p_n double precision, p_limit double precision)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_n > p_limit THEN
        PERFORM pgsemaphore.refuse('p_n',
            format('%s is above the stored limit in force (%s): it could never be admitted', p_n, p_limit));
    END IF;
END;
$$;

-- The stored arguments' shared checks: a kind, a limiter, and a key that may
-- be NULL (the whole limiter).
CREATE FUNCTION pgsemaphore.check_setting_target(p_kind text, p_limiter text, p_key text)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_kind IS NULL OR p_kind NOT IN ('token_bucket', 'fixed_window', 'sliding_window') THEN
        PERFORM pgsemaphore.refuse('p_kind',
            format('token_bucket, fixed_window or sliding_window, got %s', coalesce(quote_literal(left(p_kind, 50)), 'NULL')));
    END IF;
    PERFORM pgsemaphore.checked_text(p_limiter, 'p_limiter', 200);
    IF p_key IS NOT NULL THEN
        PERFORM pgsemaphore.checked_text(p_key, 'p_key', 256);
    END IF;
END;
$$;

-- The arguments of several limits at once (check_limits,
-- check_limits_reserve): the arrays' shapes, then each element as its
-- kind's own function checks it (22023 naming p_rate, p_burst, p_limit,
-- p_window or p_n, as that function does), no key twice.
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

-- The microseconds until p_until, from the clock now (at least 1).
CREATE FUNCTION pgsemaphore.us_until(p_until timestamptz)
RETURNS bigint
LANGUAGE sql VOLATILE
AS $$ SELECT greatest(1, ceil(extract(epoch FROM p_until - clock_timestamp()) * 1e6))::bigint $$;

-- What the limits in force for a key are: the key's stored pair, else the
-- limiter's, else NULL (the caller's own); and the later of the two pauses.
-- One index range scan of at most two rows. PL/pgSQL, not SQL: a SQL
-- function that is not inlined is planned again at every call (about a
-- third of a check's time, measured), a PL/pgSQL one keeps its plan for the
-- session.
CREATE FUNCTION pgsemaphore.rate_limit_stored(p_kind text, p_limiter text, p_key text,
    OUT o_rate double precision, OUT o_burst double precision,
    OUT o_limit bigint, OUT o_window interval, OUT o_paused_until timestamptz)
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    SELECT (array_agg(s.rate ORDER BY s.key = '') FILTER (WHERE s.rate IS NOT NULL))[1],
           (array_agg(s.burst ORDER BY s.key = '') FILTER (WHERE s.rate IS NOT NULL))[1],
           (array_agg(s.permit_limit ORDER BY s.key = '') FILTER (WHERE s.permit_limit IS NOT NULL))[1],
           (array_agg(s.window_length ORDER BY s.key = '') FILTER (WHERE s.permit_limit IS NOT NULL))[1],
           max(s.paused_until)
      INTO o_rate, o_burst, o_limit, o_window, o_paused_until
      FROM pgsemaphore.rate_limit_settings s
     WHERE s.kind = p_kind AND s.limiter = p_limiter AND s.key IN (p_key, '');
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
-- The engine
-- ---------------------------------------------------------------------------

-- The arithmetic: pure functions of a key's state, the clock and the limits
-- (no table, no grants). Each takes the state read (NULL when the key has
-- none: a full bucket, empty windows), the clock p_now, and p_from, the
-- earliest instant the caller may be admitted (p_now, but for a check of
-- several limits looking for an instant they all admit). Each returns
-- o_allowed (admitted at an instant within p_max_wait of p_now), o_wait_us
-- (microseconds from p_now to that instant; refused: to the instant it
-- would have been), o_remaining (what is left after the decision), and the
-- state to write when admitted. A plain check is a reservation or booking
-- that may not wait (p_max_wait 0). An instant later than p_now is booked
-- conservatively: the bucket holds the tokens back from every check before
-- that instant (it admits less before it, never more), a window closes the
-- windows before it. The decisions of one key are serialised (rate_take),
-- so each step sees the state the decision before it left.

-- What a step returns: the decision (o_allowed, o_wait_us, o_remaining) and
-- the key's state to write when admitted, in the ledger's columns (a token
-- bucket's o_tokens, a window's o_hits and o_previous; o_stamp is a bucket's
-- stamp or a window's start). A named type, not OUT parameters: a function
-- with OUT parameters builds its result's row type at every call, which
-- cost a check about a sixth of its time (measured); a named type's comes
-- from the type cache. rate_take returns it too.
CREATE TYPE pgsemaphore.rate_step AS (
    o_allowed   boolean,
    o_wait_us   bigint,
    o_remaining bigint,
    o_tokens    double precision,
    o_hits      bigint,
    o_previous  bigint,
    o_stamp     timestamptz,
    o_idle_at   timestamptz
);

-- Invariant (bucket_step): over any interval of length d, the admissions of
-- a key at their admitted instants (decision + o_wait_us), plain checks
-- included, take at most p_burst + p_rate x d tokens. The stored level is
-- the bucket's level once every reservation made so far has been paid: a
-- reservation takes p_n now and is admitted exactly when the level,
-- refilling, would have reached p_n again had it not taken them. So every
-- admission, plain or reserved, is admitted at an instant when a plain
-- bucket debited at those instants, in the order the key's lock served
-- them, would hold its tokens; and such a bucket never passes more than
-- p_burst + p_rate x d in d. A later decision is never admitted before an
-- earlier one: while tokens are owed, the level is below p_n until the last
-- reservation's instant. A caller that abandons a reservation leaves its
-- tokens taken: the key admits less, never more.
CREATE FUNCTION pgsemaphore.bucket_step(
    p_tokens double precision, p_stamp timestamptz, p_now timestamptz, p_from timestamptz,
    p_rate double precision, p_burst double precision, p_n double precision, p_max_wait interval)
RETURNS pgsemaphore.rate_step
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_wait      double precision;
    o_allowed   boolean;
    o_wait_us   bigint;
    o_remaining bigint;
    o_tokens    double precision;
    o_stamp     timestamptz;
    o_idle_at   timestamptz;
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
        -- p_from = p_now this is the level minus p_n, as a plain bucket
        -- takes it; with a later p_from it holds back what that admission will
        -- spend from every check before it, so over any interval of length
        -- d the admissions, at their instants and in whatever order they
        -- were decided, take at most p_burst + p_rate x d.
        o_tokens := least(o_tokens, p_burst - p_rate * v_wait) - p_n;
    END IF;
    o_remaining := floor(o_tokens)::bigint;
    o_idle_at := o_stamp + make_interval(secs => (p_burst - o_tokens) / p_rate);
    RETURN ROW(o_allowed, o_wait_us, o_remaining, o_tokens, NULL, NULL, o_stamp, o_idle_at)::pgsemaphore.rate_step;
END;
$$;

-- Invariant (fixed_step): at most p_limit permits are admitted in any one
-- window of the key's grid, counting each booking in the window it was
-- booked in, where it is admitted (at the later of the decision and the
-- window's start, both within that window). A booking goes only into
-- stamp's window (if it has room and has not ended) or the one after it
-- (which is empty: p_n <= p_limit fits), so the count of every window is
-- the sum of the hits it was given, each time checked against p_limit.
CREATE FUNCTION pgsemaphore.fixed_step(
    p_hits bigint, p_start timestamptz, p_now timestamptz, p_from timestamptz,
    p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS pgsemaphore.rate_step
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    o_allowed   boolean;
    o_wait_us   bigint;
    o_remaining bigint;
    o_hits      bigint;
    o_start     timestamptz;
    o_idle_at   timestamptz;
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
    RETURN ROW(o_allowed, o_wait_us, o_remaining, NULL, o_hits, NULL, o_start, o_idle_at)::pgsemaphore.rate_step;
END;
$$;

-- Invariant (sliding_step): at every admission instant t of a booking in
-- window W, previous(W) x (1 - elapsed(t)) + (the permits of W admitted at
-- or before t) <= p_limit; and at most p_limit permits are booked in one
-- window of the grid. Of the bookings of W admitted by t, the one booked
-- last saw all the others in hits (they were booked before it) and checked
-- the estimate at its own instant, no later than t; the weight of
-- previous(W) only falls with time, so the estimate at t is no higher.
-- previous(W) is final when W gets its first booking: bookings go only into
-- stamp's window or later ones. A booking goes into stamp's window, or else
-- the next (previous := hits), or else the one after (previous := 0), where
-- it always fits.
CREATE FUNCTION pgsemaphore.sliding_step(
    p_hits bigint, p_previous bigint, p_start timestamptz, p_now timestamptz, p_from timestamptz,
    p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS pgsemaphore.rate_step
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    o_allowed   boolean;
    o_wait_us   bigint;
    o_remaining bigint;
    o_hits      bigint;
    o_previous  bigint;
    o_start     timestamptz;
    o_idle_at   timestamptz;
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
    RETURN ROW(o_allowed, o_wait_us, o_remaining, NULL, o_hits, o_previous, o_start, o_idle_at)::pgsemaphore.rate_step;
END;
$$;

-- Deletes the rows of a key with p_from <= seq < p_to, skipping any row
-- another transaction is deleting (a check's trim or a prune not yet
-- committed): nobody ever waits for it, and the row goes with that
-- transaction or with a later trim or prune. Never called with a range
-- that holds the key's newest row, unless that row is at rest (prune).
-- enable_seqscan off: the plan is kept for the session, and one made while
-- the ledger was a page or two (a new database, a new limiter's first
-- minutes) read the whole table twice, by sequential scans, at every trim.
-- While a transaction holds the xmin horizon, no deleted row can go, so
-- that cost grew with every admission, under the key's lock: in pgbench,
-- one key checked by 4 clients through 4 minutes of a held query fell from
-- 9,341 to 2,068 checks/s (15,062 sequential scans of the ledger).
-- Without sequential scans, the plan is the key's index range and a TID
-- scan of the rows found, whatever the statistics (tests/rate_limit.rs:
-- a_trim_never_scans_the_ledger). rate_take and rate_take_all run the same
-- way: an autoanalyze that found a few live rows, beside an index ten
-- times the table's size (after a vacuum), made their read of a key's
-- newest row a sequential scan and a sort of the whole table, at every
-- check, and with the horizon held that reads every dead row too. In a
-- bench run that plan appeared with the first autoanalyze (sequential
-- scans of the ledger from 1 to about 1,500/s, index scans stopped) as the
-- hot key fell to 0.22x of its rate (tests/rate_limit.rs:
-- no_check_scans_the_ledger).
CREATE FUNCTION pgsemaphore.rate_trim(p_kind text, p_limiter text, p_key text, p_from bigint, p_to bigint)
RETURNS void
LANGUAGE plpgsql  -- (not sql: its plan is kept for the session)
SET enable_seqscan = off
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

CREATE FUNCTION pgsemaphore.rate_take(
    p_kind text, p_limiter text, p_key text,
    p_rate double precision, p_burst double precision, p_limit bigint, p_window interval,
    p_n double precision, p_max_wait interval, p_stored boolean)
RETURNS pgsemaphore.rate_step
LANGUAGE plpgsql
SET enable_seqscan = off  -- (see rate_trim: no plan of the ledger is a sequential scan)
AS $$
-- ONE KEY: p_n permits of key p_key of limiter (p_kind, p_limiter), with the
-- kind's limits (p_rate, p_burst for a token bucket; p_limit, p_window for a
-- window), admitted at once or within p_max_wait; p_stored: the stored
-- limits and pauses apply (false only for the _unchecked functions). The
-- arguments were checked by the caller.
-- Steps:
--   1. READ COMMITTED, or 0A000;
--   2. one statement: the stored limits and pause (the pair in force when
--      the check began) and the key's advisory lock if it is free
--      (pg_try_advisory_xact_lock); a pause refuses, taking nothing; no
--      stored pair: the first use stores the caller's as the limiter's
--      (rate_limit_first_use); the stored pair replaces the caller's (p_n
--      above it: 22023); p_max_wait is clamped to what the pair allows
--      ahead: burst / rate, or one window;
--   3. a new statement, so a new snapshot: the key's newest row (none: a
--      full bucket, empty windows), and the kind's step function decides on
--      it, with the clock read now. With the lock, that row is the one its
--      previous holder committed: the decision is made;
--   4. without the lock (another transaction holds the key), a plain check
--      (a reservation waits for the lock before step 3) refused on that
--      row: that is the answer, and nothing was locked or written. A
--      refusal on a committed state is a refusal on every later one: a
--      key's state changes only by admissions (each takes tokens or counts
--      permits, at an instant no earlier than its decision) and by
--      deletions of rows at rest (the same as no row), so what a check can
--      take, and the earliest instant it can take it, only get less and
--      later. Admitted on it: the key's lock (waited for at most the
--      calling function's lock_timeout, 2 s, then 55P03), then step 3 again
--      with the lock;
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
--   * checks, reservations and multi-limit checks of the key: those that
--     may admit queue on the advisory lock (a multi-limit check holds it to
--     its end, as a caller's open transaction does); each reads the state
--     the one before left. A rolled-back holder's row was never committed:
--     the next one reads the row before it, so nothing was charged. A check
--     that finds the key held and is refused in step 4 waits for nobody and
--     holds nothing: a flood of refused checks of a busy key does not queue
--     on its lock (tests/isolation/specs/rate-refused-unlocked.spec: refused
--     while another holds the lock; admitted on a row a holder is about to
--     replace, then refused once its commit is read);
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
--     which PUBLIC may call): a check the key's committed state refuses is
--     answered at once; one it admits waits at most 2 s, then 55P03, having
--     taken nothing (tests/isolation/specs/rate-key-lock-held.spec);
--   * the trim of step 5 or prune_rate_limits deleting old rows: never the
--     newest, which is all a check reads; neither waits for the other
--     (rate_trim skips rows another transaction is deleting). Prune
--     deleting a key at rest deletes only up to the newest row it read, so
--     a check reads that row
--     (at rest) or none (a full bucket, empty windows: the same admissions),
--     and a row a check commits after prune's read stays, as the state;
--   * a stored limit's change or a pause committed after step 2's snapshot
--     (taken before the key's lock):
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
    v_locked boolean;
    -- The key's advisory lock: (1885828967, v_lock).
    v_lock   integer := hashtext(p_kind || '/' || p_limiter || '/' || p_key);
    d        pgsemaphore.rate_step;
BEGIN
    -- 1.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgsemaphore.refuse_isolation('a rate limiter check',
            'its snapshot could not see the previous check''s state');
    END IF;
    -- 2. One statement: the stored limits and pause, and the key's lock if
    -- it is free (two primary-key lookups; a try, never a wait).
    SELECT CASE WHEN k.rate IS NOT NULL THEN k.rate ELSE l.rate END,
           CASE WHEN k.rate IS NOT NULL THEN k.burst ELSE l.burst END,
           CASE WHEN k.permit_limit IS NOT NULL THEN k.permit_limit ELSE l.permit_limit END,
           CASE WHEN k.permit_limit IS NOT NULL THEN k.window_length ELSE l.window_length END,
           greatest(k.paused_until, l.paused_until),
           pg_try_advisory_xact_lock(1885828967, v_lock)
      INTO v_rate, v_burst, v_limit, v_window, v_paused, v_locked
      FROM (SELECT) AS one
      LEFT JOIN pgsemaphore.rate_limit_settings k
        ON p_stored AND k.kind = p_kind AND k.limiter = p_limiter AND k.key = p_key
      LEFT JOIN pgsemaphore.rate_limit_settings l
        ON p_stored AND l.kind = p_kind AND l.limiter = p_limiter AND l.key = '';
    IF v_paused > clock_timestamp() THEN
        RETURN ROW(false, pgsemaphore.us_until(v_paused), 0, NULL, NULL, NULL, NULL, NULL)::pgsemaphore.rate_step;
    END IF;
    -- 2b. No pair in force: the first use stores the caller's as the
    -- limiter's (or finds the one a concurrent first use stored), holding
    -- the key's lock, so that every check takes the key's lock before a
    -- settings row (a first use without it could wait for another's row
    -- while that one waits for this key: a deadlock, seen in tests).
    IF p_stored AND (CASE WHEN p_kind = 'token_bucket' THEN v_rate IS NULL ELSE v_limit IS NULL END) THEN
        IF NOT v_locked THEN
            PERFORM pg_advisory_xact_lock(1885828967, v_lock);
            v_locked := true;
        END IF;
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
    -- 3. and 4. A new statement, so a new snapshot: the key's newest row,
    -- and the step on it with the clock read now. With the lock, that is
    -- the row the previous holder committed, and the decision. Without it
    -- (another transaction holds the key), a plain check decides on the
    -- committed row: a refusal is final, with nothing locked or written; an
    -- admission waits for the lock (the next round), then reads and decides
    -- again. A reservation waits for the lock first: its refusal near the
    -- booking bound could be an admission a moment later, which its waiter
    -- would pay for with another round trip.
    LOOP
        IF NOT v_locked AND (p_max_wait > interval '0' OR coalesce(d.o_allowed, false)) THEN
            PERFORM pg_advisory_xact_lock(1885828967, v_lock);
            v_locked := true;
        END IF;
        SELECT l.seq, l.tokens, l.hits, l.previous_hits, l.stamp
          INTO v_seq, v_tokens, v_hits, v_prev, v_stamp
          FROM pgsemaphore.rate_ledger l
         WHERE l.kind = p_kind AND l.limiter = p_limiter AND l.key = p_key
         ORDER BY l.seq DESC
         LIMIT 1;
        v_now := clock_timestamp();
        IF p_kind = 'token_bucket' THEN
            d := pgsemaphore.bucket_step(v_tokens, v_stamp, v_now, v_now, p_rate, p_burst, p_n, p_max_wait);
        ELSIF p_kind = 'fixed_window' THEN
            d := pgsemaphore.fixed_step(v_hits, v_stamp, v_now, v_now, p_limit, p_window, p_n::bigint, p_max_wait);
        ELSE
            d := pgsemaphore.sliding_step(v_hits, v_prev, v_stamp, v_now, v_now, p_limit, p_window, p_n::bigint,
                                          p_max_wait);
        END IF;
        EXIT WHEN v_locked OR NOT d.o_allowed;
    END LOOP;
    v_seq := coalesce(v_seq, 0) + 1;
    IF d.o_allowed THEN
        INSERT INTO pgsemaphore.rate_ledger (kind, limiter, key, seq, tokens, hits, previous_hits, stamp, idle_at)
        VALUES (p_kind, p_limiter, p_key, v_seq, d.o_tokens, d.o_hits, d.o_previous, d.o_stamp, d.o_idle_at);
        -- The trim: every 16th row of a key.
        IF v_seq % 16 = 0 THEN
            PERFORM pgsemaphore.rate_trim(p_kind, p_limiter, p_key, v_seq - 32, v_seq - 16);
        END IF;
    END IF;
    RETURN d;
END;
$$;

CREATE FUNCTION pgsemaphore.rate_take_all(
    p_kinds text[], p_limiters text[], p_keys text[],
    p_rates double precision[], p_bursts double precision[],
    p_limits bigint[], p_windows interval[], p_n bigint, p_max_wait interval, p_order integer[])
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint, o_deciding integer)
LANGUAGE plpgsql
SET enable_seqscan = off  -- (see rate_trim)
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
--   2. one statement: each limit's stored limits and pause, and the keys
--      in the order of their locks' hash (the same order for every caller);
--      then a try of each key's lock in that order, stopping at the first
--      another transaction holds; any pause refuses, taking nothing; a limit
--      with no pair in force first takes every lock (below);
--   3. one statement: every key's newest row (a new snapshot);
--   4. the step functions decide at an instant t: from the clock, t moves to
--      the latest instant any limit needs, and the limits decide again from
--      there, until all admit at t (at most 8 rounds; each round only moves
--      t later, and a bucket or a fixed window that admits at t admits at
--      any later instant, so only a sliding window's previous window can
--      make a round more);
--   4b. a plain check (p_max_wait 0) without every lock decided on the
--      committed rows: refused, that is the answer (a refusal on a key's
--      committed state is final, as in rate_take: step 4 there), with
--      nothing written; admitted, the locks not yet held, waited for in
--      hash order, then steps 3 and 4 again with them. A reservation, and a
--      limit's first use, wait for every lock before step 3;
--   5. admitted: every new state in one INSERT; refused: nothing written.
-- Invariant: each limit admits only what its own step admits on the state
-- the previous decision on its key left (as a single check would, at the
-- instant t), and a refused call writes nothing, so no limit counts a
-- refused call. The locks are taken in hash order, tries first, and a wait
-- only ever comes after every lock before it in that order was taken (the
-- tries stop at the first key held), so two of these never wait on each
-- other in a cycle; a single check holds one lock and cannot close a cycle
-- either.
-- Step 2 also stores, for every limit with no pair in force, the caller's
-- pair as its limiter's (as rate_take), and clamps p_max_wait to the least
-- of what the limits in force allow ahead (burst / rate, one window).
-- Meets: what rate_take meets, for every key (each lock waited for at most
-- 2 s, then 55P03: the whole call fails, nothing charged; a plain check
-- the committed rows refuse waits for no lock, as a single check:
-- tests/isolation/specs/limits-refused-unlocked.spec); a multi-limit check
-- holding some of our keys: it holds their locks, we wait in hash order.
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
    -- The keys' lock hashes, in lock order; the first not yet locked (past
    -- the end: every one); decided admitted without every lock.
    v_hashes  integer[];
    v_next    integer := 1;
    v_admit   boolean := false;
    r         record;
    u         record;
    b         record;
    f         record;
    w         record;
BEGIN
    -- 1.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgsemaphore.refuse_isolation('a rate limiter check',
            'its snapshot could not see the previous check''s state');
    END IF;
    -- 2. (A loop over the statement's rows, each put at its limit's index:
    -- no aggregate, whose sorts cost more than the rows.)
    FOR r IN
        SELECT o.i, o.h, st.rate, st.burst, st.lim, st.win, st.paused
          FROM (SELECT g.i, hashtext(p_kinds[g.i] || '/' || p_limiters[g.i] || '/' || p_keys[g.i]) AS h
                  FROM generate_subscripts(p_kinds, 1) AS g(i)
                OFFSET 0) AS o
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
         ORDER BY o.h
    LOOP
        v_hashes := v_hashes || r.h;
        v_srates[r.i] := r.rate;
        v_sbursts[r.i] := r.burst;
        v_slimits[r.i] := r.lim;
        v_swins[r.i] := r.win;
        v_paused[r.i] := r.paused;
    END LOOP;
    -- The tries, in hash order, up to the first key another transaction
    -- holds (a try never waits; a wait for a key after it would break the
    -- order).
    FOR v_i IN 1 .. v_count LOOP
        EXIT WHEN NOT pg_try_advisory_xact_lock(1885828967, v_hashes[v_i]);
        v_next := v_i + 1;
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
            -- rate_take, holding the keys' locks: every lock, in order).
            IF (CASE WHEN p_kinds[v_i] = 'token_bucket' THEN v_srates[v_i] IS NULL ELSE v_slimits[v_i] IS NULL END) THEN
                FOR v_j IN v_next .. v_count LOOP
                    PERFORM pg_advisory_xact_lock(1885828967, v_hashes[v_j]);
                END LOOP;
                v_next := v_count + 1;
                u := pgsemaphore.rate_limit_first_use(p_kinds[v_i], p_limiters[v_i], p_rates[v_i], p_bursts[v_i],
                                                      p_limits[v_i], p_windows[v_i]);
                v_srates[v_i] := u.o_rate;
                v_sbursts[v_i] := u.o_burst;
                v_slimits[v_i] := u.o_limit;
                v_swins[v_i] := u.o_window;
            END IF;
            IF p_kinds[v_i] = 'token_bucket' THEN
                IF v_srates[v_i] IS NOT NULL THEN
                    IF p_n > v_sbursts[v_i] THEN
                        PERFORM pgsemaphore.check_n_stored(p_n, v_sbursts[v_i]);
                    END IF;
                    p_rates[v_i] := v_srates[v_i];
                    p_bursts[v_i] := v_sbursts[v_i];
                END IF;
                v_bound := least(v_bound, make_interval(secs => p_bursts[v_i] / p_rates[v_i]));
            ELSE
                IF v_slimits[v_i] IS NOT NULL THEN
                    IF p_n > v_slimits[v_i] THEN
                        PERFORM pgsemaphore.check_n_stored(p_n, v_slimits[v_i]);
                    END IF;
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
    -- 3. and 4., and again with every lock when admitted without them (4b).
    LOOP
        IF v_next <= v_count AND (p_max_wait > interval '0' OR v_admit) THEN
            FOR v_j IN v_next .. v_count LOOP
                PERFORM pg_advisory_xact_lock(1885828967, v_hashes[v_j]);
            END LOOP;
            v_next := v_count + 1;
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
            -- In the canonical order (kind, limiter, key): ties decide the same
            -- whatever order the caller listed the limits in.
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
                    n_stamp[v_i] := f.o_stamp;
                    n_idle[v_i] := f.o_idle_at;
                ELSE
                    w := pgsemaphore.sliding_step(v_hits[v_i], v_prev[v_i], v_stamp[v_i], v_now, v_from,
                                                  p_limits[v_i], p_windows[v_i], p_n, p_max_wait);
                    v_ok := w.o_allowed;
                    v_wait := w.o_wait_us;
                    v_left := w.o_remaining;
                    n_hits[v_i] := w.o_hits;
                    n_prev[v_i] := w.o_previous;
                    n_stamp[v_i] := w.o_stamp;
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
        -- 4b. Admitted with every lock: the decision; without them, the
        -- locks and the decision again.
        EXIT WHEN v_next > v_count;
        v_admit := true;
        -- (Read again: a key with no row now reads as none.)
        v_seq := NULL;
        v_tokens := NULL;
        v_hits := NULL;
        v_prev := NULL;
        v_stamp := NULL;
    END LOOP;
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

-- ---------------------------------------------------------------------------
-- Application functions
-- ---------------------------------------------------------------------------

-- Each checks its arguments with plain expressions (a helper is called only
-- to raise) and calls the engine once.

CREATE FUNCTION pgsemaphore.token_bucket(
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
-- and pgsemaphore.bucket_step.
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

CREATE FUNCTION pgsemaphore.token_bucket_reserve(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision,
    p_n double precision, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- TOKEN BUCKET RESERVATION: p_n tokens taken now even if they
-- are not there yet, provided they will be within p_max_wait; the caller
-- waits o_wait_us, then acts: that instant is its admission. The invariant
-- (over any interval of length d, the admissions of a key at their admitted
-- instants, plain checks included, take at most p_burst + p_rate x d tokens):
-- pgsemaphore.bucket_step; the steps and what it meets: pgsemaphore.rate_take.
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
        SELECT t.o_allowed, t.o_wait_us, t.o_remaining
          FROM pgsemaphore.rate_take('token_bucket', p_limiter, p_key, p_rate, p_burst, NULL, NULL,
                                            p_n, p_max_wait, true) t;
END;
$$;

CREATE FUNCTION pgsemaphore.fixed_window(
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
-- pgsemaphore.fixed_step; the steps and what it meets: pgsemaphore.rate_take.
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

CREATE FUNCTION pgsemaphore.sliding_window(
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
-- arithmetic and its invariant: pgsemaphore.sliding_step; the steps and
-- what it meets: pgsemaphore.rate_take.
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

CREATE FUNCTION pgsemaphore.fixed_window_reserve(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- FIXED WINDOW RESERVATION: books p_n permits in the first
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
        SELECT t.o_allowed, t.o_wait_us, t.o_remaining
          FROM pgsemaphore.rate_take('fixed_window', p_limiter, p_key, NULL, NULL, p_limit, p_window,
                                            p_n, p_max_wait, true) t;
END;
$$;

CREATE FUNCTION pgsemaphore.sliding_window_reserve(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- SLIDING WINDOW RESERVATION: books p_n permits at the earliest
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
        SELECT t.o_allowed, t.o_wait_us, t.o_remaining
          FROM pgsemaphore.rate_take('sliding_window', p_limiter, p_key, NULL, NULL, p_limit, p_window,
                                            p_n, p_max_wait, true) t;
END;
$$;

CREATE FUNCTION pgsemaphore.check_limits(
    p_kinds text[], p_limiters text[], p_keys text[],
    p_rates double precision[], p_bursts double precision[],
    p_limits bigint[], p_windows interval[], p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint, o_deciding integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET lock_timeout = '2s'
AS $$
-- SEVERAL LIMITS IN ONE CHECK: p_n permits against limit i =
-- (p_kinds[i], p_limiters[i], p_keys[i]) for every i, admitted only if every
-- limit admits now, and then charged to every one; refused if any refuses,
-- and then charged to none. Each limit decides as its kind's check would
-- (stored limits and pauses apply). The steps, the invariant and what it
-- meets: pgsemaphore.rate_take_all (one statement reads the limits in
-- force, one reads the keys, one writes them; the keys' locks are tried,
-- then waited for only by a check that may admit).
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
-- SEVERAL LIMITS THAT WAIT: books p_n permits in every limit
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

CREATE FUNCTION pgsemaphore.pause_rate_limit(p_kind text, p_limiter text, p_key text, p_for interval)
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
-- PAUSE (waits at most lock_timeout, 2 s, for the row, then 55P03): refuses
-- every check (and reservation) of key p_key of limiter
-- (p_kind, p_limiter), or of all its keys when p_key is NULL, for p_for
-- from now, in every process; for an upstream that answered 429 with
-- Retry-After. Only ever extends the pause in force (never shortens one set
-- by another caller). Returns the instant the row's pause ends.
--   p_kind token_bucket, fixed_window or sliding_window; p_limiter
--   1..200 characters; p_key NULL or 1..256 characters; p_for 1 ms to 1 hour
-- Meets: a concurrent pause of the same row (the upsert serialises them and
-- keeps the later end); set/clear/resume_rate_limit (the same row lock; a
-- resume after us ends our pause, the operator's choice); checks (they read
-- the row in their own statement: one that read it before our commit is
-- not paused, which is the case of a check a moment earlier).
DECLARE
    v_until timestamptz;
BEGIN
    PERFORM pgsemaphore.check_setting_target(p_kind, p_limiter, p_key);
    PERFORM pgsemaphore.checked_interval(p_for, 'p_for', interval '1 ms', interval '1 hour');
    -- Pause-only rows whose pause ended: a few go each time.
    DELETE FROM pgsemaphore.rate_limit_settings s
     WHERE (s.kind, s.limiter, s.key) IN (
            SELECT d.kind, d.limiter, d.key
              FROM pgsemaphore.rate_limit_settings d
             WHERE d.kind = p_kind AND d.limiter = p_limiter
               AND d.rate IS NULL AND d.permit_limit IS NULL AND d.paused_until < now()
             LIMIT 100
               FOR UPDATE SKIP LOCKED);
    INSERT INTO pgsemaphore.rate_limit_settings AS s (kind, limiter, key, paused_until, updated_at)
    VALUES (p_kind, p_limiter, coalesce(p_key, ''), clock_timestamp() + p_for, now())
    ON CONFLICT (kind, limiter, key) DO UPDATE
       SET paused_until = greatest(s.paused_until, excluded.paused_until),
           updated_at = now()
    RETURNING s.paused_until INTO v_until;
    RETURN v_until;
END;
$$;

CREATE FUNCTION pgsemaphore.rate_limit_in_force(p_kind text, p_limiter text, p_key text)
RETURNS TABLE (o_rate double precision, o_burst double precision, o_limit bigint,
               o_window interval, o_paused_until timestamptz)
LANGUAGE plpgsql SECURITY DEFINER STABLE
SET search_path = pg_catalog, pg_temp
AS $$
-- What a check of key p_key (NULL: a key with no override of its own) of
-- limiter (p_kind, p_limiter) applies now from the stored settings: the
-- stored pair in force (NULLs: none is stored, the caller's own applies)
-- and the end of the pause in force (NULL or past: not paused). Reads only.
--   p_kind, p_limiter, p_key as pause_rate_limit
BEGIN
    PERFORM pgsemaphore.check_setting_target(p_kind, p_limiter, p_key);
    RETURN QUERY SELECT * FROM pgsemaphore.rate_limit_stored(p_kind, p_limiter, coalesce(p_key, ''));
END;
$$;

-- ---------------------------------------------------------------------------
-- The owner's unchecked forms (granted to nobody)
-- ---------------------------------------------------------------------------

-- The caller's limits, no stored ones, no pause, on the same engine: kept
-- for whatever an operator builds on them as the owner.

CREATE FUNCTION pgsemaphore.token_bucket_unchecked(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision, p_n double precision)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE sql
AS $$
    SELECT t.o_allowed, t.o_remaining, CASE WHEN t.o_allowed THEN 0::bigint ELSE t.o_wait_us END
      FROM pgsemaphore.rate_take('token_bucket', p_limiter, p_key, p_rate, p_burst, NULL, NULL,
                                 p_n, interval '0', false) t
$$;

-- The windows' bookings: the windows' arithmetic, able to book ahead
-- (fixed_window_unchecked and sliding_window_unchecked call them too).
CREATE FUNCTION pgsemaphore.fixed_window_book(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE sql
AS $$
    SELECT t.o_allowed, t.o_wait_us, t.o_remaining
      FROM pgsemaphore.rate_take('fixed_window', p_limiter, p_key, NULL, NULL, p_limit, p_window,
                                 p_n, p_max_wait, false) t
$$;

CREATE FUNCTION pgsemaphore.sliding_window_book(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE sql
AS $$
    SELECT t.o_allowed, t.o_wait_us, t.o_remaining
      FROM pgsemaphore.rate_take('sliding_window', p_limiter, p_key, NULL, NULL, p_limit, p_window,
                                 p_n, p_max_wait, false) t
$$;

-- The plain checks' arithmetic: a booking that may not wait. Admitted only
-- in the window open now with room now; refused, the retry-after is the
-- wait a booking would get (when nothing is booked ahead: the end of the
-- window for a fixed window, the instant enough has slid out for a sliding
-- one). Nothing in the crate calls them (the checked functions call
-- rate_take directly): they are the owner's, for whatever an operator builds
-- on them.
CREATE FUNCTION pgsemaphore.fixed_window_unchecked(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE sql
AS $$
    SELECT b.o_allowed, b.o_remaining, CASE WHEN b.o_allowed THEN 0 ELSE b.o_wait_us END
      FROM pgsemaphore.fixed_window_book(p_limiter, p_key, p_limit, p_window, p_n, interval '0') b
$$;

CREATE FUNCTION pgsemaphore.sliding_window_unchecked(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE sql
AS $$
    SELECT b.o_allowed, b.o_remaining, CASE WHEN b.o_allowed THEN 0 ELSE b.o_wait_us END
      FROM pgsemaphore.sliding_window_book(p_limiter, p_key, p_limit, p_window, p_n, interval '0') b
$$;

-- ---------------------------------------------------------------------------
-- Operator functions
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.set_rate_limit(
    p_kind text, p_limiter text, p_key text,
    p_rate double precision, p_burst double precision, p_limit bigint, p_window interval)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
-- STORES the limits of limiter (p_kind, p_limiter), or of its key p_key's
-- override when p_key is not NULL: a token bucket's p_rate and p_burst (p_limit
-- and p_window NULL), a window's p_limit and p_window (p_rate and p_burst
-- NULL), validated as the checks validate passed ones. Applies from each
-- key's next check (see the migration's header for how it meets a key's
-- state) and sends NOTIFY pgsemaphore_rate 'kind/limiter' at commit, so that
-- waiting acquires re-read it. A limiter's first check stores its caller's
-- pair (pgsemaphore.rate_limit_first_use; see the migration's header): this
-- function is how that pair changes. The row is waited for at most
-- lock_timeout, 2 s (an application's pause or first use left in an open
-- transaction holds it), then 55P03.
BEGIN
    PERFORM pgsemaphore.check_setting_target(p_kind, p_limiter, p_key);
    IF p_kind = 'token_bucket' THEN
        PERFORM pgsemaphore.check_bucket(p_rate, p_burst);
        IF p_limit IS NOT NULL THEN
            PERFORM pgsemaphore.refuse('p_limit', 'NULL for a token bucket (it has a rate and a burst)');
        END IF;
        IF p_window IS NOT NULL THEN
            PERFORM pgsemaphore.refuse('p_window', 'NULL for a token bucket (it has a rate and a burst)');
        END IF;
    ELSE
        PERFORM pgsemaphore.check_window(p_limit, p_window, 1);
        IF p_rate IS NOT NULL THEN
            PERFORM pgsemaphore.refuse('p_rate', 'NULL for a window (it has a permit limit and a window)');
        END IF;
        IF p_burst IS NOT NULL THEN
            PERFORM pgsemaphore.refuse('p_burst', 'NULL for a window (it has a permit limit and a window)');
        END IF;
    END IF;
    INSERT INTO pgsemaphore.rate_limit_settings AS s
           (kind, limiter, key, rate, burst, permit_limit, window_length, updated_at)
    VALUES (p_kind, p_limiter, coalesce(p_key, ''), p_rate, p_burst, p_limit, p_window, now())
    ON CONFLICT (kind, limiter, key) DO UPDATE
       SET rate = excluded.rate, burst = excluded.burst,
           permit_limit = excluded.permit_limit, window_length = excluded.window_length,
           updated_at = now();
    PERFORM pg_notify('pgsemaphore_rate', p_kind || '/' || p_limiter);
END;
$$;

CREATE FUNCTION pgsemaphore.clear_rate_limit(p_kind text, p_limiter text, p_key text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
-- FORGETS the stored limits of limiter (p_kind, p_limiter) (p_key NULL) or
-- of its key p_key's override: the next checks apply the limiter's stored
-- pair (for a key) or, for the limiter, the next check is a first use
-- again and stores its caller's pair. A pause stays. Returns
-- whether a pair was stored. NOTIFY as set_rate_limit. The row is waited
-- for at most lock_timeout, 2 s, then 55P03.
DECLARE
    v_had boolean;
BEGIN
    PERFORM pgsemaphore.check_setting_target(p_kind, p_limiter, p_key);
    UPDATE pgsemaphore.rate_limit_settings s
       SET rate = NULL, burst = NULL, permit_limit = NULL, window_length = NULL, updated_at = now()
     WHERE s.kind = p_kind AND s.limiter = p_limiter AND s.key = coalesce(p_key, '')
       AND (s.rate IS NOT NULL OR s.permit_limit IS NOT NULL);
    v_had := FOUND;
    DELETE FROM pgsemaphore.rate_limit_settings s
     WHERE s.kind = p_kind AND s.limiter = p_limiter AND s.key = coalesce(p_key, '')
       AND s.rate IS NULL AND s.permit_limit IS NULL
       AND (s.paused_until IS NULL OR s.paused_until <= now());
    IF v_had THEN
        PERFORM pg_notify('pgsemaphore_rate', p_kind || '/' || p_limiter);
    END IF;
    RETURN v_had;
END;
$$;

CREATE FUNCTION pgsemaphore.resume_rate_limit(p_kind text, p_limiter text, p_key text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
-- ENDS the pause of limiter (p_kind, p_limiter) (p_key NULL) or of its key
-- p_key, now (the row waited for at most lock_timeout, 2 s, then 55P03). Returns whether one was running. NOTIFY as set_rate_limit, so
-- that acquires waiting for the pause's end retry at once.
DECLARE
    v_had boolean;
BEGIN
    PERFORM pgsemaphore.check_setting_target(p_kind, p_limiter, p_key);
    UPDATE pgsemaphore.rate_limit_settings s
       SET paused_until = NULL, updated_at = now()
     WHERE s.kind = p_kind AND s.limiter = p_limiter AND s.key = coalesce(p_key, '')
       AND s.paused_until > now();
    v_had := FOUND;
    DELETE FROM pgsemaphore.rate_limit_settings s
     WHERE s.kind = p_kind AND s.limiter = p_limiter AND s.key = coalesce(p_key, '')
       AND s.rate IS NULL AND s.permit_limit IS NULL;
    IF v_had THEN
        PERFORM pg_notify('pgsemaphore_rate', p_kind || '/' || p_limiter);
    END IF;
    RETURN v_had;
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

CREATE FUNCTION pgsemaphore.prune_rate_limits_unchecked(
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

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
