//! Everything else redis mode changes on the way of a request: switching a resource's mode,
//! mirroring its status, pausing it around an adjustment, warming it, routing reservation moves
//! of reservations made in Redis, and the Redis half of reconciliation.

use serde::Serialize;
use utoipa::ToSchema;

use super::{RedisDrift, RedisMode, RedisModeError};
use crate::engine::{Mode, Reconciliation, Reservation, ReservationState, ResourceKey, ResourceState, TenantId};
use crate::storage::redis_store::SettlementFailure;
use crate::storage::{Storage, Transition};
use crate::time::now_ms;

/// Most settlement failures one reconciliation report lists (newest first).
const MAX_FAILURES_SHOWN: u32 = 1_000;

/// `GET /v1/reconciliation`: the ledger check, plus Redis against the database for each
/// redis-mode resource, plus the sales the database refused at settlement.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReconciliationReport {
    #[serde(flatten)]
    pub ledger: Reconciliation,
    /// One entry per redis-mode resource; `drift` is non-zero where Redis and the database
    /// disagree beyond the unsettled backlog.
    pub redis: Vec<RedisDrift>,
    /// False when Redis could not be asked (the `redis` list is then empty).
    pub redis_reachable: bool,
    /// Sales Redis acknowledged that the database refused (newest first, at most 1000): for the
    /// tenant's order service to compensate.
    pub settlement_failures: Vec<SettlementFailure>,
}

/// Refuses `"mode": "redis"` when this server has no Redis.
pub fn check_mode(redis: Option<&RedisMode>, mode: Option<Mode>) -> Result<(), RedisModeError> {
    match (mode, redis) {
        (Some(Mode::Redis), None) => Err(RedisModeError::NotConfigured),
        _ => Ok(()),
    }
}

/// Switches a resource's mode: into redis mode it is warmed; out of it, its Redis backlog is
/// settled first and its Redis keys are deleted. `None`: no such resource.
pub async fn switch_mode(
    redis: Option<&RedisMode>,
    storage: &dyn Storage,
    tenant: &TenantId,
    key: &ResourceKey,
    mode: Mode,
) -> Result<Option<ResourceState>, RedisModeError> {
    let Some(hot) = redis else {
        return match mode {
            Mode::Db => Ok(storage.get_resource(tenant, key).await?),
            Mode::Redis => Err(RedisModeError::NotConfigured),
        };
    };
    match mode {
        Mode::Redis => {
            match storage.get_resource(tenant, key).await? {
                None => return Ok(None),
                Some(current) if current.buckets != 1 => return Err(RedisModeError::Bucketed),
                Some(_) => {}
            }
            let Some(updated) = storage.set_resource_mode(tenant, key, Mode::Redis, now_ms()).await? else {
                return Ok(None);
            };
            hot.mark(tenant.as_str(), key.as_str(), true);
            hot.warm(storage, tenant, key).await?;
            Ok(Some(updated))
        }
        Mode::Db => {
            let Some(current) = storage.get_resource(tenant, key).await? else { return Ok(None) };
            if current.mode == Mode::Redis {
                hot.drain_and_forget(tenant.as_str(), key.as_str()).await?;
            }
            let updated = storage.set_resource_mode(tenant, key, Mode::Db, now_ms()).await?;
            hot.mark(tenant.as_str(), key.as_str(), false);
            Ok(updated)
        }
    }
}

impl RedisMode {
    /// Mirrors an activation or deactivation of a redis-mode resource into Redis.
    pub async fn after_status(&self, resource: &ResourceState, tenant: &TenantId) -> Result<(), RedisModeError> {
        if resource.mode != Mode::Redis {
            return Ok(());
        }
        let inactive = resource.status != crate::engine::ResourceStatus::Active;
        self.set_inactive(tenant.as_str(), &resource.key, inactive).await
    }

