//! The embedded SQLite backend (WAL), on one driver (rusqlite): writes go through one
//! group-committing writer thread ([`writer`]) and are [`crate::apply`] over [`port::SqlitePort`]
//! (or plain SQL in [`ops`] for tenants, keys and plugins); reads run on read-only connections
//! beside it ([`readers`]), most over the same port. sqlx only applies the migrations at start.

pub mod library;
pub mod migrate;
pub mod ops;
pub mod port;
pub mod readers;
pub mod redis_store;
pub mod sinks;
mod walbuf;
mod webhooks;
pub mod writer;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::{params, OptionalExtension};

use self::port::{all, mapped, SqlitePort};
use self::readers::Readers;
use self::writer::{Wal, Writer, WriterLimits};
use super::rows::{self, API_KEY_COLUMNS, TENANT_COLUMNS};
use super::ApiKeyInfo;
use super::Holding;
use super::{
    AdjustRefusal, ApiKeyRecord, IdempotencyRequest, Idempotent, Insert, ModeFence, NewApiKey, NewResource,
    OrderExecution, OrderJob, PageFrom, PluginUpload, PluginVersion, SinkBacklog, SinkClaim, Storage, StorageError,
    TenantRecord, Transition,
};
use crate::apply::batch::MoveJob;
use crate::apply::port::run_now;
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

/// How the SQLite backend is opened.
#[derive(Debug, Clone)]
pub struct SqliteSettings {
    pub url: String,
    pub read_connections: u32,
    /// `FULL` (default) makes every acknowledged commit survive power loss; `NORMAL` only a
    /// process crash.
    pub synchronous_full: bool,
    pub busy_timeout: Duration,
    /// What the WAL file is cut back to when it starts over (`PRAGMA journal_size_limit`).
    pub wal_limit_bytes: u64,
    pub writer: WriterLimits,
}

pub struct SqliteStorage {
    readers: Arc<Readers>,
    writer: Mutex<Option<Writer>>,
    writer_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    checkpointer: Mutex<Option<Checkpointer>>,
}

/// Moves committed WAL frames into the database file on a thread of its own, every 200 ms and
/// at once when the writer asks ([`writer::Wal`]), so the checkpoint the writer still runs finds
/// almost every frame already copied (checkpointing was ~7% of the writer's time under load).
/// The writer's own checkpoint stays: only a checkpoint that completes between two of its
/// transactions lets the next one restart the WAL from the beginning; with the thread alone,
/// under steady load, the WAL never restarts and grows without bound (2 GiB in 20 s of hot-key
/// load).
struct Checkpointer {
    signal: std::sync::mpsc::Sender<Signal>,
    thread: std::thread::JoinHandle<()>,
}

/// What the checkpoint thread is told.
enum Signal {
    /// The writer waits for a pass ([`writer::Wal`]).
    Pass,
    /// One more pass, then end.
    Stop,
}

/// How often the checkpointer runs.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(200);

impl Checkpointer {
    fn start(path: &Path, settings: &SqliteSettings, wal: &'static Wal) -> Result<Self, StorageError> {
        let conn = rusqlite::Connection::open(path)?;
        conn.busy_timeout(settings.busy_timeout)?;
        conn.pragma_update(None, "synchronous", if settings.synchronous_full { "FULL" } else { "NORMAL" })?;
        let (signal, signals) = std::sync::mpsc::channel::<Signal>();
        let thread = std::thread::Builder::new()
            .name("stockd-checkpoint".into())
            .spawn(move || loop {
                let last = matches!(
                    signals.recv_timeout(CHECKPOINT_EVERY),
                    Ok(Signal::Stop) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
                );
                let asked = wal.pass_starts();
                // PASSIVE: copies what no reader still needs, never waits for the writer.
                if let Err(err) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                    tracing::warn!(error = %err, "WAL checkpoint failed; will retry");
                }
                wal.pass_ended(asked);
                if last {
                    return;
                }
            })
            .map_err(|e| StorageError::Internal(format!("cannot start the checkpoint thread: {e}")))?;
        Ok(Self { signal, thread })
    }

    /// What the writer calls to ask for a pass.
    fn wake(&self) -> writer::Wake {
        let signal = self.signal.clone();
        Box::new(move || {
            let _ = signal.send(Signal::Pass);
        })
    }
}

