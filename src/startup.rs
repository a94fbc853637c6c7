//! Building the server from config and running it: open storage, declare config tenants, start
//! the jobs, serve HTTP until the shutdown future resolves, then drain and close.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::api::{self, ApiSettings, AppState};
use crate::auth::{self, Authenticator};
use crate::config::{Config, RunMode};
use crate::engine::{ResourceKey, TenantId};
use crate::jobs::supervisor::{JobRegistry, StuckPolicy, Supervisor};
use crate::jobs::{self, JobSettings};
use crate::pipeline::{OrderSettings, Pipeline};
use crate::plugin::{ArtifactStore, HostShared, PlanPool, PluginHost, Registry, Runtime};
use crate::ratelimit::TenantLimiter;
use crate::storage::mysql::{MySettings, MyStorage};
use crate::storage::postgres::{PgSettings, PgStorage};
use crate::storage::sqlite::{SqliteSettings, SqliteStorage};
use crate::storage::writer_limits;
use crate::storage::{NewResource, PluginUpload, Storage};
use crate::time::now_ms;

/// Opens the configured storage backend (migrating it).
pub async fn open_storage(config: &Config) -> anyhow::Result<Arc<dyn Storage>> {
    let url = config.database.url.as_str();
    if url.starts_with("sqlite:") {
        let storage = SqliteStorage::open(&sqlite_settings(config)).await.context("opening the SQLite database")?;
        Ok(Arc::new(storage))
    } else if is_postgres(url) {
        let storage = PgStorage::open(&pg_settings(config)).await.context("opening the PostgreSQL database")?;
        Ok(Arc::new(storage))
    } else if is_mysql(url) {
        let storage = MyStorage::open(&my_settings(config)).await.context("opening the MySQL database")?;
        Ok(Arc::new(storage))
    } else {
        bail!("{UNSUPPORTED_SCHEME}")
    }
}

const UNSUPPORTED_SCHEME: &str = "database.url: unsupported scheme (expected sqlite://, postgres:// or mysql://)";

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// MySQL 8 and MariaDB both (sqlx's driver speaks the protocol they share).
fn is_mysql(url: &str) -> bool {
    url.starts_with("mysql://") || url.starts_with("mariadb://")
}

fn my_settings(config: &Config) -> MySettings {
    let url = &config.database.url;
    MySettings {
        // sqlx knows the scheme as mysql:// only.
        url: url.strip_prefix("mariadb://").map(|rest| format!("mysql://{rest}")).unwrap_or_else(|| url.clone()),
        max_connections: config.database.max_connections,
        acquire_timeout: Duration::from_millis(config.database.acquire_timeout_ms),
        writer: writer_limits(&config.batch),
        max_retries: config.database.max_retries,
    }
}

fn pg_settings(config: &Config) -> PgSettings {
    PgSettings {
        url: config.database.url.clone(),
        max_connections: config.database.max_connections,
        acquire_timeout: Duration::from_millis(config.database.acquire_timeout_ms),
        writer: writer_limits(&config.batch),
        max_retries: config.database.max_retries,
    }
}

/// Applies migrations only (`stockd migrate`).
pub async fn migrate(config: &Config) -> anyhow::Result<()> {
    let url = config.database.url.as_str();
    if url.starts_with("sqlite:") {
        SqliteStorage::migrate(&sqlite_settings(config)).await.context("migrating the SQLite database")?;
    } else if is_postgres(url) {
        PgStorage::migrate(&pg_settings(config)).await.context("migrating the PostgreSQL database")?;
    } else if is_mysql(url) {
        MyStorage::migrate(&my_settings(config)).await.context("migrating the MySQL database")?;
    } else {
        bail!("{UNSUPPORTED_SCHEME}")
    }
    Ok(())
}

fn sqlite_settings(config: &Config) -> SqliteSettings {
    SqliteSettings {
        url: config.database.url.clone(),
        read_connections: config.database.max_connections,
        synchronous_full: config.database.sqlite_synchronous == "full",
        busy_timeout: Duration::from_millis(config.database.busy_timeout_ms),
        wal_limit_bytes: config.database.sqlite_wal_limit_bytes,
        writer: writer_limits(&config.batch),
    }
}

