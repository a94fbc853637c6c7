-- Redis mode (flash sales): sales Redis acknowledged that the database refused when they were
-- settled (stock Redis lost in a failover). Never dropped: the tenant compensates from here.
-- One row per business action, so a redelivered record is recorded once.
CREATE TABLE settlement_failures (
    tenant_id        TEXT NOT NULL,
    resource_key     TEXT NOT NULL,
    request_id       TEXT NOT NULL,
    order_id         TEXT NOT NULL,
    idempotency_key  TEXT NOT NULL,
    qty              INTEGER NOT NULL CHECK (qty > 0),
    reason           TEXT NOT NULL,
    available        INTEGER NOT NULL,   -- database available stock when it refused
    at               INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, resource_key, request_id)
) WITHOUT ROWID;
CREATE INDEX settlement_failures_by_time ON settlement_failures (tenant_id, at);
-- Every Redis sale settled (applied or refused), by its request id: a redelivered stream entry
-- is recognised by one probe of this primary key, claimed before anything else is written.
CREATE TABLE redis_settled (
    tenant_id     TEXT NOT NULL,
    resource_key  TEXT NOT NULL,
    request_id    TEXT NOT NULL,
    at            INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, resource_key, request_id)
) WITHOUT ROWID;
-- The settlement consumers list the redis-mode resources every second.
CREATE INDEX resources_by_mode ON resources (mode) WHERE mode = 'redis';
