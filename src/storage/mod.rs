//! Storage: the one place that reads and writes durable state. Each backend implements
//! [`Storage`]; the rules it applies (guarded updates, ledger rows and the idempotency record in
//! the same transaction, legal reservation moves) are the same everywhere and are proven by one
//! integration suite run against every backend.

pub(crate) mod batcher;
mod deflate_fixed;
pub(crate) mod held_events;
pub(crate) mod lookups;
pub mod mysql;
pub mod payload;
pub mod postgres;
pub mod redis_store;
pub mod rows;
pub mod rules;
#[cfg(test)]
mod settle_run_tests;
pub mod sqlite;
pub mod webhooks;

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;

use crate::apply::reversals::{ReversalJob, Reversed};
use crate::engine::reversal::OrderLedger;
use crate::engine::OrderId;
use crate::engine::{
    IdempotencyKey, Kind, LineResult, OrderDocument, OrderRequest, OrderStatus, Pass, Plan, Reconciliation,
    Reservation, ReservationState, ResourceKey, ResourceState, ResourceStatus, TenantId,
};
use crate::events::{Event, EventType};
use crate::problem::Problem;
use crate::ratelimit::RateLimit;

/// A resource and which of the reservations asked about are held ([`Storage::resource_holding`]).
pub type Holding = Option<(ResourceState, HashSet<String>)>;

/// A failure of the storage layer itself (not a business outcome).
#[derive(Debug, Clone, thiserror::Error)]
pub enum StorageError {
    /// The database could not be reached or refused for a passing reason (busy, connection
    /// lost, serialization failure); nothing was applied and the client may retry.
    #[error("storage unavailable: {0}")]
    Unavailable(String),
    /// Anything else: a bug or a broken invariant. Logged, answered 500, never detailed.
    #[error("storage failure: {0}")]
    Internal(String),
    /// The plan names something the stored data refutes (a bucket the resource does not have):
    /// the plugin's fault, answered `422 plugin_failed`; nothing of the request was applied.
    #[error("plan refused: {0}")]
    PlanRefused(String),
    /// This request cannot be decided here now, though nothing is wrong with it or the database
    /// (its resource is sold in redis mode, which this process had not learnt yet): nothing of it
    /// was applied and the client retries with the same key. Fails only its own request: in a
    /// group commit it is rolled back to its savepoint and the batch goes on.
    #[error("retry later: {0}")]
    RetryLater(String),
}

impl From<sqlx::Error> for StorageError {
    fn from(err: sqlx::Error) -> Self {
        use sqlx::Error as E;
        match &err {
            E::Io(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed | E::Tls(_) => {
                StorageError::Unavailable(err.to_string())
            }
            E::Database(db) if is_transient_mysql(db.as_ref()) => StorageError::Unavailable(err.to_string()),
            E::Database(db) if db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some() => {
                StorageError::Internal(err.to_string())
            }
            E::Database(db) if is_transient_code(db.code().as_deref()) => StorageError::Unavailable(err.to_string()),
            _ => StorageError::Internal(err.to_string()),
        }
    }
}

/// MySQL / MariaDB errors that mean "try again later": lock wait timeout (1205), deadlock
/// (1213), too many connections (1040), server shutting down (1053), connection killed (1927),
/// read-only server (1290, 1836, 1792: a failover in progress), statement timeouts (1969
/// MariaDB, 3024 MySQL), lost connection (2006, 2013). SQLSTATEs alone cannot tell: 1205 is HY000.
fn is_transient_mysql(db: &dyn sqlx::error::DatabaseError) -> bool {
    db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some_and(|e| {
        matches!(e.number(), 1205 | 1213 | 1040 | 1053 | 1927 | 1290 | 1836 | 1792 | 1969 | 3024 | 2006 | 2013)
    })
}

/// Database error codes that mean "try again later" rather than "this is a bug".
fn is_transient_code(code: Option<&str>) -> bool {
    match code {
        // SQLite primary result codes (extended codes keep the primary in the low byte).
        Some(c) if c.parse::<u32>().is_ok() => {
            let primary = c.parse::<u32>().unwrap_or(0) & 0xff;
            // BUSY, LOCKED, IOERR, FULL, CANTOPEN, PROTOCOL.
            matches!(primary, 5 | 6 | 10 | 13 | 14 | 15)
        }
        // PostgreSQL: connection exceptions, serialization failure, deadlock, insufficient
        // resources, operator intervention (shutdown).
        Some(c) => c.starts_with("08") || c == "40001" || c == "40P01" || c.starts_with("53") || c.starts_with("57"),
        None => false,
    }
}

/// A response exactly as first produced; replays return these bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub content_type: ContentType,
    pub body: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentType {
    Json,
    Problem,
}

impl ContentType {
    pub fn as_str(self) -> &'static str {
        match self {
            ContentType::Json => "json",
            ContentType::Problem => "problem",
        }
    }

