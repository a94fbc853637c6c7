-- stockd core schema (SQLite). Counters are integers in the smallest unit; times are Unix ms.
-- The CHECK constraints are the last line of defence: a bug that would oversell fails its
-- transaction instead of committing a negative or unbalanced resource.

CREATE TABLE tenants (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    created_at  INTEGER NOT NULL
);

CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenants (id),
    hash        TEXT NOT NULL UNIQUE,          -- SHA-256 of the key; the key itself is never stored
    created_at  INTEGER NOT NULL,
    revoked_at  INTEGER
);

CREATE TABLE resources (
    tenant_id   TEXT NOT NULL REFERENCES tenants (id),
    key         TEXT NOT NULL,
    kind        TEXT NOT NULL CHECK (kind IN ('inventory', 'balance', 'coupon', 'quota')),
    status      TEXT NOT NULL CHECK (status IN ('active', 'inactive')),
    mode        TEXT NOT NULL CHECK (mode IN ('db', 'redis')),
    buckets     INTEGER NOT NULL CHECK (buckets BETWEEN 1 AND 1024),
    total       INTEGER NOT NULL,
    available   INTEGER NOT NULL CHECK (available >= 0),
    reserved    INTEGER NOT NULL CHECK (reserved >= 0),
    consumed    INTEGER NOT NULL CHECK (consumed >= 0),
    version     INTEGER NOT NULL CHECK (version >= 1),
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    CHECK (available + reserved + consumed = total),
    PRIMARY KEY (tenant_id, key)
) WITHOUT ROWID;

-- Append-only. seq is the rowid: never reused because rows are never deleted.
CREATE TABLE ledger (
    seq             INTEGER PRIMARY KEY,
    tenant_id       TEXT NOT NULL,
    resource_key    TEXT NOT NULL,
    bucket          INTEGER NOT NULL DEFAULT 0,
    op              TEXT NOT NULL CHECK (op IN ('create', 'adjust', 'deduct', 'reserve', 'confirm', 'release', 'expire')),
    qty             INTEGER NOT NULL,
    request_id      TEXT NOT NULL,
    order_id        TEXT,
    reservation_id  TEXT,
    available_after INTEGER NOT NULL,
    reserved_after  INTEGER NOT NULL,
    consumed_after  INTEGER NOT NULL,
    version_after   INTEGER NOT NULL,
    plugin_version  INTEGER,
    at              INTEGER NOT NULL
);
-- One business action changes one resource (bucket) once per op: a replayed or redelivered
-- action cannot be applied twice.
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_id, resource_key, bucket, request_id, op);
CREATE INDEX ledger_by_resource ON ledger (tenant_id, resource_key, seq);

CREATE TABLE idempotency (
    tenant_id      TEXT NOT NULL,
    key            TEXT NOT NULL,
    request_hash   TEXT NOT NULL,
    response_code  INTEGER NOT NULL,
    response_type  TEXT NOT NULL,
    response_body  TEXT NOT NULL,
    created_at     INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, key)
) WITHOUT ROWID;
CREATE INDEX idempotency_by_age ON idempotency (created_at);

CREATE TABLE reservations (
    tenant_id   TEXT NOT NULL,
    id          TEXT NOT NULL,
    order_id    TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('held', 'confirmed', 'released', 'expired')),
    lines       TEXT NOT NULL,                 -- JSON [{key, resource, qty}]
    expires_at  INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, id)
) WITHOUT ROWID;
CREATE INDEX reservations_due ON reservations (state, expires_at);
