\set tok random(1, 1000000000)
BEGIN;
SELECT capacity FROM p_sem WHERE name = 's' FOR NO KEY UPDATE \gset
SELECT count(*) AS held FROM p_slots WHERE semaphore = 's' AND completed_at IS NULL AND timed_out_at IS NULL \gset
INSERT INTO p_slots (semaphore, slot, holder, token_hash, created_at, expires_at)
SELECT 's', f.slot, 'bench', sha256(:tok::text::bytea), clock_timestamp(), clock_timestamp() + interval '1 min'
  FROM (SELECT g.slot FROM generate_series(0, :held) g(slot)
         WHERE NOT EXISTS (SELECT 1 FROM p_slots z WHERE z.semaphore = 's' AND z.slot = g.slot AND z.completed_at IS NULL AND z.timed_out_at IS NULL OFFSET 0)
         LIMIT 1) f RETURNING id \gset
COMMIT;
UPDATE p_slots SET completed_at = clock_timestamp() WHERE id = :id AND token_hash = sha256(:tok::text::bytea) AND completed_at IS NULL AND timed_out_at IS NULL;
