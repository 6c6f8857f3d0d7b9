-- pg-semaphore, schema version 6: a token bucket that waits.
--
-- A caller that would rather wait for its tokens than be refused used to
-- poll token_bucket, sleeping o_retry_after_us between checks: a thousand
-- waiters on one key made a thousand round trips each time the key's tokens
-- came back, and all but one were refused again. pgsemaphore.token_bucket_reserve
-- reserves instead (as GCRA and Stripe's limiter do): one call takes the
-- tokens now, even those not yet refilled, and answers how long the caller
-- must wait before it may act, so each admission costs one round trip and
-- waiters are admitted in the order they reserved.
-- What this migration adds, and nothing else changes:
--   * application function token_bucket_reserve(p_limiter, p_key, p_rate,
--     p_burst, p_n, p_max_wait), on the same rows and with the same
--     arithmetic as token_bucket; it is granted here to every role that may
--     run token_bucket (copied below), so an upgrade asks for no new grants;
--   * a key with reservations outstanding has a negative token count in
--     pgsemaphore.rate_limits: token_bucket refuses it (its retry-after
--     counts the reservations) and reports o_remaining below zero (the
--     tokens owed) until they are refilled; its idle_at is later by as
--     much (the row is at rest once the bucket is full again);
--   * schema_version() returns (6, 2): code built for versions 2 to 5 works
--     against it unchanged.

CREATE OR REPLACE FUNCTION pgsemaphore.schema_version()
RETURNS TABLE (o_version integer, o_compatible_from integer)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 6, 2 $$;

-- ---------------------------------------------------------------------------
-- Application functions
-- ---------------------------------------------------------------------------

CREATE FUNCTION pgsemaphore.token_bucket_reserve(
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
DECLARE
    v_tokens double precision;
    v_stamp  timestamptz;
    v_now    timestamptz;
    v_found  boolean;
    v_wait   double precision;
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
-- Privileges: nobody but the owner runs anything until granted; whoever may
-- run token_bucket (an application role granted as the README says) may
-- reserve, so an upgrade asks for no new grants.
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
         WHERE p.oid = 'pgsemaphore.token_bucket(text, text, double precision, double precision, double precision)'::regprocedure
           AND a.privilege_type = 'EXECUTE'
           AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION '
                       'pgsemaphore.token_bucket_reserve(text, text, double precision, double precision, '
                       'double precision, interval) TO %s%s',
                       r.grantee, CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END;
$$;
