//! The storage port: the statements the orchestration in [`crate::apply`] needs, and nothing
//! else. A backend implements it with SQL text and plumbing only; every decision (which row to
//! try next, when to create, what a refusal means, what the response is) is made once, above it.
//!
//! Every method runs on the connection (and inside the transaction) of the write it serves. A
//! backend's methods may be asynchronous (PostgreSQL) or complete at once (SQLite, whose writer
//! thread drives the orchestration with [`run_now`]).

use std::collections::HashMap;
use std::future::Future;

use futures::FutureExt;

use crate::engine::admission::Row as AdmissionRow;
use crate::engine::reversal::OrderEntries;
use crate::engine::{
    BucketCounts, Checkpoint, Kind, LedgerOp, LimitSpec, Mode, Reservation, ReservationState, ResourceState,
    ResourceStatus, TenantId,
};
use crate::events::{NewEvent, Stock, StockBand};
use crate::storage::redis_store::SettleRecord;
use crate::storage::{IdempotencyRequest, Idempotent, NewResource, StorageError, StoredResponse};

/// A row's counters after a change, as its ledger row records them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub available: i64,
    pub reserved: i64,
    pub consumed: i64,
    pub version: i64,
}

/// How a change moves a quantity between a row's counters, and what guards it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    /// `available → consumed`, guarded by `available >= qty`.
    Deduct,
    /// `available → reserved`, guarded by `available >= qty`.
    Reserve,
    /// `reserved → consumed`, guarded by `reserved >= qty`.
    Confirm,
    /// `reserved → available`, guarded by `reserved >= qty`.
    Unreserve,
    /// `available` and `total` by a signed quantity, guarded by `available + qty >= 0` (and, on
    /// a resource row, `total + qty <= MAX_TOTAL`).
    Adjust,
    /// `consumed → available` (a reversal), guarded by `consumed >= qty`; with
    /// [`Gate::Order`], a resource row must also be in db mode (Redis gives back its own).
    Reverse,
}

/// Which row a change applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Row {
    /// The resource row of a single-bucket resource.
    Resource,
    /// One bucket row of a bucketed resource.
    Bucket(i64),
}

/// Who asks, for the guards a deduction or reservation of a resource row adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// An order on the database path: the row must also be active, in db mode and (when the plan
    /// names one) of `kind`.
    Order { kind: Option<Kind> },
    /// Only the counters may refuse it: a sale Redis already made, a reservation move, an
    /// adjustment.
    Counters,
}

/// What a ledger row records besides the counters after its change.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    pub tenant: &'a str,
    pub resource: &'a str,
    pub bucket: i64,
    pub op: LedgerOp,
    /// Signed for an adjustment.
    pub qty: i64,
    pub request_id: &'a str,
    pub order_id: Option<&'a str>,
    pub reservation_id: Option<&'a str>,
    pub plugin_version: Option<i64>,
    pub at: i64,
    /// The order line (its key as sent) an order's entry applied.
    pub line_key: Option<&'a str>,
    /// The per-user limit the line counted against (given back by a reversal).
    pub limit_key: Option<&'a str>,
    /// A reversal's: the request whose take it gives back.
    pub reverses: Option<&'a str>,
}

/// One guarded change of one row, written with its ledger row (`entry`, with `entry.qty` the
/// quantity moved) when the guard lets it through.
#[derive(Debug, Clone, Copy)]
pub struct Change<'a> {
    pub row: Row,
    pub how: Move,
    pub gate: Gate,
    pub entry: Entry<'a>,
}

/// A resource as a line is judged against it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    pub status: ResourceStatus,
    pub kind: Kind,
    pub mode: Mode,
    /// A bucketed resource's is its buckets' sum.
    pub available: i64,
    pub buckets: i64,
}

/// A reservation row to insert (state `held`).
#[derive(Debug, Clone)]
pub struct NewReservation {
    pub tenant: String,
    pub id: String,
    pub order_id: String,
    /// [`crate::engine::ReservationLine`]s as JSON.
    pub lines: String,
    pub expires_at: i64,
    pub created_at: i64,
}

/// How a batch's claim of an idempotency key went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key is this request's: decide it and store its outcome.
    Ours,
    /// The key was answered before: its first outcome (or a mismatch).
    Answered(Idempotent),
    /// Neither can be said in bulk (the key vanished between two statements): leave the order to
    /// the per-order path.
    Unsure,
}

