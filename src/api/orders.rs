//! Orders: deduct or reserve several lines at once, idempotently; and the dry run.

use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use serde::Serialize;
use utoipa::ToSchema;

use super::error::ApiError;
use super::extract::{IdemKey, Tenant, ValidJson};
use super::{idempotent_response, SharedState};
use crate::engine::order::OrderBody;
use crate::engine::{LineResult, OrderDocument, OrderRequest, OrderStatus, Plan, TenantId};
use crate::plugin::PlanFailure;
use crate::storage::{IdempotencyRequest, OrderJob};
use crate::time::now_ms;

pub fn routes() -> Router<SharedState> {
    Router::new().route("/v1/orders", post(create_order)).route("/v1/orders/dry-run", post(dry_run))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DryRun {
    pub plan: Plan,
    pub outcome: OrderDocument,
}

fn validate(state: &SharedState, body: OrderBody) -> Result<OrderRequest, ApiError> {
    body.validate(state.settings.max_lines).map_err(|(field, err)| ApiError::validation(&field, err))
}

async fn plan(state: &SharedState, tenant: &TenantId, order: &OrderRequest, now_ms: i64) -> Result<Plan, ApiError> {
    state.plugins.plan(tenant, order, now_ms).await.map_err(|e| match e {
        PlanFailure::Plugin(reason) => ApiError::new(422, "plugin_failed", "Plugin failed", reason),
        PlanFailure::TenantBusy(why) => ApiError::too_many_requests(&why, 1),
        PlanFailure::Unavailable(why) => ApiError::unavailable(&why),
        PlanFailure::Storage(err) => err.into(),
    })
}

/// The stored answer to this key if the key was answered before, else `refusal`. Whatever
/// refuses an order now (a lowered `orders.max_lines`, another plugin version, a plugin that
/// refuses, a busy plan pool) must not change the answer to a retry of an order that was
/// answered: the first outcome stands, byte for byte. Asked only on the way out of a refusal,
/// so a fresh order pays no extra read; an order that goes on to storage is judged against its
/// key inside the commit, as ever.
async fn replayed_or(
    state: &SharedState,
    tenant: &TenantId,
    idempotency: &IdempotencyRequest,
    refusal: ApiError,
) -> Result<Response, ApiError> {
    match state.storage.stored_outcome(tenant, idempotency).await {
        Ok(Some(previous)) => Ok(idempotent_response(previous)),
        // No record, or storage cannot say: the refusal is the answer.
        Ok(None) | Err(_) => Err(refusal),
    }
}

fn record_outcome(status: OrderStatus, lines: &[LineResult]) {
    let status_label = match status {
        OrderStatus::Succeeded => "succeeded",
        OrderStatus::Partial => "partial",
        OrderStatus::Rejected => "rejected",
    };
    metrics::counter!("stockd_orders_total", "status" => status_label).increment(1);
    for line in lines {
        let (result, reason) = match (line, status) {
            (LineResult::Applied(_), OrderStatus::Rejected) => ("rejected", "skipped"),
            (LineResult::Applied(_), _) => ("applied", ""),
            (LineResult::Rejected(reason), _) => ("rejected", reason.as_str()),
        };
        metrics::counter!("stockd_deductions_total", "result" => result, "reason" => reason).increment(1);
    }
}

/// Applies an order: every line, or (when the plan allows) those that can. Requires
/// `Idempotency-Key`; a retry returns the first outcome with `Idempotent-Replayed: true`.
#[utoipa::path(post, path = "/v1/orders", tag = "orders", request_body = OrderBody,
    security(("api_key" = [])),
    params(("Idempotency-Key" = String, Header, description = "1-255 visible ASCII characters")),
    responses(
        (status = 201, description = "succeeded or partial", body = OrderDocument),
        (status = 400, description = "validation_failed / idempotency_key_missing", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "rejected: nothing applied", body = OrderDocument),
        (status = 422, description = "idempotency_key_mismatch / plugin_failed", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "too_many_requests: the tenant's share of plugin calls is in use; nothing applied, retry after Retry-After", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "unavailable: nothing applied", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn create_order(
    Tenant(auth): Tenant,
    IdemKey(key): IdemKey,
    State(state): State<SharedState>,
    body: ValidJson<OrderBody>,
) -> Result<Response, ApiError> {
    let idempotency = body.idempotency(key);
    let order = match validate(&state, body.value) {
        Ok(order) => order,
        Err(refusal) => return replayed_or(&state, &auth.tenant, &idempotency, refusal).await,
    };
    let now = now_ms();
    let plan = match plan(&state, &auth.tenant, &order, now).await {
        Ok(plan) => plan,
        Err(refusal) => return replayed_or(&state, &auth.tenant, &idempotency, refusal).await,
    };
    let ttl_seconds = order.ttl_seconds.unwrap_or(state.settings.default_ttl_seconds);
    let job = OrderJob { tenant: auth.tenant, idempotency, order, plan, ttl_ms: ttl_seconds.saturating_mul(1000) };
    match super::hot::order(&state, &job).await {
        Ok(Some(answered)) => return Ok(answered),
        Ok(None) => {}
        Err(refusal) => return replayed_or(&state, &job.tenant, &job.idempotency, refusal).await,
    }
    let executed = state.storage.execute_order(job, now).await?;
    if let Some((status, lines)) = &executed.outcome {
        record_outcome(*status, lines);
    }
    Ok(idempotent_response(executed.response))
}

/// The plan and the outcome the order would have now; applies and records nothing.
#[utoipa::path(post, path = "/v1/orders/dry-run", tag = "orders", request_body = OrderBody,
    security(("api_key" = [])),
    responses(
        (status = 200, body = DryRun),
        (status = 400, body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "plugin_failed", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "too_many_requests: the tenant's share of plugin calls is in use", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "unavailable", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn dry_run(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    body: ValidJson<OrderBody>,
) -> Result<Json<DryRun>, ApiError> {
    let order = validate(&state, body.value)?;
    let plan = plan(&state, &auth.tenant, &order, now_ms()).await?;
    let outcome = state.storage.preview_order(&auth.tenant, &order, &plan).await?;
    Ok(Json(DryRun { plan, outcome }))
}
