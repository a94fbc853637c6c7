//! Which planner each tenant's orders use right now. Versions live in storage, so every process
//! sees an upload or activation; each process caches the active version per tenant for a short
//! time (`cache_ttl`), and the process that made the change updates its cache at once. A plan
//! is made once, when the request starts, so a swap never changes an order in flight. Plugin
//! calls run on the plan pool (`pool.rs`), never on the async workers.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use super::{
    LoadError, LoadedPlugin, PlanInput, PlanPool, PluginFailed, PluginHost, PluginInvalid, PluginPlan, PluginPolicy,
    PoolError, Runtime,
};
use crate::engine::{
    DefaultPlanner, LimitSpec, OrderRequest, PartialPolicy, Plan, PlanError, PlannedLine, Planner, PlannerRef, Target,
    TenantId,
};
use crate::storage::{Storage, StorageError};

/// Most tenants whose active plugin is cached; beyond it the cache starts afresh.
const MAX_CACHED_TENANTS: usize = 100_000;

/// A tenant's planner as of now.
#[derive(Clone)]
pub enum Active {
    /// The native default plan.
    Builtin,
    /// An uploaded component.
    Wasm { version: i64, plugin: Arc<LoadedPlugin>, config: Arc<str> },
}

/// Why no plan could be made for an order.
#[derive(Debug, thiserror::Error)]
pub enum PlanFailure {
    /// The plugin failed (trap, fuel, deadline, memory, refusal, invalid plan):
    /// `422 plugin_failed`.
    #[error("{0}")]
    Plugin(String),
    /// The tenant has as many plugin calls (or compiles) in progress as it may: `429`.
    #[error("{0}")]
    TenantBusy(String),
    /// The server could not run the plugin right now: `503`, retry.
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Storage(#[from] StorageError),
}

struct Cached {
    active: Active,
    checked: Instant,
}

/// Per-tenant planners, backed by storage and one [`PluginHost`] per enabled language profile.
pub struct Registry {
    hosts: BTreeMap<Runtime, Arc<PluginHost>>,
    pool: PlanPool,
    storage: Arc<dyn Storage>,
    cache_ttl: Duration,
    cache: RwLock<HashMap<TenantId, Cached>>,
}

impl Registry {
    /// A registry over `hosts`, one per enabled language profile.
    pub fn new(hosts: Vec<Arc<PluginHost>>, pool: PlanPool, storage: Arc<dyn Storage>, cache_ttl: Duration) -> Self {
        let hosts = hosts.into_iter().map(|h| (h.runtime(), h)).collect();
        Self { hosts, pool, storage, cache_ttl, cache: RwLock::new(HashMap::new()) }
    }

    /// The host of `runtime`, when that profile is enabled.
    pub fn host(&self, runtime: Runtime) -> Option<&Arc<PluginHost>> {
        self.hosts.get(&runtime)
    }

    /// Every enabled profile's host.
    pub fn hosts(&self) -> impl Iterator<Item = &Arc<PluginHost>> {
        self.hosts.values()
    }

    /// The largest upload any enabled profile accepts: the upload route's body limit.
    pub fn max_wasm_bytes(&self) -> usize {
        self.hosts.values().map(|h| h.limits().max_wasm_bytes).max().unwrap_or(0)
    }

    /// Stops the compiles of every host: the server is shutting down.
    pub fn stop_compiles(&self) {
        for host in self.hosts.values() {
            host.stop_compiles();
        }
    }

    /// Validates and compiles a tenant's upload under `runtime`'s limits (in a child process,
    /// bounded; see [`PluginHost::load`]).
    pub async fn load(
        &self,
        tenant: &TenantId,
        runtime: Runtime,
        wasm: Arc<[u8]>,
    ) -> Result<Arc<LoadedPlugin>, LoadError> {
        match self.hosts.get(&runtime) {
            Some(host) => host.load(tenant, wasm).await,
            None => Err(PluginInvalid::new(format!("the {runtime} runtime is not enabled on this server")).into()),
        }
    }

    /// A stored version's component, inflated (`super::stored`); `None` when there is no such
    /// version. Bounded by the largest upload any enabled profile takes.
    pub async fn stored_wasm(&self, tenant: &TenantId, version: i64) -> Result<Option<Vec<u8>>, PlanFailure> {
        let Some(stored) = self.storage.plugin_wasm(tenant, version).await? else { return Ok(None) };
        let max = self.max_wasm_bytes();
        let wasm = tokio::task::spawn_blocking(move || super::stored::decode(&stored, max))
            .await
            .map_err(|_| PlanFailure::Unavailable("the plugin could not be read; try again".into()))?;
        wasm.map(Some)
            .ok_or_else(|| PlanFailure::Plugin(format!("plugin version {version} cannot be read from storage")))
    }

    /// Records what this process just activated, so its next order uses it at once.
    pub fn set(&self, tenant: &TenantId, active: Active) {
        if let Ok(mut cache) = self.cache.write() {
            if cache.len() >= MAX_CACHED_TENANTS {
                cache.clear();
            }
            cache.insert(tenant.clone(), Cached { active, checked: Instant::now() });
        }
    }

