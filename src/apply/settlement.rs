//! Settlement: one sale (or reservation move) Redis acknowledged, applied to the database exactly
//! once whatever the number of deliveries. Its request id is claimed first (a second consumer
//! of a reclaimed entry finds it taken); the change is the database path's guarded change
//! without the order gate (the sale happened in Redis while the resource was active, so only the
//! counters may refuse it), with its ledger row; what the database refuses is recorded as a
//! settlement failure for the tenant to compensate; the client's answer is stored so a replay
//! finds it after Redis forgot it.
//!
//! A run of deductions read together from one stream is settled as one write
//! ([`settle_run`]): decided record by record exactly as [`settle`] decides each, with the
//! resource row read and written once and each kind of row written in one statement where the
//! backend can.

use std::collections::{BTreeMap, HashSet};

use serde_json::json;

use super::events;
use super::port::{
    BatchWrites, Change, Counts, Entry, Gate, LedgerRow, Move, NewReservation, Outcome, Port, Row, RowWrite, Savepoint,
};
use super::reversals::{self, Shortfall};
use crate::engine::reversal::{BucketReversal, LineReversal};
use crate::engine::{LedgerOp, Reservation, ReservationState};
use crate::events::{order_key, resource_key, EventType, NewEvent, Stock};
use crate::storage::redis_store::{move_target, SettleRecord, Settled};
use crate::storage::{ContentType, StorageError, StoredResponse};

/// Applies one record (see the module docs).
pub async fn settle<P: Port>(port: &mut P, r: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
    if !port.claim_settlement(&r.t, &r.k, &r.rid, now_ms).await? {
        return Ok(Settled::Duplicate);
    }
    if r.op() == "refuse" {
        // Nothing changed in Redis's stock: only the client's answer is kept.
        let answer =
            StoredResponse { status: r.c.unwrap_or(409), content_type: ContentType::Json, body: r.body.clone() };
        port.store_outcome_if_absent(&r.t, &r.idem, &r.h, &answer, None, r.at).await?;
        return Ok(Settled::Answered);
    }
    if r.op() == "reverse" {
        return settle_reverse(port, r, now_ms).await;
    }
    match move_target(r.op()) {
        Some((to, op)) => settle_move(port, r, to, op, now_ms).await,
        None => settle_take(port, r, now_ms).await,
    }
}

/// A reversal Redis made: the database path's give-back (the order line's guarded count, the
/// `reverse` change and ledger entry, the limit), without the mode gate; what it refuses is a
/// settlement failure. Its answer is stored, and `order.reversed` emitted, with it.
async fn settle_reverse<P: Port>(port: &mut P, r: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
    let line = LineReversal {
        key: r.lk.clone().unwrap_or_else(|| r.k.clone()),
        resource: r.k.clone(),
        qty: r.q,
        limit_key: r.lim.clone(),
        reverses: r.rv.clone().unwrap_or_default(),
        bucketed: false,
        takes: vec![BucketReversal { bucket: 0, qty: r.q, taken: r.tk.unwrap_or(0) }],
    };
    port.savepoint(Savepoint::Lines).await?;
    let given = reversals::give_back(port, &r.t, &r.oid, &r.rid, &line, true, now_ms).await?;
    let settled = match given {
        Ok(()) => {
            port.release(Savepoint::Lines).await?;
            Settled::Applied
        }
        Err(shortfall) => {
            port.rollback_to(Savepoint::Lines).await?;
            port.release(Savepoint::Lines).await?;
            let reason = match shortfall {
                Shortfall::Reversed => "exceeds_reversible",
                Shortfall::Consumed => "insufficient",
            };
            refused(port, r, r.q, reason, now_ms).await?
        }
    };
    // The client's answer, so a replay finds it after Redis forgot it.
    let answer = StoredResponse { status: 201, content_type: ContentType::Json, body: r.body.clone() };
    let stored = port.store_outcome_if_absent(&r.t, &r.idem, &r.h, &answer, None, r.at).await?;
    if settled == Settled::Applied {
        if stored {
            let event = NewEvent::raw(&r.t, EventType::OrderReversed, order_key(&r.oid), now_ms, r.body.clone());
            port.emit(&event).await?;
        }
        events::observe_stock(port, &r.t, &r.k, now_ms).await?;
    }
    Ok(settled)
}

