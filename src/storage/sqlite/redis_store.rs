//! SQLite side of redis mode ([`crate::storage::redis_store`]): settlement runs on the writer
//! thread in its own savepoint of a group commit, like every other write.

use super::port::{all, SqlitePort};
use super::SqliteStorage;
use crate::apply::port::run_now;
use crate::engine::{Mode, ResourceKey, ResourceState, TenantId};
use crate::storage::redis_store::{
    parse_pair, RedisStore, SettleRecord, Settled, SettlementFailure, SettlementTable, FAILURES_SQL,
    REDIS_RESOURCES_SQL,
};
use crate::storage::rows;
use crate::storage::StorageError;
use async_trait::async_trait;
use rusqlite::params;

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
        let pairs = self
            .readers()
            .snapshot(move |conn| {
                let sql = REDIS_RESOURCES_SQL.replace('$', "?");
                all(&mut conn.prepare_cached(&sql)?, params![i64::from(limit)], |row| {
                    Ok((row.text("tenant_id")?, row.text("key")?))
                })
            })
            .await?;
        pairs.into_iter().map(|(tenant, key)| parse_pair(tenant, key)).collect()
    }

    async fn settlement_failures(&self, tenant: &TenantId, limit: u32) -> Result<Vec<SettlementFailure>, StorageError> {
        let tenant = tenant.clone();
        self.readers()
            .snapshot(move |conn| {
                let sql = FAILURES_SQL.replace('$', "?");
                all(
                    &mut conn.prepare_cached(&sql)?,
                    params![tenant.as_str(), i64::from(limit)],
                    rows::settlement_failure,
                )
            })
            .await
    }

    async fn purge_settlement(&self, table: SettlementTable, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.writer()?
            .submit(move |conn| {
                let sql = table.purge_sql("").replace('$', "?");
                Ok(conn.prepare_cached(&sql)?.execute(params![before_ms, i64::from(limit)])? as u64)
            })
            .await
    }
}
