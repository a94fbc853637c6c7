//! SQLite side of the Redis hot path ([`crate::storage::settle`]): settlement runs on the
//! writer thread in its own savepoint of a group commit, like every other write.

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension};
use sqlx::Row;

use super::SqliteStorage;
use crate::engine::{Mode, ResourceKey, ResourceState, TenantId};
use crate::storage::settle::{move_target, reserved_qty, SettleRecord, SettleStore, Settled, SettlementFailure};
use crate::storage::{ContentType, IdempotencyRequest, Idempotent, StorageError, StoredResponse};
use crate::time::Timestamp;

/// A tenant's settlement failures, newest first (both backends; `$n` binds on both).
pub(crate) const FAILURES_SQL: &str = "SELECT resource_key, request_id, order_id, idempotency_key, qty, reason,
        available, at
    FROM settlement_failures WHERE tenant_id = $1 ORDER BY at DESC, request_id LIMIT $2";
/// Every redis-mode resource (both backends).
pub(crate) const REDIS_RESOURCES_SQL: &str = "SELECT tenant_id, key FROM resources WHERE mode = 'redis' LIMIT $1";

/// The guarded UPDATEs of a settled deduction and reservation. Unlike an order they do not
/// look at `status`: the sale happened in Redis while the resource was active; only stock may
/// refuse it.
const DEDUCT_SQL: &str = "UPDATE resources SET available = available - ?1, consumed = consumed + ?1,
        version = version + 1, updated_at = ?2
    WHERE tenant_id = ?3 AND key = ?4 AND available >= ?1
    RETURNING available, reserved, consumed, version";
const RESERVE_SQL: &str = "UPDATE resources SET available = available - ?1, reserved = reserved + ?1,
        version = version + 1, updated_at = ?2
    WHERE tenant_id = ?3 AND key = ?4 AND available >= ?1
    RETURNING available, reserved, consumed, version";
/// A reservation made in Redis leaving `reserved`: to consumed (confirm) or back to available.
const CONFIRM_SQL: &str = "UPDATE resources SET reserved = reserved - ?1, consumed = consumed + ?1,
        version = version + 1, updated_at = ?2
    WHERE tenant_id = ?3 AND key = ?4 AND reserved >= ?1
    RETURNING available, reserved, consumed, version";
const RETURN_SQL: &str = "UPDATE resources SET reserved = reserved - ?1, available = available + ?1,
        version = version + 1, updated_at = ?2
    WHERE tenant_id = ?3 AND key = ?4 AND reserved >= ?1
    RETURNING available, reserved, consumed, version";

type Counters4 = (i64, i64, i64, i64);

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
    match move_target(r.op()) {
        Some((to, op)) => settle_move(conn, r, to, op, now_ms),
        None => settle_take(conn, r, now_ms),
    }
}

fn guarded(
    conn: &Connection,
    sql: &str,
    qty: i64,
    now_ms: i64,
    r: &SettleRecord,
) -> Result<Option<Counters4>, StorageError> {
    Ok(conn
        .prepare_cached(sql)?
        .query_row(params![qty, now_ms, r.t, r.k], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)))
        .optional()?)
}

#[allow(clippy::too_many_arguments)]
fn ledger_row(
    conn: &Connection,
    r: &SettleRecord,
    op: &str,
    qty: i64,
    request_id: &str,
    after: Counters4,
    plugin_version: Option<i64>,
    now_ms: i64,
) -> Result<(), StorageError> {
    let (available, reserved, consumed, version) = after;
    conn.prepare_cached(
        "INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                             available_after, reserved_after, consumed_after, version_after, plugin_version, at)
         VALUES (?1, ?2, 0, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
    )?
    .execute(params![
        r.t,
        r.k,
        op,
        qty,
        request_id,
        r.oid,
        r.rsv,
        available,
        reserved,
        consumed,
        version,
        plugin_version,
        now_ms
    ])?;
    Ok(())
}

fn record_failure(
    conn: &Connection,
    r: &SettleRecord,
    qty: i64,
    reason: &str,
    now_ms: i64,
) -> Result<(), StorageError> {
    let available: i64 = conn
        .prepare_cached("SELECT available FROM resources WHERE tenant_id = ?1 AND key = ?2")?
        .query_row(params![r.t, r.k], |row| row.get(0))
        .optional()?
        .unwrap_or(0);
    conn.prepare_cached(
        "INSERT INTO settlement_failures (tenant_id, resource_key, request_id, order_id, idempotency_key,
                                          qty, reason, available, at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) ON CONFLICT DO NOTHING",
    )?
    .execute(params![r.t, r.k, r.rid, r.oid, r.idem, qty, reason, available, now_ms])?;
    Ok(())
}