/// The admin token's hash: from `STOCKD_ADMIN_TOKEN`, else the config; in dev mode a fresh
/// token is minted and returned so it can be shown once.
fn admin_token(config: &Config) -> anyhow::Result<(String, Option<String>)> {
    if let Ok(token) = std::env::var("STOCKD_ADMIN_TOKEN") {
        if token.len() < 16 {
            bail!("STOCKD_ADMIN_TOKEN must be at least 16 characters");
        }
        return Ok((auth::sha256_hex(&token), None));
    }
    if let Some(hash) = &config.server.admin_token_sha256 {
        return Ok((hash.to_ascii_lowercase(), None));
    }
    match config.server.mode {
        RunMode::Dev => {
            let token = auth::mint_admin_token();
            Ok((auth::sha256_hex(&token), Some(token)))
        }
        RunMode::Production => {
            bail!("production mode needs an admin token: set STOCKD_ADMIN_TOKEN or server.admin_token_sha256")
        }
    }
}

/// Creates config-declared tenants, their keys and seed resources. Idempotent across restarts.
async fn declare_tenants(storage: &Arc<dyn Storage>, plugins: &Registry, config: &Config) -> anyhow::Result<()> {
    for t in &config.tenants {
        let id = TenantId::parse(t.id.clone())?;
        let hash = match (&t.api_key_sha256, &t.api_key_env) {
            (Some(hash), _) => hash.to_ascii_lowercase(),
            (None, Some(var)) => {
                let key = std::env::var(var)
                    .with_context(|| format!("tenant {id}: environment variable {var} is not set"))?;
                auth::sha256_hex(&key)
            }
            (None, None) => bail!("tenant {id}: no API key configured"),
        };
        storage.ensure_config_tenant(&id, &t.name, t.rate_limit, &hash, now_ms()).await?;
        for r in &t.resources {
            let new = NewResource {
                key: ResourceKey::parse(r.key.clone())?,
                kind: r.kind,
                total: r.total,
                buckets: 1,
                low_stock: None,
            };
            storage.create_resource(&id, &new, now_ms()).await?;
        }
        if let Some(path) = &t.plugin {
            let wasm =
                std::fs::read(path).with_context(|| format!("tenant {id}: reading plugin {}", path.display()))?;
            let plugin = plugins
                .load(&id, t.plugin_runtime, Arc::from(wasm.as_slice()))
                .await
                .map_err(|e| anyhow::anyhow!("tenant {id}: plugin {}: {e}", path.display()))?;
            let active = storage.active_plugin(&id).await?;
            let unchanged = active.is_some_and(|a| {
                a.sha256 == plugin.sha256() && a.config == t.plugin_config && a.runtime == t.plugin_runtime.as_str()
            });
            if !unchanged {
                let upload = PluginUpload {
                    sha256: plugin.sha256(),
                    wasm: crate::plugin::stored::encode(&wasm),
                    config: t.plugin_config.clone(),
                    runtime: t.plugin_runtime.as_str().to_owned(),
                    max_versions: config.plugins.max_versions_per_tenant,
                };
                let saved = storage.save_plugin(&id, &upload, now_ms()).await?;
                tracing::info!(tenant = %id, version = saved.version, "config plugin uploaded");
            }
        }
    }
    Ok(())
}

/// Resolves when SIGTERM or SIGINT arrives.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

/// One plugin host per enabled language profile, sharing the compile slots and the artifact
/// directory. An artifact directory that cannot be used safely is an error, not a silent
/// fallback to compiling every time.
pub fn plugin_hosts(config: &Config) -> anyhow::Result<Vec<Arc<PluginHost>>> {
    let artifacts = match config.plugins.artifact_dir() {
        Some(dir) => Some(Arc::new(ArtifactStore::open(&dir, config.plugins.max_artifact_dir_bytes)?)),
        None => None,
    };
    let shared = HostShared::new(config.plugins.max_concurrent_compiles, artifacts)?;
    Runtime::ALL
        .into_iter()
        .filter_map(|runtime| config.plugins.limits_for(runtime).map(|limits| (runtime, limits)))
        .map(|(runtime, limits)| {
            PluginHost::for_runtime(runtime, limits, Arc::clone(&shared))
                .with_context(|| format!("starting the {runtime} plugin host"))
        })
        .collect()
}

