//! The outbox on PostgreSQL: numbering a batch attempt's held events at its end
//! ([`crate::storage::held_events`]) in one statement, and reading the feed.

use sqlx::PgConnection;

use crate::events::NewEvent;
use crate::storage::held_events;

/// Inserts the events the attempt emitted, numbered in the order emitted, and returns their
/// types: each tenant's sequence is bumped by its count (tenants in one order, so two sealing
/// transactions never wait on each other in a cycle).
pub(crate) async fn seal(conn: &mut PgConnection) -> Result<Vec<String>, sqlx::Error> {
    let held = held_events::take();
    if held.is_empty() {
        return Ok(Vec::new());
    }
    fn col<U>(held: &[NewEvent], f: impl Fn(&NewEvent) -> U) -> Vec<U> {
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
    .bind(col(&held, |h| h.tenant.clone()))
    .bind(col(&held, |h| h.kind.as_str()))
    .bind(col(&held, |h| h.ordering_key.clone()))
    .bind(col(&held, |h| h.at))
    .bind(col(&held, |h| crate::storage::payload::pack(&h.data).into_owned()))
    .fetch_all(conn)
    .await
}
