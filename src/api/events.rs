//! The event feed: `GET /v1/events` pages a tenant's committed events in sequence order, and
//! with `wait` holds the request open until one arrives (docs/EVENTS.md).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use utoipa::{IntoParams, ToSchema};

use super::error::ApiError;
use super::extract::{page_limit, query, Tenant};
use super::SharedState;
use crate::engine::TenantId;
use crate::events::{next_commit, Event, EventType};
use crate::storage::PageFrom;

pub fn routes() -> Router<SharedState> {
    Router::new().route("/v1/events", get(events))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct EventParams {
    /// Only events with a larger sequence number (default 0: from the oldest kept).
    #[param(minimum = 0)]
    pub after: Option<i64>,
    /// Comma-separated event types (default: all).
    pub types: Option<String>,
    /// 1..=1000 (default 100).
    pub limit: Option<u32>,
    /// Seconds to wait for an event when there is none yet (default 0; at most
    /// `[events] max_wait_seconds`).
    pub wait: Option<u64>,
    /// `true`: the newest `limit` events instead (still oldest first), to start following the
    /// feed from its end; not with `after` or `wait`.
    pub newest: Option<bool>,
}

/// One event, as the feed, webhooks and the broker sink carry it.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventEnvelope {
    /// `evt_<ULID>`, globally unique: deduplicate on it.
    pub id: String,
    /// The tenant's own sequence number: increasing, in commit order.
    pub seq: i64,
    #[serde(rename = "type")]
    pub kind: String,
    /// RFC 3339 time of the change.
    pub timestamp: String,
    /// Unix ms of the change.
    pub at: i64,
    #[schema(value_type = Object)]
    pub data: serde_json::Value,
}

/// A page of events.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventPage {
    pub items: Vec<EventEnvelope>,
    /// The sequence number to pass as `after` for the next page: the last item's, or the
    /// request's `after` when the page is empty.
    pub next_after: i64,
}

/// Long polls held open per tenant in this process.
static WAITING: std::sync::LazyLock<Mutex<HashMap<TenantId, usize>>> = std::sync::LazyLock::new(Default::default);

/// A tenant's place among the waiting polls; given back when dropped.
struct Waiting(TenantId);

impl Waiting {
    fn take(tenant: &TenantId, max: usize) -> Option<Self> {
        let mut waiting = WAITING.lock().unwrap_or_else(PoisonError::into_inner);
        let n = waiting.entry(tenant.clone()).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        metrics::gauge!("stockd_event_polls_waiting").increment(1.0);
        Some(Waiting(tenant.clone()))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        metrics::gauge!("stockd_event_polls_waiting").decrement(1.0);
        let mut waiting = WAITING.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = waiting.get_mut(&self.0) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                waiting.remove(&self.0);
            }
        }
    }
}

fn types(param: Option<&str>) -> Result<Vec<EventType>, ApiError> {
    let Some(param) = param.filter(|p| !p.is_empty()) else { return Ok(Vec::new()) };
    let mut types = Vec::new();
    for name in param.split(',') {
        let t = EventType::parse(name.trim()).ok_or_else(|| {
            let known: Vec<_> = EventType::ALL.iter().map(|t| t.as_str()).collect();
            ApiError::validation("types", format!("unknown event type (known: {})", known.join(", ")))
        })?;
        if !types.contains(&t) {
            types.push(t);
        }
    }
    Ok(types)
}

/// The longest `wait`: `[events] max_wait_seconds`, kept a second under the request timeout so
/// a poll always answers before it.
pub fn max_wait(settings: &super::ApiSettings) -> Duration {
    Duration::from_secs(settings.events.max_wait_seconds)
        .min(settings.request_timeout.saturating_sub(Duration::from_secs(1)))
}

/// The tenant's committed events after `after`, oldest first. With `wait`, an empty page is
/// answered only once `wait` seconds passed without a new event.
#[utoipa::path(get, path = "/v1/events", tag = "events", security(("api_key" = [])),
    params(EventParams),
    responses(
        (status = 200, body = EventPage),
        (status = 400, body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn events(
    Tenant(auth): Tenant,
    State(state): State<SharedState>,
    params: Result<Query<EventParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let params = query(params)?;
    let after = params.after.unwrap_or(0);
    if after < 0 {
        return Err(ApiError::validation("after", "must be a sequence number (0 or more)"));
    }
    let from = match params.newest {
        Some(true) if params.after.is_some() || params.wait.is_some() => {
            return Err(ApiError::validation("newest", "reads the feed's end: not with `after` or `wait`"));
        }
        Some(true) => PageFrom::Newest,
        _ => PageFrom::After(after),
    };
    let limit = page_limit(params.limit)?;
    let settings = &state.settings.events;
    let most = max_wait(&state.settings);
    let wait = match params.wait.unwrap_or(0) {
        s if Duration::from_secs(s) <= most => Duration::from_secs(s),
        _ => return Err(ApiError::validation("wait", format!("must be between 0 and {}", most.as_secs()))),
    };
    let types = types(params.types.as_deref())?;
    let storage = state.storage.clone();
    let tenant = auth.tenant.clone();
    let read = || storage.events_page(&tenant, from, &types, limit);

    let mut page = read().await?;
    if page.is_empty() && !wait.is_zero() {
        // Past the tenant's share of waiting polls, a poll answers at once.
        if let Some(_place) = Waiting::take(&tenant, settings.max_waiting_per_tenant) {
            let deadline = Instant::now() + wait;
            let poll = Duration::from_millis(settings.poll_interval_ms.max(10));
            while page.is_empty() && Instant::now() < deadline {
                // This process's commits wake it at once; other processes' are seen by polling.
                let commit = next_commit();
                let _ = tokio::time::timeout(poll.min(deadline - Instant::now()), commit).await;
                page = read().await?;
            }
        }
    }
    Ok(page_response(page, after))
}

/// The page as JSON, each event's stored payload embedded as it is.
fn page_response(page: Vec<Event>, after: i64) -> Response {
    let next_after = page.last().map_or(after, |e| e.seq);
    let items: Vec<String> = page.iter().map(Event::envelope).collect();
    let body = format!("{{\"items\":[{}],\"next_after\":{next_after}}}", items.join(","));
    ([(CONTENT_TYPE, "application/json")], body).into_response()
}
