-- stockd core schema (PostgreSQL). Counters are BIGINT in the smallest unit; times are Unix ms.
-- The CHECK constraints are the last line of defence: a bug that would oversell fails its
-- transaction instead of committing a negative or unbalanced resource.

CREATE TABLE tenants (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);

CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenants (id),
    hash        TEXT NOT NULL UNIQUE,          -- SHA-256 of the key; the key itself is never stored
    created_at  BIGINT NOT NULL,
    revoked_at  BIGINT
);

CREATE TABLE resources (
    tenant_id   TEXT NOT NULL REFERENCES tenants (id),
    key         TEXT NOT NULL,
    kind        TEXT NOT NULL CHECK (kind IN ('inventory', 'balance', 'coupon', 'quota')),
    status      TEXT NOT NULL CHECK (status IN ('active', 'inactive')),
    mode        TEXT NOT NULL CHECK (mode IN ('db', 'redis')),
    buckets     BIGINT NOT NULL CHECK (buckets BETWEEN 1 AND 1024),
    total       BIGINT NOT NULL,
    available   BIGINT NOT NULL CHECK (available >= 0),
    reserved    BIGINT NOT NULL CHECK (reserved >= 0),
    consumed    BIGINT NOT NULL CHECK (consumed >= 0),
    version     BIGINT NOT NULL CHECK (version >= 1),
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL,
    CHECK (available + reserved + consumed = total),
    PRIMARY KEY (tenant_id, key)
);

-- Append-only.
CREATE TABLE ledger (
    seq             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id       TEXT NOT NULL,
    resource_key    TEXT NOT NULL,
    bucket          BIGINT NOT NULL DEFAULT 0,
    op              TEXT NOT NULL CHECK (op IN ('create', 'adjust', 'deduct', 'reserve', 'confirm', 'release', 'expire')),
    qty             BIGINT NOT NULL,
    request_id      TEXT NOT NULL,
    order_id        TEXT,
    reservation_id  TEXT,
    available_after BIGINT NOT NULL,
    reserved_after  BIGINT NOT NULL,
    consumed_after  BIGINT NOT NULL,
    version_after   BIGINT NOT NULL,
    plugin_version  BIGINT,
    at              BIGINT NOT NULL
);
-- One business action changes one resource (bucket) once per op: a replayed or redelivered
-- action cannot be applied twice.
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_id, resource_key, bucket, request_id, op);
CREATE INDEX ledger_by_resource ON ledger (tenant_id, resource_key, seq);

-- A row is inserted (response NULL) before the business writes of its request, in the same
-- transaction: a concurrent duplicate in another process waits on this row's lock and then
-- replays the stored response. No row outlives a failed transaction, so nothing is stuck.
CREATE TABLE idempotency (
    tenant_id      TEXT NOT NULL,
    key            TEXT NOT NULL,
    request_hash   TEXT NOT NULL,
    response_code  INTEGER,
    response_type  TEXT,
    response_body  TEXT,
    created_at     BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, key)
);
CREATE INDEX idempotency_by_age ON idempotency (created_at);

CREATE TABLE reservations (
    tenant_id   TEXT NOT NULL,
    id          TEXT NOT NULL,
    order_id    TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('held', 'confirmed', 'released', 'expired')),
    lines       TEXT NOT NULL,                 -- JSON [{key, resource, qty}]
    expires_at  BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, id)
);
CREATE INDEX reservations_due ON reservations (expires_at) WHERE state = 'held';
