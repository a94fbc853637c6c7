//! PostgreSQL side of the Redis hot path ([`crate::storage::settle`]). Settlement is a write of
//! the group-commit batcher like any other: it declares the resource row it updates, so batches
//! of several processes lock rows in one order, and it may run again if its batch is retried.
//! A record delivered to two consumers (one presumed dead, its entry reclaimed) is applied once:
//! each claims the record's request id in `redis_settled` first, and the second finds it taken.

use async_trait::async_trait;
use sqlx::{PgConnection, Row};

use super::{acquire, work, PgStorage};
use crate::engine::{Mode, ResourceKey, ResourceState, TenantId};
use crate::storage::settle::{SettleRecord, SettleStore, Settled, SettlementFailure};
use crate::storage::sqlite::settle::{failure_of, outcome_of, parse_pair, FAILURES_SQL, REDIS_RESOURCES_SQL};
use crate::storage::{IdempotencyRequest, Idempotent, StorageError};

/// The guarded UPDATE of a settled deduction and its ledger row, in one statement. Unlike an
/// order it does not look at `status`: the sale happened in Redis while the resource was
/// active; only stock may refuse it.
const SETTLE_SQL: &str = "WITH changed AS (
        UPDATE resources SET available = available - $1, consumed = consumed + $1,
            version = version + 1, updated_at = $2
        WHERE tenant_id = $3 AND key = $4 AND available >= $1
        RETURNING available, reserved, consumed, version)
     INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                         available_after, reserved_after, consumed_after, version_after, plugin_version, at)
     SELECT $3, $4, 0, 'deduct', $1, $5, $6, NULL, available, reserved, consumed, version, $7, $2 FROM changed
     RETURNING seq";

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
    let applied = sqlx::query(SETTLE_SQL)
        .bind(r.q)
        .bind(now_ms)
        .bind(&r.t)
        .bind(&r.k)
        .bind(&r.rid)
        .bind(&r.oid)
        .bind(r.pv)
        .fetch_optional(&mut *conn)
        .await?
        .is_some();
    let settled = if applied {
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
        let available: Option<i64> =
            sqlx::query_scalar("SELECT available FROM resources WHERE tenant_id = $1 AND key = $2")
                .bind(&r.t)
                .bind(&r.k)
                .fetch_optional(&mut *conn)
                .await?;
        let reason = if available.is_some() { "insufficient" } else { "resource_not_found" };
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
        .bind(r.q)
        .bind(reason)
        .bind(available.unwrap_or(0))
        .bind(now_ms)
        .execute(&mut *conn)
        .await?;
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
