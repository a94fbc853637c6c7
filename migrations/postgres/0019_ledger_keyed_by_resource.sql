-- The ledger's primary key becomes (tenant_id, resource_key, seq), the index every read of it
-- by resource already used (`ledger_by_resource`), instead of `seq` alone, which nothing looks
-- an entry up by: one b-tree fewer on every ledger entry (its insertion, its pages, its WAL),
-- the same rows, and still a key for each (`seq` stays the identity column that numbers them).
-- SQLite's ledger keeps `seq` as its rowid, which costs no index of its own.
ALTER TABLE ledger DROP CONSTRAINT ledger_pkey;
DROP INDEX ledger_by_resource;
ALTER TABLE ledger ADD CONSTRAINT ledger_by_resource PRIMARY KEY (tenant_id, resource_key, seq);
