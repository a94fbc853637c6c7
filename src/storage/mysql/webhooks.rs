//! [`WebhookStore`] on MySQL / MariaDB, straight on the pool (webhook rows contend with no
//! order write, so the batcher has nothing to save). Several processes share the queue: a claim
//! picks due rows with a plain read, then, in a transaction, locks them `FOR UPDATE SKIP LOCKED`
//! (checking again that they are due and unleased), leases them and reads them back; a queueing
//! pass takes the endpoints it advances the same way, so two processes never queue the same
//! endpoint at once.
//!
//! A locking read locks the rows of every table it joins (MariaDB has no `FOR UPDATE OF t`),
//! and on MariaDB a subquery of an `INSERT` holds shared locks on what it reads. So the locking
//! statements here read other tables only through a `SELECT`'s subqueries, which lock nothing
//! (checked on MariaDB 10.11), and nothing here holds the `event_seqs` row the batcher numbers
//! a tenant's events on.

use std::sync::LazyLock;

use async_trait::async_trait;
use sqlx::mysql::{MySql, MySqlArguments};
use sqlx::query::Query;
use sqlx::{Connection, MySqlConnection};

use super::port::tuples;
use super::sql::translate;
use super::{acquire, MyStorage};
use crate::engine::TenantId;
use crate::storage::rows::Columns;
use crate::storage::webhooks::{self as rows, ATTEMPT_COLUMNS, ENDPOINT_COLUMNS};
use crate::storage::StorageError;
use crate::webhooks::{
    types_to_db, Attempt, Claimed, Endpoint, Finished, NewEndpoint, Next, QueueLimits, QueuePage, Redeliver,
    Redelivered, SigningSecret, WebhookStore,
};

/// [`ENDPOINT_COLUMNS`] with `cursor` quoted (MySQL reserves the word).
static ENDPOINT_COLS: LazyLock<String> = LazyLock::new(|| translate(ENDPOINT_COLUMNS).0);

/// A delivery's key: endpoint id and event seq.
type Key = (String, i64);

/// The keys (columns `endpoint_id, seq`) `query` reads.
async fn keys_of(
    query: Query<'_, MySql, MySqlArguments>,
    conn: &mut MySqlConnection,
) -> Result<Vec<Key>, StorageError> {
    let rows = query.fetch_all(conn).await?;
    rows.iter().map(|r| Ok((r.text("endpoint_id")?, r.int("seq")?))).collect()
}

/// `query` with each key bound as an `(endpoint_id, seq)` pair, in order.
fn bind_keys<'q>(query: Query<'q, MySql, MySqlArguments>, keys: &'q [Key]) -> Query<'q, MySql, MySqlArguments> {
    keys.iter().fold(query, |q, (endpoint_id, seq)| q.bind(endpoint_id).bind(seq))
}

async fn endpoint_of(conn: &mut MySqlConnection, tenant: &str, id: &str) -> Result<Option<Endpoint>, StorageError> {
    let row = sqlx::query(&format!(
        "SELECT {} FROM webhook_endpoints WHERE tenant_id = ? AND id = ?",
        ENDPOINT_COLS.as_str()
    ))
    .bind(tenant)
    .bind(id)
    .fetch_optional(conn)
    .await?;
    row.as_ref().map(|r| rows::endpoint(r)).transpose()
}

/// Most deliveries one claim takes, whatever it is asked: each is two placeholders in the
/// statements that lock, lease and read them back (MySQL allows 65,535 in one), and the delivery
/// job asks for at most `[events.webhooks] batch`, itself at most 10,000.
const MAX_CLAIM: u32 = 10_000;

