//! [`WebhookStore`] on SQLite: writes through the one writer (a single process owns the
//! database, so a claim needs no lock beyond the writer's turn), reads on the read connections.

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension};

use super::port::{all, mapped};
use super::SqliteStorage;
use crate::engine::TenantId;
use crate::storage::webhooks::{self as rows, ATTEMPT_COLUMNS, ENDPOINT_COLUMNS};
use crate::storage::StorageError;
use crate::webhooks::{
    types_to_db, Attempt, Claimed, Endpoint, Finished, NewEndpoint, Next, QueueLimits, QueuePage, Redeliver,
    Redelivered, SigningSecret, WebhookStore,
};

/// The claimed deliveries with their endpoint and event (see [`rows::claimed`]).
const CLAIMED_SQL: &str = "SELECT d.endpoint_id, d.tenant_id, d.seq, d.attempts, d.window_start, d.lease_until,
        w.url, w.secret, w.previous_secret, w.previous_valid_until,
        e.id AS event_id, e.type, e.ordering_key, e.at, e.data
   FROM webhook_deliveries d JOIN webhook_endpoints w ON w.id = d.endpoint_id
   LEFT JOIN events e ON e.tenant_id = d.tenant_id AND e.seq = d.seq
  WHERE d.endpoint_id = ?1 AND d.seq = ?2";

fn endpoint_of(conn: &Connection, tenant: &str, id: &str) -> Result<Option<Endpoint>, StorageError> {
    let sql = format!("SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE tenant_id = ?1 AND id = ?2");
    conn.prepare_cached(&sql)?.query_row(params![tenant, id], mapped(rows::endpoint)).optional()?.transpose()
}

fn create(conn: &Connection, new: &NewEndpoint, max: usize) -> Result<Option<Endpoint>, StorageError> {
    let tenant = new.tenant.as_str();
    let count: i64 = conn
        .prepare_cached("SELECT COUNT(*) FROM webhook_endpoints WHERE tenant_id = ?1")?
        .query_row(params![tenant], |row| row.get(0))?;
    if usize::try_from(count).unwrap_or(usize::MAX) >= max {
        return Ok(None);
    }
    conn.prepare_cached(
        "INSERT INTO webhook_endpoints (id, tenant_id, url, types, description, secret, state, cursor, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'active',
                 COALESCE((SELECT last FROM event_seqs WHERE tenant_id = ?2), 0), ?7)",
    )?
    .execute(params![
        new.id,
        tenant,
        new.url,
        types_to_db(&new.types),
        new.description,
        new.secret.expose(),
        new.created_at
    ])?;
    endpoint_of(conn, tenant, &new.id)
}

