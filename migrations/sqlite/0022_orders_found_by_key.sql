-- An order whose id is its own idempotency key is found through that key's record instead of
-- `ledger_by_order`. The bench's orders and most clients' send the order id as the key, and
-- `ledger_by_order`, keyed by what the client chose, put a random leaf (a 4 KiB WAL frame) into
-- every commit for every line of such an order: without those entries SQLite's writer does
-- 10-20 % more orders a second (docs/PERFORMANCE.md, "Orders found by their key").
--
-- How (src/storage/sqlite/port.rs, `write_batch` and `order_entries`):
-- - A ledger entry the batch writes for an order whose id is the key its own request is stored
--   under gets `by_key = 1` and no entry in `ledger_by_order` (now partial). That record keeps
--   `ledger_seq`, the `seq` of one of those entries; their request id is read there, and the
--   request's entries through `ledger_identity` (request first). Everything else is indexed by
--   order as before, and every existing entry keeps its index entry (`by_key` NULL).
-- - The ledger is kept for ever, the record 24 h: past its retention the purge keeps such a
--   record as a stub (every response column NULL, `ledger_seq` kept; stubs answer nothing and
--   are not in `idempotency_by_age`), which costs about what the entries' index entries did.
-- - A stub's key taken by a new request first puts the old order's entries back into
--   `ledger_by_order` (`by_key` NULL) and deletes the stub, in the new request's transaction.
--
-- SQLite cannot drop a NOT NULL from a column, so `idempotency` is rebuilt with its rows (as long
-- as copying the last day's records once), and `ledger_by_order` is built again (one read of the
-- ledger).
CREATE TABLE idempotency_new (
    tenant_id      TEXT NOT NULL,
    key            TEXT NOT NULL,
    request_hash   TEXT,
    response_code  INTEGER,
    response_type  TEXT,
    response_body  TEXT,
    response_event TEXT,
    created_at     INTEGER NOT NULL,
    ledger_seq     INTEGER,
    PRIMARY KEY (tenant_id, key),
    CHECK ((response_code IS NOT NULL AND request_hash IS NOT NULL AND response_type IS NOT NULL
            AND (response_body IS NULL) <> (response_event IS NULL))
           OR (response_code IS NULL AND request_hash IS NULL AND response_type IS NULL
               AND response_body IS NULL AND response_event IS NULL AND ledger_seq IS NOT NULL))
) WITHOUT ROWID;
INSERT INTO idempotency_new (tenant_id, key, request_hash, response_code, response_type, response_body,
                             response_event, created_at)
SELECT tenant_id, key, request_hash, response_code, response_type, response_body, response_event, created_at
FROM idempotency;
DROP TABLE idempotency;
ALTER TABLE idempotency_new RENAME TO idempotency;
CREATE INDEX idempotency_by_age ON idempotency (created_at) WHERE response_code IS NOT NULL;

ALTER TABLE ledger ADD COLUMN by_key INTEGER;
DROP INDEX ledger_by_order;
CREATE INDEX ledger_by_order ON ledger (tenant_id, order_id) WHERE order_id IS NOT NULL AND by_key IS NULL;
