//! The MySQL / MariaDB backend (InnoDB), for teams that run MySQL already and for several
//! `stockd` processes sharing one database. The same shape as the PostgreSQL backend: reads go
//! straight to a connection pool (the ones that must agree with themselves read one consistent
//! snapshot); writes go through one group-committing batcher task per process ([`batcher`]);
//! what they do is [`crate::apply`] over [`port::MyPort`], or plain SQL in [`ops`].
//!
//! Isolation and locking, chosen deliberately (docs/MYSQL.md): every session runs READ COMMITTED,
//! so a statement reads the latest committed rows (a duplicate idempotency key found after
//! waiting on its lock is read as committed, not from an older snapshot) and InnoDB takes no gap
//! or next-key locks for our range reads and inserts, the classic source of deadlocks between
//! concurrent inserters of the ledger and idempotency tables. Rows are locked in one global order
//! (see the batcher); a deadlock or lock wait timeout that still happens is transient: the whole
//! batch is rolled back and run again, as on PostgreSQL.

mod batcher;
mod events;
pub mod ops;
pub mod port;
pub mod redis_store;
mod sinks;
mod sql;
mod webhooks;

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::pool::PoolConnection;
use sqlx::MySqlConnection;
use sqlx::{ConnectOptions, Connection, MySql};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use self::batcher::My;
use super::batcher::{run_batcher, LockSet, Pending, PendingMove, PendingOrder, Queued, ATTEMPT_DEADLINE};

/// A write of this backend's batcher.
type Work<T> = super::batcher::Work<My, T>;

/// Helps type inference see a closure as a [`Work`] (the higher-ranked lifetime needs a hint).
pub(super) fn work<T, F>(f: F) -> Work<T>
where
    F: for<'c> Fn(&'c mut MySqlConnection) -> futures::future::BoxFuture<'c, Result<T, StorageError>>
        + Send
        + Sync
        + 'static,
{
    Box::new(f)
}
use self::port::MyPort;
use super::rows::{self, API_KEY_COLUMNS, TENANT_COLUMNS};
use super::sqlite::writer::WriterLimits;
use super::ApiKeyInfo;
use super::Holding;
use super::{
    AdjustRefusal, ApiKeyRecord, IdempotencyRequest, Idempotent, Insert, ModeFence, NewApiKey, NewResource,
    OrderExecution, OrderJob, PageFrom, PluginUpload, PluginVersion, SinkBacklog, SinkClaim, Storage, StorageError,
    TenantRecord, Transition,
};
use crate::apply::batch::MoveJob;
use crate::apply::port::Port;
use crate::apply::reversals::{ReversalJob, Reversed};
use crate::apply::{buckets, reads, reservations, resources, reversals};
use crate::engine::reversal::OrderLedger;
use crate::engine::OrderId;
use crate::engine::{
    LedgerEntry, OrderDocument, OrderRequest, Pass, Plan, Reconciliation, Reservation, ReservationState, ResourceKey,
    ResourceState, ResourceStatus, TenantId,
};
use crate::events::{Event, EventType};
use crate::ratelimit::RateLimit;
use crate::storage::redis_store::STORED_OUTCOME_SQL;

