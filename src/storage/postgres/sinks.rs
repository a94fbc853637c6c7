//! The broker sinks' cursors on PostgreSQL (docs/NATS.md). Several processes share the database
//! and each runs the sink, so a process claims a tenant's cursor row with `FOR UPDATE SKIP
//! LOCKED` in a transaction it keeps open while it publishes that tenant's page and waits for
//! the acknowledgements; another process skips the tenant meanwhile instead of publishing the
//! same page. The claim only spares duplicate work: if a process dies or loses the database
//! mid-page, its transaction ends, the row is free, and whoever takes it next republishes from
//! the stored cursor; the broker drops what it already has by event id.
//!
//! The transaction is idle while the page is published, so the publish must end well within
//! the session's `idle_in_transaction_session_timeout` (10 s, see `batcher::ATTEMPT_DEADLINE`):
//! `[events.nats] publish_timeout_ms` is capped below it.

use async_trait::async_trait;
use sqlx::{PgPool, Postgres, Transaction};

use crate::engine::TenantId;
use crate::events::Event;
use crate::storage::rows::{event, EVENT_COLUMNS};
use crate::storage::{SinkBacklog, SinkClaim, StorageError};

/// Tenants whose `event_seqs.last` is past the sink's cursor (none: 0), and the events behind in
/// total.
pub(super) async fn backlog(pool: &PgPool, sink: &str, max_tenants: u32) -> Result<SinkBacklog, StorageError> {
    let ids: Vec<String> = sqlx::query_scalar(
        "SELECT s.tenant_id FROM event_seqs s
         LEFT JOIN event_sink_cursors c ON c.sink = $1 AND c.tenant_id = s.tenant_id
         WHERE s.last > COALESCE(c.last_seq, 0) ORDER BY s.tenant_id COLLATE \"C\" LIMIT $2",
    )
    .bind(sink)
    .bind(i64::from(max_tenants))
    .fetch_all(pool)
    .await?;
    let tenants = ids
        .into_iter()
        .map(|id| TenantId::parse(id).map_err(|e| StorageError::Internal(format!("event_seqs.tenant_id: {e}"))))
        .collect::<Result<_, _>>()?;
    let lag: i64 = sqlx::query_scalar(
        "SELECT COALESCE(SUM(s.last - COALESCE(c.last_seq, 0)), 0)::BIGINT FROM event_seqs s
         LEFT JOIN event_sink_cursors c ON c.sink = $1 AND c.tenant_id = s.tenant_id
         WHERE s.last > COALESCE(c.last_seq, 0)",
    )
    .bind(sink)
    .fetch_one(pool)
    .await?;
    Ok(SinkBacklog { tenants, lag })
}

/// Takes the tenant's cursor row, or `None` while another transaction holds it.
pub(super) async fn claim(pool: &PgPool, sink: &str, tenant: &TenantId) -> Result<Option<PgClaim>, StorageError> {
    // Created outside the claiming transaction: inserting it there would make a second process
    // wait on the first one's uncommitted row instead of skipping it.
    sqlx::query(
        "INSERT INTO event_sink_cursors (sink, tenant_id, last_seq) VALUES ($1, $2, 0)
         ON CONFLICT (sink, tenant_id) DO NOTHING",
    )
    .bind(sink)
    .bind(tenant.as_str())
    .execute(pool)
    .await?;
    let mut tx = pool.begin().await?;
    let cursor: Option<i64> = sqlx::query_scalar(
        "SELECT last_seq FROM event_sink_cursors WHERE sink = $1 AND tenant_id = $2 FOR UPDATE SKIP LOCKED",
    )
    .bind(sink)
    .bind(tenant.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    match cursor {
        Some(cursor) => Ok(Some(PgClaim { tx, sink: sink.to_string(), tenant: tenant.clone(), cursor })),
        None => {
            tx.rollback().await?;
            Ok(None)
        }
    }
}

/// A cursor row locked by this process's open transaction.
pub(super) struct PgClaim {
    tx: Transaction<'static, Postgres>,
    sink: String,
    tenant: TenantId,
    cursor: i64,
}

#[async_trait]
impl SinkClaim for PgClaim {
    fn cursor(&self) -> i64 {
        self.cursor
    }

    async fn page(&mut self, limit: u32) -> Result<Vec<Event>, StorageError> {
        let rows = sqlx::query(&format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = $1 AND seq > $2 ORDER BY seq LIMIT $3"
        ))
        .bind(self.tenant.as_str())
        .bind(self.cursor)
        .bind(i64::from(limit))
        .fetch_all(&mut *self.tx)
        .await?;
        rows.iter().map(|row| event(row)).collect()
    }

    async fn advance(self: Box<Self>, to: i64) -> Result<(), StorageError> {
        let PgClaim { mut tx, sink, tenant, .. } = *self;
        sqlx::query(
            "UPDATE event_sink_cursors SET last_seq = GREATEST(last_seq, $3) WHERE sink = $1 AND tenant_id = $2",
        )
        .bind(&sink)
        .bind(tenant.as_str())
        .bind(to)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }
}
