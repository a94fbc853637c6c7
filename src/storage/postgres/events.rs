//! The outbox on PostgreSQL: numbering a transaction's events at its end, and reading the feed.
//!
//! A job writes its events unnumbered (`seq` NULL) in its own savepoint, so a rolled-back job
//! takes its events with it (and the batcher forgets their ids, [`WRITTEN`]). Just before COMMIT
//! the batcher numbers what is left, found by id: it bumps each
//! tenant's `event_seqs` row by its count and holds that row until the commit. A tenant's next
//! transaction waits there, so its events commit in sequence order and a reader paging
//! `seq > after` never misses one that commits later with a lower number. The row is taken after
//! every resource row the transaction locks, so no lock cycle runs through it.

use std::cell::RefCell;

use sqlx::{PgConnection, Row};

use crate::events::Event;
use crate::storage::StorageError;

tokio::task_local! {
    /// The events a batch attempt wrote so far, `(id, tenant)` in the order written: what
    /// [`seal`] numbers. A job rolled back to its savepoint takes its own back ([`rollback_to`]).
    pub(super) static WRITTEN: RefCell<Vec<(String, String)>>;
}

/// Records events the current batch attempt wrote (in its transaction).
pub(super) fn written(events: impl IntoIterator<Item = (String, String)>) -> Result<(), StorageError> {
    WRITTEN
        .try_with(|w| w.borrow_mut().extend(events))
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

/// Numbers the events the attempt wrote, in the order written, and returns their types: each
/// tenant's sequence is bumped by its count (tenants in one order, so two sealing transactions
/// never wait on each other in a cycle), then each event is found by its id.
pub(super) async fn seal(conn: &mut PgConnection) -> Result<Vec<String>, sqlx::Error> {
    let (ids, tenants): (Vec<String>, Vec<String>) = mark_all();
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar(
        "WITH mine AS (
            SELECT * FROM UNNEST($1::text[], $2::text[]) WITH ORDINALITY AS m (id, tenant_id, n)),
         counts AS (
            SELECT tenant_id, COUNT(*) AS c FROM mine GROUP BY tenant_id),
         bumped AS (
            INSERT INTO event_seqs AS s (tenant_id, last)
            SELECT tenant_id, c FROM counts ORDER BY tenant_id COLLATE \"C\"
            ON CONFLICT (tenant_id) DO UPDATE SET last = s.last + excluded.last
            RETURNING s.tenant_id, s.last),
         numbered AS (
            SELECT m.id, b.last - c.c + ROW_NUMBER() OVER (PARTITION BY m.tenant_id ORDER BY m.n) AS seq
            FROM mine m JOIN counts c ON c.tenant_id = m.tenant_id JOIN bumped b ON b.tenant_id = m.tenant_id)
         UPDATE events e SET seq = numbered.seq FROM numbered WHERE e.id = numbered.id RETURNING e.type",
    )
    .bind(ids)
    .bind(tenants)
    .fetch_all(conn)
    .await
}

/// The attempt's events as two arrays, ids and tenants.
fn mark_all() -> (Vec<String>, Vec<String>) {
    WRITTEN.try_with(|w| w.borrow().iter().cloned().unzip()).unwrap_or_default()
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
