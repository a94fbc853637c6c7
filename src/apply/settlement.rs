//! Settlement: one sale (or reservation move) Redis acknowledged, applied to the database exactly
//! once whatever the number of deliveries. Its request id is claimed first (a second consumer
//! of a reclaimed entry finds it taken); the change is the database path's guarded change
//! without the order gate (the sale happened in Redis while the resource was active, so only the
//! counters may refuse it), with its ledger row; what the database refuses is recorded as a
//! settlement failure for the tenant to compensate; the client's answer is stored so a replay
//! finds it after Redis forgot it.

use serde_json::json;

use super::events;
use super::port::{Change, Entry, Gate, Move, NewReservation, Port, Row, Savepoint};
use super::reversals::{self, Shortfall};
use crate::engine::reversal::{BucketReversal, LineReversal};
use crate::engine::{LedgerOp, Reservation, ReservationState};
use crate::events::{order_key, resource_key, EventType, NewEvent};
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
    port.emit(&NewEvent::new(&r.t, EventType::SettlementFailed, resource_key(&r.k), now_ms, &data)).await?;
    Ok(Settled::Refused)
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
            if reservation.state == to {
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
        let how = if to == ReservationState::Confirmed { Move::Confirm } else { Move::Unreserve };
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
