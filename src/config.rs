//! Configuration: TOML (every setting with a safe default, see `config/stockd.toml`), then
//! environment overrides (`STOCKD_LISTEN`, `STOCKD_DATABASE_URL`, `STOCKD_REDIS_URL`,
//! `STOCKD_ADMIN_TOKEN`). Validated once at start-up; a bad config stops the process with a
//! message naming the setting.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Deserialize;

use crate::engine::{Kind, ResourceKey, TenantId, MAX_TOTAL};
use crate::ratelimit::RateLimit;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub database: DatabaseConfig,
    pub redis: RedisConfig,
    pub batch: BatchConfig,
    pub orders: OrdersConfig,
    pub idempotency: IdempotencyConfig,
    pub reservations: ReservationsConfig,
    pub reconciliation: ReconciliationConfig,
    pub buckets: BucketsConfig,
    pub auth: AuthConfig,
    pub plugins: PluginsConfig,
    pub rate_limits: RateLimitsConfig,
    pub jobs: JobsConfig,
    pub events: EventsConfig,
    pub tenants: Vec<TenantConfig>,
}

/// The outbox and its readers (docs/EVENTS.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsConfig {
    /// How long events are kept (the feed's reach back in time).
    pub retention_hours: u64,
    /// How often events past their retention are deleted.
    pub purge_interval_seconds: u64,
    /// Longest `GET /v1/events?wait=` holds a request open (kept under the request timeout).
    pub max_wait_seconds: u64,
    /// Long polls one tenant may hold open at once, per process; past it a poll answers at once.
    pub max_waiting_per_tenant: usize,
    /// How often a waiting poll looks again for events other processes committed.
    pub poll_interval_ms: u64,
    /// The NATS JetStream sink (docs/NATS.md); absent: none.
    pub nats: Option<NatsSinkConfig>,
    /// `[events.webhooks]`: delivery to tenants' endpoints (docs/WEBHOOKS.md).
    pub webhooks: WebhooksConfig,
}

/// Webhook delivery (docs/WEBHOOKS.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebhooksConfig {
    /// Whether this process runs the delivery job (the API works either way).
    pub enabled: bool,
    /// Allow targets in loopback, private, link-local and other non-public ranges. Off: a tenant
    /// must not reach the operator's network (SSRF). Tests and private deployments turn it on.
    pub allow_private_targets: bool,
    /// Endpoints one tenant may register.
    pub max_endpoints_per_tenant: usize,
    /// Longest endpoint description, in characters.
    pub max_description_chars: usize,
    /// How long after its first failed attempt a delivery is retried; then the endpoint is
    /// `failing` (nothing more is sent to it until a redeliver call; the feed keeps the events).
    pub retry_window_seconds: u64,
    /// Delay before the first retry; it doubles with each failure (with jitter)...
    pub retry_initial_ms: u64,
    /// ...up to this.
    pub retry_max_ms: u64,
    /// Time limit of one delivery request (connect included).
    pub request_timeout_ms: u64,
    /// Deliveries in flight at once in this process.
    pub max_concurrency: usize,
    /// Deliveries of one tenant in flight at once, across processes: one tenant's slow
    /// receivers never take every place.
    pub max_in_flight_per_tenant: u32,
    /// How often the job looks for new events and due retries (this process's own commits
    /// wake it sooner).
    pub poll_interval_ms: u64,
    /// Deliveries claimed, and events scanned per endpoint, per pass.
    pub batch: u32,
    /// Most deliveries queued for one endpoint; past it, its cursor waits (bounds the queue
    /// of a receiver that is down).
    pub max_pending_per_endpoint: u32,
    /// How long the previous secret still signs after a rotation, unless the call says.
    pub rotation_grace_seconds: u64,
    /// How long the deliveries log (`GET /v1/webhooks/{id}/deliveries`) keeps an attempt.
    pub attempts_retention_hours: u64,
}

impl Default for WebhooksConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            allow_private_targets: false,
            max_endpoints_per_tenant: 16,
            max_description_chars: 500,
            retry_window_seconds: 86_400,
            retry_initial_ms: 5_000,
            retry_max_ms: 3_600_000,
            request_timeout_ms: 10_000,
            max_concurrency: 32,
            max_in_flight_per_tenant: 8,
            poll_interval_ms: 500,
            batch: 100,
            max_pending_per_endpoint: 10_000,
            rotation_grace_seconds: 86_400,
            attempts_retention_hours: 72,
        }
    }
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self {
            retention_hours: 72,
            purge_interval_seconds: 300,
            max_wait_seconds: 25,
            max_waiting_per_tenant: 16,
            poll_interval_ms: 500,
            nats: None,
            webhooks: WebhooksConfig::default(),
        }
    }
}

/// `[events.nats]`: every committed event is published to NATS JetStream on
/// `<subject_prefix>.<tenant>.<type>`, with the event id as `Nats-Msg-Id` (docs/NATS.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsSinkConfig {
    /// The NATS server(s): `nats://host:4222`, several separated by commas.
    pub url: String,
    /// First subject tokens: dot-separated tokens of `[A-Za-z0-9_-]`.
    pub subject_prefix: String,
    /// A stream to create at connect if missing, capturing `<subject_prefix>.>`; none: the
    /// operator provides a stream that captures the subjects.
    pub stream: Option<String>,
    /// The duplicate window of the stream stockd creates: a republished event (a crash between
    /// publish and the stored cursor) is dropped only within it.
    pub duplicate_window_seconds: u64,
    /// How long a page's acknowledgements are awaited (and a connection attempt); at most 5000,
    /// so a PostgreSQL cursor claim ends well within the session's idle limit.
    pub publish_timeout_ms: u64,
    /// Events published per page, acknowledgements awaited together (1..=1000).
    pub batch_size: u32,
    /// How often the sink looks for undelivered events.
    pub poll_interval_ms: u64,
}

