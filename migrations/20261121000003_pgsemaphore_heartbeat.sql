-- pg-semaphore: lease renewal (heartbeat), and durable claims and releases.
--
-- A holder renews its claims' leases before they end. Renewal uses the
-- database clock, like the claim, so client clocks never matter. A claim whose
-- lease has already ended is not revived: it is reaped on the spot (any claim
-- or reaper could have done so already) and reported as timed out, so the
-- holder stops work instead of carrying on beside a new holder.

-- A claim, renewal or release that a client was told about must survive a
-- database crash. A lost claim or renewal would make the slot look free while
-- its holder works, and admit a second holder; a lost release would leave the
-- audit log contradicting what the holder was told (the slot reaped later,
-- as if the holder had vanished). Under `synchronous_commit = off` (a common
-- throughput setting) a commit is acknowledged before its WAL is flushed, and
-- an immediate shutdown or crash loses it: the torture test saw both. So
-- these functions upgrade `off` to `on` for their own transaction (any
-- stricter setting is left as it is). pgsemaphore.claim does so from
-- migration 20261121000005 on, which replaces it.
CREATE FUNCTION pgsemaphore.durable_commit()
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF current_setting('synchronous_commit') = 'off' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END;
$$;

-- The release, as in the first migration, now with a durable commit.
-- Ends a claim. Returns what happened:
--   'released'  this call ended it (and waiters were notified);
--   'timed_out' it had already been reaped (o_at = timed_out_at);
--   'completed' it had already been released (o_at = completed_at);
--   'missing'   no such claim.
CREATE OR REPLACE FUNCTION pgsemaphore.release(p_id bigint)
RETURNS TABLE (o_outcome text, o_semaphore text, o_at timestamptz)
LANGUAGE plpgsql
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

-- Renews every given claim to end `p_lease` from now. One row per id:
--   'renewed'   the claim was live and unexpired; o_at = its new expires_at;
--   'timed_out' it was reaped (now, or earlier); o_at = timed_out_at;
--   'completed' it had been released; o_at = completed_at;
--   'missing'   no such claim (its audit row was deleted).
CREATE FUNCTION pgsemaphore.renew(p_ids bigint[], p_lease interval)
RETURNS TABLE (o_id bigint, o_outcome text, o_at timestamptz)
LANGUAGE plpgsql
AS $$
DECLARE
    v_semaphore text;
    -- One instant for every claim of the permit: they expire together.
    v_now       timestamptz := clock_timestamp();
BEGIN
    IF p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'pg_semaphore.renew needs a positive lease, got %', p_lease
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pgsemaphore.durable_commit();

    -- Unexpired live claims: extend (row locks serialise with release and reap).
    RETURN QUERY
        UPDATE pgsemaphore.slots s
           SET expires_at = v_now + p_lease
         WHERE s.id = ANY (p_ids)
           AND s.completed_at IS NULL AND s.timed_out_at IS NULL
           AND s.expires_at > clock_timestamp()
        RETURNING s.id, 'renewed'::text, s.expires_at;

    -- Live claims whose lease already ended: reap them now and wake waiters.
    FOR v_semaphore IN
        UPDATE pgsemaphore.slots s
           SET timed_out_at = clock_timestamp()
         WHERE s.id = ANY (p_ids)
           AND s.completed_at IS NULL AND s.timed_out_at IS NULL
           AND s.expires_at <= clock_timestamp()
        RETURNING s.semaphore
    LOOP
        PERFORM pg_notify('pgsemaphore', v_semaphore);
    END LOOP;

    -- Everything not renewed above, as it now stands.
    RETURN QUERY
        SELECT i.id,
               CASE WHEN s.id IS NULL THEN 'missing'
                    WHEN s.timed_out_at IS NOT NULL THEN 'timed_out'
                    ELSE 'completed' END,
               coalesce(s.timed_out_at, s.completed_at)
          FROM unnest(p_ids) AS i(id)
          LEFT JOIN pgsemaphore.slots s ON s.id = i.id
         WHERE s.id IS NULL OR s.completed_at IS NOT NULL OR s.timed_out_at IS NOT NULL;
END;
$$;
