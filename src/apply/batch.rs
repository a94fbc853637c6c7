//! Batch admission: the orders of one group commit decided together against the resource rows
//! the batch read once (under its locks, where several processes write), so that a hot row takes
//! one UPDATE per batch instead of one per order. See [`crate::engine::admission`] for the rules;
//! they are those of the per-order path, and the property test in `tests.rs` holds the two to
//! the same outcomes, ledger rows and final state.
//!
//! Each order still gets its own ledger rows, reservation and idempotency record; each changed
//! row is written once, guarded by the version it was read at. A bucketed resource's buckets are
//! read with its row and each changed bucket written the same way. Orders this path cannot
//! decide (limits, creation, redis mode, a key used twice in the batch, a key it cannot claim in
//! bulk) are left to the per-order path: their slot in the answer is `None`.

use std::collections::{HashMap, HashSet};

use super::orders::{held_reservation, new_reservation, order_response};
use super::port::{BatchWrites, BucketWrite, Claim, Counts, HeldMove, LedgerRow, LockedRows, Outcome, Port, RowWrite};
use super::{events, reservations};
use crate::engine::admission::{self, Row as AdmissionRow};
use crate::engine::{OrderStatus, Reservation, ReservationState, TenantId};
use crate::events::{NewEvent, Stock, StockBand};
use crate::storage::rules::{bucket_seed, new_request_id, reservation_lines};
use crate::storage::{Idempotent, OrderExecution, OrderJob, StorageError, Transition};

/// A reservation's confirm (`to`: confirmed) or release (`to`: released), queued with a batch.
#[derive(Debug, Clone)]
pub struct MoveJob {
    pub tenant: TenantId,
    pub id: String,
    pub to: ReservationState,
}

/// What admission decided: per order and per move, in the order given; `None` is left to the
/// per-request path.
#[derive(Debug, Default)]
pub struct Decided {
    pub orders: Vec<Option<OrderExecution>>,
    pub moves: Vec<Option<Transition>>,
}

/// Reads the reservations of a batch's moves, locked where several processes write (in one
/// global order, before any resource row), one answer per move. The resources their lines name
/// are read with the batch's other rows (see [`move_resources`]).
pub async fn read_moves<P: Port>(
    port: &mut P,
    moves: &[(&MoveJob, i64)],
) -> Result<Vec<Option<Reservation>>, StorageError> {
    if moves.is_empty() {
        return Ok(Vec::new());
    }
    let wanted: Vec<(&str, &str)> = moves.iter().map(|(m, _)| (m.tenant.as_str(), m.id.as_str())).collect();
    port.lock_reservations(&wanted).await
}

/// The `(tenant, resource)` rows the held reservations among `found` move.
pub fn move_resources<'a>(
    moves: &'a [(&MoveJob, i64)],
    found: &'a [Option<Reservation>],
) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
    moves.iter().zip(found).flat_map(|((m, _), r)| {
        r.iter()
            .filter(|r| r.state == ReservationState::Held)
            .flat_map(move |r| r.lines.iter().map(move |l| (m.tenant.as_str(), l.resource.as_str())))
    })
}

/// Where the batch's rows stand for their stock events: each change is judged against the band
/// the row was in just before it, so the events are those of deciding the batch's writes one
/// after another (as the per-request path emits them), crossings within the batch included.
fn crossings(
    tenant: &str,
    rows: &mut LockedRows,
    keys: impl IntoIterator<Item = String>,
    at: i64,
    out: &mut Vec<NewEvent>,
) {
    let mut keys: Vec<String> = keys.into_iter().collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let Some(row) = rows.get_mut(tenant).and_then(|r| r.get_mut(&key)) else { continue };
        let stock = Stock { available: row.sellable(), low_stock: row.low_stock, band: row.stock };
        if let Some((band, emitted)) = events::stock_events(tenant, &key, stock, at) {
            out.extend(emitted);
            row.stock = band;
        }
    }
}

/// The rows a batch's kept changes touched, each with the time of the last write that changed it.
#[derive(Default)]
struct Touched {
    /// Resource rows, by tenant and key.
    rows: HashMap<(String, String), i64>,
    /// Bucket rows, by tenant, key and bucket.
    buckets: HashMap<(String, String, i64), i64>,
    /// The bucketed resources whose buckets changed.
    bucketed: HashSet<(String, String)>,
}