    /// Warms a redis-mode resource and answers Redis against the database afterwards; `None`:
    /// no such resource.
    pub async fn warm_resource(
        &self,
        storage: &dyn Storage,
        tenant: &TenantId,
        key: &ResourceKey,
    ) -> Result<Option<RedisDrift>, RedisModeError> {
        let Some(current) = storage.get_resource(tenant, key).await? else { return Ok(None) };
        if current.mode != Mode::Redis {
            return Err(RedisModeError::NotRedis(key.to_string()));
        }
        self.mark(tenant.as_str(), key.as_str(), true);
        self.warm(storage, tenant, key).await?;
        let Some(after) = storage.get_resource(tenant, key).await? else { return Ok(None) };
        Ok(Some(self.compare(tenant, &after).await?))
    }

    /// The resource of a reservation made in Redis on a redis-mode resource: from Redis while it
    /// may be unsettled, else from its database row. `None`: a database-path reservation.
    async fn reservation_home(
        &self,
        storage: &dyn Storage,
        tenant: &TenantId,
        id: &str,
    ) -> Result<Option<String>, RedisModeError> {
        if let Some(key) = self.reservation_resource(tenant.as_str(), id).await? {
            return Ok(Some(key));
        }
        let Some(row) = storage.get_reservation(tenant, id).await? else { return Ok(None) };
        Ok(row.lines.first().map(|l| l.resource.clone()).filter(|r| self.is_redis(tenant.as_str(), r)))
    }

    /// Confirms or releases a reservation made in Redis; `None` sends it down the database path
    /// (a database-path reservation, or one Redis no longer holds).
    pub async fn move_reservation(
        &self,
        storage: &dyn Storage,
        tenant: &TenantId,
        id: &str,
        to: ReservationState,
    ) -> Result<Option<Transition>, RedisModeError> {
        let Some(key) = self.reservation_home(storage, tenant, id).await? else { return Ok(None) };
        let moved = self.transition_reservation(tenant.as_str(), &key, id, to.as_str(), now_ms()).await?;
        let Some(reservation) = moved else { return Ok(None) };
        let done = match to {
            ReservationState::Confirmed => reservation.state == ReservationState::Confirmed,
            _ => reservation.state != ReservationState::Confirmed,
        };
        Ok(Some(if done { Transition::Done(reservation) } else { Transition::Refused(reservation.state, reservation) }))
    }

    /// A reservation made in Redis, in its current state; `None`: ask the database.
    pub async fn held_reservation(
        &self,
        storage: &dyn Storage,
        tenant: &TenantId,
        id: &str,
    ) -> Result<Option<Reservation>, RedisModeError> {
        let Some(key) = self.reservation_home(storage, tenant, id).await? else { return Ok(None) };
        self.get_reservation(tenant.as_str(), &key, id).await
    }
}

/// The Redis half of a tenant's reconciliation, around the ledger check.
pub async fn reconciliation(
    redis: Option<&RedisMode>,
    storage: &dyn Storage,
    tenant: &TenantId,
    ledger: Reconciliation,
) -> Result<ReconciliationReport, RedisModeError> {
    let settlement_failures = storage.settlement_failures(tenant, MAX_FAILURES_SHOWN).await?;
    let mut report = ReconciliationReport { ledger, redis: Vec::new(), redis_reachable: true, settlement_failures };
    let Some(hot) = redis else { return Ok(report) };
    let mut keys: Vec<String> =
        hot.redis_resources().into_iter().filter(|(t, _)| t == tenant.as_str()).map(|(_, k)| k).collect();
    keys.sort();
    for key in keys {
        let Ok(key) = ResourceKey::parse(key) else { continue };
        let Some(db) = storage.get_resource(tenant, &key).await? else { continue };
        match hot.compare(tenant, &db).await {
            Ok(drift) => {
                // With a backlog, a settlement landing between the two reads can look like
                // drift for a moment; only a settled resource's drift is certain.
                if (drift.drift != 0 && drift.backlog == 0) || !drift.warmed {
                    tracing::error!(tenant = %tenant, key = %key, drift = drift.drift, warmed = drift.warmed, "redis drift");
                }
                report.redis.push(drift);
            }
            Err(err) => {
                tracing::warn!(error = %err, "reconciliation could not read redis");
                report.redis_reachable = false;
                report.redis.clear();
                break;
            }
        }
    }
    Ok(report)
}