impl Default for NatsSinkConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            subject_prefix: "stockd".into(),
            stream: None,
            duplicate_window_seconds: 600,
            publish_timeout_ms: 5_000,
            batch_size: 100,
            poll_interval_ms: 200,
        }
    }
}

/// Longest `publish_timeout_ms`: a PostgreSQL claim's transaction waits idle that long, and the
/// session is ended after 10 s idle in a transaction.
pub const NATS_MAX_PUBLISH_TIMEOUT_MS: u64 = 5_000;

impl NatsSinkConfig {
    /// The servers of `url`.
    pub fn servers(&self) -> Vec<String> {
        self.url.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
    }

    fn validate(&self) -> anyhow::Result<()> {
        if self.url.trim().is_empty() {
            bail!("events.nats.url must name a NATS server (nats://host:4222)");
        }
        for server in self.servers() {
            let addr =
                server.parse::<async_nats::ServerAddr>().with_context(|| format!("events.nats.url: {server:?}"))?;
            // The client is built without a TLS crypto provider or websockets (Cargo.toml).
            if addr.scheme() != "nats" {
                bail!("events.nats.url: {server:?}: only nats:// servers are supported (no TLS, no websockets)");
            }
        }
        let token_ok = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b));
        if self.subject_prefix.len() > 128 || !self.subject_prefix.split('.').all(token_ok) {
            bail!("events.nats.subject_prefix must be dot-separated tokens of [A-Za-z0-9_-], 128 characters at most");
        }
        if let Some(stream) = &self.stream {
            if stream.len() > 64 || !token_ok(stream) {
                bail!("events.nats.stream must be 1-64 characters of [A-Za-z0-9_-]");
            }
        }
        if self.duplicate_window_seconds == 0 {
            bail!("events.nats.duplicate_window_seconds must be greater than 0");
        }
        if !(1..=NATS_MAX_PUBLISH_TIMEOUT_MS).contains(&self.publish_timeout_ms) {
            bail!("events.nats.publish_timeout_ms must be between 1 and {NATS_MAX_PUBLISH_TIMEOUT_MS}");
        }
        if !(1..=1000).contains(&self.batch_size) {
            bail!("events.nats.batch_size must be between 1 and 1000");
        }
        if self.poll_interval_ms == 0 {
            bail!("events.nats.poll_interval_ms must be greater than 0");
        }
        Ok(())
    }
}

/// Supervision of the background jobs: when `/readyz` calls one stuck.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobsConfig {
    /// A job without a successful run for this many of its intervals is stuck...
    pub stuck_after_intervals: u32,
    /// ...but never before this long (milliseconds).
    pub stuck_min_ms: u64,
}

impl Default for JobsConfig {
    fn default() -> Self {
        Self { stuck_after_intervals: 10, stuck_min_ms: 30_000 }
    }
}

/// Per-tenant request rate limits: the default token bucket of every tenant without a rate of
/// its own (`rate_limit` in its `[[tenants]]` entry or through the admin API).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimitsConfig {
    /// Requests per second each tenant may make, per process; 0: no limit at all.
    pub requests_per_second: u32,
    /// Requests a tenant may send at once after a quiet spell (the bucket's size).
    pub burst: u32,
    /// Tenants whose buckets a process remembers; past it, idle ones are forgotten first.
    pub max_tenants: usize,
}

impl Default for RateLimitsConfig {
    fn default() -> Self {
        Self { requests_per_second: 50_000, burst: 50_000, max_tenants: 10_000 }
    }
}

