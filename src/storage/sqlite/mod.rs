//! The embedded SQLite backend (WAL). Writes go through one group-committing writer thread
//! ([`writer`], [`ops`]); reads use a pool of read connections that WAL lets run beside it.

pub mod lookup;
pub mod ops;
pub mod port;
pub mod redis_store;
pub mod writer;

use std::path::Path;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{ConnectOptions, Row};

use self::port::SqlitePort;
use self::writer::{Writer, WriterLimits};
use super::rules::{
    self, bucket_rows, fold_all, preview_line, previewed, reconcile_rows, API_KEY_COLUMNS, BUCKET_COLUMNS,
    RESOURCE_COLUMNS, TENANT_COLUMNS,
};
use super::{
    AdjustRefusal, ApiKeyRecord, IdempotencyRequest, Idempotent, Insert, NewApiKey, NewResource, OrderExecution,
    OrderJob, PluginUpload, PluginVersion, Storage, StorageError, TenantRecord, Transition,
};
use crate::apply::port::run_now;
use crate::apply::{buckets, reservations, resources};
use crate::engine::{
    Kind, LedgerEntry, LedgerOp, Mode, OrderDocument, OrderRequest, Plan, Reconciliation, Reservation,
    ReservationState, ResourceKey, ResourceState, ResourceStatus, TenantId,
};
use crate::ratelimit::RateLimit;
use crate::storage::redis_store::{outcome_of, STORED_OUTCOME_SQL};
use crate::time::Timestamp;

/// How the SQLite backend is opened.
#[derive(Debug, Clone)]
pub struct SqliteSettings {
    pub url: String,
    pub read_connections: u32,
    /// `FULL` (default) makes every acknowledged commit survive power loss; `NORMAL` only a
    /// process crash.
    pub synchronous_full: bool,
    pub busy_timeout: Duration,
    pub writer: WriterLimits,
}

pub struct SqliteStorage {
    read: SqlitePool,
    /// In-process idempotency lookups (the first step of every mutating request).
    lookups: lookup::Lookups,
    writer: Mutex<Option<Writer>>,
    writer_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    checkpointer: Mutex<Option<Checkpointer>>,
}

/// Moves committed WAL frames into the database file on a thread of its own, so the checkpoint
/// the writer still runs every `WRITER_AUTOCHECKPOINT_PAGES` finds most frames already copied
/// (checkpointing was ~7% of the writer's time under load). The writer's own checkpoint stays:
/// only a checkpoint that completes between two of its transactions lets the next one restart
/// the WAL from the beginning; with the thread alone, under steady load, the WAL never restarts
/// and grows without bound (2 GiB in 20 s of hot-key load).
struct Checkpointer {
    stop: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

/// How often the checkpointer runs.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(200);
/// WAL pages after which the writer checkpoints; bounds the WAL at ~40 MiB
/// plus one batch.
const WRITER_AUTOCHECKPOINT_PAGES: i64 = 10_000;

impl Checkpointer {
    fn start(path: &Path, settings: &SqliteSettings) -> Result<Self, StorageError> {
        let conn = rusqlite::Connection::open(path)?;
        conn.busy_timeout(settings.busy_timeout)?;
        conn.pragma_update(None, "synchronous", if settings.synchronous_full { "FULL" } else { "NORMAL" })?;
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("stockd-checkpoint".into())
            .spawn(move || loop {
                let last =
                    !matches!(stopped.recv_timeout(CHECKPOINT_EVERY), Err(std::sync::mpsc::RecvTimeoutError::Timeout));
                // PASSIVE: copies what no reader still needs, never waits for the writer.
                if let Err(err) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                    tracing::warn!(error = %err, "WAL checkpoint failed; will retry");
                }
                if last {
                    return;
                }
            })
            .map_err(|e| StorageError::Internal(format!("cannot start the checkpoint thread: {e}")))?;
        Ok(Self { stop, thread })
    }
}

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

