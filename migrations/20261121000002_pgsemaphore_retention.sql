-- Retention: bound the audit log.
--
-- pgsemaphore.prune deletes finished claims (completed or timed out) that
-- ended before a cutoff, oldest first, at most p_batch rows per call, so a
-- large backlog is removed in short transactions. Live claims are never
-- touched. Ids only grow, so walking the primary key from the smallest id
-- reaches the oldest claims first and stops after p_batch matches.

CREATE FUNCTION pgsemaphore.prune(p_older_than interval, p_batch integer)
RETURNS bigint
LANGUAGE sql
AS $$
    WITH doomed AS (
        SELECT s.id
          FROM pgsemaphore.slots s
         WHERE coalesce(s.completed_at, s.timed_out_at) < clock_timestamp() - p_older_than
         ORDER BY s.id
         LIMIT p_batch
           FOR UPDATE SKIP LOCKED
    ), deleted AS (
        DELETE FROM pgsemaphore.slots s
         USING doomed
         WHERE s.id = doomed.id
        RETURNING 1
    )
    SELECT count(*) FROM deleted
$$;

-- The slot table churns like a queue (an insert and an update per claim,
-- deletes when pruned): let autovacuum reclaim dead rows after 2% of the
-- table changed instead of the default 20%, so freed space is reused and the
-- table stays small under retention.
ALTER TABLE pgsemaphore.slots SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);
