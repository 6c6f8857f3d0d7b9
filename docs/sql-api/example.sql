-- pg-semaphore's SQL API driven from psql: the worked example of
-- docs/sql-api.md. Run it against a database migrated to schema version 1,
-- as a role with the application's grants (docs/guide/operations.md, "Privileges"):
--
--   psql -X -f docs/sql-api/example.sql "$DATABASE_URL"
--
-- tests/sql_api.rs runs exactly this file and compares what it prints with
-- docs/sql-api/example.out (timestamps, pids and key bases masked).
\set ON_ERROR_STOP on
\pset null '(null)'
\set VERBOSITY verbose
\set SHOW_CONTEXT never

-- The contract this database speaks: version 1, and the oldest version
-- whose callers still work against it.
SELECT * FROM pgsemaphore.schema_version();

-- 1. Open a semaphore: 2 slots, claims last 30 s unless renewed. An existing
-- semaphore keeps its settings (o_created false).
SELECT * FROM pgsemaphore.open(p_name => 'upstream', p_capacity => 2, p_lease => '30 seconds');

-- 2. Claim a slot. A token is 16..64 random bytes, fresh for every claim,
-- and only its holder knows it: keep it to release, renew or fence.
-- uuid_send(gen_random_uuid()) is 16 bytes from PostgreSQL's strong random
-- source; a client of another language uses its own (Python's
-- secrets.token_bytes(16), Go's crypto/rand, Node's crypto.randomBytes).
SELECT uuid_send(gen_random_uuid()) AS token_a \gset
SELECT o_status, o_ids[1] AS claim_a, o_slots, o_free, o_wake
  FROM pgsemaphore.claim(p_semaphore => 'upstream', p_holder => 'worker-a',
                         p_lease => NULL, p_metadata => '{"job": 41}',
                         p_token => :'token_a') \gset
\echo claim a: :o_status, slots :o_slots, :o_free free, wake :o_wake

-- 3. The claim is a row of pgsemaphore.slots (live_slots: those not ended).
-- The table keeps the token's SHA-256, never the token.
SELECT id = :claim_a AS claim_a, slot, holder, metadata, expires_at - created_at AS lease,
       token_hash = sha256(:'token_a') AS my_token
  FROM pgsemaphore.live_slots WHERE semaphore = 'upstream';

-- 4. Renew before the lease ends (the crate's heartbeat does it every third
-- of the lease). Every outcome but 'renewed' means the permit is lost.
SELECT o_id = :claim_a AS claim_a, o_outcome, o_at > now() AS ends_later
  FROM pgsemaphore.renew(p_ids => ARRAY[:claim_a]::bigint[], p_token => :'token_a',
                         p_lease => '60 seconds');

-- A token that is not the holder's changes nothing.
SELECT o_id = :claim_a AS claim_a, o_outcome
  FROM pgsemaphore.renew(p_ids => ARRAY[:claim_a]::bigint[],
                         p_token => decode(repeat('00', 16), 'hex'),
                         p_lease => '60 seconds');

-- 5. A second holder takes the other slot; a third is refused: 'full', with
-- o_retry_in, when to look again without a wake-up (the earliest lease end).
SELECT uuid_send(gen_random_uuid()) AS token_b \gset
SELECT o_status, o_ids[1] AS claim_b, o_slots, o_free
  FROM pgsemaphore.claim(p_semaphore => 'upstream', p_holder => 'worker-b',
                         p_lease => '30 seconds', p_metadata => NULL,
                         p_token => :'token_b') \gset
\echo claim b: :o_status, slots :o_slots, :o_free free
SELECT o_status, o_ids, o_free, o_retry_in > interval '0' AS retry_in_positive, o_wake
  FROM pgsemaphore.claim(p_semaphore => 'upstream', p_holder => 'worker-c',
                         p_lease => NULL, p_metadata => NULL,
                         p_token => uuid_send(gen_random_uuid()));

