//! The reads of the API, written once over [`Reads`] (the read half of the storage port): a
//! resource with its buckets folded in, a page of resources or of a ledger, the dry run, and
//! reconciliation. A backend runs each inside one read snapshot, so the queries of one read
//! agree with each other.

use std::collections::{HashMap, HashSet};

use super::buckets::complete;
use super::port::Port;
use crate::engine::{
    reconcile, BucketCounts, Checkpoint, CheckpointUpdate, Drift, LedgerEntry, LedgerSum, NewestEntry, OrderDocument,
    OrderRequest, Pass, Plan, Reconciliation, ResourceState, TenantId,
};
use crate::events::{resource_key, EventType, NewEvent};
use crate::storage::rules::{fold_all, preview_line, previewed};
use crate::storage::{Holding, PageFrom, StorageError};

/// The rows reconciliation judges, read in one snapshot.
#[derive(Debug, Default)]
pub struct LedgerRows {
    /// Every resource row, with its tenant.
    pub resources: Vec<(String, ResourceState)>,
    /// Every stored checkpoint of these resources (and buckets).
    pub checkpoints: Vec<Checkpoint>,
    /// Per resource, bucket and op: the quantity and number of ledger rows (after the
    /// checkpoint's version in an incremental pass; all of them in a full one).
    pub sums: Vec<LedgerSum>,
    /// Per resource and bucket: the counters after its newest ledger row (of those summed).
    pub newest: Vec<NewestEntry>,
    /// Every bucket row, by `(tenant, resource)`.
    pub buckets: HashMap<(String, String), Vec<BucketCounts>>,
}

/// The read queries, beside [`Port`]'s.
#[allow(async_fn_in_trait)]
pub trait Reads: Port {
    /// A page of the tenant's resources by key: those with `prefix`, after `after`, at most
    /// `limit`, in bytewise key order (rows only; buckets not folded in).
    async fn resources_page(
        &mut self,
        tenant: &str,
        prefix: &str,
        after: &str,
        limit: u32,
    ) -> Result<Vec<ResourceState>, StorageError>;
    /// Every bucket row of these resources, by `(tenant, resource)`.
    async fn buckets_of(
        &mut self,
        tenant: &str,
        keys: &[String],
    ) -> Result<HashMap<(String, String), Vec<BucketCounts>>, StorageError>;
    /// A page of a resource's ledger, by `seq`.
    /// A page of a resource's ledger, in [`PageFrom::bounds`]' order.
    async fn ledger_entries(
        &mut self,
        tenant: &str,
        key: &str,
        from: PageFrom,
        limit: u32,
    ) -> Result<Vec<LedgerEntry>, StorageError>;
    /// What a per-user limit key has used so far (0 if never).
    async fn limit_used(&mut self, tenant: &str, key: &str) -> Result<i64, StorageError>;
    /// Those of `ids` that are the tenant's reservations in state `held`.
    async fn held_among(&mut self, tenant: &str, ids: &[String]) -> Result<HashSet<String>, StorageError>;
    /// Everything reconciliation judges, for one tenant or all. An incremental pass sums, for
    /// each resource (bucket), only the ledger rows whose `seq` is past its checkpoint's, through
    /// the index on `(tenant, resource, seq)`. Across rows `seq` is not in commit order (on
    /// PostgreSQL and MySQL transactions take their numbers before they commit), but every entry
    /// of one row (bucket) takes its number after its change took the row's lock and commits
    /// before the lock is let go: one row's entries commit in `seq` order, so no entry can later
    /// appear below a checkpoint that a snapshot proved.
    async fn ledger_rows(&mut self, tenant: Option<&str>, pass: Pass) -> Result<LedgerRows, StorageError>;
}

/// A resource with a bucketed one's buckets folded in (and listed).
pub async fn resource<R: Reads>(
    reads: &mut R,
    tenant: &TenantId,
    key: &str,
) -> Result<Option<ResourceState>, StorageError> {
    match reads.resource(tenant.as_str(), key).await? {
        Some(state) => complete(reads, tenant.as_str(), state).await.map(Some),
        None => Ok(None),
    }
}

