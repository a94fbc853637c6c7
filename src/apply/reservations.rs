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

/// The ledger op and counter move of leaving `held` for `to`.
pub(super) fn move_op(to: ReservationState) -> Result<(LedgerOp, Move), StorageError> {
    match to {
        ReservationState::Confirmed => Ok((LedgerOp::Confirm, Move::Confirm)),
        ReservationState::Released => Ok((LedgerOp::Release, Move::Unreserve)),
        ReservationState::Expired => Ok((LedgerOp::Expire, Move::Unreserve)),
        ReservationState::Held => Err(StorageError::Internal("a reservation cannot move back to held".into())),
    }
}

/// Where a confirm (`to`: confirmed) or release (`to`: released) takes the reservation now:
/// the state to move it to, or `None` when it stays as it is (answer [`unmoved`]). Past its
/// deadline but not yet swept, a held reservation is expired instead, whatever was asked: a
/// late confirm does not win a race with the sweeper, and a late release records the same
/// `expire` the sweeper (or Redis's expiry pass) would, so every copy of the reservation ends
/// in one state.
pub(super) fn move_to(reservation: &Reservation, to: ReservationState, now_ms: i64) -> Option<ReservationState> {
    match reservation.state {
        ReservationState::Held if reservation.expires_at.0 <= now_ms => Some(ReservationState::Expired),
        ReservationState::Held => Some(to),
        _ => None,
    }
}

/// The answer to a confirm or release toward `to` that found the reservation already out of
/// `held`: done if it is where the request leads (a release finds an expired one done too).
pub(super) fn unmoved(reservation: Reservation, to: ReservationState) -> Transition {
    match (reservation.state, to) {
        (ReservationState::Confirmed, ReservationState::Confirmed)
        | (ReservationState::Released | ReservationState::Expired, ReservationState::Released) => {
            Transition::Done(reservation)
        }
        (state, _) => Transition::Refused(state, reservation),
    }
}

/// The answer to a move toward `to` made: a confirm that expired the reservation is refused as
/// expired; a release that did is done (as a release of one the sweeper expired is).
pub(super) fn moved(reservation: Reservation, to: ReservationState) -> Transition {
    if reservation.state != ReservationState::Expired {
        return Transition::Done(reservation);
    }
    metrics::counter!("stockd_reservations_expired_total").increment(1);
    if to == ReservationState::Confirmed {
        Transition::Refused(ReservationState::Expired, reservation)
    } else {
        Transition::Done(reservation)
    }
}

/// Whether `to` is what a confirm or release asks for.
pub(super) fn requested(to: ReservationState) -> Result<(), StorageError> {
    match to {
        ReservationState::Confirmed | ReservationState::Released => Ok(()),
        other => Err(StorageError::Internal(format!("a reservation cannot be moved to {other:?}"))),
    }
}

/// Moves a held reservation to `to`; `None` when it was no longer held: another process moved it
/// after our read, and its move stands.
async fn finish<P: Port>(
    port: &mut P,
    tenant: &str,
    mut reservation: Reservation,
    to: ReservationState,
    now_ms: i64,
) -> Result<Option<Reservation>, StorageError> {
    let (op, how) = move_op(to)?;
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
    requested(job.to)?;
    transition(port, &job.tenant, &job.id, job.to, now_ms).await
}

/// Moves a reservation toward `to` (confirmed or released), judged by its state now.
async fn transition<P: Port>(
    port: &mut P,
    tenant: &TenantId,
    id: &str,
    to: ReservationState,
    now_ms: i64,
) -> Result<Transition, StorageError> {
    for _ in 0..TRANSITION_READS {
        let Some(reservation) = port.reservation(tenant.as_str(), id).await? else {
            return Ok(Transition::NotFound);
        };
        let Some(next) = move_to(&reservation, to, now_ms) else { return Ok(unmoved(reservation, to)) };
        let Some(reservation) = finish(port, tenant.as_str(), reservation, next, now_ms).await? else { continue };
        return Ok(moved(reservation, to));
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
