-- The ledger's uniqueness (one business action changes one resource bucket once per op) keyed
-- by the request first, as on SQLite (sqlite/0018): the same columns, so the same rule, but
-- request ids grow with time (`req_<ULID>`, `res_<ULID>`, ...), so a batch's entries land side
-- by side at the index's right edge instead of each on its resource's page at a random place:
-- fewer pages dirtied per batch, and fewer full-page images in the WAL after each checkpoint
-- (docs/PERFORMANCE.md, 2026-12-03, tenth session). Nothing reads the ledger through this
-- index; reads by resource go through `ledger_by_resource`. Rebuilding it reads the ledger once
-- and holds writes to it meanwhile (docs/OPERATIONS.md, "Upgrades").
DROP INDEX ledger_identity;
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_id, request_id, op, resource_key, bucket);
