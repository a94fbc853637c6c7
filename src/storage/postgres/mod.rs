//! The PostgreSQL backend, for production and for several `stockd` processes sharing one
//! database. Reads go straight to a connection pool (the ones that must agree with themselves
//! read one REPEATABLE READ snapshot). Writes go through one group-committing batcher task per
//! process ([`batcher`]); what they do is [`crate::apply`] over [`port::PgPort`], or plain SQL in
//! [`ops`] for tenants, keys and plugins.
//!
//! Correctness across processes comes from the database alone (guarded updates, the
//! idempotency row claimed first, `SKIP LOCKED`), never from the batcher: it only saves commits.

mod batcher;
pub mod ops;
pub mod port;
pub mod redis_store;

use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{ConnectOptions, Connection, Postgres, Row};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use self::batcher::{run_batcher, work, LockSet, Pending, PendingOrder, Queued, Work, ATTEMPT_DEADLINE};
use self::port::{reservation_from_row, resource_from_row, PgPort};
use super::rules::{
    self, bucket_rows, fold_all, preview_line, previewed, reconcile_rows, API_KEY_COLUMNS, BUCKET_COLUMNS,
    RESOURCE_COLUMNS, TENANT_COLUMNS,
};
use super::sqlite::writer::WriterLimits;
use super::{
    AdjustRefusal, ApiKeyRecord, IdempotencyRequest, Idempotent, Insert, NewApiKey, NewResource, OrderExecution,
    OrderJob, PluginUpload, PluginVersion, Storage, StorageError, TenantRecord, Transition,
};
use crate::apply::port::Port;
use crate::apply::{buckets, reservations, resources};
use crate::engine::{
    LedgerEntry, LedgerOp, OrderDocument, OrderRequest, Plan, Reconciliation, Reservation, ResourceKey, ResourceState,
    ResourceStatus, TenantId,
};
use crate::ratelimit::RateLimit;
use crate::storage::redis_store::{outcome_of, STORED_OUTCOME_SQL};
use crate::time::Timestamp;

/// How the PostgreSQL backend is opened.
#[derive(Debug, Clone)]
pub struct PgSettings {
    /// `postgres://user@host:port/database`.
    pub url: String,
    /// Pool size: the batcher holds one connection while it commits, reads share the rest.
    pub max_connections: u32,
    /// How long a read or a batch waits for a connection before answering `Unavailable`; also
    /// bounds connecting when the database is down.
    pub acquire_timeout: Duration,
    /// Batch size, queue depth and linger of the batcher (the same `[batch]` settings as SQLite).
    pub writer: WriterLimits,
    /// How many times a batch that failed for a transient reason is run again.
    pub max_retries: u32,
}

/// The PostgreSQL [`Storage`].
pub struct PgStorage {
    pool: PgPool,
    /// Taken by `close`, which makes the batcher drain its queue and stop.
    queue: Mutex<Option<mpsc::Sender<Box<dyn Queued>>>>,
    batcher: Mutex<Option<JoinHandle<()>>>,
}

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

async fn connect(settings: &PgSettings) -> Result<PgPool, StorageError> {
    let options = PgConnectOptions::from_str(&settings.url)
        .map_err(|e| StorageError::Internal(format!("bad PostgreSQL URL: {e}")))?
        .application_name("stockd")
        .log_statements(tracing::log::LevelFilter::Trace)
        // If this process loses the database mid-transaction (partition, freeze), the server
        // ends the session, and releases its row locks for the other processes, once it has
        // waited this long for our next statement; a live batch sends them back to back.
        .options([("idle_in_transaction_session_timeout", format!("{}ms", ATTEMPT_DEADLINE.as_millis()))]);
    Ok(PgPoolOptions::new()
        .max_connections(settings.max_connections.max(1))
        .acquire_timeout(settings.acquire_timeout)
        .connect_with(options)
        .await?)
}

/// A pooled connection, or `Unavailable` if none comes within `acquire_timeout`. Any failure
/// to get one is the database being unreachable from here (down, refusing connections,
/// shutting down), whatever its SQLSTATE: nothing was attempted, so the client may retry.
async fn acquire(pool: &PgPool) -> Result<PoolConnection<Postgres>, StorageError> {
    pool.acquire().await.map_err(|e| StorageError::Unavailable(format!("no database connection: {e}")))
}