    pub fn from_db(value: &str) -> Self {
        if value == "problem" {
            ContentType::Problem
        } else {
            ContentType::Json
        }
    }
}

/// Room for an answer's JSON before it is written: a one-line order's is ~260 bytes, a
/// five-line order's ~1 KiB.
const BODY_CAPACITY: usize = 1024;

impl StoredResponse {
    /// Written into a buffer of [`BODY_CAPACITY`]: `serde_json::to_string` starts at 128 bytes
    /// and grows by reallocating, two or three times for an order's answer.
    pub fn json<T: serde::Serialize>(status: u16, value: &T) -> Result<Self, StorageError> {
        let mut bytes = Vec::with_capacity(BODY_CAPACITY);
        serde_json::to_writer(&mut bytes, value).map_err(|e| StorageError::Internal(e.to_string()))?;
        let body = String::from_utf8(bytes).map_err(|e| StorageError::Internal(e.to_string()))?;
        Ok(Self { status, content_type: ContentType::Json, body })
    }

    /// A response as an idempotency record stores it (`response_code, response_type,
    /// response_body`).
    /// `body` as stored ([`payload::unpack`]).
    pub fn from_db(code: i64, kind: &str, body: String) -> Result<Self, StorageError> {
        let status = u16::try_from(code)
            .map_err(|_| StorageError::Internal("unexpected stored value in idempotency.response_code".into()))?;
        Ok(Self { status, content_type: ContentType::from_db(kind), body: payload::unpack(body)? })
    }

    /// A record's response from its columns as read through [`outcome_columns!`] (the body
    /// joined from its event where the record points at one, or, for a record this batch wrote
    /// beside an event it has not inserted yet, that held event's payload); `None`: the record
    /// is claimed by a write that has not answered yet.
    pub fn from_columns(
        code: Option<i64>,
        kind: Option<&str>,
        body: Option<String>,
        event: Option<&str>,
    ) -> Result<Option<Self>, StorageError> {
        let body = body.or_else(|| event.and_then(held_events::held_data));
        match (code, kind, body) {
            (Some(code), Some(kind), Some(body)) => Self::from_db(code, kind, body).map(Some),
            // Answered, and its event is gone: only a record past its retention, which the
            // idempotency purge is about to delete (events outlive records, see `body_columns`).
            (Some(_), _, None) => {
                Err(StorageError::Unavailable("an idempotency record past its retention awaits its purge".into()))
            }
            _ => Ok(None),
        }
    }

    pub fn problem(problem: &Problem) -> Result<Self, StorageError> {
        let body = serde_json::to_string(problem).map_err(|e| StorageError::Internal(e.to_string()))?;
        Ok(Self { status: problem.status, content_type: ContentType::Problem, body })
    }
}

/// The `response_body` and `response_event` columns of an idempotency record whose answer is
/// `response`. An applied order's answer is, byte for byte, the payload of the `order.applied`
/// event written in the same transaction: the record keeps that event's id (`event`) and not the
/// body, so the document is stored once. Reads join the event back ([`outcome_columns!`]); the
/// events purge keeps events at least [`EVENTS_OUTLIVE_RECORDS`] longer than records. A body
/// kept in the record is stored packed ([`payload::pack`]), like every event's payload.
pub fn body_columns<'a>(
    response: &'a StoredResponse,
    event: Option<&'a str>,
) -> (Option<std::borrow::Cow<'a, str>>, Option<&'a str>) {
    match event {
        Some(id) => (None, Some(id)),
        None => (Some(payload::pack(&response.body)), None),
    }
}

/// How much longer than `[idempotency] retention_hours` events are kept at least, whatever
/// `[events] retention_hours` says: a record may point at its order's event until the
/// idempotency purge (every `purge_interval_seconds`) deletes it.
pub const EVENTS_OUTLIVE_RECORDS: std::time::Duration = std::time::Duration::from_secs(3600);

