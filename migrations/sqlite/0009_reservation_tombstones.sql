-- A reservation Redis made and the database refused at settlement leaves its failure row as a
-- tombstone: a later confirm, release or expiry of it (Redis still held it) settles as a
-- recorded failure of its own instead of waiting forever for a row that will never exist.
ALTER TABLE settlement_failures ADD COLUMN reservation_id TEXT;
CREATE INDEX settlement_failures_by_reservation ON settlement_failures (tenant_id, reservation_id)
    WHERE reservation_id IS NOT NULL;
