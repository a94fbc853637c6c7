-- `ledger_by_order` keyed by a 64-bit hash of the tenant and the order id instead of the two
-- texts. The order id is the client's, so every line of every order lands on a random leaf; keyed
-- by the texts an entry took ~84 bytes of index (`bench-xxxxxxxx` and a 20-character order id,
-- leaves about half full), keyed by the hash ~26 (docs/PERFORMANCE.md, "The order index keyed by
-- a hash"). The ledger is kept for ever, and so is this index's entry for each of its lines.
--
-- Lookups (src/storage/postgres/port.rs, `ORDER_ENTRIES`) name the same expression and then check
-- the tenant and the order id themselves, so a collision of two hashes costs a row read, never a
-- wrong answer. A space joins the two: a tenant id is `[a-z0-9-]` and an order id visible ASCII,
-- so no two pairs make the same text. An order id used by many orders (it need not be unique)
-- makes one run of equal keys, which a b-tree keeps as posting lists; a hash index (`USING
-- hash`) would chain them into overflow pages that every insert walks, so it is not one.
--
-- `hashtextextended` is the function PostgreSQL's hash partitioning stores its rows by, and so
-- stays the same across versions; should it ever change, `REINDEX INDEX ledger_by_order` rebuilds
-- the index. Building it reads the ledger once, with writes to the ledger waiting meanwhile
-- (docs/OPERATIONS.md, "Upgrades").
DROP INDEX ledger_by_order;
CREATE INDEX ledger_by_order ON ledger (hashtextextended(tenant_id || ' ' || order_id, 0)) WHERE order_id IS NOT NULL;