impl RateLimitsConfig {
    pub fn default_limit(&self) -> RateLimit {
        RateLimit { requests_per_second: self.requests_per_second, burst: self.burst }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PluginsConfig {
    /// Largest component a tenant may upload.
    pub max_wasm_bytes: usize,
    /// Fuel one plan call may burn (about one unit per instruction); an endless loop stops here.
    pub fuel_per_call: u64,
    /// Largest linear memory one plugin instance may grow to.
    pub max_memory_bytes: usize,
    /// Calls one live instance serves before a fresh one replaces it (1: a fresh one per call).
    pub calls_per_instance: u32,
    /// How long a process trusts its cached view of a tenant's active version; an upload or
    /// activation through another process takes effect here within this time.
    pub cache_ttl_ms: u64,
    /// Time limit of one plan call besides fuel: CPU time it ran (4x on the wall clock at most).
    pub plan_timeout_ms: u64,
    /// Instances alive at once across all plugins (sizes the instance pool).
    pub max_live_instances: u32,
    /// Threads that run plugin calls (0: one per core, at least 2).
    pub plan_threads: usize,
    /// Plan threads one tenant's calls may occupy at once (0: half the threads, at least 1).
    pub max_concurrent_plans_per_tenant: usize,
    /// How long a call waits for a place before `429` (its tenant's) or `503` (the pool's).
    pub plan_wait_ms: u64,
    /// Niceness of the plan threads (0-19; 0: the server's own priority).
    pub plan_thread_nice: i32,
    /// Wall-clock deadline of one compile.
    pub compile_timeout_ms: u64,
    /// Address space a compiler child may map.
    pub compile_memory_bytes: u64,
    /// CPU time a compiler child may use (rounded up to whole seconds).
    pub compile_cpu_ms: u64,
    /// Compiles running at once (each in its own child process).
    pub max_concurrent_compiles: usize,
    /// Structural limits checked before compiling.
    pub max_functions: usize,
    pub max_function_body_bytes: usize,
    pub max_locals_per_function: u64,
    pub max_block_depth: usize,
    /// Versions a tenant keeps: an upload beyond this prunes the oldest ones, never the new
    /// version nor the one active when the upload began.
    pub max_versions_per_tenant: usize,
    /// Where compiled plugins are kept, so restarts and other processes on this machine map
    /// them instead of compiling again; `""` keeps none. Default: `$XDG_CACHE_HOME/stockd/plugins`
    /// (or `~/.cache/stockd/plugins`).
    pub artifact_dir: Option<String>,
    /// Bytes the artifact directory may hold; beyond it the least recently used go.
    pub max_artifact_dir_bytes: u64,
    /// How long an upload waits for its compile before answering `202 Accepted` with the
    /// upload's status address (the compile goes on; the version is stored and activated when
    /// it succeeds). At most three quarters of `server.request_timeout_ms` applies, so the
    /// answer always comes before the request's own deadline.
    pub upload_wait_ms: u64,
    /// JavaScript and Python uploads (up to tens of MiB each) held at once, from reading the
    /// body to the end of the compile; one more is answered `503` with `Retry-After`.
    pub max_concurrent_large_uploads: usize,
    /// The JavaScript profile (`PUT /v1/plugin?runtime=js`): its own limits, each defaulting
    /// to the profile's (docs/PLUGINS.md).
    pub js: RuntimeConfig,
    /// The Python profile (`?runtime=python`).
    pub python: RuntimeConfig,
}

/// A language profile's settings (`[plugins.js]`, `[plugins.python]`): whether uploads may
/// choose it, and its limits where they differ from the profile's defaults. The `[plugins]`
/// keys of the same names are the Rust profile's.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    pub enabled: bool,
    pub max_wasm_bytes: Option<usize>,
    pub fuel_per_call: Option<u64>,
    pub max_memory_bytes: Option<usize>,
    pub calls_per_instance: Option<u32>,
    pub plan_timeout_ms: Option<u64>,
    pub max_live_instances: Option<u32>,
    pub max_instances_per_plugin: Option<usize>,
    pub compile_timeout_ms: Option<u64>,
    pub compile_memory_bytes: Option<u64>,
    pub compile_cpu_ms: Option<u64>,
    pub max_functions: Option<usize>,
    pub max_function_body_bytes: Option<usize>,
    pub max_locals_per_function: Option<u64>,
    pub max_block_depth: Option<usize>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_wasm_bytes: None,
            fuel_per_call: None,
            max_memory_bytes: None,
            calls_per_instance: None,
            plan_timeout_ms: None,
            max_live_instances: None,
            max_instances_per_plugin: None,
            compile_timeout_ms: None,
            compile_memory_bytes: None,
            compile_cpu_ms: None,
            max_functions: None,
            max_function_body_bytes: None,
            max_locals_per_function: None,
            max_block_depth: None,
        }
    }
}

fn rust_runtime() -> crate::plugin::Runtime {
    crate::plugin::Runtime::Rust
}

impl RuntimeConfig {
    /// `base` (the profile's defaults) with this section's settings applied.
    fn apply(&self, base: crate::plugin::PluginLimits) -> crate::plugin::PluginLimits {
        let mut l = base;
        l.max_wasm_bytes = self.max_wasm_bytes.unwrap_or(l.max_wasm_bytes);
        l.fuel_per_call = self.fuel_per_call.unwrap_or(l.fuel_per_call);
        l.max_memory_bytes = self.max_memory_bytes.unwrap_or(l.max_memory_bytes);
        l.calls_per_instance = self.calls_per_instance.unwrap_or(l.calls_per_instance);
        l.plan_timeout = self.plan_timeout_ms.map_or(l.plan_timeout, Duration::from_millis);
        l.max_live_instances = self.max_live_instances.unwrap_or(l.max_live_instances);
        l.max_instances_per_plugin = self.max_instances_per_plugin.unwrap_or(l.max_instances_per_plugin);
        l.compile.timeout = self.compile_timeout_ms.map_or(l.compile.timeout, Duration::from_millis);
        l.compile.memory_bytes = self.compile_memory_bytes.unwrap_or(l.compile.memory_bytes);
        l.compile.cpu = self.compile_cpu_ms.map_or(l.compile.cpu, Duration::from_millis);
        l.shape.max_functions = self.max_functions.unwrap_or(l.shape.max_functions);
        l.shape.max_function_body_bytes = self.max_function_body_bytes.unwrap_or(l.shape.max_function_body_bytes);
        l.shape.max_locals_per_function = self.max_locals_per_function.unwrap_or(l.shape.max_locals_per_function);
        l.shape.max_block_depth = self.max_block_depth.unwrap_or(l.shape.max_block_depth);
        l
    }
}

