//! The outbox on PostgreSQL: numbering a transaction's events at its end, and reading the feed.
//!
//! A job's events are held by its batch attempt ([`WRITTEN`]), in the order emitted; a job rolled
//! back to its savepoint takes its own back. Just before COMMIT the batcher inserts what is left,
//! numbered, in one statement: it bumps each tenant's `event_seqs` row by its count and holds that
//! row until the commit. A tenant's next transaction waits there, so its events commit in
//! sequence order and a reader paging `seq > after` never misses one that commits later with a
//! lower number. The row is taken after every resource row the transaction locks, so no lock
//! cycle runs through it.
//!
//! Why held rather than inserted unnumbered and numbered at the end: the numbering UPDATE wrote
//! every event row twice (a new version that is never heap-only, since `seq` is indexed), with
//! a second entry in each of its indexes.

use std::cell::RefCell;

use sqlx::{PgConnection, Row};

use crate::events::{new_event_id, Event, NewEvent};
use crate::storage::StorageError;

/// An event of the batch attempt, its id made when it was emitted (ids sort in the order made).
#[derive(Debug)]
pub(super) struct Held {
    id: String,
    event: NewEvent,
}

tokio::task_local! {
    /// The events a batch attempt emitted so far, in the order emitted: what [`seal`] inserts.
    /// A job rolled back to its savepoint takes its own back ([`rollback_to`]).
    pub(super) static WRITTEN: RefCell<Vec<Held>>;
}

/// Holds events the current batch attempt emitted (in its transaction) until [`seal`].
pub(super) fn hold(events: &[NewEvent]) -> Result<(), StorageError> {
    WRITTEN
        .try_with(|w| w.borrow_mut().extend(events.iter().map(|e| Held { id: new_event_id(), event: e.clone() })))
        .map_err(|_| StorageError::Internal("an event was written outside a batch".into()))
}

/// Where the attempt's events stand (before a job's savepoint).
pub(super) fn mark() -> usize {
    WRITTEN.try_with(|w| w.borrow().len()).unwrap_or(0)
}

/// Forgets the events written since `mark` (their savepoint rolled back).
pub(super) fn rollback_to(mark: usize) {
    let _ = WRITTEN.try_with(|w| w.borrow_mut().truncate(mark));
}

/// Inserts the events the attempt emitted, numbered in the order emitted, and returns their
/// types: each tenant's sequence is bumped by its count (tenants in one order, so two sealing
/// transactions never wait on each other in a cycle).
pub(super) async fn seal(conn: &mut PgConnection) -> Result<Vec<String>, sqlx::Error> {
    // Taken: a seal that fails fails its attempt, and a rerun starts from an empty list.
    let held = WRITTEN.try_with(|w| std::mem::take(&mut *w.borrow_mut())).unwrap_or_default();
    if held.is_empty() {
        return Ok(Vec::new());
    }
    fn col<U>(held: &[Held], f: impl Fn(&Held) -> U) -> Vec<U> {
        held.iter().map(f).collect()
    }
    sqlx::query_scalar(
        "WITH mine AS (
            SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[])
                     WITH ORDINALITY AS m (id, tenant_id, type, ordering_key, at, data, n)),
         counts AS (
            SELECT tenant_id, COUNT(*) AS c FROM mine GROUP BY tenant_id),
         bumped AS (
            INSERT INTO event_seqs AS s (tenant_id, last)
            SELECT tenant_id, c FROM counts ORDER BY tenant_id COLLATE \"C\"
            ON CONFLICT (tenant_id) DO UPDATE SET last = s.last + excluded.last
            RETURNING s.tenant_id, s.last)
         INSERT INTO events (id, tenant_id, seq, type, ordering_key, at, data)
         SELECT m.id, m.tenant_id, b.last - c.c + ROW_NUMBER() OVER (PARTITION BY m.tenant_id ORDER BY m.n),
                m.type, m.ordering_key, m.at, m.data
         FROM mine m JOIN counts c ON c.tenant_id = m.tenant_id JOIN bumped b ON b.tenant_id = m.tenant_id
         ORDER BY m.n
         RETURNING type",
    )
    .bind(col(&held, |h| h.id.clone()))
    .bind(col(&held, |h| h.event.tenant.clone()))
    .bind(col(&held, |h| h.event.kind.as_str()))
    .bind(col(&held, |h| h.event.ordering_key.clone()))
    .bind(col(&held, |h| h.event.at))
    .bind(col(&held, |h| h.event.data.clone()))
    .fetch_all(conn)
    .await
}

/// The columns [`event`] reads.
pub(super) const EVENT_COLUMNS: &str = "id, tenant_id, seq, type, ordering_key, at, data";

pub(super) fn event(row: &sqlx::postgres::PgRow) -> Result<Event, StorageError> {
    let seq: Option<i64> = row.try_get("seq")?;
    Ok(Event {
        id: row.try_get("id")?,
        tenant: row.try_get("tenant_id")?,
        seq: seq.ok_or_else(|| StorageError::Internal("an unnumbered event was read".into()))?,
        kind: row.try_get("type")?,
        ordering_key: row.try_get("ordering_key")?,
        at: row.try_get("at")?,
        data: row.try_get("data")?,
    })
}
