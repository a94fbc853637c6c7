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
use crate::engine::{LineResult, OrderDocument, OrderStatus, Plan};

pub fn routes() -> Router<SharedState> {
    Router::new().route("/v1/orders", post(create_order)).route("/v1/orders/dry-run", post(dry_run))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DryRun {
    pub plan: Plan,
    pub outcome: OrderDocument,
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
    let answer = state.pipeline.order(&auth.tenant, idempotency, body.value).await?;
    if let Some((status, lines)) = &answer.outcome {
        record_outcome(*status, lines);
    }
    Ok(idempotent_response(answer.response))
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
    let (plan, outcome) = state.pipeline.dry_run(&auth.tenant, body.value).await?;
    Ok(Json(DryRun { plan, outcome }))
}
