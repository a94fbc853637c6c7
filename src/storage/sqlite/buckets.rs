//! Bucketed resources on SQLite: creation, deductions and reservations that fall back across
//! buckets, adjustments, and the rebalancer. Every change is still one guarded UPDATE of one
//! bucket row judged by the row it returns, with its ledger row (carrying the bucket).

use rusqlite::{params, Connection, OptionalExtension};

use super::ops::{append_ledger, corrupt, After, LedgerFacts};
use crate::engine::{BucketCounts, BucketTake, LedgerOp, Reason, ResourceState, Target, TenantId, MAX_TOTAL};
use crate::storage::rules::{
    bucket_order, bucket_takes, new_request_id, rebalance_moves, split_evenly, write_off_takes,
};
use crate::storage::{NewResource, StorageError};

/// Every bucket's counters, in bucket order.
pub fn load_buckets(conn: &Connection, tenant: &str, key: &str) -> Result<Vec<BucketCounts>, StorageError> {
    Ok(conn
        .prepare_cached(
            "SELECT bucket, available, reserved, consumed, version, updated_at FROM resource_buckets
             WHERE tenant_id = ?1 AND resource_key = ?2 ORDER BY bucket",
        )?
        .query_map(params![tenant, key], |row| {
            Ok(BucketCounts {
                bucket: row.get(0)?,
                available: row.get(1)?,
                reserved: row.get(2)?,
                consumed: row.get(3)?,
                version: row.get(4)?,
                updated_at_ms: row.get(5)?,
            })
        })?
        .collect::<rusqlite::Result<_>>()?)
}

/// A resource's state with a bucketed resource's totals folded in from its buckets.
pub fn complete(conn: &Connection, tenant: &str, mut state: ResourceState) -> Result<ResourceState, StorageError> {
    if state.buckets > 1 {
        let buckets = load_buckets(conn, tenant, &state.key)?;
        state.fold_buckets(buckets);
    }
    Ok(state)
}

fn availables(conn: &Connection, tenant: &str, key: &str) -> Result<Vec<i64>, StorageError> {
    Ok(load_buckets(conn, tenant, key)?.into_iter().map(|b| b.available).collect())
}

/// Creates the bucket rows of a resource whose row was just inserted, each with its share of
/// `res.total` and its own `create` ledger entry.
pub fn create_buckets(
    conn: &Connection,
    tenant: &TenantId,
    res: &NewResource,
    plugin_version: Option<i64>,
    now_ms: i64,
) -> Result<(), StorageError> {
    for (bucket, share) in split_evenly(res.total, res.buckets).into_iter().enumerate() {
        let after = conn
            .prepare_cached(
                "INSERT INTO resource_buckets (tenant_id, resource_key, bucket, total, available, reserved, consumed,
                                               version, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?4, 0, 0, 1, ?5)
                 RETURNING available, reserved, consumed, version",
            )?
            .query_row(params![tenant.as_str(), res.key.as_str(), bucket as i64, share, now_ms], After::from_row)?;
        let facts = LedgerFacts {
            tenant: tenant.as_str(),
            resource: res.key.as_str(),
            bucket: bucket as i64,
            op: LedgerOp::Create,
            qty: share,
            request_id: "create",
            order_id: None,
            reservation_id: None,
            plugin_version,
            now_ms,
        };
        append_ledger(conn, facts, after)?;
    }
    Ok(())
}

/// How one bucket row changes: the counter a quantity leaves and the one it enters.
#[derive(Debug, Clone, Copy)]
pub enum Move {
    Deduct,
    Reserve,
    Confirm,
    Unreserve,
    /// Restock (+) or write-off (−): `available` and `total` by the signed quantity.
    Adjust,
}

impl Move {
    fn sql(self) -> &'static str {
        macro_rules! bucket_move {
            ($set:literal, $guard:literal) => {
                concat!(
                    "UPDATE resource_buckets SET ",
                    $set,
                    ", version = version + 1, updated_at = ?2
                     WHERE tenant_id = ?3 AND resource_key = ?4 AND bucket = ?5 AND ",
                    $guard,
                    " RETURNING available, reserved, consumed, version"
                )
            };
        }
        match self {
            Move::Deduct => bucket_move!("available = available - ?1, consumed = consumed + ?1", "available >= ?1"),
            Move::Reserve => bucket_move!("available = available - ?1, reserved = reserved + ?1", "available >= ?1"),
            Move::Confirm => bucket_move!("reserved = reserved - ?1, consumed = consumed + ?1", "reserved >= ?1"),
            Move::Unreserve => bucket_move!("reserved = reserved - ?1, available = available + ?1", "reserved >= ?1"),
            Move::Adjust => bucket_move!("available = available + ?1, total = total + ?1", "available + ?1 >= 0"),
        }
    }
}

/// What the ledger rows of a bucket change record besides the bucket, quantity and counters.
pub struct BucketFacts<'a> {
    pub tenant: &'a str,
    pub resource: &'a str,
    pub op: LedgerOp,
    pub request_id: &'a str,
    pub order_id: Option<&'a str>,
    pub reservation_id: Option<&'a str>,
    pub plugin_version: Option<i64>,
    pub now_ms: i64,
}

