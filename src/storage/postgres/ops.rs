//! The PostgreSQL writes that are not business orchestration (tenants, keys, plugins, purges),
//! each run on the batcher's connection inside its own savepoint of a group-commit transaction
//! (see [`super`]); a write may be run again from the start if its batch is retried, so none
//! keeps anything between runs. Orders, reservations, adjustments and resources go through
//! [`crate::apply`] over [`super::port::PgPort`].

use sqlx::PgConnection;

use crate::engine::TenantId;
use crate::ratelimit::RateLimit;
use crate::storage::{rows, rules};
use crate::storage::{Insert, NewApiKey, PluginUpload, PluginVersion, StorageError};

pub async fn create_tenant(
    conn: &mut PgConnection,
    id: &TenantId,
    name: &str,
    rate_limit: Option<RateLimit>,
    key: &NewApiKey,
    now_ms: i64,
) -> Result<Insert, StorageError> {
    let (rps, burst) = rules::rate_limit_columns(rate_limit);
    let created = sqlx::query(
        "INSERT INTO tenants (id, name, created_at, rate_limit_rps, rate_limit_burst) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (id) DO NOTHING RETURNING id",
    )
    .bind(id.as_str())
    .bind(name)
    .bind(now_ms)
    .bind(rps)
    .bind(burst)
    .fetch_optional(&mut *conn)
    .await?;
    if created.is_none() {
        return Ok(Insert::AlreadyExists);
    }
    sqlx::query("INSERT INTO api_keys (id, tenant_id, hash, created_at) VALUES ($1, $2, $3, $4)")
        .bind(&key.id)
        .bind(id.as_str())
        .bind(&key.hash)
        .bind(now_ms)
        .execute(&mut *conn)
        .await?;
    Ok(Insert::Created)
}

pub async fn add_api_key(
    conn: &mut PgConnection,
    tenant: &TenantId,
    key: &NewApiKey,
    now_ms: i64,
) -> Result<Option<()>, StorageError> {
    let added = sqlx::query(
        "INSERT INTO api_keys (id, tenant_id, hash, created_at) SELECT $1, id, $2, $3 FROM tenants WHERE id = $4",
    )
    .bind(&key.id)
    .bind(&key.hash)
    .bind(now_ms)
    .bind(tenant.as_str())
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok((added == 1).then_some(()))
}

pub async fn revoke_api_key(
    conn: &mut PgConnection,
    tenant: &TenantId,
    key_id: &str,
    now_ms: i64,
) -> Result<Option<()>, StorageError> {
    let revoked =
        sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND tenant_id = $3 AND revoked_at IS NULL")
            .bind(now_ms)
            .bind(key_id)
            .bind(tenant.as_str())
            .execute(&mut *conn)
            .await?
            .rows_affected();
    Ok((revoked == 1).then_some(()))
}

pub async fn ensure_config_tenant(
    conn: &mut PgConnection,
    id: &TenantId,
    name: &str,
    rate_limit: Option<RateLimit>,
    key_hash: &str,
    now_ms: i64,
) -> Result<(), StorageError> {
    let (rps, burst) = rules::rate_limit_columns(rate_limit);
    // Upserts, so several processes starting on one database at once all succeed.
    sqlx::query(
        "INSERT INTO tenants (id, name, created_at, rate_limit_rps, rate_limit_burst) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (id) DO UPDATE SET name = excluded.name, rate_limit_rps = excluded.rate_limit_rps,
             rate_limit_burst = excluded.rate_limit_burst",
    )
    .bind(id.as_str())
    .bind(name)
    .bind(now_ms)
    .bind(rps)
    .bind(burst)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO api_keys (id, tenant_id, hash, created_at) VALUES ($1, $2, $3, $4)
         ON CONFLICT (id) DO UPDATE SET hash = excluded.hash, revoked_at = NULL",
    )
    .bind(format!("cfg-{id}"))
    .bind(id.as_str())
    .bind(key_hash)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub async fn purge_idempotency(conn: &mut PgConnection, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
    purge(
        conn,
        // Oldest first, which also makes the plan walk `idempotency_by_age` from its start
        // whatever the statistics say, rather than read the table until it finds old rows.
        "DELETE FROM idempotency WHERE (tenant_id, key) IN
           (SELECT tenant_id, key FROM idempotency WHERE created_at < $1 ORDER BY created_at LIMIT $2
            FOR UPDATE SKIP LOCKED)",
        before_ms,
        limit,
    )
    .await
}

