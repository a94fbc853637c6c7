//! The one HTTP mapping of errors: every failure becomes `application/problem+json` with a
//! stable `code`. Internal details are logged here and never returned.

use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::problem::Problem;
use crate::ratelimit::{remaining_field, RateLimit};
use crate::storage::StorageError;

pub const PROBLEM_JSON: &str = "application/problem+json";

/// The IETF httpapi rate-limit headers (draft-ietf-httpapi-ratelimit-headers).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    pub problem: Problem,
    pub retry_after_s: Option<u32>,
    /// `RateLimit-Policy` and `RateLimit` of a 429 (boxed: errors travel in every `Result`).
    pub rate_limit: Option<Box<[HeaderValue; 2]>>,
}

impl ApiError {
    pub fn new(status: u16, code: &str, title: &str, detail: impl Into<String>) -> Self {
        Self { problem: Problem::new(status, code, title, detail), retry_after_s: None, rate_limit: None }
    }

    /// The tenant's token bucket is empty; a token is back in `retry_after_s` (at least 1).
    pub fn rate_limited(limit: &RateLimit, retry_after_s: u32) -> Self {
        let detail = format!(
            "this tenant may send {} requests per second (bursts of {}); retry after {retry_after_s} s, \
             with the same Idempotency-Key where the call takes one",
            limit.requests_per_second, limit.burst
        );
        let policy = HeaderValue::try_from(limit.policy_field());
        let remaining = HeaderValue::try_from(remaining_field(0, retry_after_s));
        Self {
            retry_after_s: Some(retry_after_s.max(1)),
            rate_limit: policy.and_then(|p| Ok(Box::new([p, remaining?]))).ok(),
            ..Self::new(429, "rate_limited", "Too many requests", detail)
        }
    }

    /// A malformed or out-of-range input; `field` names it.
    pub fn validation(field: &str, detail: impl std::fmt::Display) -> Self {
        let field = if field.is_empty() || field == "." { "body" } else { field };
        Self::new(400, "validation_failed", "Validation failed", format!("{field}: {detail}"))
    }

    pub fn unauthorized() -> Self {
        Self::new(401, "unauthorized", "Unauthorized", "a valid bearer token is required")
    }

    pub fn forbidden() -> Self {
        Self::new(403, "forbidden", "Forbidden", "this key may not perform this operation")
    }

    pub fn not_found(code: &str, title: &str, detail: impl Into<String>) -> Self {
        Self::new(404, code, title, detail)
    }

    pub fn unavailable(detail: &str) -> Self {
        Self { retry_after_s: Some(1), ..Self::new(503, "unavailable", "Service unavailable", detail) }
    }

    /// The caller's own excess (its tenant's share of a limited resource is in use): retry
    /// after the given seconds. Never stored as an idempotent outcome.
    pub fn too_many_requests(detail: &str, retry_after_s: u32) -> Self {
        Self {
            retry_after_s: Some(retry_after_s.max(1)),
            ..Self::new(429, "too_many_requests", "Too many requests", detail)
        }
    }

    pub fn internal() -> Self {
        Self::new(500, "internal", "Internal error", "the request failed; nothing was applied")
    }
}

impl From<StorageError> for ApiError {
    fn from(err: StorageError) -> Self {
        match err {
            StorageError::Unavailable(why) => {
                tracing::warn!(error = %why, "storage unavailable");
                metrics::counter!("stockd_storage_unavailable_total").increment(1);
                ApiError::unavailable("storage is unavailable; retry shortly")
            }
            StorageError::Internal(why) => {
                tracing::error!(error = %why, "storage failure");
                ApiError::internal()
            }
            StorageError::RetryLater(why) => {
                tracing::info!(reason = %why, "request must be retried");
                ApiError::unavailable(&format!("{why}; retry with the same Idempotency-Key"))
            }
            StorageError::PlanRefused(why) => {
                metrics::counter!("stockd_plugin_failures_total", "kind" => "plan_refused").increment(1);
                ApiError::new(422, "plugin_failed", "Plugin failed", why)
            }
        }
    }
}

impl From<crate::pipeline::Refusal> for ApiError {
    fn from(refusal: crate::pipeline::Refusal) -> Self {
        use crate::pipeline::Refusal;
        use crate::plugin::PlanFailure;
        match refusal {
            Refusal::Invalid { field, reason } => ApiError::validation(&field, reason),
            Refusal::Plan(PlanFailure::Plugin(reason)) => ApiError::new(422, "plugin_failed", "Plugin failed", reason),
            Refusal::Plan(PlanFailure::TenantBusy(why)) => ApiError::too_many_requests(&why, 1),
            Refusal::Plan(PlanFailure::Unavailable(why)) => ApiError::unavailable(&why),
            Refusal::Plan(PlanFailure::Storage(err)) | Refusal::Storage(err) => err.into(),
            Refusal::Redis(err) => err.into(),
            // The handler that knows the key answers this itself.
            Refusal::ResourceNotFound => {
                ApiError::not_found("resource_not_found", "Resource not found", "no such resource")
            }
            Refusal::OrderNotFound => ApiError::not_found("order_not_found", "Order not found", "no such order"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_string(&self.problem).unwrap_or_else(|_| "{}".into());
        let mut response =
            (status, [(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON))], body).into_response();
        if let Some(seconds) = self.retry_after_s {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if let Some(values) = self.rate_limit {
            let [policy, remaining] = *values;
            response.headers_mut().insert(RATELIMIT_POLICY, policy);
            response.headers_mut().insert(RATELIMIT, remaining);
        }
        response
    }
}