/// The columns a stored outcome is read with, from `idempotency i` joined to the event that
/// holds an applied order's answer (`e`): `request_hash, response_code, response_type,
/// response_body, response_event`. Followed by a `WHERE` (or a further `JOIN`) on `i`. A record
/// this transaction wrote may name an event it still holds in memory (the server-database
/// backends insert a batch's events at its end): `response_body` is then NULL and
/// [`StoredResponse::from_columns`] finds the body among the held events.
#[macro_export]
macro_rules! outcome_columns {
    () => {
        "i.request_hash, i.response_code, i.response_type, COALESCE(i.response_body, e.data) AS response_body,
         i.response_event FROM idempotency i LEFT JOIN events e ON e.id = i.response_event"
    };
}

/// The identity of an idempotent request: the tenant-scoped key and a hash of
/// (method, path, canonical body).
#[derive(Debug, Clone)]
pub struct IdempotencyRequest {
    pub key: IdempotencyKey,
    pub request_hash: String,
}

/// Hex digits of a request hash that an idempotency record keeps: the first 128 bits of its
/// SHA-256, which tell one request under a key from another as surely as the whole (a
/// collision made on purpose takes 2^64 tries, with a key of one's own). Half the bytes of the
/// whole in every record. Records written before this kept all 64 digits and are judged by
/// them ([`IdempotencyRequest::judge`]); Redis's request records keep the whole hash.
pub const STORED_HASH_DIGITS: usize = 32;

/// A request hash as an idempotency record stores it ([`STORED_HASH_DIGITS`]).
pub fn stored_hash(request_hash: &str) -> &str {
    request_hash.get(..STORED_HASH_DIGITS).unwrap_or(request_hash)
}

impl IdempotencyRequest {
    /// The answer to this request from its key's stored record: the first response if the
    /// record was made for the same request, else a mismatch. A record keeps the hash's first
    /// [`STORED_HASH_DIGITS`], or the whole of it if an earlier version wrote it.
    pub fn judge(&self, stored: &str, response: StoredResponse) -> Idempotent {
        if stored == stored_hash(&self.request_hash) || stored == self.request_hash {
            Idempotent::Replayed(response)
        } else {
            Idempotent::Mismatch
        }
    }
}

/// How an idempotent call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Idempotent {
    /// Processed now; the response is stored with its effects.
    Fresh(StoredResponse),
    /// The key was used before for the same request: its first response.
    Replayed(StoredResponse),
    /// The key was used before for a different request; nothing applied.
    Mismatch,
}

/// An adjustment that did not leave a stored outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdjustRefusal {
    ResourceNotFound,
    /// The resource is no longer in the mode (or redis-mode epoch) the adjustment was decided
    /// under: nothing applied; decide again.
    ModeChanged,
}

/// The mode an adjustment was decided under; it applies only while the resource is still in
/// it, read under the same lock as the change (docs/REDIS.md, "Fencing").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeFence {
    Db,
    /// Redis mode at this epoch: taken, with Redis closed under it, by the adjusting process.
    Redis {
        epoch: i64,
    },
}

/// The outcome of a reservation transition (confirm or release).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// The reservation is (now, or already was) in the requested end state.
    Done(Reservation),
    /// The reservation is in a state the transition may not leave.
    Refused(ReservationState, Reservation),
    NotFound,
}

/// Something to insert that may already exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Insert {
    Created,
    AlreadyExists,
}

#[derive(Debug, Clone)]
pub struct TenantRecord {
    pub id: TenantId,
    pub name: String,
    pub created_at_ms: i64,
    /// The tenant's own request rate; `None`: the server default.
    pub rate_limit: Option<RateLimit>,
}

/// An API key as the admin lists it: its id and dates, never the key or its hash.
#[derive(Debug, Clone)]
pub struct ApiKeyInfo {
    pub id: String,
    pub created_at_ms: i64,
    pub revoked_at_ms: Option<i64>,
}

/// An API key as found by its hash, with its tenant's own request rate.
#[derive(Debug, Clone)]
pub struct ApiKeyRecord {
    pub id: String,
    pub tenant_id: TenantId,
    pub hash: String,
    pub rate_limit: Option<RateLimit>,
}

