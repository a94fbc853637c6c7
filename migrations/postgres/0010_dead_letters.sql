-- Redis stream entries the settlement consumer could not read (not a record this version
-- wrote), copied here with their raw fields before they are acknowledged: nothing Redis
-- acknowledged is deleted unrecorded. Listed by GET /v1/reconciliation.
CREATE TABLE settlement_dead_letters (
    tenant_id     TEXT NOT NULL,
    resource_key  TEXT NOT NULL,
    entry_id      TEXT NOT NULL,
    payload       TEXT NOT NULL,   -- the entry's fields as a JSON object (at most 64 KiB)
    reason        TEXT NOT NULL,
    at            BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, resource_key, entry_id)
);
CREATE INDEX settlement_dead_letters_by_time ON settlement_dead_letters (tenant_id, at);
-- Purged with the settlement failures' retention (src/jobs/mod.rs), oldest first.
CREATE INDEX settlement_dead_letters_by_at ON settlement_dead_letters (at);
