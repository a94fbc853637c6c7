//! Everything else redis mode changes on the way of a request: switching a resource's mode,
//! mirroring its status, pausing it around an adjustment, warming it, routing reservation moves
//! of reservations made in Redis, and the Redis half of reconciliation.

use std::sync::Arc;

use serde::Serialize;
use utoipa::ToSchema;

use super::{RedisDrift, RedisMode, RedisModeError};
use crate::engine::{Mode, Reconciliation, Reservation, ReservationState, ResourceKey, ResourceState, TenantId};
use crate::storage::redis_store::{DeadLetter, SettlementFailure};
use crate::storage::{AdjustRefusal, IdempotencyRequest, Idempotent, ModeFence, Storage, Transition};
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
    /// Stream entries of the tenant's resources that could not be read, kept with their raw
    /// fields before they were acknowledged (newest first, at most 1000).
    pub dead_letters: Vec<DeadLetter>,
}

/// Refuses `"mode": "redis"` when this server has no Redis.
pub fn check_mode(redis: Option<&RedisMode>, mode: Option<Mode>) -> Result<(), RedisModeError> {
    match (mode, redis) {
        (Some(Mode::Redis), None) => Err(RedisModeError::NotConfigured),
        _ => Ok(()),
    }
}

/// Switches a resource's mode (docs/REDIS.md, "Fencing"). Into redis mode: the database moves
/// it to redis mode under a new epoch (the database path stops selling it at that moment), then
/// Redis is closed under that epoch and loaded. Out of it: a new epoch closes Redis and drains
/// its backlog, the database leaves redis mode only if still at that epoch, then Redis forgets
/// it. Runs to its end even if the request that asked for it is cancelled. `None`: no such
/// resource.
pub async fn switch_mode(
    redis: Option<&Arc<RedisMode>>,
    storage: &Arc<dyn Storage>,
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
    match storage.get_resource(tenant, key).await? {
        None => return Ok(None),
        Some(current) if mode == Mode::Redis && current.buckets != 1 => return Err(RedisModeError::Bucketed),
        Some(_) => {}
    }
    let (hot, storage2, t, k) = (hot.clone(), storage.clone(), tenant.clone(), key.clone());
    detached(async move {
        match mode {
            Mode::Redis => hot.enter(storage2.as_ref(), &t, &k).await,
            Mode::Db => hot.leave(storage2.as_ref(), &t, &k).await,
        }
    })
    .await?;
    Ok(storage.get_resource(tenant, key).await?)
}

