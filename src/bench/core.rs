//! The storage core without HTTP: `core-hot-key`, `core-uniform` and `core-multi-line` hand the
//! orders of `hot-key`, `uniform` and `multi-line` straight to the server's storage core
//! (`Storage::execute_order`, the call the pipeline makes for an order on the database path),
//! from as many tasks of the bench's own process as the HTTP scenarios have clients.
//!
//! Each order is built as the HTTP layer leaves it: the same JSON body as the HTTP scenario's,
//! hashed by the server's own request hash, turned into an `OrderBody` by serde, validated and
//! planned by the built-in plan; then executed and its answer checked. What is left out is what a
//! request costs before that: the load generator, TCP, HTTP framing, reading the body's bytes,
//! authentication, the response's headers. The difference between a scenario and its `core-`
//! twin in the same run is what HTTP costs an order; the `core-` figure is the most the server
//! could do with this storage if HTTP cost nothing.
//!
//! Each runs on a database of its own (a SQLite file beside the server's, or a fresh PostgreSQL
//! or MySQL database on the server's database server, dropped at the end), opened with the
//! server's defaults (`[batch]`, `[database]`), so nothing else writes to it. Its CPU per
//! operation is the bench process's own over the load (the storage core, its writer and the
//! tasks that feed it; the database server's own CPU is not in it, as it is not in the HTTP
//! scenarios' `server_cpu_us_per_op`). Checked like the HTTP scenario: no counter negative,
//! each resource sums to its total, and the resources consumed what the acknowledged orders
//! took.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use axum::http::Method;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::load::{self, Limit, Stop, Workload, TOTAL};
use super::server::{cpu_us_of, random_hex, DbAccess, FreshDatabase};
use super::{storage, Backend, Stats};
use crate::api::extract::request_hash;
use crate::config::Config;
use crate::engine::order::OrderBody;
use crate::engine::{DefaultPlanner, IdempotencyKey, Kind, OrderStatus, Planner, ResourceKey, TenantId};
use crate::storage::{IdempotencyRequest, Idempotent, NewApiKey, NewResource, OrderJob, Storage};
use crate::time::now_ms;

/// The name's prefix: `core-` + the HTTP scenario's name.
const PREFIX: &str = "core-";

/// The HTTP workload a `core-` scenario name stands for.
pub fn parse(name: &str) -> Option<Workload> {
    match name.strip_prefix(PREFIX)? {
        "hot-key" => Some(Workload::HotKey),
        "uniform" => Some(Workload::Uniform),
        "multi-line" => Some(Workload::MultiLine),
        _ => None,
    }
}

/// The scenario's name.
pub fn name(w: Workload) -> String {
    format!("{PREFIX}{}", w.name())
}

/// One `core-` scenario's outcome.
pub struct CoreRun {
    pub stats: Stats,
    pub violations: Vec<String>,
    /// The bench process's CPU (user + system) over the load, per successful order.
    pub cpu_us_per_op: Option<f64>,
    /// What the orders left on disk.
    pub usage: storage::Usage,
}

/// The database a `core-` scenario runs on, removed (or dropped) by [`CoreDb::remove`].
enum CoreDb {
    Sqlite(PathBuf),
    Fresh(FreshDatabase),
}

impl CoreDb {
    /// A database beside the server's: its own SQLite file, or a fresh database on the same
    /// PostgreSQL or MySQL server.
    async fn create(server_db: &DbAccess, w: Workload) -> anyhow::Result<(Self, String, DbAccess)> {
        Ok(match server_db {
            DbAccess::Sqlite(path) => {
                let file = sibling_sqlite(path, &name(w));
                let url = format!("sqlite://{}", file.display());
                (Self::Sqlite(file.clone()), url, DbAccess::Sqlite(file))
            }
            DbAccess::Postgres(url) => Self::fresh(Backend::Postgres, url).await?,
            DbAccess::Mysql(url) => Self::fresh(Backend::Mysql, url).await?,
        })
    }

