//! Redis mode over HTTP: orders on redis-mode resources, warming, switching modes, and the
//! Redis half of reconciliation. The handlers of `orders.rs`, `resources.rs` and
//! `reservations.rs` call in here; without `[redis]` configured every function is a no-op and
//! redis mode is refused.

use axum::extract::{Path, State};
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use serde::Serialize;
use utoipa::ToSchema;

use super::error::ApiError;
use super::extract::Tenant;
use super::{idempotent_response, stored_response, SharedState};
use crate::engine::{
    Action, LineResult, Mode, OrderDocument, Reason, Reconciliation, Reservation, ReservationLine, ReservationState,
    ResourceKey, ResourceState, TenantId,
};
use crate::hotpath::{Bodies, Deducted, Deduction, HotError, Hotpath, RedisDrift, Reserve};
use crate::storage::rules::new_request_id;
use crate::storage::settle::{SettleRecord, SettlementFailure};
use crate::storage::Transition;
use crate::storage::{ContentType, Idempotent, OrderJob, StoredResponse};
use crate::time::now_ms;
use crate::time::Timestamp;

/// Most settlement failures one reconciliation report lists (newest first).
const MAX_FAILURES_SHOWN: u32 = 1_000;
/// How long past its deadline Redis remembers which resource a reservation belongs to.
const RESERVATION_MAP_EXTRA_S: i64 = 86_400;

pub fn routes() -> Router<SharedState> {
    Router::new().route("/v1/resources/{key}/warm", post(warm))
}

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

fn hot_error(err: HotError) -> ApiError {
    match err {
        HotError::Redis(err) => {
            tracing::warn!(error = %err, "redis unavailable");
            metrics::counter!("stockd_redis_unavailable_total").increment(1);
            ApiError::unavailable("redis is unavailable; retry with the same Idempotency-Key")
        }
        HotError::Storage(err) => err.into(),
        HotError::DrainTimeout(backlog) => {
            tracing::warn!(backlog, "redis backlog did not drain in time");
            ApiError::unavailable("unsettled sales are still being written to the database; retry shortly")
        }
        HotError::Reply(why) => {
            tracing::error!(error = %why, "unexpected redis reply");
            ApiError::internal()
        }
    }
}

fn not_configured() -> ApiError {
    ApiError::validation("mode", "\"redis\" needs [redis] to be configured on this server")
}

