//! Creating a resource (with its `create` ledger rows) and adjusting it (restock or write-off,
//! idempotent).

use super::buckets;
use super::events;
use super::port::{Change, Entry, Gate, Move, Port, Row};
use crate::engine::ResourceKey;
use crate::engine::{LedgerOp, Mode, ResourceState, ResourceStatus, TenantId};
use crate::events::StockBand;
use crate::storage::rules::{adjust_refusal, new_request_id, split_evenly};
use crate::storage::{
    AdjustRefusal, IdempotencyRequest, Idempotent, ModeFence, NewResource, StorageError, StoredResponse,
};

/// Creates a resource with its `create` ledger rows (one per bucket when it has several);
/// `plugin_version` when a plan created it. `None` if the key exists.
pub async fn create<P: Port>(
    port: &mut P,
    tenant: &TenantId,
    res: &NewResource,
    plugin_version: Option<i64>,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    let Some((state, counts)) = port.insert_resource(tenant.as_str(), res, now_ms).await? else { return Ok(None) };
    let entry = Entry {
        tenant: tenant.as_str(),
        resource: res.key.as_str(),
        bucket: 0,
        op: LedgerOp::Create,
        qty: res.total,
        request_id: "create",
        order_id: None,
        reservation_id: None,
        plugin_version,
        at: now_ms,
        line_key: None,
        limit_key: None,
        reverses: None,
    };
    if res.buckets > 1 {
        port.insert_buckets(&split_evenly(res.total, res.buckets), &entry).await?;
        return buckets::complete(port, tenant.as_str(), state).await.map(Some);
    }
    port.append_ledger(&entry, counts).await?;
    Ok(Some(state))
}

/// Restock (+) or write-off (−), idempotent: the response (200 with the state after, or the
/// refusal) is stored under the key. An unknown resource leaves no stored outcome, so the key
/// stays free for a retry once the resource exists.
pub async fn adjust<P: Port>(
    port: &mut P,
    tenant: &TenantId,
    idem: &IdempotencyRequest,
    key: &ResourceKey,
    delta: i64,
    fence: ModeFence,
    now_ms: i64,
) -> Result<Result<Idempotent, AdjustRefusal>, StorageError> {
    if let Some(previous) = port.claim_key(tenant, idem, now_ms).await? {
        return Ok(Ok(previous));
    }
    let Some(state) = port.resource(tenant.as_str(), key.as_str()).await? else {
        port.forget_key(tenant, idem).await?;
        return Ok(Err(AdjustRefusal::ResourceNotFound));
    };
    // Read under the row's lock (PostgreSQL's batch locks it first; SQLite has one writer), so
    // the mode cannot move between this check and the commit.
    let decided = match fence {
        ModeFence::Db => state.mode == Mode::Db,
        ModeFence::Redis { epoch } => state.mode == Mode::Redis && state.mode_epoch == epoch,
    };
    if !decided {
        port.forget_key(tenant, idem).await?;
        return Ok(Err(AdjustRefusal::ModeChanged));
    }
    let request_id = new_request_id();
    let response = if state.buckets > 1 {
        match buckets::adjust(port, tenant.as_str(), state, delta, &request_id, now_ms).await? {
            Ok(state) => StoredResponse::json(200, &state)?,
            Err(available) => StoredResponse::problem(&adjust_refusal(key, available, delta))?,
        }
    } else {
        let entry = Entry {
            tenant: tenant.as_str(),
            resource: key.as_str(),
            bucket: 0,
            op: LedgerOp::Adjust,
            qty: delta,
            request_id: &request_id,
            order_id: None,
            reservation_id: None,
            plugin_version: None,
            at: now_ms,
            line_key: None,
            limit_key: None,
            reverses: None,
        };
        let change = Change { row: Row::Resource, how: Move::Adjust, gate: Gate::Counters, entry };
        let changed = port.change(&change).await?.is_some();
        let after = port.resource(tenant.as_str(), key.as_str()).await?;
        match after {
            Some(after) if changed => StoredResponse::json(200, &after)?,
            Some(after) => StoredResponse::problem(&adjust_refusal(key, after.available, delta))?,
            None => return Err(StorageError::Internal(format!("resource {key} vanished during an adjustment"))),
        }
    };
    port.store_outcome(tenant, idem, &response, None, None, now_ms).await?;
    if response.status == 200 {
        events::observe_stock(port, tenant.as_str(), key.as_str(), now_ms).await?;
    }
    Ok(Ok(Idempotent::Fresh(response)))
}

/// Sets (or clears) the resource's low-stock threshold; its state after (`None`: no such
/// resource). The stored band follows the new threshold without an event: no stock moved.
pub async fn set_low_stock<P: Port>(
    port: &mut P,
    tenant: &TenantId,
    key: &ResourceKey,
    low_stock: Option<i64>,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    let (t, k) = (tenant.as_str(), key.as_str());
    if !port.set_low_stock(t, k, low_stock, now_ms).await? {
        return Ok(None);
    }
    if let Some(stock) = port.stock(t, k).await? {
        port.set_stock(t, k, StockBand::of(stock.available, low_stock)).await?;
    }
    let Some(state) = port.resource(t, k).await? else { return Ok(None) };
    buckets::complete(port, t, state).await.map(Some)
}

/// Activates or deactivates a resource; its state after (`None`: no such resource).
pub async fn set_status<P: Port>(
    port: &mut P,
    tenant: &TenantId,
    key: &ResourceKey,
    status: ResourceStatus,
    now_ms: i64,
) -> Result<Option<ResourceState>, StorageError> {
    let Some(state) = port.set_status(tenant.as_str(), key.as_str(), status, now_ms).await? else { return Ok(None) };
    buckets::complete(port, tenant.as_str(), state).await.map(Some)
}
