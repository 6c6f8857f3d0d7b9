\set tok random(1, 1000000000)
BEGIN;
SELECT capacity FROM g2_sem WHERE name = 's' FOR NO KEY UPDATE \gset
WITH free AS (
  SELECT c.slot, n.gen
    FROM generate_series(0, :capacity - 1) AS c(slot)
    LEFT JOIN LATERAL (SELECT g.gen, g.completed_at IS NULL AND g.timed_out_at IS NULL AS live
                         FROM g2_slots g WHERE g.semaphore = 's' AND g.slot = c.slot
                        ORDER BY g.gen DESC LIMIT 1) n ON true
   WHERE n.live IS NOT TRUE
   LIMIT 1)
INSERT INTO g2_slots (semaphore, slot, gen, holder, token_hash, created_at, expires_at)
SELECT 's', f.slot, coalesce(f.gen, 0) + 1, 'bench', sha256(:tok::text::bytea), clock_timestamp(), clock_timestamp() + interval '1 min'
  FROM free f RETURNING id \gset
COMMIT;
UPDATE g2_slots SET completed_at = clock_timestamp() WHERE id = :id AND token_hash = sha256(:tok::text::bytea) AND completed_at IS NULL AND timed_out_at IS NULL;
