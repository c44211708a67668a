-- When an answer for this operation entered the inbox and waits to be
-- applied; NULL when none waits. Set in the transaction that stores the
-- callback (or records the decision id, for an early answer), cleared in
-- the one that applies it. Workers find such operations by this index
-- alone, so callbacks that match no operation (early, or foreign) cost
-- nothing to look past however many there are.
ALTER TABLE operations ADD COLUMN inbox_at BIGINT;
CREATE INDEX operations_inbox ON operations (inbox_at) WHERE inbox_at IS NOT NULL;
UPDATE operations SET inbox_at = (
    SELECT MIN(i.received_at) FROM inbox i
    WHERE i.tenant = operations.tenant AND i.correlation_id = operations.decision_id AND i.state = 'new')
WHERE decision_id IS NOT NULL;
-- The orphan sweep reads only callbacks old enough to be orphaned.
CREATE INDEX inbox_new_received ON inbox (received_at) WHERE state = 'new';
