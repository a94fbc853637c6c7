-- Reversals (docs/API.md, "Orders: lookup and reversals"): an order's consumed quantity given
-- back to available on the resource and bucket it was taken from, as ledger op 'reverse'.
--
-- New ledger columns, NULL on every entry written before this migration:
-- - `line_key`: the order line (its key as the client sent it) an order's entry applied;
-- - `limit_key`: the per-user limit that line counted against, given back by a reversal;
-- - `reverses`: on a 'reverse' entry, the request whose take it gives back.
ALTER TABLE ledger DROP CONSTRAINT ledger_op_check;
ALTER TABLE ledger ADD CONSTRAINT ledger_op_check
    CHECK (op IN ('create', 'adjust', 'deduct', 'reserve', 'confirm', 'release', 'expire', 'reverse'));
ALTER TABLE ledger ADD COLUMN line_key TEXT;
ALTER TABLE ledger ADD COLUMN limit_key TEXT;
ALTER TABLE ledger ADD COLUMN reverses TEXT;
-- An order's entries (GET /v1/orders/{order_id}, reversals).
CREATE INDEX ledger_by_order ON ledger (tenant_id, order_id) WHERE order_id IS NOT NULL;

-- What each order has had reversed, per resource (bucket): the row every reversal of that line
-- updates, guarded (`reversed + qty <= taken`), so concurrent reversals of one order, in any
-- number of processes, never give back more than it took. `taken` is what the order consumed
-- there (deducted, or confirmed), as the ledger said when a reversal last looked; it only grows.
CREATE TABLE order_reversals (
    tenant_id     TEXT NOT NULL,
    order_id      TEXT NOT NULL,
    resource_key  TEXT NOT NULL,
    bucket        BIGINT NOT NULL,
    taken         BIGINT NOT NULL CHECK (taken >= 0),
    reversed      BIGINT NOT NULL CHECK (reversed >= 0),
    updated_at    BIGINT NOT NULL,
    CHECK (reversed <= taken),
    PRIMARY KEY (tenant_id, order_id, resource_key, bucket)
);
