//! Reservation moves: `held → confirmed | released | expired`. The state changes only if it is
//! still `held` (so of two concurrent movers exactly one wins), and each line leaves `reserved`
//! with a ledger row: to `consumed` on a confirm, back to `available` (with its per-user limit
//! given back) otherwise.

use super::events;
use super::port::{Change, Entry, Gate, Move, Port, Row};
use crate::engine::{LedgerOp, Reservation, ReservationState, TenantId};
use crate::storage::{StorageError, Transition};

/// How many times a transition reads the reservation: a second read follows only a lost race,
/// and then sees a final state, which needs no move.
const TRANSITION_READS: usize = 2;

/// Moves a held reservation to `to`; `None` when it was no longer held: another process moved it
/// after our read, and its move stands.
async fn finish<P: Port>(
    port: &mut P,
    tenant: &str,
    mut reservation: Reservation,
    to: ReservationState,
    now_ms: i64,
) -> Result<Option<Reservation>, StorageError> {
    let (op, how) = match to {
        ReservationState::Confirmed => (LedgerOp::Confirm, Move::Confirm),
        ReservationState::Released => (LedgerOp::Release, Move::Unreserve),
        ReservationState::Expired => (LedgerOp::Expire, Move::Unreserve),
        ReservationState::Held => return Err(StorageError::Internal("a reservation cannot move back to held".into())),
    };
    if !port.leave_held(tenant, &reservation.id, to, now_ms).await? {
        return Ok(None);
    }
    let mut lines = reservation.lines.clone();
    lines.sort_by(|a, b| a.resource.cmp(&b.resource));
    for line in &lines {
        let entry = Entry {
            tenant,
            resource: &line.resource,
            bucket: 0,
            op,
            qty: line.qty,
            request_id: &reservation.id,
            order_id: Some(&reservation.order_id),
            reservation_id: Some(&reservation.id),
            plugin_version: None,
            at: now_ms,
            line_key: Some(&line.key),
            limit_key: line.limit_key.as_deref(),
            reverses: None,
        };
        let changes: Vec<Change<'_>> = if line.buckets.is_empty() {
            vec![Change { row: Row::Resource, how, gate: Gate::Counters, entry }]
        } else {
            line.buckets
                .iter()
                .map(|take| Change {
                    row: Row::Bucket(take.bucket),
                    how,
                    gate: Gate::Counters,
                    entry: Entry { bucket: take.bucket, qty: take.qty, ..entry },
                })
                .collect()
        };
        for change in &changes {
            if port.change(change).await?.is_none() {
                return Err(StorageError::Internal(format!(
                    "resource of reservation {} holds less than reserved",
                    reservation.id
                )));
            }
        }
        if let (Some(key), true) = (&line.limit_key, to != ReservationState::Confirmed) {
            port.give_back_limit(tenant, key, line.qty).await?;
        }
    }
    reservation.state = to;
    port.emit(&events::reservation_event(tenant, &reservation, now_ms)).await?;
    if to != ReservationState::Confirmed {
        events::observe_all(port, tenant, lines.iter().map(|l| l.resource.as_str()), now_ms).await?;
    }
    Ok(Some(reservation))
}

/// Held → confirmed: its lines' reserved becomes consumed. Again on a confirmed one: done.
pub async fn confirm<P: Port>(
    port: &mut P,
    tenant: &TenantId,
    id: &str,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    transition(port, tenant, id, ReservationState::Confirmed, now_ms).await
}

/// Held → released: its lines' reserved goes back to available. Again, or on an expired one:
/// done.
pub async fn release<P: Port>(
    port: &mut P,
    tenant: &TenantId,
    id: &str,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    transition(port, tenant, id, ReservationState::Released, now_ms).await
}

/// A queued confirm or release on its own (what batch admission left, see [`super::batch`]).
pub async fn execute<P: Port>(
    port: &mut P,
    job: &super::batch::MoveJob,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    match job.to {
        ReservationState::Confirmed | ReservationState::Released => {
            transition(port, &job.tenant, &job.id, job.to, now_ms).await
        }
        other => Err(StorageError::Internal(format!("a reservation cannot be moved to {other:?}"))),
    }
}

/// Moves a reservation toward `to` (confirmed or released), judged by its state now.
async fn transition<P: Port>(
    port: &mut P,
    tenant: &TenantId,
    id: &str,
    to: ReservationState,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    let confirming = to == ReservationState::Confirmed;
    for _ in 0..TRANSITION_READS {
        let Some(reservation) = port.reservation(tenant.as_str(), id).await? else {
            return Ok(Transition::NotFound);
        };
        let state = reservation.state;
        // Past its deadline but not yet swept, a held reservation is expired. Expiring it here
        // keeps a late confirm from winning a race with the sweeper.
        let to = match state {
            ReservationState::Held if confirming && reservation.expires_at.0 <= now_ms => ReservationState::Expired,
            ReservationState::Held => to,
            ReservationState::Confirmed if confirming => return Ok(Transition::Done(reservation)),
            ReservationState::Released | ReservationState::Expired if !confirming => {
                return Ok(Transition::Done(reservation))
            }
            _ => return Ok(Transition::Refused(state, reservation)),
        };
        let Some(moved) = finish(port, tenant.as_str(), reservation, to, now_ms).await? else { continue };
        return Ok(if to == ReservationState::Expired {
            metrics::counter!("stockd_reservations_expired_total").increment(1);
            Transition::Refused(ReservationState::Expired, moved)
        } else {
            Transition::Done(moved)
        });
    }
    Err(StorageError::Internal(format!("reservation {id} left held twice")))
}

/// Expires up to `limit` held reservations past their deadline; returns how many.
pub async fn expire_due<P: Port>(port: &mut P, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
    let mut expired = 0;
    for (tenant, reservation) in port.due_reservations(now_ms, limit).await? {
        let id = reservation.id.clone();
        // The row is locked by this transaction (or this is the only writer), so it is held.
        if finish(port, &tenant, reservation, ReservationState::Expired, now_ms).await?.is_none() {
            return Err(StorageError::Internal(format!("locked reservation {id} was not held")));
        }
        expired += 1;
    }
    Ok(expired)
}
