//! The PostgreSQL backend, for production and for several `stockd` processes sharing one
//! database. Reads go straight to a connection pool (the ones that must agree with themselves
//! read one REPEATABLE READ snapshot). Writes go through one group-committing batcher task per
//! process ([`batcher`]); what they do is [`crate::apply`] over [`port::PgPort`], or plain SQL in
//! [`ops`] for tenants, keys and plugins.
//!
//! Correctness across processes comes from the database alone (guarded updates, the
//! idempotency row claimed first, `SKIP LOCKED`), never from the batcher: it only saves commits.

mod batcher;
mod events;
pub mod ops;
pub mod port;
pub mod redis_store;
mod sinks;
mod webhooks;

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, Postgres};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use self::batcher::Pg;
use super::batcher::{run_batcher, LockSet, Pending, PendingMove, PendingOrder, Queued, ATTEMPT_DEADLINE};

/// A write of this backend's batcher.
type Work<T> = super::batcher::Work<Pg, T>;

/// Helps type inference see a closure as a [`Work`] (the higher-ranked lifetime needs a hint).
pub(super) fn work<T, F>(f: F) -> Work<T>
where
    F: for<'c> Fn(&'c mut sqlx::PgConnection) -> futures::future::BoxFuture<'c, Result<T, StorageError>>
        + Send
        + Sync
        + 'static,
{
    Box::new(f)
}
use self::port::PgPort;
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
use crate::storage::lookups::{Found, Lookups, ReadGroup};

/// How many groups of stored outcomes are read at once (each on a connection of its own).
const LOOKUP_READERS: usize = 2;

/// The stored outcomes of a group of `(tenant, key)` pairs, `n` the pair's place (from 1).
const STORED_OUTCOMES_SQL: &str = concat!(
    "SELECT k.n, ",
    crate::outcome_columns!(),
    " JOIN UNNEST($1::text[], $2::text[]) WITH ORDINALITY AS k (tenant_id, key, n)
       ON i.tenant_id = k.tenant_id AND i.key = k.key
     WHERE i.response_code IS NOT NULL"
);

/// A row of [`STORED_OUTCOMES_SQL`]: the pair's place, then the record's columns.
type OutcomeRow = (i64, String, i32, String, Option<String>, Option<String>);

/// Reads a group of stored outcomes ([`super::lookups`]) in one statement, on a connection of
/// [`LookupConnections`]. A kept connection that fails (the database ended the session while
/// it was idle: a restart, a failover, an operator) is dropped and the group read once more on
/// a new one: the statement only reads, and the client should not hear of it.
fn read_stored_outcomes(connections: Arc<LookupConnections>) -> ReadGroup {
    Arc::new(move |keys: Vec<(String, String)>| {
        let connections = connections.clone();
        Box::pin(async move {
            let n = keys.len();
            let (tenants, keys): (Vec<String>, Vec<String>) = keys.into_iter().unzip();
            let rows: Vec<OutcomeRow> = loop {
                let (mut conn, kept) = connections.take().await?;
                match sqlx::query_as(STORED_OUTCOMES_SQL).bind(&tenants).bind(&keys).fetch_all(&mut conn).await {
                    Ok(rows) => {
                        connections.keep(conn);
                        break rows;
                    }
                    Err(err) if kept => {
                        tracing::debug!(error = %err, "a kept lookup connection failed; reading on a new one");
                    }
                    Err(err) => return Err(err.into()),
                }
            };
            let mut found: Vec<Found> = (0..n).map(|_| Ok(None)).collect();
            for (at, hash, code, kind, body, event) in rows {
                let slot = usize::try_from(at - 1).ok().and_then(|i| found.get_mut(i));
                let Some(slot) = slot else {
                    return Err(StorageError::Internal(format!("a group of {n} lookups read place {at}")));
                };
                *slot = super::StoredResponse::from_columns(Some(i64::from(code)), Some(&kind), body, event.as_deref())
                    .map(|response| response.map(|response| (hash, response)));
            }
            Ok(found)
        })
    })
}

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
    queue: Mutex<Option<mpsc::Sender<Box<dyn Queued<Pg>>>>>,
    batcher: Mutex<Option<JoinHandle<()>>>,
    /// Stored outcomes read in groups ([`super::lookups`]), on connections of their own.
    lookups: Lookups,
    lookup_connections: Arc<LookupConnections>,
}

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

