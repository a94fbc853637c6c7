//! Events: the transactional outbox (docs/EVENTS.md). Every committed change that matters
//! writes its event in the same transaction as the change ([`crate::apply::port::Port::emit`]);
//! the `events` table is the source every reader works from: the feed (`GET /v1/events`),
//! webhooks and the broker sink. Nothing rolled back is ever seen; nothing committed is lost.
//!
//! An event has a globally unique id (`evt_<ULID>`), the tenant's own monotonic sequence number
//! (assigned at commit, in commit order), a type, the time of the change and a JSON payload.
//! Deliveries keep sequence order among events of the same ordering key (a resource, an order).

use serde::Serialize;
use ulid::Ulid;

/// Every event type stockd emits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum EventType {
    #[serde(rename = "order.applied")]
    OrderApplied,
    #[serde(rename = "order.reversed")]
    OrderReversed,
    #[serde(rename = "reservation.held")]
    ReservationHeld,
    #[serde(rename = "reservation.confirmed")]
    ReservationConfirmed,
    #[serde(rename = "reservation.released")]
    ReservationReleased,
    #[serde(rename = "reservation.expired")]
    ReservationExpired,
    #[serde(rename = "resource.sold_out")]
    ResourceSoldOut,
    #[serde(rename = "resource.restocked")]
    ResourceRestocked,
    #[serde(rename = "resource.low_stock")]
    ResourceLowStock,
    #[serde(rename = "settlement.failed")]
    SettlementFailed,
    #[serde(rename = "reconciliation.drift")]
    ReconciliationDrift,
}

impl EventType {
    pub const ALL: [EventType; 11] = [
        EventType::OrderApplied,
        EventType::OrderReversed,
        EventType::ReservationHeld,
        EventType::ReservationConfirmed,
        EventType::ReservationReleased,
        EventType::ReservationExpired,
        EventType::ResourceSoldOut,
        EventType::ResourceRestocked,
        EventType::ResourceLowStock,
        EventType::SettlementFailed,
        EventType::ReconciliationDrift,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::OrderApplied => "order.applied",
            EventType::OrderReversed => "order.reversed",
            EventType::ReservationHeld => "reservation.held",
            EventType::ReservationConfirmed => "reservation.confirmed",
            EventType::ReservationReleased => "reservation.released",
            EventType::ReservationExpired => "reservation.expired",
            EventType::ResourceSoldOut => "resource.sold_out",
            EventType::ResourceRestocked => "resource.restocked",
            EventType::ResourceLowStock => "resource.low_stock",
            EventType::SettlementFailed => "settlement.failed",
            EventType::ReconciliationDrift => "reconciliation.drift",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == name)
    }
}

impl std::fmt::Display for EventType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event to write with the change that caused it. Its id is made with it ([`new_event_id`]),
/// so that a record written beside it can name it (an applied order's idempotency record keeps
/// only its event's id: the event's payload is the answer); its sequence number is given when
/// the transaction commits, in the order the events were written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewEvent {
    pub id: String,
    pub tenant: String,
    pub kind: EventType,
    /// Deliveries keep sequence order among events with the same one: `resource:<key>` for a
    /// resource's events, `order:<order id>` for an order's and its reservation's.
    pub ordering_key: String,
    /// Unix ms of the change.
    pub at: i64,
    /// The payload, a JSON object.
    pub data: String,
}

impl NewEvent {
    pub fn new(tenant: &str, kind: EventType, ordering_key: String, at: i64, data: &serde_json::Value) -> Self {
        Self { id: new_event_id(), tenant: tenant.to_string(), kind, ordering_key, at, data: data.to_string() }
    }

    /// An event whose payload is already JSON text (a stored order document).
    pub fn raw(tenant: &str, kind: EventType, ordering_key: String, at: i64, data: String) -> Self {
        Self { id: new_event_id(), tenant: tenant.to_string(), kind, ordering_key, at, data }
    }
}

/// Counts committed events by type (`stockd_events_written_total`).
pub fn count_written<'a>(types: impl IntoIterator<Item = &'a str>) {
    let mut counts: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
    for t in types {
        *counts.entry(t).or_default() += 1;
    }
    for (t, n) in counts {
        if let Some(t) = EventType::parse(t) {
            metrics::counter!("stockd_events_written_total", "type" => t.as_str()).increment(n);
        }
    }
}