fn options(settings: &SqliteSettings) -> Result<SqliteConnectOptions, StorageError> {
    let opts = SqliteConnectOptions::from_str(&settings.url)
        .map_err(|e| StorageError::Internal(format!("bad SQLite URL: {e}")))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(if settings.synchronous_full { SqliteSynchronous::Full } else { SqliteSynchronous::Normal })
        .busy_timeout(settings.busy_timeout)
        .foreign_keys(true)
        .log_statements(tracing::log::LevelFilter::Trace);
    if let Some(parent) = Path::new(opts.get_filename()).parent() {
        if !parent.as_os_str().is_empty() {
            std::fs::create_dir_all(parent)
                .map_err(|e| StorageError::Unavailable(format!("cannot create {}: {e}", parent.display())))?;
        }
    }
    Ok(opts)
}

impl SqliteStorage {
    /// Opens the database, applies migrations and starts the writer.
    pub async fn open(settings: &SqliteSettings) -> Result<Self, StorageError> {
        let opts = options(settings)?;
        let read = SqlitePoolOptions::new()
            .max_connections(settings.read_connections.max(1))
            .connect_with(opts.clone())
            .await?;
        MIGRATOR.run(&read).await.map_err(|e| StorageError::Internal(format!("migration failed: {e}")))?;
        let write_conn = open_writer(opts.get_filename(), settings)?;
        let checkpointer = Checkpointer::start(opts.get_filename(), settings)?;
        let (writer, thread) = Writer::start(write_conn, settings.writer)
            .map_err(|e| StorageError::Internal(format!("cannot start the writer thread: {e}")))?;
        Ok(Self {
            read,
            lookups: lookup::Lookups::new(opts.get_filename(), settings.read_connections.max(1) as usize),
            writer: Mutex::new(Some(writer)),
            writer_thread: Mutex::new(Some(thread)),
            checkpointer: Mutex::new(Some(checkpointer)),
        })
    }