fn redeliver(
    conn: &Connection,
    tenant: &str,
    id: &str,
    what: &Redeliver,
    now_ms: i64,
) -> Result<Redelivered, StorageError> {
    if endpoint_of(conn, tenant, id)?.is_none() {
        return Ok(Redelivered::EndpointNotFound);
    }
    let mut queued = 0;
    if let Some(event_id) = &what.event_id {
        let event: Option<(i64, String, i64)> = conn
            .prepare_cached("SELECT seq, ordering_key, at FROM events WHERE tenant_id = ?1 AND id = ?2")?
            .query_row(params![tenant, event_id], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
            .optional()?;
        let Some((seq, key, at)) = event else { return Ok(Redelivered::EventNotFound) };
        queued = conn
            .prepare_cached(
                "INSERT INTO webhook_deliveries (endpoint_id, seq, tenant_id, ordering_key, event_at, due_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT DO NOTHING",
            )?
            .execute(params![id, seq, tenant, key, at, now_ms])? as u64;
    }
    if let Some(after) = what.after {
        conn.prepare_cached("UPDATE webhook_endpoints SET cursor = MIN(cursor, ?2) WHERE id = ?1")?
            .execute(params![id, after])?;
    }
    conn.prepare_cached("UPDATE webhook_endpoints SET state = 'active', failing_since = NULL WHERE id = ?1")?
        .execute(params![id])?;
    conn.prepare_cached("UPDATE webhook_deliveries SET due_at = ?2, window_start = NULL WHERE endpoint_id = ?1")?
        .execute(params![id, now_ms])?;
    Ok(Redelivered::Queued(queued))
}

fn queue(conn: &Connection, now_ms: i64, after: &str, limits: QueueLimits) -> Result<QueuePage, StorageError> {
    let behind = all(
        &mut conn.prepare_cached(
            "SELECT w.id, w.tenant_id, w.types, w.cursor FROM webhook_endpoints w
               JOIN event_seqs s ON s.tenant_id = w.tenant_id
              WHERE w.state = 'active' AND w.cursor < s.last AND w.id > ?1
              ORDER BY w.id LIMIT ?2",
        )?,
        params![after, i64::from(limits.endpoints)],
        rows::behind,
    )?;
    let mut page = QueuePage::default();
    for endpoint in &behind {
        let pending: i64 = conn
            .prepare_cached("SELECT COUNT(*) FROM webhook_deliveries WHERE endpoint_id = ?1")?
            .query_row(params![endpoint.id], |row| row.get(0))?;
        let room = u64::try_from(i64::from(limits.max_pending).saturating_sub(pending)).unwrap_or(0);
        let scanned = all(
            &mut conn.prepare_cached(
                "SELECT seq, type, ordering_key, at FROM events WHERE tenant_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
            )?,
            params![endpoint.tenant, endpoint.cursor, i64::from(limits.events)],
            rows::scanned,
        )?;
        let (take, cursor) = rows::plan_queue(&endpoint.types, &scanned, room);
        let mut insert = conn.prepare_cached(
            "INSERT INTO webhook_deliveries (endpoint_id, seq, tenant_id, ordering_key, event_at, due_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT DO NOTHING",
        )?;
        for e in take {
            page.queued +=
                insert.execute(params![endpoint.id, e.seq, endpoint.tenant, e.ordering_key, e.at, now_ms])? as u64;
        }
        if let Some(cursor) = cursor {
            conn.prepare_cached("UPDATE webhook_endpoints SET cursor = ?2 WHERE id = ?1 AND cursor < ?2")?
                .execute(params![endpoint.id, cursor])?;
        }
    }
    if behind.len() >= limits.endpoints as usize {
        page.last_endpoint = behind.last().map(|b| b.id.clone());
    }
    Ok(page)
}

fn claim(conn: &Connection, now_ms: i64, lease_until: i64, limit: u32) -> Result<Vec<Claimed>, StorageError> {
    let picked: Vec<(String, i64)> = conn
        .prepare_cached(
            "SELECT q.endpoint_id, q.seq FROM webhook_deliveries q
               JOIN webhook_endpoints w ON w.id = q.endpoint_id
              WHERE w.state = 'active' AND q.due_at <= ?1 AND q.lease_until <= ?1
                AND NOT EXISTS (SELECT 1 FROM webhook_deliveries p
                                 WHERE p.endpoint_id = q.endpoint_id AND p.ordering_key = q.ordering_key
                                   AND p.seq < q.seq)
              ORDER BY q.due_at, q.seq LIMIT ?2",
        )?
        .query_map(params![now_ms, i64::from(limit)], |row| Ok((row.get(0)?, row.get(1)?)))?
        .collect::<Result<_, _>>()?;
    let mut claimed = Vec::with_capacity(picked.len());
    for (endpoint_id, seq) in picked {
        conn.prepare_cached("UPDATE webhook_deliveries SET lease_until = ?3 WHERE endpoint_id = ?1 AND seq = ?2")?
            .execute(params![endpoint_id, seq, lease_until])?;
        let row = conn.prepare_cached(CLAIMED_SQL)?.query_row(params![endpoint_id, seq], mapped(rows::claimed))?;
        claimed.push(row?);
    }
    Ok(claimed)
}

fn finish(conn: &Connection, f: &Finished) -> Result<(), StorageError> {
    let a = &f.attempt;
    // Recorded whatever became of the claim: the attempt was made. Not for a deleted endpoint.
    conn.prepare_cached(
        "INSERT INTO webhook_attempts (endpoint_id, event_id, seq, type, attempt, at, outcome, http_status, error, latency_ms)
         SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10 WHERE EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = ?1)",
    )?
    .execute(params![
        f.endpoint_id,
        a.event_id,
        f.seq,
        a.kind,
        a.attempt,
        a.at,
        a.outcome.as_str(),
        a.http_status,
        a.error,
        a.latency_ms
    ])?;
    match f.next {
        Next::Done => {
            conn.prepare_cached(
                "DELETE FROM webhook_deliveries WHERE endpoint_id = ?1 AND seq = ?2 AND lease_until = ?3",
            )?
            .execute(params![f.endpoint_id, f.seq, f.lease_until])?;
        }
        Next::Retry { due_at, window_start } => {
            conn.prepare_cached(
                "UPDATE webhook_deliveries SET attempts = attempts + 1, due_at = ?4, window_start = ?5, lease_until = 0
                  WHERE endpoint_id = ?1 AND seq = ?2 AND lease_until = ?3",
            )?
            .execute(params![f.endpoint_id, f.seq, f.lease_until, due_at, window_start])?;
        }
        Next::EndpointFailing { window_start } => {
            let kept = conn
                .prepare_cached(
                    "UPDATE webhook_deliveries SET attempts = attempts + 1, due_at = ?4, window_start = ?5, lease_until = 0
                      WHERE endpoint_id = ?1 AND seq = ?2 AND lease_until = ?3",
                )?
                .execute(params![f.endpoint_id, f.seq, f.lease_until, f.now_ms, window_start])?;
            if kept > 0 {
                conn.prepare_cached(
                    "UPDATE webhook_endpoints SET state = 'failing', failing_since = ?2 WHERE id = ?1 AND state = 'active'",
                )?
                .execute(params![f.endpoint_id, f.now_ms])?;
            }
        }
    }
    Ok(())
}

