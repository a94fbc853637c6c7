//! Webhooks: delivery of the outbox (`events`) to tenants' HTTP receivers (docs/WEBHOOKS.md).
//!
//! A tenant registers endpoints (`/v1/webhooks`, [`crate::api::webhooks`]). Every process runs
//! the delivery job ([`delivery`]): it queues each endpoint's new events (those after its
//! cursor, of its types), claims due deliveries (PostgreSQL: `FOR UPDATE SKIP LOCKED` with a
//! lease that runs out if the process dies), and POSTs each event's envelope signed the Standard
//! Webhooks way ([`signing`]) to a target that must not be in the operator's network
//! ([`target`]). Delivery is at least once, in sequence order per ordering key; a failed one is
//! retried with exponential backoff and jitter ([`retry`]) over a window, after which the
//! endpoint is `failing` and the events stay in the feed.
//!
//! The storage side is [`WebhookStore`], implemented by each backend.

pub mod delivery;
pub mod retry;
pub mod signing;
pub mod target;

use async_trait::async_trait;
use serde::Serialize;

use crate::engine::TenantId;
use crate::events::EventType;
use crate::storage::StorageError;

pub use self::signing::SigningSecret;

/// Endpoint state: `active` endpoints are delivered to; `failing` ones are not (until a
/// redeliver call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EndpointState {
    Active,
    Failing,
}

impl EndpointState {
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointState::Active => "active",
            EndpointState::Failing => "failing",
        }
    }

    pub fn from_db(value: &str) -> Result<Self, StorageError> {
        match value {
            "active" => Ok(EndpointState::Active),
            "failing" => Ok(EndpointState::Failing),
            other => Err(StorageError::Internal(format!("unexpected webhook state {other:?}"))),
        }
    }
}

/// A stored endpoint, secrets included (they never leave the process except in signatures and
/// in the one answer that issues them).
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub id: String,
    pub tenant: String,
    pub url: String,
    /// Empty: every type.
    pub types: Vec<EventType>,
    pub description: String,
    pub secret: SigningSecret,
    /// The secret before the last rotation and until when (Unix ms) it still signs.
    pub previous: Option<(SigningSecret, i64)>,
    pub state: EndpointState,
    pub failing_since: Option<i64>,
    /// Every event with a seq at or below it has been queued (or did not match).
    pub cursor: i64,
    pub created_at: i64,
}

/// An endpoint to store.
#[derive(Debug, Clone)]
pub struct NewEndpoint {
    pub id: String,
    pub tenant: TenantId,
    pub url: String,
    pub types: Vec<EventType>,
    pub description: String,
    pub secret: SigningSecret,
    pub created_at: i64,
}

/// Types as stored: a JSON array of names.
pub fn types_to_db(types: &[EventType]) -> String {
    serde_json::to_string(&types.iter().map(|t| t.as_str()).collect::<Vec<_>>()).unwrap_or_else(|_| "[]".into())
}

pub fn types_from_db(text: &str) -> Result<Vec<EventType>, StorageError> {
    let names: Vec<String> =
        serde_json::from_str(text).map_err(|e| StorageError::Internal(format!("webhook types: {e}")))?;
    // A type a later version no longer knows is dropped rather than failing the endpoint.
    Ok(names.iter().filter_map(|n| EventType::parse(n)).collect())
}

/// Whether an endpoint with these types wants an event of type `kind`.
pub fn wants(types: &[EventType], kind: &str) -> bool {
    types.is_empty() || types.iter().any(|t| t.as_str() == kind)
}

/// What a redeliver call asks for (besides making the endpoint active and its queued
/// deliveries due now).
#[derive(Debug, Clone, Default)]
pub struct Redeliver {
    /// Queue this event again.
    pub event_id: Option<String>,
    /// Queue every event after this seq again (the cursor moves back to it, never forward).
    pub after: Option<i64>,
}

/// How a redeliver call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redelivered {
    /// Done; the event named was queued (1) or already was (0); a rewound cursor queues later.
    Queued(u64),
    EndpointNotFound,
    /// `event_id` names no event of the tenant still in the feed; nothing was changed.
    EventNotFound,
}

/// A claimed delivery with everything needed to send it.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub endpoint_id: String,
    pub tenant: String,
    pub seq: i64,
    /// Attempts made before this one.
    pub attempts: i64,
    pub window_start: Option<i64>,
    /// The claim: a later outcome applies only while the row still carries it.
    pub lease_until: i64,
    pub url: String,
    pub secret: SigningSecret,
    pub previous: Option<(SigningSecret, i64)>,
    /// `None`: the event is gone (purged past its retention).
    pub event: Option<crate::events::Event>,
}

/// How an attempt ended, as the deliveries log keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptOutcome {
    Delivered,
    Failed,
    /// Not sent: the event was purged before it could be delivered.
    Dropped,
}

impl AttemptOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Delivered => "delivered",
            AttemptOutcome::Failed => "failed",
            AttemptOutcome::Dropped => "dropped",
        }
    }

    pub fn from_db(value: &str) -> Result<Self, StorageError> {
        match value {
            "delivered" => Ok(AttemptOutcome::Delivered),
            "failed" => Ok(AttemptOutcome::Failed),
            "dropped" => Ok(AttemptOutcome::Dropped),
            other => Err(StorageError::Internal(format!("unexpected webhook attempt outcome {other:?}"))),
        }
    }
}

