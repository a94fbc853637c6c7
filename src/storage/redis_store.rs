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
use crate::engine::{LedgerOp, ReservationState, ResourceKey, TenantId};

/// One success Redis acknowledged, as its Lua script appended it to the resource's stream.
/// Field names are short: one record per sale crosses Redis twice.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// The order line's key as the client sent it (records of this version on), for the ledger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lk: Option<String>,
    /// The plan's planner version, for the ledger row.
    pub pv: i64,
    /// When Redis acknowledged it (Unix ms).
    pub at: i64,
    /// `deduct` (when absent), `reserve`, `reverse` (consumed back to available), or a move of a
    /// reservation made in Redis: `confirm`, `release`, `expire` (whose quantity the database
    /// takes from the reservation's row).
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
    /// A reversal: what the order took from the resource (the database's ledger, when Redis
    /// decided it) and the request whose take it gives back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tk: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rv: Option<String>,
    /// A refusal's status code (from the stream entry's `c`; its `b` is the body).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub c: Option<u16>,
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
        available, at, reservation_id
    FROM settlement_failures WHERE tenant_id = $1 ORDER BY at DESC, request_id LIMIT $2";
/// Takes the next epoch (both backends; `$n` binds on both): $1 into redis mode, $2 now, $3
/// tenant, $4 key. `updated_at` moves only with the mode.
pub(crate) const TAKE_EPOCH_SQL: &str = "UPDATE resources
    SET mode_epoch = mode_epoch + 1,
        updated_at = CASE WHEN mode = 'redis' THEN updated_at ELSE $2 END,
        mode = 'redis'
    WHERE tenant_id = $3 AND key = $4 AND (mode = 'redis' OR $1)
    RETURNING mode_epoch";
/// Leaves redis mode at an epoch (both backends): $1 epoch, $2 now, $3 tenant, $4 key.
pub(crate) const LEAVE_REDIS_SQL: &str = "UPDATE resources SET mode = 'db', updated_at = $2
    WHERE tenant_id = $3 AND key = $4 AND mode = 'redis' AND mode_epoch = $1";
/// The quantity of the first settlement failure of a reservation (both backends): its refused
/// reserve, as a move fails only once the reservation's row exists or after this.
pub(crate) const REFUSED_RESERVATION_SQL: &str = "SELECT qty FROM settlement_failures
    WHERE tenant_id = $1 AND reservation_id = $2 ORDER BY at, request_id LIMIT 1";
/// A limit key's count and a resource's epoch in one statement (both backends): $1 tenant,
/// $2 limit key, $3 resource key.
pub(crate) const LIMIT_SEED_SQL: &str = "SELECT
        COALESCE((SELECT used FROM user_limits WHERE tenant_id = $1 AND key = $2), 0) AS used,
        COALESCE((SELECT mode_epoch FROM resources WHERE tenant_id = $1 AND key = $3), -1) AS epoch";
/// The redis-mode tables whose old rows a retention purge deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettlementTable {
    /// `redis_settled`: the request ids of settled records, which only need to outlive any
    /// redelivery of their stream entry.
    Settled,
    /// `settlement_failures`: refused sales, kept for the tenant to compensate.
    Failures,
    /// `settlement_dead_letters`: unreadable stream entries, kept as long as failures.
    DeadLetters,
}

impl SettlementTable {
    /// The table's name (also the `table` label of `stockd_purged_rows_total`).
    pub fn name(self) -> &'static str {
        match self {
            SettlementTable::Settled => "redis_settled",
            SettlementTable::Failures => "settlement_failures",
            SettlementTable::DeadLetters => "settlement_dead_letters",
        }
    }

    /// The columns naming one row.
    fn identity(self) -> &'static str {
        match self {
            SettlementTable::Settled | SettlementTable::Failures => "tenant_id, resource_key, request_id",
            SettlementTable::DeadLetters => "tenant_id, resource_key, entry_id",
        }
    }

    /// Deletes at most $2 rows written before $1 (both backends; `$n` binds on both), oldest
    /// first through the `*_by_at` index; `tail` ends the inner SELECT (PostgreSQL skips rows
    /// another process's purge holds).
    pub(crate) fn purge_sql(self, tail: &str) -> String {
        let (table, id) = (self.name(), self.identity());
        format!(
            "DELETE FROM {table} WHERE ({id}) IN (SELECT {id} FROM {table} WHERE at < $1 ORDER BY at LIMIT $2{tail})"
        )
    }
}

