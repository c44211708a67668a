-- Finished operations past the retention time, compacted into one row each
-- (the full operation resource: transitions, deliveries, inbox entry) and
-- removed from the working tables, which therefore stay small. The row
-- keeps what must outlive the work: the operation key (an enqueue of the
-- same key still answers with this operation) and the decision id (a
-- replayed callback for it is recognised and changes nothing).
CREATE TABLE archived_operations (
    id            TEXT PRIMARY KEY,
    tenant        TEXT NOT NULL,
    operation_key TEXT NOT NULL,
    fingerprint   TEXT NOT NULL,
    decision_id   TEXT,
    state         TEXT NOT NULL,
    finished_at   INTEGER NOT NULL,
    archived_at   INTEGER NOT NULL,
    document      TEXT NOT NULL,
    UNIQUE (tenant, operation_key)
);
CREATE UNIQUE INDEX archived_operations_decision ON archived_operations (tenant, decision_id)
    WHERE decision_id IS NOT NULL;
-- The archiver's scan: finished operations with no work left, oldest first.
CREATE INDEX operations_finished ON operations (updated_at) WHERE due_at IS NULL AND poll_at IS NULL;