impl Touched {
    fn note(&mut self, tenant: &str, change: &admission::Change, at: i64) {
        let resource = (tenant.to_owned(), change.resource.clone());
        match change.bucket {
            None => {
                self.rows.insert(resource, at);
            }
            Some(b) => {
                self.buckets.insert((resource.0.clone(), resource.1.clone(), b), at);
                self.bucketed.insert(resource);
            }
        }
    }
}

/// Reads every bucket row of the bucketed, database-mode resources among `rows` into them, so
/// admission can decide their orders. The batch holds their resource rows (locked where several
/// processes write), as every batch that declared them does before it moves their buckets; a
/// bucket that moved meanwhile all the same fails its guarded write, and the batch runs again.
/// A resource whose buckets read back incomplete stays unread: its orders take the per-order
/// path.
async fn read_buckets<P: Port>(port: &mut P, rows: &mut LockedRows) -> Result<(), StorageError> {
    for (tenant, keys) in rows.iter_mut() {
        for (key, row) in keys.iter_mut().filter(|(_, r)| r.buckets > 1 && !r.redis) {
            row.bucket_rows = port.buckets(tenant, key).await?;
            if !row.has_buckets() {
                row.bucket_rows.clear();
            }
        }
    }
    Ok(())
}

/// Whether admission may decide this order: no limits or creation, and every target it names
/// that exists is a database-mode row the batch read (with every bucket, if it has several).
fn eligible(job: &OrderJob, rows: &LockedRows) -> bool {
    let tenant_rows = rows.get(job.tenant.as_str());
    admission::admissible(&job.plan)
        && job
            .plan
            .resources()
            .all(|key| tenant_rows.and_then(|r| r.get(key.as_str())).is_none_or(AdmissionRow::admissible))
}