/// One attempt in the deliveries log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub id: i64,
    pub event_id: String,
    pub seq: i64,
    pub kind: String,
    /// 1 for the first attempt of this delivery.
    pub attempt: i64,
    pub at: i64,
    pub outcome: AttemptOutcome,
    pub http_status: Option<i64>,
    /// The kind of failure (`timeout`, `connect`, `http_status`, `target_refused`, ...).
    pub error: Option<String>,
    pub latency_ms: i64,
}

/// What becomes of a claimed delivery after its attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Delivered (or dropped): the row goes.
    Done,
    /// Try again at `due_at`; the window started at `window_start`.
    Retry { due_at: i64, window_start: i64 },
    /// The retry window is over: the endpoint becomes `failing` (the row stays queued).
    EndpointFailing { window_start: i64 },
}

/// The result of one attempt, to record.
#[derive(Debug, Clone)]
pub struct Finished {
    pub endpoint_id: String,
    pub seq: i64,
    pub lease_until: i64,
    pub now_ms: i64,
    pub attempt: Attempt,
    pub next: Next,
}

/// Bounds of one pass of the delivery job.
#[derive(Debug, Clone, Copy)]
pub struct QueueLimits {
    /// Endpoints looked at per pass.
    pub endpoints: u32,
    /// Events scanned per endpoint per pass.
    pub events: u32,
    /// Most deliveries queued for one endpoint at once; its cursor waits beyond it.
    pub max_pending: u32,
}

/// One page of a queueing pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueuePage {
    /// Deliveries queued.
    pub queued: u64,
    /// The last endpoint looked at when the page was full (the next page starts after it);
    /// `None`: every endpoint behind was looked at.
    pub last_endpoint: Option<String>,
}

/// The storage side of webhooks; every backend implements it.
#[async_trait]
pub trait WebhookStore: Send + Sync {
    /// Stores the endpoint with its cursor at the tenant's last event; `None` when the tenant
    /// has `max_per_tenant` endpoints already.
    async fn create_webhook(&self, new: &NewEndpoint, max_per_tenant: usize) -> Result<Option<Endpoint>, StorageError>;
    async fn list_webhooks(&self, tenant: &TenantId) -> Result<Vec<Endpoint>, StorageError>;
    async fn get_webhook(&self, tenant: &TenantId, id: &str) -> Result<Option<Endpoint>, StorageError>;
    /// Deletes the endpoint with its queue and log; `false` when there is none.
    async fn delete_webhook(&self, tenant: &TenantId, id: &str) -> Result<bool, StorageError>;
    /// Replaces the secret; the current one keeps signing until `previous_valid_until`.
    async fn rotate_webhook_secret(
        &self,
        tenant: &TenantId,
        id: &str,
        secret: &SigningSecret,
        previous_valid_until: i64,
    ) -> Result<Option<Endpoint>, StorageError>;
    /// Makes the endpoint active, its queued deliveries due now with a fresh window, and queues
    /// what `what` asks for (all or nothing).
    async fn redeliver_webhook(
        &self,
        tenant: &TenantId,
        id: &str,
        what: &Redeliver,
        now_ms: i64,
    ) -> Result<Redelivered, StorageError>;
    /// The endpoint's attempts, newest first, with an id below `before`; `None` when there is
    /// no such endpoint.
    async fn webhook_attempts(
        &self,
        tenant: &TenantId,
        id: &str,
        before: Option<i64>,
        limit: u32,
    ) -> Result<Option<Vec<Attempt>>, StorageError>;
    /// Deliveries queued for the endpoint.
    async fn webhook_pending(&self, id: &str) -> Result<u64, StorageError>;

    /// Queues the new events of up to `limits.endpoints` active endpoints behind on their
    /// tenant's feed, those with an id above `after_endpoint` ("" for the first page).
    async fn queue_webhook_deliveries(
        &self,
        now_ms: i64,
        after_endpoint: &str,
        limits: QueueLimits,
    ) -> Result<QueuePage, StorageError>;
    /// Claims up to `limit` due deliveries of active endpoints, each the oldest queued of its
    /// endpoint and ordering key, until `lease_until`.
    async fn claim_webhook_deliveries(
        &self,
        now_ms: i64,
        lease_until: i64,
        limit: u32,
    ) -> Result<Vec<Claimed>, StorageError>;
    /// Records an attempt and applies its [`Next`] (only while the claim still holds).
    async fn finish_webhook_delivery(&self, finished: &Finished) -> Result<(), StorageError>;
    /// Unix ms of the oldest queued event of an active endpoint, if any.
    async fn webhook_oldest_pending(&self) -> Result<Option<i64>, StorageError>;
    /// Deletes up to `limit` attempts made before `before_ms`; returns how many.
    async fn purge_webhook_attempts(&self, before_ms: i64, limit: u32) -> Result<u64, StorageError>;
}

/// A new endpoint id: `wh_<ULID>`.
pub fn new_endpoint_id() -> String {
    format!("wh_{}", ulid::Ulid::new())
}
