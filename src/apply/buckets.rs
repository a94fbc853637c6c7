//! Bucketed resources: deductions and reservations that fall back across buckets, adjustments
//! spread over them, and the rebalancer. Every change is one guarded change of one bucket row
//! with its ledger row (carrying the bucket).
//!
//! A guard that refuses after the buckets were read means something moved them meanwhile (only
//! possible where several processes write and a lock was not held): nothing is judged on a
//! stale read, the write fails as transient and its batch runs again.

use super::orders::{bucket_change, OrderFacts};
use super::port::{Change, Entry, Gate, Move, Port, Row};
use crate::engine::{BucketTake, LedgerOp, Reason, ResourceState, Target, MAX_TOTAL};
use crate::storage::rules::{bucket_order, bucket_takes, rebalance_moves, split_evenly, write_off_takes};
use crate::storage::StorageError;

fn moved_meanwhile(resource: &str, bucket: i64) -> StorageError {
    StorageError::Unavailable(format!("bucket {bucket} of {resource} changed meanwhile"))
}

/// A resource's state with a bucketed resource's totals folded in from its buckets.
pub async fn complete<P: Port>(
    port: &mut P,
    tenant: &str,
    mut state: ResourceState,
) -> Result<ResourceState, StorageError> {
    if state.buckets > 1 {
        let buckets = port.buckets(tenant, &state.key).await?;
        state.fold_buckets(buckets);
    }
    Ok(state)
}

async fn availables<P: Port>(port: &mut P, tenant: &str, key: &str) -> Result<Vec<i64>, StorageError> {
    Ok(port.buckets(tenant, key).await?.into_iter().map(|b| b.available).collect())
}

/// Takes `qty` from a bucketed resource of `n` buckets for a deduction or reservation: the
/// plan's bucket order (or the seed's rotation) picks the first bucket; when no single bucket
/// covers it, it is taken from several, so the line is refused only if the total cannot cover
/// it. The caller has checked the resource's status and kind.
pub(super) async fn take<P: Port>(
    port: &mut P,
    facts: &OrderFacts<'_>,
    target: &Target,
    n: i64,
    qty: i64,
) -> Result<Result<Vec<BucketTake>, Reason>, StorageError> {
    let resource = target.resource.as_str();
    let order = bucket_order(&target.buckets, n, facts.seed).map_err(StorageError::PlanRefused)?;
    // Most of the time the first bucket covers the line: one statement, no read.
    if let Some(&first) = order.first() {
        if port.change(&bucket_change(facts, resource, first, qty)).await?.is_some() {
            return Ok(Ok(vec![BucketTake { bucket: first, qty }]));
        }
    }
    let available = availables(port, facts.tenant.as_str(), resource).await?;
    let Some(takes) = bucket_takes(&order, &available, qty) else { return Ok(Err(Reason::Insufficient)) };
    for &(bucket, qty) in &takes {
        if port.change(&bucket_change(facts, resource, bucket, qty)).await?.is_none() {
            return Err(moved_meanwhile(resource, bucket));
        }
    }
    Ok(Ok(takes.into_iter().map(|(bucket, qty)| BucketTake { bucket, qty }).collect()))
}

/// Signed changes of `available` per bucket, as adjustments with ledger rows under one request.
async fn apply_moves<P: Port>(
    port: &mut P,
    tenant: &str,
    resource: &str,
    request_id: &str,
    moves: Vec<(i64, i64)>,
    now_ms: i64,
) -> Result<(), StorageError> {
    for (bucket, qty) in moves.into_iter().filter(|(_, d)| *d != 0) {
        let entry = Entry {
            tenant,
            resource,
            bucket,
            op: LedgerOp::Adjust,
            qty,
            request_id,
            order_id: None,
            reservation_id: None,
            plugin_version: None,
            at: now_ms,
            line_key: None,
            limit_key: None,
            reverses: None,
        };
        let change = Change { row: Row::Bucket(bucket), how: Move::Adjust, gate: Gate::Counters, entry };
        if port.change(&change).await?.is_none() {
            return Err(moved_meanwhile(resource, bucket));
        }
    }
    Ok(())
}

/// A restock (spread evenly) or write-off (fullest buckets first) of a bucketed resource.
/// `Err(available)`: a write-off larger than the available total, or a restock past the largest
/// total; nothing changed. The state after, otherwise.
pub async fn adjust<P: Port>(
    port: &mut P,
    tenant: &str,
    state: ResourceState,
    delta: i64,
    request_id: &str,
    now_ms: i64,
) -> Result<Result<ResourceState, i64>, StorageError> {
    let state = complete(port, tenant, state).await?;
    let available: Vec<i64> = state.bucket_counts.iter().flatten().map(|b| b.available).collect();
    let moves: Vec<(i64, i64)> = if delta >= 0 {
        if state.total.saturating_add(delta) > MAX_TOTAL {
            return Ok(Err(state.available));
        }
        split_evenly(delta, state.buckets).into_iter().enumerate().map(|(b, d)| (b as i64, d)).collect()
    } else {
        let Some(takes) = write_off_takes(&available, delta.saturating_neg()) else { return Ok(Err(state.available)) };
        takes.into_iter().map(|(b, q)| (b, -q)).collect()
    };
    apply_moves(port, tenant, &state.key, request_id, moves, now_ms).await?;
    // The resource row is unchanged; its buckets are read again for the state after.
    complete(port, tenant, state).await.map(Ok)
}

/// Evens out `available` across the buckets of up to `limit` resources whose buckets differ by
/// more than one, with `adjust` entries that sum to zero per resource; returns how many moved.
pub async fn rebalance<P: Port>(port: &mut P, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let mut moved = 0;
    for (tenant, key) in port.uneven_resources(limit).await? {
        let mut moves = rebalance_moves(&availables(port, &tenant, &key).await?);
        if moves.is_empty() {
            continue;
        }
        // Take from the fuller buckets first so no row dips below zero on the way.
        moves.sort_by_key(|&(_, d)| d);
        let request_id = format!("rebalance_{}", ulid::Ulid::new());
        apply_moves(port, &tenant, &key, &request_id, moves, now_ms).await?;
        moved += 1;
    }
    Ok(moved)
}