/// `stockd serve`: everything from config to a served, drained, closed server.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    let (admin_hash, minted_admin) = admin_token(&config)?;
    let metrics = crate::telemetry::init_metrics()?;
    let storage = open_storage(&config).await?;
    let hosts = plugin_hosts(&config)?;
    let pool = PlanPool::new(config.plugins.pool()).context("starting the plan pool")?;
    let plugins =
        Arc::new(Registry::new(hosts, pool, storage.clone(), Duration::from_millis(config.plugins.cache_ttl_ms)));
    declare_tenants(&storage, &plugins, &config).await?;
    let listener =
        TcpListener::bind(&config.server.listen).await.with_context(|| format!("binding {}", config.server.listen))?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");
    if let Some(token) = minted_admin {
        println!("dev mode: admin token for this run: {token}");
        println!("create a tenant: curl -s -X POST http://{addr}/v1/admin/tenants -H 'Authorization: Bearer {token}' -H 'Content-Type: application/json' -d '{{\"id\":\"demo\",\"name\":\"Demo\"}}'");
    } else {
        println!("create a tenant with POST /v1/admin/tenants and the admin token");
    }
    if !config.redis.replay_from_database {
        tracing::warn!(
            "[redis] replay_from_database = false is ignored: an order routed to Redis always has its key looked up first"
        );
    }
    let redis = crate::redis_mode::RedisMode::from_config(
        &config.redis,
        config.idempotency.retention_hours.saturating_mul(3600),
    )
    .context("configuring redis")?
    .map(Arc::new);
    let orders =
        OrderSettings { max_lines: config.orders.max_lines, default_ttl_seconds: config.orders.default_ttl_seconds };
    let state = Arc::new(AppState {
        storage: storage.clone(),
        auth: Authenticator::new(admin_hash, Duration::from_millis(config.auth.cache_ttl_ms)),
        limits: TenantLimiter::new(config.rate_limits.default_limit(), config.rate_limits.max_tenants),
        plugins: plugins.clone(),
        uploads: api::plugins::UploadTracker::new(config.plugins.max_concurrent_large_uploads),
        settings: ApiSettings {
            body_limit_bytes: config.server.body_limit_bytes,
            request_timeout: Duration::from_millis(config.server.request_timeout_ms),
            max_in_flight: config.server.max_in_flight_requests,
            max_plugin_versions: config.plugins.max_versions_per_tenant,
            upload_wait: Duration::from_millis(
                config.plugins.upload_wait_ms.min(config.server.request_timeout_ms.saturating_mul(3) / 4),
            ),
            events: config.events.clone(),
        },
        metrics: Some(metrics),
        redis: redis.clone(),
        pipeline: Pipeline::new(storage.clone(), plugins, redis, orders),
        in_flight: Arc::new(tokio::sync::Semaphore::new(config.server.max_in_flight_requests)),
        jobs: Arc::new(JobRegistry::default()),
    });
    run(listener, state, &config, shutdown_signal()).await
}

