-- stockd schema (MySQL 8 / MariaDB 10.11, InnoDB): the PostgreSQL schema as of its migration
-- 0014, in one step (this backend starts there). Table and column names are the same on every
-- backend; `key` and `lines` are reserved words here and are always written quoted.
--
-- Counters are BIGINT in the smallest unit; times are Unix ms. Identifiers (tenants, resource
-- keys, idempotency keys, ids) are ASCII by the API's rules and compared byte by byte
-- (ascii_bin): page order and the batches' global lock order are the same as on the other
-- backends. The CHECK constraints (enforced by MySQL 8.0.16+ and MariaDB 10.2+) are the last
-- line of defence: a bug that would oversell fails its transaction instead of committing.

CREATE TABLE tenants (
    id                VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    name              TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_at        BIGINT NOT NULL,
    rate_limit_rps    BIGINT CHECK (rate_limit_rps >= 0),
    rate_limit_burst  BIGINT CHECK (rate_limit_burst >= 0),
    CONSTRAINT tenants_rate_limit_pair CHECK ((rate_limit_burst IS NULL) = (rate_limit_rps IS NULL))
) ENGINE = InnoDB;

CREATE TABLE api_keys (
    id          VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    tenant_id   VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    hash        VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL UNIQUE, -- SHA-256 of the key
    created_at  BIGINT NOT NULL,
    revoked_at  BIGINT,
    FOREIGN KEY (tenant_id) REFERENCES tenants (id)
) ENGINE = InnoDB;

CREATE TABLE resources (
    tenant_id   VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    `key`       VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    kind        VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL
                CHECK (kind IN ('inventory', 'balance', 'coupon', 'quota')),
    status      VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL CHECK (status IN ('active', 'inactive')),
    mode        VARCHAR(8) CHARACTER SET ascii COLLATE ascii_bin NOT NULL CHECK (mode IN ('db', 'redis')),
    buckets     BIGINT NOT NULL CHECK (buckets BETWEEN 1 AND 1024),
    total       BIGINT NOT NULL,
    available   BIGINT NOT NULL CHECK (available >= 0),
    reserved    BIGINT NOT NULL CHECK (reserved >= 0),
    consumed    BIGINT NOT NULL CHECK (consumed >= 0),
    version     BIGINT NOT NULL CHECK (version >= 1),
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL,
    mode_epoch  BIGINT NOT NULL DEFAULT 0 CHECK (mode_epoch >= 0),
    low_stock   BIGINT CHECK (low_stock IS NULL OR low_stock >= 0),
    stock       VARCHAR(8) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'ok'
                CHECK (stock IN ('ok', 'low', 'out')),
    CONSTRAINT resources_balanced CHECK (available + reserved + consumed = total),
    PRIMARY KEY (tenant_id, `key`),
    FOREIGN KEY (tenant_id) REFERENCES tenants (id)
) ENGINE = InnoDB;
-- The settlement consumers list the redis-mode resources every second.
CREATE INDEX resources_by_mode ON resources (mode);

-- Append-only.
CREATE TABLE ledger (
    seq             BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    tenant_id       VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    resource_key    VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    bucket          BIGINT NOT NULL DEFAULT 0,
    op              VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL
                    CHECK (op IN ('create', 'adjust', 'deduct', 'reserve', 'confirm', 'release', 'expire', 'reverse')),
    qty             BIGINT NOT NULL,
    request_id      VARCHAR(400) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    order_id        VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin,
    reservation_id  VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin,
    available_after BIGINT NOT NULL,
    reserved_after  BIGINT NOT NULL,
    consumed_after  BIGINT NOT NULL,
    version_after   BIGINT NOT NULL,
    plugin_version  BIGINT,
    at              BIGINT NOT NULL,
    line_key        VARCHAR(400) CHARACTER SET ascii COLLATE ascii_bin,
    limit_key       VARCHAR(400) CHARACTER SET ascii COLLATE ascii_bin,
    reverses        VARCHAR(400) CHARACTER SET ascii COLLATE ascii_bin
) ENGINE = InnoDB;
-- One business action changes one resource (bucket) once per op: a replayed or redelivered
-- action cannot be applied twice.
CREATE UNIQUE INDEX ledger_identity ON ledger (tenant_id, resource_key, bucket, request_id, op);
CREATE INDEX ledger_by_resource ON ledger (tenant_id, resource_key, seq);
-- Incremental reconciliation's watermark (see the PostgreSQL migration 0008).
CREATE INDEX ledger_by_version ON ledger (tenant_id, resource_key, bucket, version_after);
-- An order's entries (GET /v1/orders/{order_id}, reversals).
CREATE INDEX ledger_by_order ON ledger (tenant_id, order_id);

