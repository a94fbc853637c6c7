//! The tenant's planning plugin: upload a WebAssembly component, list versions, roll back or
//! forward. Versions live in storage, so every process serves the same one.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::ApiError;
use super::extract::{Path, Tenant};
use super::SharedState;
use crate::plugin::{Active, LoadError};
use crate::storage::{PluginUpload, PluginVersion};
use crate::time::{now_ms, Timestamp};

/// Longest plugin configuration text.
const MAX_CONFIG_BYTES: usize = 4096;

pub fn routes(max_wasm_bytes: usize) -> Router<SharedState> {
    Router::new()
        .route("/v1/plugin", get(get_plugin).put(put_plugin).layer(DefaultBodyLimit::max(max_wasm_bytes)))
        .route("/v1/plugin/versions", get(list_versions))
        .route("/v1/plugin/versions/{version}/activate", post(activate))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UploadParams {
    /// The plugin's configuration text (up to 4096 bytes), passed to every plan call.
    #[param(max_length = 4096)]
    pub config: Option<String>,
}

/// The body of an upload: a WebAssembly component's bytes (the document's name for them; the
/// handler reads the raw body).
#[derive(ToSchema)]
#[schema(value_type = String, format = Binary)]
pub struct WasmComponent(#[allow(dead_code)] Vec<u8>);

#[derive(Debug, Serialize, ToSchema)]
pub struct Uploaded {
    pub version: i64,
    /// `null` for version 0, the built-in default.
    pub sha256: Option<String>,
    pub active: bool,
}

/// The active planner: an uploaded version, or the built-in default (version 0).
#[derive(Debug, Serialize, ToSchema)]
pub struct ActivePlugin {
    pub name: String,
    pub version: i64,
    pub sha256: Option<String>,
    #[schema(value_type = Option<String>, format = DateTime)]
    pub uploaded_at: Option<Timestamp>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct VersionView {
    pub version: i64,
    pub sha256: String,
    #[schema(value_type = String, format = DateTime)]
    pub uploaded_at: Timestamp,
    pub active: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct VersionPage {
    pub items: Vec<VersionView>,
    pub next_after: Option<String>,
}

fn builtin() -> ActivePlugin {
    ActivePlugin { name: "default".into(), version: 0, sha256: None, uploaded_at: None }
}

fn load_failed(error: LoadError) -> ApiError {
    match error {
        LoadError::Invalid(invalid) => {
            metrics::counter!("stockd_plugin_uploads_total", "result" => "invalid").increment(1);
            ApiError::new(422, "plugin_invalid", "Plugin invalid", invalid.reason().to_string())
        }
        LoadError::Busy(why) => ApiError::too_many_requests(&why, 1),
        LoadError::Unavailable(why) => ApiError::unavailable(&why),
    }
}

/// Uploads a new version (a WebAssembly component, `application/wasm`) and activates it. Beyond
/// `[plugins] max_versions_per_tenant` versions, the oldest are deleted (never the version that
/// was active until now).
#[utoipa::path(put, path = "/v1/plugin", tag = "plugins", security(("api_key" = [])), params(UploadParams),
    request_body(content = WasmComponent, content_type = "application/wasm"),
    responses(
        (status = 201, body = Uploaded),
        (status = 413, description = "payload_too_large", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 415, description = "unsupported_media_type", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "plugin_invalid: invalid, or too complex to compile within limits", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "too_many_requests: another plugin of this tenant is compiling", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "every compiler is busy, or shutting down", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn put_plugin(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    params: Result<Query<UploadParams>, QueryRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let params = params.map(|Query(p)| p).map_err(|e| ApiError::validation("query", e.body_text()))?;
    let is_wasm = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/wasm")));
    if !is_wasm {
        return Err(ApiError::new(
            415,
            "unsupported_media_type",
            "Unsupported media type",
            "the body must be application/wasm",
        ));
    }
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                413,
                "payload_too_large",
                "Payload too large",
                "the plugin exceeds the configured maximum size",
            )
        } else {
            ApiError::validation("body", "could not be read")
        }
    })?;
    let config = params.config.unwrap_or_default();
    if config.len() > MAX_CONFIG_BYTES {
        return Err(ApiError::validation("config", format!("must be at most {MAX_CONFIG_BYTES} bytes")));
    }
    let wasm: Arc<[u8]> = Arc::from(&body[..]);
    let plugin = state.plugins.load(&auth.tenant, Arc::clone(&wasm)).await.map_err(load_failed)?;
    let upload = PluginUpload {
        sha256: plugin.sha256(),
        wasm: wasm.to_vec(),
        config,
        max_versions: state.settings.max_plugin_versions,
    };
    let saved = state.storage.save_plugin(&auth.tenant, &upload, now_ms()).await?;
    state
        .plugins
        .set(&auth.tenant, Active::Wasm { version: saved.version, plugin, config: Arc::from(saved.config.as_str()) });
    metrics::counter!("stockd_plugin_uploads_total", "result" => "accepted").increment(1);
    tracing::info!(tenant = %auth.tenant, version = saved.version, sha256 = %saved.sha256, "plugin uploaded");
    let body = Uploaded { version: saved.version, sha256: Some(saved.sha256), active: true };
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// The active version, or the built-in default.
#[utoipa::path(get, path = "/v1/plugin", tag = "plugins", security(("api_key" = [])),
    responses((status = 200, body = ActivePlugin)))]
pub async fn get_plugin(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
) -> Result<Json<ActivePlugin>, ApiError> {
    let active = state.storage.active_plugin(&auth.tenant).await?;
    Ok(Json(active.map_or_else(builtin, |v| ActivePlugin {
        name: "wasm".into(),
        version: v.version,
        sha256: Some(v.sha256),
        uploaded_at: Some(Timestamp(v.uploaded_at_ms)),
    })))
}

/// Every uploaded version, oldest first.
#[utoipa::path(get, path = "/v1/plugin/versions", tag = "plugins", security(("api_key" = [])),
    responses((status = 200, body = VersionPage)))]