/// Answers an order whose plan touches a redis-mode resource; `None` sends it down the
/// database path.
pub async fn order(state: &SharedState, job: &OrderJob) -> Result<Option<Response>, ApiError> {
    let Some(hot) = &state.hotpath else { return Ok(None) };
    let tenant = job.tenant.as_str();
    if !job.plan.resources().any(|r| hot.is_redis(tenant, r.as_str())) {
        return Ok(None);
    }
    let line = match job.plan.lines.as_slice() {
        [line] if line.targets.len() == 1 && line.targets[0].create_if_missing.is_none() => line,
        _ => {
            return Err(ApiError::new(
                422,
                "redis_order_unsupported",
                "Order not supported in redis mode",
                "an order that touches a redis-mode resource must have one line planned to that one resource",
            ))
        }
    };
    let target = &line.targets[0].resource;
    // The database knows every settled outcome, and keys used on the database path: a replay
    // after Redis lost its data, or a key reused for another resource, is answered from there.
    if hot.settings.replay_from_database {
        if let Some(previous) = state.storage.stored_outcome(&job.tenant, &job.idempotency).await? {
            return Ok(Some(idempotent_response(previous)));
        }
    }
    let now = now_ms();
    let reservation = (job.order.action == Action::Reserve)
        .then(|| (format!("rsv_{}", ulid::Ulid::new()), Timestamp(now.saturating_add(job.ttl_ms))));
    let document = |result: LineResult| OrderDocument::build(&job.order, &job.plan, &[result], reservation.clone());
    let body = |result: LineResult| serde_json::to_string(&document(result)).map_err(|_| ApiError::internal());
    if hot.sold_out.contains(tenant, target.as_str()) {
        // Answered from memory, not stored: a retry after a restock may apply (API.md: `sold_out`
        // is answered without touching storage).
        metrics::counter!("stockd_redis_orders_total", "outcome" => "sold_out").increment(1);
        let response = StoredResponse {
            status: 409,
            content_type: ContentType::Json,
            body: body(LineResult::Rejected(Reason::SoldOut))?,
        };
        return Ok(Some(stored_response(response, false)));
    }
    let applied = body(LineResult::Applied(0))?;
    let held = reservation.as_ref().map(|(id, expires_at)| Reservation {
        id: id.clone(),
        order_id: job.order.order_id.to_string(),
        state: ReservationState::Held,
        lines: vec![ReservationLine {
            key: job.order.lines.get(line.line).map(|l| l.key.to_string()).unwrap_or_default(),
            resource: target.to_string(),
            qty: line.qty,
            limit_key: line.limit.as_ref().map(|l| l.key.to_string()),
            buckets: Vec::new(),
        }],
        expires_at: *expires_at,
    });
    let lines = held.as_ref().map(|r| serde_json::to_string(&r.lines)).transpose().map_err(|_| ApiError::internal())?;
    let record = SettleRecord {
        t: tenant.to_string(),
        k: target.to_string(),
        q: line.qty,
        rid: new_request_id(),
        oid: job.order.order_id.to_string(),
        idem: job.idempotency.key.to_string(),
        h: job.idempotency.request_hash.clone(),
        body: applied.clone(),
        lim: line.limit.as_ref().map(|l| l.key.to_string()),
        pv: job.plan.planner.version,
        at: now,
        op: held.as_ref().map(|_| "reserve".to_string()),
        rsv: held.as_ref().map(|r| r.id.clone()),
        exp: held.as_ref().map(|r| r.expires_at.0),
        lines,
    };
    let reserve = match &held {
        Some(r) => Some(Reserve {
            id: r.id.clone(),
            expires_at_ms: r.expires_at.0,
            document: serde_json::to_string(r).map_err(|_| ApiError::internal())?,
        }),
        None => None,
    };
    let deduction = Deduction {
        reserve,
        tenant: &job.tenant,
        key: target,
        qty: line.qty,
        limit: line.limit.as_ref().map(|l| (l.key.as_str(), l.max)),
        request_hash: &job.idempotency.request_hash,
        idempotency_key: job.idempotency.key.as_str(),
        bodies: Bodies {
            applied,
            insufficient: body(LineResult::Rejected(Reason::Insufficient))?,
            limit: body(LineResult::Rejected(Reason::LimitExceeded))?,
            inactive: body(LineResult::Rejected(Reason::ResourceInactive))?,
        },
        record,
    };
    let answer = hot.deduct(deduction).await.map_err(hot_error)?;
    Ok(Some(match answer {
        Deducted::Fresh { outcome, status, body, available } => {
            if available == 0 {
                hot.sold_out.set(tenant, target.as_str(), true);
            }
            if let (Some(r), "applied") = (&held, outcome.as_str()) {
                // Until settled (milliseconds), confirm, release and GET find it through this.
                let ttl_s = job.ttl_ms / 1000 + RESERVATION_MAP_EXTRA_S;
                if let Err(err) = hot.map_reservation(tenant, &r.id, target.as_str(), ttl_s).await {
                    tracing::warn!(error = %err, "recording a reservation's resource in redis failed");
                }
            }
            metrics::counter!("stockd_redis_orders_total", "outcome" => outcome).increment(1);
            stored_response(StoredResponse { status, content_type: ContentType::Json, body }, false)
        }
        Deducted::Replay { status, body } => {
            idempotent_response(Idempotent::Replayed(StoredResponse { status, content_type: ContentType::Json, body }))
        }
        Deducted::Mismatch => idempotent_response(Idempotent::Mismatch),
        Deducted::Cold => {
            return Err(ApiError {
                retry_after_s: Some(1),
                ..ApiError::new(
                    503,
                    "redis_not_warmed",
                    "Resource not loaded into Redis",
                    format!(
                    "{target} is in redis mode but Redis does not hold it; warm it (POST /v1/resources/{target}/warm)"
                ),
                )
            })
        }
        Deducted::Closed => {
            return Err(ApiError::unavailable("the resource is being warmed or switched; retry shortly"))
        }
    }))
}