async fn run_migrations(pool: &PgPool) -> Result<(), StorageError> {
    // sqlx holds an advisory lock while migrating, so processes starting together take turns.
    MIGRATOR.run(pool).await.map_err(|e| match e {
        sqlx::migrate::MigrateError::Execute(e) => StorageError::from(e),
        other => StorageError::Internal(format!("migration failed: {other}")),
    })
}

impl PgStorage {
    /// Connects, applies migrations and starts the batcher. Must run inside a Tokio runtime.
    pub async fn open(settings: &PgSettings) -> Result<Self, StorageError> {
        let pool = connect(settings).await?;
        run_migrations(&pool).await?;
        let (tx, rx) = mpsc::channel(settings.writer.queue_depth.max(1));
        let batcher = tokio::spawn(run_batcher(pool.clone(), rx, settings.writer, settings.max_retries));
        Ok(Self { pool, queue: Mutex::new(Some(tx)), batcher: Mutex::new(Some(batcher)) })
    }

    /// Applies migrations and returns, for `stockd migrate`.
    pub async fn migrate(settings: &PgSettings) -> Result<(), StorageError> {
        let pool = connect(settings).await?;
        run_migrations(&pool).await?;
        pool.close().await;
        Ok(())
    }

    fn queue(&self) -> Result<mpsc::Sender<Box<dyn Queued>>, StorageError> {
        self.queue
            .lock()
            .map_err(|_| StorageError::Internal("batcher handle poisoned".into()))?
            .clone()
            .ok_or_else(|| StorageError::Unavailable("shutting down".into()))
    }

    /// Runs `work` in the next batch and returns the result of its committed run. `locks`: the
    /// resource rows it will update, locked with the batch's others before any job runs.
    async fn submit<T: Send + 'static>(&self, locks: LockSet, work: Work<T>) -> Result<T, StorageError> {
        let (tx, rx) = oneshot::channel();
        let job: Box<dyn Queued> = Box::new(Pending { locks, work, result: None, reply: tx });
        self.queue()?.send(job).await.map_err(|_| StorageError::Unavailable("writer stopped".into()))?;
        rx.await.map_err(|_| StorageError::Unavailable("write was not committed".into()))?
    }
}

// ---------------------------------------------------------------------------------------------
// Reads
// ---------------------------------------------------------------------------------------------

/// A transaction that sees one snapshot and writes nothing, for reads made of several queries.
const SNAPSHOT: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";

fn ledger_from_row(row: &PgRow) -> Result<LedgerEntry, StorageError> {
    let op: &str = row.try_get("op")?;
    Ok(LedgerEntry {
        seq: row.try_get("seq")?,
        bucket: row.try_get("bucket")?,
        op: LedgerOp::from_db(op).ok_or_else(|| StorageError::Internal("unexpected ledger op".into()))?,
        qty: row.try_get("qty")?,
        request_id: row.try_get("request_id")?,
        order_id: row.try_get("order_id")?,
        reservation_id: row.try_get("reservation_id")?,
        available_after: row.try_get("available_after")?,
        reserved_after: row.try_get("reserved_after")?,
        consumed_after: row.try_get("consumed_after")?,
        plugin_version: row.try_get("plugin_version")?,
        at: Timestamp(row.try_get("at")?),
    })
}

#[async_trait]
impl Storage for PgStorage {
    async fn ready(&self) -> Result<(), StorageError> {
        let mut conn = acquire(&self.pool).await?;
        sqlx::query("SELECT 1 FROM resources LIMIT 1").fetch_optional(&mut *conn).await?;
        if self.queue()?.is_closed() {
            return Err(StorageError::Unavailable("writer stopped".into()));
        }
        Ok(())
    }

    async fn create_tenant(
        &self,
        id: &TenantId,
        name: &str,
        rate_limit: Option<RateLimit>,
        key: &NewApiKey,
        now_ms: i64,
    ) -> Result<Insert, StorageError> {
        let (id, name, key) = (id.clone(), name.to_string(), key.clone());
        self.submit(
            Vec::new(),
            work(move |conn| {
                let (id, name, key) = (id.clone(), name.clone(), key.clone());
                Box::pin(async move { ops::create_tenant(conn, &id, &name, rate_limit, &key, now_ms).await })
            }),
        )
        .await
    }