pub async fn list_versions(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
) -> Result<Json<VersionPage>, ApiError> {
    let versions = state.storage.list_plugins(&auth.tenant).await?;
    let items = versions
        .into_iter()
        .map(|v: PluginVersion| VersionView {
            version: v.version,
            sha256: v.sha256,
            uploaded_at: Timestamp(v.uploaded_at_ms),
            active: v.active,
        })
        .collect();
    Ok(Json(VersionPage { items, next_after: None }))
}

/// Makes a stored version active (0: the built-in default). Orders already planned finish on
/// the version they started with.
#[utoipa::path(post, path = "/v1/plugin/versions/{version}/activate", tag = "plugins", security(("api_key" = [])),
    params(("version" = i64, Path, minimum = 0)),
    responses(
        (status = 200, body = Uploaded),
        (status = 404, description = "plugin_version_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "plugin_invalid: the version no longer compiles under today's limits", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "too_many_requests: another plugin of this tenant is compiling", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "every compiler is busy, or shutting down", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn activate(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(version): Path<String>,
) -> Result<Json<Uploaded>, ApiError> {
    let missing =
        || ApiError::not_found("plugin_version_not_found", "Plugin version not found", "no such plugin version");
    let version: i64 = version.parse().ok().filter(|v| *v >= 0).ok_or_else(missing)?;
    if version == 0 {
        state.storage.activate_plugin(&auth.tenant, 0).await?;
        state.plugins.set(&auth.tenant, Active::Builtin);
        return Ok(Json(Uploaded { version: 0, sha256: None, active: true }));
    }
    // Load first, so a version that no longer compiles under today's limits is never activated.
    let wasm = state.storage.plugin_wasm(&auth.tenant, version).await?.ok_or_else(missing)?;
    let plugin = state.plugins.load(&auth.tenant, Arc::from(wasm)).await.map_err(load_failed)?;
    let activated = state.storage.activate_plugin(&auth.tenant, version).await?.ok_or_else(missing)?;
    state.plugins.set(&auth.tenant, Active::Wasm { version, plugin, config: Arc::from(activated.config.as_str()) });
    tracing::info!(tenant = %auth.tenant, version, "plugin version activated");
    Ok(Json(Uploaded { version, sha256: Some(activated.sha256), active: true }))
}
