//! The tenant's planning plugin: upload a WebAssembly component, list versions, roll back or
//! forward. Versions live in storage, so every process serves the same one.
//!
//! An upload names its language profile (`?runtime=rust|js|python`), whose limits bound it. A
//! compile that outlasts `[plugins] upload_wait_ms` (a JavaScript or Python engine takes
//! Cranelift tens of seconds) is answered `202 Accepted` with the upload's status address; the
//! compile goes on without the client, and the version is stored and activated when it
//! succeeds, exactly as if the request had waited.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
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
use crate::engine::TenantId;
use crate::plugin::{Active, LoadError, PlanFailure, Runtime};
use crate::problem::Problem;
use crate::storage::{PluginUpload, PluginVersion};
use crate::time::{now_ms, Timestamp};

/// Longest plugin configuration text.
const MAX_CONFIG_BYTES: usize = 4096;

pub fn routes(max_wasm_bytes: usize) -> Router<SharedState> {
    Router::new()
        .route("/v1/plugin", get(get_plugin).put(put_plugin).layer(DefaultBodyLimit::max(max_wasm_bytes)))
        .route("/v1/plugin/versions", get(list_versions))
        .route("/v1/plugin/uploads/{id}", get(upload_status))
        .route("/v1/plugin/versions/{version}/activate", post(activate))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UploadParams {
    /// The plugin's configuration text (up to 4096 bytes), passed to every plan call.
    #[param(max_length = 4096)]
    pub config: Option<String>,
    /// The component's language profile, whose limits it runs under: `rust` (the default),
    /// `js` (componentize-js) or `python` (componentize-py).
    pub runtime: Option<Runtime>,
}

/// The body of an upload: a WebAssembly component's bytes (the document's name for them; the
/// handler reads the raw body).
#[derive(ToSchema)]
#[schema(value_type = String, format = Binary)]
pub struct WasmComponent(#[allow(dead_code)] Vec<u8>);

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Uploaded {
    pub version: i64,
    /// `null` for version 0, the built-in default.
    pub sha256: Option<String>,
    pub active: bool,
    /// The version's language profile; `null` for version 0.
    pub runtime: Option<Runtime>,
}

/// Where an upload that answered `202 Accepted` stands.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct UploadStatus {
    pub id: String,
    /// `compiling`, `active` (stored and activated: `version` is set) or `failed` (`problem`
    /// says why, as the upload itself would have answered).
    #[schema(example = "compiling")]
    pub state: &'static str,
    pub runtime: Runtime,
    pub sha256: String,
    pub version: Option<i64>,
    pub problem: Option<Problem>,
}

/// The active planner: an uploaded version, or the built-in default (version 0).
#[derive(Debug, Serialize, ToSchema)]
pub struct ActivePlugin {
    pub name: String,
    pub version: i64,
    pub sha256: Option<String>,
    /// The language profile; `null` for the built-in default.
    pub runtime: Option<Runtime>,
    #[schema(value_type = Option<String>, format = DateTime)]
    pub uploaded_at: Option<Timestamp>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct VersionView {
    pub version: i64,
    pub sha256: String,
    pub runtime: Runtime,
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
    ActivePlugin { name: "default".into(), version: 0, sha256: None, runtime: None, uploaded_at: None }
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

/// Uploads a new version (a WebAssembly component, `application/wasm`) for a language profile
/// (`?runtime=`, default `rust`) and activates it. Beyond `[plugins] max_versions_per_tenant`
/// versions, the oldest are deleted (never the version that was active until now). A compile
/// longer than `[plugins] upload_wait_ms` answers `202` with `Location:
/// /v1/plugin/uploads/{id}`; the version is stored and activated when the compile succeeds.
#[utoipa::path(put, path = "/v1/plugin", tag = "plugins", security(("api_key" = [])), params(UploadParams),
    request_body(content = WasmComponent, content_type = "application/wasm"),
    responses(
        (status = 201, body = Uploaded),
        (status = 202, description = "still compiling: poll the Location (GET /v1/plugin/uploads/{id})", body = UploadStatus),
        (status = 413, description = "payload_too_large: over the runtime's max_wasm_bytes", body = crate::problem::Problem, content_type = "application/problem+json"),
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
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let params = params.map(|Query(p)| p).map_err(|e| ApiError::validation("query", e.body_text()));
    let is_wasm = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/wasm")));
    let runtime = params.as_ref().ok().and_then(|p| p.runtime).unwrap_or(Runtime::Rust);
    let host = state.plugins.host(runtime);
    // A JavaScript or Python upload may be tens of MiB: only so many are held at once (each
    // until its compile ends), so a burst of them cannot take the server's memory.
    let acceptable = params.is_ok() && is_wasm && host.is_some();
    let permit = match runtime {
        Runtime::Js | Runtime::Python if acceptable => Some(state.uploads.hold_large()),
        _ => None,
    };
    // The body is kept up to this runtime's limit (nothing of a request refused anyway), and
    // the rest is read and dropped, up to the route's limit, so a client still sending gets
    // the answer below rather than a reset connection.
    let keep = match (&host, &permit) {
        (Some(host), None | Some(Ok(_))) if acceptable => host.limits().max_wasm_bytes,
        _ => 0,
    };
    let body = read_limited(body, keep, state.plugins.max_wasm_bytes()).await?;
    let params = params?;
    if !is_wasm {
        return Err(ApiError::new(
            415,
            "unsupported_media_type",
            "Unsupported media type",
            "the body must be application/wasm",
        ));
    }
    let host = host.ok_or_else(|| {
        ApiError::validation("runtime", format!("the {runtime} runtime is not enabled on this server"))
    })?;
    let permit = permit.transpose().map_err(|_| {
        ApiError::unavailable("as many large plugin uploads as this server takes are in progress; retry shortly")
    })?;
    let max_bytes = host.limits().max_wasm_bytes;
    let body = body.ok_or_else(|| {
        ApiError::new(
            413,
            "payload_too_large",
            "Payload too large",
            format!("the plugin exceeds the {runtime} runtime's maximum size of {max_bytes} bytes"),
        )
    })?;
    let config = params.config.unwrap_or_default();
    if config.len() > MAX_CONFIG_BYTES {
        return Err(ApiError::validation("config", format!("must be at most {MAX_CONFIG_BYTES} bytes")));
    }
    let wasm: Arc<[u8]> = Arc::from(&body[..]);
    let sha256 = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&wasm));
    let id = state.uploads.start(&auth.tenant, runtime, &sha256);
    // The compile, store and activation run on their own task: a client that stops waiting
    // (or the 202 below) does not stop them.
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let task_state = Arc::clone(&state);
    let (tenant, task_id) = (auth.tenant.clone(), id.clone());
    tokio::spawn(async move {
        let _permit = permit;
        let outcome = upload_and_activate(&task_state, &tenant, runtime, wasm, config).await;
        task_state.uploads.finish(&task_id, &outcome);
        let _ = done_tx.send(outcome);
    });
    match tokio::time::timeout(state.settings.upload_wait, done_rx).await {
        Ok(Ok(Ok(uploaded))) => Ok((StatusCode::CREATED, Json(uploaded)).into_response()),
        Ok(Ok(Err(error))) => Err(error),
        Ok(Err(_)) => Err(ApiError::internal()),
        Err(_) => {
            let status = state.uploads.status(&auth.tenant, &id).ok_or_else(ApiError::internal)?;
            let location = format!("/v1/plugin/uploads/{id}");
            Ok((StatusCode::ACCEPTED, [(header::LOCATION, location)], Json(status)).into_response())
        }
    }
}

/// The body if it is at most `keep` bytes; `None` when it is longer (read on, and dropped, up to
/// `drain` bytes in all).
async fn read_limited(body: axum::body::Body, keep: usize, drain: usize) -> Result<Option<Bytes>, ApiError> {
    use futures::StreamExt;
    let mut stream = body.into_data_stream();
    let mut kept = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|_| ApiError::validation("body", "could not be read"))?;
        seen = seen.saturating_add(chunk.len());
        if seen <= keep {
            kept.extend_from_slice(&chunk);
        } else if seen > drain {
            return Ok(None);
        }
    }
    Ok((seen <= keep).then(|| Bytes::from(kept)))
}

