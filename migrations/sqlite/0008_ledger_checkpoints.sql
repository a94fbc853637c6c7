-- Incremental reconciliation (docs/API.md, "Operations"): what each resource (bucket) was
-- proven to be at a version, so that the next pass replays only the ledger rows written after
-- it. A checkpoint is written only for a resource found clean, and deleted when one drifts.
CREATE TABLE ledger_checkpoints (
    tenant_id     TEXT NOT NULL,
    resource_key  TEXT NOT NULL,
    bucket        INTEGER NOT NULL,
    version       INTEGER NOT NULL CHECK (version >= 1),
    available     INTEGER NOT NULL,
    reserved      INTEGER NOT NULL,
    consumed      INTEGER NOT NULL,
    total         INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, resource_key, bucket)
) WITHOUT ROWID;
-- The watermark: a row's ledger entries after its checkpoint, as one index range. The version
-- (written under the row's lock) rather than seq, so entries committed out of seq order are
-- never skipped.
CREATE INDEX ledger_by_version ON ledger (tenant_id, resource_key, bucket, version_after);
