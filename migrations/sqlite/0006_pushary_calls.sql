-- Every Pushary call made for an operation (opening its decision,
-- consuming the permit, the receipt, polls and cancels), failed ones too,
-- for the operator page's timeline. Written in the transaction of the step
-- that made the call, so it costs no commit of its own.
CREATE TABLE pushary_calls (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    operation_id TEXT NOT NULL REFERENCES operations (id),
    call         TEXT NOT NULL,
    started_at   INTEGER NOT NULL,
    duration_ms  INTEGER NOT NULL,
    status_code  INTEGER,
    error        TEXT
);
CREATE INDEX pushary_calls_operation ON pushary_calls (operation_id, id);
