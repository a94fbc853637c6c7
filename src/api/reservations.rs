//! Reservations: read, confirm, release. Confirm and release take no body: the reservation id
//! and the action are their identity, so repeating one is harmless.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::ApiError;
use super::extract::{page_limit, query, Path, Tenant};
use super::SharedState;
use crate::engine::{Pass, Reservation, ReservationState};
use crate::storage::Transition;

/// Reservation ids are `rsv_` + a ULID; anything much longer cannot exist.
const MAX_ID_LEN: usize = 64;

pub fn routes() -> Router<SharedState> {
    Router::new()
        .route("/v1/reservations", get(list_held))
        .route("/v1/reservations/{id}", get(get_reservation))
        .route("/v1/reservations/{id}/confirm", post(confirm))
        .route("/v1/reservations/{id}/release", post(release))
        .route("/v1/reconciliation", get(reconciliation))
}

fn not_found() -> ApiError {
    ApiError::not_found("reservation_not_found", "Reservation not found", "no such reservation")
}

fn checked_id(id: &str) -> Result<&str, ApiError> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        Err(not_found())
    } else {
        Ok(id)
    }
}

fn answer(transition: Transition) -> Result<Json<Reservation>, ApiError> {
    match transition {
        Transition::Done(reservation) => Ok(Json(reservation)),
        Transition::NotFound => Err(not_found()),
        Transition::Refused(state, reservation) => {
            let (code, title) = match state {
                ReservationState::Released => ("reservation_released", "Reservation released"),
                ReservationState::Expired => ("reservation_expired", "Reservation expired"),
                ReservationState::Confirmed => ("reservation_confirmed", "Reservation confirmed"),
                ReservationState::Held => ("reservation_held", "Reservation held"),
            };
            Err(ApiError::new(409, code, title, format!("reservation {} is {}", reservation.id, state)))
        }
    }
}

/// A reservation and its state.
#[utoipa::path(get, path = "/v1/reservations/{id}", tag = "reservations", security(("api_key" = [])),
    params(("id" = String, Path, min_length = 1, max_length = 64)),
    responses(
        (status = 200, body = Reservation),
        (status = 404, description = "reservation_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_reservation(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> Result<Json<Reservation>, ApiError> {
    let id = checked_id(&id)?;
    if let Some(redis) = state.redis.as_deref() {
        if let Some(held_in_redis) = redis.held_reservation(state.storage.as_ref(), &auth.tenant, id).await? {
            return Ok(Json(held_in_redis));
        }
    }
    state.storage.get_reservation(&auth.tenant, id).await?.map(Json).ok_or_else(not_found)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct HeldParams {
    /// 1..=1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
}

/// Held reservations, the soonest to expire first.
#[derive(Debug, Serialize, ToSchema)]
pub struct HeldPage {
    pub items: Vec<Reservation>,
}

/// The tenant's held reservations, the soonest to expire first (what the console shows as
/// "about to expire"). Redis-mode reservations are listed once settled into the database.
#[utoipa::path(get, path = "/v1/reservations", tag = "reservations", security(("api_key" = [])),
    params(HeldParams),
    responses((status = 200, body = HeldPage)))]
pub async fn list_held(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    params: Result<Query<HeldParams>, QueryRejection>,
) -> Result<Json<HeldPage>, ApiError> {
    let limit = page_limit(query(params)?.limit)?;
    let items = state.storage.held_reservations(&auth.tenant, limit).await?;
    Ok(Json(HeldPage { items }))
}

/// Held → confirmed (reserved → consumed). Again on a confirmed one: the same 200.
#[utoipa::path(post, path = "/v1/reservations/{id}/confirm", tag = "reservations", security(("api_key" = [])),
    params(("id" = String, Path, min_length = 1, max_length = 64)),
    responses(
        (status = 200, body = Reservation),
        (status = 404, description = "reservation_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "reservation_released / reservation_expired", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn confirm(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> Result<Json<Reservation>, ApiError> {
    let id = checked_id(&id)?;
    answer(state.pipeline.move_reservation(&auth.tenant, id, ReservationState::Confirmed).await?)
}

/// Held → released (reserved → available). Again, or on an expired one: 200 with its state;
/// past its deadline (not yet swept) a held one is expired: 200 with state `expired`.
#[utoipa::path(post, path = "/v1/reservations/{id}/release", tag = "reservations", security(("api_key" = [])),
    params(("id" = String, Path, min_length = 1, max_length = 64)),
    responses(
        (status = 200, body = Reservation),
        (status = 404, description = "reservation_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "reservation_confirmed", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn release(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> Result<Json<Reservation>, ApiError> {
    let id = checked_id(&id)?;
    answer(state.pipeline.move_reservation(&auth.tenant, id, ReservationState::Released).await?)
}

/// Unknown parameters are ignored, as they were before `pass` existed.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ReconciliationParams {
    /// `incremental` (default): each resource from its last clean checkpoint; `full`: from its
    /// whole ledger, which also finds history changed below a checkpoint.
    pub pass: Option<Pass>,
}

/// Proves, for each of the tenant's resources, state == opening balance + ledger; compares
/// Redis with the database for redis-mode resources; lists refused settlements.
#[utoipa::path(get, path = "/v1/reconciliation", tag = "reconciliation", security(("api_key" = [])),
    params(ReconciliationParams),
    responses((status = 200, body = crate::redis_mode::control::ReconciliationReport)))]
pub async fn reconciliation(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    params: Result<Query<ReconciliationParams>, QueryRejection>,
) -> Result<Json<crate::redis_mode::control::ReconciliationReport>, ApiError> {
    let params = params.map(|Query(p)| p).map_err(|e| ApiError::validation("pass", e.body_text()))?;
    let pass = params.pass.unwrap_or(Pass::Incremental);
    let report = state.storage.reconcile(Some(&auth.tenant), pass).await?;
    if !report.drift.is_empty() {
        tracing::error!(tenant = %auth.tenant, resources = report.drift.len(), "reconciliation found drift");
    }
    let report = crate::redis_mode::control::reconciliation(
        state.redis.as_deref(),
        state.storage.as_ref(),
        &auth.tenant,
        report,
    )
    .await?;
    Ok(Json(report))
}