fn connect_options(settings: &PgSettings) -> Result<PgConnectOptions, StorageError> {
    Ok(PgConnectOptions::from_str(&settings.url)
        .map_err(|e| StorageError::Internal(format!("bad PostgreSQL URL: {e}")))?
        .application_name("stockd")
        .log_statements(tracing::log::LevelFilter::Trace)
        // If this process loses the database mid-transaction (partition, freeze), the server
        // ends the session, and releases its row locks for the other processes, once it has
        // waited this long for our next statement; a live batch sends them back to back.
        .options([("idle_in_transaction_session_timeout", format!("{}ms", ATTEMPT_DEADLINE.as_millis()))]))
}

async fn connect(settings: &PgSettings) -> Result<PgPool, StorageError> {
    Ok(PgPoolOptions::new()
        .max_connections(settings.max_connections.max(1))
        .acquire_timeout(settings.acquire_timeout)
        .connect_with(connect_options(settings)?)
        .await?)
}

/// The connections of the grouped lookups ([`read_stored_outcomes`]), at most one per reader,
/// opened when first needed and kept between groups. A pool would test each connection with a
/// round trip when lent and again when given back: two round trips for every group, which cost
/// the server more CPU than the group's statement under a redis-mode sale (docs/PERFORMANCE.md,
/// twenty-fourth session).
///
/// Their one statement joins an array of keys to `idempotency`, as a batch's do, so it runs
/// under the batch's settings, for the whole session: one plan, each key looked up by the
/// primary key, made once per connection and right at any table size
/// ([`batcher::BY_KEY_PLANS_OPTIONS`]).
pub(super) struct LookupConnections {
    options: PgConnectOptions,
    connect_timeout: Duration,
    /// Connections not in use. Readers take one (or open one) for a group and put it back.
    spare: Mutex<Vec<sqlx::PgConnection>>,
}

impl LookupConnections {
    fn new(settings: &PgSettings) -> Result<Self, StorageError> {
        Ok(Self {
            options: connect_options(settings)?.options(batcher::BY_KEY_PLANS_OPTIONS.iter().copied()),
            connect_timeout: settings.acquire_timeout,
            spare: Mutex::new(Vec::new()),
        })
    }

    /// A kept connection (`true`), or a new one; `Unavailable` if none opens within
    /// `acquire_timeout`.
    async fn take(&self) -> Result<(sqlx::PgConnection, bool), StorageError> {
        if let Some(conn) = self.spare.lock().ok().and_then(|mut spare| spare.pop()) {
            return Ok((conn, true));
        }
        match tokio::time::timeout(self.connect_timeout, self.options.connect()).await {
            Ok(Ok(conn)) => Ok((conn, false)),
            Ok(Err(err)) => Err(StorageError::Unavailable(format!("no database connection: {err}"))),
            Err(_) => {
                Err(StorageError::Unavailable(format!("no database connection within {:?}", self.connect_timeout)))
            }
        }
    }

    fn keep(&self, conn: sqlx::PgConnection) {
        if let Ok(mut spare) = self.spare.lock() {
            spare.push(conn);
        }
    }