/// Every redis-mode resource (both backends).
pub(crate) const REDIS_RESOURCES_SQL: &str = "SELECT tenant_id, key FROM resources WHERE mode = 'redis' LIMIT $1";
/// An idempotency key's finished record (both backends). Only finished: one still claimed by an
/// in-flight request has no response yet, and that request will store its own.
pub(crate) const STORED_OUTCOME_SQL: &str = concat!(
    "SELECT ",
    crate::outcome_columns!(),
    " WHERE i.tenant_id = $1 AND i.key = $2 AND i.response_code IS NOT NULL"
);

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
    /// A refusal Redis decided, now the key's stored outcome.
    Answered,
}

/// A sale Redis acknowledged that the database refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct SettlementFailure {
    pub key: String,
    pub request_id: String,
    pub order_id: String,
    pub idempotency_key: String,
    pub qty: i64,
    /// Why the database refused it: `insufficient` or `resource_not_found` (a deduction or a
    /// reservation), `reservation_<state>` (a move of a reservation the database had already
    /// moved), `reservation_refused` (a move of a reservation whose own settlement was refused).
    pub reason: String,
    /// The reservation, for a reservation or a move of one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
    /// Database available stock when it was refused.
    pub available: i64,
    #[schema(value_type = String, format = DateTime)]
    pub at: crate::time::Timestamp,
}

/// A stream entry the settlement consumer could not read, kept with its raw fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct DeadLetter {
    pub key: String,
    /// The Redis stream entry id.
    pub entry_id: String,
    /// The entry's fields as a JSON object of strings (at most 64 KiB, cut beyond).
    pub payload: String,
    /// Why it could not be settled.
    pub reason: String,
    #[schema(value_type = String, format = DateTime)]
    pub at: crate::time::Timestamp,
}

/// Records a dead letter once (both backends): $1 tenant, $2 key, $3 entry id, $4 payload,
/// $5 reason, $6 now.
pub(crate) const DEAD_LETTER_SQL: &str = "INSERT INTO settlement_dead_letters
        (tenant_id, resource_key, entry_id, payload, reason, at)
    VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING";
/// A tenant's dead letters, newest first (both backends).
pub(crate) const DEAD_LETTERS_SQL: &str = "SELECT resource_key, entry_id, payload, reason, at
    FROM settlement_dead_letters WHERE tenant_id = $1 ORDER BY at DESC, entry_id LIMIT $2";

/// The storage operations of the Redis hot path.
#[async_trait]
pub trait RedisStore: Send + Sync {
    /// Applies one record, exactly once whatever the number of deliveries.
    async fn settle(&self, record: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError>;
    /// Applies a run of deductions of one resource read together from its stream, in stream
    /// order, as one write ([`crate::apply::settlement::settle_run`]): one answer per record.
    /// An error leaves every record of the run unsettled.
    async fn settle_run(&self, records: Vec<SettleRecord>, now_ms: i64) -> Result<Vec<Settled>, StorageError>;
    /// Takes the next fencing epoch of a resource in redis mode, putting it into redis mode
    /// first when `into_redis`. `None`: no such resource, or (without `into_redis`) it is not in
    /// redis mode. Every warm, switch and adjustment of a redis-mode resource starts here.
    async fn take_epoch(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        into_redis: bool,
        now_ms: i64,
    ) -> Result<Option<i64>, StorageError>;
    /// Puts a resource back into db mode, only while it is still in redis mode at `epoch` (its
    /// Redis stock closed and settled under that epoch). False: another process took a later
    /// epoch meanwhile, or it left redis mode already.
    async fn leave_redis(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        epoch: i64,
        now_ms: i64,
    ) -> Result<bool, StorageError>;
    /// Every resource in redis mode (all tenants), at most `limit`.
    async fn redis_resources(&self, limit: u32) -> Result<Vec<(TenantId, ResourceKey)>, StorageError>;
    /// A per-user limit key's count and the resource's fencing epoch, read together (one
    /// statement): what Redis starts the key from (see [`crate::redis_mode::scripts::DEDUCT`]).
    async fn limit_seed(
        &self,
        tenant: &TenantId,
        limit: &str,
        resource: &ResourceKey,
    ) -> Result<(i64, i64), StorageError>;
    /// Keeps a stream entry that could not be read (once per entry id), before it is
    /// acknowledged.
    async fn record_dead_letter(&self, letter: &DeadLetter, tenant: &str) -> Result<(), StorageError>;
    /// The tenant's dead letters, newest first, at most `limit`.
    async fn dead_letters(&self, tenant: &TenantId, limit: u32) -> Result<Vec<DeadLetter>, StorageError>;
    /// The tenant's settlement failures, newest first, at most `limit`.
    async fn settlement_failures(&self, tenant: &TenantId, limit: u32) -> Result<Vec<SettlementFailure>, StorageError>;
    /// Deletes at most `limit` rows of `table` written before `before_ms`; returns how many.
    async fn purge_settlement(&self, table: SettlementTable, before_ms: i64, limit: u32) -> Result<u64, StorageError>;
}
