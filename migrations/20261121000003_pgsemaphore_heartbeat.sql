-- pg-semaphore: lease renewal (heartbeat).
--
-- A holder renews its claims' leases before they end. Renewal uses the
-- database clock, like the claim, so client clocks never matter. A claim whose
-- lease has already ended is not revived: it is reaped on the spot (any claim
-- or reaper could have done so already) and reported as timed out, so the
-- holder stops work instead of carrying on beside a new holder.

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
BEGIN
    -- Unexpired live claims: extend (row locks serialise with release and reap).
    RETURN QUERY
        UPDATE pgsemaphore.slots s
           SET expires_at = clock_timestamp() + p_lease
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