/// A new resource's opening state.
#[derive(Debug, Clone)]
pub struct NewResource {
    pub key: ResourceKey,
    pub kind: Kind,
    pub total: i64,
    /// 1..=1024; with more than one, the counters live in bucket rows.
    pub buckets: i64,
    /// The low-stock threshold (docs/EVENTS.md); `None`: none.
    pub low_stock: Option<i64>,
}

/// An order to apply: the validated request, its plan, and the resolved reservation lifetime.
#[derive(Debug, Clone)]
pub struct OrderJob {
    pub tenant: TenantId,
    pub idempotency: IdempotencyRequest,
    pub order: OrderRequest,
    pub plan: Plan,
    pub ttl_ms: i64,
}

/// An order's response, and (when processed now) how each planned line fared, for metrics.
#[derive(Debug, Clone)]
pub struct OrderExecution {
    pub response: Idempotent,
    pub outcome: Option<(OrderStatus, Vec<LineResult>)>,
}

/// The storage contract. Every mutating method is atomic: it applies wholly or not at all.
/// Most reconciliation checkpoints stored (or forgotten) per write: the first pass over a large
/// database stores one per resource and bucket, and one write must not hold the writer long.
pub const CHECKPOINTS_PER_WRITE: usize = 5_000;

/// Where a page of the event feed or of a ledger starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageFrom {
    /// The items with a sequence number above this one, oldest first.
    After(i64),
    /// The newest items (a reader starting at the end), still returned oldest first.
    Newest,
}

impl PageFrom {
    /// The sequence number to read above, and the order to read in (newest first for the tail).
    pub fn bounds(self) -> (i64, &'static str) {
        match self {
            PageFrom::After(after) => (after, "ASC"),
            PageFrom::Newest => (0, "DESC"),
        }
    }

    /// Puts a page read in [`PageFrom::bounds`]' order into sequence order.
    pub fn arrange<T>(self, mut page: Vec<T>) -> Vec<T> {
        if self == PageFrom::Newest {
            page.reverse();
        }
        page
    }
}

