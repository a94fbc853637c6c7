//! PostgreSQL side of the Redis hot path ([`crate::storage::settle`]). Settlement is a write of
//! the group-commit batcher like any other: it declares the resource row it updates, so batches
//! of several processes lock rows in one order, and it may run again if its batch is retried.
//! A record delivered to two consumers (one presumed dead, its entry reclaimed) is applied once:
//! each claims the record's request id in `redis_settled` first, and the second finds it taken.

use async_trait::async_trait;
use sqlx::{PgConnection, Row};

use super::{acquire, work, PgStorage};
use crate::engine::{Mode, ResourceKey, ResourceState, TenantId};
use crate::storage::settle::{move_target, reserved_qty, SettleRecord, SettleStore, Settled, SettlementFailure};
use crate::storage::sqlite::settle::{failure_of, outcome_of, parse_pair, FAILURES_SQL, REDIS_RESOURCES_SQL};
use crate::storage::{IdempotencyRequest, Idempotent, StorageError};

/// The guarded UPDATE of one settled change and its ledger row, in one statement (the INSERT
/// reads the UPDATE's RETURNING, so it writes a row exactly when the guard let the change
/// through). Unlike an order it does not look at `status`: the sale happened in Redis while the
/// resource was active; only the counters may refuse it.
/// $1 qty, $2 now, $3 tenant, $4 key, $5 ledger op, $6 request id, $7 order id,
/// $8 reservation id, $9 plugin version.
const fn change_sql(op: &str) -> &'static str {
    macro_rules! change {
        ($set:literal, $guard:literal) => {
            concat!(
                "WITH changed AS (UPDATE resources SET ",
                $set,
                ", version = version + 1, updated_at = $2 WHERE tenant_id = $3 AND key = $4 AND ",
                $guard,
                " RETURNING available, reserved, consumed, version)
                 INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                                     available_after, reserved_after, consumed_after, version_after, plugin_version, at)
                 SELECT $3, $4, 0, $5, $1, $6, $7, $8, available, reserved, consumed, version, $9, $2 FROM changed
                 RETURNING seq"
            )
        };
    }
    match op.as_bytes() {
        b"reserve" => change!("available = available - $1, reserved = reserved + $1", "available >= $1"),
        b"confirm" => change!("reserved = reserved - $1, consumed = consumed + $1", "reserved >= $1"),
        b"release" | b"expire" => change!("reserved = reserved - $1, available = available + $1", "reserved >= $1"),
        _ => change!("available = available - $1, consumed = consumed + $1", "available >= $1"),
    }
}

/// Applies one change with its ledger row; `false` when the guard refused it.
async fn change(
    conn: &mut PgConnection,
    r: &SettleRecord,
    op: &str,
    qty: i64,
    request_id: &str,
    plugin_version: Option<i64>,
    now_ms: i64,
) -> Result<bool, StorageError> {
    Ok(sqlx::query(change_sql(op))
        .bind(qty)
        .bind(now_ms)
        .bind(&r.t)
        .bind(&r.k)
        .bind(op)
        .bind(request_id)
        .bind(&r.oid)
        .bind(&r.rsv)
        .bind(plugin_version)
        .fetch_optional(&mut *conn)
        .await?
        .is_some())
}