/// Records a sale the database refused, with the resource's available stock then.
async fn refused<P: Port>(
    port: &mut P,
    r: &SettleRecord,
    qty: i64,
    reason: &str,
    now_ms: i64,
) -> Result<Settled, StorageError> {
    let available = port.view(&r.t, &r.k).await?.map_or(0, |v| v.available);
    port.record_settlement_failure(r, qty, reason, available, now_ms).await?;
    port.emit(&failed_event(r, qty, reason, available, now_ms)).await?;
    Ok(Settled::Refused)
}

/// `settlement.failed` for a sale the database refused.
fn failed_event(r: &SettleRecord, qty: i64, reason: &str, available: i64, now_ms: i64) -> NewEvent {
    let data = json!({
        "key": r.k,
        "op": r.op(),
        "qty": qty,
        "reason": reason,
        "available": available,
        "order_id": r.oid,
        "reservation_id": r.rsv,
        "request_id": r.rid,
    });
    NewEvent::new(&r.t, EventType::SettlementFailed, resource_key(&r.k), now_ms, &data)
}

/// A deduction or a reservation Redis acknowledged.
async fn settle_take<P: Port>(port: &mut P, r: &SettleRecord, now_ms: i64) -> Result<Settled, StorageError> {
    let reserve = r.op() == "reserve";
    let entry = Entry {
        tenant: &r.t,
        resource: &r.k,
        bucket: 0,
        op: if reserve { LedgerOp::Reserve } else { LedgerOp::Deduct },
        qty: r.q,
        request_id: &r.rid,
        order_id: Some(&r.oid),
        reservation_id: r.rsv.as_deref(),
        plugin_version: Some(r.pv),
        at: now_ms,
        line_key: r.lk.as_deref(),
        limit_key: r.lim.as_deref(),
        reverses: None,
    };
    let how = if reserve { Move::Reserve } else { Move::Deduct };
    let change = Change { row: Row::Resource, how, gate: Gate::Counters, entry };
    let mut held = None;
    let settled = if port.change(&change).await?.is_some() {
        if let (true, Some(id)) = (reserve, &r.rsv) {
            let reservation = NewReservation {
                tenant: r.t.clone(),
                id: id.clone(),
                order_id: r.oid.clone(),
                lines: r.lines.clone().unwrap_or_else(|| "[]".into()),
                expires_at: r.exp.unwrap_or(now_ms),
                created_at: r.at,
            };
            port.insert_reservation(&reservation).await?;
            // The lines as Redis recorded them, read back for the event.
            let lines = serde_json::from_str(&reservation.lines)
                .map_err(|e| StorageError::Internal(format!("reservation lines: {e}")))?;
            held = Some(events::held_event(&reservation, lines, now_ms));
        }
        if let Some(limit) = &r.lim {
            // Redis enforced the limit; the database keeps the count for the record.
            port.count_limit(&r.t, limit, r.q).await?;
        }
        Settled::Applied
    } else {
        let exists = port.view(&r.t, &r.k).await?.is_some();
        refused(port, r, r.q, if exists { "insufficient" } else { "resource_not_found" }, now_ms).await?
    };
    // The client's answer, so a replay finds it even after Redis forgot it.
    let answer = StoredResponse { status: 201, content_type: ContentType::Json, body: r.body.clone() };
    // The first of the order's lines to settle stores its answer, and emits its event (whose
    // payload the record then points at).
    let applied = events::order_applied_event(&r.t, &r.oid, &r.body, now_ms);
    if port.store_outcome_if_absent(&r.t, &r.idem, &r.h, &answer, Some(&applied.id), r.at).await? {
        port.emit(&applied).await?;
    }
    if let Some(held) = held {
        port.emit(&held).await?;
    }
    if settled == Settled::Applied {
        events::observe_stock(port, &r.t, &r.k, now_ms).await?;
    }
    Ok(settled)
}