/// The database file of a `sqlite://path` (or `sqlite:path`) URL, its directory created if
/// missing. Query parameters are refused rather than ignored: durability and timeouts are
/// settings of their own.
fn database_path(settings: &SqliteSettings) -> Result<PathBuf, StorageError> {
    let bad = |why: &str| StorageError::Internal(format!("bad SQLite URL {:?}: {why}", settings.url));
    let rest = settings
        .url
        .strip_prefix("sqlite://")
        .or_else(|| settings.url.strip_prefix("sqlite:"))
        .ok_or_else(|| bad("it must start with sqlite://"))?;
    if rest.contains('?') {
        return Err(bad("query parameters are not supported"));
    }
    if rest.is_empty() || rest.starts_with(':') {
        return Err(bad("it must name a database file"));
    }
    let path = PathBuf::from(rest);
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| StorageError::Unavailable(format!("cannot create {}: {e}", parent.display())))?;
    }
    Ok(path)
}

impl SqliteStorage {
    /// Opens the database, applies migrations and starts the writer.
    pub async fn open(settings: &SqliteSettings) -> Result<Self, StorageError> {
        let path = database_path(settings)?;
        let mut write_conn = open_writer(&path, settings)?;
        migrate::run(&mut write_conn)?;
        // Shared by the writer and the checkpoint thread for the life of the process (SQLite's
        // WAL hook on the writer's connection writes into it).
        let wal: &'static Wal = Box::leak(Box::default());
        let checkpointer = Checkpointer::start(&path, settings, wal)?;
        let (writer, thread) = Writer::start(write_conn, settings.writer, wal, Some(checkpointer.wake()))
            .map_err(|e| StorageError::Internal(format!("cannot start the writer thread: {e}")))?;
        let readers = Readers::new(&path, settings.read_connections.max(1) as usize, settings.busy_timeout);
        Ok(Self {
            readers: Arc::new(readers),
            writer: Mutex::new(Some(writer)),
            writer_thread: Mutex::new(Some(thread)),
            checkpointer: Mutex::new(Some(checkpointer)),
        })
    }

    /// Applies migrations and returns, for `stockd migrate`.
    pub async fn migrate(settings: &SqliteSettings) -> Result<(), StorageError> {
        let mut conn = open_writer(&database_path(settings)?, settings)?;
        migrate::run(&mut conn)
    }

    fn readers(&self) -> &Arc<Readers> {
        &self.readers
    }

    fn writer(&self) -> Result<Writer, StorageError> {
        self.writer
            .lock()
            .map_err(|_| StorageError::Internal("writer handle poisoned".into()))?
            .clone()
            .ok_or_else(|| StorageError::Unavailable("shutting down".into()))
    }
}