/// How the MySQL backend is opened.
#[derive(Debug, Clone)]
pub struct MySettings {
    /// `mysql://user:password@host:port/database`.
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

/// The MySQL [`Storage`].
pub struct MyStorage {
    pool: MySqlPool,
    /// Taken by `close`, which makes the batcher drain its queue and stop.
    queue: Mutex<Option<mpsc::Sender<Box<dyn Queued<My>>>>>,
    batcher: Mutex<Option<JoinHandle<()>>>,
}

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/mysql");

/// How long a statement waits for a row lock before it fails (transient: the batch runs again).
/// Far under [`ATTEMPT_DEADLINE`]: a healthy batch holds its locks for milliseconds.
const LOCK_WAIT_SECONDS: u32 = 5;

async fn connect(settings: &MySettings) -> Result<MySqlPool, StorageError> {
    let options = MySqlConnectOptions::from_str(&settings.url)
        .map_err(|e| StorageError::Internal(format!("bad MySQL URL: {e}")))?
        .charset("utf8mb4")
        .log_statements(tracing::log::LevelFilter::Trace);
    Ok(MySqlPoolOptions::new()
        .max_connections(settings.max_connections.max(1))
        .acquire_timeout(settings.acquire_timeout)
        .after_connect(|conn, _| Box::pin(async move { configure_session(conn).await }))
        .connect_with(options)
        .await?)
}

/// Every session: READ COMMITTED (see the module docs), a bounded lock wait, and, where the
/// server has it (MariaDB), an end to a transaction left idle: if this process loses the
/// database mid-batch (partition, freeze), the server rolls back and frees its row locks for the
/// other processes once it has waited that long for our next statement.
async fn configure_session(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(&mut *conn).await?;
    sqlx::query(&format!("SET SESSION innodb_lock_wait_timeout = {LOCK_WAIT_SECONDS}")).execute(&mut *conn).await?;
    let idle = format!("SET SESSION idle_transaction_timeout = {}", ATTEMPT_DEADLINE.as_secs());
    if let Err(err) = sqlx::query(&idle).execute(&mut *conn).await {
        // MySQL 8 has no such variable (error 1193); the locks then last until the connection
        // drops. Anything else is a real failure.
        match &err {
            sqlx::Error::Database(db) if db.code().as_deref() == Some("HY000") => {}
            _ => return Err(err),
        }
    }
    Ok(())
}

/// A pooled connection, or `Unavailable` if none comes within `acquire_timeout`. Any failure
/// to get one is the database being unreachable from here (down, refusing connections,
/// shutting down), whatever its SQLSTATE: nothing was attempted, so the client may retry.
async fn acquire(pool: &MySqlPool) -> Result<PoolConnection<MySql>, StorageError> {
    pool.acquire().await.map_err(|e| StorageError::Unavailable(format!("no database connection: {e}")))
}

async fn run_migrations(pool: &MySqlPool) -> Result<(), StorageError> {
    // sqlx holds an advisory lock while migrating, so processes starting together take turns.
    MIGRATOR.run(pool).await.map_err(|e| match e {
        sqlx::migrate::MigrateError::Execute(e) => StorageError::from(e),
        other => StorageError::Internal(format!("migration failed: {other}")),
    })
}

impl MyStorage {
    /// Connects, applies migrations and starts the batcher. Must run inside a Tokio runtime.
    pub async fn open(settings: &MySettings) -> Result<Self, StorageError> {
        let pool = connect(settings).await?;
        run_migrations(&pool).await?;
        let (tx, rx) = mpsc::channel(settings.writer.queue_depth.max(1));
        let batcher = tokio::spawn(run_batcher(pool.clone(), rx, settings.writer, settings.max_retries));
        Ok(Self { pool, queue: Mutex::new(Some(tx)), batcher: Mutex::new(Some(batcher)) })
    }

    /// Applies migrations and returns, for `stockd migrate`.
    pub async fn migrate(settings: &MySettings) -> Result<(), StorageError> {
        let pool = connect(settings).await?;
        run_migrations(&pool).await?;
        pool.close().await;
        Ok(())
    }

    fn queue(&self) -> Result<mpsc::Sender<Box<dyn Queued<My>>>, StorageError> {
        self.queue
            .lock()
            .map_err(|_| StorageError::Internal("batcher handle poisoned".into()))?
            .clone()
            .ok_or_else(|| StorageError::Unavailable("shutting down".into()))
    }

    /// Runs `work` in the next batch and returns the result of its committed run. `locks`: the
    /// resource rows it will update, locked with the batch's others before any job runs.
    /// Queues a reservation's confirm or release, which the batch decides with its orders where
    /// it can (see the batcher).
    async fn submit_move(&self, job: MoveJob, now_ms: i64) -> Result<Transition, StorageError> {
        let (reply, rx) = oneshot::channel();
        let queued: Box<dyn Queued<My>> = Box::new(PendingMove::new(job, now_ms, reply));
        self.queue()?.send(queued).await.map_err(|_| StorageError::Unavailable("writer stopped".into()))?;
        rx.await.map_err(|_| StorageError::Unavailable("write was not committed".into()))?
    }

    async fn submit<T: Send + 'static>(&self, locks: LockSet, work: Work<T>) -> Result<T, StorageError> {
        let (tx, rx) = oneshot::channel();
        let job: Box<dyn Queued<My>> = Box::new(Pending { locks, work, result: None, reply: tx });
        self.queue()?.send(job).await.map_err(|_| StorageError::Unavailable("writer stopped".into()))?;
        rx.await.map_err(|_| StorageError::Unavailable("write was not committed".into()))?
    }
}