-- An idempotency record is inserted complete with the writes of its request, in the same
-- transaction; a per-request write claims the key first (response NULL) and a concurrent
-- duplicate in another process waits on that row's lock, then replays the stored response.
CREATE TABLE idempotency (
    tenant_id      VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    `key`          VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    request_hash   VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    response_code  INTEGER,
    response_type  VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin,
    response_body  MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    created_at     BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, `key`)
) ENGINE = InnoDB;
CREATE INDEX idempotency_by_age ON idempotency (created_at);

CREATE TABLE reservations (
    tenant_id   VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    id          VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    order_id    VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    state       VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL
                CHECK (state IN ('held', 'confirmed', 'released', 'expired')),
    `lines`     MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, -- JSON [{key, resource, qty}]
    expires_at  BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, id)
) ENGINE = InnoDB;
-- No partial indexes here: the sweep's range starts with the state.
CREATE INDEX reservations_due ON reservations (state, expires_at);

-- Tenant plugins (every version kept, one active) and per-user limit counters.
CREATE TABLE plugins (
    tenant_id    VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    version      BIGINT NOT NULL CHECK (version >= 1),
    sha256       VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    wasm         LONGBLOB NOT NULL,
    config       MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    uploaded_at  BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, version),
    FOREIGN KEY (tenant_id) REFERENCES tenants (id)
) ENGINE = InnoDB;

-- The active version per tenant; no row (or version 0) means the built-in default plan.
CREATE TABLE plugin_active (
    tenant_id  VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    version    BIGINT NOT NULL CHECK (version >= 0),
    FOREIGN KEY (tenant_id) REFERENCES tenants (id)
) ENGINE = InnoDB;

-- What each per-user limit key has used; a plan's line applies only if used + qty <= max.
CREATE TABLE user_limits (
    tenant_id  VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    `key`      VARCHAR(400) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    used       BIGINT NOT NULL CHECK (used >= 0),
    PRIMARY KEY (tenant_id, `key`)
) ENGINE = InnoDB;

-- Bucketed resources: one row per bucket (see the PostgreSQL migration 0003).
CREATE TABLE resource_buckets (
    tenant_id     VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    resource_key  VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    bucket        BIGINT NOT NULL CHECK (bucket BETWEEN 0 AND 1023),
    total         BIGINT NOT NULL,
    available     BIGINT NOT NULL CHECK (available >= 0),
    reserved      BIGINT NOT NULL CHECK (reserved >= 0),
    consumed      BIGINT NOT NULL CHECK (consumed >= 0),
    version       BIGINT NOT NULL CHECK (version >= 1),
    updated_at    BIGINT NOT NULL,
    CONSTRAINT resource_buckets_balanced CHECK (available + reserved + consumed = total),
    PRIMARY KEY (tenant_id, resource_key, bucket),
    FOREIGN KEY (tenant_id, resource_key) REFERENCES resources (tenant_id, `key`)
) ENGINE = InnoDB;

-- Redis mode: sales Redis acknowledged that the database refused at settlement (never dropped),
-- and every sale settled, by request id (see the PostgreSQL migrations 0004, 0009).
CREATE TABLE settlement_failures (
    tenant_id        VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    resource_key     VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    request_id       VARCHAR(400) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    order_id         VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    idempotency_key  VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    qty              BIGINT NOT NULL CHECK (qty > 0),
    reason           TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    available        BIGINT NOT NULL,
    at               BIGINT NOT NULL,
    reservation_id   VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin,
    PRIMARY KEY (tenant_id, resource_key, request_id)
) ENGINE = InnoDB;
CREATE INDEX settlement_failures_by_time ON settlement_failures (tenant_id, at);
CREATE INDEX settlement_failures_by_at ON settlement_failures (at);
CREATE INDEX settlement_failures_by_reservation ON settlement_failures (tenant_id, reservation_id);

CREATE TABLE redis_settled (
    tenant_id     VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    resource_key  VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    request_id    VARCHAR(400) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    at            BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, resource_key, request_id)
) ENGINE = InnoDB;
CREATE INDEX redis_settled_by_at ON redis_settled (at);

-- Incremental reconciliation's checkpoints (see the PostgreSQL migration 0008).
CREATE TABLE ledger_checkpoints (
    tenant_id     VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    resource_key  VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    bucket        BIGINT NOT NULL,
    version       BIGINT NOT NULL CHECK (version >= 1),
    available     BIGINT NOT NULL,
    reserved      BIGINT NOT NULL,
    consumed      BIGINT NOT NULL,
    total         BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, resource_key, bucket)
) ENGINE = InnoDB;

