//! PostgreSQL side of redis mode ([`crate::storage::redis_store`]). Settlement is a write of
//! the group-commit batcher like any other: it declares the resource row it updates, so batches
//! of several processes lock rows in one order, and it may run again if its batch is retried.
//! A record delivered to two consumers (one presumed dead, its entry reclaimed) is applied once:
//! each claims the record's request id in `redis_settled` first, and the second finds it taken.

use async_trait::async_trait;

use super::batcher::work;
use super::port::PgPort;
use super::{acquire, PgStorage};
use crate::engine::{Mode, ResourceKey, ResourceState, TenantId};
use crate::storage::redis_store::{
    parse_pair, RedisStore, SettleRecord, Settled, SettlementFailure, SettlementTable, FAILURES_SQL,
    REDIS_RESOURCES_SQL,
};
use crate::storage::rows::{self, Columns};
use crate::storage::StorageError;

#[async_trait]
impl RedisStore for PgStorage {
    async fn settle(&self, record: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
        let record = record.clone();
        let locks = vec![(record.t.clone(), record.k.clone())];
        self.submit(
            locks,
            work(move |conn| {
                let record = record.clone();
                Box::pin(async move { crate::apply::settlement::settle(&mut PgPort::new(conn), &record, now_ms).await })
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
        rows.iter().map(|row| parse_pair(row.text("tenant_id")?, row.text("key")?)).collect()
    }

    async fn settlement_failures(&self, tenant: &TenantId, limit: u32) -> Result<Vec<SettlementFailure>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let rows = sqlx::query(FAILURES_SQL).bind(tenant.as_str()).bind(i64::from(limit)).fetch_all(&mut *conn).await?;
        rows.iter().map(|row| rows::settlement_failure(row)).collect()
    }

    async fn purge_settlement(&self, table: SettlementTable, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
        let sql = table.purge_sql(" FOR UPDATE SKIP LOCKED");
        self.submit(
            Vec::new(),
            work(move |conn| {
                let sql = sql.clone();
                Box::pin(async move { super::ops::purge(conn, &sql, before_ms, limit).await })
            }),
        )
        .await
    }
}
