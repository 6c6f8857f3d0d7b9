-- pg-semaphore, schema version 9: rate limits stored in the database, several
-- limits per check, and pauses.
--
-- Until now a rate limiter's limits lived in the code of each process: every
-- check passed its rate and burst (or permit limit and window), so two
-- versions of a service disagreed during a deploy, an operator could change
-- nothing at run time, a key had one limit, and an upstream's 429 could not
-- hold back the other processes. What this migration adds:
--   * table pgsemaphore.rate_limit_settings: per (kind, limiter) and
--     optionally per key, the limits an operator stored, and a pause;
--   * the four check functions (token_bucket, fixed_window, sliding_window,
--     token_bucket_reserve) keep their signatures and their arithmetic, and
--     now read that table in the same statement (no extra round trip): the
--     limits in force are the key's stored ones, else the limiter's stored
--     ones, else the ones passed (the code's defaults). A paused key or
--     limiter is refused without touching its state. Code built for any
--     version from 2 on honours stored limits and pauses unchanged;
--   * application functions check_limits (several limits in one atomic
--     check: admitted only if all admit, charging none otherwise),
--     pause_rate_limit (only ever extends a pause, at most 1 hour ahead) and
--     rate_limit_in_force (what a check of a key would apply now);
--   * operator functions set_rate_limit, clear_rate_limit,
--     resume_rate_limit (not granted to the application role);
--   * schema_version() returns (9, 2).
--
-- Decisions, written down once here (docs/sql-api.md repeats them):
--   * Limits are stored in pairs, validated as the checks validate passed
--     ones: a token bucket's rate and burst together, a window's permit
--     limit and window together. The pair in force is the key's row's if it
--     has one, else the limiter's row's (key ''), else the passed one; pairs
--     are never mixed, so every combination in force was validated whole.
--   * A stored limit applies from each key's next check, to the key's
--     existing state, with the unchanged arithmetic: a lowered burst caps the
--     stored tokens at the next refill (least(burst, ...)), a raised rate
--     refills the time since the key's last check at the new rate, a window's
--     new limit counts the permits already granted in the current window,
--     and a new window length starts from the key's current window start.
--   * A check asking for more permits than the limit in force (p_n above the
--     stored burst or permit limit) could never be admitted: it raises 22023
--     naming p_n, as a p_n above the passed limit always did.
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

CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 9, 2 $$;

-- ---------------------------------------------------------------------------
-- Table
-- ---------------------------------------------------------------------------

-- Stored limits and pauses, per (kind, limiter) (key '') and per key. Written
-- only by the functions below; read by every check in its own statement.
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

-- ---------------------------------------------------------------------------
-- Internal helpers (not granted to anyone)
-- ---------------------------------------------------------------------------

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

-- The microseconds until p_until, from the clock now (at least 1).
CREATE FUNCTION pgsemaphore.us_until(p_until timestamptz)
RETURNS bigint
LANGUAGE sql VOLATILE
AS $$ SELECT greatest(1, ceil(extract(epoch FROM p_until - clock_timestamp()) * 1e6))::bigint $$;

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

-- ---------------------------------------------------------------------------
-- The checks, reading the stored limits
-- ---------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION pgsemaphore.token_bucket(
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
-- Since version 9: p_rate and p_burst are defaults; the pair stored in
-- pgsemaphore.rate_limit_settings for the key, else for the limiter, is
-- applied instead (p_n above a stored burst raises 22023 p_n). While the key
-- or the limiter is paused the check is refused (o_remaining 0,
-- o_retry_after_us until the pause ends) without touching the key's row.
-- Meets (since 9), besides what token_bucket_unchecked meets: a stored
-- limit's change or a pause committed while we run. The settings are read
-- by their own statement before the key's row is locked, so the decision
-- applies the whole pair in force at that read: a check that then waits for
-- the row lock (behind a multi-limit check's open transaction, say) decides
-- under the settings it read before waiting, which were in force during
-- the check (tests/isolation/specs/limits-multi-settings.spec).
DECLARE
    v record;
BEGIN
    PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    PERFORM pgsemaphore.check_bucket(p_rate, p_burst);
    IF p_n IS NULL OR NOT (p_n >= 1 AND p_n <= p_burst) THEN
        PERFORM pgsemaphore.refuse('p_n', format('1 to the burst (%s), got %s', p_burst, coalesce(p_n::text, 'NULL')));
    END IF;
    SELECT * INTO v FROM pgsemaphore.rate_limit_stored('token_bucket', p_limiter, p_key);
    IF v.o_paused_until > clock_timestamp() THEN
        RETURN QUERY SELECT false, 0::bigint, pgsemaphore.us_until(v.o_paused_until);
        RETURN;
    END IF;
    IF v.o_rate IS NOT NULL THEN
        PERFORM pgsemaphore.check_n_stored(p_n, v.o_burst);
    END IF;
    RETURN QUERY SELECT * FROM pgsemaphore.token_bucket_unchecked(
        p_limiter, p_key, coalesce(v.o_rate, p_rate), coalesce(v.o_burst, p_burst), p_n);
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.fixed_window(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- FIXED WINDOW, per key: see pgsemaphore.fixed_window_unchecked.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_limit at least
--   1; p_window 1 ms..366 days; p_n 1 to p_limit
-- Since version 9: p_limit and p_window are defaults, the stored pair (key,
-- else limiter) applies instead, and a pause refuses, as in token_bucket.
-- Meets (since 9), besides what the _unchecked function meets: a stored
-- limit's change or a pause committed while we run. The settings are read
-- by their own statement before the key's row is locked, so the decision
-- applies the whole pair in force at that read: a check that then waits for
-- the row lock (behind a multi-limit check's open transaction, say) decides
-- under the settings it read before waiting, which were in force during
-- the check (tests/isolation/specs/limits-multi-settings.spec).
DECLARE
    v record;
BEGIN
    PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    SELECT * INTO v FROM pgsemaphore.rate_limit_stored('fixed_window', p_limiter, p_key);
    IF v.o_paused_until > clock_timestamp() THEN
        RETURN QUERY SELECT false, 0::bigint, pgsemaphore.us_until(v.o_paused_until);
        RETURN;
    END IF;
    IF v.o_limit IS NOT NULL THEN
        PERFORM pgsemaphore.check_n_stored(p_n, v.o_limit);
    END IF;
    RETURN QUERY SELECT * FROM pgsemaphore.fixed_window_unchecked(
        p_limiter, p_key, coalesce(v.o_limit, p_limit), coalesce(v.o_window, p_window), p_n);
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.sliding_window(
    p_limiter text, p_key text, p_limit bigint, p_window interval, p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- SLIDING WINDOW, per key: see pgsemaphore.sliding_window_unchecked.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_limit at least
--   1; p_window 1 ms..366 days; p_n 1 to p_limit
-- Since version 9: p_limit and p_window are defaults, the stored pair (key,
-- else limiter) applies instead, and a pause refuses, as in token_bucket.
-- Meets (since 9), besides what the _unchecked function meets: a stored
-- limit's change or a pause committed while we run. The settings are read
-- by their own statement before the key's row is locked, so the decision
-- applies the whole pair in force at that read: a check that then waits for
-- the row lock (behind a multi-limit check's open transaction, say) decides
-- under the settings it read before waiting, which were in force during
-- the check (tests/isolation/specs/limits-multi-settings.spec).
DECLARE
    v record;
BEGIN
    PERFORM pgsemaphore.check_limiter_key(p_limiter, p_key);
    PERFORM pgsemaphore.check_window(p_limit, p_window, p_n);
    SELECT * INTO v FROM pgsemaphore.rate_limit_stored('sliding_window', p_limiter, p_key);
    IF v.o_paused_until > clock_timestamp() THEN
        RETURN QUERY SELECT false, 0::bigint, pgsemaphore.us_until(v.o_paused_until);
        RETURN;
    END IF;
    IF v.o_limit IS NOT NULL THEN
        PERFORM pgsemaphore.check_n_stored(p_n, v.o_limit);
    END IF;
    RETURN QUERY SELECT * FROM pgsemaphore.sliding_window_unchecked(
        p_limiter, p_key, coalesce(v.o_limit, p_limit), coalesce(v.o_window, p_window), p_n);
END;
$$;

CREATE OR REPLACE FUNCTION pgsemaphore.token_bucket_reserve(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision,
    p_n double precision, p_max_wait interval)
RETURNS TABLE (o_allowed boolean, o_wait_us bigint, o_remaining bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- TOKEN BUCKET RESERVATION: p_n tokens of key p_key of the token bucket
-- p_limiter (the same rows, rules and arithmetic as pgsemaphore.token_bucket:
-- p_burst tokens at most, refilled continuously at p_rate per second, the
-- database's clock read after the key's row lock), taken now even if they
-- are not there yet, provided they will be within p_max_wait. The caller
-- then waits o_wait_us before it acts: that instant is its admission.
--   p_limiter 1..200 characters; p_key 1..256 characters; p_rate finite,
--   above 0, at most 1e9 tokens per second; p_burst finite, 1 to 1e15, and
--   refilled from empty within 366 days; p_n finite, 1 to p_burst (as
--   token_bucket); p_max_wait 0 to 366 days, not NULL
-- Every bad argument raises 22023 naming it in COLUMN.
-- Returns one row:
--   o_allowed   true: the tokens are taken (reserved); false: the wait
--               would pass p_max_wait, and nothing is taken
--   o_wait_us   microseconds from the database's clock at the decision
--               until the tokens are refilled: allowed, when the caller may
--               act (0: at once); refused, how long it would have had to wait
--   o_remaining the whole tokens left after the decision; below zero, the
--               tokens reserved ahead that are not refilled yet
--
-- Invariant: over any interval of length d, the admissions of a key at their
-- admitted instants (decision + o_wait_us), plain checks included, take at
-- most p_burst + p_rate x d tokens. The row's token count is the bucket's
-- level once every reservation made so far has been paid: a reservation
-- takes p_n now and is admitted exactly when the level, refilling, would
-- have reached p_n again had it not taken them. So every admission, plain or
-- reserved, is admitted at an instant when a plain bucket debited at those
-- instants, in the order the row lock served them, would hold its tokens;
-- and such a bucket never passes more than p_burst + p_rate x d in d. A
-- later decision is never admitted before an earlier one: while tokens are
-- owed, the level is below p_n until the last reservation's instant.
-- Meets:
--   * plain checks (token_bucket) and other reservations of the key: they
--     queue on the key's row lock and each sees the level the one before
--     left, negative while reservations are outstanding, so a plain check
--     is refused until every earlier reservation's instant has passed
--     (reservations are served first, in the order they were made);
--   * the key's first use by anyone: a concurrent insert of the row makes
--     our insert do nothing, and the loop's next SELECT waits for it;
--   * prune_rate_limits: it deletes only a row at rest (idle_at, the instant
--     the level is back at p_burst, later by the tokens owed) and skips a
--     row we hold; a row it deleted before our lock is gone, and we start a
--     fresh full bucket, which is what it was;
--   * a caller that abandons a reservation (its process stops waiting):
--     the tokens stay taken, so the key admits less, never more.
--   * a stored limit's change (set_rate_limit, clear_rate_limit): read in
--     step 1b by its own statement, so the reservation applies the pair in
--     force either before or after the change, whole; the key's row carries
--     only the level, so the next decision refills it at the new rate and
--     caps it at the new burst. A waiter that reserved earlier keeps its
--     instant in the books; the crate's waiter, woken by the change's
--     NOTIFY, shortens its own sleep when the rate was raised (never below
--     what the refill at the old rate until the change plus the new rate
--     after it allows);
--   * a pause (pause_rate_limit) committed before step 1b: refused, nothing
--     taken; one committed after it: this reservation was made before the
--     pause and stands (the pause holds back the ones after it).
-- Since version 9 (step 1b): p_rate and p_burst are defaults; the pair
-- stored for the key, else for the limiter, applies instead (p_n above a
-- stored burst raises 22023 p_n). While the key or the limiter is paused the
-- reservation is refused, nothing taken, with o_wait_us the time until the
-- pause ends and o_remaining 0: a refusal with o_wait_us within p_max_wait is
-- a pause, and the caller may call again when it ends.
DECLARE
    v_tokens double precision;
    v_stamp  timestamptz;
    v_now    timestamptz;
    v_found  boolean;
    v_wait   double precision;
    v        record;
BEGIN
    -- 1. The arguments: token_bucket's checks, then p_max_wait.
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
    PERFORM pgsemaphore.checked_interval(p_max_wait, 'p_max_wait', interval '0', interval '366 days');
    -- 1b. The stored pair in force, and a pause.
    SELECT * INTO v FROM pgsemaphore.rate_limit_stored('token_bucket', p_limiter, p_key);
    IF v.o_paused_until > clock_timestamp() THEN
        o_allowed := false;
        o_wait_us := pgsemaphore.us_until(v.o_paused_until);
        o_remaining := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    IF v.o_rate IS NOT NULL THEN
        PERFORM pgsemaphore.check_n_stored(p_n, v.o_burst);
        p_rate := v.o_rate;
        p_burst := v.o_burst;
    END IF;
    LOOP
        -- 2. The key's row, locked; then the clock.
        SELECT r.tokens, r.stamp INTO v_tokens, v_stamp
          FROM pgsemaphore.rate_limits r
         WHERE r.kind = 'token_bucket' AND r.limiter = p_limiter AND r.key = p_key
           FOR UPDATE;
        v_found := FOUND;
        v_now := clock_timestamp();
        -- 3. Refill, as token_bucket does (from below zero too: what is owed
        -- is paid first).
        IF v_found THEN
            v_tokens := least(p_burst,
                              v_tokens + greatest(0, extract(epoch FROM v_now - v_stamp)::double precision) * p_rate);
            v_stamp := greatest(v_stamp, v_now);
        ELSE
            v_tokens := p_burst;
            v_stamp := v_now;
        END IF;
        -- 4. Decide: the seconds until p_n tokens are there, within p_max_wait?
        v_wait := greatest(0, (p_n - v_tokens) / p_rate);
        o_allowed := v_wait <= extract(epoch FROM p_max_wait)::double precision;
        o_wait_us := ceil(v_wait * 1e6)::bigint;
        IF o_allowed THEN
            v_tokens := v_tokens - p_n;
        END IF;
        o_remaining := floor(v_tokens)::bigint;
        -- 5. Write the level back (refused: only the refill), and when the
        -- row will be at rest.
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
        -- A concurrent first use inserted the row: the next SELECT waits for it.
    END LOOP;
END;
$$;

-- ---------------------------------------------------------------------------
-- Application functions
-- ---------------------------------------------------------------------------

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

CREATE FUNCTION pgsemaphore.check_limits(
    p_kinds text[], p_limiters text[], p_keys text[],
    p_rates double precision[], p_bursts double precision[],
    p_limits bigint[], p_windows interval[], p_n bigint)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint, o_deciding integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
-- SEVERAL LIMITS IN ONE CHECK: p_n permits against limit i = (p_kinds[i],
-- p_limiters[i], p_keys[i]) for every i, admitted only if every limit
-- admits, and then charged to every one; refused if any refuses, and then
-- charged to none. Each limit is checked by its kind's own function
-- (token_bucket with p_rates[i], p_bursts[i]; fixed_window or
-- sliding_window with p_limits[i], p_windows[i]), so stored limits and
-- pauses apply as there, and the arithmetic is theirs.
--   p_kinds: a one-dimensional array of 1 to 16 kinds, from index 1, no
--   NULL; the six other arrays: one-dimensional, from index 1, as long
--   (elements as each kind's function takes them; the other kind's may be
--   NULL); no (kind, limiter, key) twice (22023 p_limiters); p_n at least 1
--   and at most every limit (22023 p_n, from the limit's function)
-- Returns one row:
--   o_allowed        every limit admitted (and all are charged)
--   o_remaining      the fewest permits any limit has left after the
--                    decision (refused: as each limit answered)
--   o_retry_after_us refused: the longest retry-after of the refusing
--                    limits; 0 when admitted
--   o_deciding       the index (from 1, in the caller's order) of the limit
--                    that decided: refused, the refusing one with the
--                    longest retry-after; admitted, the one with the fewest
--                    left
--
-- Invariant: no limit admits more than its function allows alone, and the
-- permits of a refused check are counted by none. Every limit's row is
-- locked by its function (FOR UPDATE) and kept until this transaction ends,
-- and the rows are locked in one canonical order (kind, limiter, key, by
-- byte), so two multi-limit checks never wait on each other in a cycle; a
-- single check locks one row, so it cannot close a cycle either.
-- Meets:
--   * single checks and reservations of any of the keys: they queue on the
--     row's lock in either direction; each sees the state the one before
--     left. A refused multi-check's charges are undone (a subtransaction
--     rolled back) before its row locks are released, so no one ever sees
--     them;
--   * other multi-limit checks sharing some keys: the canonical order;
--   * a stored limit's change or a pause committed while we run: each
--     limit's function reads the settings in its own statement, so limit i
--     may be decided under the old pair and limit j under the new one; each
--     under a pair that was in force during the check;
--   * prune_rate_limits: as for each function (it skips locked rows).
DECLARE
    v_count    integer;
    v_order    integer[];
    v_i        integer;
    v_ok       boolean;
    v_left     bigint;
    v_retry    bigint;
    v_refused  boolean := false;
    v_best     bigint;
BEGIN
    -- 1. The arrays: shapes first, then the elements that pick the rows.
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
        PERFORM pgsemaphore.check_limiter_key(p_limiters[v_i], p_keys[v_i]);
    END LOOP;
    -- 2. The canonical order, and no row twice.
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
    o_allowed := true;
    o_retry_after_us := 0;
    -- 3. Every limit, in that order, inside a subtransaction (one limit: none
    -- is needed, a refused check charges nothing by itself). A refusal does
    -- not stop the walk: the caller is told the longest retry-after.
    BEGIN
        FOREACH v_i IN ARRAY v_order LOOP
            CASE p_kinds[v_i]
            WHEN 'token_bucket' THEN
                SELECT c.o_allowed, c.o_remaining, c.o_retry_after_us INTO v_ok, v_left, v_retry
                  FROM pgsemaphore.token_bucket(p_limiters[v_i], p_keys[v_i], p_rates[v_i], p_bursts[v_i],
                                                p_n::double precision) c;
            WHEN 'fixed_window' THEN
                SELECT c.o_allowed, c.o_remaining, c.o_retry_after_us INTO v_ok, v_left, v_retry
                  FROM pgsemaphore.fixed_window(p_limiters[v_i], p_keys[v_i], p_limits[v_i], p_windows[v_i], p_n) c;
            ELSE
                SELECT c.o_allowed, c.o_remaining, c.o_retry_after_us INTO v_ok, v_left, v_retry
                  FROM pgsemaphore.sliding_window(p_limiters[v_i], p_keys[v_i], p_limits[v_i], p_windows[v_i], p_n) c;
            END CASE;
            IF o_remaining IS NULL OR v_left < o_remaining THEN
                o_remaining := v_left;
                IF NOT v_refused AND v_ok THEN
                    o_deciding := v_i;
                END IF;
            END IF;
            IF NOT v_ok AND (NOT v_refused OR v_retry > v_best) THEN
                v_refused := true;
                v_best := v_retry;
                o_deciding := v_i;
            END IF;
        END LOOP;
        IF v_refused AND v_count > 1 THEN
            -- 4. Refused: undo every charge (caught just below).
            RAISE EXCEPTION 'refused' USING ERRCODE = 'PSRL0';
        END IF;
    EXCEPTION WHEN SQLSTATE 'PSRL0' THEN
        NULL;
    END;
    IF v_refused THEN
        o_allowed := false;
        o_retry_after_us := v_best;
    END IF;
    RETURN NEXT;
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
-- waiting acquires re-read it. Since version 12 a limiter's first check
-- stores its caller's pair (migrations/20261129000006_pgsemaphore_rate_ledger.sql):
-- this function is how that pair changes. The row is waited for at most
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
-- again and stores its caller's pair (version 12). A pause stays. Returns
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

-- ---------------------------------------------------------------------------
-- Privileges: nobody but the owner runs anything until granted. Whoever may
-- run token_bucket (the application, granted as the README says) may run
-- check_limits, pause_rate_limit and rate_limit_in_force; whoever may run
-- configure (the operator) may run set_rate_limit, clear_rate_limit and
-- resume_rate_limit. An upgrade asks for no new grants.
-- ---------------------------------------------------------------------------

REVOKE ALL ON ALL ROUTINES IN SCHEMA pgsemaphore FROM PUBLIC;
DO $$
DECLARE
    r  record;
    fn text;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS grantee, a.is_grantable, f.target
          FROM (VALUES
                ('pgsemaphore.token_bucket(text, text, double precision, double precision, double precision)',
                 'pgsemaphore.check_limits(text[], text[], text[], double precision[], double precision[], bigint[], interval[], bigint)'),
                ('pgsemaphore.token_bucket(text, text, double precision, double precision, double precision)',
                 'pgsemaphore.pause_rate_limit(text, text, text, interval)'),
                ('pgsemaphore.token_bucket(text, text, double precision, double precision, double precision)',
                 'pgsemaphore.rate_limit_in_force(text, text, text)'),
                ('pgsemaphore.configure(text, integer, interval, boolean, boolean)',
                 'pgsemaphore.set_rate_limit(text, text, text, double precision, double precision, bigint, interval)'),
                ('pgsemaphore.configure(text, integer, interval, boolean, boolean)',
                 'pgsemaphore.clear_rate_limit(text, text, text)'),
                ('pgsemaphore.configure(text, integer, interval, boolean, boolean)',
                 'pgsemaphore.resume_rate_limit(text, text, text)')) AS f(source, target)
          JOIN pg_proc p ON p.oid = f.source::regprocedure
         CROSS JOIN LATERAL aclexplode(p.proacl) a
         WHERE a.privilege_type = 'EXECUTE'
           AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s%s',
                       r.target, r.grantee, CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END;
$$;