thread_local! {
    /// The SQLite writer thread's events of its open transaction: counted once it commits.
    static UNCOMMITTED: std::cell::RefCell<Vec<EventType>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An event written on this (the SQLite writer's) thread, counted only if its transaction
/// commits ([`writer_mark`], [`writer_rollback_to`], [`writer_finished`]).
pub fn written_now(kind: EventType) {
    UNCOMMITTED.with(|u| u.borrow_mut().push(kind));
}

/// Where this thread's uncommitted events stand (before a savepoint).
pub fn writer_mark() -> usize {
    UNCOMMITTED.with(|u| u.borrow().len())
}

/// Forgets the events written since `mark` (their savepoint rolled back).
pub fn writer_rollback_to(mark: usize) {
    UNCOMMITTED.with(|u| u.borrow_mut().truncate(mark));
}

/// Counts this thread's events (`committed`) or forgets them (the transaction failed).
pub fn writer_finished(committed: bool) {
    let done = UNCOMMITTED.with(|u| std::mem::take(&mut *u.borrow_mut()));
    if committed {
        count_written(done.iter().map(|t| t.as_str()));
    }
}

static COMMITS: std::sync::LazyLock<tokio::sync::Notify> = std::sync::LazyLock::new(tokio::sync::Notify::new);

/// Called by a backend after each commit, which may have written events: wakes this process's
/// long polls of the feed (other processes' commits are found by polling).
pub fn committed() {
    COMMITS.notify_waiters();
}

/// Resolves at this process's next commit.
pub fn next_commit() -> tokio::sync::futures::Notified<'static> {
    COMMITS.notified()
}

/// Event ids in the order this process makes them (a ULID's random part is not ordered within
/// a millisecond).
pub fn new_event_id() -> String {
    static IDS: std::sync::Mutex<Option<ulid::Generator>> = std::sync::Mutex::new(None);
    let mut guard = IDS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let generator = guard.get_or_insert_with(ulid::Generator::new);
    // Overflow needs 2^80 ids in one millisecond; a fresh ULID is still unique then.
    format!("evt_{}", generator.generate().unwrap_or_else(|_| Ulid::new()))
}

/// The lowest event id [`new_event_id`] can make at `ms` or later: every id below it was made
/// before `ms` (a ULID's text sorts by its millisecond first). The purge walks the ids up to
/// it, from the oldest, so it needs no index of events by age.
pub fn first_event_id_at(ms: i64) -> String {
    format!("evt_{}", Ulid::from_parts(u64::try_from(ms).unwrap_or(0), 0))
}

/// Where a resource's available stock stands, as its stock events see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StockBand {
    /// Above its low-stock threshold (or above 0 without one).
    Ok,
    /// At or under its threshold, above 0.
    Low,
    /// Available 0.
    Out,
}

impl StockBand {
    pub fn of(available: i64, low_stock: Option<i64>) -> Self {
        if available <= 0 {
            StockBand::Out
        } else if low_stock.is_some_and(|t| available <= t) {
            StockBand::Low
        } else {
            StockBand::Ok
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            StockBand::Ok => "ok",
            StockBand::Low => "low",
            StockBand::Out => "out",
        }
    }

    pub fn from_db(value: &str) -> Option<Self> {
        match value {
            "ok" => Some(StockBand::Ok),
            "low" => Some(StockBand::Low),
            "out" => Some(StockBand::Out),
            _ => None,
        }
    }

    /// The events a move from `self` to `to` emits, in order: falling to a threshold
    /// (`low_stock`) comes before reaching 0 (`sold_out`); leaving 0 is `restocked`.
    pub fn crossing(self, to: StockBand, threshold: Option<i64>) -> &'static [EventType] {
        match (self, to) {
            (StockBand::Ok, StockBand::Low) => &[EventType::ResourceLowStock],
            // Falling past a threshold above 0 on the way to 0 crosses it too.
            (StockBand::Ok, StockBand::Out) if threshold.is_some_and(|t| t > 0) => {
                &[EventType::ResourceLowStock, EventType::ResourceSoldOut]
            }
            (StockBand::Ok, StockBand::Out) => &[EventType::ResourceSoldOut],
            (StockBand::Low, StockBand::Out) => &[EventType::ResourceSoldOut],
            (StockBand::Out, StockBand::Low | StockBand::Ok) => &[EventType::ResourceRestocked],
            _ => &[],
        }
    }
}

