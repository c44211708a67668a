-- The operation list (GET /v1/operations, the operator page) is newest
-- first within a tenant: with this index it reads the newest rows and
-- stops at its limit, where it read all of the tenant's operations and
-- sorted them (1.4 s on SQLite with 200,000 finished ones; decisions §37).
-- Lists by state read `operations_state`, and a tenant's list by thread
-- `operations_thread`.
CREATE INDEX IF NOT EXISTS operations_created ON operations (tenant, created_at);