async fn record_failure(
    conn: &mut PgConnection,
    r: &SettleRecord,
    qty: i64,
    reason: &str,
    now_ms: i64,
) -> Result<(), StorageError> {
    let available: Option<i64> =
        sqlx::query_scalar("SELECT available FROM resources WHERE tenant_id = $1 AND key = $2")
            .bind(&r.t)
            .bind(&r.k)
            .fetch_optional(&mut *conn)
            .await?;
    sqlx::query(
        "INSERT INTO settlement_failures (tenant_id, resource_key, request_id, order_id, idempotency_key,
                                          qty, reason, available, at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING",
    )
    .bind(&r.t)
    .bind(&r.k)
    .bind(&r.rid)
    .bind(&r.oid)
    .bind(&r.idem)
    .bind(qty)
    .bind(reason)
    .bind(available.unwrap_or(0))
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn settle_on(conn: &mut PgConnection, r: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
    // Claimed first: a second consumer settling the same entry waits here for the first one's
    // transaction, then finds the row and does nothing.
    let claimed = sqlx::query(
        "INSERT INTO redis_settled (tenant_id, resource_key, request_id, at) VALUES ($1, $2, $3, $4)
         ON CONFLICT DO NOTHING",
    )
    .bind(&r.t)
    .bind(&r.k)
    .bind(&r.rid)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if claimed == 0 {
        return Ok(Settled::Duplicate);
    }
    match move_target(r.op()) {
        Some((to, op)) => settle_move(conn, r, to, op, now_ms).await,
        None => settle_take(conn, r, now_ms).await,
    }
}

/// A deduction or a reservation Redis acknowledged.
async fn settle_take(conn: &mut PgConnection, r: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
    let settled = if change(conn, r, r.op(), r.q, &r.rid, Some(r.pv), now_ms).await? {
        if let (Some(id), "reserve") = (&r.rsv, r.op()) {
            sqlx::query(
                "INSERT INTO reservations (tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at)
                 VALUES ($1, $2, $3, 'held', $4, $5, $6, $6)",
            )
            .bind(&r.t)
            .bind(id)
            .bind(&r.oid)
            .bind(r.lines.as_deref().unwrap_or("[]"))
            .bind(r.exp.unwrap_or(now_ms))
            .bind(r.at)
            .execute(&mut *conn)
            .await?;
        }
        if let Some(limit) = &r.lim {
            // Redis enforced the limit; the database keeps the count for the record.
            sqlx::query(
                "INSERT INTO user_limits (tenant_id, key, used) VALUES ($1, $2, $3)
                 ON CONFLICT (tenant_id, key) DO UPDATE SET used = user_limits.used + EXCLUDED.used",
            )
            .bind(&r.t)
            .bind(limit)
            .bind(r.q)
            .execute(&mut *conn)
            .await?;
        }
        Settled::Applied
    } else {
        let found: Option<i32> = sqlx::query_scalar("SELECT 1 FROM resources WHERE tenant_id = $1 AND key = $2")
            .bind(&r.t)
            .bind(&r.k)
            .fetch_optional(&mut *conn)
            .await?;
        let reason = if found.is_some() { "insufficient" } else { "resource_not_found" };
        record_failure(conn, r, r.q, reason, now_ms).await?;
        Settled::Refused
    };
    // The client's answer, so a replay finds it even after Redis forgot it.
    sqlx::query(
        "INSERT INTO idempotency (tenant_id, key, request_hash, response_code, response_type, response_body, created_at)
         VALUES ($1, $2, $3, 201, 'json', $4, $5) ON CONFLICT DO NOTHING",
    )
    .bind(&r.t)
    .bind(&r.idem)
    .bind(&r.h)
    .bind(&r.body)
    .bind(r.at)
    .execute(&mut *conn)
    .await?;
    Ok(settled)
}

/// A confirm, release or expiry of a reservation made in Redis. Its row must be settled first
/// (an error otherwise: the entry stays pending and is tried again).
async fn settle_move(
    conn: &mut PgConnection,
    r: &SettleRecord,
    to: &str,
    op: &str,
    now_ms: i64,
) -> Result<Settled, StorageError> {
    let id = r.rsv.as_deref().ok_or_else(|| StorageError::Internal("a reservation move without its id".into()))?;
    let row: Option<(String, String)> =
        sqlx::query_as("SELECT state, lines FROM reservations WHERE tenant_id = $1 AND id = $2 FOR UPDATE")
            .bind(&r.t)
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
    let Some((state, lines)) = row else {
        return Err(StorageError::Internal(format!("reservation {id} is not settled yet")));
    };
    let qty = reserved_qty(&lines)?;
    if state != "held" {
        if state == to {
            return Ok(Settled::Duplicate);
        }
        record_failure(conn, r, qty, &format!("reservation_{state}"), now_ms).await?;
        return Ok(Settled::Refused);
    }
    sqlx::query("UPDATE reservations SET state = $1, updated_at = $2 WHERE tenant_id = $3 AND id = $4")
        .bind(to)
        .bind(now_ms)
        .bind(&r.t)
        .bind(id)
        .execute(&mut *conn)
        .await?;
    if !change(conn, r, op, qty, id, None, now_ms).await? {
        return Err(StorageError::Internal(format!("resource of reservation {id} holds less than reserved")));
    }
    if let (Some(limit), false) = (&r.lim, op == "confirm") {
        sqlx::query("UPDATE user_limits SET used = used - $1 WHERE tenant_id = $2 AND key = $3 AND used >= $1")
            .bind(qty)
            .bind(&r.t)
            .bind(limit)
            .execute(&mut *conn)
            .await?;
    }
    Ok(Settled::Applied)
}

#[async_trait]
impl SettleStore for PgStorage {
    async fn settle(&self, record: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
        let record = record.clone();
        let locks = vec![(record.t.clone(), record.k.clone())];
        self.submit(
            locks,
            work(move |conn| {
                let record = record.clone();
                Box::pin(async move { settle_on(conn, &record, now_ms).await })
            }),
        )
        .await
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
            .submit(
                vec![(t.to_string(), k.to_string())],
                work(move |conn| {
                    let (t, k) = (t.clone(), k.clone());
                    Box::pin(async move {
                        let done = sqlx::query(
                            "UPDATE resources SET mode = $1, updated_at = $2 WHERE tenant_id = $3 AND key = $4",
                        )
                        .bind(mode.as_str())
                        .bind(now_ms)
                        .bind(t.as_str())
                        .bind(k.as_str())
                        .execute(&mut *conn)
                        .await?;
                        Ok(done.rows_affected())
                    })
                }),
            )
            .await?;
        if updated == 0 {
            return Ok(None);
        }
        crate::storage::Storage::get_resource(self, tenant, key).await
    }

    async fn redis_resources(&self, limit: u32) -> Result<Vec<(TenantId, ResourceKey)>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let rows = sqlx::query(REDIS_RESOURCES_SQL).bind(i64::from(limit)).fetch_all(&mut *conn).await?;
        rows.iter().map(|row| parse_pair(row.try_get("tenant_id")?, row.try_get("key")?)).collect()
    }

    async fn stored_outcome(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
    ) -> Result<Option<Idempotent>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        // Only finished records: one still claimed by an in-flight database-path request has no
        // response yet, and that request will store its own.
        let row: Option<(String, i32, String, String)> = sqlx::query_as(
            "SELECT request_hash, response_code, response_type, response_body FROM idempotency
             WHERE tenant_id = $1 AND key = $2 AND response_code IS NOT NULL",
        )
        .bind(tenant.as_str())
        .bind(idem.key.as_str())
        .fetch_optional(&mut *conn)
        .await?;
        Ok(row.map(|(hash, code, kind, body)| outcome_of(idem, &hash, i64::from(code), &kind, body)))
    }

    async fn settlement_failures(&self, tenant: &TenantId, limit: u32) -> Result<Vec<SettlementFailure>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let rows: Vec<(String, String, String, String, i64, String, i64, i64)> =
            sqlx::query_as(FAILURES_SQL).bind(tenant.as_str()).bind(i64::from(limit)).fetch_all(&mut *conn).await?;
        Ok(rows.into_iter().map(failure_of).collect())
    }
}
