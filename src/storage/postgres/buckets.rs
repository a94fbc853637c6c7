//! Bucketed resources on PostgreSQL, mirroring [`crate::storage::sqlite::buckets`]: creation,
//! deductions and reservations that fall back across buckets, adjustments, the rebalancer.
//! Every change is one guarded UPDATE of one bucket row and its ledger row in one statement.
//!
//! Several processes may write: a deduction, reservation or adjustment of a bucketed resource
//! runs while its batch holds the resource row's lock (the batch's declared rows), and the
//! rebalancer takes that lock too, so the buckets' `available` read to plan a split cannot
//! shrink before the split's guarded UPDATEs. Reservation transitions only ever raise a
//! bucket's available or leave it alone. Should a guard refuse anyway, the batch is retried.

use sqlx::{PgConnection, Row};

use crate::engine::{BucketCounts, BucketTake, LedgerOp, Reason, ResourceState, Target, TenantId, MAX_TOTAL};
use crate::storage::rules::{
    bucket_order, bucket_rows, bucket_takes, new_request_id, rebalance_moves, split_evenly, write_off_takes,
    BUCKET_COLUMNS,
};
use crate::storage::{NewResource, StorageError};

/// Every bucket's counters, in bucket order.
pub async fn load_buckets(conn: &mut PgConnection, tenant: &str, key: &str) -> Result<Vec<BucketCounts>, StorageError> {
    let rows = sqlx::query(&format!(
        "SELECT {BUCKET_COLUMNS} FROM resource_buckets WHERE tenant_id = $1 AND resource_key = $2 ORDER BY bucket"
    ))
    .bind(tenant)
    .bind(key)
    .fetch_all(&mut *conn)
    .await?;
    Ok(bucket_rows(&rows)?.into_values().next().unwrap_or_default())
}

/// A resource's state with a bucketed resource's totals folded in from its buckets.
pub async fn complete(
    conn: &mut PgConnection,
    tenant: &str,
    mut state: ResourceState,
) -> Result<ResourceState, StorageError> {
    if state.buckets > 1 {
        let buckets = load_buckets(conn, tenant, &state.key).await?;
        state.fold_buckets(buckets);
    }
    Ok(state)
}

