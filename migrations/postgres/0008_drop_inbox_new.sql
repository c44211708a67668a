-- `inbox_new` indexed (tenant, correlation_id) for rows in state 'new':
-- the columns of the inbox's UNIQUE key, which every lookup by decision
-- already reads (the state is checked on the one row it finds), and the
-- scans of waiting rows by age use `inbox_new_received`. It served no query
-- the unique key does not, and it cost every stored callback an insert at
-- a random place in a second tree: one more page dirtied, written to the
-- WAL and flushed per callback, because correlation ids are random.
-- The same change on SQLite (its migration 7) took ingest from 9,920 to
-- 14,479 callbacks/s; on PostgreSQL it was not measured on its own.
DROP INDEX IF EXISTS inbox_new;