/// A deduction or a reservation Redis acknowledged.
fn settle_take(conn: &Connection, r: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
    let reserve = r.op() == "reserve";
    let after = guarded(conn, if reserve { RESERVE_SQL } else { DEDUCT_SQL }, r.q, now_ms, r)?;
    let settled = match after {
        Some(after) => {
            ledger_row(conn, r, r.op(), r.q, &r.rid, after, Some(r.pv), now_ms)?;
            if let (true, Some(id)) = (reserve, &r.rsv) {
                conn.prepare_cached(
                    "INSERT INTO reservations (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
                     VALUES (?1, ?2, ?3, 'held', ?4, ?5, ?6, ?6)",
                )?
                .execute(params![r.t, id, r.oid, r.lines.as_deref().unwrap_or("[]"), r.exp.unwrap_or(now_ms), r.at])?;
            }
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
            let found = conn
                .prepare_cached("SELECT 1 FROM resources WHERE tenant_id = ?1 AND key = ?2")?
                .query_row(params![r.t, r.k], |_| Ok(()))
                .optional()?;
            record_failure(conn, r, r.q, if found.is_some() { "insufficient" } else { "resource_not_found" }, now_ms)?;
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

/// A confirm, release or expiry of a reservation made in Redis. Its row must be settled first
/// (an error otherwise: the entry stays pending and is tried again).
fn settle_move(conn: &Connection, r: &SettleRecord, to: &str, op: &str, now_ms: i64) -> Result<Settled, StorageError> {
    let id = r.rsv.as_deref().ok_or_else(|| StorageError::Internal("a reservation move without its id".into()))?;
    let row: Option<(String, String)> = conn
        .prepare_cached("SELECT state, lines FROM reservations WHERE tenant_id = ?1 AND id = ?2")?
        .query_row(params![r.t, id], |row| Ok((row.get(0)?, row.get(1)?)))
        .optional()?;
    let Some((state, lines)) = row else {
        return Err(StorageError::Internal(format!("reservation {id} is not settled yet")));
    };
    let qty = reserved_qty(&lines)?;
    if state != "held" {
        if state == to {
            return Ok(Settled::Duplicate);
        }
        record_failure(conn, r, qty, &format!("reservation_{state}"), now_ms)?;
        return Ok(Settled::Refused);
    }
    conn.prepare_cached("UPDATE reservations SET state = ?1, updated_at = ?2 WHERE tenant_id = ?3 AND id = ?4")?
        .execute(params![to, now_ms, r.t, id])?;
    let sql = if op == "confirm" { CONFIRM_SQL } else { RETURN_SQL };
    let after = guarded(conn, sql, qty, now_ms, r)?
        .ok_or_else(|| StorageError::Internal(format!("resource of reservation {id} holds less than reserved")))?;
    ledger_row(conn, r, op, qty, id, after, None, now_ms)?;
    if let (Some(limit), false) = (&r.lim, op == "confirm") {
        conn.prepare_cached(
            "UPDATE user_limits SET used = used - ?1 WHERE tenant_id = ?2 AND key = ?3 AND used >= ?1",
        )?
        .execute(params![qty, r.t, limit])?;
    }
    Ok(Settled::Applied)
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
