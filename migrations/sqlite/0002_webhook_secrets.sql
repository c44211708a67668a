-- Webhook secrets rotated in with `approvald secret rotate`, and the
-- retirement times of older ones (including secrets from the config file).
-- A secret verifies callbacks while valid_until is empty or in the future.
CREATE TABLE webhook_secrets (
    tenant      TEXT NOT NULL,
    secret      TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    valid_until INTEGER,
    PRIMARY KEY (tenant, secret)
);
