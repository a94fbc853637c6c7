//! SQLite side of redis mode ([`crate::storage::redis_store`]): settlement runs on the writer
//! thread in its own savepoint of a group commit, like every other write.

use async_trait::async_trait;
use rusqlite::params;
use sqlx::Row;

use super::port::SqlitePort;
use super::SqliteStorage;
use crate::apply::port::run_now;
use crate::engine::{Mode, ResourceKey, ResourceState, TenantId};
use crate::storage::redis_store::{
    failure_of, parse_pair, RedisStore, SettleRecord, Settled, SettlementFailure, FAILURES_SQL, REDIS_RESOURCES_SQL,
};
use crate::storage::StorageError;

#[async_trait]
impl RedisStore for SqliteStorage {
    async fn settle(&self, record: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
        let record = record.clone();
        self.writer()?
            .submit(move |conn| run_now(crate::apply::settlement::settle(&mut SqlitePort::new(conn), &record, now_ms)))
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

    async fn settlement_failures(&self, tenant: &TenantId, limit: u32) -> Result<Vec<SettlementFailure>, StorageError> {
        let rows: Vec<(String, String, String, String, i64, String, i64, i64)> =
            sqlx::query_as(FAILURES_SQL).bind(tenant.as_str()).bind(i64::from(limit)).fetch_all(&self.read).await?;
        Ok(rows.into_iter().map(failure_of).collect())
    }
}