// ---------------------------------------------------------------------------------------------
// Reads
// ---------------------------------------------------------------------------------------------

/// A transaction that sees one snapshot and writes nothing, for reads made of several queries.
///
/// MySQL cannot set the isolation of one transaction in its BEGIN: the next transaction of the
/// session is set to REPEATABLE READ first, and a consistent snapshot started at once.
async fn snapshot(conn: &mut MySqlConnection) -> Result<sqlx::Transaction<'_, MySql>, StorageError> {
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY").execute(&mut *conn).await?;
    Ok(conn.begin_with("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY").await?)
}

#[async_trait]
impl Storage for MyStorage {
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
        let rows = sqlx::query(&format!("SELECT {TENANT_COLUMNS} FROM tenants ORDER BY id LIMIT 10000"))
            .fetch_all(&mut *conn)
            .await?;
        rows.iter().map(|row| rows::tenant(row)).collect()
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

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Option<Vec<ApiKeyInfo>>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let list = sql::translate(rows::LIST_API_KEYS_SQL);
        let args = [sql::Arg::Text(tenant.as_str()), sql::Arg::Int(rows::MAX_API_KEYS_LISTED)];
        let keys = sql::bind_all(&list, &args).fetch_all(&mut *conn).await?;
        let exists = sql::translate(rows::TENANT_EXISTS_SQL);
        if keys.is_empty() && sql::bind_all(&exists, &args[..1]).fetch_optional(&mut *conn).await?.is_none() {
            return Ok(None);
        }
        keys.iter().map(|row| rows::api_key_info(row)).collect::<Result<_, _>>().map(Some)
    }

    async fn find_api_key(&self, hash: &str) -> Result<Option<ApiKeyRecord>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let row = sqlx::query(&format!(
            "SELECT {API_KEY_COLUMNS} FROM api_keys k JOIN tenants t ON t.id = k.tenant_id
             WHERE k.hash = ? AND k.revoked_at IS NULL"
        ))
        .bind(hash)
        .fetch_optional(&mut *conn)
        .await?;
        row.as_ref().map(|row| rows::api_key(row)).transpose()
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
        let (rps, burst) = crate::storage::rules::rate_limit_columns(limit);
        let mut conn = acquire(&self.pool).await?;
        let updated = sqlx::query("UPDATE tenants SET rate_limit_rps = ?, rate_limit_burst = ? WHERE id = ?")
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
                Box::pin(async move { resources::create(&mut MyPort::new(conn), &tenant, &res, None, now_ms).await })
            }),
        )
        .await
    }

    async fn resource_holding(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        ids: &[String],
    ) -> Result<Holding, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let mut tx = snapshot(&mut conn).await?;
        let read = reads::resource_holding(&mut MyPort::new(&mut tx), tenant, key.as_str(), ids).await?;
        tx.commit().await?;
        Ok(read)
    }

    async fn list_resources(
        &self,
        tenant: &TenantId,
        prefix: Option<&str>,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<ResourceState>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let mut tx = snapshot(&mut conn).await?;
        let page = reads::resources(&mut MyPort::new(&mut tx), tenant, prefix, after, limit).await?;
        tx.commit().await?;
        Ok(page)
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
                    async move { resources::set_status(&mut MyPort::new(conn), &tenant, &key, status, now_ms).await },
                )
            }),
        )
        .await
    }

    async fn set_low_stock(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        low_stock: Option<i64>,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError> {
        let locks = vec![(tenant.to_string(), key.to_string())];
        let (tenant, key) = (tenant.clone(), key.clone());
        self.submit(
            locks,
            work(move |conn| {
                let (tenant, key) = (tenant.clone(), key.clone());
                Box::pin(async move {
                    resources::set_low_stock(&mut MyPort::new(conn), &tenant, &key, low_stock, now_ms).await
                })
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
        fence: ModeFence,
        now_ms: i64,
    ) -> Result<Result<Idempotent, AdjustRefusal>, StorageError> {
        let locks = vec![(tenant.to_string(), key.to_string())];
        let (tenant, idem, key) = (tenant.clone(), idem.clone(), key.clone());
        self.submit(
            locks,
            work(move |conn| {
                let (tenant, idem, key) = (tenant.clone(), idem.clone(), key.clone());
                Box::pin(async move {
                    resources::adjust(&mut MyPort::new(conn), &tenant, &idem, &key, delta, fence, now_ms).await
                })
            }),
        )
        .await
    }

    async fn ledger_page(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        from: PageFrom,
        limit: u32,
    ) -> Result<Option<Vec<LedgerEntry>>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let mut tx = snapshot(&mut conn).await?;
        let page = reads::ledger(&mut MyPort::new(&mut tx), tenant, key.as_str(), from, limit).await?;
        tx.commit().await?;
        Ok(page)
    }

    async fn stored_outcome(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
    ) -> Result<Option<Idempotent>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let sql = sql::translate(STORED_OUTCOME_SQL);
        let args = [sql::Arg::Text(tenant.as_str()), sql::Arg::Text(idem.key.as_str())];
        let Some(row) = sql::bind_all(&sql, &args).fetch_optional(&mut *conn).await? else { return Ok(None) };
        let Some(response) = port::stored_response(&row)? else { return Ok(None) };
        Ok(Some(idem.judge(&rows::Columns::text(&row, "request_hash")?, response)))
    }

    async fn execute_order(&self, job: Arc<OrderJob>, now_ms: i64) -> Result<OrderExecution, StorageError> {
        // Its resource rows are declared by the order itself (see `declared_rows`).
        let (reply, rx) = oneshot::channel();
        let order: PendingOrder<My> = PendingOrder::new(job, now_ms, reply);
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
        let mut tx = snapshot(&mut conn).await?;
        let outcome = reads::preview(&mut MyPort::new(&mut tx), tenant, order, plan).await?;
        tx.commit().await?;
        Ok(outcome)
    }

    async fn get_order(&self, tenant: &TenantId, order_id: &OrderId) -> Result<Option<OrderLedger>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let mut tx = snapshot(&mut conn).await?;
        let order = reversals::order(&mut MyPort::new(&mut tx), tenant.as_str(), order_id.as_str()).await?;
        tx.commit().await?;
        Ok(order)
    }

    async fn reverse_order(&self, job: Arc<ReversalJob>, now_ms: i64) -> Result<Reversed, StorageError> {
        // The order's resources are locked with the batch's other declared rows, in the one
        // global order, before any job runs: two processes' batches reversing (or selling) the
        // same resources never wait on each other in a cycle. Read here, outside the batch;
        // a resource the order touches later is still locked by the job itself, only later.
        let locks = {
            let mut conn = acquire(&self.pool).await?;
            let entries = MyPort::new(&mut conn)
                .order_entries(job.tenant.as_str(), job.order_id.as_str(), reversals::MAX_ORDER_GROUPS)
                .await?;
            let mut locks: Vec<(String, String)> =
                entries.into_iter().map(|e| (job.tenant.to_string(), e.resource)).collect();
            locks.dedup();
            locks
        };
        self.submit(
            locks,
            work(move |conn| {
                let job = job.clone();
                Box::pin(async move { reversals::reverse(&mut MyPort::new(conn), &job, now_ms).await })
            }),
        )
        .await
    }

    async fn get_reservation(&self, tenant: &TenantId, id: &str) -> Result<Option<Reservation>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        MyPort::new(&mut conn).reservation(tenant.as_str(), id).await
    }

    async fn held_reservations(&self, tenant: &TenantId, limit: u32) -> Result<Vec<Reservation>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        MyPort::new(&mut conn).held_reservations(tenant.as_str(), limit).await
    }

    async fn confirm_reservation(&self, tenant: &TenantId, id: &str, now_ms: i64) -> Result<Transition, StorageError> {
        let job = MoveJob { tenant: tenant.clone(), id: id.to_string(), to: ReservationState::Confirmed };
        self.submit_move(job, now_ms).await
    }

    async fn release_reservation(&self, tenant: &TenantId, id: &str, now_ms: i64) -> Result<Transition, StorageError> {
        let job = MoveJob { tenant: tenant.clone(), id: id.to_string(), to: ReservationState::Released };
        self.submit_move(job, now_ms).await
    }

    async fn expire_due(&self, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.submit(
            Vec::new(),
            work(move |conn| {
                Box::pin(async move { reservations::expire_due(&mut MyPort::new(conn), now_ms, limit).await })
            }),
        )
        .await
    }

    async fn rebalance_buckets(&self, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.submit(
            Vec::new(),
            work(move |conn| Box::pin(async move { buckets::rebalance(&mut MyPort::new(conn), now_ms, limit).await })),
        )
        .await
    }

    async fn reconcile(&self, tenant: Option<&TenantId>, pass: Pass) -> Result<Reconciliation, StorageError> {
        // One snapshot: resources and ledger come from the same moment, so a commit landing
        // between the queries can never look like drift.
        let mut conn = acquire(&self.pool).await?;
        let mut tx = snapshot(&mut conn).await?;
        let (report, update) = reads::reconciliation(&mut MyPort::new(&mut tx), tenant, pass).await?;
        tx.commit().await?;
        drop(conn);
        if report.drift.iter().any(|d| d.new) {
            let drift = std::sync::Arc::new(report.drift.clone());
            let now_ms = crate::time::now_ms();
            self.submit(
                Vec::new(),
                work(move |conn| {
                    let drift = drift.clone();
                    Box::pin(async move { reads::report_drift(&mut MyPort::new(conn), &drift, now_ms).await })
                }),
            )
            .await?;
        }
        // The report stands whether or not its checkpoints are stored: without them the next
        // pass only replays more.
        for part in update.into_parts(super::CHECKPOINTS_PER_WRITE) {
            let part = std::sync::Arc::new(part);
            let saved = self
                .submit(
                    Vec::new(),
                    work(move |conn| {
                        let part = part.clone();
                        Box::pin(async move { reads::save_checkpoints(&mut MyPort::new(conn), &part).await })
                    }),
                )
                .await;
            if let Err(err) = saved {
                tracing::warn!(error = %err, "reconciliation checkpoints not saved; the next pass replays more");
                break;
            }
        }
        Ok(report)
    }

    async fn events_page(
        &self,
        tenant: &TenantId,
        from: PageFrom,
        types: &[EventType],
        limit: u32,
    ) -> Result<Vec<Event>, StorageError> {
        let (after, order) = from.bounds();
        // Event type names are a closed set of ASCII words, but they are bound all the same.
        let filter = if types.is_empty() {
            String::new()
        } else {
            format!(" AND type IN ({})", vec!["?"; types.len()].join(", "))
        };
        let sql = format!(
            "SELECT {} FROM events WHERE tenant_id = ? AND seq > ?{filter} ORDER BY seq {order} LIMIT ?",
            rows::EVENT_COLUMNS
        );
        let mut query = sqlx::query(&sql).bind(tenant.as_str()).bind(after);
        for t in types {
            query = query.bind(t.as_str());
        }
        let rows = query.bind(i64::from(limit)).fetch_all(&self.pool).await?;
        Ok(from.arrange(rows.iter().map(|row| rows::event(row)).collect::<Result<_, _>>()?))
    }

    async fn purge_events(&self, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
        // Outside the batcher: deleting old, committed events contends with no write.
        // MySQL deletes in index order with a LIMIT of its own (no LIMIT inside IN here). Walks
        // the primary key up to the first id made at `before_ms` (migration 0006).
        let done = sqlx::query("DELETE FROM events WHERE id < ? AND at < ? AND seq IS NOT NULL ORDER BY id LIMIT ?")
            .bind(crate::events::first_event_id_at(before_ms))
            .bind(before_ms)
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn sink_backlog(&self, sink: &str, max_tenants: u32) -> Result<SinkBacklog, StorageError> {
        sinks::backlog(&self.pool, sink, max_tenants).await
    }

    async fn claim_sink_cursor(
        &self,
        sink: &str,
        tenant: &TenantId,
    ) -> Result<Option<Box<dyn SinkClaim>>, StorageError> {
        Ok(sinks::claim(&self.pool, sink, tenant).await?.map(|claim| Box::new(claim) as Box<dyn SinkClaim>))
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
        let list = sql::translate(rows::LIST_PLUGINS_SQL);
        let rows = sql::bind_all(&list, &[sql::Arg::Text(tenant.as_str())]).fetch_all(&mut *conn).await?;
        rows.iter().map(|row| rows::plugin_version(row)).collect()
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
        let active = sql::translate(rows::ACTIVE_PLUGIN_SQL);
        let row = sql::bind_all(&active, &[sql::Arg::Text(tenant.as_str())]).fetch_optional(&mut *conn).await?;
        row.as_ref().map(|row| rows::plugin_version(row)).transpose()
    }

    async fn plugin_wasm(&self, tenant: &TenantId, version: i64) -> Result<Option<Vec<u8>>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        Ok(sqlx::query_scalar("SELECT wasm FROM plugins WHERE tenant_id = ? AND version = ?")
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