    /// A fresh database on the server `admin_url` names.
    async fn fresh(backend: Backend, admin_url: &str) -> anyhow::Result<(Self, String, DbAccess)> {
        let fresh = FreshDatabase::create(backend, admin_url).await?;
        let (url, access) = (fresh.url.clone(), fresh.access());
        Ok((Self::Fresh(fresh), url, access))
    }

    async fn remove(self) {
        match self {
            Self::Sqlite(file) => remove_sqlite(&file),
            Self::Fresh(fresh) => fresh.drop_database().await,
        }
    }
}

/// A fresh SQLite file for `what` beside the server's database file `path`.
pub(super) fn sibling_sqlite(path: &std::path::Path, what: &str) -> PathBuf {
    path.with_file_name(format!("{what}-{}.sqlite", random_hex(3)))
}

/// Removes a SQLite database file with its WAL and shared-memory files.
pub(super) fn remove_sqlite(file: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
    }
}

/// Runs `core-<w>` on a database of its own beside `server_db`; `hooks` run just before and
/// just after the load, like the HTTP scenarios' (`--exec-before-load`, `--exec-after-load`).
pub async fn run(
    server_db: &DbAccess,
    w: Workload,
    clients: usize,
    limit: Limit,
    hooks: (Option<&str>, Option<&str>),
) -> anyhow::Result<CoreRun> {
    let (db, url, access) = CoreDb::create(server_db, w).await?;
    let outcome = run_on(&url, &access, w, clients, limit, hooks).await;
    db.remove().await;
    outcome
}

async fn run_on(
    url: &str,
    access: &DbAccess,
    w: Workload,
    clients: usize,
    limit: Limit,
    (before, after): (Option<&str>, Option<&str>),
) -> anyhow::Result<CoreRun> {
    let mut config = Config::default();
    config.database.url = url.to_string();
    let storage = crate::startup::open_storage(&config).await?;
    let outcome = async {
        let tenant = TenantId::parse(format!("bench-{}", random_hex(4)))?;
        let key = NewApiKey { id: format!("key_{}", random_hex(8)), hash: random_hex(32) };
        storage.create_tenant(&tenant, "stockd bench core", None, &key, now_ms()).await?;
        create_resources(storage.as_ref(), &tenant, w).await?;
        let probe = storage::Probe::start(access).await;
        let scenario = name(w);
        super::exec_hook(before, &scenario).await?;
        let pid = std::process::id();
        let cpu = cpu_us_of(pid);
        let stats = load_core(&storage, &tenant, w, clients, limit, config.orders.max_lines).await?;
        let cpu_us_per_op = super::cpu_per_op(cpu, cpu_us_of(pid), stats.ok);
        super::exec_hook(after, &scenario).await?;
        let usage = match probe {
            Some(p) => p.finish(stats.ok).await,
            None => storage::Usage::default(),
        };
        let violations = check(storage.as_ref(), &tenant, w, &stats).await?;
        Ok(CoreRun { stats, violations, cpu_us_per_op, usage })
    }
    .await;
    storage.close().await;
    outcome
}

