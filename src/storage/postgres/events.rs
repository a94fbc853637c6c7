//! The outbox on PostgreSQL: numbering a transaction's events at its end, and reading the feed.
//!
//! A job writes its events unnumbered (`seq` NULL) in its own savepoint, so a rolled-back job
//! takes its events with it. Just before COMMIT the batcher numbers what is left: it bumps each
//! tenant's `event_seqs` row by its count and holds that row until the commit. A tenant's next
//! transaction waits there, so its events commit in sequence order and a reader paging
//! `seq > after` never misses one that commits later with a lower number. The row is taken after
//! every resource row the transaction locks, so no lock cycle runs through it.

use sqlx::{PgConnection, Row};

use crate::events::Event;
use crate::storage::StorageError;

/// Numbers the transaction's unnumbered events (only its own are visible to it: every committed
/// event has its number) and returns their types. Tenants in one order, so two sealing
/// transactions never wait on each other in a cycle.
pub(super) async fn seal(conn: &mut PgConnection) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "WITH mine AS (
            SELECT tenant_id, COUNT(*) AS n FROM events WHERE seq IS NULL GROUP BY tenant_id),
         bumped AS (
            INSERT INTO event_seqs AS s (tenant_id, last)
            SELECT tenant_id, n FROM mine ORDER BY tenant_id COLLATE \"C\"
            ON CONFLICT (tenant_id) DO UPDATE SET last = s.last + excluded.last
            RETURNING s.tenant_id, s.last),
         numbered AS (
            SELECT e.id, b.last - m.n + ROW_NUMBER() OVER (PARTITION BY e.tenant_id ORDER BY e.id) AS seq
            FROM events e JOIN mine m ON m.tenant_id = e.tenant_id JOIN bumped b ON b.tenant_id = e.tenant_id
            WHERE e.seq IS NULL)
         UPDATE events e SET seq = numbered.seq FROM numbered WHERE e.id = numbered.id RETURNING e.type",
    )
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