/// Compiles, stores and activates an upload: what `PUT /v1/plugin` answers, whether it
/// waited for it or not.
async fn upload_and_activate(
    state: &SharedState,
    tenant: &TenantId,
    runtime: Runtime,
    wasm: Arc<[u8]>,
    config: String,
) -> Result<Uploaded, ApiError> {
    let plugin = state.plugins.load(tenant, runtime, Arc::clone(&wasm)).await.map_err(load_failed)?;
    let stored = tokio::task::spawn_blocking(move || crate::plugin::stored::encode(&wasm))
        .await
        .map_err(|_| ApiError::unavailable("the plugin could not be stored; try again"))?;
    let upload = PluginUpload {
        sha256: plugin.sha256(),
        wasm: stored,
        config,
        runtime: runtime.as_str().to_owned(),
        max_versions: state.settings.max_plugin_versions,
    };
    let saved = state.storage.save_plugin(tenant, &upload, now_ms()).await?;
    state
        .plugins
        .set(tenant, Active::Wasm { version: saved.version, plugin, config: Arc::from(saved.config.as_str()) });
    metrics::counter!("stockd_plugin_uploads_total", "result" => "accepted").increment(1);
    tracing::info!(%tenant, version = saved.version, sha256 = %saved.sha256, %runtime, "plugin uploaded");
    Ok(Uploaded { version: saved.version, sha256: Some(saved.sha256), active: true, runtime: Some(runtime) })
}