/// A confirm, release or expiry of a reservation made in Redis. Its row must be settled first
/// (an error otherwise: the entry stays pending and is tried again).
async fn settle_move<P: Port>(
    port: &mut P,
    r: &SettleRecord,
    to: ReservationState,
    op: LedgerOp,
    now_ms: i64,
) -> Result<Settled, StorageError> {
    let id = r.rsv.as_deref().ok_or_else(|| StorageError::Internal("a reservation move without its id".into()))?;
    // Read again after a lost race: the winner's state decides.
    for _ in 0..2 {
        let Some(reservation) = port.reservation(&r.t, id).await? else {
            // Its reserve was refused: the move is a failure of its own, settled (so the
            // backlog drains), for the tenant to compensate with the reserve's.
            if let Some(qty) = port.refused_reservation(&r.t, id).await? {
                return refused(port, r, qty, "reservation_refused", now_ms).await;
            }
            // Not yet settled (another consumer holds its reserve): tried again once idle.
            return Err(StorageError::Internal(format!("reservation {id} is not settled yet")));
        };
        let qty: i64 = reservation.lines.iter().map(|l| l.qty).sum();
        if reservation.state != ReservationState::Held {
            // A release Redis made just before the deadline, settled after the sweeper
            // expired the row: both gave the stock and the limit back, once.
            if reservation.state == to || (gives_back(to) && gives_back(reservation.state)) {
                return Ok(Settled::Duplicate);
            }
            return refused(port, r, qty, &format!("reservation_{}", reservation.state.as_str()), now_ms).await;
        }
        if !port.leave_held(&r.t, id, to, now_ms).await? {
            continue;
        }
        let entry = Entry {
            tenant: &r.t,
            resource: &r.k,
            bucket: 0,
            op,
            qty,
            request_id: id,
            order_id: Some(&r.oid),
            reservation_id: Some(id),
            plugin_version: None,
            at: now_ms,
            line_key: reservation.lines.first().map(|l| l.key.as_str()),
            limit_key: r.lim.as_deref(),
            reverses: None,
        };
        let (_, how) = super::reservations::move_op(to)?;
        if port.change(&Change { row: Row::Resource, how, gate: Gate::Counters, entry }).await?.is_none() {
            return Err(StorageError::Internal(format!("resource of reservation {id} holds less than reserved")));
        }
        if let (Some(limit), false) = (&r.lim, to == ReservationState::Confirmed) {
            port.give_back_limit(&r.t, limit, qty).await?;
        }
        let moved = Reservation { state: to, ..reservation };
        port.emit(&events::reservation_event(&r.t, &moved, now_ms)).await?;
        if to != ReservationState::Confirmed {
            events::observe_stock(port, &r.t, &r.k, now_ms).await?;
        }
        return Ok(Settled::Applied);
    }
    Err(StorageError::Internal(format!("reservation {id} left held twice")))
}

/// Whether leaving `held` for `state` gives the reservation's stock back.
fn gives_back(state: ReservationState) -> bool {
    matches!(super::reservations::move_op(state), Ok((_, Move::Unreserve)))
}

/// Whether a record may be settled in a run with others ([`settle_run`]): a deduction that
/// names its order line (records of earlier versions do not, and their ledger rows keep none).
pub fn runs_together(r: &SettleRecord) -> bool {
    r.op() == "deduct" && r.rsv.is_none() && r.lk.is_some()
}

/// What one record of a run decided, for the events written in stream order once the run's
/// answers are stored.
struct Decided {
    settled: Settled,
    /// A refusal's `settlement.failed`, emitted before the order's event.
    failed: Option<NewEvent>,
    /// The `order.applied` its answer points at, emitted if the answer was stored now.
    applied: Option<NewEvent>,
    /// The stock events of its change.
    stock: Vec<NewEvent>,
}