    /// Ends the kept connections (one a reader is using ends with the process).
    async fn close(&self) {
        let spare = self.spare.lock().map(|mut spare| std::mem::take(&mut *spare)).unwrap_or_default();
        for conn in spare {
            let _ = conn.close().await;
        }
    }
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
        let lookup_connections = Arc::new(LookupConnections::new(settings)?);
        let lookups = Lookups::start(LOOKUP_READERS, read_stored_outcomes(lookup_connections.clone()));
        Ok(Self { pool, queue: Mutex::new(Some(tx)), batcher: Mutex::new(Some(batcher)), lookups, lookup_connections })
    }

    /// Applies migrations and returns, for `stockd migrate`.
    pub async fn migrate(settings: &PgSettings) -> Result<(), StorageError> {
        let pool = connect(settings).await?;
        run_migrations(&pool).await?;
        pool.close().await;
        Ok(())
    }

    fn queue(&self) -> Result<mpsc::Sender<Box<dyn Queued<Pg>>>, StorageError> {
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
        let queued: Box<dyn Queued<Pg>> = Box::new(PendingMove::new(job, now_ms, reply));
        self.queue()?.send(queued).await.map_err(|_| StorageError::Unavailable("writer stopped".into()))?;
        rx.await.map_err(|_| StorageError::Unavailable("write was not committed".into()))?
    }

    async fn submit<T: Send + 'static>(&self, locks: LockSet, work: Work<T>) -> Result<T, StorageError> {
        let (tx, rx) = oneshot::channel();
        let job: Box<dyn Queued<Pg>> = Box::new(Pending { locks, work, result: None, reply: tx });
        self.queue()?.send(job).await.map_err(|_| StorageError::Unavailable("writer stopped".into()))?;
        rx.await.map_err(|_| StorageError::Unavailable("write was not committed".into()))?
    }
}

// ---------------------------------------------------------------------------------------------
// Reads
// ---------------------------------------------------------------------------------------------

