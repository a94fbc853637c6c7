//! The broker sinks' cursors on SQLite (docs/NATS.md). One process owns a SQLite database, and it
//! runs one sink job per sink, so a claim needs no lock: it reads the cursor, the sink reads its
//! page beside the writer, and the advance goes through the writer like every write. Should two
//! processes ever share the file, each would publish the same page and the broker would drop the
//! second copy by event id; the cursor only ever moves forward (`MAX`).

use std::sync::Arc;

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension};

use super::ops;
use super::readers::Readers;
use super::writer::Writer;
use crate::engine::TenantId;
use crate::events::Event;
use crate::storage::PageFrom;
use crate::storage::{SinkBacklog, SinkClaim, StorageError};

/// Tenants whose `event_seqs.last` is past the sink's cursor (none: 0), and the events behind in
/// total.
pub fn backlog(conn: &Connection, sink: &str, max_tenants: u32) -> Result<SinkBacklog, StorageError> {
    let mut statement = conn.prepare_cached(
        "SELECT s.tenant_id FROM event_seqs s
         LEFT JOIN event_sink_cursors c ON c.sink = ?1 AND c.tenant_id = s.tenant_id
         WHERE s.last > COALESCE(c.last_seq, 0) ORDER BY s.tenant_id LIMIT ?2",
    )?;
    let ids = statement.query_map(params![sink, i64::from(max_tenants)], |row| row.get::<_, String>(0))?;
    let mut tenants = Vec::new();
    for id in ids {
        tenants.push(TenantId::parse(id?).map_err(|e| StorageError::Internal(format!("event_seqs.tenant_id: {e}")))?);
    }
    let lag: i64 = conn
        .prepare_cached(
            "SELECT COALESCE(SUM(s.last - COALESCE(c.last_seq, 0)), 0) FROM event_seqs s
             LEFT JOIN event_sink_cursors c ON c.sink = ?1 AND c.tenant_id = s.tenant_id
             WHERE s.last > COALESCE(c.last_seq, 0)",
        )?
        .query_row(params![sink], |row| row.get(0))?;
    Ok(SinkBacklog { tenants, lag })
}

/// The sink's cursor for the tenant; 0 before its first visit.
pub fn cursor(conn: &Connection, sink: &str, tenant: &str) -> Result<i64, StorageError> {
    Ok(conn
        .prepare_cached("SELECT last_seq FROM event_sink_cursors WHERE sink = ?1 AND tenant_id = ?2")?
        .query_row(params![sink, tenant], |row| row.get(0))
        .optional()?
        .unwrap_or(0))
}

/// Moves the cursor to `to`, never back.
pub fn advance(conn: &Connection, sink: &str, tenant: &str, to: i64) -> Result<(), StorageError> {
    conn.prepare_cached(
        "INSERT INTO event_sink_cursors (sink, tenant_id, last_seq) VALUES (?1, ?2, ?3)
         ON CONFLICT (sink, tenant_id) DO UPDATE SET last_seq = MAX(last_seq, excluded.last_seq)",
    )?
    .execute(params![sink, tenant, to])?;
    Ok(())
}

/// A cursor read by this process; see the module's note on why it takes no lock.
pub struct SqliteClaim {
    pub(super) readers: Arc<Readers>,
    pub(super) writer: Writer,
    pub(super) sink: String,
    pub(super) tenant: TenantId,
    pub(super) cursor: i64,
}

#[async_trait]
impl SinkClaim for SqliteClaim {
    fn cursor(&self) -> i64 {
        self.cursor
    }

    async fn page(&mut self, limit: u32) -> Result<Vec<Event>, StorageError> {
        let (tenant, after) = (self.tenant.clone(), self.cursor);
        self.readers
            .snapshot(move |conn| ops::events_page(conn, tenant.as_str(), PageFrom::After(after), "", limit))
            .await
    }

    async fn advance(self: Box<Self>, to: i64) -> Result<(), StorageError> {
        let SqliteClaim { writer, sink, tenant, .. } = *self;
        writer.submit(move |conn| advance(conn, &sink, tenant.as_str(), to)).await
    }
}
