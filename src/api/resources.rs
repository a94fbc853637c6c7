//! Resources: create, read, list, activate/deactivate, adjust (idempotent), ledger pages.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::ApiError;
use super::extract::{page_limit, query, IdemKey, Path, Tenant, ValidJson};
use super::{idempotent_response, SharedState};
use crate::engine::{Kind, LedgerEntry, Mode, ResourceKey, ResourceState, ResourceStatus, MAX_TOTAL};
use crate::pipeline::Refusal;
use crate::storage::rules::MAX_BUCKETS;
use crate::storage::NewResource;
use crate::storage::PageFrom;
use crate::time::now_ms;

pub fn routes() -> Router<SharedState> {
    Router::new()
        .route("/v1/resources", post(create_resource).get(list_resources))
        .route("/v1/resources/{key}", get(get_resource).patch(patch_resource))
        .route("/v1/resources/{key}/adjustments", post(adjust))
        .route("/v1/resources/{key}/ledger", get(ledger))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateResource {
    pub key: ResourceKey,
    pub kind: Kind,
    /// Opening total, 0..=10^15, in the smallest unit.
    #[schema(minimum = 0, maximum = 1_000_000_000_000_000_i64)]
    pub total: i64,
    /// Number of bucket rows the counters are split over, 1..=1024 (default 1). Orders fall
    /// back across buckets, so a line is refused only when the total available cannot cover it.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1024)]
    pub buckets: Option<i64>,
    /// Deduction path: "db" (default) or "redis" (needs `[redis]`; see docs/REDIS.md).
    #[serde(default)]
    pub mode: Option<Mode>,
    /// Low-stock threshold, 0..=10^15: `resource.low_stock` is emitted when available falls to
    /// it or under (docs/EVENTS.md). Absent: none.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 1_000_000_000_000_000_i64)]
    pub low_stock: Option<i64>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchResource {
    #[serde(default)]
    pub status: Option<ResourceStatus>,
    #[serde(default)]
    pub buckets: Option<i64>,
    #[serde(default)]
    pub mode: Option<Mode>,
    /// Sets the low-stock threshold (0..=10^15), or clears it with `null`.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 1_000_000_000_000_000_i64)]
    pub low_stock: Option<Option<i64>>,
}

/// A field that may be absent (`None`), `null` (`Some(None)`) or a value.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

fn low_stock_threshold(value: Option<i64>) -> Result<Option<i64>, ApiError> {
    match value {
        Some(t) if !(0..=MAX_TOTAL).contains(&t) => {
            Err(ApiError::validation("low_stock", format!("must be between 0 and {MAX_TOTAL}")))
        }
        other => Ok(other),
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Adjustment {
    /// Restock (+) or write-off (−); non-zero, |delta| <= 10^12.
    #[schema(minimum = -1_000_000_000_000_i64, maximum = 1_000_000_000_000_i64)]
    pub delta: i64,
    /// Free text for the operator, up to 200 characters.
    #[serde(default)]
    #[schema(max_length = 200)]
    pub reason: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    /// Only keys starting with this.
    #[param(pattern = r"^[A-Za-z0-9._:@-]*$", max_length = 200)]
    pub prefix: Option<String>,
    /// Exclusive cursor: the last key of the previous page.
    #[param(pattern = r"^[A-Za-z0-9._:@-]*$", max_length = 200)]
    pub after: Option<String>,
    /// 1..=1000, default 100.
    pub limit: Option<u32>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct LedgerParams {
    /// Exclusive cursor: the last `seq` of the previous page (digits; empty: from the first).
    #[param(pattern = r"^[0-9]*$", max_length = 19)]
    pub after: Option<String>,
    /// 1..=1000, default 100.
    pub limit: Option<u32>,
    /// `true`: the newest `limit` entries instead (still oldest first); not with `after`.
    pub newest: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ResourcePage {
    pub items: Vec<ResourceState>,
    pub next_after: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LedgerPage {
    pub items: Vec<LedgerEntry>,
    pub next_after: Option<String>,
}

pub fn resource_not_found(key: &str) -> ApiError {
    ApiError::not_found("resource_not_found", "Resource not found", format!("no resource {key}"))
}

/// A key from the path. A key that could never exist is simply not found.
fn path_key(key: &str) -> Result<ResourceKey, ApiError> {
    ResourceKey::parse(key).map_err(|e| ApiError::validation("key", e))
}

/// The bucket count of a new resource.
fn bucket_count(buckets: Option<i64>) -> Result<i64, ApiError> {
    match buckets.unwrap_or(1) {
        n @ 1..=MAX_BUCKETS => Ok(n),
        _ => Err(ApiError::validation("buckets", format!("must be between 1 and {MAX_BUCKETS}"))),
    }
}

fn only_supported(buckets: Option<i64>) -> Result<(), ApiError> {
    if buckets.is_some() {
        return Err(ApiError::validation("buckets", "a resource's bucket count is fixed at creation"));
    }
    Ok(())
}

/// Creates a resource with its opening total (ledger op `create`).
#[utoipa::path(post, path = "/v1/resources", tag = "resources", request_body = CreateResource,
    security(("api_key" = [])),
    responses(
        (status = 201, body = ResourceState),
        (status = 400, body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "resource_exists", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn create_resource(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    body: ValidJson<CreateResource>,
) -> Result<Response, ApiError> {
    let req = body.value;
    if !(0..=MAX_TOTAL).contains(&req.total) {
        return Err(ApiError::validation("total", format!("must be between 0 and {MAX_TOTAL}")));
    }
    let buckets = bucket_count(req.buckets)?;
    let low_stock = low_stock_threshold(req.low_stock)?;
    crate::redis_mode::control::check_mode(state.redis.as_deref(), req.mode)?;
    if buckets != 1 && req.mode == Some(Mode::Redis) {
        return Err(ApiError::validation("mode", "redis mode takes one bucket"));
    }
    let new = NewResource { key: req.key, kind: req.kind, total: req.total, buckets, low_stock };
    match state.storage.create_resource(&auth.tenant, &new, now_ms()).await? {
        Some(created) if req.mode == Some(Mode::Redis) => {
            let switched = crate::redis_mode::control::switch_mode(
                state.redis.as_ref(),
                &state.storage,
                &auth.tenant,
                &new.key,
                Mode::Redis,
            )
            .await?;
            Ok((StatusCode::CREATED, Json(switched.unwrap_or(created))).into_response())
        }
        Some(created) => Ok((StatusCode::CREATED, Json(created)).into_response()),
        None => Err(ApiError::new(
            409,
            "resource_exists",
            "Resource exists",
            format!("resource {} already exists", new.key),
        )),
    }
}

/// A resource's state.
#[utoipa::path(get, path = "/v1/resources/{key}", tag = "resources", security(("api_key" = [])),
    params(("key" = String, Path, pattern = r"^[A-Za-z0-9._:@-]{1,200}$")),
    responses(
        (status = 200, body = ResourceState),
        (status = 404, description = "resource_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_resource(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(key): Path<String>,
) -> Result<Json<ResourceState>, ApiError> {
    let key = path_key(&key)?;
    let found = state.storage.get_resource(&auth.tenant, &key).await?;
    found.map(Json).ok_or_else(|| resource_not_found(key.as_str()))
}

/// A page of resources ordered by key.
#[utoipa::path(get, path = "/v1/resources", tag = "resources", security(("api_key" = [])),
    params(ListParams), responses((status = 200, body = ResourcePage)))]
pub async fn list_resources(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    params: Result<Query<ListParams>, QueryRejection>,
) -> Result<Json<ResourcePage>, ApiError> {
    let params = query(params)?;
    let limit = page_limit(params.limit)?;
    let key_like = |field: &str, v: &Option<String>| match v.as_deref() {
        None | Some("") => Ok(None),
        Some(s) => ResourceKey::parse(s).map(|_| Some(s.to_string())).map_err(|e| ApiError::validation(field, e)),
    };
    let prefix = key_like("prefix", &params.prefix)?;
    let after = key_like("after", &params.after)?;
    let items = state.storage.list_resources(&auth.tenant, prefix.as_deref(), after.as_deref(), limit).await?;
    let next_after = (items.len() == limit as usize).then(|| items.last().map(|r| r.key.clone())).flatten();
    Ok(Json(ResourcePage { items, next_after }))
}

/// Activates or deactivates a resource, or switches its mode (warming or draining Redis).
#[utoipa::path(patch, path = "/v1/resources/{key}", tag = "resources", request_body = PatchResource,
    security(("api_key" = [])), params(("key" = String, Path, pattern = r"^[A-Za-z0-9._:@-]{1,200}$")),
    responses(
        (status = 200, body = ResourceState),
        (status = 404, description = "resource_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn patch_resource(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(key): Path<String>,
    body: ValidJson<PatchResource>,
) -> Result<Json<ResourceState>, ApiError> {
    let key = path_key(&key)?;
    let req = body.value;
    if req.status.is_none() && req.buckets.is_none() && req.mode.is_none() && req.low_stock.is_none() {
        return Err(ApiError::validation("body", "give at least one of status, buckets, mode, low_stock"));
    }
    only_supported(req.buckets)?;
    let low_stock = req.low_stock.map(low_stock_threshold).transpose()?;
    crate::redis_mode::control::check_mode(state.redis.as_deref(), req.mode)?;
    let mut updated = match req.status {
        Some(status) => state.storage.set_resource_status(&auth.tenant, &key, status, now_ms()).await?,
        None => state.storage.get_resource(&auth.tenant, &key).await?,
    };
    if let (Some(threshold), Some(_)) = (low_stock, &updated) {
        updated = state.storage.set_low_stock(&auth.tenant, &key, threshold, now_ms()).await?;
    }
    if let (Some(mode), Some(_)) = (req.mode, &updated) {
        updated =
            crate::redis_mode::control::switch_mode(state.redis.as_ref(), &state.storage, &auth.tenant, &key, mode)
                .await?;
    }
    if let (Some(_), Some(resource), Some(redis)) = (req.status, &updated, state.redis.as_deref()) {
        redis.after_status(resource, &auth.tenant).await?;
    }
    updated.map(Json).ok_or_else(|| resource_not_found(key.as_str()))
}

/// Restock (+) or write-off (−). Requires `Idempotency-Key`.
#[utoipa::path(post, path = "/v1/resources/{key}/adjustments", tag = "resources", request_body = Adjustment,
    security(("api_key" = [])),
    params(("key" = String, Path, pattern = r"^[A-Za-z0-9._:@-]{1,200}$"), ("Idempotency-Key" = String, Header, description = "1-255 visible ASCII characters", pattern = r"^[\x21-\x7e]{1,255}$")),
    responses(
        (status = 200, body = ResourceState),
        (status = 404, description = "resource_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "insufficient", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 400, description = "idempotency_key_missing: no Idempotency-Key header", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "idempotency_key_mismatch / total_out_of_range: a restock past a total of 10^15", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "redis_not_warmed: a redis-mode resource Redis does not hold", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn adjust(
    Tenant(auth): Tenant,
    IdemKey(idem_key): IdemKey,
    State(state): State<SharedState>,
    Path(key): Path<String>,
    body: ValidJson<Adjustment>,
) -> Result<Response, ApiError> {
    let key = path_key(&key)?;
    let idempotency = body.idempotency(idem_key);
    let req = body.value;
    match state.pipeline.adjust(&auth.tenant, idempotency, &key, req.delta, req.reason.as_deref()).await {
        Ok(outcome) => Ok(idempotent_response(outcome)),
        Err(Refusal::ResourceNotFound) => Err(resource_not_found(key.as_str())),
        Err(refusal) => Err(refusal.into()),
    }
}

/// The resource's ledger, oldest first (from the start, after a cursor, or its newest entries).
#[utoipa::path(get, path = "/v1/resources/{key}/ledger", tag = "resources", security(("api_key" = [])),
    params(("key" = String, Path, pattern = r"^[A-Za-z0-9._:@-]{1,200}$"), LedgerParams),
    responses(
        (status = 200, body = LedgerPage),
        (status = 404, description = "resource_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn ledger(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(key): Path<String>,
    params: Result<Query<LedgerParams>, QueryRejection>,
) -> Result<Json<LedgerPage>, ApiError> {
    let key = path_key(&key)?;
    let params = query(params)?;
    let limit = page_limit(params.limit)?;
    let after = match params.after.as_deref() {
        None | Some("") => 0,
        // 1-19 digits, as documented: `parse` alone would also take a sign or leading zeros.
        Some(s) => (s.len() <= 19 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<i64>().ok())
            .flatten()
            .ok_or_else(|| ApiError::validation("after", "must be a ledger seq"))?,
    };
    let from = match params.newest {
        Some(true) if params.after.is_some() => {
            return Err(ApiError::validation("newest", "reads the ledger's end: not with `after`"));
        }
        Some(true) => PageFrom::Newest,
        _ => PageFrom::After(after),
    };
    let items = state.storage.ledger_page(&auth.tenant, &key, from, limit).await?;
    let items = items.ok_or_else(|| resource_not_found(key.as_str()))?;
    // The newest page has nothing after it (yet).
    let full = items.len() == limit as usize && from != PageFrom::Newest;
    let next_after = full.then(|| items.last().map(|e| e.seq.to_string())).flatten();
    Ok(Json(LedgerPage { items, next_after }))
}
