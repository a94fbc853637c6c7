-- The ledger's uniqueness (one business action changes one resource bucket once per op) keyed
-- by the request first: the same columns, so the same rule, but request ids grow with time
-- (`req_<ULID>`, `res_<ULID>`, ...), so a batch's entries land side by side at the index's end
-- instead of each on its resource's page at a random place. Every ledger entry dirtied one
-- more random page per line before: `multi-line` 31 -> 20 writer writes an order, 61 -> 42 KiB
-- (docs/PERFORMANCE.md, 2026-12-02, fourth session). Reads by resource go through
-- `ledger_by_resource` as before. Rebuilding the index reads the ledger once.
DROP INDEX ledger_identity;
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_id, request_id, op, resource_key, bucket);