/// The deliveries a claim tries to take (`endpoint_id, seq`), a plain read that locks nothing:
/// due and unleased, of an active endpoint, each the oldest queued of its endpoint and ordering
/// key. Each tenant gets at most the cap in flight (those it holds in any process count: the
/// subquery on `f`), its oldest due first (`pos`, its rank within the tenant); then the oldest
/// of all, up to the limit. Values: now three times, the cap, the limit. (MariaDB has no
/// LATERAL to take each tenant's first rows, hence the window.) Claims running at the same
/// moment each count only committed leases, so together they may overfill a tenant's room, as
/// on PostgreSQL; the next claims then take nothing of it until it is back under the cap.
const CANDIDATES_SQL: &str = "SELECT c.endpoint_id, c.seq FROM (
        SELECT q.endpoint_id, q.seq, q.due_at, q.tenant_id,
               ROW_NUMBER() OVER (PARTITION BY q.tenant_id ORDER BY q.due_at, q.seq) AS pos
          FROM webhook_deliveries q
          JOIN webhook_endpoints w ON w.id = q.endpoint_id
         WHERE w.state = 'active' AND q.due_at <= ? AND q.lease_until <= ?
           AND NOT EXISTS (SELECT 1 FROM webhook_deliveries p
                            WHERE p.endpoint_id = q.endpoint_id AND p.ordering_key = q.ordering_key
                              AND p.seq < q.seq)) c
     WHERE c.pos + (SELECT COUNT(*) FROM webhook_deliveries f
                     WHERE f.tenant_id = c.tenant_id AND f.lease_until > ?) <= ?
     ORDER BY c.due_at, c.seq LIMIT ?";

/// Claims due deliveries and returns them with their endpoint and event (see [`CANDIDATES_SQL`]
/// for which). Rows another process is claiming are skipped; a row it claimed or finished since
/// the candidates were read is skipped too, as the lock checks again that it is due and
/// unleased (a locking read sees the latest committed row). The leases commit in one
/// transaction: a claim dropped before its commit leases nothing, and a lease whose claimer is
/// gone runs out by itself.
async fn claim(
    conn: &mut MySqlConnection,
    now_ms: i64,
    lease_until: i64,
    limit: u32,
    per_tenant: u32,
) -> Result<Vec<Claimed>, StorageError> {
    let candidates = sqlx::query(CANDIDATES_SQL)
        .bind(now_ms)
        .bind(now_ms)
        .bind(now_ms)
        .bind(i64::from(per_tenant))
        .bind(i64::from(limit.min(MAX_CLAIM)));
    let candidates = keys_of(candidates, &mut *conn).await?;
    if candidates.is_empty() {
        return Ok(Vec::new());
    }
    let mut tx = conn.begin().await?;
    let lock = format!(
        "SELECT endpoint_id, seq FROM webhook_deliveries
          WHERE (endpoint_id, seq) IN ({}) AND due_at <= ? AND lease_until <= ?
          FOR UPDATE SKIP LOCKED",
        tuples(candidates.len(), 2)
    );
    let locked = keys_of(bind_keys(sqlx::query(&lock), &candidates).bind(now_ms).bind(now_ms), &mut tx).await?;
    if locked.is_empty() {
        tx.rollback().await?;
        return Ok(Vec::new());
    }
    let keys = tuples(locked.len(), 2);
    let lease = format!("UPDATE webhook_deliveries SET lease_until = ? WHERE (endpoint_id, seq) IN ({keys})");
    bind_keys(sqlx::query(&lease).bind(lease_until), &locked).execute(&mut *tx).await?;
    // READ COMMITTED: this reads the rows as this transaction left them, still locked by it (an
    // endpoint deleted meanwhile waits for them, so the join finds it).
    let read = format!(
        "SELECT d.endpoint_id, d.tenant_id, d.seq, d.attempts, d.window_start, d.lease_until,
                w.url, w.secret, w.previous_secret, w.previous_valid_until,
                e.id AS event_id, e.type, e.ordering_key, e.at, e.data
           FROM webhook_deliveries d JOIN webhook_endpoints w ON w.id = d.endpoint_id
           LEFT JOIN events e ON e.tenant_id = d.tenant_id AND e.seq = d.seq
          WHERE (d.endpoint_id, d.seq) IN ({keys})
          ORDER BY d.due_at, d.seq"
    );
    let claimed = bind_keys(sqlx::query(&read), &locked)
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| rows::claimed(r))
        .collect::<Result<Vec<_>, _>>()?;
    tx.commit().await?;
    Ok(claimed)
}

