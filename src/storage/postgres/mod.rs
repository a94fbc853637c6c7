//! The PostgreSQL backend, for production and for several `stockd` processes sharing one
//! database. Reads go straight to a connection pool (the ones that must agree with themselves
//! read one REPEATABLE READ snapshot). Writes ([`ops`]) go through one group-committing batcher
//! task per process: it takes every queued job (up to `max_batch`), runs each inside its own
//! savepoint of one transaction, commits once, and only then answers each job. A job's own
//! failure rolls back its savepoint alone; a transient failure of the batch (deadlock,
//! serialization failure, lost connection) reruns the whole batch, which is why a job is a
//! closure that can run again, up to `max_retries` times before everyone in it is answered
//! `Unavailable`.
//!
//! Correctness across processes comes from the database alone (guarded updates, the
//! idempotency row claimed first, `SKIP LOCKED`), never from the batcher: it only saves commits.

pub mod ops;
pub mod port;
pub mod settle;

use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use rand::Rng;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{ConnectOptions, Connection, PgConnection, Postgres, Row};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

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
use crate::apply::{self, buckets, reservations, resources};
use crate::engine::{
    LedgerEntry, LedgerOp, OrderDocument, OrderRequest, Plan, Reconciliation, Reservation, ResourceKey, ResourceState,
    ResourceStatus, TenantId,
};
use crate::ratelimit::RateLimit;
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

/// Longest a batch attempt may take once it has its connection. A healthy batch takes
/// milliseconds, or a few seconds queued behind other processes' batches on a hot row; a
/// partition that swallows packets mid-statement would otherwise hold the batcher (and every
/// write of this process) until TCP gives up, which takes many minutes. Kept under the default
/// request timeout (30 s) so clients hear `503 unavailable` rather than time out.
const ATTEMPT_DEADLINE: Duration = Duration::from_secs(10);

/// Backoff before the first rerun of a failed batch; it doubles per attempt up to the cap.
const RETRY_BASE_MS: u64 = 5;
const RETRY_CAP_MS: u64 = 200;

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
// Group commit
// ---------------------------------------------------------------------------------------------

/// A write: runs its statements on the batch's connection. It may run more than once (the batch
/// is retried after a transient failure), so it clones its inputs on every run; the caller gets
/// the result of the run that committed.
type Work<T> = Box<dyn for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, StorageError>> + Send + Sync>;

/// The resource rows `(tenant, key)` a write will update, as far as it knows them beforehand.
///
/// Why: a batch holds every lock it takes until its commit, and its jobs run one after another,
/// so two processes' batches would lock the same hot rows in different orders (A then B here, B
/// then A there) and deadlock, costing a `deadlock_timeout` (1 s by default) before the retry.
/// Locking the declared rows of the whole batch first, in one global order, makes every process
/// take them in that order, and before any idempotency row, so those cycles cannot form.
type LockSet = Vec<(String, String)>;

/// Helps type inference see a closure as a [`Work`] (the higher-ranked lifetime needs a hint).
fn work<T, F>(f: F) -> Work<T>
where
    F: for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, StorageError>> + Send + Sync + 'static,
{
    Box::new(f)
}

/// How one run of a job went, as the batch sees it.
enum Ran {
    /// Succeeded: keep its effects.
    Kept,
    /// Failed for its own reason: roll back its savepoint, answer its error, commit the rest.
    Failed,
    /// Failed for a passing reason; PostgreSQL has aborted the transaction, so the whole batch
    /// is rolled back and run again.
    Transient(String),
}

impl Ran {
    /// How a run that ended with `result` went.
    fn of<T>(result: &Result<T, StorageError>) -> Self {
        match result {
            Ok(_) => Ran::Kept,
            Err(StorageError::Unavailable(why)) => Ran::Transient(why.clone()),
            // Its own refusal or retry answer: it alone is rolled back, the batch goes on.
            Err(StorageError::Internal(_) | StorageError::PlanRefused(_) | StorageError::RetryLater(_)) => Ran::Failed,
        }
    }
}

/// What a job's caller hears once its batch's fate is known: the committed run's result.
fn committed<T>(result: Option<Result<T, StorageError>>, batch: Result<(), StorageError>) -> Result<T, StorageError> {
    match batch {
        Ok(()) => result.unwrap_or_else(|| Err(StorageError::Internal("a committed job never ran".into()))),
        Err(err) => Err(err),
    }
}

