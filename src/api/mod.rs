//! The REST API (`docs/API.md` is the contract): routers by feature, one error mapping, strict
//! extractors, request metrics and timeouts, and the generated OpenAPI document. Mutating
//! requests go through [`crate::pipeline`]; handlers only map requests to it and its outcomes
//! to responses.

pub mod admin;
pub mod console;
pub mod docs;
pub mod error;
pub mod events;
pub mod extract;
pub mod ops;
pub mod orders;
pub mod plugins;
pub mod reservations;
pub mod resources;
pub mod warm;
pub mod webhooks;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tower_http::catch_panic::CatchPanicLayer;

use self::error::ApiError;
use crate::auth::Authenticator;
use crate::plugin::Registry;
use crate::ratelimit::TenantLimiter;
use crate::storage::{ContentType, Idempotent, Storage, StoredResponse};

/// Limits and defaults the handlers apply.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    pub body_limit_bytes: usize,
    pub request_timeout: Duration,
    /// Most requests served at once (`[server] max_in_flight_requests`).
    pub max_in_flight: usize,
    /// Plugin versions a tenant keeps (`[plugins] max_versions_per_tenant`).
    pub max_plugin_versions: usize,
    /// How long an upload waits for its compile before `202` (`[plugins] upload_wait_ms`).
    pub upload_wait: Duration,
    /// `[events]`: the feed's long polls.
    pub events: crate::config::EventsConfig,
}

/// Everything a handler needs.
pub struct AppState {
    pub storage: Arc<dyn Storage>,
    pub auth: Authenticator,
    /// Per-tenant request rate limits, applied by the [`extract::Tenant`] extractor.
    pub limits: TenantLimiter,
    pub plugins: Arc<Registry>,
    /// Uploads that answered (or may answer) `202`, for their status address.
    pub uploads: plugins::UploadTracker,
    pub settings: ApiSettings,
    pub metrics: Option<PrometheusHandle>,
    /// Redis mode, when `[redis]` is configured.
    pub redis: Option<Arc<crate::redis_mode::RedisMode>>,
    /// The path of every mutating request.
    pub pipeline: crate::pipeline::Pipeline,
    /// One permit per request in flight (see [`ApiSettings::max_in_flight`]).
    pub in_flight: Arc<tokio::sync::Semaphore>,
    /// The supervised background jobs, whose health `/readyz` reports.
    pub jobs: Arc<crate::jobs::supervisor::JobRegistry>,
}

pub type SharedState = Arc<AppState>;

/// The whole HTTP application.
pub fn router(state: SharedState) -> Router {
    let body_limit = state.settings.body_limit_bytes;
    Router::new()
        .merge(ops::routes())
        .merge(console::routes())
        .merge(admin::routes())
        .merge(resources::routes())
        .merge(orders::routes())
        .merge(plugins::routes(state.plugins.max_wasm_bytes()))
        .merge(reservations::routes())
        .merge(warm::routes())
        .merge(events::routes())
        .merge(webhooks::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .layer(CatchPanicLayer::custom(|_| {
            metrics::counter!("stockd_panics_total").increment(1);
            ApiError::internal().into_response()
        }))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::not_found("not_found", "Not found", "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(405, "method_not_allowed", "Method not allowed", "this route does not take that method")
}

/// Counts and times every request by route and status, bounds its duration, and puts the
/// tenant's rate-limit headers on a served tenant request.
async fn observe(State(state): State<SharedState>, mut request: Request, next: Next) -> Response {
    let started = Instant::now();
    // Operations routes stay answerable under any load: probes must not be shed.
    let operational = matches!(request.uri().path(), "/healthz" | "/readyz" | "/metrics");
    let _permit = match (operational, Arc::clone(&state.in_flight).try_acquire_owned()) {
        (true, _) => None,
        (false, Ok(permit)) => Some(InFlight::start(permit)),
        (false, Err(_)) => {
            metrics::counter!("stockd_http_shed_total").increment(1);
            let detail = format!(
                "the server has {} requests in flight, its limit; nothing was applied, retry shortly",
                state.settings.max_in_flight
            );
            return ApiError::unavailable(&detail).into_response();
        }
    };
    let note = extract::RateLimitNote::default();
    request.extensions_mut().insert(note.clone());
    let method = request.method().as_str().to_string();
    let route =
        request.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_else(|| "unmatched".into());
    let mut response = match tokio::time::timeout(state.settings.request_timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            ApiError::unavailable("the request took too long; retry with the same Idempotency-Key").into_response()
        }
    };
    note.apply(&mut response);
    let status = response.status().as_u16().to_string();
    metrics::counter!("stockd_http_requests_total", "method" => method.clone(), "route" => route.clone(), "status" => status)
        .increment(1);
    metrics::histogram!("stockd_http_request_duration_seconds", "method" => method, "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

/// A request counted against `[server] max_in_flight_requests` until it ends (or is dropped,
/// when its client goes away), with the gauge `stockd_http_requests_in_flight`.
struct InFlight(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit);

impl InFlight {
    fn start(permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        metrics::gauge!("stockd_http_requests_in_flight").increment(1.0);
        Self(permit)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        metrics::gauge!("stockd_http_requests_in_flight").decrement(1.0);
    }
}

/// Turns a stored (or fresh) idempotent response into HTTP, byte for byte.
pub fn stored_response(response: StoredResponse, replayed: bool) -> Response {
    let status = StatusCode::from_u16(response.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let content_type = match response.content_type {
        ContentType::Json => "application/json",
        ContentType::Problem => error::PROBLEM_JSON,
    };
    let mut http =
        (status, [(header::CONTENT_TYPE, HeaderValue::from_static(content_type))], response.body).into_response();
    if replayed {
        http.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    http
}

/// The common answer for an idempotent call's outcome.
pub fn idempotent_response(outcome: Idempotent) -> Response {
    match outcome {
        Idempotent::Fresh(r) => stored_response(r, false),
        Idempotent::Replayed(r) => {
            metrics::counter!("stockd_idempotent_replays_total").increment(1);
            stored_response(r, true)
        }
        Idempotent::Mismatch => ApiError::new(
            422,
            "idempotency_key_mismatch",
            "Idempotency key reused",
            "this Idempotency-Key was used for a different request; nothing was applied",
        )
        .into_response(),
    }
}
