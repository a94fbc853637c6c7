//! [`WebhookStore`] on MySQL, straight on the pool (webhook rows contend with no order
//! write, so the batcher has nothing to save). Several processes share the queue: a claim takes
//! due rows `FOR UPDATE SKIP LOCKED` and leases them; a queueing pass takes the endpoints it
//! advances the same way, so two processes never queue the same endpoint at once.

use async_trait::async_trait;
use sqlx::{Connection, MySqlConnection};

use super::{acquire, MyStorage};
use crate::engine::TenantId;
use crate::storage::webhooks::{self as rows, ATTEMPT_COLUMNS, ENDPOINT_COLUMNS};
use crate::storage::StorageError;
use crate::webhooks::{
    types_to_db, Attempt, Claimed, Endpoint, Finished, NewEndpoint, Next, QueueLimits, QueuePage, Redeliver,
    Redelivered, SigningSecret, WebhookStore,
};

async fn endpoint_of(conn: &mut MySqlConnection, tenant: &str, id: &str) -> Result<Option<Endpoint>, StorageError> {
    let row =
        sqlx::query(&format!("SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE tenant_id = $1 AND id = $2"))
            .bind(tenant)
            .bind(id)
            .fetch_optional(conn)
            .await?;
    row.as_ref().map(|r| rows::endpoint(r)).transpose()
}

/// Claims due deliveries (each the oldest queued of its endpoint and ordering key) and returns
/// them with their endpoint and event. Rows another process is claiming are skipped; a row it
/// claimed is skipped while its lease runs (the WHERE is checked again on the locked row).
/// Each tenant with an active endpoint gets at most `$4` deliveries in flight (those it holds
/// in any process count), its oldest due first; then the oldest of all, up to `$3`.
const CLAIM_SQL: &str = "WITH room AS (
        SELECT t.tenant_id,
               $4 - (SELECT COUNT(*) FROM webhook_deliveries f
                      WHERE f.tenant_id = t.tenant_id AND f.lease_until > $1) AS n
          FROM (SELECT DISTINCT tenant_id FROM webhook_endpoints WHERE state = 'active') t),
     fair AS (
        SELECT x.endpoint_id, x.seq, x.due_at FROM room r
         CROSS JOIN LATERAL (
            SELECT q.endpoint_id, q.seq, q.due_at FROM webhook_deliveries q
              JOIN webhook_endpoints w ON w.id = q.endpoint_id
             WHERE q.tenant_id = r.tenant_id AND w.state = 'active' AND q.due_at <= $1 AND q.lease_until <= $1
               AND NOT EXISTS (SELECT 1 FROM webhook_deliveries p
                                WHERE p.endpoint_id = q.endpoint_id AND p.ordering_key = q.ordering_key
                                  AND p.seq < q.seq)
             ORDER BY q.due_at, q.seq LIMIT GREATEST(r.n, 0)) x
         ORDER BY x.due_at, x.seq LIMIT $3),
     picked AS (
        SELECT q.endpoint_id, q.seq FROM webhook_deliveries q
          JOIN fair ON fair.endpoint_id = q.endpoint_id AND fair.seq = q.seq
         WHERE q.lease_until <= $1
         FOR UPDATE OF q SKIP LOCKED),
     claimed AS (
        UPDATE webhook_deliveries d SET lease_until = $2 FROM picked
         WHERE d.endpoint_id = picked.endpoint_id AND d.seq = picked.seq
        RETURNING d.endpoint_id, d.tenant_id, d.seq, d.attempts, d.window_start, d.lease_until)
     SELECT c.endpoint_id, c.tenant_id, c.seq, c.attempts, c.window_start, c.lease_until,
            w.url, w.secret, w.previous_secret, w.previous_valid_until,
            e.id AS event_id, e.type, e.ordering_key, e.at, e.data
       FROM claimed c JOIN webhook_endpoints w ON w.id = c.endpoint_id
       LEFT JOIN events e ON e.tenant_id = c.tenant_id AND e.seq = c.seq";