#[async_trait]
impl WebhookStore for SqliteStorage {
    async fn create_webhook(&self, new: &NewEndpoint, max_per_tenant: usize) -> Result<Option<Endpoint>, StorageError> {
        let new = new.clone();
        self.writer()?.submit(move |conn| create(conn, &new, max_per_tenant)).await
    }

    async fn list_webhooks(&self, tenant: &TenantId) -> Result<Vec<Endpoint>, StorageError> {
        let tenant = tenant.clone();
        self.readers()
            .snapshot(move |conn| {
                let sql = format!(
                    "SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE tenant_id = ?1 ORDER BY id LIMIT 10000"
                );
                all(&mut conn.prepare_cached(&sql)?, params![tenant.as_str()], rows::endpoint)
            })
            .await
    }

    async fn get_webhook(&self, tenant: &TenantId, id: &str) -> Result<Option<Endpoint>, StorageError> {
        let (tenant, id) = (tenant.clone(), id.to_string());
        self.readers().snapshot(move |conn| endpoint_of(conn, tenant.as_str(), &id)).await
    }

    async fn delete_webhook(&self, tenant: &TenantId, id: &str) -> Result<bool, StorageError> {
        let (tenant, id) = (tenant.clone(), id.to_string());
        self.writer()?
            .submit(move |conn| {
                if endpoint_of(conn, tenant.as_str(), &id)?.is_none() {
                    return Ok(false);
                }
                conn.prepare_cached("DELETE FROM webhook_attempts WHERE endpoint_id = ?1")?.execute(params![id])?;
                conn.prepare_cached("DELETE FROM webhook_deliveries WHERE endpoint_id = ?1")?.execute(params![id])?;
                conn.prepare_cached("DELETE FROM webhook_endpoints WHERE id = ?1")?.execute(params![id])?;
                Ok(true)
            })
            .await
    }