/// A resource's stock as its stock events judge it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stock {
    /// Now (a bucketed resource's summed over its buckets).
    pub available: i64,
    pub low_stock: Option<i64>,
    /// As last stored.
    pub band: StockBand,
}

/// The ordering key of a resource's events.
pub fn resource_key(key: &str) -> String {
    format!("resource:{key}")
}

/// The ordering key of an order's (and its reservation's) events.
pub fn order_key(order_id: &str) -> String {
    format!("order:{order_id}")
}

/// A committed event, as the feed and every delivery read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub id: String,
    pub tenant: String,
    pub seq: i64,
    /// The type's name (`order.applied`, ...).
    pub kind: String,
    pub ordering_key: String,
    pub at: i64,
    /// The payload, JSON text.
    pub data: String,
}

impl Event {
    /// The event as the feed, webhooks and the broker sink carry it:
    /// `{"id", "seq", "type", "timestamp" (RFC 3339), "at" (Unix ms), "data"}`.
    pub fn envelope(&self) -> String {
        let timestamp = chrono::DateTime::from_timestamp_millis(self.at)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
            .unwrap_or_default();
        // `data` is stored JSON: embedded as is, never parsed and printed again.
        format!(
            "{{\"id\":{},\"seq\":{},\"type\":{},\"timestamp\":{},\"at\":{},\"data\":{}}}",
            serde_json::Value::from(self.id.as_str()),
            self.seq,
            serde_json::Value::from(self.kind.as_str()),
            serde_json::Value::from(timestamp),
            self.at,
            if self.data.is_empty() { "{}" } else { &self.data },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_parses_back_from_its_name() {
        for t in EventType::ALL {
            assert_eq!(EventType::parse(t.as_str()), Some(t));
            assert_eq!(serde_json::to_value(t).unwrap(), serde_json::Value::from(t.as_str()));
        }
        assert_eq!(EventType::parse("order.nope"), None);
    }

    #[test]
    fn stock_bands_and_their_crossings() {
        use EventType::*;
        assert_eq!(StockBand::of(0, None), StockBand::Out);
        assert_eq!(StockBand::of(1, None), StockBand::Ok);
        assert_eq!(StockBand::of(2, Some(2)), StockBand::Low);
        assert_eq!(StockBand::of(3, Some(2)), StockBand::Ok);
        assert_eq!(StockBand::of(0, Some(0)), StockBand::Out);
        assert_eq!(StockBand::Ok.crossing(StockBand::Out, None), [ResourceSoldOut]);
        assert_eq!(StockBand::Ok.crossing(StockBand::Out, Some(0)), [ResourceSoldOut]);
        assert_eq!(StockBand::Ok.crossing(StockBand::Out, Some(3)), [ResourceLowStock, ResourceSoldOut]);
        assert_eq!(StockBand::Ok.crossing(StockBand::Low, Some(3)), [ResourceLowStock]);
        assert_eq!(StockBand::Low.crossing(StockBand::Out, Some(3)), [ResourceSoldOut]);
        assert_eq!(StockBand::Out.crossing(StockBand::Low, Some(3)), [ResourceRestocked]);
        assert_eq!(StockBand::Out.crossing(StockBand::Ok, None), [ResourceRestocked]);
        assert!(StockBand::Low.crossing(StockBand::Ok, Some(3)).is_empty());
    }

    #[test]
    fn the_envelope_embeds_the_stored_payload() {
        let e = Event {
            id: "evt_1".into(),
            tenant: "t".into(),
            seq: 7,
            kind: "resource.sold_out".into(),
            ordering_key: "resource:sku".into(),
            at: 1_700_000_000_123,
            data: "{\"key\":\"sku\",\"available\":0}".into(),
        };
        let v: serde_json::Value = serde_json::from_str(&e.envelope()).unwrap();
        assert_eq!(v["seq"], 7);
        assert_eq!(v["type"], "resource.sold_out");
        assert_eq!(v["timestamp"], "2023-11-14T22:13:20.123Z");
        assert_eq!(v["data"]["available"], 0);
    }
}