    /// The tenant's planner now: cached for `cache_ttl`, then asked of storage again.
    pub async fn active(&self, tenant: &TenantId) -> Result<Active, PlanFailure> {
        let cached = self.cache.read().ok().and_then(|c| c.get(tenant).map(|e| (e.active.clone(), e.checked)));
        if let Some((active, checked)) = &cached {
            if checked.elapsed() < self.cache_ttl {
                return Ok(active.clone());
            }
        }
        let active = match self.storage.active_plugin(tenant).await? {
            None => Active::Builtin,
            Some(v) => match cached {
                // Same version as before: keep the compiled plugin, just note the check.
                Some((Active::Wasm { version, plugin, config }, _)) if version == v.version => {
                    Active::Wasm { version, plugin, config }
                }
                _ => {
                    let wasm = self.stored_wasm(tenant, v.version).await?;
                    let wasm =
                        wasm.ok_or_else(|| PlanFailure::Plugin("the active plugin version is missing".into()))?;
                    let runtime = Runtime::parse(&v.runtime).ok_or_else(|| {
                        PlanFailure::Plugin(format!("the active plugin's runtime {:?} is unknown", v.runtime))
                    })?;
                    let plugin = self.load(tenant, runtime, Arc::from(wasm)).await.map_err(|e| match e {
                        LoadError::Invalid(e) => {
                            PlanFailure::Plugin(format!("the active plugin cannot be loaded: {e}"))
                        }
                        LoadError::Busy(why) => PlanFailure::TenantBusy(why),
                        LoadError::Unavailable(why) => PlanFailure::Unavailable(why),
                    })?;
                    Active::Wasm { version: v.version, plugin, config: Arc::from(v.config.as_str()) }
                }
            },
        };
        self.set(tenant, active.clone());
        Ok(active)
    }

    /// Plans an order with the tenant's active planner.
    pub async fn plan(&self, tenant: &TenantId, order: &OrderRequest, now_ms: i64) -> Result<Plan, PlanFailure> {
        match self.active(tenant).await? {
            Active::Builtin => DefaultPlanner.plan(tenant, order, now_ms).map_err(|e| PlanFailure::Plugin(e.0)),
            Active::Wasm { version, plugin, config } => {
                let (owned_tenant, owned_order, seed) = (tenant.clone(), order.clone(), rand::random());
                let planned = self
                    .pool
                    .run(tenant, move || {
                        let input =
                            PlanInput { tenant: &owned_tenant, order: &owned_order, now_ms, seed, config: &config };
                        plugin.plan(&input)
                    })
                    .await
                    .map_err(|e| {
                        metrics::counter!("stockd_plan_pool_refusals_total", "kind" => e.kind()).increment(1);
                        match e {
                            PoolError::TenantBusy => PlanFailure::TenantBusy(e.to_string()),
                            PoolError::Exhausted => PlanFailure::Unavailable(e.to_string()),
                        }
                    })?
                    .map_err(|e: PluginFailed| {
                        metrics::counter!("stockd_plugin_failures_total", "kind" => e.kind()).increment(1);
                        match e {
                            PluginFailed::Unavailable(why) => PlanFailure::Unavailable(why),
                            failed => PlanFailure::Plugin(failed.to_string()),
                        }
                    })?;
                to_plan(planned, version, order.lines.len()).map_err(|e| PlanFailure::Plugin(e.0))
            }
        }
    }
}

/// The core's plan from a validated plugin plan. Every order line must be planned exactly once
/// (the host already refused duplicates and out-of-range indexes).
pub fn to_plan(planned: PluginPlan, version: i64, order_lines: usize) -> Result<Plan, PlanError> {
    if planned.lines.len() != order_lines {
        return Err(PlanError(format!(
            "plugin returned an invalid plan: it planned {} of the order's {order_lines} lines",
            planned.lines.len()
        )));
    }
    let mut lines: Vec<PlannedLine> = planned
        .lines
        .into_iter()
        .map(|l| PlannedLine {
            line: l.line,
            qty: l.qty.get(),
            mandatory: l.mandatory,
            targets: l
                .targets
                .into_iter()
                .map(|t| Target {
                    resource: t.resource,
                    kind: t.kind,
                    create_if_missing: t.create_if_missing,
                    buckets: t.buckets,
                })
                .collect(),
            limit: l.limit.map(|u| LimitSpec { key: u.key, max: u.max }),
        })
        .collect();
    lines.sort_by_key(|l| l.line);
    // One change per resource and order: the ledger's identity (resource, request, op) must hold.
    let mut seen = std::collections::HashSet::new();
    for target in lines.iter().flat_map(|l| l.targets.iter()) {
        if !seen.insert(target.resource.as_str()) {
            return Err(PlanError(format!(
                "plugin returned an invalid plan: resource {} is targeted by more than one line or twice by one",
                target.resource
            )));
        }
    }
    let policy = match planned.policy {
        PluginPolicy::AllOrNothing => PartialPolicy::AllOrNothing,
        PluginPolicy::AllowPartial => PartialPolicy::AllowPartial,
        PluginPolicy::MandatoryLines => PartialPolicy::MandatoryLines,
    };
    Ok(Plan { planner: PlannerRef { name: "wasm".into(), version }, policy, lines })
}