#[async_trait]
pub trait Storage: redis_store::RedisStore + crate::webhooks::WebhookStore + Send + Sync + 'static {
    /// Storage is reachable and migrated.
    async fn ready(&self) -> Result<(), StorageError>;

    async fn create_tenant(
        &self,
        id: &TenantId,
        name: &str,
        rate_limit: Option<RateLimit>,
        key: &NewApiKey,
        now_ms: i64,
    ) -> Result<Insert, StorageError>;
    async fn list_tenants(&self) -> Result<Vec<TenantRecord>, StorageError>;
    /// Adds a key to a tenant; `AlreadyExists` is never returned, `None` means no such tenant.
    async fn add_api_key(&self, tenant: &TenantId, key: &NewApiKey, now_ms: i64) -> Result<Option<()>, StorageError>;
    /// Revokes a key; `None` when the tenant has no such unrevoked key.
    async fn revoke_api_key(&self, tenant: &TenantId, key_id: &str, now_ms: i64) -> Result<Option<()>, StorageError>;
    /// The tenant's API keys, oldest first (at most [`rows::MAX_API_KEYS_LISTED`]); `None` when
    /// there is no such tenant.
    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Option<Vec<ApiKeyInfo>>, StorageError>;
    async fn find_api_key(&self, hash: &str) -> Result<Option<ApiKeyRecord>, StorageError>;
    /// Declares a config tenant: created if missing, its name and rate set, its config key (id
    /// `cfg-<tenant>`) set to `key_hash`.
    async fn ensure_config_tenant(
        &self,
        id: &TenantId,
        name: &str,
        rate_limit: Option<RateLimit>,
        key_hash: &str,
        now_ms: i64,
    ) -> Result<(), StorageError>;
    /// Sets (or with `None` clears) the tenant's own request rate; `None` when no such tenant.
    async fn set_rate_limit(&self, tenant: &TenantId, limit: Option<RateLimit>) -> Result<Option<()>, StorageError>;

    async fn create_resource(
        &self,
        tenant: &TenantId,
        res: &NewResource,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError>;
    async fn get_resource(&self, tenant: &TenantId, key: &ResourceKey) -> Result<Option<ResourceState>, StorageError> {
        Ok(self.resource_holding(tenant, key, &[]).await?.map(|(state, _)| state))
    }
    /// The resource, and which of the reservations `ids` are held, in one snapshot
    /// (`apply::reads::resource_holding`).
    async fn resource_holding(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        ids: &[String],
    ) -> Result<Holding, StorageError>;
    async fn list_resources(
        &self,
        tenant: &TenantId,
        prefix: Option<&str>,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<ResourceState>, StorageError>;
    async fn set_resource_status(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        status: ResourceStatus,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError>;
    /// Sets (or with `None` clears) a resource's low-stock threshold.
    async fn set_low_stock(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        low_stock: Option<i64>,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError>;
    /// Restock (+) or write-off (−), idempotent.
    async fn adjust(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        key: &ResourceKey,
        delta: i64,
        fence: ModeFence,
        now_ms: i64,
    ) -> Result<Result<Idempotent, AdjustRefusal>, StorageError>;
    /// A page of a resource's ledger; `None` when the resource does not exist.
    async fn ledger_page(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        from: PageFrom,
        limit: u32,
    ) -> Result<Option<Vec<crate::engine::LedgerEntry>>, StorageError>;

    /// The finished outcome stored under an idempotency key, judged against this request; reads
    /// only. The first step of every mutating request ([`crate::pipeline`]), so it is cheap.
    async fn stored_outcome(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
    ) -> Result<Option<Idempotent>, StorageError>;

    /// Applies an order (or replays its first outcome).
    /// Shared, so a caller can still route the job elsewhere if storage refuses it.
    async fn execute_order(&self, job: Arc<OrderJob>, now_ms: i64) -> Result<OrderExecution, StorageError>;
    /// The outcome the order would have now; applies and records nothing.
    async fn preview_order(
        &self,
        tenant: &TenantId,
        order: &OrderRequest,
        plan: &Plan,
    ) -> Result<OrderDocument, StorageError>;

    /// The order as its ledger entries tell it; `None` when the tenant never applied it.
    async fn get_order(&self, tenant: &TenantId, order_id: &OrderId) -> Result<Option<OrderLedger>, StorageError>;
    /// Reverses (part of) an order on the database path, or replays its key's first outcome.
    async fn reverse_order(&self, job: Arc<ReversalJob>, now_ms: i64) -> Result<Reversed, StorageError>;

    async fn get_reservation(&self, tenant: &TenantId, id: &str) -> Result<Option<Reservation>, StorageError>;
    /// Up to `limit` of the tenant's held reservations, the soonest to expire first.
    async fn held_reservations(&self, tenant: &TenantId, limit: u32) -> Result<Vec<Reservation>, StorageError>;
    async fn confirm_reservation(&self, tenant: &TenantId, id: &str, now_ms: i64) -> Result<Transition, StorageError>;
    async fn release_reservation(&self, tenant: &TenantId, id: &str, now_ms: i64) -> Result<Transition, StorageError>;
    /// Expires up to `limit` held reservations past their deadline; returns how many.
    async fn expire_due(&self, now_ms: i64, limit: u32) -> Result<u64, StorageError>;

    /// Evens out `available` across the buckets of up to `limit` bucketed resources whose
    /// buckets differ by more than one; returns how many resources it moved.
    async fn rebalance_buckets(&self, now_ms: i64, limit: u32) -> Result<u64, StorageError>;

    /// Proves state == opening balance + ledger for one tenant, or for all when `None`, from
    /// each resource's checkpoint ([`Pass::Incremental`]) or from the start ([`Pass::Full`]);
    /// then moves the checkpoints of what it found clean and forgets those of what drifted.
    async fn reconcile(&self, tenant: Option<&TenantId>, pass: Pass) -> Result<Reconciliation, StorageError>;
    /// Up to `limit` of the tenant's committed events from `from`, in sequence order; only those
    /// of `types` unless it is empty.
    async fn events_page(
        &self,
        tenant: &TenantId,
        from: PageFrom,
        types: &[EventType],
        limit: u32,
    ) -> Result<Vec<Event>, StorageError>;
    /// Deletes up to `limit` events written before `before_ms`, oldest first; returns how many.
    async fn purge_events(&self, before_ms: i64, limit: u32) -> Result<u64, StorageError>;
    /// The tenants (at most `max_tenants`, in id order) with events the broker sink `sink` has
    /// not delivered yet, and how many such events there are across all tenants. Reads one row
    /// per tenant (`event_seqs` beside the cursors), never the events.
    async fn sink_backlog(&self, sink: &str, max_tenants: u32) -> Result<SinkBacklog, StorageError>;
    /// Takes the cursor of `sink` for `tenant` (created at 0 if missing) for as long as the
    /// returned claim lives; `None` when another process holds it now (it is delivering that
    /// tenant's events). The claim only spares duplicate work: a sink's broker drops a
    /// republished event by its id, so correctness never rests on it.
    async fn claim_sink_cursor(
        &self,
        sink: &str,
        tenant: &TenantId,
    ) -> Result<Option<Box<dyn SinkClaim>>, StorageError>;
    /// Forgets idempotency records created before `before_ms`; returns how many.
    async fn purge_idempotency(&self, before_ms: i64, limit: u32) -> Result<u64, StorageError>;

    /// Stores a new plugin version for the tenant and makes it the active one; in the same
    /// transaction deletes the versions beyond `upload.max_versions` (oldest first, never the
    /// new one nor the one that was active). Version numbers are never reused: the newest
    /// version is always kept, and the next is one past it.
    async fn save_plugin(
        &self,
        tenant: &TenantId,
        upload: &PluginUpload,
        now_ms: i64,
    ) -> Result<PluginVersion, StorageError>;
    /// Every stored version, oldest first.
    async fn list_plugins(&self, tenant: &TenantId) -> Result<Vec<PluginVersion>, StorageError>;
    /// Makes `version` active (0: the built-in default); `None` when the tenant has no such version.
    async fn activate_plugin(&self, tenant: &TenantId, version: i64) -> Result<Option<PluginVersion>, StorageError>;
    /// The active version, or `None` for the built-in default.
    async fn active_plugin(&self, tenant: &TenantId) -> Result<Option<PluginVersion>, StorageError>;
    /// A stored version's component bytes.
    async fn plugin_wasm(&self, tenant: &TenantId, version: i64) -> Result<Option<Vec<u8>>, StorageError>;

    /// Finishes queued writes and closes connections.
    async fn close(&self);
}

/// What a broker sink has yet to deliver ([`Storage::sink_backlog`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SinkBacklog {
    /// Tenants with undelivered events, in id order.
    pub tenants: Vec<TenantId>,
    /// Undelivered events across every tenant (sequence numbers past the cursors).
    pub lag: i64,
}

/// One tenant's cursor of one broker sink, held until [`SinkClaim::advance`] or drop (which
/// leaves the cursor where it was).
#[async_trait]
pub trait SinkClaim: Send {
    /// The last sequence number delivered (0: none).
    fn cursor(&self) -> i64;
    /// Up to `limit` of the tenant's events after the cursor, in sequence order.
    async fn page(&mut self, limit: u32) -> Result<Vec<Event>, StorageError>;
    /// Stores `to` as the cursor (a cursor never moves back) and lets the claim go.
    async fn advance(self: Box<Self>, to: i64) -> Result<(), StorageError>;
}

/// A plugin upload to store.
#[derive(Debug, Clone)]
pub struct PluginUpload {
    pub sha256: String,
    pub wasm: Vec<u8>,
    pub config: String,
    /// The language profile it was uploaded for (`rust`, `js`, `python`).
    pub runtime: String,
    /// Versions the tenant keeps once this one is stored (`[plugins] max_versions_per_tenant`,
    /// at least 1): the new one, the one active when the upload began, then the newest others.
    pub max_versions: usize,
}

/// A stored plugin version (without its bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginVersion {
    pub version: i64,
    pub sha256: String,
    pub config: String,
    /// The language profile it was uploaded for (`rust`, `js`, `python`; empty for version 0).
    pub runtime: String,
    pub uploaded_at_ms: i64,
    pub active: bool,
}

/// A freshly minted API key's stored half.
#[derive(Debug, Clone)]
pub struct NewApiKey {
    pub id: String,
    pub hash: String,
}

/// The writer bounds from `[batch]`.
pub fn writer_limits(batch: &crate::config::BatchConfig) -> sqlite::writer::WriterLimits {
    sqlite::writer::WriterLimits {
        max_batch: batch.max_batch,
        queue_depth: batch.queue_depth,
        max_wait: std::time::Duration::from_micros(batch.max_wait_us),
        checkpoint_pages: sqlite::writer::CHECKPOINT_PAGES,
    }
}
