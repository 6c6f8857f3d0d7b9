-- Rate limiters: token bucket, fixed window, sliding window.
--
-- One row per (kind, limiter, key) holds a key's state; it is created by the
-- key's first check. The limits themselves (rate, burst, permit limit,
-- window) are not stored: every check passes them, as Stripe's script does.
--
-- Invariants:
--   * a decision is one call of one function: one round trip;
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
--     window; windows restart from the next check), which is what
--     pgsemaphore.prune_rate_limits does.

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

-- Every check updates its row; no indexed column changes, so leave room on
-- each page for HOT updates, and let autovacuum visit this churning table
-- early (as for pgsemaphore.slots).
ALTER TABLE pgsemaphore.rate_limits SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);

-- TOKEN BUCKET (Stripe's request rate limiter, with the database's clock).
-- The bucket holds up to p_burst tokens and refills continuously at p_rate
-- tokens per second; a check takes p_n tokens if that many are there, else
-- takes nothing. A key's first check finds a full bucket.
-- Returns whether it was admitted, the whole tokens left, and (refused) how
-- many microseconds until p_n tokens will be there, 0 when admitted.
CREATE FUNCTION pgsemaphore.token_bucket(
    p_limiter text, p_key text, p_rate double precision, p_burst double precision, p_n double precision)
RETURNS TABLE (o_allowed boolean, o_remaining bigint, o_retry_after_us bigint)
LANGUAGE plpgsql
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
LANGUAGE plpgsql
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
LANGUAGE plpgsql
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

-- Deletes keys at rest since at least p_idle_for (see idle_at above): never
-- a key whose state still limits anyone. Walks the primary key from just
-- after (p_kind, p_limiter, p_key), looking at p_batch rows per call so that
-- each call is a short transaction, and skips rows a check holds right now.
-- Returns how many rows it deleted and the last row it looked at, NULLs when
-- it reached the end: pass that row back to continue.
CREATE FUNCTION pgsemaphore.prune_rate_limits(
    p_idle_for interval, p_kind text, p_limiter text, p_key text, p_batch integer)
RETURNS TABLE (o_deleted bigint, o_kind text, o_limiter text, o_key text)
LANGUAGE sql
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
