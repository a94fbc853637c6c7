-- Bucketed resources (`buckets` > 1): the counters live in one row per bucket so that writers
-- of one hot key need not queue on one row. The resource row keeps the kind, status, mode and
-- bucket count, and zero counters; its totals are the sums of its buckets. Each bucket is a
-- resource of its own to the ledger: its entries carry the bucket, and replaying them gives
-- exactly its row.
CREATE TABLE resource_buckets (
    tenant_id     TEXT NOT NULL,
    resource_key  TEXT NOT NULL,
    bucket        BIGINT NOT NULL CHECK (bucket BETWEEN 0 AND 1023),
    total         BIGINT NOT NULL,
    available     BIGINT NOT NULL CHECK (available >= 0),
    reserved      BIGINT NOT NULL CHECK (reserved >= 0),
    consumed      BIGINT NOT NULL CHECK (consumed >= 0),
    version       BIGINT NOT NULL CHECK (version >= 1),
    updated_at    BIGINT NOT NULL,
    CHECK (available + reserved + consumed = total),
    PRIMARY KEY (tenant_id, resource_key, bucket),
    FOREIGN KEY (tenant_id, resource_key) REFERENCES resources (tenant_id, key)
);
