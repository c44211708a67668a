-- The audit rows (transitions, delivery attempts, Pushary calls) name
-- their operation without a foreign key. Each key checked its row on
-- every insert with a `SELECT … FOR KEY SHARE` of the operation, a
-- statement of its own that also locks the row (a WAL record for the
-- lock), three per approval on average: 5% of PostgreSQL's statement time
-- in `approvald bench`'s end-to-end run (decisions §22). The rows are
-- written only by the save's function, and retention deletes them before
-- their operation, which it deletes only at the version it archived. What
-- is given up: the calls or delivery attempt of a save made after its
-- operation was archived (a worker whose lease ran out) stay as rows of no
-- operation, where the key failed that save's batch.
-- Run while an older approvald saves, this may meet one of its saves in a
-- deadlock; PostgreSQL then rolls one back, and if it is this migration,
-- the next `approvald migrate` (or start) applies it.
ALTER TABLE transitions DROP CONSTRAINT IF EXISTS transitions_operation_id_fkey;
ALTER TABLE deliveries DROP CONSTRAINT IF EXISTS deliveries_operation_id_fkey;
ALTER TABLE pushary_calls DROP CONSTRAINT IF EXISTS pushary_calls_operation_id_fkey;