/// A resource as [`resource`] reads it, and which of `reservations` are held, read together
/// (in the backend's one snapshot): Redis is loaded from them (`RedisMode::load`), and must
/// keep exactly the reservations whose stock the counters still count as reserved.
pub async fn resource_holding<R: Reads>(
    reads: &mut R,
    tenant: &TenantId,
    key: &str,
    reservations: &[String],
) -> Result<Holding, StorageError> {
    let Some(state) = resource(reads, tenant, key).await? else { return Ok(None) };
    let held =
        if reservations.is_empty() { HashSet::new() } else { reads.held_among(tenant.as_str(), reservations).await? };
    Ok(Some((state, held)))
}

/// A page of resources, bucketed ones' totals folded in (their buckets not listed).
pub async fn resources<R: Reads>(
    reads: &mut R,
    tenant: &TenantId,
    prefix: Option<&str>,
    after: Option<&str>,
    limit: u32,
) -> Result<Vec<ResourceState>, StorageError> {
    let page = reads.resources_page(tenant.as_str(), prefix.unwrap_or(""), after.unwrap_or(""), limit).await?;
    let bucketed: Vec<String> = page.iter().filter(|s| s.buckets > 1).map(|s| s.key.clone()).collect();
    let mut states: Vec<(String, ResourceState)> = page.into_iter().map(|s| (tenant.to_string(), s)).collect();
    if !bucketed.is_empty() {
        let grouped = reads.buckets_of(tenant.as_str(), &bucketed).await?;
        fold_all(&mut states, grouped, false);
    }
    Ok(states.into_iter().map(|(_, s)| s).collect())
}

/// A page of a resource's ledger; `None` when the resource does not exist.
pub async fn ledger<R: Reads>(
    reads: &mut R,
    tenant: &TenantId,
    key: &str,
    from: PageFrom,
    limit: u32,
) -> Result<Option<Vec<LedgerEntry>>, StorageError> {
    if reads.view(tenant.as_str(), key).await?.is_none() {
        return Ok(None);
    }
    let page = reads.ledger_entries(tenant.as_str(), key, from, limit).await?;
    Ok(Some(from.arrange(page)))
}

/// The outcome the order would have now; applies and records nothing.
pub async fn preview<R: Reads>(
    reads: &mut R,
    tenant: &TenantId,
    order: &OrderRequest,
    plan: &Plan,
) -> Result<OrderDocument, StorageError> {
    let mut results = Vec::with_capacity(plan.lines.len());
    for line in &plan.lines {
        let used = match &line.limit {
            Some(limit) => reads.limit_used(tenant.as_str(), limit.key.as_str()).await?,
            None => 0,
        };
        let mut views = Vec::with_capacity(line.targets.len());
        for target in &line.targets {
            let view = reads.view(tenant.as_str(), target.resource.as_str()).await?;
            views.push(previewed(target, view)?);
        }
        results.push(preview_line(line, used, views));
    }
    Ok(OrderDocument::build(order, plan, &results, None))
}

/// Proves state == opening balance + ledger for one tenant, or for all; returns the report and
/// the checkpoints to move for the next pass ([`save_checkpoints`], in a write of its own).
pub async fn reconciliation<R: Reads>(
    reads: &mut R,
    tenant: Option<&TenantId>,
    pass: Pass,
) -> Result<(Reconciliation, CheckpointUpdate), StorageError> {
    let LedgerRows { mut resources, checkpoints, sums, newest, buckets } =
        reads.ledger_rows(tenant.map(TenantId::as_str), pass).await?;
    fold_all(&mut resources, buckets, true);
    Ok(reconcile(&resources, &checkpoints, &sums, &newest, pass))
}

/// Emits `reconciliation.drift` for each drift the pass found in history proven clean before
/// (once per detection: its checkpoint is forgotten with it).
pub async fn report_drift<P: Port>(port: &mut P, drift: &[Drift], now_ms: i64) -> Result<(), StorageError> {
    for d in drift.iter().filter(|d| d.new) {
        let data = serde_json::json!({"key": d.key, "bucket": d.bucket, "expected": d.expected, "actual": d.actual});
        let event = NewEvent::new(&d.tenant, EventType::ReconciliationDrift, resource_key(&d.key), now_ms, &data);
        port.emit(&event).await?;
    }
    Ok(())
}

/// Stores what a pass learnt. Safe to run after any later pass: a checkpoint only moves to a
/// version at least its own (each is a fact about history up to its version), and forgetting
/// one only makes the next pass replay more.
pub async fn save_checkpoints<P: Port>(port: &mut P, update: &CheckpointUpdate) -> Result<(), StorageError> {
    port.forget_checkpoints(&update.forget).await?;
    port.advance_checkpoints(&update.advance).await
}