/// Creates the bucket rows of a resource whose row was just inserted, each with its share of
/// `res.total` and its own `create` ledger entry.
pub async fn create_buckets(
    conn: &mut PgConnection,
    tenant: &TenantId,
    res: &NewResource,
    plugin_version: Option<i64>,
    now_ms: i64,
) -> Result<(), StorageError> {
    let shares = split_evenly(res.total, res.buckets);
    let buckets: Vec<i64> = (0..shares.len() as i64).collect();
    sqlx::query(
        "WITH created AS (
            INSERT INTO resource_buckets (tenant_id, resource_key, bucket, total, available, reserved, consumed,
                                          version, updated_at)
            SELECT $1, $2, b, s, s, 0, 0, 1, $5 FROM UNNEST($3::bigint[], $4::bigint[]) AS t (b, s)
            RETURNING bucket, total)
         INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
                             available_after, reserved_after, consumed_after, version_after, plugin_version, at)
         SELECT $1, $2, bucket, 'create', total, 'create', NULL, NULL, total, 0, 0, 1, $6, $5 FROM created
         ORDER BY bucket",
    )
    .bind(tenant.as_str())
    .bind(res.key.as_str())
    .bind(&buckets)
    .bind(&shares)
    .bind(now_ms)
    .bind(plugin_version)
    .execute(&mut *conn)
    .await?;
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
    /// The guarded UPDATE of one bucket and its ledger row, in one statement: the INSERT reads
    /// the UPDATE's RETURNING, so a row is written exactly when the guard let the change through.
    fn sql(self) -> &'static str {
        macro_rules! bucket_move {
            ($set:literal, $guard:literal) => {
                concat!(
                    "WITH changed AS (
                        UPDATE resource_buckets SET ",
                    $set,
                    ", version = version + 1, updated_at = $2
                        WHERE tenant_id = $3 AND resource_key = $4 AND bucket = $5 AND ",
                    $guard,
                    " RETURNING available, reserved, consumed, version)
                     INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, order_id,
                                         reservation_id, available_after, reserved_after, consumed_after,
                                         version_after, plugin_version, at)
                     SELECT $3, $4, $5, $6, $1, $7, $8, $9, available, reserved, consumed, version, $10, $2
                     FROM changed RETURNING seq"
                )
            };
        }
        match self {
            Move::Deduct => bucket_move!("available = available - $1, consumed = consumed + $1", "available >= $1"),
            Move::Reserve => bucket_move!("available = available - $1, reserved = reserved + $1", "available >= $1"),
            Move::Confirm => bucket_move!("reserved = reserved - $1, consumed = consumed + $1", "reserved >= $1"),
            Move::Unreserve => bucket_move!("reserved = reserved - $1, available = available + $1", "reserved >= $1"),
            Move::Adjust => bucket_move!("available = available + $1, total = total + $1", "available + $1 >= 0"),
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

/// One guarded UPDATE of one bucket with its ledger row; `false`: the guard refused, nothing changed.
pub async fn move_bucket(
    conn: &mut PgConnection,
    facts: &BucketFacts<'_>,
    how: Move,
    bucket: i64,
    qty: i64,
) -> Result<bool, StorageError> {
    let row = sqlx::query(how.sql())
        .bind(qty)
        .bind(facts.now_ms)
        .bind(facts.tenant)
        .bind(facts.resource)
        .bind(bucket)
        .bind(facts.op.as_str())
        .bind(facts.request_id)
        .bind(facts.order_id)
        .bind(facts.reservation_id)
        .bind(facts.plugin_version)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(row.is_some())
}

/// A guard that refused after the buckets were read: something moved them meanwhile. Nothing is
/// judged on a stale read; the batch runs again.
fn moved_meanwhile(resource: &str, bucket: i64) -> StorageError {
    StorageError::Unavailable(format!("bucket {bucket} of {resource} changed meanwhile"))
}

/// Takes `qty` from a bucketed resource of `n` buckets for a deduction or reservation (see the
/// SQLite twin). The caller has checked the resource's status and kind.
#[allow(clippy::too_many_arguments)]
pub async fn take(
    conn: &mut PgConnection,
    facts: &BucketFacts<'_>,
    how: Move,
    target: &Target,
    n: i64,
    seed: u64,
    qty: i64,
) -> Result<Result<Vec<BucketTake>, Reason>, StorageError> {
    let order = bucket_order(&target.buckets, n, seed).map_err(StorageError::PlanRefused)?;
    if let Some(&first) = order.first() {
        if move_bucket(conn, facts, how, first, qty).await? {
            return Ok(Ok(vec![BucketTake { bucket: first, qty }]));
        }
    }
    let available: Vec<i64> =
        load_buckets(conn, facts.tenant, facts.resource).await?.into_iter().map(|b| b.available).collect();
    let Some(takes) = bucket_takes(&order, &available, qty) else { return Ok(Err(Reason::Insufficient)) };
    for &(bucket, qty) in &takes {
        if !move_bucket(conn, facts, how, bucket, qty).await? {
            return Err(moved_meanwhile(facts.resource, bucket));
        }
    }
    Ok(Ok(takes.into_iter().map(|(bucket, qty)| BucketTake { bucket, qty }).collect()))
}

/// A restock (spread evenly) or write-off (fullest buckets first) of a bucketed resource.
/// `Err(available)`: a write-off larger than the available total, or a restock past the largest
/// total; nothing changed. The state after, otherwise.
pub async fn adjust(
    conn: &mut PgConnection,
    tenant: &TenantId,
    state: ResourceState,
    delta: i64,
    now_ms: i64,
) -> Result<Result<ResourceState, i64>, StorageError> {
    let state = complete(conn, tenant.as_str(), state).await?;
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
        if !move_bucket(conn, &facts, Move::Adjust, bucket, d).await? {
            return Err(moved_meanwhile(&state.key, bucket));
        }
    }
    // The resource row is unchanged; its buckets are read again for the state after.
    complete(conn, tenant.as_str(), state).await.map(Ok)
}

/// Evens out `available` across the buckets of up to `limit` resources whose buckets differ by
/// more than one; returns how many moved. Each resource row is locked first, in the batches'
/// global order, so no batch deducts from its buckets meanwhile.
pub async fn rebalance(conn: &mut PgConnection, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let uneven = sqlx::query(
        "SELECT r.tenant_id, r.key FROM resources r
         WHERE r.buckets > 1 AND EXISTS (
             SELECT 1 FROM resource_buckets b WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.key
             GROUP BY b.tenant_id, b.resource_key HAVING MAX(b.available) - MIN(b.available) > 1)
         ORDER BY r.tenant_id COLLATE \"C\", r.key COLLATE \"C\"
         LIMIT $1
         FOR UPDATE OF r SKIP LOCKED",
    )
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    let mut moved = 0;
    for row in uneven {
        let (tenant, key): (String, String) = (row.try_get("tenant_id")?, row.try_get("key")?);
        let available: Vec<i64> = load_buckets(conn, &tenant, &key).await?.into_iter().map(|b| b.available).collect();
        let mut moves = rebalance_moves(&available);
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
        moves.sort_by_key(|&(_, d)| d);
        for (bucket, d) in moves {
            if !move_bucket(conn, &facts, Move::Adjust, bucket, d).await? {
                return Err(moved_meanwhile(&key, bucket));
            }
        }
        moved += 1;
    }
    Ok(moved)
}