/// Decides the batch's orders, then its reservation moves (see the module docs), against
/// `rows`: the resource rows of every order's plan and every held reservation's lines, as the
/// batch read them; `found`: each move's reservation as [`read_moves`] read it. Runs inside the
/// caller's transaction: on any error nothing of it may stand.
pub async fn admit<P: Port>(
    port: &mut P,
    jobs: &[(&OrderJob, i64)],
    moves: &[(&MoveJob, i64)],
    found: Vec<Option<Reservation>>,
    mut rows: LockedRows,
) -> Result<Decided, StorageError> {
    if found.len() != moves.len() {
        return Err(StorageError::Internal("a batch read a different number of reservations".into()));
    }
    read_buckets(port, &mut rows).await?;
    // Sized up front: a batch's maps grew by rehashing a few times each (~3 % of a
    // `multi-line` order's instructions on PostgreSQL).
    let locked: usize = rows.values().map(HashMap::len).sum();
    let mut read_at: HashMap<(String, String), (i64, StockBand)> = HashMap::with_capacity(locked);
    read_at.extend(
        rows.iter().flat_map(|(t, keys)| keys.iter().map(move |(k, r)| ((t.clone(), k.clone()), (r.version, r.stock)))),
    );
    let bucket_read_at: HashMap<(String, String, i64), i64> = rows
        .iter()
        .flat_map(|(t, keys)| {
            keys.iter().flat_map(move |(k, r)| {
                r.bucket_rows.iter().map(move |b| ((t.clone(), k.clone(), b.bucket), b.version))
            })
        })
        .collect();
    let mut seen = HashSet::with_capacity(jobs.len());
    let candidates: Vec<usize> = (0..jobs.len())
        .filter(|&i| {
            let (job, _) = jobs[i];
            eligible(job, &rows) && seen.insert((job.tenant.as_str(), job.idempotency.key.as_str()))
        })
        .collect();
    let keys: Vec<_> = candidates.iter().map(|&i| (&jobs[i].0.tenant, &jobs[i].0.idempotency)).collect();
    let now_ms = jobs.iter().map(|(_, at)| *at).max().unwrap_or(0);
    let claims = if keys.is_empty() { Vec::new() } else { port.claim_keys(&keys, now_ms).await? };
    if claims.len() != candidates.len() {
        return Err(StorageError::Internal("a batch claim answered a different number of keys".into()));
    }

    let mut out = Decided { orders: vec![None; jobs.len()], moves: vec![None; moves.len()] };
    let mut writes = BatchWrites::default();
    let mut touched = Touched { rows: HashMap::with_capacity(locked), ..Touched::default() };
    for (i, claim) in candidates.into_iter().zip(claims) {
        let (job, now_ms) = jobs[i];
        match claim {
            Claim::Ours => {}
            Claim::Answered(previous) => {
                out.orders[i] = Some(OrderExecution { response: previous, outcome: None });
                continue;
            }
            Claim::Unsure => continue,
        }
        let tenant_rows = rows.entry(job.tenant.as_str().to_owned()).or_default();
        let seed = bucket_seed(job.tenant.as_str(), job.idempotency.key.as_str());
        let Some(admitted) = admission::admit(tenant_rows, &job.plan, job.order.action, seed) else {
            return Err(StorageError::Internal("an eligible order was not admissible".into()));
        };
        let request_id = new_request_id();
        let reservation = new_reservation(job, now_ms);
        for change in &admitted.changes {
            touched.note(job.tenant.as_str(), change, now_ms);
            let [available, reserved, consumed] = change.after;
            let line_key = job
                .plan
                .lines
                .get(change.line)
                .and_then(|p| job.order.lines.get(p.line))
                .map(|l| l.key.as_str().to_owned())
                .unwrap_or_default();
            writes.ledger.push(LedgerRow {
                tenant: job.tenant.as_str().to_owned(),
                resource: change.resource.clone(),
                bucket: change.bucket.unwrap_or(0),
                line_key,
                limit_key: None,
                op: change.op,
                qty: change.qty,
                request_id: request_id.clone(),
                order_id: job.order.order_id.as_str().to_owned(),
                reservation_id: reservation.as_ref().map(|(id, _)| id.clone()),
                after: Counts { available, reserved, consumed, version: change.version_after },
                plugin_version: Some(job.plan.planner.version),
                at: now_ms,
            });
        }
        let mut held = None;
        if admitted.status != OrderStatus::Rejected {
            if let Some((id, expires_at)) = &reservation {
                let lines = reservation_lines(job, &admitted.results, &admitted.takes);
                let (row, event) = held_reservation(job, id, *expires_at, lines, now_ms)?;
                held = Some(event);
                writes.reservations.push(row);
            }
        }
        let response = order_response(job, &admitted.results, reservation)?;
        let mut event = None;
        if admitted.status != OrderStatus::Rejected {
            let (tenant, order_id) = (job.tenant.as_str(), job.order.order_id.as_str());
            let applied = events::order_applied_event(tenant, order_id, &response.body, now_ms);
            event = Some(applied.id.clone());
            writes.events.push(applied);
            writes.events.extend(held);
            let changed = admitted.changes.iter().map(|c| c.resource.clone());
            crossings(tenant, &mut rows, changed, now_ms, &mut writes.events);
        }
        writes.outcomes.push(Outcome {
            tenant: job.tenant.as_str().to_owned(),
            key: job.idempotency.key.as_str().to_owned(),
            request_hash: job.idempotency.request_hash.clone(),
            response: response.clone(),
            event,
            request_id: Some(request_id),
            at: now_ms,
        });
        out.orders[i] = Some(OrderExecution {
            response: Idempotent::Fresh(response),
            outcome: Some((admitted.status, admitted.results)),
        });
    }
    let mut moved = HashSet::new();
    for (m, ((job, now_ms), reservation)) in moves.iter().zip(found).enumerate() {
        let (tenant, now_ms) = (job.tenant.as_str(), *now_ms);
        // A second move of one reservation in the batch is judged on its own, after this one.
        if !moved.insert((tenant, job.id.as_str())) {
            continue;
        }
        let Some(mut reservation) = reservation else {
            out.moves[m] = Some(Transition::NotFound);
            continue;
        };
        reservations::requested(job.to)?;
        let Some(to) = reservations::move_to(&reservation, job.to, now_ms) else {
            out.moves[m] = Some(reservations::unmoved(reservation, job.to));
            continue;
        };
        let (op, _) = reservations::move_op(to)?;
        let Some(tenant_rows) = rows.get_mut(tenant) else { continue };
        let Some(changes) = admission::move_held(tenant_rows, &reservation.lines, op) else { continue };
        for change in &changes {
            touched.note(tenant, change, now_ms);
            let line = &reservation.lines[change.line];
            let [available, reserved, consumed] = change.after;
            writes.ledger.push(LedgerRow {
                tenant: tenant.to_string(),
                resource: change.resource.clone(),
                bucket: change.bucket.unwrap_or(0),
                line_key: line.key.clone(),
                limit_key: line.limit_key.clone(),
                op,
                qty: change.qty,
                request_id: reservation.id.clone(),
                order_id: reservation.order_id.clone(),
                reservation_id: Some(reservation.id.clone()),
                after: Counts { available, reserved, consumed, version: change.version_after },
                plugin_version: None,
                at: now_ms,
            });
        }
        writes.moves.push(HeldMove { tenant: tenant.to_string(), id: reservation.id.clone(), to, at: now_ms });
        metrics::counter!("stockd_moves_admitted_in_batch_total").increment(1);
        reservation.state = to;
        writes.events.push(events::reservation_event(tenant, &reservation, now_ms));
        let changed = changes.iter().map(|c| c.resource.clone());
        crossings(tenant, &mut rows, changed, now_ms, &mut writes.events);
        out.moves[m] = Some(reservations::moved(reservation, job.to));
    }
    // A bucketed resource's own row changes only when its stock band moved (its counters are
    // its buckets'); it is then written with its counters, version and time as read, as the
    // per-order path sets only its band.
    for (tenant, key) in touched.bucketed {
        let (Some(row), Some(&(read_version, read_band))) =
            (rows.get(&tenant).and_then(|r| r.get(&key)), read_at.get(&(tenant.clone(), key.clone())))
        else {
            return Err(StorageError::Internal(format!("batch admission changed {key}, a row it did not read")));
        };
        if row.stock != read_band {
            let after = Counts {
                available: row.available,
                reserved: row.reserved,
                consumed: row.consumed,
                version: row.version,
            };
            writes.rows.push(RowWrite { tenant, key, after, read_version, stock: Some(row.stock), at: None });
        }
    }
    for ((tenant, key, bucket), at) in touched.buckets {
        let found = rows
            .get(&tenant)
            .and_then(|r| r.get(&key))
            .and_then(|r| r.bucket_rows.get(usize::try_from(bucket).unwrap_or(usize::MAX)));
        let (Some(b), Some(&read_version)) = (found, bucket_read_at.get(&(tenant.clone(), key.clone(), bucket))) else {
            return Err(StorageError::Internal(format!("batch admission changed bucket {bucket} of {key}, unread")));
        };
        let after = Counts { available: b.available, reserved: b.reserved, consumed: b.consumed, version: b.version };
        writes.buckets.push(BucketWrite { tenant, key, bucket, after, read_version, at });
    }
    writes.buckets.sort_by(|a, b| (&a.tenant, &a.key, a.bucket).cmp(&(&b.tenant, &b.key, b.bucket)));
    // The rows the kept changes touched, each written once as admission left it.
    for (changed, at) in touched.rows {
        let (Some(row), Some(&(read_version, read_band))) =
            (rows.get(&changed.0).and_then(|r| r.get(&changed.1)), read_at.get(&changed))
        else {
            return Err(StorageError::Internal(format!(
                "batch admission changed {}, a row it did not read",
                changed.1
            )));
        };
        let (tenant, key) = changed;
        let after =
            Counts { available: row.available, reserved: row.reserved, consumed: row.consumed, version: row.version };
        let stock = (row.stock != read_band).then_some(row.stock);
        writes.rows.push(RowWrite { tenant, key, after, read_version, stock, at: Some(at) });
    }
    // One global order for the row writes, so two batches never wait on each other in a cycle.
    writes.rows.sort_by(|a, b| (&a.tenant, &a.key).cmp(&(&b.tenant, &b.key)));
    port.write_batch(&writes).await?;
    Ok(out)
}
