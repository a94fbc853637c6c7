-- An applied order's answer is stored once: it is the `order.applied` event's `data`, byte for
-- byte, so its idempotency record keeps only the event's id (`response_event`) and a replay reads
-- the body from there. Every other record (refusals, reversals, adjustments, ...) still keeps its
-- body inline. The events purge keeps an event as long as a record may still point at it
-- (docs/EVENTS.md, "Retention").
--
-- SQLite cannot drop a NOT NULL from a column, so the table is rebuilt with its rows.
CREATE TABLE idempotency_new (
    tenant_id      TEXT NOT NULL,
    key            TEXT NOT NULL,
    request_hash   TEXT NOT NULL,
    response_code  INTEGER NOT NULL,
    response_type  TEXT NOT NULL,
    response_body  TEXT,
    response_event TEXT,
    created_at     INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, key),
    CHECK ((response_body IS NULL) <> (response_event IS NULL))
) WITHOUT ROWID;
INSERT INTO idempotency_new (tenant_id, key, request_hash, response_code, response_type, response_body, created_at)
SELECT tenant_id, key, request_hash, response_code, response_type, response_body, created_at FROM idempotency;
DROP TABLE idempotency;
ALTER TABLE idempotency_new RENAME TO idempotency;
CREATE INDEX idempotency_by_age ON idempotency (created_at);
