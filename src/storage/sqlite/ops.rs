//! The SQLite writes that are not business orchestration (tenants, keys, plugins, purges), each
//! run by the writer thread inside its own savepoint. Orders, reservations, adjustments and
//! resources go through [`crate::apply`] over [`super::port::SqlitePort`].

use rusqlite::{params, Connection, OptionalExtension};

use super::port::mapped;
use crate::engine::TenantId;
use crate::events::Event;
use crate::ratelimit::RateLimit;
use crate::storage::{payload, rows, rules};
use crate::storage::{Insert, NewApiKey, PageFrom, PluginUpload, PluginVersion, StorageError};

impl From<rusqlite::Error> for StorageError {
    fn from(err: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode as C;
        match err.sqlite_error_code() {
            Some(
                C::DatabaseBusy
                | C::DatabaseLocked
                | C::SystemIoFailure
                | C::DiskFull
                | C::CannotOpen
                | C::FileLockingProtocolFailed
                | C::OutOfMemory,
            ) => StorageError::Unavailable(err.to_string()),
            _ => StorageError::Internal(err.to_string()),
        }
    }
}

pub fn create_tenant(
    conn: &Connection,
    id: &TenantId,
    name: &str,
    rate_limit: Option<RateLimit>,
    key: &NewApiKey,
    now_ms: i64,
) -> Result<Insert, StorageError> {
    let (rps, burst) = rules::rate_limit_columns(rate_limit);
    let created = conn
        .prepare_cached(
            "INSERT INTO tenants (id, name, created_at, rate_limit_rps, rate_limit_burst) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (id) DO NOTHING",
        )?
        .execute(params![id.as_str(), name, now_ms, rps, burst])?;
    if created == 0 {
        return Ok(Insert::AlreadyExists);
    }
    conn.prepare_cached("INSERT INTO api_keys (id, tenant_id, hash, created_at) VALUES (?1, ?2, ?3, ?4)")?
        .execute(params![key.id, id.as_str(), key.hash, now_ms])?;
    Ok(Insert::Created)
}

pub fn add_api_key(
    conn: &Connection,
    tenant: &TenantId,
    key: &NewApiKey,
    now_ms: i64,
) -> Result<Option<()>, StorageError> {
    let added = conn
        .prepare_cached(
            "INSERT INTO api_keys (id, tenant_id, hash, created_at) SELECT ?1, id, ?2, ?3 FROM tenants WHERE id = ?4",
        )?
        .execute(params![key.id, key.hash, now_ms, tenant.as_str()])?;
    Ok((added == 1).then_some(()))
}

pub fn revoke_api_key(
    conn: &Connection,
    tenant: &TenantId,
    key_id: &str,
    now_ms: i64,
) -> Result<Option<()>, StorageError> {
    let revoked = conn
        .prepare_cached("UPDATE api_keys SET revoked_at = ?1 WHERE id = ?2 AND tenant_id = ?3 AND revoked_at IS NULL")?
        .execute(params![now_ms, key_id, tenant.as_str()])?;
    Ok((revoked == 1).then_some(()))
}

pub fn set_rate_limit(
    conn: &Connection,
    tenant: &TenantId,
    rate_limit: Option<RateLimit>,
) -> Result<Option<()>, StorageError> {
    let (rps, burst) = rules::rate_limit_columns(rate_limit);
    let updated = conn
        .prepare_cached("UPDATE tenants SET rate_limit_rps = ?1, rate_limit_burst = ?2 WHERE id = ?3")?
        .execute(params![rps, burst, tenant.as_str()])?;
    Ok((updated == 1).then_some(()))
}

pub fn ensure_config_tenant(
    conn: &Connection,
    id: &TenantId,
    name: &str,
    rate_limit: Option<RateLimit>,
    key_hash: &str,
    now_ms: i64,
) -> Result<(), StorageError> {
    let (rps, burst) = rules::rate_limit_columns(rate_limit);
    conn.prepare_cached(
        "INSERT INTO tenants (id, name, created_at, rate_limit_rps, rate_limit_burst) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (id) DO UPDATE SET name = excluded.name, rate_limit_rps = excluded.rate_limit_rps,
             rate_limit_burst = excluded.rate_limit_burst",
    )?
    .execute(params![id.as_str(), name, now_ms, rps, burst])?;
    conn.prepare_cached(
        "INSERT INTO api_keys (id, tenant_id, hash, created_at) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (id) DO UPDATE SET hash = excluded.hash, revoked_at = NULL",
    )?
    .execute(params![format!("cfg-{id}"), id.as_str(), key_hash, now_ms])?;
    Ok(())
}

/// The oldest `?2` records created before `?1` that still answer, through `idempotency_by_age`,
/// which holds no stub.
pub(super) const OLDEST_RECORDS: &str = "SELECT tenant_id, key FROM idempotency
    WHERE created_at < ?1 AND response_code IS NOT NULL ORDER BY created_at LIMIT ?2";

/// Forgets up to `limit` records created before `before_ms`, oldest first. A record through which
/// its order's ledger entries are found (`ledger_seq`, migrations/sqlite/0022) becomes a stub
/// that answers nothing and keeps the key with `ledger_seq`; the others are deleted. The stubs
/// are made first: the live records left of the oldest `limit` are then the oldest `limit -
/// stubbed`, all without `ledger_seq`, which the delete takes.
pub fn purge_idempotency(conn: &Connection, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let stubbed = conn
        .prepare_cached(&format!(
            "UPDATE idempotency SET request_hash = NULL, response_code = NULL, response_type = NULL,
                                    response_body = NULL, response_event = NULL
             WHERE (tenant_id, key) IN ({OLDEST_RECORDS}) AND ledger_seq IS NOT NULL"
        ))?
        .execute(params![before_ms, i64::from(limit)])?;
    let deleted = conn
        .prepare_cached(&format!(
            "DELETE FROM idempotency WHERE (tenant_id, key) IN ({OLDEST_RECORDS}) AND ledger_seq IS NULL"
        ))?
        .execute(params![before_ms, i64::from(limit) - stubbed as i64])?;
    Ok((stubbed + deleted) as u64)
}

