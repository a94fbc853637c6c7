//! SQLite side of the Redis hot path ([`crate::storage::settle`]): settlement runs on the
//! writer thread in its own savepoint of a group commit, like every other write.

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension};
use sqlx::Row;

use super::SqliteStorage;
use crate::engine::{Mode, ResourceKey, ResourceState, TenantId};
use crate::storage::settle::{SettleRecord, SettleStore, Settled, SettlementFailure};
use crate::storage::{ContentType, IdempotencyRequest, Idempotent, StorageError, StoredResponse};
use crate::time::Timestamp;

/// A tenant's settlement failures, newest first (both backends; `$n` binds on both).
pub(crate) const FAILURES_SQL: &str = "SELECT resource_key, request_id, order_id, idempotency_key, qty, reason,
        available, at
    FROM settlement_failures WHERE tenant_id = $1 ORDER BY at DESC, request_id LIMIT $2";
/// Every redis-mode resource (both backends).
pub(crate) const REDIS_RESOURCES_SQL: &str = "SELECT tenant_id, key FROM resources WHERE mode = 'redis' LIMIT $1";

/// The guarded UPDATE of a settled deduction. Unlike an order it does not look at `status`:
/// the sale happened in Redis while the resource was active; only stock may refuse it.
const SETTLE_SQL: &str = "UPDATE resources SET available = available - ?1, consumed = consumed + ?1,
        version = version + 1, updated_at = ?2
    WHERE tenant_id = ?3 AND key = ?4 AND available >= ?1
    RETURNING available, reserved, consumed, version";

fn settle_on(conn: &Connection, r: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
    let claimed = conn
        .prepare_cached(
            "INSERT INTO redis_settled (tenant_id, resource_key, request_id, at) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT DO NOTHING",
        )?
        .execute(params![r.t, r.k, r.rid, now_ms])?;
    if claimed == 0 {
        return Ok(Settled::Duplicate);
    }
    let after: Option<(i64, i64, i64, i64)> = conn
        .prepare_cached(SETTLE_SQL)?
        .query_row(params![r.q, now_ms, r.t, r.k], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)))
        .optional()?;
    let settled = match after {
        Some((available, reserved, consumed, version)) => {
            conn.prepare_cached(
                "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                                     available_after, reserved_after, consumed_after, version_after, plugin_version, at)
                 VALUES (?1, ?2, 0, 'deduct', ?3, ?4, ?5, NULL, ?6, ?7, ?8, ?9, ?10, ?11)",
            )?
            .execute(params![r.t, r.k, r.q, r.rid, r.oid, available, reserved, consumed, version, r.pv, now_ms])?;
            if let Some(limit) = &r.lim {
                // Redis enforced the limit; the database keeps the count for the record.
                conn.prepare_cached(
                    "INSERT INTO user_limits (tenant_id, key, used) VALUES (?1, ?2, ?3)
                     ON CONFLICT (tenant_id, key) DO UPDATE SET used = used + excluded.used",
                )?
                .execute(params![r.t, limit, r.q])?;
            }
            Settled::Applied
        }
        None => {
            let available: Option<i64> = conn
                .prepare_cached("SELECT available FROM resources WHERE tenant_id = ?1 AND key = ?2")?
                .query_row(params![r.t, r.k], |row| row.get(0))
                .optional()?;
            let reason = if available.is_some() { "insufficient" } else { "resource_not_found" };
            conn.prepare_cached(
                "INSERT INTO settlement_failures (tenant_id, resource_key, request_id, order_id, idempotency_key,
                                                  qty, reason, available, at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) ON CONFLICT DO NOTHING",
            )?
            .execute(params![
                r.t,
                r.k,
                r.rid,
                r.oid,
                r.idem,
                r.q,
                reason,
                available.unwrap_or(0),
                now_ms
            ])?;
            Settled::Refused
        }
    };
    // The client's answer, so a replay finds it even after Redis forgot it.
    conn.prepare_cached(
        "INSERT INTO idempotency (tenant_id, key, request_hash, response_code, response_type, response_body, created_at)
         VALUES (?1, ?2, ?3, 201, 'json', ?4, ?5) ON CONFLICT DO NOTHING",
    )?
    .execute(params![r.t, r.idem, r.h, r.body, r.at])?;
    Ok(settled)
}