/// A queued job with its result type erased, so one batch can hold writes of every kind.
trait Queued: Send {
    fn locks(&self) -> &[(String, String)];
    fn run<'a>(&'a mut self, conn: &'a mut PgConnection) -> BoxFuture<'a, Ran>;
    /// Answers the caller once the batch's fate is known: `Ok` after a commit.
    fn answer(self: Box<Self>, batch: Result<(), StorageError>);
    /// An order the batch may decide by admission together with its other orders.
    fn as_order(&mut self) -> Option<&mut PendingOrder> {
        None
    }
}

/// A queued order. In each run of its batch it is either decided by admission with the batch's
/// other orders (`admitted`) or on its own in its savepoint, like any job.
struct PendingOrder {
    job: std::sync::Arc<OrderJob>,
    now_ms: i64,
    admitted: bool,
    result: Option<Result<OrderExecution, StorageError>>,
    reply: oneshot::Sender<Result<OrderExecution, StorageError>>,
}

impl Queued for PendingOrder {
    fn locks(&self) -> &[(String, String)] {
        &[]
    }

    fn run<'a>(&'a mut self, conn: &'a mut PgConnection) -> BoxFuture<'a, Ran> {
        Box::pin(async move {
            let result = apply::orders::execute(&mut PgPort::new(conn), &self.job, self.now_ms).await;
            let ran = Ran::of(&result);
            self.result = Some(result);
            ran
        })
    }

    fn answer(self: Box<Self>, batch: Result<(), StorageError>) {
        let _ = self.reply.send(committed(self.result, batch));
    }

    fn as_order(&mut self) -> Option<&mut PendingOrder> {
        Some(self)
    }
}

struct Pending<T> {
    locks: LockSet,
    work: Work<T>,
    /// The latest run's result; only a committed one is ever handed out.
    result: Option<Result<T, StorageError>>,
    reply: oneshot::Sender<Result<T, StorageError>>,
}

impl<T: Send + 'static> Queued for Pending<T> {
    fn locks(&self) -> &[(String, String)] {
        &self.locks
    }

    fn run<'a>(&'a mut self, conn: &'a mut PgConnection) -> BoxFuture<'a, Ran> {
        Box::pin(async move {
            let result = (self.work)(conn).await;
            let ran = Ran::of(&result);
            self.result = Some(result);
            ran
        })
    }

    fn answer(self: Box<Self>, batch: Result<(), StorageError>) {
        // The caller may have gone away (client disconnected); its effects stand.
        let _ = self.reply.send(committed(self.result, batch));
    }
}

/// Why a batch did not commit.
enum BatchFailure {
    /// Certainly not committed, for a passing reason: run it again.
    Retry(String),
    /// Batch admission failed for a reason that is not passing (a bug): run the batch again
    /// at once with every order decided on its own.
    WithoutAdmission(String),
    /// Give up now (no connection within the timeout, a commit whose outcome is unknown, or a
    /// failure that is not transient).
    Final(StorageError),
}

impl BatchFailure {
    /// Sorts an error of a statement the batcher itself runs (BEGIN, SAVEPOINT, RELEASE, ...).
    fn of(err: sqlx::Error) -> Self {
        match StorageError::from(err) {
            StorageError::Unavailable(why) => BatchFailure::Retry(why),
            internal => BatchFailure::Final(internal),
        }
    }
}

/// The batcher: one task per process, ending when every sender is gone and the queue is empty.
async fn run_batcher(pool: PgPool, mut rx: mpsc::Receiver<Box<dyn Queued>>, limits: WriterLimits, max_retries: u32) {
    let max_batch = limits.max_batch.max(1);
    let mut batch: Vec<Box<dyn Queued>> = Vec::with_capacity(max_batch);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        fill(&mut rx, &mut batch, max_batch, limits.max_wait).await;
        metrics::histogram!("stockd_batch_size").record(batch.len() as f64);
        let started = Instant::now();
        commit_batch(&pool, &mut batch, max_retries).await;
        metrics::histogram!("stockd_batch_commit_seconds").record(started.elapsed().as_secs_f64());
    }
}

/// Takes every job already queued, lingering up to `max_wait` for more if configured.
async fn fill(rx: &mut mpsc::Receiver<Box<dyn Queued>>, batch: &mut Vec<Box<dyn Queued>>, max: usize, wait: Duration) {
    let deadline = Instant::now() + wait;
    while batch.len() < max {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(mpsc::error::TryRecvError::Disconnected) => return,
            Err(mpsc::error::TryRecvError::Empty) if Instant::now() >= deadline => return,
            Err(mpsc::error::TryRecvError::Empty) => match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(job)) => batch.push(job),
                Ok(None) | Err(_) => return,
            },
        }
    }
}