/// A transaction that sees one snapshot and writes nothing, for reads made of several queries.
const SNAPSHOT: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";

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
        let keys = sqlx::query(rows::LIST_API_KEYS_SQL)
            .bind(tenant.as_str())
            .bind(rows::MAX_API_KEYS_LISTED)
            .fetch_all(&mut *conn)
            .await?;
        if keys.is_empty()
            && sqlx::query(rows::TENANT_EXISTS_SQL).bind(tenant.as_str()).fetch_optional(&mut *conn).await?.is_none()
        {
            return Ok(None);
        }
        keys.iter().map(|row| rows::api_key_info(row)).collect::<Result<_, _>>().map(Some)
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

    async fn resource_holding(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        ids: &[String],
    ) -> Result<Holding, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let mut tx = conn.begin_with(SNAPSHOT).await?;
        let read = reads::resource_holding(&mut PgPort::new(&mut tx), tenant, key.as_str(), ids).await?;
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
        let mut tx = conn.begin_with(SNAPSHOT).await?;
        let page = reads::resources(&mut PgPort::new(&mut tx), tenant, prefix, after, limit).await?;
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
                    async move { resources::set_status(&mut PgPort::new(conn), &tenant, &key, status, now_ms).await },
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
                    resources::set_low_stock(&mut PgPort::new(conn), &tenant, &key, low_stock, now_ms).await
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
                    resources::adjust(&mut PgPort::new(conn), &tenant, &idem, &key, delta, fence, now_ms).await
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
        let mut tx = conn.begin_with(SNAPSHOT).await?;
        let page = reads::ledger(&mut PgPort::new(&mut tx), tenant, key.as_str(), from, limit).await?;
        tx.commit().await?;
        Ok(page)
    }

    async fn stored_outcome(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
    ) -> Result<Option<Idempotent>, StorageError> {
        self.lookups.lookup(tenant, idem).await
    }

    async fn execute_order(&self, job: Arc<OrderJob>, now_ms: i64) -> Result<OrderExecution, StorageError> {
        // Its resource rows are declared by the order itself (see `declared_rows`).
        let (reply, rx) = oneshot::channel();
        let order: PendingOrder<Pg> = PendingOrder::new(job, now_ms, reply);
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
        let outcome = reads::preview(&mut PgPort::new(&mut tx), tenant, order, plan).await?;
        tx.commit().await?;
        Ok(outcome)
    }

    async fn get_order(&self, tenant: &TenantId, order_id: &OrderId) -> Result<Option<OrderLedger>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        let mut tx = conn.begin_with(SNAPSHOT).await?;
        let order = reversals::order(&mut PgPort::new(&mut tx), tenant.as_str(), order_id.as_str()).await?;
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
            let entries = PgPort::new(&mut conn)
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
                Box::pin(async move { reversals::reverse(&mut PgPort::new(conn), &job, now_ms).await })
            }),
        )
        .await
    }

    async fn get_reservation(&self, tenant: &TenantId, id: &str) -> Result<Option<Reservation>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        PgPort::new(&mut conn).reservation(tenant.as_str(), id).await
    }

    async fn held_reservations(&self, tenant: &TenantId, limit: u32) -> Result<Vec<Reservation>, StorageError> {
        let mut conn = acquire(&self.pool).await?;
        PgPort::new(&mut conn).held_reservations(tenant.as_str(), limit).await
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

    async fn reconcile(&self, tenant: Option<&TenantId>, pass: Pass) -> Result<Reconciliation, StorageError> {
        // One snapshot: resources and ledger come from the same moment, so a commit landing
        // between the queries can never look like drift.
        let mut conn = acquire(&self.pool).await?;
        let mut tx = conn.begin_with(SNAPSHOT).await?;
        // The planner cannot know how few entries lie past the watermarks, costs each
        // resource's range at a share of its whole ledger, and JIT-compiles the plan: 340 ms
        // of compiling for 14 ms of execution over 1,000 resources (docs/PERFORMANCE.md).
        sqlx::query("SET LOCAL jit = off").execute(&mut *tx).await?;
        let (report, update) = reads::reconciliation(&mut PgPort::new(&mut tx), tenant, pass).await?;
        tx.commit().await?;
        drop(conn);
        if report.drift.iter().any(|d| d.new) {
            let drift = std::sync::Arc::new(report.drift.clone());
            let now_ms = crate::time::now_ms();
            self.submit(
                Vec::new(),
                work(move |conn| {
                    let drift = drift.clone();
                    Box::pin(async move { reads::report_drift(&mut PgPort::new(conn), &drift, now_ms).await })
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
                        Box::pin(async move { reads::save_checkpoints(&mut PgPort::new(conn), &part).await })
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
        let types: Vec<&str> = types.iter().map(|t| t.as_str()).collect();
        let (after, order) = from.bounds();
        let rows = sqlx::query(&format!(
            "SELECT {} FROM events
             WHERE tenant_id = $1 AND seq > $2 AND (cardinality($3::text[]) = 0 OR type = ANY($3))
             ORDER BY seq {order} LIMIT $4",
            rows::EVENT_COLUMNS
        ))
        .bind(tenant.as_str())
        .bind(after)
        .bind(&types)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(from.arrange(rows.iter().map(|row| rows::event(row)).collect::<Result<_, _>>()?))
    }

    async fn purge_events(&self, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
        // Outside the batcher: deleting old, committed events contends with no write. Walks
        // the primary key up to the first id made at `before_ms` (migration 0021).
        let done = sqlx::query(
            "DELETE FROM events WHERE id IN
               (SELECT id FROM events WHERE id < $1 AND at < $2 AND seq IS NOT NULL ORDER BY id LIMIT $3)",
        )
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
        let rows = sqlx::query(rows::LIST_PLUGINS_SQL).bind(tenant.as_str()).fetch_all(&mut *conn).await?;
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
        let row = sqlx::query(rows::ACTIVE_PLUGIN_SQL).bind(tenant.as_str()).fetch_optional(&mut *conn).await?;
        row.as_ref().map(|row| rows::plugin_version(row)).transpose()
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
        self.lookup_connections.close().await;
        self.pool.close().await;
    }
}