/// Refuses `"mode": "redis"` when this server has no Redis.
pub fn check_mode(state: &SharedState, mode: Option<Mode>) -> Result<(), ApiError> {
    match (mode, &state.hotpath) {
        (Some(Mode::Redis), None) => Err(not_configured()),
        _ => Ok(()),
    }
}

/// Switches a resource's mode: into redis mode it is warmed; out of it, its Redis backlog is
/// settled first and its Redis keys are deleted. `None`: no such resource.
pub async fn switch_mode(
    state: &SharedState,
    tenant: &TenantId,
    key: &ResourceKey,
    mode: Mode,
) -> Result<Option<ResourceState>, ApiError> {
    let Some(hot) = &state.hotpath else {
        return match mode {
            Mode::Db => Ok(state.storage.get_resource(tenant, key).await?),
            Mode::Redis => Err(not_configured()),
        };
    };
    match mode {
        Mode::Redis => {
            match state.storage.get_resource(tenant, key).await? {
                None => return Ok(None),
                Some(current) if current.buckets != 1 => {
                    return Err(ApiError::validation("mode", "redis mode takes one bucket"))
                }
                Some(_) => {}
            }
            let Some(updated) = state.storage.set_resource_mode(tenant, key, Mode::Redis, now_ms()).await? else {
                return Ok(None);
            };
            hot.mark(tenant.as_str(), key.as_str(), true);
            hot.warm(state.storage.as_ref(), tenant, key).await.map_err(hot_error)?;
            Ok(Some(updated))
        }
        Mode::Db => {
            let Some(current) = state.storage.get_resource(tenant, key).await? else { return Ok(None) };
            if current.mode == Mode::Redis {
                hot.drain_and_forget(tenant.as_str(), key.as_str()).await.map_err(hot_error)?;
            }
            let updated = state.storage.set_resource_mode(tenant, key, Mode::Db, now_ms()).await?;
            hot.mark(tenant.as_str(), key.as_str(), false);
            Ok(updated)
        }
    }
}

/// Mirrors an activation or deactivation of a redis-mode resource into Redis.
pub async fn after_status(state: &SharedState, resource: &ResourceState, tenant: &TenantId) -> Result<(), ApiError> {
    match &state.hotpath {
        Some(hot) if resource.mode == Mode::Redis => {
            let inactive = resource.status != crate::engine::ResourceStatus::Active;
            hot.set_inactive(tenant.as_str(), &resource.key, inactive).await.map_err(hot_error)
        }
        _ => Ok(()),
    }
}

/// The hot path if this resource is in redis mode here.
pub fn redis_resource<'a>(state: &'a SharedState, tenant: &TenantId, key: &ResourceKey) -> Option<&'a Hotpath> {
    state.hotpath.as_deref().filter(|hot| hot.is_redis(tenant.as_str(), key.as_str()))
}

/// Before an adjustment of a redis-mode resource: stop its sales and settle its backlog, so
/// the database's available is everything the adjustment is judged against.
pub async fn before_adjust(hot: &Hotpath, tenant: &TenantId, key: &ResourceKey) -> Result<(), ApiError> {
    hot.drain(tenant.as_str(), key.as_str()).await.map_err(hot_error)
}

/// After it (applied or not): load the database's stock into Redis and reopen.
pub async fn after_adjust(
    state: &SharedState,
    hot: &Hotpath,
    tenant: &TenantId,
    key: &ResourceKey,
) -> Result<(), ApiError> {
    hot.warm(state.storage.as_ref(), tenant, key).await.map_err(hot_error)
}