/// A ledger row the batch writes, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerRow {
    pub tenant: String,
    pub resource: String,
    /// The bucket row it changed (0: the resource row of a single-bucket resource).
    pub bucket: i64,
    /// The order line (its key as sent) the entry applied.
    pub line_key: String,
    /// The per-user limit the line counted against (a confirmed reservation's line).
    pub limit_key: Option<String>,
    pub op: LedgerOp,
    pub qty: i64,
    pub request_id: String,
    pub order_id: String,
    pub reservation_id: Option<String>,
    pub after: Counts,
    /// The plan's; `None` on a reservation's move.
    pub plugin_version: Option<i64>,
    pub at: i64,
}

/// A held reservation the batch moved to `to` (written guarded by its state still `held`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldMove {
    pub tenant: String,
    pub id: String,
    pub to: ReservationState,
    pub at: i64,
}

/// A resource row the batch changed, written guarded by the version it was read at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowWrite {
    pub tenant: String,
    pub key: String,
    pub after: Counts,
    pub read_version: i64,
    /// Its stock band after the batch when that differs from the band it was read with (its
    /// stock events are among the batch's events); `None`: the band stays as stored.
    pub stock: Option<StockBand>,
    /// `updated_at`: the time of the write that last changed it; `None`: left as stored (a
    /// bucketed resource whose only change is its stock band).
    pub at: Option<i64>,
}

/// A bucket row the batch changed, written guarded by the version it was read at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketWrite {
    pub tenant: String,
    pub key: String,
    pub bucket: i64,
    pub after: Counts,
    pub read_version: i64,
    /// `updated_at`: the time of the write that last changed it.
    pub at: i64,
}

/// A batch's bucket write whose guard refused: the bucket moved after the batch read it (a
/// write that did not declare its resource). Passing: the batch runs again and reads it anew.
pub fn bucket_moved() -> StorageError {
    StorageError::Unavailable("a bucket the batch read moved meanwhile".into())
}

/// An idempotency record the batch stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub tenant: String,
    pub key: String,
    pub request_hash: String,
    pub response: StoredResponse,
    /// The batch's event whose payload is `response.body` (an applied order's `order.applied`):
    /// the record then keeps this id instead of the body.
    pub event: Option<String>,
    /// The request whose ledger entries the batch writes with this record (an order's; `None`
    /// where it writes none of its own here, as settlement's records). A backend may find those
    /// entries through the record when their order id is the key (SQLite does).
    pub request_id: Option<String>,
    pub at: i64,
}

/// Everything a batch decided by admission, written at once.
#[derive(Debug, Clone, Default)]
pub struct BatchWrites {
    pub rows: Vec<RowWrite>,
    /// Bucket rows, in `(tenant, key, bucket)` order.
    pub buckets: Vec<BucketWrite>,
    pub ledger: Vec<LedgerRow>,
    pub reservations: Vec<NewReservation>,
    /// Held reservations confirmed, released or expired.
    pub moves: Vec<HeldMove>,
    pub outcomes: Vec<Outcome>,
    /// The events of the batch's writes, in the order they were decided.
    pub events: Vec<NewEvent>,
}

/// Resource rows by tenant, then key, as a batch read them (under its locks, where the backend
/// has several writers).
pub type LockedRows = HashMap<String, HashMap<String, AdmissionRow>>;

/// The names of the savepoints the orchestration nests inside a write's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Savepoint {
    /// Around an order's lines: a rejected order leaves nothing behind.
    Lines,
    /// Around one line that may change something and still fail (a limit, a creation).
    Line,
}

impl Savepoint {
    pub fn name(self) -> &'static str {
        match self {
            Savepoint::Lines => "lines",
            Savepoint::Line => "line",
        }
    }
}

/// The statements of one backend. See the module docs.
#[allow(async_fn_in_trait)]
pub trait Port {
    /// Claims `idem` for this write: `None`, it is ours (store its outcome with
    /// [`Port::store_outcome`]); `Some`, it was used before: its first outcome, or a mismatch.
    /// Where several processes write, a concurrent first use waits here until the other commits.
    async fn claim_key(
        &mut self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        now_ms: i64,
    ) -> Result<Option<Idempotent>, StorageError>;
    /// Stores the outcome of a key this write claimed, in the same transaction as its effects.
    /// `event`: the id of an event this transaction writes whose payload is `response.body`
    /// byte for byte; the record then points at it instead of keeping the body (see
    /// [`crate::storage::body_columns`]). `request_id`: the request whose ledger entries this
    /// transaction wrote with the record, as [`Outcome::request_id`].
    async fn store_outcome(
        &mut self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        response: &StoredResponse,
        event: Option<&str>,
        request_id: Option<&str>,
        now_ms: i64,
    ) -> Result<(), StorageError>;
    /// Gives back a claimed key whose request ends without a stored outcome.
    async fn forget_key(&mut self, tenant: &TenantId, idem: &IdempotencyRequest) -> Result<(), StorageError>;