/// One guarded UPDATE of one bucket and its ledger row; `false`: the guard refused, nothing changed.
pub fn move_bucket(
    conn: &Connection,
    facts: &BucketFacts<'_>,
    how: Move,
    bucket: i64,
    qty: i64,
) -> Result<bool, StorageError> {
    let after = conn
        .prepare_cached(how.sql())?
        .query_row(params![qty, facts.now_ms, facts.tenant, facts.resource, bucket], After::from_row)
        .optional()?;
    let Some(after) = after else { return Ok(false) };
    let ledger = LedgerFacts {
        tenant: facts.tenant,
        resource: facts.resource,
        bucket,
        op: facts.op,
        qty,
        request_id: facts.request_id,
        order_id: facts.order_id,
        reservation_id: facts.reservation_id,
        plugin_version: facts.plugin_version,
        now_ms: facts.now_ms,
    };
    append_ledger(conn, ledger, after)?;
    Ok(true)
}

/// Takes `qty` from a bucketed resource of `n` buckets for a deduction or reservation: the
/// plan's bucket order (or the seed's rotation) picks the first bucket; when no single bucket
/// covers it, it is taken from several, so the line is refused only if the total cannot cover
/// it. The caller has checked the resource's status and kind.
pub fn take(
    conn: &Connection,
    facts: &BucketFacts<'_>,
    how: Move,
    target: &Target,
    n: i64,
    seed: u64,
    qty: i64,
) -> Result<Result<Vec<BucketTake>, Reason>, StorageError> {
    let order = bucket_order(&target.buckets, n, seed).map_err(StorageError::PlanRefused)?;
    // Most of the time the first bucket covers the line: one statement, no read.
    if let Some(&first) = order.first() {
        if move_bucket(conn, facts, how, first, qty)? {
            return Ok(Ok(vec![BucketTake { bucket: first, qty }]));
        }
    }
    let available = availables(conn, facts.tenant, facts.resource)?;
    let Some(takes) = bucket_takes(&order, &available, qty) else { return Ok(Err(Reason::Insufficient)) };
    for &(bucket, qty) in &takes {
        if !move_bucket(conn, facts, how, bucket, qty)? {
            // This connection is the only writer: a bucket cannot change between the read and here.
            return Err(StorageError::Internal(format!(
                "bucket {bucket} of {} changed under the writer",
                facts.resource
            )));
        }
    }
    Ok(Ok(takes.into_iter().map(|(bucket, qty)| BucketTake { bucket, qty }).collect()))
}

/// A restock (spread evenly) or write-off (fullest buckets first) of a bucketed resource.
/// `Err(available)`: a write-off larger than the available total, or a restock past the largest
/// total; nothing changed. The state after, otherwise.
pub fn adjust(
    conn: &Connection,
    tenant: &TenantId,
    state: ResourceState,
    delta: i64,
    now_ms: i64,
) -> Result<Result<ResourceState, i64>, StorageError> {
    let state = complete(conn, tenant.as_str(), state)?;
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
    let request_id = new_request_id();
    let facts = BucketFacts {
        tenant: tenant.as_str(),
        resource: &state.key,
        op: LedgerOp::Adjust,
        request_id: &request_id,
        order_id: None,
        reservation_id: None,
        plugin_version: None,
        now_ms,
    };
    for (bucket, d) in moves.into_iter().filter(|(_, d)| *d != 0) {
        if !move_bucket(conn, &facts, Move::Adjust, bucket, d)? {
            return Err(StorageError::Internal(format!("bucket {bucket} of {} changed under the writer", state.key)));
        }
    }
    // The resource row is unchanged; its buckets are read again for the state after.
    complete(conn, tenant.as_str(), state).map(Ok)
}

/// Evens out `available` across the buckets of up to `limit` resources whose buckets differ by
/// more than one, with `adjust` entries that sum to zero per resource; returns how many moved.
pub fn rebalance(conn: &Connection, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let uneven: Vec<(String, String)> = conn
        .prepare_cached(
            "SELECT b.tenant_id, b.resource_key FROM resource_buckets b
             JOIN resources r ON r.tenant_id = b.tenant_id AND r.key = b.resource_key
             WHERE r.buckets > 1
             GROUP BY b.tenant_id, b.resource_key HAVING MAX(b.available) - MIN(b.available) > 1
             LIMIT ?1",
        )?
        .query_map(params![i64::from(limit)], |row| Ok((row.get(0)?, row.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let mut moved = 0;
    for (tenant, key) in uneven {
        let available = availables(conn, &tenant, &key)?;
        let moves = rebalance_moves(&available);
        if moves.is_empty() {
            continue;
        }
        let request_id = format!("rebalance_{}", ulid::Ulid::new());
        let facts = BucketFacts {
            tenant: &tenant,
            resource: &key,
            op: LedgerOp::Adjust,
            request_id: &request_id,
            order_id: None,
            reservation_id: None,
            plugin_version: None,
            now_ms,
        };
        // Take from the fuller buckets first so no row dips below zero on the way.
        let mut moves = moves;
        moves.sort_by_key(|&(_, d)| d);
        for (bucket, d) in moves {
            if !move_bucket(conn, &facts, Move::Adjust, bucket, d)? {
                return Err(corrupt("resource_buckets"));
            }
        }
        moved += 1;
    }
    Ok(moved)
}
