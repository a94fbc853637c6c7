//! Orders: deduct or reserve several lines at once, idempotently; the dry run; an order as the
//! ledger knows it, and its reversals.

use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use utoipa::ToSchema;

use super::error::ApiError;
use super::extract::{IdemKey, Path, Tenant, ValidJson};
use super::{idempotent_response, SharedState};
use crate::engine::order::OrderBody;
use crate::engine::reversal::{OrderLedger, ReversalBody, ReversalDocument};
use crate::engine::{LineResult, OrderDocument, OrderId, OrderStatus, Plan};

pub fn routes() -> Router<SharedState> {
    Router::new()
        .route("/v1/orders", post(create_order))
        .route("/v1/orders/dry-run", post(dry_run))
        .route("/v1/orders/{order_id}", get(get_order))
        .route("/v1/orders/{order_id}/reversals", post(reverse_order))
}

fn order_not_found() -> ApiError {
    ApiError::not_found("order_not_found", "Order not found", "no such order")
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
    params(("Idempotency-Key" = String, Header, description = "1-255 visible ASCII characters", pattern = r"^[\x21-\x7e]{1,255}$")),
    responses(
        (status = 201, description = "succeeded or partial", body = OrderDocument),
        (status = 400, description = "validation_failed / idempotency_key_missing", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "rejected: nothing applied", body = OrderDocument),
        (status = 422, description = "idempotency_key_mismatch / plugin_failed", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "too_many_requests: the tenant's share of plugin calls is in use; nothing applied, retry after Retry-After", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "redis_not_warmed: a redis-mode resource Redis does not hold; nothing applied", body = crate::problem::Problem, content_type = "application/problem+json"),
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
    ))]
pub async fn dry_run(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    body: ValidJson<OrderBody>,
) -> Result<Json<DryRun>, ApiError> {
    let (plan, outcome) = state.pipeline.dry_run(&auth.tenant, body.value).await?;
    Ok(Json(DryRun { plan, outcome }))
}

/// The order as stockd knows it from its ledger: per line, its resource (and buckets), what was
/// deducted or confirmed, what is held, released and reversed, and what is still reversible.
#[utoipa::path(get, path = "/v1/orders/{order_id}", tag = "orders", security(("api_key" = [])),
    params(("order_id" = String, Path, description = "the order id the orders were sent with", pattern = r"^[\x21-\x7e]{1,128}$")),
    responses(
        (status = 200, body = OrderLedger),
        (status = 404, description = "order_not_found: this tenant never applied the order", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "unavailable: a sale made in Redis is not settled yet", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_order(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(order_id): Path<String>,
) -> Result<Json<OrderLedger>, ApiError> {
    // An id no order may have is an order this tenant never applied.
    let order_id = OrderId::parse(order_id).map_err(|_| order_not_found())?;
    state.pipeline.lookup_order(&auth.tenant, &order_id).await?.map(Json).ok_or_else(order_not_found)
}

/// Gives (part of) an order back: consumed to available on the resources and buckets it took
/// from, with the per-user limit units it used. Requires `Idempotency-Key`; a retry returns the
/// first outcome with `Idempotent-Replayed: true`.
#[utoipa::path(post, path = "/v1/orders/{order_id}/reversals", tag = "orders", request_body = ReversalBody,
    security(("api_key" = [])),
    params(
        ("order_id" = String, Path, description = "the order id the orders were sent with", pattern = r"^[\x21-\x7e]{1,128}$"),
        ("Idempotency-Key" = String, Header, description = "1-255 visible ASCII characters", pattern = r"^[\x21-\x7e]{1,255}$"),
    ),
    responses(
        (status = 201, description = "reversed", body = ReversalDocument),
        (status = 400, description = "validation_failed / idempotency_key_missing", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "order_not_found: nothing applied, nothing stored", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "exceeds_reversible / reservation_held: nothing applied; a stored outcome", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "idempotency_key_mismatch / redis_order_unsupported", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "redis_not_warmed, or the sale is not settled yet: nothing applied", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn reverse_order(
    Tenant(auth): Tenant,
    IdemKey(key): IdemKey,
    State(state): State<SharedState>,
    Path(order_id): Path<String>,
    body: ValidJson<ReversalBody>,
) -> Result<Response, ApiError> {
    let idempotency = body.idempotency(key);
    let Ok(order_id) = OrderId::parse(order_id) else {
        // Never applied; but a key answered before keeps its answer (or its mismatch).
        return match state.storage.stored_outcome(&auth.tenant, &idempotency).await {
            Ok(Some(previous)) => Ok(idempotent_response(previous)),
            Ok(None) | Err(_) => Err(order_not_found()),
        };
    };
    let outcome = state.pipeline.reverse(&auth.tenant, idempotency, order_id, body.value).await?;
    if let crate::storage::Idempotent::Fresh(response) = &outcome {
        let result = if response.status == 201 { "reversed" } else { "refused" };
        metrics::counter!("stockd_reversals_total", "result" => result).increment(1);
    }
    Ok(idempotent_response(outcome))
}