    async fn savepoint(&mut self, at: Savepoint) -> Result<(), StorageError>;
    async fn rollback_to(&mut self, at: Savepoint) -> Result<(), StorageError>;
    async fn release(&mut self, at: Savepoint) -> Result<(), StorageError>;

    /// The guarded change and its ledger row; `None`: the guard refused and nothing changed.
    async fn change(&mut self, change: &Change<'_>) -> Result<Option<Counts>, StorageError>;
    /// A ledger row for a change made otherwise (a creation).
    async fn append_ledger(&mut self, entry: &Entry<'_>, after: Counts) -> Result<(), StorageError>;

    /// The resource as lines are judged against it; `None`: no such resource.
    async fn view(&mut self, tenant: &str, key: &str) -> Result<Option<View>, StorageError>;
    /// The resource row (a bucketed resource's without its buckets folded in).
    async fn resource(&mut self, tenant: &str, key: &str) -> Result<Option<ResourceState>, StorageError>;
    /// Sets the resource's status; the row after (`None`: no such resource).
    async fn set_status(
        &mut self,
        tenant: &str,
        key: &str,
        status: ResourceStatus,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError>;
    /// Inserts an active, db-mode resource row with `total` available (0 for a bucketed one);
    /// `None` if the key exists.
    async fn insert_resource(
        &mut self,
        tenant: &str,
        res: &NewResource,
        now_ms: i64,
    ) -> Result<Option<(ResourceState, Counts)>, StorageError>;
    /// Inserts bucket rows `0..shares.len()` with those totals, each with its `create` ledger
    /// row (`entry` with the bucket and share filled in).
    async fn insert_buckets(&mut self, shares: &[i64], entry: &Entry<'_>) -> Result<(), StorageError>;
    /// Every bucket's counters, in bucket order.
    async fn buckets(&mut self, tenant: &str, key: &str) -> Result<Vec<BucketCounts>, StorageError>;
    /// Up to `limit` bucketed resources whose buckets differ by more than one, locked where
    /// several processes write (skipping those locked by others).
    async fn uneven_resources(&mut self, limit: u32) -> Result<Vec<(String, String)>, StorageError>;

    /// Counts `qty` against the limit if `used + qty <= max`; `false`: it would not fit.
    async fn take_limit(&mut self, tenant: &str, limit: &LimitSpec, qty: i64) -> Result<bool, StorageError>;
    async fn give_back_limit(&mut self, tenant: &str, key: &str, qty: i64) -> Result<(), StorageError>;

    async fn insert_reservation(&mut self, reservation: &NewReservation) -> Result<(), StorageError>;
    async fn reservation(&mut self, tenant: &str, id: &str) -> Result<Option<Reservation>, StorageError>;
    /// Up to `limit` of the tenant's held reservations, the soonest to expire first.
    async fn held_reservations(&mut self, tenant: &str, limit: u32) -> Result<Vec<Reservation>, StorageError>;
    /// Moves the reservation from `held` to `to`; `false`: it was not held (any more).
    async fn leave_held(
        &mut self,
        tenant: &str,
        id: &str,
        to: ReservationState,
        now_ms: i64,
    ) -> Result<bool, StorageError>;
    /// These reservations, one answer each, locked where several processes write (taken in one
    /// global order: tenant, then id).
    async fn lock_reservations(&mut self, wanted: &[(&str, &str)]) -> Result<Vec<Option<Reservation>>, StorageError>;
    /// Up to `limit` held reservations past their deadline with their tenants, locked where
    /// several processes write (skipping those locked by others).
    async fn due_reservations(&mut self, now_ms: i64, limit: u32) -> Result<Vec<(String, Reservation)>, StorageError>;

    /// Claims a settlement's request id; `false`: it was settled before (a redelivery).
    async fn claim_settlement(
        &mut self,
        tenant: &str,
        key: &str,
        request_id: &str,
        now_ms: i64,
    ) -> Result<bool, StorageError>;
    /// Claims settlements' request ids (distinct) of one resource at once, one answer per id in
    /// order: `false`, it was settled before. Where several processes write, an id another
    /// transaction claims first waits here for it, as [`Port::claim_settlement`] does.
    async fn claim_settlements(
        &mut self,
        tenant: &str,
        key: &str,
        request_ids: &[&str],
        now_ms: i64,
    ) -> Result<Vec<bool>, StorageError> {
        let mut claimed = Vec::with_capacity(request_ids.len());
        for id in request_ids {
            claimed.push(self.claim_settlement(tenant, key, id, now_ms).await?);
        }
        Ok(claimed)
    }
    /// Records a sale Redis acknowledged that the database refused (once per request id).
    async fn record_settlement_failure(
        &mut self,
        record: &SettleRecord,
        qty: i64,
        reason: &str,
        available: i64,
        now_ms: i64,
    ) -> Result<(), StorageError>;
    /// The quantity of a reservation made in Redis whose settlement the database refused (its
    /// failure row is the tombstone); `None` if none was refused.
    async fn refused_reservation(&mut self, tenant: &str, id: &str) -> Result<Option<i64>, StorageError>;
    /// Adds to a per-user limit's count without a bound (Redis enforced it).
    async fn count_limit(&mut self, tenant: &str, key: &str, qty: i64) -> Result<(), StorageError>;
    /// Stores an outcome under a key unless the key has one; `true`: it was stored now.
    /// `event` as for [`Port::store_outcome`].
    async fn store_outcome_if_absent(
        &mut self,
        tenant: &str,
        key: &str,
        request_hash: &str,
        response: &StoredResponse,
        event: Option<&str>,
        at: i64,
    ) -> Result<bool, StorageError>;

    /// [`Port::store_outcome_if_absent`] for each of these outcomes (of distinct keys), one
    /// answer per outcome in order.
    async fn store_outcomes_if_absent(&mut self, outcomes: &[Outcome]) -> Result<Vec<bool>, StorageError> {
        let mut stored = Vec::with_capacity(outcomes.len());
        for o in outcomes {
            let event = o.event.as_deref();
            stored.push(
                self.store_outcome_if_absent(&o.tenant, &o.key, &o.request_hash, &o.response, event, o.at).await?,
            );
        }
        Ok(stored)
    }

    /// Claims the keys of a batch's orders at once, one answer per key in order.
    async fn claim_keys(
        &mut self,
        keys: &[(&TenantId, &IdempotencyRequest)],
        now_ms: i64,
    ) -> Result<Vec<Claim>, StorageError>;
    /// Writes what batch admission decided.
    async fn write_batch(&mut self, writes: &BatchWrites) -> Result<(), StorageError>;

    /// Writes an event with the change that caused it, in the same savepoint: it commits with
    /// the change or not at all (docs/EVENTS.md). Its sequence number is assigned by the time
    /// the transaction commits.
    async fn emit(&mut self, event: &NewEvent) -> Result<(), StorageError>;
    /// A resource's available stock now (summed over its buckets), its low-stock threshold and
    /// the band last stored; `None`: no such resource.
    async fn stock(&mut self, tenant: &str, key: &str) -> Result<Option<Stock>, StorageError>;
    /// Sets (or with `None` clears) the resource's low-stock threshold; `false`: no such resource.
    async fn set_low_stock(
        &mut self,
        tenant: &str,
        key: &str,
        low_stock: Option<i64>,
        now_ms: i64,
    ) -> Result<bool, StorageError>;
    /// Stores the resource's band (after the events of its move were emitted).
    async fn set_stock(&mut self, tenant: &str, key: &str, band: StockBand) -> Result<(), StorageError>;

    /// An order's ledger entries summed per resource, bucket and op (at most `limit` groups).
    async fn order_entries(
        &mut self,
        tenant: &str,
        order_id: &str,
        limit: u32,
    ) -> Result<Vec<OrderEntries>, StorageError>;
    /// Counts `qty` more reversed of what the order took from the resource's bucket, if
    /// `reversed + qty <= taken` (with `taken` raised to the given one, never lowered); `false`:
    /// it would not fit (another reversal came first). Serialises reversals of one order line.
    #[allow(clippy::too_many_arguments)]
    async fn take_reversal(
        &mut self,
        tenant: &str,
        order_id: &str,
        resource: &str,
        bucket: i64,
        taken: i64,
        qty: i64,
        now_ms: i64,
    ) -> Result<bool, StorageError>;

    /// Stores these reconciliation checkpoints, each replacing the stored one of its resource
    /// (bucket) unless that one is at a newer version.
    async fn advance_checkpoints(&mut self, checkpoints: &[Checkpoint]) -> Result<(), StorageError>;
    /// Deletes the checkpoints of these `(tenant, resource, bucket)`s.
    async fn forget_checkpoints(&mut self, which: &[(String, String, i64)]) -> Result<(), StorageError>;
}

/// Runs orchestration over a port whose statements complete at once (SQLite on its writer
/// thread). A future that is still pending after one poll is a bug of that port.
pub fn run_now<T>(work: impl Future<Output = Result<T, StorageError>>) -> Result<T, StorageError> {
    work.now_or_never().unwrap_or_else(|| Err(StorageError::Internal("a synchronous storage port suspended".into())))
}