/// A page of a tenant's events (`types`: a JSON array of type names, or empty for all).
pub fn events_page(
    conn: &Connection,
    tenant: &str,
    from: PageFrom,
    types: &str,
    limit: u32,
) -> Result<Vec<Event>, StorageError> {
    let (after, order) = from.bounds();
    let mut statement = conn.prepare_cached(&format!(
        "SELECT id, tenant_id, seq, type, ordering_key, at, data FROM events
         WHERE tenant_id = ?1 AND seq > ?2 AND (?3 = '' OR type IN (SELECT value FROM json_each(?3)))
         ORDER BY seq {order} LIMIT ?4"
    ))?;
    let rows = statement.query_map(params![tenant, after, types, i64::from(limit)], |row| {
        Ok(Event {
            id: row.get(0)?,
            tenant: row.get(1)?,
            seq: row.get(2)?,
            kind: row.get(3)?,
            ordering_key: row.get(4)?,
            at: row.get(5)?,
            data: row.get(6)?,
        })
    })?;
    let mut events = rows.collect::<Result<Vec<_>, _>>()?;
    for event in &mut events {
        event.data = payload::unpack(std::mem::take(&mut event.data))?;
    }
    Ok(from.arrange(events))
}

/// Deletes up to `limit` events written before `before_ms`, oldest first: those whose id and
/// `at` are both older, found by walking `events_by_id` up to the first id made at `before_ms`
/// ([`crate::events::first_event_id_at`]).
pub fn purge_events(conn: &Connection, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let deleted = conn
        .prepare_cached(
            "DELETE FROM events WHERE id IN
               (SELECT id FROM events WHERE id < ?1 AND at < ?2 ORDER BY id LIMIT ?3)",
        )?
        .execute(params![crate::events::first_event_id_at(before_ms), before_ms, i64::from(limit)])?;
    Ok(deleted as u64)
}

/// Stores the next plugin version of a tenant and activates it.
/// Deletes a tenant's (?1) versions beyond the newest ?3, ranking first the new version (?2)
/// and the active one, so neither is ever deleted while the cap is at least 2.
const PRUNE_PLUGINS: &str = "DELETE FROM plugins WHERE tenant_id = ?1 AND version IN (
    SELECT version FROM (
        SELECT p.version, ROW_NUMBER() OVER (ORDER BY
            p.version = ?2 DESC,
            p.version = COALESCE((SELECT a.version FROM plugin_active a WHERE a.tenant_id = ?1), 0) DESC,
            p.version DESC) AS keep_rank
        FROM plugins p WHERE p.tenant_id = ?1)
    WHERE keep_rank > ?3)";

pub fn save_plugin(
    conn: &Connection,
    tenant: &TenantId,
    upload: &PluginUpload,
    now_ms: i64,
) -> Result<PluginVersion, StorageError> {
    let version: i64 = conn
        .prepare_cached("SELECT COALESCE(MAX(version), 0) + 1 FROM plugins WHERE tenant_id = ?1")?
        .query_row(params![tenant.as_str()], |row| row.get(0))?;
    conn.prepare_cached(
        "INSERT INTO plugins (tenant_id, version, sha256, wasm, config, uploaded_at, runtime) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![tenant.as_str(), version, upload.sha256, upload.wasm, upload.config, now_ms, upload.runtime])?;
    // Before the switch, so the version active until now is still the one the rule keeps.
    let max_versions = i64::try_from(upload.max_versions).unwrap_or(i64::MAX);
    conn.prepare_cached(PRUNE_PLUGINS)?.execute(params![tenant.as_str(), version, max_versions])?;
    set_active_plugin(conn, tenant, version)?;
    Ok(PluginVersion {
        version,
        sha256: upload.sha256.clone(),
        config: upload.config.clone(),
        runtime: upload.runtime.clone(),
        uploaded_at_ms: now_ms,
        active: true,
    })
}

fn set_active_plugin(conn: &Connection, tenant: &TenantId, version: i64) -> Result<(), StorageError> {
    conn.prepare_cached(
        "INSERT INTO plugin_active (tenant_id, version) VALUES (?1, ?2)
         ON CONFLICT (tenant_id) DO UPDATE SET version = excluded.version",
    )?
    .execute(params![tenant.as_str(), version])?;
    Ok(())
}

/// Activates a stored version (or 0, the built-in default); `None` if there is no such version.
pub fn activate_plugin(
    conn: &Connection,
    tenant: &TenantId,
    version: i64,
) -> Result<Option<PluginVersion>, StorageError> {
    if version == 0 {
        set_active_plugin(conn, tenant, 0)?;
        return Ok(Some(PluginVersion {
            version: 0,
            sha256: String::new(),
            config: String::new(),
            runtime: String::new(),
            uploaded_at_ms: 0,
            active: true,
        }));
    }
    let found = conn
        .prepare_cached(rows::STORED_PLUGIN_VERSION_SQL)?
        .query_row(params![tenant.as_str(), version], mapped(rows::plugin_version))
        .optional()?
        .transpose()?;
    let Some(found) = found else { return Ok(None) };
    set_active_plugin(conn, tenant, version)?;
    Ok(Some(found))
}