/// Runs a purge statement binding `$1` to `before_ms` and `$2` to `limit`; returns the rows deleted.
pub async fn purge(conn: &mut PgConnection, sql: &str, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let deleted = sqlx::query(sql).bind(before_ms).bind(i64::from(limit)).execute(&mut *conn).await?.rows_affected();
    Ok(deleted)
}

/// Deletes a tenant's ($1) versions beyond the newest $3, ranking first the new version ($2)
/// and the active one, so neither is ever deleted while the cap is at least 2.
const PRUNE_PLUGINS: &str = "DELETE FROM plugins WHERE tenant_id = $1 AND version IN (
    SELECT version FROM (
        SELECT p.version, ROW_NUMBER() OVER (ORDER BY
            p.version = $2 DESC,
            p.version = COALESCE((SELECT a.version FROM plugin_active a WHERE a.tenant_id = $1), 0) DESC,
            p.version DESC) AS keep_rank
        FROM plugins p WHERE p.tenant_id = $1) ranked
    WHERE keep_rank > $3)";

/// Stores the next plugin version of a tenant, prunes beyond the cap, and activates it. The
/// tenant row is locked first, so two processes uploading at once number their versions one
/// after the other, and an activation (which share-locks the row) never picks a version the
/// prune is deleting.
pub async fn save_plugin(
    conn: &mut PgConnection,
    tenant: &TenantId,
    upload: &PluginUpload,
    now_ms: i64,
) -> Result<PluginVersion, StorageError> {
    sqlx::query("SELECT 1 FROM tenants WHERE id = $1 FOR UPDATE").bind(tenant.as_str()).execute(&mut *conn).await?;
    let version: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(version), 0) + 1 FROM plugins WHERE tenant_id = $1")
        .bind(tenant.as_str())
        .fetch_one(&mut *conn)
        .await?;
    sqlx::query(
        "INSERT INTO plugins (tenant_id, version, sha256, wasm, config, uploaded_at, runtime) VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(tenant.as_str())
    .bind(version)
    .bind(&upload.sha256)
    .bind(&upload.wasm)
    .bind(&upload.config)
    .bind(now_ms)
    .bind(&upload.runtime)
    .execute(&mut *conn)
    .await?;
    // Before the switch, so the version active until now is still the one the rule keeps.
    let max_versions = i64::try_from(upload.max_versions).unwrap_or(i64::MAX);
    sqlx::query(PRUNE_PLUGINS).bind(tenant.as_str()).bind(version).bind(max_versions).execute(&mut *conn).await?;
    set_active_plugin(conn, tenant, version).await?;
    Ok(PluginVersion {
        version,
        sha256: upload.sha256.clone(),
        config: upload.config.clone(),
        runtime: upload.runtime.clone(),
        uploaded_at_ms: now_ms,
        active: true,
    })
}

async fn set_active_plugin(conn: &mut PgConnection, tenant: &TenantId, version: i64) -> Result<(), StorageError> {
    sqlx::query(
        "INSERT INTO plugin_active (tenant_id, version) VALUES ($1, $2)
         ON CONFLICT (tenant_id) DO UPDATE SET version = EXCLUDED.version",
    )
    .bind(tenant.as_str())
    .bind(version)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Activates a stored version (or 0, the built-in default); `None` if there is no such version.
pub async fn activate_plugin(
    conn: &mut PgConnection,
    tenant: &TenantId,
    version: i64,
) -> Result<Option<PluginVersion>, StorageError> {
    if version == 0 {
        set_active_plugin(conn, tenant, 0).await?;
        return Ok(Some(PluginVersion {
            version: 0,
            sha256: String::new(),
            config: String::new(),
            runtime: String::new(),
            uploaded_at_ms: 0,
            active: true,
        }));
    }
    // Waits for an upload of this tenant in flight, so the version is not one it is pruning.
    sqlx::query("SELECT 1 FROM tenants WHERE id = $1 FOR SHARE").bind(tenant.as_str()).execute(&mut *conn).await?;
    let found = sqlx::query(rows::STORED_PLUGIN_VERSION_SQL)
        .bind(tenant.as_str())
        .bind(version)
        .fetch_optional(&mut *conn)
        .await?;
    let Some(found) = found else { return Ok(None) };
    let found = rows::plugin_version(&found)?;
    set_active_plugin(conn, tenant, version).await?;
    Ok(Some(found))
}