#[async_trait]
impl SettleStore for SqliteStorage {
    async fn settle(&self, record: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
        let record = record.clone();
        self.writer()?.submit(move |conn| settle_on(conn, &record, now_ms)).await
    }

    async fn set_resource_mode(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        mode: Mode,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError> {
        let (t, k) = (tenant.clone(), key.clone());
        let updated = self
            .writer()?
            .submit(move |conn| {
                Ok(conn
                    .prepare_cached(
                        "UPDATE resources SET mode = ?1, updated_at = ?2 WHERE tenant_id = ?3 AND key = ?4",
                    )?
                    .execute(params![mode.as_str(), now_ms, t.as_str(), k.as_str()])?)
            })
            .await?;
        if updated == 0 {
            return Ok(None);
        }
        crate::storage::Storage::get_resource(self, tenant, key).await
    }

    async fn redis_resources(&self, limit: u32) -> Result<Vec<(TenantId, ResourceKey)>, StorageError> {
        let rows = sqlx::query(REDIS_RESOURCES_SQL).bind(i64::from(limit)).fetch_all(&self.read).await?;
        rows.iter().map(|row| parse_pair(row.try_get("tenant_id")?, row.try_get("key")?)).collect()
    }

    async fn stored_outcome(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
    ) -> Result<Option<Idempotent>, StorageError> {
        let row: Option<(String, i64, String, String)> = sqlx::query_as(
            "SELECT request_hash, response_code, response_type, response_body FROM idempotency
             WHERE tenant_id = $1 AND key = $2",
        )
        .bind(tenant.as_str())
        .bind(idem.key.as_str())
        .fetch_optional(&self.read)
        .await?;
        Ok(row.map(|(hash, code, kind, body)| outcome_of(idem, &hash, code, &kind, body)))
    }

    async fn settlement_failures(&self, tenant: &TenantId, limit: u32) -> Result<Vec<SettlementFailure>, StorageError> {
        let rows: Vec<(String, String, String, String, i64, String, i64, i64)> =
            sqlx::query_as(FAILURES_SQL).bind(tenant.as_str()).bind(i64::from(limit)).fetch_all(&self.read).await?;
        Ok(rows.into_iter().map(failure_of).collect())
    }
}

/// A `(tenant, key)` pair as stored.
pub(crate) fn parse_pair(tenant: String, key: String) -> Result<(TenantId, ResourceKey), StorageError> {
    let corrupt = |e: crate::engine::InvalidValue| StorageError::Internal(format!("stored resource: {e}"));
    Ok((TenantId::parse(tenant).map_err(corrupt)?, ResourceKey::parse(key).map_err(corrupt)?))
}

/// A stored idempotency record judged against this request.
pub(crate) fn outcome_of(idem: &IdempotencyRequest, hash: &str, code: i64, kind: &str, body: String) -> Idempotent {
    if hash != idem.request_hash {
        return Idempotent::Mismatch;
    }
    let status = u16::try_from(code).unwrap_or(500);
    Idempotent::Replayed(StoredResponse { status, content_type: ContentType::from_db(kind), body })
}

/// A settlement failure row as selected by both backends.
pub(crate) fn failure_of(row: (String, String, String, String, i64, String, i64, i64)) -> SettlementFailure {
    let (key, request_id, order_id, idempotency_key, qty, reason, available, at) = row;
    SettlementFailure { key, request_id, order_id, idempotency_key, qty, reason, available, at: Timestamp(at) }
}
