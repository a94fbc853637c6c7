//! What storage does for redis mode ([`crate::redis_mode`]): settle one record of a resource's
//! Redis stream into the database (written once, in [`crate::apply::settlement`], with the same
//! guarded change, ledger row and unique request id as the database path); switch a resource's
//! mode; and answer the reads redis mode needs (which resources are in redis mode, an
//! idempotency key's stored outcome, the settlement failures of a tenant).
//!
//! A separate trait, a supertrait of [`super::Storage`], so each backend implements it in its
//! own `redis_store.rs` beside the rest of its code.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::StorageError;
use crate::engine::{LedgerOp, Mode, ReservationState, ResourceKey, ResourceState, TenantId};

/// One success Redis acknowledged, as its Lua script appended it to the resource's stream.
/// Field names are short: one record per sale crosses Redis twice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettleRecord {
    /// Tenant.
    pub t: String,
    /// Resource key.
    pub k: String,
    /// Quantity deducted (positive).
    pub q: i64,
    /// The business action's request id: the ledger's unique identity.
    pub rid: String,
    /// The client's order id.
    pub oid: String,
    /// The idempotency key and the request's hash, so the database can replay the outcome
    /// even after Redis has forgotten it.
    pub idem: String,
    pub h: String,
    /// The response the client received (stored as the idempotency record).
    pub body: String,
    /// The per-user limit key the deduction counted against, if any.
    pub lim: Option<String>,
    /// The plan's planner version, for the ledger row.
    pub pv: i64,
    /// When Redis acknowledged it (Unix ms).
    pub at: i64,
    /// `deduct` (when absent), `reserve`, or a move of a reservation made in Redis: `confirm`,
    /// `release`, `expire` (whose quantity the database takes from the reservation's row).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
    /// The reservation (reserve and moves).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rsv: Option<String>,
    /// Reserve: the deadline (Unix ms) and the lines (JSON) of the reservation's database row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exp: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lines: Option<String>,
}

impl SettleRecord {
    /// The record's operation; `deduct` when absent.
    pub fn op(&self) -> &str {
        self.op.as_deref().unwrap_or("deduct")
    }
}

/// The state a move of a reservation leads to, and the ledger op it writes.
pub fn move_target(op: &str) -> Option<(ReservationState, LedgerOp)> {
    match op {
        "confirm" => Some((ReservationState::Confirmed, LedgerOp::Confirm)),
        "release" => Some((ReservationState::Released, LedgerOp::Release)),
        "expire" => Some((ReservationState::Expired, LedgerOp::Expire)),
        _ => None,
    }
}

/// A tenant's settlement failures, newest first (both backends; `$n` binds on both).
pub(crate) const FAILURES_SQL: &str = "SELECT resource_key, request_id, order_id, idempotency_key, qty, reason,
        available, at
    FROM settlement_failures WHERE tenant_id = $1 ORDER BY at DESC, request_id LIMIT $2";
/// The redis-mode tables whose old rows a retention purge deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettlementTable {
    /// `redis_settled`: the request ids of settled records, which only need to outlive any
    /// redelivery of their stream entry.
    Settled,
    /// `settlement_failures`: refused sales, kept for the tenant to compensate.
    Failures,
}

impl SettlementTable {
    /// The table's name (also the `table` label of `stockd_purged_rows_total`).
    pub fn name(self) -> &'static str {
        match self {
            SettlementTable::Settled => "redis_settled",
            SettlementTable::Failures => "settlement_failures",
        }
    }

    /// Deletes at most $2 rows written before $1 (both backends; `$n` binds on both), oldest
    /// first through the `*_by_at` index; `tail` ends the inner SELECT (PostgreSQL skips rows
    /// another process's purge holds).
    pub(crate) fn purge_sql(self, tail: &str) -> String {
        let table = self.name();
        format!(
            "DELETE FROM {table} WHERE (tenant_id, resource_key, request_id) IN
               (SELECT tenant_id, resource_key, request_id FROM {table} WHERE at < $1 ORDER BY at LIMIT $2{tail})"
        )
    }
}

/// Every redis-mode resource (both backends).
pub(crate) const REDIS_RESOURCES_SQL: &str = "SELECT tenant_id, key FROM resources WHERE mode = 'redis' LIMIT $1";
/// An idempotency key's finished record (both backends). Only finished: one still claimed by an
/// in-flight request has no response yet, and that request will store its own.
pub(crate) const STORED_OUTCOME_SQL: &str = "SELECT request_hash, response_code, response_type, response_body
    FROM idempotency WHERE tenant_id = $1 AND key = $2 AND response_code IS NOT NULL";

/// A `(tenant, key)` pair as stored.
pub(crate) fn parse_pair(tenant: String, key: String) -> Result<(TenantId, ResourceKey), StorageError> {
    let corrupt = |e: crate::engine::InvalidValue| StorageError::Internal(format!("stored resource: {e}"));
    Ok((TenantId::parse(tenant).map_err(corrupt)?, ResourceKey::parse(key).map_err(corrupt)?))
}

/// How a settlement record ended in the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Applied now: the guarded UPDATE took it, with its ledger row and idempotency record.
    Applied,
    /// Its ledger row exists already (a redelivery): nothing done again.
    Duplicate,
    /// The database refused it (Redis said yes, the database says no); recorded as a
    /// settlement failure for the tenant to compensate.
    Refused,
}

/// A sale Redis acknowledged that the database refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct SettlementFailure {
    pub key: String,
    pub request_id: String,
    pub order_id: String,
    pub idempotency_key: String,
    pub qty: i64,
    /// Why the database refused it: `insufficient` or `resource_not_found`.
    pub reason: String,
    /// Database available stock when it was refused.
    pub available: i64,
    #[schema(value_type = String, format = DateTime)]
    pub at: crate::time::Timestamp,
}

/// The storage operations of the Redis hot path.
#[async_trait]
pub trait RedisStore: Send + Sync {
    /// Applies one record, exactly once whatever the number of deliveries.
    async fn settle(&self, record: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError>;
    /// Sets a resource's mode; `None` when there is no such resource.
    async fn set_resource_mode(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        mode: Mode,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError>;
    /// Every resource in redis mode (all tenants), at most `limit`.
    async fn redis_resources(&self, limit: u32) -> Result<Vec<(TenantId, ResourceKey)>, StorageError>;
    /// The tenant's settlement failures, newest first, at most `limit`.
    async fn settlement_failures(&self, tenant: &TenantId, limit: u32) -> Result<Vec<SettlementFailure>, StorageError>;
    /// Deletes at most `limit` rows of `table` written before `before_ms`; returns how many.
    async fn purge_settlement(&self, table: SettlementTable, before_ms: i64, limit: u32) -> Result<u64, StorageError>;
}