/// Runs the batch until it commits or may not be retried any more, then answers every job.
async fn commit_batch(pool: &PgPool, batch: &mut Vec<Box<dyn Queued>>, max_retries: u32) {
    let rows = declared_rows(batch);
    let mut attempt = 0;
    let mut admission = true;
    let outcome = loop {
        match run_batch(pool, batch, &rows, admission).await {
            Ok(()) => break Ok(()),
            Err(BatchFailure::WithoutAdmission(why)) if admission => {
                tracing::error!(reason = %why, "batch admission failed; deciding the batch's orders one by one");
                admission = false;
            }
            Err(BatchFailure::WithoutAdmission(why)) => break Err(StorageError::Internal(why)),
            Err(BatchFailure::Retry(why)) if attempt < max_retries => {
                tracing::debug!(attempt, reason = %why, "batch failed for a passing reason; running it again");
                metrics::counter!("stockd_batch_retries_total").increment(1);
                tokio::time::sleep(backoff(attempt)).await;
                attempt += 1;
            }
            Err(BatchFailure::Retry(why)) => {
                tracing::warn!(attempts = attempt + 1, reason = %why, "batch kept failing; giving up");
                break Err(StorageError::Unavailable(why));
            }
            Err(BatchFailure::Final(err)) => {
                tracing::error!(error = %err, "batch failed");
                break Err(err);
            }
        }
    };
    for job in batch.drain(..) {
        job.answer(outcome.as_ref().map(|_| ()).map_err(duplicate));
    }
}

/// `StorageError` is not `Clone` (neither is `sqlx::Error`); every job of a failed batch gets
/// the same error.
fn duplicate(err: &StorageError) -> StorageError {
    match err {
        StorageError::Unavailable(why) => StorageError::Unavailable(why.clone()),
        StorageError::Internal(why) => StorageError::Internal(why.clone()),
        StorageError::PlanRefused(why) => StorageError::PlanRefused(why.clone()),
        StorageError::RetryLater(why) => StorageError::RetryLater(why.clone()),
    }
}

/// Jittered exponential backoff: 5 ms, 10 ms, 20 ms, ... capped at 200 ms, each drawn from its
/// upper half so that processes whose batches collided do not collide again in step.
fn backoff(attempt: u32) -> Duration {
    let ceiling = RETRY_BASE_MS.saturating_mul(1u64 << attempt.min(16)).min(RETRY_CAP_MS);
    Duration::from_millis(rand::rng().random_range(ceiling / 2..=ceiling))
}

/// One attempt on one pooled connection, bounded by [`ATTEMPT_DEADLINE`].
async fn run_batch(
    pool: &PgPool,
    batch: &mut [Box<dyn Queued>],
    rows: &(Vec<String>, Vec<String>),
    admission: bool,
) -> Result<(), BatchFailure> {
    // No retry when no connection comes within `acquire_timeout`: the pool has already waited
    // (and retried connecting) that long, and callers should hear `Unavailable` promptly.
    let mut conn = acquire(pool).await.map_err(BatchFailure::Final)?;
    match tokio::time::timeout(ATTEMPT_DEADLINE, attempt(&mut conn, batch, rows, admission)).await {
        Ok(result) => result,
        Err(_) => {
            // The connection stopped answering mid-statement. It must never serve anyone else,
            // so it is closed here rather than returned to the pool.
            drop(conn.detach());
            Err(BatchFailure::Final(StorageError::Unavailable(format!(
                "the database did not answer within {ATTEMPT_DEADLINE:?}; outcome unknown"
            ))))
        }
    }
}