/// The workload's resources, each of [`TOTAL`] units, 64 at a time.
async fn create_resources(storage: &dyn Storage, tenant: &TenantId, w: Workload) -> anyhow::Result<()> {
    use futures::StreamExt;
    let created: Vec<anyhow::Result<()>> = futures::stream::iter(0..w.keys())
        .map(|i| async move {
            let res = NewResource {
                key: ResourceKey::parse(load::key_of(w, i))?,
                kind: Kind::Inventory,
                total: TOTAL,
                buckets: 1,
                low_stock: None,
            };
            match storage.create_resource(tenant, &res, now_ms()).await? {
                Some(_) => Ok(()),
                None => bail!("creating {}: the tenant is missing", res.key),
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    created.into_iter().collect::<anyhow::Result<Vec<()>>>().map(|_| ())
}

/// `clients` tasks in a closed loop, each sending its next order when the last is answered.
async fn load_core(
    storage: &Arc<dyn Storage>,
    tenant: &TenantId,
    w: Workload,
    clients: usize,
    limit: Limit,
    max_lines: usize,
) -> anyhow::Result<Stats> {
    let stop = Stop::start(limit);
    let started = Instant::now();
    let handles = (0..clients)
        .map(|task| tokio::spawn(client_loop(storage.clone(), tenant.clone(), w, task, stop.clone(), max_lines)))
        .collect();
    Stats::joined(handles, started).await
}

async fn client_loop(
    storage: Arc<dyn Storage>,
    tenant: TenantId,
    w: Workload,
    task: usize,
    stop: Stop,
    max_lines: usize,
) -> Stats {
    let mut stats = Stats::default();
    let mut rng = StdRng::seed_from_u64(task as u64 ^ 0x5eed);
    let run = random_hex(3);
    let lines = if w == Workload::MultiLine { 5 } else { 1 };
    let mut i: u64 = 0;
    while stop.next() {
        i += 1;
        let idem = format!("{}-{run}-{task}-{i}", w.name());
        let keys = load::pick_keys(&mut rng, w, lines);
        let started = Instant::now();
        let reason = match order(storage.as_ref(), &tenant, &idem, &keys, max_lines).await {
            Ok(()) => {
                stats.consumed_expected += lines as i64;
                None
            }
            Err(reason) => Some(reason),
        };
        let answer = load::Answer { ok: reason.is_none(), replayed: false, status: None, reason };
        load::record(&mut stats, started, &answer);
    }
    stats
}

/// One order through the storage core; `Err` names why it did not apply.
async fn order(
    storage: &dyn Storage,
    tenant: &TenantId,
    idem: &str,
    keys: &[String],
    max_lines: usize,
) -> Result<(), String> {
    let body = load::order_body(idem, "deduct", keys);
    let hash = request_hash(&Method::POST, "/v1/orders", &body);
    let invalid = |what: &str, err: String| format!("invalid_{what}: {err}");
    let body: OrderBody = serde_json::from_value(body).map_err(|e| invalid("body", e.to_string()))?;
    let order = body.validate(max_lines).map_err(|(field, e)| invalid(&field, e.0))?;
    let now = now_ms();
    let plan = DefaultPlanner.plan(tenant, &order, now).map_err(|e| format!("plan: {}", e.0))?;
    let key = IdempotencyKey::parse(idem).map_err(|e| invalid("key", e.0))?;
    let job = Arc::new(OrderJob {
        tenant: tenant.clone(),
        idempotency: IdempotencyRequest { key, request_hash: hash },
        order,
        plan,
        ttl_ms: 0,
    });
    match storage.execute_order(job, now).await {
        Ok(done) => match (done.response, done.outcome) {
            (Idempotent::Fresh(_), Some((OrderStatus::Succeeded, _))) => Ok(()),
            (Idempotent::Fresh(r), _) => Err(format!("http_{}", r.status)),
            (Idempotent::Replayed(_), _) => Err("replayed".into()),
            (Idempotent::Mismatch, _) => Err("mismatch".into()),
        },
        Err(err) => Err(format!("storage: {err}")),
    }
}

/// No counter negative, each resource summing to its total, `consumed_expected` consumed
/// ([`load::Tally`], as the HTTP scenarios are checked).
async fn check(storage: &dyn Storage, tenant: &TenantId, w: Workload, stats: &Stats) -> anyhow::Result<Vec<String>> {
    let mut tally = load::Tally::default();
    for i in 0..w.keys() {
        let key = ResourceKey::parse(load::key_of(w, i))?;
        if let Some(r) = storage.get_resource(tenant, &key).await.context("reading a resource")? {
            tally.add(&key, r.available, r.reserved, r.consumed, r.total);
        }
    }
    Ok(tally.finish(w.keys(), stats.consumed_expected))
}