    /// Applies migrations and returns, for `stockd migrate`.
    pub async fn migrate(settings: &SqliteSettings) -> Result<(), StorageError> {
        let pool = SqlitePoolOptions::new().max_connections(1).connect_with(options(settings)?).await?;
        MIGRATOR.run(&pool).await.map_err(|e| StorageError::Internal(format!("migration failed: {e}")))?;
        pool.close().await;
        Ok(())
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
    let conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(settings.busy_timeout)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", if settings.synchronous_full { "FULL" } else { "NORMAL" })?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    // Savepoint sub-journals in memory: spilled to a temporary file they cost a write system
    // call per page a batch touches (~15% of the writer's time under load).
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    // See `Checkpointer`: the writer's checkpoint keeps the WAL bounded.
    conn.pragma_update(None, "wal_autocheckpoint", WRITER_AUTOCHECKPOINT_PAGES)?;
    // Room for every statement the writer prepares, so none is ever re-prepared.
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// A dry run's view of a resource: `(status, kind, available)`, a bucketed one's available
/// being its buckets' sum.
const PREVIEW_VIEW: &str = "SELECT status, kind, mode,
        CASE WHEN buckets = 1 THEN available ELSE
          (SELECT COALESCE(SUM(b.available), 0) FROM resource_buckets b
           WHERE b.tenant_id = r.tenant_id AND b.resource_key = r.key) END AS available,
        buckets
    FROM resources r WHERE tenant_id = $1 AND key = $2";

impl SqliteStorage {
    /// Folds each bucketed resource's totals in from its buckets, read in one snapshot.
    async fn fold_buckets(
        &self,
        states: &mut [(String, ResourceState)],
        keep_counts: bool,
    ) -> Result<(), StorageError> {
        let mut tx = self.read.begin().await?;
        let mut grouped = std::collections::HashMap::new();
        for (tenant, state) in states.iter().filter(|(_, s)| s.buckets > 1) {
            let rows = sqlx::query(&format!(
                "SELECT {BUCKET_COLUMNS} FROM resource_buckets WHERE tenant_id = $1 AND resource_key = $2 ORDER BY bucket"
            ))
            .bind(tenant.as_str())
            .bind(state.key.as_str())
            .fetch_all(&mut *tx)
            .await?;
            grouped.extend(bucket_rows(&rows)?);
        }
        tx.commit().await?;
        fold_all(states, grouped, keep_counts);
        Ok(())
    }
}

fn resource_from_row(row: &sqlx::sqlite::SqliteRow) -> Result<ResourceState, StorageError> {
    let corrupt = || StorageError::Internal("unexpected stored value in resources".into());
    Ok(ResourceState {
        key: row.try_get("key")?,
        kind: Kind::from_db(row.try_get("kind")?).ok_or_else(corrupt)?,
        status: ResourceStatus::from_db(row.try_get("status")?).ok_or_else(corrupt)?,
        available: row.try_get("available")?,
        reserved: row.try_get("reserved")?,
        consumed: row.try_get("consumed")?,
        total: row.try_get("total")?,
        buckets: row.try_get("buckets")?,
        mode: Mode::from_db(row.try_get("mode")?).ok_or_else(corrupt)?,
        version: row.try_get("version")?,
        updated_at: Timestamp(row.try_get("updated_at")?),
        bucket_counts: None,
    })
}

fn reservation_from_row(row: &sqlx::sqlite::SqliteRow) -> Result<Reservation, StorageError> {
    let corrupt = || StorageError::Internal("unexpected stored value in reservations".into());
    let lines: String = row.try_get("lines")?;
    Ok(Reservation {
        id: row.try_get("id")?,
        order_id: row.try_get("order_id")?,
        state: ReservationState::from_db(row.try_get("state")?).ok_or_else(corrupt)?,
        lines: serde_json::from_str(&lines).map_err(|_| corrupt())?,
        expires_at: Timestamp(row.try_get("expires_at")?),
    })
}

fn ledger_from_row(row: &sqlx::sqlite::SqliteRow) -> Result<LedgerEntry, StorageError> {
    let op: String = row.try_get("op")?;
    Ok(LedgerEntry {
        seq: row.try_get("seq")?,
        bucket: row.try_get("bucket")?,
        op: LedgerOp::from_db(&op).ok_or_else(|| StorageError::Internal("unexpected ledger op".into()))?,
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
impl Storage for SqliteStorage {
    async fn ready(&self) -> Result<(), StorageError> {
        sqlx::query("SELECT 1 FROM resources LIMIT 1").fetch_optional(&self.read).await?;
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
        let rows = sqlx::query(&format!("SELECT {TENANT_COLUMNS} FROM tenants ORDER BY id LIMIT 10000"))
            .fetch_all(&self.read)
            .await?;
        rows.iter().map(rules::tenant_row).collect()
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
        let row = sqlx::query(&format!(
            "SELECT {API_KEY_COLUMNS} FROM api_keys k JOIN tenants t ON t.id = k.tenant_id
             WHERE k.hash = $1 AND k.revoked_at IS NULL"
        ))
        .bind(hash)
        .fetch_optional(&self.read)
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

    async fn get_resource(&self, tenant: &TenantId, key: &ResourceKey) -> Result<Option<ResourceState>, StorageError> {
        let row = sqlx::query(&format!("SELECT {RESOURCE_COLUMNS} FROM resources WHERE tenant_id = $1 AND key = $2"))
            .bind(tenant.as_str())
            .bind(key.as_str())
            .fetch_optional(&self.read)
            .await?;
        let Some(state) = row.as_ref().map(resource_from_row).transpose()? else { return Ok(None) };
        let mut states = [(tenant.to_string(), state)];
        self.fold_buckets(&mut states, true).await?;
        let [(_, state)] = states;
        Ok(Some(state))
    }

    async fn list_resources(
        &self,
        tenant: &TenantId,
        prefix: Option<&str>,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<ResourceState>, StorageError> {
        // Keys are [A-Za-z0-9._:@-], so a prefix range needs no LIKE escaping: every key with
        // the prefix sorts in [prefix, prefix || char(0x7f)).
        let prefix = prefix.unwrap_or("");
        let rows = sqlx::query(&format!(
            "SELECT {RESOURCE_COLUMNS} FROM resources
             WHERE tenant_id = $1 AND key >= $2 AND key < $3 AND key > $4
             ORDER BY key LIMIT $5"
        ))
        .bind(tenant.as_str())
        .bind(prefix)
        .bind(format!("{prefix}\u{7f}"))
        .bind(after.unwrap_or(""))
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        let mut states = rows
            .iter()
            .map(|row| Ok((tenant.to_string(), resource_from_row(row)?)))
            .collect::<Result<Vec<_>, StorageError>>()?;
        if states.iter().any(|(_, s)| s.buckets > 1) {
            self.fold_buckets(&mut states, false).await?;
        }
        Ok(states.into_iter().map(|(_, s)| s).collect())
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

    async fn adjust(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
        key: &ResourceKey,
        delta: i64,
        now_ms: i64,
    ) -> Result<Result<Idempotent, AdjustRefusal>, StorageError> {
        let (tenant, idem, key) = (tenant.clone(), idem.clone(), key.clone());
        self.writer()?
            .submit(move |conn| {
                run_now(resources::adjust(&mut SqlitePort::new(conn), &tenant, &idem, &key, delta, now_ms))
            })
            .await
    }

    async fn ledger_page(
        &self,
        tenant: &TenantId,
        key: &ResourceKey,
        after: i64,
        limit: u32,
    ) -> Result<Option<Vec<LedgerEntry>>, StorageError> {
        let mut tx = self.read.begin().await?;
        let exists = sqlx::query("SELECT 1 FROM resources WHERE tenant_id = $1 AND key = $2")
            .bind(tenant.as_str())
            .bind(key.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Ok(None);
        }
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
        rows.iter().map(ledger_from_row).collect::<Result<Vec<_>, _>>().map(Some)
    }

    async fn stored_outcome(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
    ) -> Result<Option<Idempotent>, StorageError> {
        let record = match self.lookups.stored(tenant.as_str(), idem.key.as_str()) {
            Ok(record) => record,
            Err(err) => {
                tracing::debug!(error = %err, "in-process idempotency lookup failed; asking the read pool");
                sqlx::query_as(STORED_OUTCOME_SQL)
                    .bind(tenant.as_str())
                    .bind(idem.key.as_str())
                    .fetch_optional(&self.read)
                    .await?
            }
        };
        Ok(record.map(|(hash, code, kind, body): lookup::Record| outcome_of(idem, &hash, code, &kind, body)))
    }

    async fn execute_order(&self, job: OrderJob, now_ms: i64) -> Result<OrderExecution, StorageError> {
        self.writer()?.submit_order(job, now_ms).await
    }

    async fn preview_order(
        &self,
        tenant: &TenantId,
        order: &OrderRequest,
        plan: &Plan,
    ) -> Result<OrderDocument, StorageError> {
        let mut tx = self.read.begin().await?;
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
                let row: Option<(String, String, String, i64, i64)> = sqlx::query_as(PREVIEW_VIEW)
                    .bind(tenant.as_str())
                    .bind(target.resource.as_str())
                    .fetch_optional(&mut *tx)
                    .await?;
                let view = row.map(|(s, k, m, available, buckets)| rules::view_of(&s, &k, &m, available, buckets));
                views.push(previewed(target, view.transpose()?)?);
            }
            results.push(preview_line(line, used.unwrap_or(0), views));
        }
        Ok(OrderDocument::build(order, plan, &results, None))
    }

    async fn get_reservation(&self, tenant: &TenantId, id: &str) -> Result<Option<Reservation>, StorageError> {
        let row = sqlx::query(
            "SELECT id, order_id, state, lines, expires_at FROM reservations WHERE tenant_id = $1 AND id = $2",
        )
        .bind(tenant.as_str())
        .bind(id)
        .fetch_optional(&self.read)
        .await?;
        row.as_ref().map(reservation_from_row).transpose()
    }

    async fn confirm_reservation(&self, tenant: &TenantId, id: &str, now_ms: i64) -> Result<Transition, StorageError> {
        let (tenant, id) = (tenant.clone(), id.to_string());
        self.writer()?
            .submit(move |conn| run_now(reservations::confirm(&mut SqlitePort::new(conn), &tenant, &id, now_ms)))
            .await
    }

    async fn release_reservation(&self, tenant: &TenantId, id: &str, now_ms: i64) -> Result<Transition, StorageError> {
        let (tenant, id) = (tenant.clone(), id.to_string());
        self.writer()?
            .submit(move |conn| run_now(reservations::release(&mut SqlitePort::new(conn), &tenant, &id, now_ms)))
            .await
    }

    async fn expire_due(&self, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.writer()?
            .submit(move |conn| run_now(reservations::expire_due(&mut SqlitePort::new(conn), now_ms, limit)))
            .await
    }

    async fn rebalance_buckets(&self, now_ms: i64, limit: u32) -> Result<u64, StorageError> {
        self.writer()?.submit(move |conn| run_now(buckets::rebalance(&mut SqlitePort::new(conn), now_ms, limit))).await
    }

    async fn reconcile(&self, tenant: Option<&TenantId>) -> Result<Reconciliation, StorageError> {
        // One read transaction: resources and ledger come from the same snapshot, so a commit
        // landing between the two reads can never look like drift.
        let mut tx = self.read.begin().await?;
        let tenant = tenant.map(TenantId::as_str);
        let resources = sqlx::query(&format!(
            "SELECT tenant_id, {RESOURCE_COLUMNS} FROM resources WHERE ($1 IS NULL OR tenant_id = $1) ORDER BY tenant_id, key"
        ))
        .bind(tenant)
        .fetch_all(&mut *tx)
        .await?;
        let sums = sqlx::query(
            "SELECT tenant_id, resource_key, bucket, op, SUM(qty) AS qty, COUNT(*) AS n FROM ledger
             WHERE ($1 IS NULL OR tenant_id = $1) GROUP BY tenant_id, resource_key, bucket, op",
        )
        .bind(tenant)
        .fetch_all(&mut *tx)
        .await?;
        let latest = sqlx::query(
            "SELECT l.tenant_id, l.resource_key, l.bucket, l.available_after, l.reserved_after, l.consumed_after
             FROM ledger l
             JOIN (SELECT MAX(seq) AS seq FROM ledger WHERE ($1 IS NULL OR tenant_id = $1)
                   GROUP BY tenant_id, resource_key, bucket) m
               ON l.seq = m.seq",
        )
        .bind(tenant)
        .fetch_all(&mut *tx)
        .await?;
        let buckets_read = sqlx::query(&format!(
            "SELECT {BUCKET_COLUMNS} FROM resource_buckets WHERE ($1 IS NULL OR tenant_id = $1)
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
        let rows: Vec<(i64, String, String, i64, bool)> = sqlx::query_as(
            "SELECT p.version, p.sha256, p.config, p.uploaded_at, COALESCE(a.version = p.version, FALSE)
             FROM plugins p LEFT JOIN plugin_active a ON a.tenant_id = p.tenant_id
             WHERE p.tenant_id = $1 ORDER BY p.version LIMIT 10000",
        )
        .bind(tenant.as_str())
        .fetch_all(&self.read)
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
        self.writer()?.submit(move |conn| ops::activate_plugin(conn, &tenant, version)).await
    }

    async fn active_plugin(&self, tenant: &TenantId) -> Result<Option<PluginVersion>, StorageError> {
        let row: Option<(i64, String, String, i64)> = sqlx::query_as(
            "SELECT p.version, p.sha256, p.config, p.uploaded_at FROM plugin_active a
             JOIN plugins p ON p.tenant_id = a.tenant_id AND p.version = a.version WHERE a.tenant_id = $1",
        )
        .bind(tenant.as_str())
        .fetch_optional(&self.read)
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
        Ok(sqlx::query_scalar("SELECT wasm FROM plugins WHERE tenant_id = $1 AND version = $2")
            .bind(tenant.as_str())
            .bind(version)
            .fetch_optional(&self.read)
            .await?)
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
        if let Some(Checkpointer { stop, thread }) = checkpointer {
            drop(stop);
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        self.read.close().await;
    }
}
