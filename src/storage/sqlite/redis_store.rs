//! SQLite side of redis mode ([`crate::storage::redis_store`]): settlement runs on the writer
//! thread in its own savepoint of a group commit, like every other write.

use super::port::{all, SqlitePort};
use super::SqliteStorage;
use crate::apply::port::run_now;
use crate::engine::{ResourceKey, TenantId};
use crate::storage::redis_store::{
    parse_pair, DeadLetter, RedisStore, SettleRecord, Settled, SettlementFailure, SettlementTable, DEAD_LETTERS_SQL,
    DEAD_LETTER_SQL, FAILURES_SQL, LEAVE_REDIS_SQL, LIMIT_SEED_SQL, REDIS_RESOURCES_SQL, TAKE_EPOCH_SQL,
};
use crate::storage::rows;
use crate::storage::StorageError;
use async_trait::async_trait;
use rusqlite::{params, OptionalExtension};

#[async_trait]
impl RedisStore for SqliteStorage {
    async fn settle(&self, record: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
        let record = record.clone();
        self.writer()?
            .submit(move |conn| run_now(crate::apply::settlement::settle(&mut SqlitePort::new(conn), &record, now_ms)))
            .await
    }

    async fn settle_run(&self, records: Vec<SettleRecord>, now_ms: i64) -> Result<Vec<Settled>, StorageError> {
        self.writer()?
            .submit(move |conn| {
                run_now(crate::apply::settlement::settle_run(&mut SqlitePort::new(conn), &records, now_ms))
            })
            .await
    }

    async fn take_epoch(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        into_redis: bool,
        now_ms: i64,
    ) -> Result<Option<i64>, StorageError> {
        let (t, k) = (tenant.clone(), key.clone());
        self.writer()?
            .submit(move |conn| {
                let sql = TAKE_EPOCH_SQL.replace('$', "?");
                Ok(conn
                    .prepare_cached(&sql)?
                    .query_row(params![into_redis, now_ms, t.as_str(), k.as_str()], |row| row.get::<_, i64>(0))
                    .optional()?)
            })
            .await
    }

    async fn leave_redis(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        epoch: i64,
        now_ms: i64,
    ) -> Result<bool, StorageError> {
        let (t, k) = (tenant.clone(), key.clone());
        self.writer()?
            .submit(move |conn| {
                let sql = LEAVE_REDIS_SQL.replace('$', "?");
                Ok(conn.prepare_cached(&sql)?.execute(params![epoch, now_ms, t.as_str(), k.as_str()])? == 1)
            })
            .await
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

    async fn limit_seed(
        &self,
        tenant: &TenantId,
        limit: &str,
        resource: &ResourceKey,
    ) -> Result<(i64, i64), StorageError> {
        let (tenant, limit, resource) = (tenant.clone(), limit.to_string(), resource.clone());
        self.readers()
            .snapshot(move |conn| {
                let sql = LIMIT_SEED_SQL.replace('$', "?");
                Ok(conn.prepare_cached(&sql)?.query_row(params![tenant.as_str(), limit, resource.as_str()], |row| {
                    Ok((row.get(0)?, row.get(1)?))
                })?)
            })
            .await
    }

    async fn record_dead_letter(&self, letter: &DeadLetter, tenant: &str) -> Result<(), StorageError> {
        let (letter, tenant) = (letter.clone(), tenant.to_string());
        self.writer()?
            .submit(move |conn| {
                let sql = DEAD_LETTER_SQL.replace('$', "?");
                conn.prepare_cached(&sql)?.execute(params![
                    tenant,
                    letter.key,
                    letter.entry_id,
                    letter.payload,
                    letter.reason,
                    letter.at.0
                ])?;
                Ok(())
            })
            .await
    }

    async fn dead_letters(&self, tenant: &TenantId, limit: u32) -> Result<Vec<DeadLetter>, StorageError> {
        let tenant = tenant.clone();
        self.readers()
            .snapshot(move |conn| {
                let sql = DEAD_LETTERS_SQL.replace('$', "?");
                all(&mut conn.prepare_cached(&sql)?, params![tenant.as_str(), i64::from(limit)], rows::dead_letter)
            })
            .await
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