    async fn rotate_webhook_secret(
        &self,
        tenant: &TenantId,
        id: &str,
        secret: &SigningSecret,
        previous_valid_until: i64,
    ) -> Result<Option<Endpoint>, StorageError> {
        let (tenant, id, secret) = (tenant.clone(), id.to_string(), secret.clone());
        self.writer()?
            .submit(move |conn| {
                conn.prepare_cached(
                    "UPDATE webhook_endpoints SET previous_secret = secret, previous_valid_until = ?3, secret = ?4
                      WHERE tenant_id = ?1 AND id = ?2",
                )?
                .execute(params![tenant.as_str(), id, previous_valid_until, secret.expose()])?;
                endpoint_of(conn, tenant.as_str(), &id)
            })
            .await
    }

    async fn redeliver_webhook(
        &self,
        tenant: &TenantId,
        id: &str,
        what: &Redeliver,
        now_ms: i64,
    ) -> Result<Redelivered, StorageError> {
        let (tenant, id, what) = (tenant.clone(), id.to_string(), what.clone());
        self.writer()?.submit(move |conn| redeliver(conn, tenant.as_str(), &id, &what, now_ms)).await
    }

    async fn webhook_attempts(
        &self,
        tenant: &TenantId,
        id: &str,
        before: Option<i64>,
        limit: u32,
    ) -> Result<Option<Vec<Attempt>>, StorageError> {
        let (tenant, id) = (tenant.clone(), id.to_string());
        self.readers()
            .snapshot(move |conn| {
                if endpoint_of(conn, tenant.as_str(), &id)?.is_none() {
                    return Ok(None);
                }
                let sql = format!(
                    "SELECT {ATTEMPT_COLUMNS} FROM webhook_attempts WHERE endpoint_id = ?1 AND id < ?2
                      ORDER BY id DESC LIMIT ?3"
                );
                let before = before.unwrap_or(i64::MAX);
                Ok(Some(all(&mut conn.prepare_cached(&sql)?, params![id, before, i64::from(limit)], rows::attempt)?))
            })
            .await
    }

    async fn webhook_pending(&self, id: &str) -> Result<u64, StorageError> {
        let id = id.to_string();
        self.readers()
            .snapshot(move |conn| {
                let n: i64 = conn
                    .prepare_cached("SELECT COUNT(*) FROM webhook_deliveries WHERE endpoint_id = ?1")?
                    .query_row(params![id], |row| row.get(0))?;
                Ok(u64::try_from(n).unwrap_or(0))
            })
            .await
    }

    async fn queue_webhook_deliveries(
        &self,
        now_ms: i64,
        after_endpoint: &str,
        limits: QueueLimits,
    ) -> Result<QueuePage, StorageError> {
        let after = after_endpoint.to_string();
        self.writer()?.submit(move |conn| queue(conn, now_ms, &after, limits)).await
    }

    async fn claim_webhook_deliveries(
        &self,
        now_ms: i64,
        lease_until: i64,
        limit: u32,
    ) -> Result<Vec<Claimed>, StorageError> {
        self.writer()?.submit(move |conn| claim(conn, now_ms, lease_until, limit)).await
    }

    async fn finish_webhook_delivery(&self, finished: &Finished) -> Result<(), StorageError> {
        let finished = finished.clone();
        self.writer()?.submit(move |conn| finish(conn, &finished)).await
    }

    async fn webhook_oldest_pending(&self) -> Result<Option<i64>, StorageError> {
        self.readers()
            .snapshot(|conn| {
                Ok(conn
                    .prepare_cached(
                        "SELECT MIN(d.event_at) FROM webhook_deliveries d
                           JOIN webhook_endpoints w ON w.id = d.endpoint_id AND w.state = 'active'",
                    )?
                    .query_row([], |row| row.get(0))?)
            })
            .await
    }

    async fn purge_webhook_attempts(&self, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.writer()?
            .submit(move |conn| {
                let n = conn
                    .prepare_cached(
                        "DELETE FROM webhook_attempts WHERE id IN
                           (SELECT id FROM webhook_attempts WHERE at < ?1 ORDER BY at LIMIT ?2)",
                    )?
                    .execute(params![before_ms, i64::from(limit)])?;
                Ok(n as u64)
            })
            .await
    }
}