/// Serves `listener` until `shutdown` resolves, then lets in-flight requests finish (bounded by
/// the grace period), stops the jobs and closes storage, which commits every queued write.
pub async fn run(
    listener: TcpListener,
    state: Arc<AppState>,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let storage = state.storage.clone();
    let (stop_jobs, jobs_stopped) = watch::channel(false);
    let job_settings = JobSettings {
        sweep_interval: Duration::from_millis(config.reservations.sweep_interval_ms),
        sweep_batch: config.reservations.sweep_batch,
        reconcile_interval: (config.reconciliation.interval_seconds > 0)
            .then(|| Duration::from_secs(config.reconciliation.interval_seconds)),
        reconcile_full_every: config.reconciliation.full_every,
        purge_interval: Duration::from_secs(config.idempotency.purge_interval_seconds),
        idempotency_retention: Duration::from_secs(config.idempotency.retention_hours.saturating_mul(3600)),
        rebalance_interval: (config.buckets.rebalance_interval_ms > 0)
            .then(|| Duration::from_millis(config.buckets.rebalance_interval_ms)),
        rebalance_batch: config.buckets.rebalance_batch.max(1),
        settlement_purge_interval: Duration::from_secs(config.redis.purge_interval_seconds),
        settled_retention: Duration::from_secs(config.redis.settled_retention_seconds),
        failure_retention: Duration::from_secs(config.redis.failure_retention_seconds),
        events_purge_interval: Duration::from_secs(config.events.purge_interval_seconds),
        // An applied order's idempotency record points at its event for the answer: events
        // outlive the records (see `storage::body_columns`).
        events_retention: Duration::from_secs(config.events.retention_hours.saturating_mul(3600)).max(
            Duration::from_secs(config.idempotency.retention_hours.saturating_mul(3600))
                .saturating_add(crate::storage::EVENTS_OUTLIVE_RECORDS),
        ),
        nats: config.events.nats.clone(),
    };
    let policy = StuckPolicy {
        intervals: config.jobs.stuck_after_intervals,
        min: Duration::from_millis(config.jobs.stuck_min_ms),
    };
    let mut jobs = Supervisor::new(state.jobs.clone(), policy, jobs_stopped);
    jobs::spawn(&mut jobs, storage.clone(), job_settings);
    if config.events.webhooks.enabled {
        let settings = crate::webhooks::delivery::DeliverySettings::from_config(&config.events);
        crate::webhooks::delivery::spawn(&mut jobs, storage.clone(), settings);
    }
    if let Some(hot) = &state.redis {
        // Know the redis-mode resources before the first request (best effort: the settlement
        // loop reads them again every second).
        if let Err(err) = hot.refresh_modes(storage.as_ref()).await {
            tracing::warn!(error = %err, "listing redis-mode resources failed");
        }
        let poll = Duration::from_millis(config.redis.settle_poll_ms.max(1));
        let dead_consumer_idle = Duration::from_millis(config.redis.dead_consumer_idle_ms);
        jobs.run("settlement", Some(poll), {
            let (hot, storage) = (hot.clone(), storage.clone());
            move |ctx| jobs::settlement::run(hot.clone(), storage.clone(), dead_consumer_idle, ctx)
        });
        // Event-driven (it waits for announcements), so never stuck; its own task, whose panic
        // surfaces here through its join handle and is supervised like any other.
        jobs.run("soldout_listener", None, {
            let hot = hot.clone();
            move |ctx| {
                let listener = crate::redis_mode::soldout::spawn(hot.clone(), ctx.shutdown());
                async move {
                    if let Err(err) = listener.await {
                        if let Ok(panic) = err.try_into_panic() {
                            std::panic::resume_unwind(panic);
                        }
                    }
                }
            }
        });
    }

    let (signalled_tx, mut signalled_rx) = watch::channel(false);
    let plugins = state.plugins.clone();
    let shutdown = async move {
        shutdown.await;
        tracing::info!("shutting down: finishing in-flight requests");
        // A compile can take seconds and no answer depends on it any more.
        plugins.stop_compiles();
        let _ = signalled_tx.send(true);
    };
    let server = axum::serve(listener, api::router(state)).with_graceful_shutdown(shutdown);
    let grace = Duration::from_millis(config.server.shutdown_grace_ms);
    let served = async {
        // After the signal, in-flight requests get `grace` to finish.
        let _ = signalled_rx.wait_for(|s| *s).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        result = server => result.context("serving HTTP")?,
        _ = served => tracing::warn!("grace period over; stopping with requests still in flight"),
    }
    let _ = stop_jobs.send(true);
    jobs.join().await;
    storage.close().await;
    tracing::info!("stopped");
    Ok(())
}
