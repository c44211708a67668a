-- approvald schema, PostgreSQL. The same tables and meaning as the SQLite
-- schema; times are Unix milliseconds (BIGINT).

CREATE TABLE operations (
    id               TEXT PRIMARY KEY,
    tenant           TEXT NOT NULL,
    operation_key    TEXT NOT NULL,
    fingerprint      TEXT NOT NULL,
    thread_id        TEXT NOT NULL,
    interrupt_id     TEXT NOT NULL,
    effect           TEXT NOT NULL,
    decision_type    TEXT NOT NULL,
    -- The validated enqueue content (OperationSpec JSON): immutable.
    spec             TEXT NOT NULL,
    -- The POST /decisions payload, built once so retries resend it verbatim.
    decision_request TEXT NOT NULL,
    state            TEXT NOT NULL,
    decision_id      TEXT,
    answer           TEXT,
    permit_id        TEXT,
    -- Delivery to the effect target: NULL (not yet due), pending, done, failed, abandoned.
    delivery         TEXT,
    outcome_status   TEXT,
    idempotency_key  TEXT NOT NULL,
    result           TEXT,
    -- Receipt at Pushary for a consumed permit: NULL, pending, recorded.
    receipt          TEXT,
    receipt_outcome  TEXT,
    -- Set while a non-idempotent call is in flight; found set after a crash.
    consume_inflight  BIGINT NOT NULL DEFAULT 0,
    consume_attempts  BIGINT NOT NULL DEFAULT 0,
    delivery_inflight BIGINT NOT NULL DEFAULT 0,
    attempts         BIGINT NOT NULL DEFAULT 0,
    last_error       TEXT,
    -- When a worker should next act on this operation; NULL = nothing to do.
    due_at           BIGINT,
    deadline         BIGINT NOT NULL,
    -- When the reconciler should next poll Pushary for this pending decision.
    poll_at          BIGINT,
    -- Arrival order of the answer that resumed this operation (its inbox
    -- id): answers of one thread resume strictly in this order.
    resume_seq       BIGINT,
    opened_at        BIGINT,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    -- Optimistic concurrency: every write checks and bumps it.
    version          BIGINT NOT NULL DEFAULT 0,
    UNIQUE (tenant, operation_key)
);
CREATE UNIQUE INDEX operations_decision ON operations (tenant, decision_id) WHERE decision_id IS NOT NULL;
CREATE INDEX operations_due ON operations (due_at) WHERE due_at IS NOT NULL;
CREATE INDEX operations_pending_deadline ON operations (deadline) WHERE state = 'pending';
CREATE INDEX operations_poll ON operations (poll_at) WHERE poll_at IS NOT NULL;
CREATE INDEX operations_thread ON operations (tenant, thread_id, created_at);
CREATE INDEX operations_resume ON operations (tenant, thread_id, resume_seq) WHERE resume_seq IS NOT NULL;
CREATE INDEX operations_state ON operations (state, created_at);

CREATE TABLE transitions (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id TEXT NOT NULL REFERENCES operations (id),
    from_state   TEXT,
    to_state     TEXT NOT NULL,
    at           BIGINT NOT NULL,
    cause        TEXT NOT NULL,
    actor        TEXT NOT NULL
);
CREATE INDEX transitions_operation ON transitions (operation_id, id);

-- Verified callbacks, committed before the 2xx. `id` is arrival order.
CREATE TABLE inbox (
    id             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant         TEXT NOT NULL,
    correlation_id TEXT NOT NULL,
    answer         TEXT NOT NULL,
    answered_at    TEXT,
    body           BYTEA NOT NULL,
    body_sha256    TEXT NOT NULL,
    source         TEXT NOT NULL,
    -- new (waiting to be matched and processed), processed, ignored, orphaned
    state          TEXT NOT NULL,
    received_at    BIGINT NOT NULL,
    duplicates     BIGINT NOT NULL DEFAULT 0,
    operation_id   TEXT,
    processed_at   BIGINT,
    note           TEXT,
    UNIQUE (tenant, correlation_id)
);
CREATE INDEX inbox_new ON inbox (tenant, correlation_id) WHERE state = 'new';

-- Every attempt to deliver an outcome to an effect target.
CREATE TABLE deliveries (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id  TEXT NOT NULL REFERENCES operations (id),
    attempt       BIGINT NOT NULL,
    started_at    BIGINT NOT NULL,
    duration_ms   BIGINT,
    status_code   BIGINT,
    error         TEXT,
    response_body TEXT
);
CREATE INDEX deliveries_operation ON deliveries (operation_id, id);

-- Per-thread exclusivity: a worker holds a thread until `until`.
CREATE TABLE thread_leases (
    tenant    TEXT NOT NULL,
    thread_id TEXT NOT NULL,
    owner     TEXT NOT NULL,
    until     BIGINT NOT NULL,
    PRIMARY KEY (tenant, thread_id)
);