impl Default for PluginsConfig {
    fn default() -> Self {
        let limits = crate::plugin::PluginLimits::default();
        Self {
            max_wasm_bytes: limits.max_wasm_bytes,
            fuel_per_call: limits.fuel_per_call,
            max_memory_bytes: limits.max_memory_bytes,
            calls_per_instance: limits.calls_per_instance,
            cache_ttl_ms: 1_000,
            plan_timeout_ms: limits.plan_timeout.as_millis() as u64,
            max_live_instances: limits.max_live_instances,
            plan_threads: 0,
            max_concurrent_plans_per_tenant: 0,
            plan_wait_ms: 1_000,
            plan_thread_nice: 0,
            compile_timeout_ms: limits.compile.timeout.as_millis() as u64,
            compile_memory_bytes: limits.compile.memory_bytes,
            compile_cpu_ms: limits.compile.cpu.as_millis() as u64,
            max_concurrent_compiles: limits.max_concurrent_compiles,
            max_functions: limits.shape.max_functions,
            max_function_body_bytes: limits.shape.max_function_body_bytes,
            max_locals_per_function: limits.shape.max_locals_per_function,
            max_block_depth: limits.shape.max_block_depth,
            max_versions_per_tenant: 20,
            artifact_dir: None,
            max_artifact_dir_bytes: 4 << 30,
            upload_wait_ms: 20_000,
            max_concurrent_large_uploads: 2,
            js: RuntimeConfig::default(),
            python: RuntimeConfig::default(),
        }
    }
}

impl PluginsConfig {
    pub fn limits(&self) -> crate::plugin::PluginLimits {
        crate::plugin::PluginLimits {
            max_wasm_bytes: self.max_wasm_bytes,
            fuel_per_call: self.fuel_per_call,
            max_memory_bytes: self.max_memory_bytes,
            calls_per_instance: self.calls_per_instance,
            max_live_instances: self.max_live_instances,
            plan_timeout: Duration::from_millis(self.plan_timeout_ms),
            max_concurrent_compiles: self.max_concurrent_compiles,
            compile: crate::plugin::CompileLimits {
                timeout: Duration::from_millis(self.compile_timeout_ms),
                memory_bytes: self.compile_memory_bytes,
                cpu: Duration::from_millis(self.compile_cpu_ms),
                ..crate::plugin::CompileLimits::default()
            },
            shape: crate::plugin::ShapeLimits {
                max_functions: self.max_functions,
                max_function_body_bytes: self.max_function_body_bytes,
                max_locals_per_function: self.max_locals_per_function,
                max_block_depth: self.max_block_depth,
            },
            ..crate::plugin::PluginLimits::default()
        }
    }

    /// The limits of `runtime`'s profile, or `None` when uploads may not choose it.
    pub fn limits_for(&self, runtime: crate::plugin::Runtime) -> Option<crate::plugin::PluginLimits> {
        use crate::plugin::{PluginLimits, Runtime};
        let section = match runtime {
            Runtime::Rust => return Some(self.limits()),
            Runtime::Js => &self.js,
            Runtime::Python => &self.python,
        };
        let base = PluginLimits {
            // One compile gate for every profile.
            max_concurrent_compiles: self.max_concurrent_compiles,
            ..PluginLimits::for_runtime(runtime)
        };
        section.enabled.then(|| section.apply(base))
    }

    /// The artifact directory: the configured one, none for `""`, else the user's cache.
    pub fn artifact_dir(&self) -> Option<std::path::PathBuf> {
        match self.artifact_dir.as_deref() {
            Some("") => None,
            Some(dir) => Some(std::path::PathBuf::from(dir)),
            None => {
                let cache = std::env::var_os("XDG_CACHE_HOME")
                    .filter(|d| !d.is_empty())
                    .map(std::path::PathBuf::from)
                    .or_else(|| {
                        std::env::var_os("HOME")
                            .filter(|d| !d.is_empty())
                            .map(|h| std::path::PathBuf::from(h).join(".cache"))
                    })?;
                Some(cache.join("stockd").join("plugins"))
            }
        }
    }

