-- `inbox_new` indexed (tenant, correlation_id) for rows in state 'new':
-- the columns of the inbox's UNIQUE key, which every lookup by decision
-- already reads (the state is checked on the one row it finds), and the
-- scans of waiting rows by age use `inbox_new_received`. It served no query
-- the unique key does not, and it cost every stored callback an insert at
-- a random place in a second tree: one more page dirtied, written to the
-- WAL and flushed per callback, because correlation ids are random.
-- Ingest, 64 clients: 9,920 → 14,479 callbacks/s, 0.101 → 0.072 ms of
-- approvald's CPU per callback (docs/performance.md).
DROP INDEX IF EXISTS inbox_new;
