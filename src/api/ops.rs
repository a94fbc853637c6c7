//! Operations endpoints: liveness, readiness, Prometheus metrics, the OpenAPI document.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use super::error::ApiError;
use super::SharedState;

pub fn routes() -> Router<SharedState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi))
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, description = "alive")))]
pub async fn healthz() -> Response {
    // A static body: this is the HTTP stack's ceiling in benchmarks, so it does no work.
    ([(header::CONTENT_TYPE, "application/json")], r#"{"status":"ok"}"#).into_response()
}

/// Storage is reachable and migrated (and Redis answers, when configured), and no background
/// job is stuck. The answer lists every supervised job: milliseconds since its last successful
/// run, how often it panicked and was restarted, and its stuck threshold.
#[utoipa::path(get, path = "/readyz", tag = "operations", responses(
    (status = 200, description = "ready"),
    (status = 503, description = "storage or Redis unreachable, or a background job stuck (`job_stuck`)", body = crate::problem::Problem, content_type = "application/problem+json"),
))]
pub async fn readyz(State(state): State<SharedState>) -> Result<Json<serde_json::Value>, ApiError> {
    state.storage.ready().await?;
    if let Some(hot) = &state.redis {
        hot.ready().await.map_err(|e| {
            tracing::warn!(error = %e, "redis not ready");
            ApiError::unavailable("redis is unavailable")
        })?;
    }
    let jobs = state.jobs.report();
    let stuck: Vec<String> = jobs
        .iter()
        .filter(|j| j.stuck)
        .map(|j| match j.last_ok_ms_ago {
            Some(ms) => format!("{} (last success {ms} ms ago)", j.name),
            None => format!("{} (no success since start)", j.name),
        })
        .collect();
    if !stuck.is_empty() {
        tracing::warn!(jobs = ?stuck, "background jobs stuck; not ready");
        return Err(ApiError {
            retry_after_s: Some(STUCK_RETRY_AFTER_S),
            ..ApiError::new(503, "job_stuck", "Background job stuck", format!("stuck: {}", stuck.join(", ")))
        });
    }
    let jobs: serde_json::Map<String, serde_json::Value> =
        jobs.into_iter().map(|j| (j.name.to_string(), json!(j))).collect();
    Ok(Json(json!({"status": "ready", "jobs": jobs})))
}

/// A stuck job is not over in a second; probes may come back after this.
const STUCK_RETRY_AFTER_S: u32 = 5;

/// Prometheus text exposition.
#[utoipa::path(get, path = "/metrics", tag = "operations", responses(
    (status = 200, description = "Prometheus text format", content_type = "text/plain"),
    (status = 404, description = "no metrics recorder in this process (plain text)", content_type = "text/plain"),
))]
pub async fn metrics_text(State(state): State<SharedState>) -> Response {
    match &state.metrics {
        Some(handle) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()).into_response(),
        None => (StatusCode::NOT_FOUND, "metrics recorder not installed").into_response(),
    }
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations", responses((status = 200, description = "OpenAPI 3 document")))]
pub async fn openapi(State(state): State<SharedState>) -> Json<utoipa::openapi::OpenApi> {
    Json(super::docs::document(&state.settings))
}