    /// The plan pool's size and shares; zeros pick this machine's defaults.
    pub fn pool(&self) -> crate::plugin::PoolSettings {
        crate::plugin::PoolSettings::resolve(
            self.plan_threads,
            self.max_concurrent_plans_per_tenant,
            Duration::from_millis(self.plan_wait_ms),
            self.plan_thread_nice,
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RunMode {
    /// Local use: an admin token is generated and printed when none is configured.
    #[default]
    Dev,
    /// An admin token must be configured; nothing secret is ever printed.
    Production,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: String,
    pub mode: RunMode,
    /// SHA-256 (hex) of the admin token, so the config file holds no secret.
    pub admin_token_sha256: Option<String>,
    /// Largest request body accepted on JSON routes.
    pub body_limit_bytes: usize,
    /// A request running longer than this is answered 503 (its write, if queued, still
    /// commits or not atomically).
    pub request_timeout_ms: u64,
    /// On SIGTERM, how long in-flight requests may take to finish.
    pub shutdown_grace_ms: u64,
    /// Most requests served at once (health, readiness and metrics aside); one more is answered
    /// `503` with `Retry-After` at once, before its body is read, so load beyond this costs no
    /// memory.
    pub max_in_flight_requests: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            mode: RunMode::Dev,
            admin_token_sha256: None,
            body_limit_bytes: 1024 * 1024,
            request_timeout_ms: 30_000,
            shutdown_grace_ms: 30_000,
            max_in_flight_requests: 4_096,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    pub url: String,
    /// Read connections (SQLite) or pool size (PostgreSQL).
    pub max_connections: u32,
    /// SQLite `synchronous`: "full" survives power loss, "normal" only process crashes.
    pub sqlite_synchronous: String,
    pub busy_timeout_ms: u64,
    /// SQLite: the size the WAL file is cut back to whenever it starts over after a checkpoint
    /// (`PRAGMA journal_size_limit`), so a burst that grew it does not keep the disk space.
    pub sqlite_wal_limit_bytes: u64,
    /// PostgreSQL: how long a request waits for a pooled connection before 503 unavailable.
    pub acquire_timeout_ms: u64,
    /// PostgreSQL: how often a batch that hit a serialization failure, deadlock or lost
    /// connection is retried (with backoff) before its requests get 503 unavailable.
    pub max_retries: u32,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: "sqlite://data/stockd.db".into(),
            max_connections: 8,
            sqlite_synchronous: "full".into(),
            busy_timeout_ms: 5_000,
            sqlite_wal_limit_bytes: 64 * 1024 * 1024,
            acquire_timeout_ms: 2_000,
            max_retries: 5,
        }
    }
}

/// Redis for resources in redis mode (flash sales); see `docs/REDIS.md`. Without `url`,
/// `cluster_nodes` or `sentinels`, redis mode is off and such resources are refused.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// One Redis server, `redis://host:port/db`.
    pub url: Option<String>,
    /// Or: seed nodes of a Redis Cluster.
    pub cluster_nodes: Vec<String>,
    /// Or: Sentinel addresses (`redis://host:port`) and the master's service name.
    pub sentinels: Vec<String>,
    pub sentinel_master: String,
    /// Every key and channel stockd uses starts with this, so several deployments (or test
    /// runs) can share one Redis.
    pub prefix: String,
    /// Longest a Redis command may take before the request answers 503 (connect included).
    pub timeout_ms: u64,
    /// Stream entries one consumer reads (and settles in one group commit) at a time.
    pub settle_batch: usize,
    /// How long the settlement consumer sleeps when every stream is empty.
    pub settle_poll_ms: u64,
    /// Most entries a resource's stream may hold not yet settled into the database: past it,
    /// its orders answer `503` with `Retry-After` (nothing sold) until settlement catches up,
    /// so a sale faster than the database settles cannot grow Redis without bound.
    pub max_backlog: u64,
    /// An entry delivered this long ago and still unacknowledged belongs to a consumer presumed
    /// dead; any other consumer reclaims it (XAUTOCLAIM).
    pub claim_idle_ms: u64,
    /// How long a warm or a switch out of redis mode waits for the backlog to settle.
    pub drain_timeout_ms: u64,
    /// How long a warm, switch or adjustment may keep a resource closed in Redis. A process that
    /// dies half-way leaves it closed; once this lease runs out, the settlement loop of any
    /// process warms it again. Longer than `drain_timeout_ms`; unset: twice it.
    pub lease_ms: Option<u64>,
    /// How often each process reads again which resources are in redis mode. A process that has
    /// not yet seen a switch is corrected on its next order of that resource anyway (the
    /// database path refuses a redis-mode resource; Redis holds nothing of a db-mode one).
    pub mode_refresh_ms: u64,
    /// Accepted and ignored (a warning when `false`): an order routed to Redis always has its key
    /// looked up in the database first ([`crate::pipeline`]), so a retry gets its first answer.
    pub replay_from_database: bool,
    /// How long the request id of a settled record is kept (`redis_settled`): it recognises a
    /// redelivered stream entry, so it must outlive any entry left unacknowledged (a Redis
    /// outage). Must exceed `claim_idle_ms`.
    pub settled_retention_seconds: u64,
    /// How long a settlement failure is kept; the tenant must have compensated before then.
    pub failure_retention_seconds: u64,
    /// How often both are purged.
    pub purge_interval_seconds: u64,
    /// A consumer of the settlement group idle this long with no pending entry belonged to a
    /// process that is gone: it is removed from the group. Must exceed `claim_idle_ms`.
    pub dead_consumer_idle_ms: u64,
}

