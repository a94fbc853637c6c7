//! Webhook endpoints (docs/WEBHOOKS.md): register, list, read, delete, rotate the signing
//! secret, list delivery attempts, redeliver. Another tenant's endpoint answers exactly like a
//! missing one. The signing secret is answered once, at creation or rotation, and never again.

use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::ApiError;
use super::extract::{page_limit, query, Path, Tenant, ValidJson};
use super::SharedState;
use crate::events::EventType;
use crate::time::{now_ms, Timestamp};
use crate::webhooks::target::{self, TargetError};
use crate::webhooks::{new_endpoint_id, Attempt, Endpoint, NewEndpoint, Redeliver, Redelivered, SigningSecret};

/// Longest rotation grace a call may ask for.
const MAX_GRACE_SECONDS: u64 = 7 * 24 * 3600;
/// How long creating an endpoint waits for its host to resolve.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

pub fn routes() -> Router<SharedState> {
    Router::new()
        .route("/v1/webhooks", post(create_webhook).get(list_webhooks))
        .route("/v1/webhooks/{id}", get(get_webhook).delete(delete_webhook))
        .route("/v1/webhooks/{id}/rotate", post(rotate_secret))
        .route("/v1/webhooks/{id}/deliveries", get(list_deliveries))
        .route("/v1/webhooks/{id}/redeliver", post(redeliver))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWebhook {
    /// `http` or `https`, at most 2048 bytes, no credentials; must not resolve only to
    /// loopback, private or other non-public addresses (unless the server allows them).
    pub url: String,
    /// Event types to deliver (absent or empty: every type).
    #[serde(default)]
    pub types: Option<Vec<String>>,
    /// Free text, at most `[events.webhooks] max_description_chars` characters.
    #[serde(default)]
    pub description: Option<String>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RotateSecret {
    /// How long the current secret keeps signing beside the new one (0..=604800; default
    /// `[events.webhooks] rotation_grace_seconds`).
    #[serde(default)]
    #[schema(maximum = 604800)]
    pub grace_seconds: Option<u64>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RedeliverRequest {
    /// Queue this event again (one of the tenant's, still in the feed).
    #[serde(default)]
    #[schema(pattern = r"^evt_[\x21-\x7e]{0,60}$")]
    pub event_id: Option<String>,
    /// Queue every event of the endpoint's types after this sequence number again.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub after: Option<i64>,
}

/// An endpoint as answered (never with its secret, except [`CreatedWebhook`]).
#[derive(Debug, Serialize, ToSchema)]
pub struct Webhook {
    /// `wh_<ULID>`.
    pub id: String,
    pub url: String,
    /// Empty: every type.
    pub types: Vec<String>,
    pub description: String,
    /// `active`, or `failing` once a delivery failed for the whole retry window.
    pub state: String,
    #[schema(value_type = Option<String>)]
    pub failing_since: Option<Timestamp>,
    #[schema(value_type = String)]
    pub created_at: Timestamp,
    /// Until when the secret before the last rotation still signs (`null`: none).
    #[schema(value_type = Option<String>)]
    pub previous_secret_expires_at: Option<Timestamp>,
    /// Deliveries queued (on `GET /v1/webhooks/{id}` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending: Option<u64>,
}

impl Webhook {
    fn of(e: &Endpoint) -> Self {
        Self {
            id: e.id.clone(),
            url: e.url.clone(),
            types: e.types.iter().map(|t| t.as_str().to_string()).collect(),
            description: e.description.clone(),
            state: e.state.as_str().to_string(),
            failing_since: e.failing_since.map(Timestamp),
            created_at: Timestamp(e.created_at),
            previous_secret_expires_at: e.previous.as_ref().map(|(_, until)| Timestamp(*until)),
            pending: None,
        }
    }
}

/// An endpoint with its signing secret: the only answers that carry it.
#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedWebhook {
    #[serde(flatten)]
    pub webhook: Webhook,
    /// `whsec_<base64>`: verify deliveries with it (Standard Webhooks). Shown only now.
    pub secret: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookList {
    pub items: Vec<Webhook>,
}

/// One delivery attempt.
#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryAttempt {
    /// Increasing; pass the last one as `before` for the next (older) page.
    pub id: i64,
    pub event_id: String,
    pub seq: i64,
    #[serde(rename = "type")]
    pub kind: String,
    /// 1 for the first attempt of this event to this endpoint.
    pub attempt: i64,
    #[schema(value_type = String)]
    pub at: Timestamp,
    /// `delivered`, `failed`, or `dropped` (purged before it could be delivered).
    pub outcome: String,
    /// The receiver's status code, when it answered.
    pub http_status: Option<i64>,
    /// `http_status`, `timeout`, `connect`, `target_refused`, `request`, `event_purged`.
    pub error: Option<String>,
    pub latency_ms: i64,
}

impl DeliveryAttempt {
    fn of(a: Attempt) -> Self {
        Self {
            id: a.id,
            event_id: a.event_id,
            seq: a.seq,
            kind: a.kind,
            attempt: a.attempt,
            at: Timestamp(a.at),
            outcome: a.outcome.as_str().to_string(),
            http_status: a.http_status,
            error: a.error,
            latency_ms: a.latency_ms,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryPage {
    /// Newest first.
    pub items: Vec<DeliveryAttempt>,
    /// The `before` of the next page; `null` at the end.
    pub next_before: Option<i64>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeliveryParams {
    /// Only attempts with a smaller id (default: from the newest).
    pub before: Option<i64>,
    /// 1..=1000 (default 100).
    pub limit: Option<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Redelivery {
    pub id: String,
    /// Always `active` after a redeliver.
    pub state: String,
    /// Deliveries queued now for `event_id` (0 if it already was); the events after `after`
    /// are queued by the delivery job as it goes.
    pub queued: u64,
}

fn not_found() -> ApiError {
    ApiError::not_found("webhook_not_found", "Webhook not found", "no such webhook endpoint")
}

/// An id that could never be an endpoint's is simply not found.
fn path_id(id: &str) -> Result<&str, ApiError> {
    let ok = id.len() == 29 && id.starts_with("wh_") && id[3..].bytes().all(|b| b.is_ascii_alphanumeric());
    if ok {
        Ok(id)
    } else {
        Err(not_found())
    }
}

fn event_types(names: Option<Vec<String>>) -> Result<Vec<EventType>, ApiError> {
    let names = names.unwrap_or_default();
    if names.len() > EventType::ALL.len() {
        return Err(ApiError::validation("types", format!("at most {} types", EventType::ALL.len())));
    }
    let mut types = Vec::new();
    for name in &names {
        let t = EventType::parse(name).ok_or_else(|| {
            let known: Vec<_> = EventType::ALL.iter().map(|t| t.as_str()).collect();
            ApiError::validation("types", format!("unknown event type (known: {})", known.join(", ")))
        })?;
        if !types.contains(&t) {
            types.push(t);
        }
    }
    types.sort();
    Ok(types)
}

fn target_refused(err: TargetError) -> ApiError {
    match err {
        TargetError::Invalid(why) => ApiError::validation("url", why),
        TargetError::Forbidden(why) | TargetError::Unresolvable(why) => {
            ApiError::new(422, "webhook_target_refused", "Webhook target refused", format!("url: {why}"))
        }
    }
}

/// Registers an endpoint; its secret is answered now and never again. It receives the events
/// committed after it was created.
#[utoipa::path(post, path = "/v1/webhooks", tag = "webhooks", request_body = CreateWebhook,
    security(("api_key" = [])),
    responses(
        (status = 201, body = CreatedWebhook),
        (status = 400, body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "webhook_limit", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "webhook_target_refused", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn create_webhook(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    body: ValidJson<CreateWebhook>,
) -> Result<Response, ApiError> {
    let req = body.value;
    let settings = &state.settings.events.webhooks;
    let url = target::parse_url(req.url.trim()).map_err(target_refused)?;
    let types = event_types(req.types)?;
    let description = req.description.unwrap_or_default();
    if description.chars().count() > settings.max_description_chars {
        return Err(ApiError::validation(
            "description",
            format!("at most {} characters", settings.max_description_chars),
        ));
    }
    target::check(&url, settings.allow_private_targets, RESOLVE_TIMEOUT).await.map_err(target_refused)?;
    let new = NewEndpoint {
        id: new_endpoint_id(),
        tenant: auth.tenant.clone(),
        url: url.to_string(),
        types,
        description,
        secret: SigningSecret::generate(),
        created_at: now_ms(),
    };
    match state.storage.create_webhook(&new, settings.max_endpoints_per_tenant).await? {
        Some(created) => {
            metrics::counter!("stockd_webhook_endpoints_created_total").increment(1);
            let body = CreatedWebhook { webhook: Webhook::of(&created), secret: created.secret.expose().to_string() };
            Ok((StatusCode::CREATED, Json(body)).into_response())
        }
        None => Err(ApiError::new(
            409,
            "webhook_limit",
            "Too many webhooks",
            format!("a tenant may have {} webhook endpoints; delete one first", settings.max_endpoints_per_tenant),
        )),
    }
}

/// The tenant's endpoints (without secrets).
#[utoipa::path(get, path = "/v1/webhooks", tag = "webhooks", security(("api_key" = [])),
    responses((status = 200, body = WebhookList)))]
pub async fn list_webhooks(Tenant(auth): Tenant, State(state): State<SharedState>) -> Result<Response, ApiError> {
    let items = state.storage.list_webhooks(&auth.tenant).await?.iter().map(Webhook::of).collect();
    Ok(Json(WebhookList { items }).into_response())
}

/// One endpoint (without its secret), with its queued deliveries.
#[utoipa::path(get, path = "/v1/webhooks/{id}", tag = "webhooks", security(("api_key" = [])),
    params(("id" = String, Path, description = "wh_<ULID>", pattern = r"^wh_[A-Za-z0-9]{26}$")),
    responses(
        (status = 200, body = Webhook),
        (status = 404, description = "webhook_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_webhook(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = path_id(&id)?;
    let endpoint = state.storage.get_webhook(&auth.tenant, id).await?.ok_or_else(not_found)?;
    let mut webhook = Webhook::of(&endpoint);
    webhook.pending = Some(state.storage.webhook_pending(id).await?);
    Ok(Json(webhook).into_response())
}

/// Deletes an endpoint with its queued deliveries and its deliveries log.
#[utoipa::path(delete, path = "/v1/webhooks/{id}", tag = "webhooks", security(("api_key" = [])),
    params(("id" = String, Path, description = "wh_<ULID>", pattern = r"^wh_[A-Za-z0-9]{26}$")),
    responses(
        (status = 204),
        (status = 404, description = "webhook_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn delete_webhook(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = path_id(&id)?;
    if state.storage.delete_webhook(&auth.tenant, id).await? {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(not_found())
    }
}

/// Issues a new signing secret (answered now and never again); the current one keeps signing
/// beside it for the grace period, so receivers can switch without missing a delivery.
#[utoipa::path(post, path = "/v1/webhooks/{id}/rotate", tag = "webhooks", request_body = RotateSecret,
    security(("api_key" = [])),
    params(("id" = String, Path, description = "wh_<ULID>", pattern = r"^wh_[A-Za-z0-9]{26}$")),
    responses(
        (status = 200, body = CreatedWebhook),
        (status = 400, body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "webhook_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn rotate_secret(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(id): Path<String>,
    body: ValidJson<RotateSecret>,
) -> Result<Response, ApiError> {
    let id = path_id(&id)?;
    let grace = body.value.grace_seconds.unwrap_or(state.settings.events.webhooks.rotation_grace_seconds);
    if grace > MAX_GRACE_SECONDS {
        return Err(ApiError::validation("grace_seconds", format!("must be between 0 and {MAX_GRACE_SECONDS}")));
    }
    let secret = SigningSecret::generate();
    let until = now_ms().saturating_add(i64::try_from(grace.saturating_mul(1000)).unwrap_or(i64::MAX));
    let rotated = state.storage.rotate_webhook_secret(&auth.tenant, id, &secret, until).await?.ok_or_else(not_found)?;
    let body = CreatedWebhook { webhook: Webhook::of(&rotated), secret: rotated.secret.expose().to_string() };
    Ok(Json(body).into_response())
}

/// The endpoint's delivery attempts, newest first: status, latency, error kind.
#[utoipa::path(get, path = "/v1/webhooks/{id}/deliveries", tag = "webhooks", security(("api_key" = [])),
    params(("id" = String, Path, description = "wh_<ULID>", pattern = r"^wh_[A-Za-z0-9]{26}$"), DeliveryParams),
    responses(
        (status = 200, body = DeliveryPage),
        (status = 400, body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "webhook_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_deliveries(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(id): Path<String>,
    params: Result<Query<DeliveryParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let id = path_id(&id)?;
    let params = query(params)?;
    let limit = page_limit(params.limit)?;
    let attempts =
        state.storage.webhook_attempts(&auth.tenant, id, params.before, limit).await?.ok_or_else(not_found)?;
    let next_before = (attempts.len() == limit as usize).then(|| attempts.last().map(|a| a.id)).flatten();
    let items = attempts.into_iter().map(DeliveryAttempt::of).collect();
    Ok(Json(DeliveryPage { items, next_before }).into_response())
}

/// Makes the endpoint active again (after `failing`), its queued deliveries due now with a
/// fresh retry window, and queues an event (`event_id`) or every event after a sequence number
/// (`after`) again.
#[utoipa::path(post, path = "/v1/webhooks/{id}/redeliver", tag = "webhooks", request_body = RedeliverRequest,
    security(("api_key" = [])),
    params(("id" = String, Path, description = "wh_<ULID>", pattern = r"^wh_[A-Za-z0-9]{26}$")),
    responses(
        (status = 202, body = Redelivery),
        (status = 400, body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "webhook_not_found, event_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn redeliver(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(id): Path<String>,
    body: ValidJson<RedeliverRequest>,
) -> Result<Response, ApiError> {
    let id = path_id(&id)?;
    let req = body.value;
    if let Some(event_id) = &req.event_id {
        let ok = event_id.len() <= 64 && event_id.starts_with("evt_") && event_id.bytes().all(|b| b.is_ascii_graphic());
        if !ok {
            return Err(ApiError::validation("event_id", "must be an event id (evt_...)"));
        }
    }
    if req.after.is_some_and(|a| a < 0) {
        return Err(ApiError::validation("after", "must be a sequence number (0 or more)"));
    }
    let what = Redeliver { event_id: req.event_id, after: req.after };
    match state.storage.redeliver_webhook(&auth.tenant, id, &what, now_ms()).await? {
        Redelivered::Queued(queued) => {
            let body = Redelivery { id: id.to_string(), state: "active".into(), queued };
            Ok((StatusCode::ACCEPTED, Json(body)).into_response())
        }
        Redelivered::EndpointNotFound => Err(not_found()),
        Redelivered::EventNotFound => {
            Err(ApiError::not_found("event_not_found", "Event not found", "no such event in the feed"))
        }
    }
}
