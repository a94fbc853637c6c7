-- Tenant plugins (every version kept, one active) and per-user limit counters.

CREATE TABLE plugins (
    tenant_id    TEXT NOT NULL REFERENCES tenants (id),
    version      INTEGER NOT NULL CHECK (version >= 1),
    sha256       TEXT NOT NULL,
    wasm         BLOB NOT NULL,
    config       TEXT NOT NULL,
    uploaded_at  INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, version)
);

-- The active version per tenant; no row (or version 0) means the built-in default plan.
CREATE TABLE plugin_active (
    tenant_id  TEXT PRIMARY KEY REFERENCES tenants (id),
    version    INTEGER NOT NULL CHECK (version >= 0)
);

-- What each per-user limit key has used; a plan's line applies only if used + qty <= max.
CREATE TABLE user_limits (
    tenant_id  TEXT NOT NULL,
    key        TEXT NOT NULL,
    used       INTEGER NOT NULL CHECK (used >= 0),
    PRIMARY KEY (tenant_id, key)
) WITHOUT ROWID;