impl RedisConfig {
    /// `lease_ms`, or twice `drain_timeout_ms`.
    pub fn lease_ms(&self) -> u64 {
        self.lease_ms.unwrap_or(self.drain_timeout_ms.saturating_mul(2))
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: None,
            cluster_nodes: Vec::new(),
            sentinels: Vec::new(),
            sentinel_master: "mymaster".into(),
            prefix: "stockd".into(),
            timeout_ms: 1_000,
            settle_batch: 256,
            settle_poll_ms: 5,
            max_backlog: 100_000,
            claim_idle_ms: 5_000,
            drain_timeout_ms: 10_000,
            lease_ms: None,
            mode_refresh_ms: 1_000,
            replay_from_database: true,
            settled_retention_seconds: 7 * 24 * 3600,
            failure_retention_seconds: 90 * 24 * 3600,
            purge_interval_seconds: 300,
            dead_consumer_idle_ms: 3_600_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchConfig {
    /// Most writes committed in one transaction.
    pub max_batch: usize,
    /// How long the writer waits for company when a write arrives alone (microseconds).
    /// 0: never; writes arriving during a commit form the next batch anyway.
    pub max_wait_us: u64,
    /// Writes that may queue for the writer before submitters wait.
    pub queue_depth: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self { max_batch: 256, max_wait_us: 0, queue_depth: 10_000 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OrdersConfig {
    pub max_lines: usize,
    /// Reservation lifetime when an order gives no `ttl_seconds`.
    pub default_ttl_seconds: i64,
}

impl Default for OrdersConfig {
    fn default() -> Self {
        Self { max_lines: 100, default_ttl_seconds: 900 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencyConfig {
    /// How long a key's first outcome is kept and replayed.
    pub retention_hours: u64,
    pub purge_interval_seconds: u64,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self { retention_hours: 24, purge_interval_seconds: 300 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReservationsConfig {
    /// How often the sweeper looks for held reservations past their deadline.
    pub sweep_interval_ms: u64,
    /// Most reservations expired per sweep transaction.
    pub sweep_batch: u32,
}

impl Default for ReservationsConfig {
    fn default() -> Self {
        Self { sweep_interval_ms: 1_000, sweep_batch: 500 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReconciliationConfig {
    /// How often the background job proves state == opening + ledger; 0 disables it.
    pub interval_seconds: u64,
    /// Every `full_every`-th background pass replays every resource's whole ledger instead of
    /// only what was written since its checkpoint (which cannot see history changed below the
    /// checkpoint); 0: never.
    pub full_every: u64,
}

impl Default for ReconciliationConfig {
    fn default() -> Self {
        Self { interval_seconds: 60, full_every: 60 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BucketsConfig {
    /// How often bucketed resources whose buckets drifted apart are evened out; 0 disables.
    pub rebalance_interval_ms: u64,
    /// Most resources rebalanced per transaction.
    pub rebalance_batch: u32,
}

impl Default for BucketsConfig {
    fn default() -> Self {
        Self { rebalance_interval_ms: 1_000, rebalance_batch: 100 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// How long a verified API key is trusted without asking storage again. A key revoked
    /// through this process stops working at once; through another process, within this time.
    pub cache_ttl_ms: u64,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self { cache_ttl_ms: 1_000 }
    }
}

/// A tenant declared in config; created (or updated) at start-up.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub id: String,
    pub name: String,
    /// SHA-256 (hex) of the tenant's API key.
    pub api_key_sha256: Option<String>,
    /// Or: the environment variable holding the key.
    pub api_key_env: Option<String>,
    #[serde(default)]
    pub resources: Vec<SeedResource>,
    /// A plugin component file; uploaded as a new version at start-up when it differs from
    /// the active one.
    pub plugin: Option<std::path::PathBuf>,
    /// The plugin's configuration text.
    #[serde(default)]
    pub plugin_config: String,
    /// The plugin's language profile (`rust`, `js`, `python`).
    #[serde(default = "rust_runtime")]
    pub plugin_runtime: crate::plugin::Runtime,
    /// The tenant's own request rate (else `[rate_limits]`); set at every start-up.
    pub rate_limit: Option<RateLimit>,
}

/// A resource created at start-up if missing (never changed if it exists).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeedResource {
    pub key: String,
    pub kind: Kind,
    pub total: i64,
}

impl Config {
    /// Reads `path` (if given), applies environment overrides and validates.
    pub fn load(path: Option<&Path>) -> anyhow::Result<Self> {
        let mut config = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                toml::from_str::<Config>(&text).with_context(|| format!("parsing {}", path.display()))?
            }
            None => Config::default(),
        };
        config.apply_env(|name| std::env::var(name).ok());
        config.validate()?;
        Ok(config)
    }

    fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) {
        if let Some(v) = var("STOCKD_LISTEN") {
            self.server.listen = v;
        }
        if let Some(v) = var("STOCKD_DATABASE_URL") {
            self.database.url = v;
        }
        if let Some(v) = var("STOCKD_REDIS_URL") {
            self.redis.url = Some(v);
        }
        if let Some(v) = var("STOCKD_REDIS_PREFIX") {
            self.redis.prefix = v;
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        let positive = [
            ("server.body_limit_bytes", self.server.body_limit_bytes as u64),
            ("server.request_timeout_ms", self.server.request_timeout_ms),
            ("server.max_in_flight_requests", self.server.max_in_flight_requests as u64),
            ("database.max_connections", u64::from(self.database.max_connections)),
            ("batch.max_batch", self.batch.max_batch as u64),
            ("batch.queue_depth", self.batch.queue_depth as u64),
            ("orders.max_lines", self.orders.max_lines as u64),
            ("idempotency.retention_hours", self.idempotency.retention_hours),
            ("events.retention_hours", self.events.retention_hours),
            ("events.purge_interval_seconds", self.events.purge_interval_seconds),
            ("events.max_waiting_per_tenant", self.events.max_waiting_per_tenant as u64),
            ("events.poll_interval_ms", self.events.poll_interval_ms),
            ("events.webhooks.max_endpoints_per_tenant", self.events.webhooks.max_endpoints_per_tenant as u64),
            ("events.webhooks.retry_window_seconds", self.events.webhooks.retry_window_seconds),
            ("events.webhooks.retry_initial_ms", self.events.webhooks.retry_initial_ms),
            ("events.webhooks.retry_max_ms", self.events.webhooks.retry_max_ms),
            ("events.webhooks.request_timeout_ms", self.events.webhooks.request_timeout_ms),
            ("events.webhooks.max_concurrency", self.events.webhooks.max_concurrency as u64),
            ("events.webhooks.max_in_flight_per_tenant", u64::from(self.events.webhooks.max_in_flight_per_tenant)),
            ("events.webhooks.poll_interval_ms", self.events.webhooks.poll_interval_ms),
            ("events.webhooks.batch", u64::from(self.events.webhooks.batch)),
            ("events.webhooks.max_pending_per_endpoint", u64::from(self.events.webhooks.max_pending_per_endpoint)),
            ("events.webhooks.attempts_retention_hours", self.events.webhooks.attempts_retention_hours),
            ("idempotency.purge_interval_seconds", self.idempotency.purge_interval_seconds),
            ("reservations.sweep_interval_ms", self.reservations.sweep_interval_ms),
            ("reservations.sweep_batch", u64::from(self.reservations.sweep_batch)),
            ("plugins.max_wasm_bytes", self.plugins.max_wasm_bytes as u64),
            ("plugins.fuel_per_call", self.plugins.fuel_per_call),
            ("plugins.max_memory_bytes", self.plugins.max_memory_bytes as u64),
            ("plugins.calls_per_instance", u64::from(self.plugins.calls_per_instance)),
            ("plugins.plan_timeout_ms", self.plugins.plan_timeout_ms),
            ("plugins.compile_timeout_ms", self.plugins.compile_timeout_ms),
            ("plugins.compile_memory_bytes", self.plugins.compile_memory_bytes),
            ("plugins.compile_cpu_ms", self.plugins.compile_cpu_ms),
            ("plugins.max_concurrent_compiles", self.plugins.max_concurrent_compiles as u64),
            ("plugins.max_functions", self.plugins.max_functions as u64),
            ("plugins.max_function_body_bytes", self.plugins.max_function_body_bytes as u64),
            ("plugins.max_locals_per_function", self.plugins.max_locals_per_function),
            ("plugins.max_block_depth", self.plugins.max_block_depth as u64),
            ("plugins.max_versions_per_tenant", self.plugins.max_versions_per_tenant as u64),
            ("plugins.max_artifact_dir_bytes", self.plugins.max_artifact_dir_bytes),
            ("plugins.upload_wait_ms", self.plugins.upload_wait_ms),
            ("plugins.max_concurrent_large_uploads", self.plugins.max_concurrent_large_uploads as u64),
            ("rate_limits.max_tenants", self.rate_limits.max_tenants as u64),
            ("jobs.stuck_after_intervals", u64::from(self.jobs.stuck_after_intervals)),
            ("redis.failure_retention_seconds", self.redis.failure_retention_seconds),
            ("redis.purge_interval_seconds", self.redis.purge_interval_seconds),
        ];
        for (name, value) in positive {
            if value == 0 {
                bail!("{name} must be greater than 0");
            }
        }
        let redis_prefix_ok = (1..=64).contains(&self.redis.prefix.len())
            && self.redis.prefix.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
        if !redis_prefix_ok {
            bail!("redis.prefix must be 1-64 characters of [A-Za-z0-9._:-]");
        }
        if self.redis.timeout_ms == 0 || self.redis.settle_batch == 0 || self.redis.settle_batch > 10_000 {
            bail!("redis.timeout_ms must be > 0 and redis.settle_batch between 1 and 10000");
        }
        if !(1..=100_000_000).contains(&self.redis.max_backlog) {
            bail!("redis.max_backlog must be between 1 and 100000000");
        }
        if self.redis.lease_ms() <= self.redis.drain_timeout_ms || self.redis.mode_refresh_ms == 0 {
            bail!(
                "redis.lease_ms must be greater than redis.drain_timeout_ms, and redis.mode_refresh_ms greater than 0"
            );
        }
        // A settled record's id must outlive a redelivery of its entry, which comes at the
        // earliest `claim_idle_ms` after it was read; a live consumer is never that idle.
        if self.redis.settled_retention_seconds.saturating_mul(1000) <= self.redis.claim_idle_ms {
            bail!("redis.settled_retention_seconds must exceed redis.claim_idle_ms");
        }
        if self.redis.dead_consumer_idle_ms <= self.redis.claim_idle_ms {
            bail!("redis.dead_consumer_idle_ms must exceed redis.claim_idle_ms");
        }
        if self.plugins.max_live_instances < 2 {
            bail!("plugins.max_live_instances must be at least 2");
        }
        for runtime in crate::plugin::Runtime::ALL {
            let Some(limits) = self.plugins.limits_for(runtime) else { continue };
            let section = if runtime == crate::plugin::Runtime::Rust { String::new() } else { format!(".{runtime}") };
            if limits.plan_timeout.as_millis() >= u128::from(self.server.request_timeout_ms) {
                bail!("plugins{section}.plan_timeout_ms must be less than server.request_timeout_ms");
            }
            let positive = [
                ("max_wasm_bytes", limits.max_wasm_bytes as u64),
                ("fuel_per_call", limits.fuel_per_call),
                ("max_memory_bytes", limits.max_memory_bytes as u64),
                ("calls_per_instance", u64::from(limits.calls_per_instance)),
                ("plan_timeout_ms", limits.plan_timeout.as_millis() as u64),
                ("max_instances_per_plugin", limits.max_instances_per_plugin as u64),
                ("compile_timeout_ms", limits.compile.timeout.as_millis() as u64),
                ("compile_memory_bytes", limits.compile.memory_bytes),
                ("compile_cpu_ms", limits.compile.cpu.as_millis() as u64),
                ("max_functions", limits.shape.max_functions as u64),
                ("max_function_body_bytes", limits.shape.max_function_body_bytes as u64),
                ("max_locals_per_function", limits.shape.max_locals_per_function),
                ("max_block_depth", limits.shape.max_block_depth as u64),
            ];
            if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
                bail!("plugins{section}.{name} must be greater than 0");
            }
            if limits.max_live_instances < 2 {
                bail!("plugins{section}.max_live_instances must be at least 2");
            }
        }
        let hooks = &self.events.webhooks;
        if hooks.batch > 10_000 || hooks.max_concurrency > 10_000 || hooks.max_endpoints_per_tenant > 10_000 {
            bail!("events.webhooks.batch, max_concurrency and max_endpoints_per_tenant must be at most 10000");
        }
        if hooks.retry_initial_ms > hooks.retry_max_ms {
            bail!("events.webhooks.retry_initial_ms must not exceed retry_max_ms");
        }
        if self.orders.max_lines > 1000 {
            bail!("orders.max_lines must be at most 1000");
        }
        if !(1..=crate::engine::order::MAX_TTL_SECONDS).contains(&self.orders.default_ttl_seconds) {
            bail!("orders.default_ttl_seconds must be between 1 and 604800");
        }
        if !matches!(self.database.sqlite_synchronous.as_str(), "full" | "normal") {
            bail!("database.sqlite_synchronous must be \"full\" or \"normal\"");
        }
        if let Some(nats) = &self.events.nats {
            nats.validate()?;
        }
        if let Some(hash) = &self.server.admin_token_sha256 {
            check_sha256("server.admin_token_sha256", hash)?;
        }
        self.rate_limits.default_limit().validate().map_err(|e| anyhow::anyhow!("rate_limits.{e}"))?;
        for t in &self.tenants {
            TenantId::parse(t.id.clone()).with_context(|| format!("tenants: id {:?}", t.id))?;
            if let Some(limit) = &t.rate_limit {
                limit.validate().map_err(|e| anyhow::anyhow!("tenant {}: rate_limit.{e}", t.id))?;
            }
            match (&t.api_key_sha256, &t.api_key_env) {
                (Some(hash), None) => check_sha256(&format!("tenants.{}.api_key_sha256", t.id), hash)?,
                (None, Some(_)) => {}
                _ => bail!("tenant {}: set exactly one of api_key_sha256 or api_key_env", t.id),
            }
            for r in &t.resources {
                ResourceKey::parse(r.key.clone())
                    .with_context(|| format!("tenant {}: resource key {:?}", t.id, r.key))?;
                if !(0..=MAX_TOTAL).contains(&r.total) {
                    bail!("tenant {}: resource {} total must be between 0 and {MAX_TOTAL}", t.id, r.key);
                }
            }
        }
        Ok(())
    }
}

fn check_sha256(name: &str, value: &str) -> anyhow::Result<()> {
    if value.len() == 64 && value.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        bail!("{name} must be 64 hex characters (a SHA-256)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_config_parses_and_validates() {
        let text = include_str!("../config/stockd.toml");
        let config: Config = toml::from_str(text).unwrap_or_else(|e| panic!("config/stockd.toml: {e}"));
        assert!(config.validate().is_ok());
    }

    #[test]
    fn environment_overrides_the_file() {
        let mut config = Config::default();
        config.apply_env(|name| (name == "STOCKD_LISTEN").then(|| "127.0.0.1:0".to_string()));
        assert_eq!(config.server.listen, "127.0.0.1:0");
        assert_eq!(config.database.url, "sqlite://data/stockd.db");
    }

    #[test]
    fn the_commented_nats_example_parses_and_validates() {
        let text = include_str!("../config/stockd.toml");
        let block: Vec<&str> = text
            .lines()
            .skip_while(|l| *l != "# [events.nats]")
            .take_while(|l| l.starts_with('#'))
            .map(|l| l.strip_prefix("# ").unwrap_or(l))
            .collect();
        assert!(block.len() > 1, "config/stockd.toml shows a commented [events.nats]");
        let config: Config = toml::from_str(&block.join("\n")).unwrap_or_else(|e| panic!("{e}"));
        assert!(config.validate().is_ok());
        let nats = config.events.nats.expect("the block is [events.nats]");
        let defaults = NatsSinkConfig::default();
        assert_eq!(
            (nats.subject_prefix, nats.duplicate_window_seconds, nats.publish_timeout_ms, nats.batch_size),
            (
                defaults.subject_prefix,
                defaults.duplicate_window_seconds,
                defaults.publish_timeout_ms,
                defaults.batch_size
            ),
            "the example shows the defaults"
        );
        assert_eq!(nats.poll_interval_ms, defaults.poll_interval_ms);
    }

    #[test]
    fn a_nats_sink_needs_a_url_and_subject_safe_names() {
        let parse = |text: &str| {
            toml::from_str::<Config>(text).map_err(|e| e.to_string())?.validate().map_err(|e| e.to_string())
        };
        assert!(parse("").is_ok(), "no [events.nats]: no sink");
        assert!(parse("[events.nats]\nurl = \"nats://127.0.0.1:4222\"").is_ok());
        assert!(parse("[events.nats]\nsubject_prefix = \"x\"").is_err(), "a url is required");
        for prefix in ["", "a..b", "a.*", "a.>", "a b", ".a"] {
            let text = format!("[events.nats]\nurl = \"nats://h\"\nsubject_prefix = {prefix:?}");
            assert!(parse(&text).is_err(), "prefix {prefix:?} is refused");
        }
        assert!(parse("[events.nats]\nurl = \"nats://h\"\nsubject_prefix = \"acme.stock-events_1\"").is_ok());
        assert!(parse("[events.nats]\nurl = \"nats://h\"\nstream = \"a.b\"").is_err());
        assert!(parse("[events.nats]\nurl = \"nats://h\"\npublish_timeout_ms = 9000").is_err());
        assert!(parse("[events.nats]\nurl = \"nats://h\"\nbatch_size = 0").is_err());
        assert!(parse("[events.nats]\nurl = \"tls://h:4222\"").is_err(), "no TLS provider is built in");
        assert!(parse("[events.nats]\nurl = \"nats://a:4222, b:4223\"").is_ok(), "nats:// is the default scheme");
    }

    #[test]
    fn unknown_settings_are_refused() {
        assert!(toml::from_str::<Config>("[server]\nlisten_on = \"x\"").is_err());
    }
}
