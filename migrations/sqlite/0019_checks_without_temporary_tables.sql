-- SQLite evaluates `x IN (a, b, c, ...)` over three or more constants by filling a temporary
-- b-tree with the constants, once per statement execution: every ledger entry written (the
-- `op` CHECK) and every reservation written or moved (the `state` CHECK) opened, filled and freed
-- one, about 40 % of a ledger INSERT's instructions (docs/PERFORMANCE.md, "CHECKs without
-- temporary tables"). The same rules written as comparisons joined by OR compile to plain
-- comparisons and accept exactly the same values.
--
-- SQLite cannot change a CHECK constraint in place, so both tables are rebuilt by the documented
-- procedure (https://www.sqlite.org/lang_altertable.html#otheralter), as 0012 did: create the new
-- table, copy, drop the old one, rename, create its indexes again. The ledger's `seq` (its rowid)
-- is copied as it was. No other table refers to either, and no view or trigger is defined on
-- them. The copy reads and writes each table once (docs/OPERATIONS.md, "Upgrades").
CREATE TABLE ledger_new (
    seq             INTEGER PRIMARY KEY,
    tenant_id       TEXT NOT NULL,
    resource_key    TEXT NOT NULL,
    bucket          INTEGER NOT NULL DEFAULT 0,
    op              TEXT NOT NULL CHECK (op = 'create' OR op = 'adjust' OR op = 'deduct' OR op = 'reserve'
                                         OR op = 'confirm' OR op = 'release' OR op = 'expire'
                                         OR op = 'reverse'),
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
                        available_after, reserved_after, consumed_after, version_after, plugin_version, at,
                        line_key, limit_key, reverses)
SELECT seq, tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
       available_after, reserved_after, consumed_after, version_after, plugin_version, at,
       line_key, limit_key, reverses
FROM ledger;
DROP TABLE ledger;
ALTER TABLE ledger_new RENAME TO ledger;
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_id, request_id, op, resource_key, bucket);
CREATE INDEX ledger_by_resource ON ledger (tenant_id, resource_key, seq);
CREATE INDEX ledger_by_order ON ledger (tenant_id, order_id) WHERE order_id IS NOT NULL;

CREATE TABLE reservations_new (
    tenant_id   TEXT NOT NULL,
    id          TEXT NOT NULL,
    order_id    TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state = 'held' OR state = 'confirmed' OR state = 'released'
                                     OR state = 'expired'),
    lines       TEXT NOT NULL,                 -- JSON [{key, resource, qty}]
    expires_at  INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, id)
) WITHOUT ROWID;
INSERT INTO reservations_new (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
SELECT tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at FROM reservations;
DROP TABLE reservations;
ALTER TABLE reservations_new RENAME TO reservations;
CREATE INDEX reservations_due ON reservations (state, expires_at);
