//! PostgreSQL side of redis mode ([`crate::storage::redis_store`]). Settlement is a write of
//! the group-commit batcher like any other: it declares the resource row it updates, so batches
//! of several processes lock rows in one order, and it may run again if its batch is retried.
//! A record delivered to two consumers (one presumed dead, its entry reclaimed) is applied once:
//! each claims the record's request id in `redis_settled` first, and the second finds it taken.

use async_trait::async_trait;

use super::port::PgPort;
use super::{acquire, work, PgStorage};
use crate::engine::{ResourceKey, TenantId};
use crate::storage::redis_store::{
    parse_pair, DeadLetter, RedisStore, SettleRecord, Settled, SettlementFailure, SettlementTable, DEAD_LETTERS_SQL,
    DEAD_LETTER_SQL, FAILURES_SQL, LEAVE_REDIS_SQL, LIMIT_SEED_SQL, REDIS_RESOURCES_SQL, TAKE_EPOCH_SQL,
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

    async fn settle_run(&self, records: Vec<SettleRecord>, now_ms: i64) -> Result<Vec<Settled>, StorageError> {
        let Some(first) = records.first() else { return Ok(Vec::new()) };
        let locks = vec![(first.t.clone(), first.k.clone())];
        let records = std::sync::Arc::new(records);
        self.submit(
            locks,
            work(move |conn| {
                let records = records.clone();
                Box::pin(
                    async move { crate::apply::settlement::settle_run(&mut PgPort::new(conn), &records, now_ms).await },
                )
            }),
        )
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
        self.submit(
            vec![(t.to_string(), k.to_string())],
            work(move |conn| {
                let (t, k) = (t.clone(), k.clone());
                Box::pin(async move {
                    Ok(sqlx::query_scalar::<_, i64>(TAKE_EPOCH_SQL)
                        .bind(into_redis)
                        .bind(now_ms)
                        .bind(t.as_str())
                        .bind(k.as_str())
                        .fetch_optional(&mut *conn)
                        .await?)
                })
            }),
        )
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
        self.submit(
            vec![(t.to_string(), k.to_string())],
            work(move |conn| {
                let (t, k) = (t.clone(), k.clone());
                Box::pin(async move {
                    let done = sqlx::query(LEAVE_REDIS_SQL)
                        .bind(epoch)
                        .bind(now_ms)
                        .bind(t.as_str())
                        .bind(k.as_str())
                        .execute(&mut *conn)
                        .await?;
                    Ok(done.rows_affected() == 1)
                })
            }),
        )
        .await
    }

    async fn redis_resources(&self, limit: u32) -> Result<Vec<(TenantId, ResourceKey)>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let rows = sqlx::query(REDIS_RESOURCES_SQL).bind(i64::from(limit)).fetch_all(&mut *conn).await?;
        rows.iter().map(|row| parse_pair(row.text("tenant_id")?, row.text("key")?)).collect()
    }

    async fn limit_seed(
        &self,
        tenant: &TenantId,
        limit: &str,
        resource: &ResourceKey,
    ) -> Result<(i64, i64), StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let row = sqlx::query(LIMIT_SEED_SQL)
            .bind(tenant.as_str())
            .bind(limit)
            .bind(resource.as_str())
            .fetch_one(&mut *conn)
            .await?;
        Ok((row.int("used")?, row.int("epoch")?))
    }

    async fn record_dead_letter(&self, letter: &DeadLetter, tenant: &str) -> Result<(), StorageError> {
        let mut conn = acquire(&self.pool).await?;
        sqlx::query(DEAD_LETTER_SQL)
            .bind(tenant)
            .bind(&letter.key)
            .bind(&letter.entry_id)
            .bind(&letter.payload)
            .bind(&letter.reason)
            .bind(letter.at.0)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn dead_letters(&self, tenant: &TenantId, limit: u32) -> Result<Vec<DeadLetter>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let rows =
            sqlx::query(DEAD_LETTERS_SQL).bind(tenant.as_str()).bind(i64::from(limit)).fetch_all(&mut *conn).await?;
        rows.iter().map(|row| rows::dead_letter(row)).collect()
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
