//! The events a write emits with its change (docs/EVENTS.md), decided here once for every
//! backend: an applied order and its reservation, reservation moves, and the stock events of
//! every resource a write changed. Each is written through [`Port::emit`] in the write's own
//! savepoint, so it commits with the change or not at all.

use serde_json::json;

use super::port::{NewReservation, Port};
use crate::engine::{Reservation, ReservationLine, ReservationState};
use crate::events::{order_key, resource_key, EventType, NewEvent, Stock, StockBand};
use crate::storage::StorageError;
use crate::time::Timestamp;

/// An applied order (succeeded or partial): its document, as the client was answered. Its id
/// is what the order's idempotency record keeps instead of the document.
pub fn order_applied_event(tenant: &str, order_id: &str, document: &str, now_ms: i64) -> NewEvent {
    NewEvent::raw(tenant, EventType::OrderApplied, order_key(order_id), now_ms, document.to_string())
}

/// A reservation's event: `reservation.held` when it is made, then the one of its end state.
pub fn reservation_event(tenant: &str, reservation: &Reservation, now_ms: i64) -> NewEvent {
    let kind = match reservation.state {
        ReservationState::Held => EventType::ReservationHeld,
        ReservationState::Confirmed => EventType::ReservationConfirmed,
        ReservationState::Released => EventType::ReservationReleased,
        ReservationState::Expired => EventType::ReservationExpired,
    };
    let lines: Vec<_> = reservation
        .lines
        .iter()
        .map(|l| {
            let mut line = json!({"key": l.key, "resource": l.resource, "qty": l.qty});
            if !l.buckets.is_empty() {
                line["buckets"] = json!(l.buckets);
            }
            line
        })
        .collect();
    let data = json!({
        "reservation_id": reservation.id,
        "order_id": reservation.order_id,
        "state": reservation.state.as_str(),
        "expires_at": reservation.expires_at,
        "lines": lines,
    });
    NewEvent::new(tenant, kind, order_key(&reservation.order_id), now_ms, &data)
}

/// `reservation.held` for a reservation row about to be inserted, with its `lines`.
pub fn held_event(row: &NewReservation, lines: Vec<ReservationLine>, now_ms: i64) -> NewEvent {
    let reservation = Reservation {
        id: row.id.clone(),
        order_id: row.order_id.clone(),
        state: ReservationState::Held,
        lines,
        expires_at: Timestamp(row.expires_at),
    };
    reservation_event(&row.tenant, &reservation, now_ms)
}

/// Judges the resource's stock again after a write changed it: when it moved to another band,
/// emits the events of that crossing (`resource.low_stock`, `resource.sold_out`,
/// `resource.restocked`) and stores the new band. A change within a band emits nothing.
pub async fn observe_stock<P: Port>(port: &mut P, tenant: &str, key: &str, now_ms: i64) -> Result<(), StorageError> {
    let Some(stock) = port.stock(tenant, key).await? else { return Ok(()) };
    let Some((band, emitted)) = stock_events(tenant, key, stock, now_ms) else { return Ok(()) };
    for event in &emitted {
        port.emit(event).await?;
    }
    port.set_stock(tenant, key, band).await
}

/// The band a resource's stock is in now and the events of its crossing there from the band
/// stored, in order; `None`: it stayed within its band.
pub fn stock_events(tenant: &str, key: &str, stock: Stock, now_ms: i64) -> Option<(StockBand, Vec<NewEvent>)> {
    let band = StockBand::of(stock.available, stock.low_stock);
    if band == stock.band {
        return None;
    }
    let emitted = stock
        .band
        .crossing(band, stock.low_stock)
        .iter()
        .map(|&kind| {
            let mut data = json!({"key": key, "available": stock.available});
            if let Some(threshold) = stock.low_stock {
                data["low_stock"] = json!(threshold);
            }
            NewEvent::new(tenant, kind, resource_key(key), now_ms, &data)
        })
        .collect();
    Some((band, emitted))
}

/// [`observe_stock`] for each of these resources, once each, in key order.
pub async fn observe_all<P: Port>(
    port: &mut P,
    tenant: &str,
    keys: impl IntoIterator<Item = &str>,
    now_ms: i64,
) -> Result<(), StorageError> {
    let mut keys: Vec<&str> = keys.into_iter().collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        observe_stock(port, tenant, key, now_ms).await?;
    }
    Ok(())
}
