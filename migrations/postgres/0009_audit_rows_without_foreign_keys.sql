-- The audit rows (transitions, delivery attempts, Pushary calls) name
-- their operation without a foreign key. Each key checked its row on
-- every insert with a `SELECT … FOR KEY SHARE` of the operation, a
-- statement of its own that also locks the row (a WAL record for the
-- lock), three per approval on average: 5% of PostgreSQL's statement time
-- in `approvald bench`'s end-to-end run (decisions §22). The rows are
-- written only by the save's function, in the transaction that updates
-- their operation or by then finds it there, and retention deletes them
-- before their operation; nothing else writes or deletes them.
ALTER TABLE transitions DROP CONSTRAINT IF EXISTS transitions_operation_id_fkey;
ALTER TABLE deliveries DROP CONSTRAINT IF EXISTS deliveries_operation_id_fkey;
ALTER TABLE pushary_calls DROP CONSTRAINT IF EXISTS pushary_calls_operation_id_fkey;