/// The Redis half of a tenant's reconciliation.
pub async fn reconciliation(
    state: &SharedState,
    tenant: &TenantId,
    ledger: Reconciliation,
) -> Result<ReconciliationReport, ApiError> {
    let settlement_failures = state.storage.settlement_failures(tenant, MAX_FAILURES_SHOWN).await?;
    let mut report = ReconciliationReport { ledger, redis: Vec::new(), redis_reachable: true, settlement_failures };
    let Some(hot) = &state.hotpath else { return Ok(report) };
    let mut keys: Vec<String> =
        hot.redis_resources().into_iter().filter(|(t, _)| t == tenant.as_str()).map(|(_, k)| k).collect();
    keys.sort();
    for key in keys {
        let Ok(key) = ResourceKey::parse(key) else { continue };
        let Some(db) = state.storage.get_resource(tenant, &key).await? else { continue };
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

/// Loads a redis-mode resource into Redis from the database, once every sale already made in
/// Redis is settled: after a Redis restart or failover, or to end drift. Sales pause (503 with
/// `Retry-After`) while it runs. Answers Redis against the database afterwards.
#[utoipa::path(post, path = "/v1/resources/{key}/warm", tag = "resources", security(("api_key" = [])),
    params(("key" = String, Path)),
    responses(
        (status = 200, body = RedisDrift),
        (status = 404, description = "resource_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "resource_not_redis: the resource is in db mode", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "unavailable: Redis unreachable or the backlog did not drain", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn warm(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(key): Path<String>,
) -> Result<Json<RedisDrift>, ApiError> {
    let key = ResourceKey::parse(key).map_err(|e| ApiError::validation("key", e))?;
    let missing = || super::resources::resource_not_found(key.as_str());
    let state_now = state.storage.get_resource(&auth.tenant, &key).await?.ok_or_else(missing)?;
    if state_now.mode != Mode::Redis {
        return Err(ApiError::new(
            409,
            "resource_not_redis",
            "Resource not in redis mode",
            format!("{key} is in db mode; switch it with PATCH {{\"mode\": \"redis\"}}"),
        ));
    }
    let hot = state.hotpath.as_deref().ok_or_else(not_configured)?;
    hot.mark(auth.tenant.as_str(), key.as_str(), true);
    hot.warm(state.storage.as_ref(), &auth.tenant, &key).await.map_err(hot_error)?;
    let after = state.storage.get_resource(&auth.tenant, &key).await?.ok_or_else(missing)?;
    Ok(Json(hot.compare(&auth.tenant, &after).await.map_err(hot_error)?))
}

/// The resource of a reservation made in Redis on a redis-mode resource: from Redis while it
/// may be unsettled, else from its database row. `None`: a database-path reservation.
async fn reservation_home(
    state: &SharedState,
    hot: &Hotpath,
    tenant: &TenantId,
    id: &str,
) -> Result<Option<String>, ApiError> {
    if let Some(key) = hot.reservation_resource(tenant.as_str(), id).await.map_err(hot_error)? {
        return Ok(Some(key));
    }
    let Some(row) = state.storage.get_reservation(tenant, id).await? else { return Ok(None) };
    Ok(row.lines.first().map(|l| l.resource.clone()).filter(|r| hot.is_redis(tenant.as_str(), r)))
}

/// Confirms or releases a reservation made in Redis; `None` sends it down the database path
/// (a database-path reservation, or one Redis no longer holds).
pub async fn move_reservation(
    state: &SharedState,
    tenant: &TenantId,
    id: &str,
    to: ReservationState,
) -> Result<Option<Transition>, ApiError> {
    let Some(hot) = &state.hotpath else { return Ok(None) };
    let Some(key) = reservation_home(state, hot, tenant, id).await? else { return Ok(None) };
    let moved = hot.move_reservation(tenant.as_str(), &key, id, to.as_str(), now_ms()).await.map_err(hot_error)?;
    let Some(reservation) = moved else { return Ok(None) };
    let done = match to {
        ReservationState::Confirmed => reservation.state == ReservationState::Confirmed,
        _ => reservation.state != ReservationState::Confirmed,
    };
    Ok(Some(if done { Transition::Done(reservation) } else { Transition::Refused(reservation.state, reservation) }))
}

/// A reservation made in Redis, in its current state; `None`: ask the database.
pub async fn get_reservation(
    state: &SharedState,
    tenant: &TenantId,
    id: &str,
) -> Result<Option<Reservation>, ApiError> {
    let Some(hot) = &state.hotpath else { return Ok(None) };
    let Some(key) = reservation_home(state, hot, tenant, id).await? else { return Ok(None) };
    hot.get_reservation(tenant.as_str(), &key, id).await.map_err(hot_error)
}