/// Runs a warm, switch or adjustment in a task of its own, so a cancelled request (client
/// gone, request timeout) never stops it half-way with Redis closed. A process that dies
/// half-way leaves a lease that runs out instead (see [`crate::jobs::settlement`]).
pub(crate) async fn detached<T: Send + 'static>(
    operation: impl std::future::Future<Output = Result<T, RedisModeError>> + Send + 'static,
) -> Result<T, RedisModeError> {
    tokio::spawn(operation).await.map_err(|e| RedisModeError::Reply(format!("redis-mode operation stopped: {e}")))?
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

    /// Puts a resource into redis mode and loads it.
    async fn enter(&self, storage: &dyn Storage, tenant: &TenantId, key: &ResourceKey) -> Result<(), RedisModeError> {
        let Some(epoch) = self.close(storage, tenant, key, true).await? else { return Ok(()) };
        self.mark(tenant.as_str(), key.as_str(), true);
        self.load(storage, tenant, key, epoch).await
    }

    /// Takes a resource out of redis mode once its backlog is settled. Also finishes a switch
    /// that stopped after the database left redis mode (its Redis keys not yet deleted).
    async fn leave(&self, storage: &dyn Storage, tenant: &TenantId, key: &ResourceKey) -> Result<(), RedisModeError> {
        let (t, k) = (tenant.as_str(), key.as_str());
        let Some(epoch) = self.close(storage, tenant, key, false).await? else {
            if let Some(current) = storage.get_resource(tenant, key).await? {
                if current.mode == Mode::Db && current.mode_epoch > 0 {
                    self.mark(t, k, false);
                    self.forget(t, k, current.mode_epoch).await?;
                }
            }
            return Ok(());
        };
        if !storage.leave_redis(tenant, key, epoch, now_ms()).await? {
            // A later epoch took over: it loads or leaves the resource itself.
            return Err(RedisModeError::Superseded);
        }
        self.mark(t, k, false);
        self.forget(t, k, epoch).await
    }

    /// Loads a redis-mode resource from the database again. False: no such resource, or it is
    /// not in redis mode.
    pub async fn warm(
        &self,
        storage: &dyn Storage,
        tenant: &TenantId,
        key: &ResourceKey,
    ) -> Result<bool, RedisModeError> {
        let Some(epoch) = self.close(storage, tenant, key, false).await? else { return Ok(false) };
        self.mark(tenant.as_str(), key.as_str(), true);
        self.load(storage, tenant, key, epoch).await?;
        Ok(true)
    }

    /// Restock or write-off of a redis-mode resource: its sales closed and settled under a new
    /// epoch, the database changed only while still at that epoch, then Redis loaded again
    /// (whether or not the adjustment applied). `ModeChanged`: it is not in redis mode.
    pub async fn adjust(
        &self,
        storage: &dyn Storage,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        key: &ResourceKey,
        delta: i64,
    ) -> Result<Result<Idempotent, AdjustRefusal>, RedisModeError> {
        let Some(epoch) = self.close(storage, tenant, key, false).await? else {
            return Ok(Err(AdjustRefusal::ModeChanged));
        };
        let adjusted = storage.adjust(tenant, idem, key, delta, ModeFence::Redis { epoch }, now_ms()).await;
        let loaded = self.load(storage, tenant, key, epoch).await;
        let adjusted = adjusted?;
        if let Err(err) = loaded {
            // The adjustment's outcome stands; sales resume when the lease runs out.
            tracing::warn!(error = %err, tenant = %tenant, key = %key, "reloading redis after an adjustment failed");
            if adjusted.is_err() {
                return Err(err);
            }
        }
        Ok(adjusted)
    }

    /// Warms a redis-mode resource and answers Redis against the database afterwards; `None`:
    /// no such resource.
    pub async fn warm_resource(
        self: &Arc<Self>,
        storage: &Arc<dyn Storage>,
        tenant: &TenantId,
        key: &ResourceKey,
    ) -> Result<Option<RedisDrift>, RedisModeError> {
        let Some(current) = storage.get_resource(tenant, key).await? else { return Ok(None) };
        if current.mode != Mode::Redis {
            return Err(RedisModeError::NotRedis(key.to_string()));
        }
        let (hot, storage2, t, k) = (self.clone(), storage.clone(), tenant.clone(), key.clone());
        if !detached(async move { hot.warm(storage2.as_ref(), &t, &k).await }).await? {
            return Err(RedisModeError::NotRedis(key.to_string()));
        }
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
            // Redis may name it after its resource left redis mode (restored from a snapshot
            // older than the switch, while this process's view was stale): only a redis-mode
            // resource's reservations are answered from Redis.
            self.catch_up(storage).await?;
            if self.is_redis(tenant.as_str(), &key) || self.still_redis(storage, tenant, &key).await? {
                return Ok(Some(key));
            }
            return Ok(None);
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
        let moved = match self.transition_reservation(tenant.as_str(), &key, id, to.as_str(), now_ms()).await {
            // Closed by a switch that took the resource out of redis mode (and had not yet
            // deleted its keys): the database holds the reservation now.
            Err(RedisModeError::Closed) if !self.still_redis(storage, tenant, &key).await? => return Ok(None),
            moved => moved?,
        };
        let Some(reservation) = moved else { return Ok(None) };
        let done = match to {
            ReservationState::Confirmed => reservation.state == ReservationState::Confirmed,
            _ => reservation.state != ReservationState::Confirmed,
        };
        Ok(Some(if done { Transition::Done(reservation) } else { Transition::Refused(reservation.state, reservation) }))
    }

    /// Whether the database still has the resource in redis mode (read now, not from this
    /// process's view, which it corrects).
    pub async fn still_redis(
        &self,
        storage: &dyn Storage,
        tenant: &TenantId,
        key: &str,
    ) -> Result<bool, RedisModeError> {
        let Ok(parsed) = ResourceKey::parse(key) else { return Ok(false) };
        let redis = storage.get_resource(tenant, &parsed).await?.is_some_and(|r| r.mode == Mode::Redis);
        self.mark(tenant.as_str(), key, redis);
        Ok(redis)
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
    let dead_letters = storage.dead_letters(tenant, MAX_FAILURES_SHOWN).await?;
    let mut report =
        ReconciliationReport { ledger, redis: Vec::new(), redis_reachable: true, settlement_failures, dead_letters };
    let Some(hot) = redis else { return Ok(report) };
    // The database's list, not this process's view (refreshed every `mode_refresh_ms`): a
    // resource switched through another process is reported at once.
    let mut keys: Vec<ResourceKey> = storage
        .redis_resources(super::MAX_RESOURCES)
        .await?
        .into_iter()
        .filter(|(t, _)| t == tenant)
        .map(|(_, k)| k)
        .collect();
    keys.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    for key in keys {
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
