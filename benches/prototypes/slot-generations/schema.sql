DROP TABLE IF EXISTS g_slots, g_sem, p_slots, p_sem;
CREATE TABLE g_sem(name text PRIMARY KEY, capacity int NOT NULL);
INSERT INTO g_sem VALUES ('s', 64);
-- G: one row per claim; slot's state = its newest generation. No partial index:
-- release is a HOT update (completed_at not indexed).
CREATE TABLE g_slots(
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  semaphore text NOT NULL, slot int NOT NULL, gen bigint NOT NULL,
  holder text NOT NULL, token_hash bytea NOT NULL,
  created_at timestamptz NOT NULL, expires_at timestamptz NOT NULL,
  completed_at timestamptz, timed_out_at timestamptz
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_insert_scale_factor = 0.02);
CREATE UNIQUE INDEX g_slots_gen ON g_slots (semaphore, slot, gen);
CREATE INDEX g_slots_history ON g_slots (semaphore, created_at);
-- P: today's shape, simplified: partial unique index on live claims.
CREATE TABLE p_sem(name text PRIMARY KEY, capacity int NOT NULL);
INSERT INTO p_sem VALUES ('s', 64);
CREATE TABLE p_slots(
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  semaphore text NOT NULL, slot int NOT NULL,
  holder text NOT NULL, token_hash bytea NOT NULL,
  created_at timestamptz NOT NULL, expires_at timestamptz NOT NULL,
  completed_at timestamptz, timed_out_at timestamptz
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_insert_scale_factor = 0.02);
CREATE UNIQUE INDEX p_slots_live ON p_slots (semaphore, slot) WHERE completed_at IS NULL AND timed_out_at IS NULL;
CREATE INDEX p_slots_history ON p_slots (semaphore, created_at);
-- G2: G plus today's partial unique index kept (the hard limit as a constraint).
DROP TABLE IF EXISTS g2_slots, g2_sem;
CREATE TABLE g2_sem(name text PRIMARY KEY, capacity int NOT NULL);
INSERT INTO g2_sem VALUES ('s', 64);
CREATE TABLE g2_slots (LIKE g_slots INCLUDING ALL) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_insert_scale_factor = 0.02);
CREATE UNIQUE INDEX g2_slots_live ON g2_slots (semaphore, slot) WHERE completed_at IS NULL AND timed_out_at IS NULL;