/// Queues one delivery; a duplicate (already queued) is left as it is and counts 0.
const INSERT_DELIVERY: &str =
    "INSERT IGNORE INTO webhook_deliveries (endpoint_id, seq, tenant_id, ordering_key, event_at, due_at)
     VALUES (?, ?, ?, ?, ?, ?)";

async fn queue(
    conn: &mut MySqlConnection,
    now_ms: i64,
    after: &str,
    limits: QueueLimits,
) -> Result<QueuePage, StorageError> {
    let mut tx = conn.begin().await?;
    // The tenant's last seq is read in a subquery, which takes no lock: a join would lock its
    // `event_seqs` row too (MySQL locks every joined table), stalling the tenant's event writes
    // for the whole pass.
    let behind = sqlx::query(
        "SELECT w.id, w.tenant_id, w.types, w.`cursor` FROM webhook_endpoints w
          WHERE w.state = 'active' AND w.id > ?
            AND w.`cursor` < (SELECT s.last FROM event_seqs s WHERE s.tenant_id = w.tenant_id)
          ORDER BY w.id LIMIT ?
          FOR UPDATE SKIP LOCKED",
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
        let pending: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM webhook_deliveries WHERE endpoint_id = ?")
            .bind(&endpoint.id)
            .fetch_one(&mut *tx)
            .await?;
        let room = u64::try_from(i64::from(limits.max_pending).saturating_sub(pending)).unwrap_or(0);
        let scanned = sqlx::query(
            "SELECT seq, type, ordering_key, at FROM events WHERE tenant_id = ? AND seq > ? ORDER BY seq LIMIT ?",
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
            sqlx::query("UPDATE webhook_endpoints SET `cursor` = ? WHERE id = ? AND `cursor` < ?")
                .bind(cursor)
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
         SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ? FROM DUAL WHERE EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = ?)",
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
    .bind(&f.endpoint_id)
    .execute(&mut *tx)
    .await?;
    let (due_at, window_start, failing) = match f.next {
        Next::Done => {
            sqlx::query("DELETE FROM webhook_deliveries WHERE endpoint_id = ? AND seq = ? AND lease_until = ?")
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
    // Rows matched, not changed (sqlx sets CLIENT_FOUND_ROWS): whether the claim still held.
    let kept = sqlx::query(
        "UPDATE webhook_deliveries SET attempts = attempts + 1, due_at = ?, window_start = ?, lease_until = 0
          WHERE endpoint_id = ? AND seq = ? AND lease_until = ?",
    )
    .bind(due_at)
    .bind(window_start)
    .bind(&f.endpoint_id)
    .bind(f.seq)
    .bind(f.lease_until)
    .execute(&mut *tx)
    .await?;
    if failing && kept.rows_affected() > 0 {
        sqlx::query(
            "UPDATE webhook_endpoints SET state = 'failing', failing_since = ? WHERE id = ? AND state = 'active'",
        )
        .bind(f.now_ms)
        .bind(&f.endpoint_id)
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
    let found: Option<i64> =
        sqlx::query_scalar("SELECT 1 FROM webhook_endpoints WHERE tenant_id = ? AND id = ? FOR UPDATE")
            .bind(tenant)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
    if found.is_none() {
        return Ok(Redelivered::EndpointNotFound);
    }
    let mut queued = 0;
    if let Some(event_id) = &what.event_id {
        let event = sqlx::query("SELECT seq, ordering_key, at FROM events WHERE tenant_id = ? AND id = ?")
            .bind(tenant)
            .bind(event_id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(event) = event else { return Ok(Redelivered::EventNotFound) };
        let Some(seq) = event.opt_int("seq")? else { return Ok(Redelivered::EventNotFound) };
        let (key, at) = (event.text("ordering_key")?, event.int("at")?);
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
        sqlx::query("UPDATE webhook_endpoints SET `cursor` = LEAST(`cursor`, ?) WHERE id = ?")
            .bind(after)
            .bind(id)
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query("UPDATE webhook_endpoints SET state = 'active', failing_since = NULL WHERE id = ?")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    sqlx::query("UPDATE webhook_deliveries SET due_at = ?, window_start = NULL WHERE endpoint_id = ?")
        .bind(now_ms)
        .bind(id)
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
        sqlx::query("SELECT id FROM tenants WHERE id = ? FOR UPDATE")
            .bind(new.tenant.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM webhook_endpoints WHERE tenant_id = ?")
            .bind(new.tenant.as_str())
            .fetch_one(&mut *tx)
            .await?;
        if usize::try_from(count).unwrap_or(usize::MAX) >= max_per_tenant {
            return Ok(None);
        }
        // Read on its own, without a lock: as a subquery of the INSERT it would hold the tenant's
        // `event_seqs` row shared to COMMIT, stalling the tenant's event writes. An event committed
        // after this read has a higher seq, so it is still delivered.
        let last: Option<i64> = sqlx::query_scalar("SELECT last FROM event_seqs WHERE tenant_id = ?")
            .bind(new.tenant.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO webhook_endpoints (id, tenant_id, url, types, description, secret, state, `cursor`, created_at)
             VALUES (?, ?, ?, ?, ?, ?, 'active', ?, ?)",
        )
        .bind(&new.id)
        .bind(new.tenant.as_str())
        .bind(&new.url)
        .bind(types_to_db(&new.types))
        .bind(&new.description)
        .bind(new.secret.expose())
        .bind(last.unwrap_or(0))
        .bind(new.created_at)
        .execute(&mut *tx)
        .await?;
        let created = endpoint_of(&mut tx, new.tenant.as_str(), &new.id).await?;
        tx.commit().await?;
        Ok(created)
    }

    async fn list_webhooks(&self, tenant: &TenantId) -> Result<Vec<Endpoint>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        // Ids are ascii_bin: ORDER BY compares bytes, as `COLLATE "C"` does on PostgreSQL.
        sqlx::query(&format!(
            "SELECT {} FROM webhook_endpoints WHERE tenant_id = ? ORDER BY id LIMIT 10000",
            ENDPOINT_COLS.as_str()
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
        let done = sqlx::query("DELETE FROM webhook_endpoints WHERE tenant_id = ? AND id = ?")
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
        let mut tx = conn.begin().await?;
        // MySQL assigns left to right, each seeing the ones before: `previous_secret` must come
        // first to take the secret being replaced.
        let done = sqlx::query(
            "UPDATE webhook_endpoints SET previous_secret = secret, previous_valid_until = ?, secret = ?
              WHERE tenant_id = ? AND id = ?",
        )
        .bind(previous_valid_until)
        .bind(secret.expose())
        .bind(tenant.as_str())
        .bind(id)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(None);
        }
        // The row as this rotation left it: still locked by it, so no other rotation in between.
        let rotated = endpoint_of(&mut tx, tenant.as_str(), id).await?;
        tx.commit().await?;
        Ok(rotated)
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
            "SELECT {ATTEMPT_COLUMNS} FROM webhook_attempts WHERE endpoint_id = ? AND id < ? ORDER BY id DESC LIMIT ?"
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
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM webhook_deliveries WHERE endpoint_id = ?")
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
        claim(&mut conn, now_ms, lease_until, limit, per_tenant).await
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
        // MySQL allows no LIMIT in an IN subquery, but a single-table DELETE takes its own.
        let done = sqlx::query("DELETE FROM webhook_attempts WHERE at < ? ORDER BY at LIMIT ?")
            .bind(before_ms)
            .bind(i64::from(limit))
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected())
    }
}