-- Redis stream entries the settlement consumer could not read (see the PostgreSQL migration 0010).
CREATE TABLE settlement_dead_letters (
    tenant_id     VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    resource_key  VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    entry_id      VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    payload       MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    reason        TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    at            BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, resource_key, entry_id)
) ENGINE = InnoDB;
CREATE INDEX settlement_dead_letters_by_time ON settlement_dead_letters (tenant_id, at);
CREATE INDEX settlement_dead_letters_by_at ON settlement_dead_letters (at);

-- The transactional outbox (docs/EVENTS.md). A transaction numbers its events just before
-- COMMIT, holding the tenant's `event_seqs` row until then, so a tenant's events commit in
-- sequence order (src/storage/mysql/events.rs).
CREATE TABLE events (
    id            VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, -- evt_<ULID>
    tenant_id     VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    seq           BIGINT,
    type          VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    ordering_key  VARCHAR(400) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    at            BIGINT NOT NULL,
    data          MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL
) ENGINE = InnoDB;
CREATE UNIQUE INDEX events_feed ON events (tenant_id, seq);
CREATE INDEX events_by_age ON events (at);

CREATE TABLE event_seqs (
    tenant_id  VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    last       BIGINT NOT NULL CHECK (last >= 0)
) ENGINE = InnoDB;

-- What each order has had reversed, per resource (bucket) (see the PostgreSQL migration 0012).
CREATE TABLE order_reversals (
    tenant_id     VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    order_id      VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    resource_key  VARCHAR(200) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    bucket        BIGINT NOT NULL,
    taken         BIGINT NOT NULL CHECK (taken >= 0),
    reversed      BIGINT NOT NULL CHECK (reversed >= 0),
    updated_at    BIGINT NOT NULL,
    CONSTRAINT order_reversals_bounded CHECK (reversed <= taken),
    PRIMARY KEY (tenant_id, order_id, resource_key, bucket)
) ENGINE = InnoDB;

-- Webhook delivery of the outbox (docs/WEBHOOKS.md; see the PostgreSQL migration 0013).
CREATE TABLE webhook_endpoints (
    id                    VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, -- wh_<ULID>
    tenant_id             VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    url                   TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    types                 TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, -- JSON array of event types
    description           TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    secret                VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    previous_secret       VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin,
    previous_valid_until  BIGINT,
    state                 VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'active'
                          CHECK (state IN ('active', 'failing')),
    failing_since         BIGINT,
    `cursor`              BIGINT NOT NULL CHECK (`cursor` >= 0),
    created_at            BIGINT NOT NULL
) ENGINE = InnoDB;
CREATE INDEX webhook_endpoints_by_tenant ON webhook_endpoints (tenant_id, id);

CREATE TABLE webhook_deliveries (
    endpoint_id   VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    seq           BIGINT NOT NULL,
    tenant_id     VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    ordering_key  VARCHAR(400) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    event_at      BIGINT NOT NULL,
    attempts      BIGINT NOT NULL DEFAULT 0,
    due_at        BIGINT NOT NULL,
    window_start  BIGINT,
    lease_until   BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (endpoint_id, seq),
    FOREIGN KEY (endpoint_id) REFERENCES webhook_endpoints (id) ON DELETE CASCADE
) ENGINE = InnoDB;
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (due_at);
CREATE INDEX webhook_deliveries_by_tenant ON webhook_deliveries (tenant_id, due_at, seq);
CREATE INDEX webhook_deliveries_order ON webhook_deliveries (endpoint_id, ordering_key, seq);
CREATE INDEX webhook_deliveries_age ON webhook_deliveries (event_at);

CREATE TABLE webhook_attempts (
    id           BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    endpoint_id  VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    event_id     VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    seq          BIGINT NOT NULL,
    type         VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    attempt      BIGINT NOT NULL,
    at           BIGINT NOT NULL,
    outcome      VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL
                 CHECK (outcome IN ('delivered', 'failed', 'dropped')),
    http_status  BIGINT,
    error        TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    latency_ms   BIGINT NOT NULL,
    FOREIGN KEY (endpoint_id) REFERENCES webhook_endpoints (id) ON DELETE CASCADE
) ENGINE = InnoDB;
CREATE INDEX webhook_attempts_by_endpoint ON webhook_attempts (endpoint_id, id);
CREATE INDEX webhook_attempts_by_at ON webhook_attempts (at);

-- Where each broker sink of the outbox stands with each tenant (docs/NATS.md).
CREATE TABLE event_sink_cursors (
    sink       VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    tenant_id  VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    last_seq   BIGINT NOT NULL CHECK (last_seq >= 0),
    PRIMARY KEY (sink, tenant_id)
) ENGINE = InnoDB;