/// Where an upload stands (`202` answered it with this address). Kept by the process that
/// took the upload, for an hour after it ended; another process answers `404`, and
/// `GET /v1/plugin/versions` shows the version once stored, on every process.
#[utoipa::path(get, path = "/v1/plugin/uploads/{id}", tag = "plugins", security(("api_key" = [])),
    params(("id" = String, Path, max_length = 64)),
    responses(
        (status = 200, body = UploadStatus),
        (status = 404, description = "upload_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn upload_status(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> Result<Json<UploadStatus>, ApiError> {
    state
        .uploads
        .status(&auth.tenant, &id)
        .map(Json)
        .ok_or_else(|| ApiError::not_found("upload_not_found", "Upload not found", "no such upload on this server"))
}

/// Uploads in progress and recently ended, by id: what `GET /v1/plugin/uploads/{id}` answers.
/// Bounded: ended uploads are forgotten after [`UPLOAD_RETENTION`], and beyond
/// [`MAX_TRACKED_UPLOADS`] the oldest ended ones go first.
pub struct UploadTracker {
    uploads: Mutex<HashMap<String, Tracked>>,
    /// Uploads of the big profiles (`js`, `python`) held at once, from reading the body to the
    /// compile's end (`[plugins] max_concurrent_large_uploads`).
    large: Arc<tokio::sync::Semaphore>,
}

impl UploadTracker {
    pub fn new(max_concurrent_large_uploads: usize) -> Self {
        Self { uploads: Mutex::default(), large: Arc::new(tokio::sync::Semaphore::new(max_concurrent_large_uploads)) }
    }

    /// A place for one large upload, if one is free; counted in
    /// `stockd_plugin_large_uploads_in_progress` while held.
    fn hold_large(&self) -> Result<LargeUpload, tokio::sync::TryAcquireError> {
        let permit = Arc::clone(&self.large).try_acquire_owned()?;
        metrics::gauge!("stockd_plugin_large_uploads_in_progress").increment(1.0);
        Ok(LargeUpload { _permit: permit })
    }
}

/// One of `max_concurrent_large_uploads` places, from reading the body to the compile's end.
struct LargeUpload {
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for LargeUpload {
    fn drop(&mut self) {
        metrics::gauge!("stockd_plugin_large_uploads_in_progress").decrement(1.0);
    }
}

/// How long an ended upload's outcome is kept.
const UPLOAD_RETENTION: Duration = Duration::from_secs(3600);
/// Uploads tracked at once. In progress ones are bounded by the compile rules (one per tenant).
const MAX_TRACKED_UPLOADS: usize = 10_000;

struct Tracked {
    tenant: TenantId,
    status: UploadStatus,
    ended: Option<Instant>,
}

impl UploadTracker {
    /// Records a new upload as compiling; returns its id.
    fn start(&self, tenant: &TenantId, runtime: Runtime, sha256: &str) -> String {
        let id = hex::encode(rand::random::<[u8; 16]>());
        let status = UploadStatus {
            id: id.clone(),
            state: "compiling",
            runtime,
            sha256: sha256.to_owned(),
            version: None,
            problem: None,
        };
        let mut uploads = self.uploads.lock().unwrap_or_else(PoisonError::into_inner);
        uploads.retain(|_, t| t.ended.is_none_or(|at| at.elapsed() < UPLOAD_RETENTION));
        while uploads.len() >= MAX_TRACKED_UPLOADS {
            let oldest = uploads.iter().filter_map(|(id, t)| t.ended.map(|at| (at, id.clone()))).min();
            match oldest {
                Some((_, id)) => uploads.remove(&id),
                None => break,
            };
        }
        uploads.insert(id.clone(), Tracked { tenant: tenant.clone(), status, ended: None });
        id
    }

    fn finish(&self, id: &str, outcome: &Result<Uploaded, ApiError>) {
        let mut uploads = self.uploads.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(tracked) = uploads.get_mut(id) {
            tracked.ended = Some(Instant::now());
            match outcome {
                Ok(uploaded) => {
                    tracked.status.state = "active";
                    tracked.status.version = Some(uploaded.version);
                }
                Err(error) => {
                    tracked.status.state = "failed";
                    tracked.status.problem = Some(error.problem.clone());
                }
            }
        }
    }

    /// The tenant's upload `id`; another tenant's answers like a missing one.
    fn status(&self, tenant: &TenantId, id: &str) -> Option<UploadStatus> {
        let uploads = self.uploads.lock().unwrap_or_else(PoisonError::into_inner);
        uploads.get(id).filter(|t| &t.tenant == tenant).map(|t| t.status.clone())
    }
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
        runtime: Runtime::parse(&v.runtime),
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
            runtime: Runtime::parse(&v.runtime).unwrap_or(Runtime::Rust),
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
        return Ok(Json(Uploaded { version: 0, sha256: None, active: true, runtime: None }));
    }
    // Load first, so a version that no longer compiles under today's limits is never activated.
    let stored = state.storage.list_plugins(&auth.tenant).await?.into_iter().find(|v| v.version == version);
    let runtime = stored.as_ref().and_then(|v| Runtime::parse(&v.runtime)).ok_or_else(missing)?;
    let wasm = match state.plugins.stored_wasm(&auth.tenant, version).await {
        Ok(wasm) => wasm.ok_or_else(missing)?,
        Err(PlanFailure::Storage(e)) => return Err(e.into()),
        Err(PlanFailure::Unavailable(why)) => return Err(ApiError::unavailable(&why)),
        Err(failure) => return Err(ApiError::new(422, "plugin_invalid", "Plugin invalid", failure.to_string())),
    };
    let plugin = state.plugins.load(&auth.tenant, runtime, Arc::from(wasm)).await.map_err(load_failed)?;
    let activated = state.storage.activate_plugin(&auth.tenant, version).await?.ok_or_else(missing)?;
    state.plugins.set(&auth.tenant, Active::Wasm { version, plugin, config: Arc::from(activated.config.as_str()) });
    tracing::info!(tenant = %auth.tenant, version, "plugin version activated");
    Ok(Json(Uploaded { version, sha256: Some(activated.sha256), active: true, runtime: Some(runtime) }))
}
