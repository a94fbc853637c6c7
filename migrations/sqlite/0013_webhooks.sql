-- Webhook delivery of the outbox (docs/WEBHOOKS.md).
--
-- `webhook_endpoints`: a tenant's receivers. The signing secret must be recoverable to sign, so it
-- is stored as issued (`whsec_...`); it is never logged nor answered after creation or rotation.
-- During a rotation's grace period the previous secret signs too, until `previous_valid_until`.
-- `cursor`: every event of the tenant with a seq at or below it has been queued for this endpoint
-- (or did not match its types). An endpoint whose deliveries failed for the whole retry window is
-- `failing`: nothing more is queued or sent until a redeliver call makes it active again.
CREATE TABLE webhook_endpoints (
    id                    TEXT PRIMARY KEY,        -- wh_<ULID>
    tenant_id             TEXT NOT NULL,
    url                   TEXT NOT NULL,
    types                 TEXT NOT NULL,           -- JSON array of event type names; [] = every type
    description           TEXT NOT NULL,
    secret                TEXT NOT NULL,
    previous_secret       TEXT,
    previous_valid_until  INTEGER,                  -- Unix ms
    state                 TEXT NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'failing')),
    failing_since         INTEGER,
    cursor                INTEGER NOT NULL CHECK (cursor >= 0),
    created_at            INTEGER NOT NULL
);
CREATE INDEX webhook_endpoints_by_tenant ON webhook_endpoints (tenant_id, id);

-- The delivery queue: one row per (endpoint, event) not yet delivered. A row is deleted when its
-- receiver answers 2xx. A process claims a row by setting `lease_until` (single writer);
-- a claim of a process that died runs out and the row is claimed again. A row is only claimed
-- while no row of the same endpoint and ordering key has a lower seq (sequence order per key).
CREATE TABLE webhook_deliveries (
    endpoint_id   TEXT NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    seq           INTEGER NOT NULL,                 -- the event's (tenant_id, seq)
    tenant_id     TEXT NOT NULL,
    ordering_key  TEXT NOT NULL,
    event_at      INTEGER NOT NULL,                 -- Unix ms of the event, for the pending-age gauge
    attempts      INTEGER NOT NULL DEFAULT 0,
    due_at        INTEGER NOT NULL,                 -- next attempt not before (Unix ms)
    window_start  INTEGER,                          -- first failed attempt; retries stop a window later
    lease_until   INTEGER NOT NULL DEFAULT 0,       -- claimed until (Unix ms); 0: unclaimed
    PRIMARY KEY (endpoint_id, seq)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (due_at);
CREATE INDEX webhook_deliveries_order ON webhook_deliveries (endpoint_id, ordering_key, seq);
CREATE INDEX webhook_deliveries_age ON webhook_deliveries (event_at);

-- Every attempt, for GET /v1/webhooks/{id}/deliveries; purged after a retention.
CREATE TABLE webhook_attempts (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    endpoint_id  TEXT NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    event_id     TEXT NOT NULL,
    seq          INTEGER NOT NULL,
    type         TEXT NOT NULL,
    attempt      INTEGER NOT NULL,
    at           INTEGER NOT NULL,                  -- Unix ms the request was sent
    outcome      TEXT NOT NULL CHECK (outcome IN ('delivered', 'failed', 'dropped')),
    http_status  INTEGER,
    error        TEXT,                             -- the kind of failure, never a secret
    latency_ms   INTEGER NOT NULL
);
CREATE INDEX webhook_attempts_by_endpoint ON webhook_attempts (endpoint_id, id);
CREATE INDEX webhook_attempts_by_at ON webhook_attempts (at);