/// Settles a run of deductions of one resource, in stream order (each [`runs_together`]), as
/// one write, with the outcomes, rows and events [`settle`] gives them one by one (the property
/// test in `settlement_tests.rs` holds the two alike): the request ids claimed in one statement,
/// the resource row read once, each record decided against the counters the ones before it
/// left, then the answers stored in one statement and the row, ledger rows and events written
/// as batch admission writes them. A missing or bucketed resource (neither is a redis-mode
/// resource settlement expects) settles each record with [`settle`].
pub async fn settle_run<P: Port>(
    port: &mut P,
    records: &[SettleRecord],
    now_ms: i64,
) -> Result<Vec<Settled>, StorageError> {
    let Some(first) = records.first() else { return Ok(Vec::new()) };
    let (tenant, key) = (first.t.as_str(), first.k.as_str());
    if records.iter().any(|r| r.t != tenant || r.k != key || !runs_together(r)) {
        return Err(StorageError::Internal("a settlement run mixes resources or kinds of record".into()));
    }
    let (row, stock) = match (port.resource(tenant, key).await?, port.stock(tenant, key).await?) {
        (Some(row), Some(stock)) if row.buckets == 1 => (row, stock),
        _ => {
            let mut settled = Vec::with_capacity(records.len());
            for r in records {
                settled.push(settle(port, r, now_ms).await?);
            }
            return Ok(settled);
        }
    };
    // A request id twice in the run: the second is a redelivery of the first, as [`settle`]
    // would find it claimed.
    let mut seen = HashSet::new();
    let first_of_id: Vec<bool> = records.iter().map(|r| seen.insert(r.rid.as_str())).collect();
    let ids: Vec<&str> = records.iter().zip(&first_of_id).filter(|(_, &f)| f).map(|(r, _)| r.rid.as_str()).collect();
    let claimed = port.claim_settlements(tenant, key, &ids, now_ms).await?;
    if claimed.len() != ids.len() {
        return Err(StorageError::Internal("a settlement claim answered a different number of ids".into()));
    }
    let mut claimed = claimed.into_iter();
    let read_version = row.version;
    let mut counts =
        Counts { available: row.available, reserved: row.reserved, consumed: row.consumed, version: row.version };
    let mut band = stock.band;
    let mut writes = BatchWrites::default();
    let mut limits: BTreeMap<&str, i64> = BTreeMap::new();
    let mut decided = Vec::with_capacity(records.len());
    let mut answered = HashSet::new();
    let mut outcomes = Vec::new();
    for (r, first) in records.iter().zip(first_of_id) {
        let fresh = first && claimed.next().unwrap_or(false);
        if !fresh {
            decided.push(Decided { settled: Settled::Duplicate, failed: None, applied: None, stock: Vec::new() });
            continue;
        }
        let mut d = Decided { settled: Settled::Applied, failed: None, applied: None, stock: Vec::new() };
        if counts.available >= r.q {
            counts = Counts {
                available: counts.available - r.q,
                consumed: counts.consumed + r.q,
                version: counts.version + 1,
                ..counts
            };
            writes.ledger.push(LedgerRow {
                tenant: r.t.clone(),
                resource: r.k.clone(),
                bucket: 0,
                line_key: r.lk.clone().unwrap_or_default(),
                limit_key: r.lim.clone(),
                op: LedgerOp::Deduct,
                qty: r.q,
                request_id: r.rid.clone(),
                order_id: r.oid.clone(),
                reservation_id: None,
                after: counts,
                plugin_version: Some(r.pv),
                at: now_ms,
            });
            if let Some(limit) = &r.lim {
                *limits.entry(limit).or_default() += r.q;
            }
            let now = Stock { available: counts.available, low_stock: stock.low_stock, band };
            if let Some((moved_to, emitted)) = events::stock_events(tenant, key, now, now_ms) {
                band = moved_to;
                d.stock = emitted;
            }
        } else {
            port.record_settlement_failure(r, r.q, "insufficient", counts.available, now_ms).await?;
            d.settled = Settled::Refused;
            d.failed = Some(failed_event(r, r.q, "insufficient", counts.available, now_ms));
        }
        // The first record of an order to settle stores its answer (a key twice in the run: the
        // second finds it stored, as [`settle`] would).
        if answered.insert(r.idem.as_str()) {
            let applied = events::order_applied_event(&r.t, &r.oid, &r.body, now_ms);
            outcomes.push(Outcome {
                tenant: r.t.clone(),
                key: r.idem.clone(),
                request_hash: r.h.clone(),
                response: StoredResponse { status: 201, content_type: ContentType::Json, body: r.body.clone() },
                event: Some(applied.id.clone()),
                request_id: None,
                at: r.at,
            });
            d.applied = Some(applied);
        }
        decided.push(d);
    }
    let stored = port.store_outcomes_if_absent(&outcomes).await?;
    if stored.len() != outcomes.len() {
        return Err(StorageError::Internal("storing a run's answers answered a different number".into()));
    }
    let mut stored = stored.into_iter();
    let mut settled = Vec::with_capacity(decided.len());
    for d in decided {
        writes.events.extend(d.failed);
        if let Some(applied) = d.applied {
            if stored.next().unwrap_or(false) {
                writes.events.push(applied);
            }
        }
        writes.events.extend(d.stock);
        settled.push(d.settled);
    }
    for (limit, qty) in limits {
        // Redis enforced the limit; the database keeps the count for the record.
        port.count_limit(tenant, limit, qty).await?;
    }
    if counts.version != read_version {
        writes.rows.push(RowWrite {
            tenant: tenant.to_string(),
            key: key.to_string(),
            after: counts,
            read_version,
            stock: (band != stock.band).then_some(band),
            at: Some(now_ms),
        });
    }
    port.write_batch(&writes).await?;
    Ok(settled)
}
