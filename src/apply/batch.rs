//! Batch admission: the orders of one group commit decided together against the resource rows
//! the batch read once (under its locks, where several processes write), so that a hot row takes
//! one UPDATE per batch instead of one per order. See [`crate::engine::admission`] for the rules;
//! they are those of the per-order path, and the property test in `tests.rs` holds the two to
//! the same outcomes, ledger rows and final state.
//!
//! Each order still gets its own ledger rows, reservation and idempotency record; each changed
//! row is written once, guarded by the version it was read at. Orders this path cannot decide
//! (limits, creation, buckets, redis mode, a key used twice in the batch, a key it cannot claim
//! in bulk) are left to the per-order path: their slot in the answer is `None`.

use std::collections::{HashMap, HashSet};

use super::events;
use super::orders::{held_reservation, new_reservation, order_response};
use super::port::{BatchWrites, Claim, Counts, LedgerRow, LockedRows, Outcome, Port, RowWrite};
use crate::engine::admission::{self, Row as AdmissionRow};
use crate::engine::OrderStatus;
use crate::events::Stock;
use crate::storage::rules::{new_request_id, reservation_lines};
use crate::storage::{Idempotent, OrderExecution, OrderJob, StorageError};

/// Whether admission may decide this order: no limits or creation, and every target it names
/// that exists is a single-bucket, database-mode row the batch read.
fn eligible(job: &OrderJob, rows: &LockedRows) -> bool {
    let tenant_rows = rows.get(job.tenant.as_str());
    admission::admissible(&job.plan)
        && job
            .plan
            .resources()
            .all(|key| tenant_rows.and_then(|r| r.get(key.as_str())).is_none_or(AdmissionRow::admissible))
}

/// Decides the batch's orders (see the module docs) against `rows`, the resource rows of every
/// order's plan as the batch read them. Runs inside the caller's transaction: on any error
/// nothing of it may stand.
pub async fn admit<P: Port>(
    port: &mut P,
    jobs: &[(&OrderJob, i64)],
    mut rows: LockedRows,
) -> Result<Vec<Option<OrderExecution>>, StorageError> {
    let read_at: HashMap<(String, String), i64> =
        rows.iter().flat_map(|(t, keys)| keys.iter().map(move |(k, r)| ((t.clone(), k.clone()), r.version))).collect();
    let mut seen = HashSet::new();
    let candidates: Vec<usize> = (0..jobs.len())
        .filter(|&i| {
            let (job, _) = jobs[i];
            eligible(job, &rows) && seen.insert((job.tenant.as_str(), job.idempotency.key.as_str()))
        })
        .collect();
    let keys: Vec<_> = candidates.iter().map(|&i| (&jobs[i].0.tenant, &jobs[i].0.idempotency)).collect();
    let now_ms = jobs.iter().map(|(_, at)| *at).max().unwrap_or(0);
    let claims = port.claim_keys(&keys, now_ms).await?;
    if claims.len() != candidates.len() {
        return Err(StorageError::Internal("a batch claim answered a different number of keys".into()));
    }

    let mut out: Vec<Option<OrderExecution>> = vec![None; jobs.len()];
    let mut writes = BatchWrites::default();
    // Each changed row's time: that of the last order that changed it.
    let mut changed_at: HashMap<(String, String), i64> = HashMap::new();
    for (i, claim) in candidates.into_iter().zip(claims) {
        let (job, now_ms) = jobs[i];
        match claim {
            Claim::Ours => {}
            Claim::Answered(previous) => {
                out[i] = Some(OrderExecution { response: previous, outcome: None });
                continue;
            }
            Claim::Unsure => continue,
        }
        let tenant_rows = rows.entry(job.tenant.to_string()).or_default();
        let Some(admitted) = admission::admit(tenant_rows, &job.plan, job.order.action) else {
            return Err(StorageError::Internal("an eligible order was not admissible".into()));
        };
        let request_id = new_request_id();
        let reservation = new_reservation(job, now_ms);
        for change in &admitted.changes {
            changed_at.insert((job.tenant.to_string(), change.resource.clone()), now_ms);
            let [available, reserved, consumed] = change.after;
            let line_key = job
                .plan
                .lines
                .get(change.line)
                .and_then(|p| job.order.lines.get(p.line))
                .map(|l| l.key.to_string())
                .unwrap_or_default();
            writes.ledger.push(LedgerRow {
                tenant: job.tenant.to_string(),
                resource: change.resource.clone(),
                line_key,
                op: change.op,
                qty: change.qty,
                request_id: request_id.clone(),
                order_id: job.order.order_id.to_string(),
                reservation_id: reservation.as_ref().map(|(id, _)| id.clone()),
                after: Counts { available, reserved, consumed, version: change.version_after },
                plugin_version: job.plan.planner.version,
                at: now_ms,
            });
        }
        let mut held = None;
        if admitted.status != OrderStatus::Rejected {
            if let Some((id, expires_at)) = &reservation {
                let lines = reservation_lines(job, &admitted.results, &[]);
                let (row, event) = held_reservation(job, id, *expires_at, lines, now_ms)?;
                held = Some(event);
                writes.reservations.push(row);
            }
        }
        let response = order_response(job, &admitted.results, reservation)?;
        if admitted.status != OrderStatus::Rejected {
            let (tenant, order_id) = (job.tenant.as_str(), job.order.order_id.as_str());
            writes.events.push(events::order_applied_event(tenant, order_id, &response.body, now_ms));
            writes.events.extend(held);
        }
        writes.outcomes.push(Outcome {
            tenant: job.tenant.to_string(),
            key: job.idempotency.key.to_string(),
            request_hash: job.idempotency.request_hash.clone(),
            response: response.clone(),
            at: now_ms,
        });
        out[i] = Some(OrderExecution {
            response: Idempotent::Fresh(response),
            outcome: Some((admitted.status, admitted.results)),
        });
    }
    // The rows the kept changes touched, each written once as admission left it.
    for ((tenant, key), at) in changed_at {
        let (Some(row), Some(&read_version)) =
            (rows.get(&tenant).and_then(|r| r.get(&key)), read_at.get(&(tenant.clone(), key.clone())))
        else {
            return Err(StorageError::Internal(format!("batch admission changed {key}, a row it did not read")));
        };
        let after =
            Counts { available: row.available, reserved: row.reserved, consumed: row.consumed, version: row.version };
        writes.rows.push(RowWrite { tenant, key, after, read_version, at });
    }
    // One global order for the row writes, so two batches never wait on each other in a cycle.
    writes.rows.sort_by(|a, b| (&a.tenant, &a.key).cmp(&(&b.tenant, &b.key)));
    port.write_batch(&writes).await?;
    // Stock events once per changed row, after the batch's orders, judged from the row as the
    // batch left it (no read): within a batch admission only takes stock, so the band a row
    // ends in is the last it passed through.
    for write in &writes.rows {
        if let Some(row) = rows.get(&write.tenant).and_then(|r| r.get(&write.key)) {
            let stock = Stock { available: row.available, low_stock: row.low_stock, band: row.stock };
            events::stock_moved(port, &write.tenant, &write.key, stock, write.at).await?;
        }
    }
    Ok(out)
}
