//! Tenant administration (admin token): tenants, their API keys and their request rates.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post, put};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::ApiError;
use super::extract::{Admin, Path, ValidJson};
use super::SharedState;
use crate::auth::mint_api_key;
use crate::engine::TenantId;
use crate::ratelimit::RateLimit;
use crate::storage::Insert;
use crate::time::{now_ms, Timestamp};

pub fn routes() -> Router<SharedState> {
    Router::new()
        .route("/v1/admin/tenants", post(create_tenant).get(list_tenants))
        .route("/v1/admin/tenants/{id}/api-keys", post(create_api_key).get(list_api_keys))
        .route("/v1/admin/tenants/{id}/api-keys/{key_id}", delete(revoke_api_key))
        .route("/v1/admin/tenants/{id}/rate-limit", put(set_rate_limit).delete(clear_rate_limit))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    /// `[a-z0-9-]{1,64}`
    pub id: TenantId,
    /// 1-200 characters.
    pub name: String,
    /// The tenant's own request rate; absent or `null`: the server's `[rate_limits]` default.
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedTenant {
    pub id: String,
    pub name: String,
    /// Shown once; only its hash is stored.
    pub api_key: String,
    pub rate_limit: Option<RateLimit>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TenantView {
    pub id: String,
    pub name: String,
    #[schema(value_type = String, format = DateTime)]
    pub created_at: Timestamp,
    /// `null`: the server's `[rate_limits]` default.
    pub rate_limit: Option<RateLimit>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TenantRate {
    pub id: String,
    pub rate_limit: RateLimit,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TenantList {
    pub items: Vec<TenantView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedApiKey {
    pub key_id: String,
    /// Shown once; only its hash is stored.
    pub api_key: String,
}

fn tenant_not_found() -> ApiError {
    ApiError::not_found("tenant_not_found", "Tenant not found", "no such tenant")
}

fn tenant_path(id: &str) -> Result<TenantId, ApiError> {
    TenantId::parse(id).map_err(|_| tenant_not_found())
}

/// Creates a tenant and its first API key.
#[utoipa::path(post, path = "/v1/admin/tenants", tag = "admin", request_body = CreateTenant,
    security(("admin_token" = [])),
    responses(
        (status = 201, body = CreatedTenant),
        (status = 400, body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "tenant_exists", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn create_tenant(
    _: Admin,
    State(state): State<SharedState>,
    body: ValidJson<CreateTenant>,
) -> Result<Response, ApiError> {
    let req = body.value;
    let name = req.name.trim();
    if name.is_empty() || name.chars().count() > 200 {
        return Err(ApiError::validation("name", "must be 1-200 characters"));
    }
    if let Some(limit) = &req.rate_limit {
        limit.validate().map_err(|e| ApiError::validation("rate_limit", e))?;
    }
    let (secret, stored) = mint_api_key();
    match state.storage.create_tenant(&req.id, name, req.rate_limit, &stored, now_ms()).await? {
        Insert::Created => {
            tracing::info!(tenant = %req.id, "tenant created");
            let body = CreatedTenant {
                id: req.id.to_string(),
                name: name.to_string(),
                api_key: secret,
                rate_limit: req.rate_limit,
            };
            Ok((StatusCode::CREATED, Json(body)).into_response())
        }
        Insert::AlreadyExists => {
            Err(ApiError::new(409, "tenant_exists", "Tenant exists", format!("tenant {} already exists", req.id)))
        }
    }
}

/// Lists tenants (never their keys).
#[utoipa::path(get, path = "/v1/admin/tenants", tag = "admin", security(("admin_token" = [])),
    responses((status = 200, body = TenantList)))]
pub async fn list_tenants(_: Admin, State(state): State<SharedState>) -> Result<Json<TenantList>, ApiError> {
    let tenants = state.storage.list_tenants().await?;
    let items = tenants
        .into_iter()
        .map(|t| TenantView {
            id: t.id.to_string(),
            name: t.name,
            created_at: Timestamp(t.created_at_ms),
            rate_limit: t.rate_limit,
        })
        .collect();
    Ok(Json(TenantList { items }))
}

/// One of a tenant's API keys: its id and dates, never the key (which only its hash records).
#[derive(Debug, Serialize, ToSchema)]
pub struct ApiKeyView {
    pub key_id: String,
    #[schema(value_type = String, format = DateTime)]
    pub created_at: Timestamp,
    /// `null` while the key works.
    #[schema(value_type = Option<String>, format = DateTime)]
    pub revoked_at: Option<Timestamp>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ApiKeyList {
    pub items: Vec<ApiKeyView>,
}

/// Lists a tenant's API keys, revoked ones included, oldest first (at most 1,000).
#[utoipa::path(get, path = "/v1/admin/tenants/{id}/api-keys", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, pattern = r"^[a-z0-9-]{1,64}$")),
    responses(
        (status = 200, body = ApiKeyList),
        (status = 404, description = "tenant_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_api_keys(
    _: Admin,
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> Result<Json<ApiKeyList>, ApiError> {
    let tenant = tenant_path(&id)?;
    let keys = state.storage.list_api_keys(&tenant).await?.ok_or_else(tenant_not_found)?;
    let items = keys
        .into_iter()
        .map(|k| ApiKeyView {
            key_id: k.id,
            created_at: Timestamp(k.created_at_ms),
            revoked_at: k.revoked_at_ms.map(Timestamp),
        })
        .collect();
    Ok(Json(ApiKeyList { items }))
}

/// Issues another API key for a tenant.
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/api-keys", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, pattern = r"^[a-z0-9-]{1,64}$")),
    responses(
        (status = 201, body = CreatedApiKey),
        (status = 404, description = "tenant_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn create_api_key(
    _: Admin,
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let tenant = tenant_path(&id)?;
    let (secret, stored) = mint_api_key();
    match state.storage.add_api_key(&tenant, &stored, now_ms()).await? {
        Some(()) => {
            Ok((StatusCode::CREATED, Json(CreatedApiKey { key_id: stored.id, api_key: secret })).into_response())
        }
        None => Err(tenant_not_found()),
    }
}

/// Revokes an API key; it fails with 401 at once.
#[utoipa::path(delete, path = "/v1/admin/tenants/{id}/api-keys/{key_id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, pattern = r"^[a-z0-9-]{1,64}$"), ("key_id" = String, Path, min_length = 1, max_length = 128)),
    responses(
        (status = 204, description = "revoked"),
        (status = 404, description = "api_key_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn revoke_api_key(
    _: Admin,
    State(state): State<SharedState>,
    Path((id, key_id)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let missing = || ApiError::not_found("api_key_not_found", "API key not found", "no such API key");
    let tenant = TenantId::parse(id).map_err(|_| missing())?;
    if key_id.len() > 128 {
        return Err(missing());
    }
    // Evict before and after: a request racing the revocation cannot re-cache the key.
    state.auth.evict(&key_id);
    let revoked = state.storage.revoke_api_key(&tenant, &key_id, now_ms()).await?;
    state.auth.evict(&key_id);
    match revoked {
        Some(()) => {
            tracing::info!(tenant = %tenant, key_id = %key_id, "api key revoked");
            Ok(StatusCode::NO_CONTENT)
        }
        None => Err(missing()),
    }
}

/// Sets the tenant's own request rate (`requests_per_second` 0: no limit). It applies at once in
/// this process and within `[auth] cache_ttl_ms` in the others; the tenant's bucket starts full.
#[utoipa::path(put, path = "/v1/admin/tenants/{id}/rate-limit", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, pattern = r"^[a-z0-9-]{1,64}$")), request_body = RateLimit,
    responses(
        (status = 200, body = TenantRate),
        (status = 400, description = "validation_failed", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "tenant_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn set_rate_limit(
    _: Admin,
    State(state): State<SharedState>,
    Path(id): Path<String>,
    body: ValidJson<RateLimit>,
) -> Result<Json<TenantRate>, ApiError> {
    let tenant = tenant_path(&id)?;
    let limit = body.value;
    limit.validate().map_err(|e| ApiError::validation("body", e))?;
    store_rate_limit(&state, &tenant, Some(limit)).await?;
    Ok(Json(TenantRate { id: tenant.to_string(), rate_limit: limit }))
}

/// Returns the tenant to the server's `[rate_limits]` default.
#[utoipa::path(delete, path = "/v1/admin/tenants/{id}/rate-limit", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, pattern = r"^[a-z0-9-]{1,64}$")),
    responses(
        (status = 204, description = "the server default applies"),
        (status = 404, description = "tenant_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn clear_rate_limit(
    _: Admin,
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let tenant = tenant_path(&id)?;
    store_rate_limit(&state, &tenant, None).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn store_rate_limit(state: &SharedState, tenant: &TenantId, limit: Option<RateLimit>) -> Result<(), ApiError> {
    let stored = state.storage.set_rate_limit(tenant, limit).await?;
    stored.ok_or_else(tenant_not_found)?;
    // The cached keys carry the old rate; other processes drop theirs within the cache time.
    state.auth.evict_tenant(tenant);
    tracing::info!(tenant = %tenant, ?limit, "tenant rate limit set");
    Ok(())
}