/// BEGIN, the declared row locks, each job in its savepoint, COMMIT.
async fn attempt(
    conn: &mut PgConnection,
    batch: &mut [Box<dyn Queued>],
    rows: &(Vec<String>, Vec<String>),
    admission: bool,
) -> Result<(), BatchFailure> {
    // sqlx's transaction guards roll back whatever is left open if this returns early (or is
    // dropped), before the connection can serve anyone else.
    let mut tx = conn.begin().await.map_err(BatchFailure::of)?;
    let locked = lock_declared_rows(&mut tx, rows).await.map_err(BatchFailure::of)?;
    if let Err(why) = admit_orders(&mut tx, batch, &locked, admission).await {
        // Best effort: if the connection is gone, the server has rolled back already.
        let _ = tx.rollback().await;
        return Err(why);
    }
    for job in batch.iter_mut() {
        if job.as_order().is_some_and(|o| o.admitted) {
            continue;
        }
        let mut savepoint = Connection::begin(&mut *tx).await.map_err(BatchFailure::of)?;
        match job.run(&mut savepoint).await {
            Ran::Kept => savepoint.commit().await.map_err(BatchFailure::of)?,
            Ran::Failed => savepoint.rollback().await.map_err(BatchFailure::of)?,
            Ran::Transient(why) => {
                drop(savepoint);
                // Best effort: if the connection is gone, the server has rolled back already.
                let _ = tx.rollback().await;
                return Err(BatchFailure::Retry(why));
            }
        }
    }
    tx.commit().await.map_err(|e| match e {
        // The server answered the COMMIT with an error: the transaction did not commit.
        sqlx::Error::Database(_) => BatchFailure::of(e),
        // No answer (connection lost): it may or may not have committed. Running the batch
        // again could apply a non-idempotent write twice, so its callers hear `Unavailable`
        // and find out by reading (idempotent requests replay on retry).
        other => BatchFailure::Final(StorageError::Unavailable(format!("commit outcome unknown: {other}"))),
    })
}

/// Decides the batch's orders together (see [`apply::batch`]), marking those it
/// decided; the rest run on their own. It runs first in the transaction, so a failure of it
/// needs no savepoint: the batch is run again, without admission if the failure was not
/// passing.
async fn admit_orders(
    tx: &mut PgConnection,
    batch: &mut [Box<dyn Queued>],
    locked: &[PgRow],
    admission: bool,
) -> Result<(), BatchFailure> {
    let mut orders: Vec<&mut PendingOrder> = batch.iter_mut().filter_map(|job| job.as_order()).collect();
    for order in orders.iter_mut() {
        order.admitted = false;
    }
    if !admission || orders.len() < 2 {
        return Ok(());
    }
    let rows = port::locked_rows(locked).map_err(|e| BatchFailure::WithoutAdmission(e.to_string()))?;
    let jobs: Vec<(&OrderJob, i64)> = orders.iter().map(|o| (&*o.job, o.now_ms)).collect();
    match apply::batch::admit(&mut PgPort::new(tx), &jobs, rows).await {
        Ok(outcomes) => {
            for (order, outcome) in orders.into_iter().zip(outcomes) {
                if let Some(execution) = outcome {
                    metrics::counter!("stockd_orders_admitted_in_batch_total").increment(1);
                    order.result = Some(Ok(execution));
                    order.admitted = true;
                }
            }
            Ok(())
        }
        Err(StorageError::Unavailable(why)) => Err(BatchFailure::Retry(why)),
        Err(err) => Err(BatchFailure::WithoutAdmission(err.to_string())),
    }
}

/// The resource rows a batch's jobs declared (see [`LockSet`]), as the two parallel arrays
/// [`lock_declared_rows`] binds; computed once per batch, not per attempt.
fn declared_rows(batch: &mut [Box<dyn Queued>]) -> (Vec<String>, Vec<String>) {
    let mut rows: Vec<(String, String)> = batch.iter().flat_map(|job| job.locks()).cloned().collect();
    for job in batch.iter_mut() {
        if let Some(order) = job.as_order() {
            let tenant = order.job.tenant.to_string();
            rows.extend(order.job.plan.resources().map(|key| (tenant.clone(), key.to_string())));
        }
    }
    rows.sort_unstable();
    rows.dedup();
    rows.into_iter().unzip()
}

/// Locks the declared resource rows in one global order and returns them as they are now (for
/// batch admission). Rows that do not exist are simply not locked; the jobs judge them as usual.
async fn lock_declared_rows(
    conn: &mut PgConnection,
    rows: &(Vec<String>, Vec<String>),
) -> Result<Vec<PgRow>, sqlx::Error> {
    let (tenants, keys) = rows;
    if tenants.is_empty() {
        return Ok(Vec::new());
    }
    // In a locking SELECT the sort runs first and rows are locked as they leave it, so the
    // locks are taken in this order.
    sqlx::query(
        "SELECT r.tenant_id, r.key, r.kind, r.status, r.mode, r.buckets, r.available, r.reserved, r.consumed, r.version
         FROM resources r
         JOIN UNNEST($1::text[], $2::text[]) AS wanted (tenant_id, key)
           ON r.tenant_id = wanted.tenant_id AND r.key = wanted.key
         ORDER BY r.tenant_id COLLATE \"C\", r.key COLLATE \"C\"
         FOR UPDATE OF r",
    )
    .bind(tenants)
    .bind(keys)
    .fetch_all(conn)
    .await
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
