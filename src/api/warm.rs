//! Redis mode over HTTP: the warm endpoint, and how redis mode's refusals are answered. What
//! redis mode does lives in [`crate::redis_mode`]; orders reach it through the pipeline.

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};

use super::error::ApiError;
use super::extract::{Path, Tenant};
use super::SharedState;
use crate::engine::ResourceKey;
use crate::redis_mode::{RedisDrift, RedisModeError};

pub fn routes() -> Router<SharedState> {
    Router::new().route("/v1/resources/{key}/warm", post(warm))
}

impl From<RedisModeError> for ApiError {
    fn from(err: RedisModeError) -> Self {
        match err {
            RedisModeError::Redis(err) => {
                tracing::warn!(error = %err, "redis unavailable");
                metrics::counter!("stockd_redis_unavailable_total").increment(1);
                ApiError::unavailable("redis is unavailable; retry with the same Idempotency-Key")
            }
            RedisModeError::Storage(err) => err.into(),
            RedisModeError::DrainTimeout(backlog) => {
                tracing::warn!(backlog, "redis backlog did not drain in time");
                ApiError::unavailable("unsettled sales are still being written to the database; retry shortly")
            }
            RedisModeError::Reply(why) => {
                tracing::error!(error = %why, "unexpected redis reply");
                ApiError::internal()
            }
            err @ RedisModeError::OrderUnsupported => {
                ApiError::new(422, "redis_order_unsupported", "Order not supported in redis mode", err.to_string())
            }
            RedisModeError::NotWarmed(key) => ApiError {
                retry_after_s: Some(1),
                ..ApiError::new(
                    503,
                    "redis_not_warmed",
                    "Resource not loaded into Redis",
                    format!(
                        "{key} is in redis mode but Redis does not hold it; warm it (POST /v1/resources/{key}/warm)"
                    ),
                )
            },
            RedisModeError::Closed => ApiError::unavailable("the resource is being warmed or switched; retry shortly"),
            RedisModeError::Backlog => {
                ApiError::unavailable("the resource's sales are waiting for settlement to catch up; retry shortly")
            }
            RedisModeError::Superseded => {
                ApiError::unavailable("another warm or switch of the resource is under way; retry shortly")
            }
            RedisModeError::NotConfigured => {
                ApiError::validation("mode", "\"redis\" needs [redis] to be configured on this server")
            }
            RedisModeError::Bucketed => ApiError::validation("mode", "redis mode takes one bucket"),
            RedisModeError::NotRedis(key) => ApiError::new(
                409,
                "resource_not_redis",
                "Resource not in redis mode",
                format!("{key} is in db mode; switch it with PATCH {{\"mode\": \"redis\"}}"),
            ),
        }
    }
}

/// Loads a redis-mode resource into Redis from the database, once every sale already made in
/// Redis is settled: after a Redis restart or failover, or to end drift. Sales pause (503 with
/// `Retry-After`) while it runs. Answers Redis against the database afterwards.
#[utoipa::path(post, path = "/v1/resources/{key}/warm", tag = "resources", security(("api_key" = [])),
    params(("key" = String, Path, pattern = r"^[A-Za-z0-9._:@-]{1,200}$")),
    responses(
        (status = 200, body = RedisDrift),
        (status = 404, description = "resource_not_found", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "resource_not_redis: the resource is in db mode", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 400, description = "validation_failed: a key that cannot exist, or no `[redis]` on this server", body = crate::problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "Redis unreachable, the backlog did not drain, or another warm or switch took over", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn warm(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    Path(key): Path<String>,
) -> Result<Json<RedisDrift>, ApiError> {
    let key = ResourceKey::parse(key).map_err(|e| ApiError::validation("key", e))?;
    let missing = || super::resources::resource_not_found(key.as_str());
    let Some(redis) = state.redis.as_ref() else {
        // Without Redis here, a redis-mode resource cannot be warmed; a db-mode one is refused
        // as such.
        let current = state.storage.get_resource(&auth.tenant, &key).await?.ok_or_else(missing)?;
        return Err(match current.mode {
            crate::engine::Mode::Db => RedisModeError::NotRedis(key.to_string()).into(),
            crate::engine::Mode::Redis => RedisModeError::NotConfigured.into(),
        });
    };
    let drift = redis.warm_resource(&state.storage, &auth.tenant, &key).await?;
    drift.map(Json).ok_or_else(missing)
}