-- 6. A waiter would now LISTEN on the channel 'pgsemaphore' (the payload is
-- the semaphore's name) and register with keep_waiting, under a token of
-- its process, before it claims again. A wake-up is a hint: on one, or
-- after o_retry_in, claim again.
LISTEN pgsemaphore;
SELECT uuid_send(gen_random_uuid()) AS process \gset
SELECT pgsemaphore.keep_waiting(p_semaphore => 'upstream', p_lease => '10 seconds',
                                p_tickets => '{}', p_token => :'process',
                                p_register => true, p_spell => 1);

-- 7. Release. o_wake says a waiter may be registered: then, after the
-- release committed (psql commits each statement), send the wake-up.
SELECT o_outcome, o_wake, o_semaphore
  FROM pgsemaphore.release(p_ids => ARRAY[:claim_a]::bigint[], p_token => :'token_a') \gset
\echo release a: :o_outcome, wake :o_wake
\if :o_wake
SELECT pgsemaphore.wake(p_semaphore => :'o_semaphore') AS notified;
\endif

-- The waiter, woken, claims again (and would stop_waiting when it has no
-- more waiters).
SELECT o_status, o_slots, o_free
  FROM pgsemaphore.claim(p_semaphore => 'upstream', p_holder => 'worker-c',
                         p_lease => NULL, p_metadata => NULL,
                         p_token => uuid_send(gen_random_uuid()));
SELECT pgsemaphore.stop_waiting(p_semaphore => 'upstream', p_token => :'process', p_spell => 1);
UNLISTEN pgsemaphore;

-- A second release of the same claim reports what became of it.
SELECT o_outcome, o_id = :claim_a AS claim_a
  FROM pgsemaphore.release(p_ids => ARRAY[:claim_a]::bigint[], p_token => :'token_a');

-- 7b. Several limits at once: a slot of 'upstream' and one of
-- 'upstream:tenant-7' (at most one call per tenant), all or nothing, in
-- one call; the names in any order. 'upstream' is full (workers b and c):
-- nothing is claimed, not even the tenant's free slot.
SELECT o_capacity, o_created
  FROM pgsemaphore.open(p_name => 'upstream:tenant-7', p_capacity => 1, p_lease => '30 seconds');
SELECT uuid_send(gen_random_uuid()) AS token_m \gset
SELECT o_status, o_semaphore, o_ids, o_free
  FROM pgsemaphore.claim_all(p_semaphores => ARRAY['upstream:tenant-7', 'upstream'],
                             p_holder => 'worker-m', p_lease => NULL, p_metadata => NULL,
                             p_token => :'token_m');
SELECT count(*) AS tenant_holders FROM pgsemaphore.live_slots WHERE semaphore = 'upstream:tenant-7';
-- Worker b releases; now both are claimed, with one token, linked in the
-- audit log by group_id (the first claim's id).
SELECT o_outcome FROM pgsemaphore.release(p_ids => ARRAY[:claim_b]::bigint[], p_token => :'token_b');
SELECT o_status, o_semaphores, o_ids AS m_ids, o_wake
  FROM pgsemaphore.claim_all(p_semaphores => ARRAY['upstream:tenant-7', 'upstream'],
                             p_holder => 'worker-m', p_lease => NULL, p_metadata => NULL,
                             p_token => :'token_m') \gset
\echo claim_all m: :o_status, semaphores :o_semaphores
SELECT semaphore, group_id = (:'m_ids'::bigint[])[1] AS linked
  FROM pgsemaphore.live_slots WHERE token_hash = sha256(:'token_m') ORDER BY id;
-- One call releases them all (release_all; o_wake: the semaphores to wake).
SELECT o_outcome, o_wake
  FROM pgsemaphore.release_all(p_ids => :'m_ids'::bigint[], p_token => :'token_m');

-- 8. A refused argument: SQLSTATE 22023, the argument's name in COLUMN.
\set ON_ERROR_STOP off
SELECT * FROM pgsemaphore.claim(p_semaphore => 'upstream', p_holder => 'worker-d',
                                p_lease => NULL, p_metadata => NULL,
                                p_token => '\x00010203'::bytea);
\echo error: :LAST_ERROR_SQLSTATE
SELECT * FROM pgsemaphore.claim(p_semaphore => 'nowhere', p_holder => 'worker-d',
                                p_lease => NULL, p_metadata => NULL,
                                p_token => :'token_b');
\echo error: :LAST_ERROR_SQLSTATE
\set ON_ERROR_STOP on

-- 9. An advisory semaphore: each slot is a session-level advisory lock of
-- the claiming session, so one dedicated session claims, holds and
-- releases. Nothing is written; the holders are in pg_locks.
SELECT o_capacity, o_created, o_key_base AS key_base
  FROM pgsemaphore.open_advisory(p_name => 'reports', p_capacity => 1) \gset
\echo open_advisory: capacity :o_capacity, created :o_created
SELECT o_status, o_slots, o_capacity
  FROM pgsemaphore.advisory_claim(p_semaphore => 'reports', p_permits => 1, p_mine => '{}');
SELECT slot, pid = pg_backend_pid() AS this_session
  FROM pgsemaphore.advisory_holders WHERE semaphore = 'reports';
-- Full: a second permit on this session names the slots it holds (p_mine).
SELECT o_status, o_slots
  FROM pgsemaphore.advisory_claim(p_semaphore => 'reports', p_permits => 1, p_mine => '{0}');
SELECT pgsemaphore.advisory_release(p_semaphore => 'reports', p_key_base => :key_base,
                                    p_slots => '{0}') AS released;
SELECT count(*) AS holders FROM pgsemaphore.advisory_holders WHERE semaphore = 'reports';

-- 10. Rate limits: two limits on one key checked
-- together, all or none; then a pause (an upstream answered 429 with
-- Retry-After: 30) refuses the key in every process, taking nothing.
SELECT o_allowed, o_remaining, o_deciding
  FROM pgsemaphore.check_limits(
         p_kinds => ARRAY['token_bucket', 'fixed_window'], p_limiters => ARRAY['partner-s', 'partner-day'],
         p_keys => ARRAY['tenant-7', 'tenant-7'], p_rates => ARRAY[10, NULL]::float8[],
         p_bursts => ARRAY[10, NULL]::float8[], p_limits => ARRAY[NULL, 1]::bigint[],
         p_windows => ARRAY[NULL, '1 day']::interval[], p_n => 1);
-- The daily limit of 1 is spent: refused, and the bucket keeps its tokens.
SELECT o_allowed, o_retry_after_us > 0 AS must_wait, o_deciding
  FROM pgsemaphore.check_limits(
         p_kinds => ARRAY['token_bucket', 'fixed_window'], p_limiters => ARRAY['partner-s', 'partner-day'],
         p_keys => ARRAY['tenant-7', 'tenant-7'], p_rates => ARRAY[10, NULL]::float8[],
         p_bursts => ARRAY[10, NULL]::float8[], p_limits => ARRAY[NULL, 1]::bigint[],
         p_windows => ARRAY[NULL, '1 day']::interval[], p_n => 1);
SELECT pgsemaphore.pause_rate_limit(p_kind => 'token_bucket', p_limiter => 'partner-s',
                                    p_key => 'tenant-7', p_for => '30 s') > now() AS paused;
SELECT o_allowed, o_remaining, o_retry_after_us > 25000000 AS retry_after_over_25s
  FROM pgsemaphore.token_bucket(p_limiter => 'partner-s', p_key => 'tenant-7',
                                p_rate => 10, p_burst => 10, p_n => 1);

-- 11. A semaphore family: one semaphore per key, created on first use with
-- the capacity the operator's rules give the key (here none: the family's
-- default). The key's semaphore is an ordinary one: claim and release on
-- o_name. A claim that raises P0002 on it later means the reaper removed
-- the idle key: open it again.
SELECT o_capacity, o_created FROM pgsemaphore.open_family(p_family => 'tenants', p_capacity => 3,
                                                          p_lease => '30 seconds',
                                                          p_idle_after => '15 minutes');
SELECT o_name AS tenant_sem, o_capacity, o_created
  FROM pgsemaphore.open_family_key(p_family => 'tenants', p_key => 'tenant-42') \gset
\echo open_family_key: :tenant_sem capacity :o_capacity created :o_created
SELECT uuid_send(gen_random_uuid()) AS token_t \gset
SELECT o_status, o_ids[1] AS claim_t, o_free
  FROM pgsemaphore.claim(p_semaphore => :'tenant_sem', p_holder => 'worker-t',
                         p_lease => NULL, p_metadata => NULL, p_token => :'token_t') \gset
\echo claim on the key: :o_status, :o_free free
SELECT o_outcome FROM pgsemaphore.release(p_ids => ARRAY[:claim_t]::bigint[], p_token => :'token_t');
