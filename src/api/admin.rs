//! Tenant administration (admin token): tenants and their API keys.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::ApiError;
use super::extract::{Admin, ValidJson};
use super::SharedState;
use crate::auth::mint_api_key;
use crate::engine::TenantId;
use crate::storage::Insert;
use crate::time::{now_ms, Timestamp};

pub fn routes() -> Router<SharedState> {
    Router::new()
        .route("/v1/admin/tenants", post(create_tenant).get(list_tenants))
        .route("/v1/admin/tenants/{id}/api-keys", post(create_api_key))
        .route("/v1/admin/tenants/{id}/api-keys/{key_id}", delete(revoke_api_key))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    /// `[a-z0-9-]{1,64}`
    pub id: TenantId,
    /// 1-200 characters.
    pub name: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedTenant {
    pub id: String,
    pub name: String,
    /// Shown once; only its hash is stored.
    pub api_key: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TenantView {
    pub id: String,
    pub name: String,
    #[schema(value_type = String, format = DateTime)]
    pub created_at: Timestamp,
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

fn tenant_path(id: &str) -> Result<TenantId, ApiError> {
    TenantId::parse(id).map_err(|_| ApiError::not_found("tenant_not_found", "Tenant not found", "no such tenant"))
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
    let (secret, stored) = mint_api_key();
    match state.storage.create_tenant(&req.id, name, &stored, now_ms()).await? {
        Insert::Created => {
            tracing::info!(tenant = %req.id, "tenant created");
            let body = CreatedTenant { id: req.id.to_string(), name: name.to_string(), api_key: secret };
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
        .map(|t| TenantView { id: t.id.to_string(), name: t.name, created_at: Timestamp(t.created_at_ms) })
        .collect();
    Ok(Json(TenantList { items }))
}

/// Issues another API key for a tenant.
#[utoipa::path(post, path = "/v1/admin/tenants/{id}/api-keys", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path)),
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
        None => Err(ApiError::not_found("tenant_not_found", "Tenant not found", "no such tenant")),
    }
}

/// Revokes an API key; it fails with 401 at once.
#[utoipa::path(delete, path = "/v1/admin/tenants/{id}/api-keys/{key_id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path), ("key_id" = String, Path)),
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