const INSERT_DELIVERY: &str =
    "INSERT INTO webhook_deliveries (endpoint_id, seq, tenant_id, ordering_key, event_at, due_at)
     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING";

async fn queue(
    conn: &mut MySqlConnection,
    now_ms: i64,
    after: &str,
    limits: QueueLimits,
) -> Result<QueuePage, StorageError> {
    let mut tx = conn.begin().await?;
    let behind = sqlx::query(
        "SELECT w.id, w.tenant_id, w.types, w.cursor FROM webhook_endpoints w
           JOIN event_seqs s ON s.tenant_id = w.tenant_id
          WHERE w.state = 'active' AND w.cursor < s.last AND w.id > $1
          ORDER BY w.id LIMIT $2
          FOR UPDATE OF w SKIP LOCKED",
    )
    .bind(after)
    .bind(i64::from(limits.endpoints))
    .fetch_all(&mut *tx)
    .await?
    .iter()
    .map(|r| rows::behind(r))
    .collect::<Result<Vec<_>, _>>()?;
    let mut page = QueuePage::default();
    for endpoint in &behind {
        let pending: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM webhook_deliveries WHERE endpoint_id = $1")
            .bind(&endpoint.id)
            .fetch_one(&mut *tx)
            .await?;
        let room = u64::try_from(i64::from(limits.max_pending).saturating_sub(pending)).unwrap_or(0);
        let scanned = sqlx::query(
            "SELECT seq, type, ordering_key, at FROM events WHERE tenant_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(&endpoint.tenant)
        .bind(endpoint.cursor)
        .bind(i64::from(limits.events))
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| rows::scanned(r))
        .collect::<Result<Vec<_>, _>>()?;
        let (take, cursor) = rows::plan_queue(&endpoint.types, &scanned, room);
        for e in take {
            let done = sqlx::query(INSERT_DELIVERY)
                .bind(&endpoint.id)
                .bind(e.seq)
                .bind(&endpoint.tenant)
                .bind(&e.ordering_key)
                .bind(e.at)
                .bind(now_ms)
                .execute(&mut *tx)
                .await?;
            page.queued += done.rows_affected();
        }
        if let Some(cursor) = cursor {
            sqlx::query("UPDATE webhook_endpoints SET cursor = $2 WHERE id = $1 AND cursor < $2")
                .bind(&endpoint.id)
                .bind(cursor)
                .execute(&mut *tx)
                .await?;
        }
    }
    tx.commit().await?;
    if behind.len() >= limits.endpoints as usize {
        page.last_endpoint = behind.last().map(|b| b.id.clone());
    }
    Ok(page)
}