/// The writer's own connection, with the same durability settings as the pool.
fn open_writer(path: &Path, settings: &SqliteSettings) -> Result<rusqlite::Connection, StorageError> {
    // The first connection this process opens: SQLite's own settings go first.
    library::configure();
    // A commit's WAL frames handed to the kernel in a few writes (`walbuf`), when commits sync.
    let conn = match walbuf::for_writer(settings.synchronous_full) {
        Some(vfs) => rusqlite::Connection::open_with_flags_and_vfs(path, rusqlite::OpenFlags::default(), vfs)?,
        None => rusqlite::Connection::open(path)?,
    };
    conn.busy_timeout(settings.busy_timeout)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", if settings.synchronous_full { "FULL" } else { "NORMAL" })?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    // Savepoint sub-journals in memory: spilled to a temporary file they cost a write system
    // call per page a batch touches (~15% of the writer's time under load).
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    // See `Checkpointer`: the writer's checkpoint keeps the WAL bounded (the writer thread
    // replaces this autocheckpoint by its own, run after a batch is answered; `stockd migrate`
    // keeps it).
    conn.pragma_update(None, "wal_autocheckpoint", writer::CHECKPOINT_PAGES)?;
    // Without a limit the WAL file keeps the largest size it ever reached (it is reused from
    // its start, never shrunk); with one, it is truncated to the limit each time it starts over.
    conn.pragma_update(None, "journal_size_limit", i64::try_from(settings.wal_limit_bytes).unwrap_or(i64::MAX))?;
    // Room for every statement the writer prepares, so none is ever re-prepared.
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

#[async_trait]
impl Storage for SqliteStorage {
    async fn ready(&self) -> Result<(), StorageError> {
        self.readers.snapshot(|conn| Ok(conn.prepare_cached("SELECT 1 FROM resources LIMIT 1")?.exists([])?)).await?;
        if self.writer()?.is_running() {
            Ok(())
        } else {
            Err(StorageError::Unavailable("the writer thread has stopped".into()))
        }
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
        self.writer()?.submit(move |conn| ops::create_tenant(conn, &id, &name, rate_limit, &key, now_ms)).await
    }

    async fn list_tenants(&self) -> Result<Vec<TenantRecord>, StorageError> {
        self.readers
            .snapshot(|conn| {
                let sql = format!("SELECT {TENANT_COLUMNS} FROM tenants ORDER BY id LIMIT 10000");
                all(&mut conn.prepare_cached(&sql)?, [], rows::tenant)
            })
            .await
    }

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Option<Vec<ApiKeyInfo>>, StorageError> {
        let tenant = tenant.clone();
        self.readers
            .snapshot(move |conn| {
                let keys = all(
                    &mut conn.prepare_cached(rows::LIST_API_KEYS_SQL)?,
                    params![tenant.as_str(), rows::MAX_API_KEYS_LISTED],
                    rows::api_key_info,
                )?;
                let exists = || -> Result<bool, StorageError> {
                    Ok(conn.prepare_cached(rows::TENANT_EXISTS_SQL)?.exists(params![tenant.as_str()])?)
                };
                Ok((!keys.is_empty() || exists()?).then_some(keys))
            })
            .await
    }

    async fn add_api_key(&self, tenant: &TenantId, key: &NewApiKey, now_ms: i64) -> Result<Option<()>, StorageError> {
        let (tenant, key) = (tenant.clone(), key.clone());
        self.writer()?.submit(move |conn| ops::add_api_key(conn, &tenant, &key, now_ms)).await
    }

    async fn revoke_api_key(&self, tenant: &TenantId, key_id: &str, now_ms: i64) -> Result<Option<()>, StorageError> {
        let (tenant, key_id) = (tenant.clone(), key_id.to_string());
        self.writer()?.submit(move |conn| ops::revoke_api_key(conn, &tenant, &key_id, now_ms)).await
    }

    async fn find_api_key(&self, hash: &str) -> Result<Option<ApiKeyRecord>, StorageError> {
        let hash = hash.to_string();
        self.readers
            .snapshot(move |conn| {
                let sql = format!(
                    "SELECT {API_KEY_COLUMNS} FROM api_keys k JOIN tenants t ON t.id = k.tenant_id
                     WHERE k.hash = ?1 AND k.revoked_at IS NULL"
                );
                conn.prepare_cached(&sql)?.query_row(params![hash], mapped(rows::api_key)).optional()?.transpose()
            })
            .await
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
        self.writer()?
            .submit(move |conn| ops::ensure_config_tenant(conn, &id, &name, rate_limit, &key_hash, now_ms))
            .await
    }

    async fn set_rate_limit(&self, tenant: &TenantId, limit: Option<RateLimit>) -> Result<Option<()>, StorageError> {
        let tenant = tenant.clone();
        self.writer()?.submit(move |conn| ops::set_rate_limit(conn, &tenant, limit)).await
    }

    async fn create_resource(
        &self,
        tenant: &TenantId,
        res: &NewResource,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError> {
        let (tenant, res) = (tenant.clone(), res.clone());
        self.writer()?
            .submit(move |conn| run_now(resources::create(&mut SqlitePort::new(conn), &tenant, &res, None, now_ms)))
            .await
    }

    async fn resource_holding(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        ids: &[String],
    ) -> Result<Holding, StorageError> {
        let (tenant, key, ids) = (tenant.clone(), key.clone(), ids.to_vec());
        self.readers
            .snapshot(move |conn| {
                run_now(reads::resource_holding(&mut SqlitePort::new(conn), &tenant, key.as_str(), &ids))
            })
            .await
    }

    async fn list_resources(
        &self,
        tenant: &TenantId,
        prefix: Option<&str>,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<ResourceState>, StorageError> {
        let (tenant, prefix, after) = (tenant.clone(), prefix.map(str::to_string), after.map(str::to_string));
        self.readers
            .snapshot(move |conn| {
                let mut port = SqlitePort::new(conn);
                run_now(reads::resources(&mut port, &tenant, prefix.as_deref(), after.as_deref(), limit))
            })
            .await
    }

    async fn set_resource_status(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        status: ResourceStatus,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError> {
        let (tenant, key) = (tenant.clone(), key.clone());
        self.writer()?
            .submit(move |conn| {
                run_now(resources::set_status(&mut SqlitePort::new(conn), &tenant, &key, status, now_ms))
            })
            .await
    }

    async fn set_low_stock(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        low_stock: Option<i64>,
        now_ms: i64,
    ) -> Result<Option<ResourceState>, StorageError> {
        let (tenant, key) = (tenant.clone(), key.clone());
        self.writer()?
            .submit(move |conn| {
                run_now(resources::set_low_stock(&mut SqlitePort::new(conn), &tenant, &key, low_stock, now_ms))
            })
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
        let (tenant, idem, key) = (tenant.clone(), idem.clone(), key.clone());
        self.writer()?
            .submit(move |conn| {
                run_now(resources::adjust(&mut SqlitePort::new(conn), &tenant, &idem, &key, delta, fence, now_ms))
            })
            .await
    }

    async fn ledger_page(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        from: PageFrom,
        limit: u32,
    ) -> Result<Option<Vec<LedgerEntry>>, StorageError> {
        let (tenant, key) = (tenant.clone(), key.clone());
        self.readers
            .snapshot(move |conn| {
                run_now(reads::ledger(&mut SqlitePort::new(conn), &tenant, key.as_str(), from, limit))
            })
            .await
    }

    async fn stored_outcome(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
    ) -> Result<Option<Idempotent>, StorageError> {
        // In-process (microseconds); on a blocking thread only if the database was locked.
        match self.readers.point(|conn| SqlitePort::new(conn).lookup(tenant, idem)) {
            Err(StorageError::Unavailable(_)) => {
                let (tenant, idem) = (tenant.clone(), idem.clone());
                self.readers.snapshot(move |conn| SqlitePort::new(conn).lookup(&tenant, &idem)).await
            }
            answered => answered,
        }
    }

    async fn execute_order(&self, job: Arc<OrderJob>, now_ms: i64) -> Result<OrderExecution, StorageError> {
        self.writer()?.submit_order(job, now_ms).await
    }

    async fn preview_order(
        &self,
        tenant: &TenantId,
        order: &OrderRequest,
        plan: &Plan,
    ) -> Result<OrderDocument, StorageError> {
        let (tenant, order, plan) = (tenant.clone(), order.clone(), plan.clone());
        self.readers
            .snapshot(move |conn| run_now(reads::preview(&mut SqlitePort::new(conn), &tenant, &order, &plan)))
            .await
    }

    async fn get_order(&self, tenant: &TenantId, order_id: &OrderId) -> Result<Option<OrderLedger>, StorageError> {
        let (tenant, order_id) = (tenant.clone(), order_id.clone());
        self.readers
            .snapshot(move |conn| {
                run_now(reversals::order(&mut SqlitePort::new(conn), tenant.as_str(), order_id.as_str()))
            })
            .await
    }

    async fn reverse_order(&self, job: Arc<ReversalJob>, now_ms: i64) -> Result<Reversed, StorageError> {
        self.writer()?.submit(move |conn| run_now(reversals::reverse(&mut SqlitePort::new(conn), &job, now_ms))).await
    }

    async fn get_reservation(&self, tenant: &TenantId, id: &str) -> Result<Option<Reservation>, StorageError> {
        let (tenant, id) = (tenant.clone(), id.to_string());
        self.readers
            .snapshot(move |conn| {
                use crate::apply::port::Port;
                run_now(SqlitePort::new(conn).reservation(tenant.as_str(), &id))
            })
            .await
    }

    async fn held_reservations(&self, tenant: &TenantId, limit: u32) -> Result<Vec<Reservation>, StorageError> {
        let tenant = tenant.clone();
        self.readers
            .snapshot(move |conn| {
                use crate::apply::port::Port;
                run_now(SqlitePort::new(conn).held_reservations(tenant.as_str(), limit))
            })
            .await
    }

    async fn confirm_reservation(&self, tenant: &TenantId, id: &str, now_ms: i64) -> Result<Transition, StorageError> {
        let job = MoveJob { tenant: tenant.clone(), id: id.to_string(), to: ReservationState::Confirmed };
        self.writer()?.submit_move(job, now_ms).await
    }

    async fn release_reservation(&self, tenant: &TenantId, id: &str, now_ms: i64) -> Result<Transition, StorageError> {
        let job = MoveJob { tenant: tenant.clone(), id: id.to_string(), to: ReservationState::Released };
        self.writer()?.submit_move(job, now_ms).await
    }

    async fn expire_due(&self, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.writer()?
            .submit(move |conn| run_now(reservations::expire_due(&mut SqlitePort::new(conn), now_ms, limit)))
            .await
    }

    async fn rebalance_buckets(&self, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.writer()?.submit(move |conn| run_now(buckets::rebalance(&mut SqlitePort::new(conn), now_ms, limit))).await
    }

    async fn reconcile(&self, tenant: Option<&TenantId>, pass: Pass) -> Result<Reconciliation, StorageError> {
        // One read transaction: resources and ledger come from the same snapshot, so a commit
        // landing between the reads can never look like drift.
        let tenant = tenant.cloned();
        let (report, update) = self
            .readers
            .snapshot(move |conn| run_now(reads::reconciliation(&mut SqlitePort::new(conn), tenant.as_ref(), pass)))
            .await?;
        if report.drift.iter().any(|d| d.new) {
            let drift = report.drift.clone();
            let now_ms = crate::time::now_ms();
            self.writer()?
                .submit(move |conn| run_now(reads::report_drift(&mut SqlitePort::new(conn), &drift, now_ms)))
                .await?;
        }
        // The report stands whether or not its checkpoints are stored: without them the next
        // pass only replays more.
        for part in update.into_parts(super::CHECKPOINTS_PER_WRITE) {
            let saved = self
                .writer()?
                .submit(move |conn| run_now(reads::save_checkpoints(&mut SqlitePort::new(conn), &part)))
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
        let tenant = tenant.clone();
        let types = if types.is_empty() {
            String::new()
        } else {
            serde_json::to_string(&types.iter().map(|t| t.as_str()).collect::<Vec<_>>())
                .map_err(|e| StorageError::Internal(e.to_string()))?
        };
        self.readers.snapshot(move |conn| ops::events_page(conn, tenant.as_str(), from, &types, limit)).await
    }

    async fn purge_events(&self, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.writer()?.submit(move |conn| ops::purge_events(conn, before_ms, limit)).await
    }

    async fn sink_backlog(&self, sink: &str, max_tenants: u32) -> Result<SinkBacklog, StorageError> {
        let sink = sink.to_string();
        self.readers.snapshot(move |conn| sinks::backlog(conn, &sink, max_tenants)).await
    }

    async fn claim_sink_cursor(
        &self,
        sink: &str,
        tenant: &TenantId,
    ) -> Result<Option<Box<dyn SinkClaim>>, StorageError> {
        let (sink, tenant) = (sink.to_string(), tenant.clone());
        let cursor = {
            let (sink, tenant) = (sink.clone(), tenant.clone());
            self.readers.snapshot(move |conn| sinks::cursor(conn, &sink, tenant.as_str())).await?
        };
        let claim = sinks::SqliteClaim { readers: self.readers.clone(), writer: self.writer()?, sink, tenant, cursor };
        Ok(Some(Box::new(claim)))
    }

    async fn purge_idempotency(&self, before_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.writer()?.submit(move |conn| ops::purge_idempotency(conn, before_ms, limit)).await
    }

    async fn save_plugin(
        &self,
        tenant: &TenantId,
        upload: &PluginUpload,
        now_ms: i64,
    ) -> Result<PluginVersion, StorageError> {
        let (tenant, upload) = (tenant.clone(), upload.clone());
        self.writer()?.submit(move |conn| ops::save_plugin(conn, &tenant, &upload, now_ms)).await
    }

    async fn list_plugins(&self, tenant: &TenantId) -> Result<Vec<PluginVersion>, StorageError> {
        let tenant = tenant.clone();
        self.readers
            .snapshot(move |conn| {
                let mut statement = conn.prepare_cached(rows::LIST_PLUGINS_SQL)?;
                all(&mut statement, params![tenant.as_str()], rows::plugin_version)
            })
            .await
    }

    async fn activate_plugin(&self, tenant: &TenantId, version: i64) -> Result<Option<PluginVersion>, StorageError> {
        let tenant = tenant.clone();
        self.writer()?.submit(move |conn| ops::activate_plugin(conn, &tenant, version)).await
    }

    async fn active_plugin(&self, tenant: &TenantId) -> Result<Option<PluginVersion>, StorageError> {
        let tenant = tenant.clone();
        self.readers
            .snapshot(move |conn| {
                conn.prepare_cached(rows::ACTIVE_PLUGIN_SQL)?
                    .query_row(params![tenant.as_str()], mapped(rows::plugin_version))
                    .optional()?
                    .transpose()
            })
            .await
    }

    async fn plugin_wasm(&self, tenant: &TenantId, version: i64) -> Result<Option<Vec<u8>>, StorageError> {
        let tenant = tenant.clone();
        self.readers
            .snapshot(move |conn| {
                Ok(conn
                    .prepare_cached("SELECT wasm FROM plugins WHERE tenant_id = ?1 AND version = ?2")?
                    .query_row(params![tenant.as_str(), version], |row| row.get(0))
                    .optional()?)
            })
            .await
    }

    async fn close(&self) {
        // Dropping the last handle lets the writer drain its queue and stop.
        if let Ok(mut w) = self.writer.lock() {
            w.take();
        }
        let thread = self.writer_thread.lock().ok().and_then(|mut t| t.take());
        if let Some(thread) = thread {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        // After the writer's last commit: one more checkpoint, then the thread ends.
        let checkpointer = self.checkpointer.lock().ok().and_then(|mut c| c.take());
        if let Some(Checkpointer { signal, thread }) = checkpointer {
            let _ = signal.send(Signal::Stop);
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The writer and the checkpoint thread together (the writer asks for a pass, then finishes
    /// the checkpoint itself): under steady commits the WAL still starts over, within twice its
    /// threshold, the bound the writer keeps on its own when the thread falls behind.
    #[tokio::test]
    async fn the_wal_starts_over_under_steady_commits() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("wal.sqlite");
        let settings = SqliteSettings {
            url: format!("sqlite://{}", path.display()),
            read_connections: 2,
            synchronous_full: true,
            busy_timeout: Duration::from_secs(5),
            // Cut back to nothing each time it starts over, so its size is what it holds.
            wal_limit_bytes: 0,
            writer: WriterLimits { max_batch: 4, queue_depth: 16, max_wait: Duration::ZERO, checkpoint_pages: 50 },
        };
        let storage = SqliteStorage::open(&settings).await.expect("the database opens");
        let writer = storage.writer().expect("the writer runs");
        writer.submit(|c| Ok(c.execute_batch("CREATE TABLE t (x BLOB)")?)).await.expect("a table");
        let wal_path = dir.path().join("wal.sqlite-wal");
        let mut largest = 0;
        for _ in 0..600 {
            // A new 4 KiB leaf a row: ~2 frames a commit.
            writer.submit(|c| Ok(c.execute("INSERT INTO t VALUES (randomblob(3000))", [])?)).await.expect("a commit");
            let bytes = std::fs::metadata(&wal_path).expect("the WAL exists").len();
            largest = largest.max(writer::tests::frames(bytes, 4096));
        }
        assert!(largest <= 2 * 50 + 4, "the WAL grew to {largest} frames; it must start over by 100");
        drop(writer);
        storage.close().await;
    }

    /// Write system calls this thread has made (`/proc/thread-self/io`).
    fn writes_of_this_thread() -> u64 {
        let io = std::fs::read_to_string("/proc/thread-self/io").expect("the thread's I/O counters");
        io.lines().find_map(|l| l.strip_prefix("syscw:")).and_then(|n| n.trim().parse().ok()).expect("a syscw line")
    }

    /// Commits rows `first..first + 50` of ~3,000 random bytes each (a leaf each: ~50 WAL frames)
    /// in one transaction, and answers the write system calls it took.
    fn write_calls_of_a_commit(conn: &mut rusqlite::Connection, first: i64) -> u64 {
        let before = writes_of_this_thread();
        let tx = conn.transaction().expect("a transaction");
        for row in first..first + 50 {
            tx.execute("INSERT INTO t VALUES (?1, randomblob(3000))", [row]).expect("a row");
        }
        tx.commit().expect("a commit");
        writes_of_this_thread() - before
    }

    /// The writer's connection to a new database in `dir` holding a table `t (n, x)`, with
    /// `synchronous` FULL or NORMAL, and the database's path.
    fn writer_in(dir: &Path, synchronous_full: bool) -> (PathBuf, rusqlite::Connection) {
        let settings = SqliteSettings {
            url: format!("sqlite://{}", dir.join("gather.sqlite").display()),
            read_connections: 1,
            synchronous_full,
            busy_timeout: Duration::from_secs(5),
            wal_limit_bytes: 0,
            writer: WriterLimits { max_batch: 4, queue_depth: 16, max_wait: Duration::ZERO, checkpoint_pages: 50 },
        };
        let path = database_path(&settings).expect("a path");
        let conn = open_writer(&path, &settings).expect("the writer's connection");
        conn.pragma_update(None, "wal_autocheckpoint", 0).expect("no checkpoints");
        conn.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY, x BLOB)").expect("a table");
        (path, conn)
    }

    /// With `synchronous = FULL` the writer's connection hands a commit's WAL frames to the
    /// kernel in a few writes (`walbuf`), not two a frame; another connection sees every row of every
    /// commit, and so does a new one after the writer's connection is gone without a checkpoint.
    #[test]
    fn a_commits_frames_go_to_the_kernel_in_one_write() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (path, mut conn) = writer_in(dir.path(), true);
        let reader = rusqlite::Connection::open(&path).expect("a reader");
        let mut written = 0;
        for commit in 0..20_i64 {
            let calls = write_calls_of_a_commit(&mut conn, commit * 50);
            // ~50 frames of 4,120 bytes, in writes of 124 KiB: 2; two a frame without gathering.
            assert!(calls <= 4, "commit {commit} took {calls} write calls");
            written += 50;
            let seen: i64 = reader.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0)).expect("a count");
            assert_eq!(seen, written, "another connection sees every committed row");
        }
        drop(reader);
        // Gone as a crashed process goes, without closing (closing would checkpoint): the frames
        // are only in the WAL, and a new connection reads them there.
        std::mem::forget(conn);
        let again = rusqlite::Connection::open(&path).expect("reopened");
        let seen: i64 = again.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0)).expect("a count");
        assert_eq!(seen, written);
        let check: String = again.query_row("PRAGMA integrity_check", [], |r| r.get(0)).expect("a check");
        assert_eq!(check, "ok");
    }

    /// A transaction larger than the page cache spills pages to the WAL before it commits and
    /// reads them back from there (gathered writes are handed over before any read); one rolled
    /// back leaves nothing behind, and the next commit is whole. Readers see none of it early.
    #[test]
    fn a_transaction_that_spills_reads_its_own_pages_back() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (path, mut conn) = writer_in(dir.path(), true);
        conn.pragma_update(None, "cache_size", 50).expect("a cache of 50 pages");
        let reader = rusqlite::Connection::open(&path).expect("a reader");
        let count = |c: &rusqlite::Connection| -> i64 {
            c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0)).expect("a count")
        };
        let sum = |c: &rusqlite::Connection| -> i64 {
            c.query_row("SELECT COALESCE(SUM(length(x)), 0) FROM t", [], |r| r.get(0)).expect("a sum")
        };
        for keep in [false, true] {
            let tx = conn.transaction().expect("a transaction");
            for row in 0..2_000_i64 {
                // ~2,000 pages: forty times the cache.
                tx.execute("INSERT INTO t VALUES (?1, randomblob(3000))", [row]).expect("a row");
            }
            // Every page read back, most of them from the WAL the transaction spilled to.
            assert_eq!(count(&tx), 2_000);
            assert_eq!(sum(&tx), 2_000 * 3_000);
            assert_eq!(count(&reader), 0, "nothing is visible before the commit");
            if keep {
                tx.commit().expect("a commit");
            } else {
                tx.rollback().expect("a rollback");
                assert_eq!(count(&conn), 0);
            }
        }
        assert_eq!((count(&reader), sum(&reader)), (2_000, 2_000 * 3_000));
        let check: String = reader.query_row("PRAGMA integrity_check", [], |r| r.get(0)).expect("a check");
        assert_eq!(check, "ok");
    }

    /// With `synchronous = NORMAL` a commit publishes its frames without a sync, the moment the
    /// gathering relies on: the writer keeps SQLite's own VFS, a write call per frame part.
    #[test]
    fn with_synchronous_normal_frames_are_not_gathered() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (_, mut conn) = writer_in(dir.path(), false);
        let calls = write_calls_of_a_commit(&mut conn, 0);
        assert!(calls >= 100, "{calls} write calls for ~50 frames");
    }
}