    async fn list_tenants(&self) -> Result<Vec<TenantRecord>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let rows = sqlx::query(&format!("SELECT {TENANT_COLUMNS} FROM tenants ORDER BY id COLLATE \"C\" LIMIT 10000"))
            .fetch_all(&mut *conn)
            .await?;
        rows.iter().map(rules::tenant_row).collect()
    }

    async fn add_api_key(&self, tenant: &TenantId, key: &NewApiKey, now_ms: i64) -> Result<Option<()>, StorageError> {
        let (tenant, key) = (tenant.clone(), key.clone());
        self.submit(
            Vec::new(),
            work(move |conn| {
                let (tenant, key) = (tenant.clone(), key.clone());
                Box::pin(async move { ops::add_api_key(conn, &tenant, &key, now_ms).await })
            }),
        )
        .await
    }

    async fn revoke_api_key(&self, tenant: &TenantId, key_id: &str, now_ms: i64) -> Result<Option<()>, StorageError> {
        let (tenant, key_id) = (tenant.clone(), key_id.to_string());
        self.submit(
            Vec::new(),
            work(move |conn| {
                let (tenant, key_id) = (tenant.clone(), key_id.clone());
                Box::pin(async move { ops::revoke_api_key(conn, &tenant, &key_id, now_ms).await })
            }),
        )
        .await
    }

    async fn find_api_key(&self, hash: &str) -> Result<Option<ApiKeyRecord>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let row = sqlx::query(&format!(
            "SELECT {API_KEY_COLUMNS} FROM api_keys k JOIN tenants t ON t.id = k.tenant_id
             WHERE k.hash = $1 AND k.revoked_at IS NULL"
        ))
        .bind(hash)
        .fetch_optional(&mut *conn)
        .await?;
        row.as_ref().map(rules::api_key_row).transpose()
    }

    async fn ensure_config_tenant(
        &self,
        id: &TenantId,
        name: &str,
        rate_limit: Option<RateLimit>,
        key_hash: &str,
        now_ms: i64,
    ) -> Result<(), StorageError> {
        let (id, name, key_hash) = (id.clone(), name.to_string(), key_hash.to_string());
        self.submit(
            Vec::new(),
            work(move |conn| {
                let (id, name, key_hash) = (id.clone(), name.clone(), key_hash.clone());
                Box::pin(
                    async move { ops::ensure_config_tenant(conn, &id, &name, rate_limit, &key_hash, now_ms).await },
                )
            }),
        )
        .await
    }

    async fn set_rate_limit(&self, tenant: &TenantId, limit: Option<RateLimit>) -> Result<Option<()>, StorageError> {
        let (rps, burst) = rules::rate_limit_columns(limit);
        let mut conn = acquire(&self.pool).await?;
        let updated = sqlx::query("UPDATE tenants SET rate_limit_rps = $1, rate_limit_burst = $2 WHERE id = $3")
            .bind(rps)
            .bind(burst)
            .bind(tenant.as_str())
            .execute(&mut *conn)
            .await?;
        Ok((updated.rows_affected() == 1).then_some(()))
    }

    async fn create_resource(
        &self,
        tenant: &TenantId,
        res: &NewResource,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError> {
        let (tenant, res) = (tenant.clone(), res.clone());
        self.submit(
            Vec::new(),
            work(move |conn| {
                let (tenant, res) = (tenant.clone(), res.clone());
                Box::pin(async move { resources::create(&mut PgPort::new(conn), &tenant, &res, None, now_ms).await })
            }),
        )
        .await
    }

    async fn get_resource(&self, tenant: &TenantId, key: &ResourceKey) -> Result<Option<ResourceState>, StorageError> {
        let sql = format!("SELECT {RESOURCE_COLUMNS} FROM resources WHERE tenant_id = $1 AND key = $2");
        let mut conn = acquire(&self.pool).await?;
        let mut tx = conn.begin_with(SNAPSHOT).await?;
        let row = sqlx::query(&sql).bind(tenant.as_str()).bind(key.as_str()).fetch_optional(&mut *tx).await?;
        let state = match row.as_ref().map(resource_from_row).transpose()? {
            Some(state) => Some(buckets::complete(&mut PgPort::new(&mut tx), tenant.as_str(), state).await?),
            None => None,
        };
        tx.commit().await?;
        Ok(state)
    }

    async fn list_resources(
        &self,
        tenant: &TenantId,
        prefix: Option<&str>,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<ResourceState>, StorageError> {
        // Keys are [A-Za-z0-9._:@-], so a prefix range needs no LIKE escaping: every key with
        // the prefix sorts in [prefix, prefix || chr(0x7f)) in byte order. COLLATE "C" makes the
        // comparisons and the page order bytewise whatever the database's default collation
        // (a linguistic one may ignore punctuation, and pages would skip or repeat keys).
        let prefix = prefix.unwrap_or("");
        let sql = format!(
            "SELECT {RESOURCE_COLUMNS} FROM resources
             WHERE tenant_id = $1 AND key COLLATE \"C\" >= $2 AND key COLLATE \"C\" < $3 AND key COLLATE \"C\" > $4
             ORDER BY key COLLATE \"C\" LIMIT $5"
        );
        let mut conn = acquire(&self.pool).await?;
        let rows = sqlx::query(&sql)
            .bind(tenant.as_str())
            .bind(prefix)
            .bind(format!("{prefix}\u{7f}"))
            .bind(after.unwrap_or(""))
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?;
        let mut states = Vec::with_capacity(rows.len());
        for row in &rows {
            let mut state =
                buckets::complete(&mut PgPort::new(&mut conn), tenant.as_str(), resource_from_row(row)?).await?;
            state.bucket_counts = None;
            states.push(state);
        }
        Ok(states)
    }

    async fn set_resource_status(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        status: ResourceStatus,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError> {
        let locks = vec![(tenant.to_string(), key.to_string())];
        let (tenant, key) = (tenant.clone(), key.clone());
        self.submit(
            locks,
            work(move |conn| {
                let (tenant, key) = (tenant.clone(), key.clone());
                Box::pin(
                    async move { resources::set_status(&mut PgPort::new(conn), &tenant, &key, status, now_ms).await },
                )
            }),
        )
        .await
    }

    async fn adjust(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        key: &ResourceKey,
        delta: i64,
        now_ms: i64,
    ) -> Result<Result<Idempotent, AdjustRefusal>, StorageError> {
        let locks = vec![(tenant.to_string(), key.to_string())];
        let (tenant, idem, key) = (tenant.clone(), idem.clone(), key.clone());
        self.submit(
            locks,
            work(move |conn| {
                let (tenant, idem, key) = (tenant.clone(), idem.clone(), key.clone());
                Box::pin(
                    async move { resources::adjust(&mut PgPort::new(conn), &tenant, &idem, &key, delta, now_ms).await },
                )
            }),
        )
        .await
    }

    async fn ledger_page(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        after: i64,
        limit: u32,
    ) -> Result<Option<Vec<LedgerEntry>>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let mut tx = conn.begin_with(SNAPSHOT).await?;
        let exists = sqlx::query("SELECT 1 FROM resources WHERE tenant_id = $1 AND key = $2")
            .bind(tenant.as_str())
            .bind(key.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Ok(None);
        }
        // Paging by `seq` is gap-free per resource: its ledger rows are written while the
        // resource row is locked, so they commit in `seq` order.
        let rows = sqlx::query(
            "SELECT seq, bucket, op, qty, request_id, order_id, reservation_id, available_after, reserved_after,
                    consumed_after, plugin_version, at
             FROM ledger WHERE tenant_id = $1 AND resource_key = $2 AND seq > $3 ORDER BY seq LIMIT $4",
        )
        .bind(tenant.as_str())
        .bind(key.as_str())
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        rows.iter().map(ledger_from_row).collect::<Result<Vec<_>, _>>().map(Some)
    }

    async fn stored_outcome(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
    ) -> Result<Option<Idempotent>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let row: Option<(String, i32, String, String)> = sqlx::query_as(STORED_OUTCOME_SQL)
            .bind(tenant.as_str())
            .bind(idem.key.as_str())
            .fetch_optional(&mut *conn)
            .await?;
        Ok(row.map(|(hash, code, kind, body)| outcome_of(idem, &hash, i64::from(code), &kind, body)))
    }

    async fn execute_order(&self, job: OrderJob, now_ms: i64) -> Result<OrderExecution, StorageError> {
        // Its resource rows are declared by the order itself (see `declared_rows`).
        let (reply, rx) = oneshot::channel();
        let order = PendingOrder { job: std::sync::Arc::new(job), now_ms, admitted: false, result: None, reply };
        self.queue()?.send(Box::new(order)).await.map_err(|_| StorageError::Unavailable("writer stopped".into()))?;
        rx.await.map_err(|_| StorageError::Unavailable("write was not committed".into()))?
    }

    async fn preview_order(
        &self,
        tenant: &TenantId,
        order: &OrderRequest,
        plan: &Plan,
    ) -> Result<OrderDocument, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let mut tx = conn.begin_with(SNAPSHOT).await?;
        let mut results = Vec::with_capacity(plan.lines.len());
        for line in &plan.lines {
            let used: Option<i64> = match &line.limit {
                Some(limit) => {
                    sqlx::query_scalar("SELECT used FROM user_limits WHERE tenant_id = $1 AND key = $2")
                        .bind(tenant.as_str())
                        .bind(limit.key.as_str())
                        .fetch_optional(&mut *tx)
                        .await?
                }
                None => None,
            };
            let mut views = Vec::with_capacity(line.targets.len());
            for target in &line.targets {
                let view = PgPort::new(&mut tx).view(tenant.as_str(), target.resource.as_str()).await?;
                views.push(previewed(target, view)?);
            }
            results.push(preview_line(line, used.unwrap_or(0), views));
        }
        tx.commit().await?;
        Ok(OrderDocument::build(order, plan, &results, None))
    }

    async fn get_reservation(&self, tenant: &TenantId, id: &str) -> Result<Option<Reservation>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let row = sqlx::query(
            "SELECT id, order_id, state, lines, expires_at FROM reservations WHERE tenant_id = $1 AND id = $2",
        )
        .bind(tenant.as_str())
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?;
        row.as_ref().map(reservation_from_row).transpose()
    }

    async fn confirm_reservation(&self, tenant: &TenantId, id: &str, now_ms: i64) -> Result<Transition, StorageError> {
        let (tenant, id) = (tenant.clone(), id.to_string());
        self.submit(
            Vec::new(),
            work(move |conn| {
                let (tenant, id) = (tenant.clone(), id.clone());
                Box::pin(async move { reservations::confirm(&mut PgPort::new(conn), &tenant, &id, now_ms).await })
            }),
        )
        .await
    }

    async fn release_reservation(&self, tenant: &TenantId, id: &str, now_ms: i64) -> Result<Transition, StorageError> {
        let (tenant, id) = (tenant.clone(), id.to_string());
        self.submit(
            Vec::new(),
            work(move |conn| {
                let (tenant, id) = (tenant.clone(), id.clone());
                Box::pin(async move { reservations::release(&mut PgPort::new(conn), &tenant, &id, now_ms).await })
            }),
        )
        .await
    }

    async fn expire_due(&self, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.submit(
            Vec::new(),
            work(move |conn| {
                Box::pin(async move { reservations::expire_due(&mut PgPort::new(conn), now_ms, limit).await })
            }),
        )
        .await
    }

    async fn rebalance_buckets(&self, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.submit(
            Vec::new(),
            work(move |conn| Box::pin(async move { buckets::rebalance(&mut PgPort::new(conn), now_ms, limit).await })),
        )
        .await
    }

    async fn reconcile(&self, tenant: Option<&TenantId>) -> Result<Reconciliation, StorageError> {
        // One snapshot: resources and ledger come from the same moment, so a commit landing
        // between the queries can never look like drift.
        let mut conn = acquire(&self.pool).await?;
        let mut tx = conn.begin_with(SNAPSHOT).await?;
        let tenant = tenant.map(TenantId::as_str);
        let sql = format!(
            "SELECT tenant_id, {RESOURCE_COLUMNS} FROM resources WHERE ($1::text IS NULL OR tenant_id = $1::text)
             ORDER BY tenant_id COLLATE \"C\", key COLLATE \"C\""
        );
        let resources = sqlx::query(&sql).bind(tenant).fetch_all(&mut *tx).await?;
        // SUM over BIGINT is NUMERIC in PostgreSQL; the cast fails (rather than wraps) on overflow.
        let sums = sqlx::query(
            "SELECT tenant_id, resource_key, bucket, op, SUM(qty)::BIGINT AS qty, COUNT(*) AS n FROM ledger
             WHERE ($1::text IS NULL OR tenant_id = $1::text) GROUP BY tenant_id, resource_key, bucket, op",
        )
        .bind(tenant)
        .fetch_all(&mut *tx)
        .await?;
        let latest = sqlx::query(
            "SELECT l.tenant_id, l.resource_key, l.bucket, l.available_after, l.reserved_after, l.consumed_after
             FROM ledger l
             JOIN (SELECT MAX(seq) AS seq FROM ledger WHERE ($1::text IS NULL OR tenant_id = $1::text)
                   GROUP BY tenant_id, resource_key, bucket) m
               ON l.seq = m.seq",
        )
        .bind(tenant)
        .fetch_all(&mut *tx)
        .await?;
        let buckets_read = sqlx::query(&format!(
            "SELECT {BUCKET_COLUMNS} FROM resource_buckets WHERE ($1::text IS NULL OR tenant_id = $1::text)
             ORDER BY tenant_id, resource_key, bucket"
        ))
        .bind(tenant)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;

        let mut resources = resources
            .iter()
            .map(|row| Ok((row.try_get("tenant_id")?, resource_from_row(row)?)))
            .collect::<Result<Vec<_>, StorageError>>()?;
        fold_all(&mut resources, bucket_rows(&buckets_read)?, true);
        reconcile_rows(resources, &sums, &latest)
    }

    async fn purge_idempotency(&self, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.submit(Vec::new(), work(move |conn| Box::pin(ops::purge_idempotency(conn, before_ms, limit)))).await
    }

    async fn save_plugin(
        &self,
        tenant: &TenantId,
        upload: &PluginUpload,
        now_ms: i64,
    ) -> Result<PluginVersion, StorageError> {
        let (tenant, upload) = (tenant.clone(), std::sync::Arc::new(upload.clone()));
        self.submit(
            Vec::new(),
            work(move |conn| {
                let (tenant, upload) = (tenant.clone(), upload.clone());
                Box::pin(async move { ops::save_plugin(conn, &tenant, &upload, now_ms).await })
            }),
        )
        .await
    }

    async fn list_plugins(&self, tenant: &TenantId) -> Result<Vec<PluginVersion>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let rows: Vec<(i64, String, String, i64, bool)> = sqlx::query_as(
            "SELECT p.version, p.sha256, p.config, p.uploaded_at, COALESCE(a.version = p.version, FALSE)
             FROM plugins p LEFT JOIN plugin_active a ON a.tenant_id = p.tenant_id
             WHERE p.tenant_id = $1 ORDER BY p.version LIMIT 10000",
        )
        .bind(tenant.as_str())
        .fetch_all(&mut *conn)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(version, sha256, config, uploaded_at_ms, active)| PluginVersion {
                version,
                sha256,
                config,
                uploaded_at_ms,
                active,
            })
            .collect())
    }

    async fn activate_plugin(&self, tenant: &TenantId, version: i64) -> Result<Option<PluginVersion>, StorageError> {
        let tenant = tenant.clone();
        self.submit(
            Vec::new(),
            work(move |conn| {
                let tenant = tenant.clone();
                Box::pin(async move { ops::activate_plugin(conn, &tenant, version).await })
            }),
        )
        .await
    }

    async fn active_plugin(&self, tenant: &TenantId) -> Result<Option<PluginVersion>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let row: Option<(i64, String, String, i64)> = sqlx::query_as(
            "SELECT p.version, p.sha256, p.config, p.uploaded_at FROM plugin_active a
             JOIN plugins p ON p.tenant_id = a.tenant_id AND p.version = a.version WHERE a.tenant_id = $1",
        )
        .bind(tenant.as_str())
        .fetch_optional(&mut *conn)
        .await?;
        Ok(row.map(|(version, sha256, config, uploaded_at_ms)| PluginVersion {
            version,
            sha256,
            config,
            uploaded_at_ms,
            active: true,
        }))
    }

    async fn plugin_wasm(&self, tenant: &TenantId, version: i64) -> Result<Option<Vec<u8>>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        Ok(sqlx::query_scalar("SELECT wasm FROM plugins WHERE tenant_id = $1 AND version = $2")
            .bind(tenant.as_str())
            .bind(version)
            .fetch_optional(&mut *conn)
            .await?)
    }

    async fn close(&self) {
        // Dropping the last sender lets the batcher commit what is queued and stop.
        if let Ok(mut queue) = self.queue.lock() {
            queue.take();
        }
        let batcher = self.batcher.lock().ok().and_then(|mut b| b.take());
        if let Some(batcher) = batcher {
            if let Err(err) = batcher.await {
                tracing::error!(error = %err, "the batcher task failed");
            }
        }
        self.pool.close().await;
    }
}