async fn finish(conn: &mut MySqlConnection, f: &Finished) -> Result<(), StorageError> {
    let mut tx = conn.begin().await?;
    let a = &f.attempt;
    sqlx::query(
        "INSERT INTO webhook_attempts (endpoint_id, event_id, seq, type, attempt, at, outcome, http_status, error, latency_ms)
         SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10 WHERE EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = $1)",
    )
    .bind(&f.endpoint_id)
    .bind(&a.event_id)
    .bind(f.seq)
    .bind(&a.kind)
    .bind(a.attempt)
    .bind(a.at)
    .bind(a.outcome.as_str())
    .bind(a.http_status)
    .bind(&a.error)
    .bind(a.latency_ms)
    .execute(&mut *tx)
    .await?;
    let (due_at, window_start, failing) = match f.next {
        Next::Done => {
            sqlx::query("DELETE FROM webhook_deliveries WHERE endpoint_id = $1 AND seq = $2 AND lease_until = $3")
                .bind(&f.endpoint_id)
                .bind(f.seq)
                .bind(f.lease_until)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            return Ok(());
        }
        Next::Retry { due_at, window_start } => (due_at, window_start, false),
        Next::EndpointFailing { window_start } => (f.now_ms, window_start, true),
    };
    let kept = sqlx::query(
        "UPDATE webhook_deliveries SET attempts = attempts + 1, due_at = $4, window_start = $5, lease_until = 0
          WHERE endpoint_id = $1 AND seq = $2 AND lease_until = $3",
    )
    .bind(&f.endpoint_id)
    .bind(f.seq)
    .bind(f.lease_until)
    .bind(due_at)
    .bind(window_start)
    .execute(&mut *tx)
    .await?;
    if failing && kept.rows_affected() > 0 {
        sqlx::query(
            "UPDATE webhook_endpoints SET state = 'failing', failing_since = $2 WHERE id = $1 AND state = 'active'",
        )
        .bind(&f.endpoint_id)
        .bind(f.now_ms)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

async fn redeliver(
    conn: &mut MySqlConnection,
    tenant: &str,
    id: &str,
    what: &Redeliver,
    now_ms: i64,
) -> Result<Redelivered, StorageError> {
    let mut tx = conn.begin().await?;
    let found: Option<String> =
        sqlx::query_scalar("SELECT id FROM webhook_endpoints WHERE tenant_id = $1 AND id = $2 FOR UPDATE")
            .bind(tenant)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
    if found.is_none() {
        return Ok(Redelivered::EndpointNotFound);
    }
    let mut queued = 0;
    if let Some(event_id) = &what.event_id {
        let event: Option<(Option<i64>, String, i64)> =
            sqlx::query_as("SELECT seq, ordering_key, at FROM events WHERE tenant_id = $1 AND id = $2")
                .bind(tenant)
                .bind(event_id)
                .fetch_optional(&mut *tx)
                .await?;
        let Some((Some(seq), key, at)) = event else { return Ok(Redelivered::EventNotFound) };
        queued = sqlx::query(INSERT_DELIVERY)
            .bind(id)
            .bind(seq)
            .bind(tenant)
            .bind(key)
            .bind(at)
            .bind(now_ms)
            .execute(&mut *tx)
            .await?
            .rows_affected();
    }
    if let Some(after) = what.after {
        sqlx::query("UPDATE webhook_endpoints SET cursor = LEAST(cursor, $2) WHERE id = $1")
            .bind(id)
            .bind(after)
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query("UPDATE webhook_endpoints SET state = 'active', failing_since = NULL WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    sqlx::query("UPDATE webhook_deliveries SET due_at = $2, window_start = NULL WHERE endpoint_id = $1")
        .bind(id)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Redelivered::Queued(queued))
}

#[async_trait]
impl WebhookStore for MyStorage {
    async fn create_webhook(&self, new: &NewEndpoint, max_per_tenant: usize) -> Result<Option<Endpoint>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let mut tx = conn.begin().await?;
        // The tenant's row serializes its creations, so the limit holds across processes.
        sqlx::query("SELECT id FROM tenants WHERE id = $1 FOR UPDATE")
            .bind(new.tenant.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM webhook_endpoints WHERE tenant_id = $1")
            .bind(new.tenant.as_str())
            .fetch_one(&mut *tx)
            .await?;
        if usize::try_from(count).unwrap_or(usize::MAX) >= max_per_tenant {
            return Ok(None);
        }
        sqlx::query(
            "INSERT INTO webhook_endpoints (id, tenant_id, url, types, description, secret, state, cursor, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, 'active',
                     COALESCE((SELECT last FROM event_seqs WHERE tenant_id = $2), 0), $7)",
        )
        .bind(&new.id)
        .bind(new.tenant.as_str())
        .bind(&new.url)
        .bind(types_to_db(&new.types))
        .bind(&new.description)
        .bind(new.secret.expose())
        .bind(new.created_at)
        .execute(&mut *tx)
        .await?;
        let created = endpoint_of(&mut tx, new.tenant.as_str(), &new.id).await?;
        tx.commit().await?;
        Ok(created)
    }

    async fn list_webhooks(&self, tenant: &TenantId) -> Result<Vec<Endpoint>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        sqlx::query(&format!(
            "SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE tenant_id = $1 ORDER BY id COLLATE \"C\" LIMIT 10000"
        ))
        .bind(tenant.as_str())
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|r| rows::endpoint(r))
        .collect()
    }

    async fn get_webhook(&self, tenant: &TenantId, id: &str) -> Result<Option<Endpoint>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        endpoint_of(&mut conn, tenant.as_str(), id).await
    }

    async fn delete_webhook(&self, tenant: &TenantId, id: &str) -> Result<bool, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        // Its queue and log go with it (ON DELETE CASCADE).
        let done = sqlx::query("DELETE FROM webhook_endpoints WHERE tenant_id = $1 AND id = $2")
            .bind(tenant.as_str())
            .bind(id)
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn rotate_webhook_secret(
        &self,
        tenant: &TenantId,
        id: &str,
        secret: &SigningSecret,
        previous_valid_until: i64,
    ) -> Result<Option<Endpoint>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let row = sqlx::query(&format!(
            "UPDATE webhook_endpoints SET previous_secret = secret, previous_valid_until = $3, secret = $4
              WHERE tenant_id = $1 AND id = $2 RETURNING {ENDPOINT_COLUMNS}"
        ))
        .bind(tenant.as_str())
        .bind(id)
        .bind(previous_valid_until)
        .bind(secret.expose())
        .fetch_optional(&mut *conn)
        .await?;
        row.as_ref().map(|r| rows::endpoint(r)).transpose()
    }

    async fn redeliver_webhook(
        &self,
        tenant: &TenantId,
        id: &str,
        what: &Redeliver,
        now_ms: i64,
    ) -> Result<Redelivered, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        redeliver(&mut conn, tenant.as_str(), id, what, now_ms).await
    }

    async fn webhook_attempts(
        &self,
        tenant: &TenantId,
        id: &str,
        before: Option<i64>,
        limit: u32,
    ) -> Result<Option<Vec<Attempt>>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        if endpoint_of(&mut conn, tenant.as_str(), id).await?.is_none() {
            return Ok(None);
        }
        let attempts = sqlx::query(&format!(
            "SELECT {ATTEMPT_COLUMNS} FROM webhook_attempts WHERE endpoint_id = $1 AND id < $2 ORDER BY id DESC LIMIT $3"
        ))
        .bind(id)
        .bind(before.unwrap_or(i64::MAX))
        .bind(i64::from(limit))
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|r| rows::attempt(r))
        .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(attempts))
    }

    async fn webhook_pending(&self, id: &str) -> Result<u64, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM webhook_deliveries WHERE endpoint_id = $1")
            .bind(id)
            .fetch_one(&mut *conn)
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn queue_webhook_deliveries(
        &self,
        now_ms: i64,
        after_endpoint: &str,
        limits: QueueLimits,
    ) -> Result<QueuePage, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        queue(&mut conn, now_ms, after_endpoint, limits).await
    }

    async fn claim_webhook_deliveries(
        &self,
        now_ms: i64,
        lease_until: i64,
        limit: u32,
        per_tenant: u32,
    ) -> Result<Vec<Claimed>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        sqlx::query(CLAIM_SQL)
            .bind(now_ms)
            .bind(lease_until)
            .bind(i64::from(limit))
            .bind(i64::from(per_tenant))
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|r| rows::claimed(r))
            .collect()
    }

    async fn finish_webhook_delivery(&self, finished: &Finished) -> Result<(), StorageError> {
        let mut conn = acquire(&self.pool).await?;
        finish(&mut conn, finished).await
    }

    async fn webhook_oldest_pending(&self) -> Result<Option<i64>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        Ok(sqlx::query_scalar(
            "SELECT MIN(d.event_at) FROM webhook_deliveries d
               JOIN webhook_endpoints w ON w.id = d.endpoint_id AND w.state = 'active'",
        )
        .fetch_one(&mut *conn)
        .await?)
    }

    async fn purge_webhook_attempts(&self, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let done = sqlx::query(
            "DELETE FROM webhook_attempts WHERE id IN (SELECT id FROM webhook_attempts WHERE at < $1 ORDER BY at LIMIT $2)",
        )
        .bind(before_ms)
        .bind(i64::from(limit))
        .execute(&mut *conn)
        .await?;
        Ok(done.rows_affected())
    }
}
