-- Reversals (docs/API.md, "Orders: lookup and reversals"): an order's consumed quantity given
-- back to available on the resource and bucket it was taken from, as ledger op 'reverse'.
--
-- SQLite cannot change a CHECK constraint in place, so the ledger is rebuilt by the documented
-- procedure (https://www.sqlite.org/lang_altertable.html#otheralter): create the new table,
-- copy, drop the old one, rename, and create its indexes again. `seq` is copied as it was (the
-- rowid), so no entry changes its number. No other table refers to the ledger, and no view or
-- trigger is defined on it.
--
-- New columns, NULL on every entry written before this migration:
-- - `line_key`: the order line (its key as the client sent it) an order's entry applied;
-- - `limit_key`: the per-user limit that line counted against, given back by a reversal;
-- - `reverses`: on a 'reverse' entry, the request whose take it gives back.
CREATE TABLE ledger_new (
    seq             INTEGER PRIMARY KEY,
    tenant_id       TEXT NOT NULL,
    resource_key    TEXT NOT NULL,
    bucket          INTEGER NOT NULL DEFAULT 0,
    op              TEXT NOT NULL CHECK (op IN ('create', 'adjust', 'deduct', 'reserve', 'confirm', 'release',
                                                'expire', 'reverse')),
    qty             INTEGER NOT NULL,
    request_id      TEXT NOT NULL,
    order_id        TEXT,
    reservation_id  TEXT,
    available_after INTEGER NOT NULL,
    reserved_after  INTEGER NOT NULL,
    consumed_after  INTEGER NOT NULL,
    version_after   INTEGER NOT NULL,
    plugin_version  INTEGER,
    at              INTEGER NOT NULL,
    line_key        TEXT,
    limit_key       TEXT,
    reverses        TEXT
);
INSERT INTO ledger_new (seq, tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                        available_after, reserved_after, consumed_after, version_after, plugin_version, at)
SELECT seq, tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
       available_after, reserved_after, consumed_after, version_after, plugin_version, at
FROM ledger;
DROP TABLE ledger;
ALTER TABLE ledger_new RENAME TO ledger;
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_id, resource_key, bucket, request_id, op);
CREATE INDEX ledger_by_resource ON ledger (tenant_id, resource_key, seq);
CREATE INDEX ledger_by_version ON ledger (tenant_id, resource_key, bucket, version_after);
-- An order's entries (GET /v1/orders/{order_id}, reversals).
CREATE INDEX ledger_by_order ON ledger (tenant_id, order_id) WHERE order_id IS NOT NULL;

-- What each order has had reversed, per resource (bucket): the row every reversal of that line
-- updates, guarded (`reversed + qty <= taken`), so concurrent reversals of one order never give
-- back more than it took. `taken` is what the order consumed there (deducted, or confirmed), as
-- the ledger said when a reversal last looked; it only grows.
CREATE TABLE order_reversals (
    tenant_id     TEXT NOT NULL,
    order_id      TEXT NOT NULL,
    resource_key  TEXT NOT NULL,
    bucket        INTEGER NOT NULL,
    taken         INTEGER NOT NULL CHECK (taken >= 0),
    reversed      INTEGER NOT NULL CHECK (reversed >= 0),
    updated_at    INTEGER NOT NULL,
    CHECK (reversed <= taken),
    PRIMARY KEY (tenant_id, order_id, resource_key, bucket)
) WITHOUT ROWID;
