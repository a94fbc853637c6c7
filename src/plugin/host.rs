//! The wasmtime side: one engine for every plugin, a linker that provides nothing, compiled
//! components cached by sha256, and per plugin a small pool of live instances so a call costs
//! a fraction of a microsecond instead of an instantiation.
//!
//! Loading an upload: size and header checks, the structural pre-checks (`precheck.rs`), then
//! a compile in a child process under hard limits (`compile.rs`), whose artifact this process
//! maps. One compile per sha256 at a time (later callers wait for the first), at most
//! `max_concurrent_compiles` at once and one per tenant. Nothing compiled is kept from a
//! refused or abandoned compile; a refusal is remembered, so the same bytes are refused again
//! at once.
//!
//! Isolation of a call: each instance has its own `Store` (memory capped by [`StoreLimits`],
//! fuel reset to the budget and a time limit set before every call, lifting of the
//! result capped at what a legal plan can need). An instance serves at most
//! [`PluginLimits::calls_per_instance`] calls and is thrown away after any failure, so a trap
//! or a half-finished call never leaves state behind for the next order.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, FutureExt, Shared, WeakShared};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use wasmtime::component::{types::ComponentItem, Component, Linker};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, OptLevel, PoolingAllocationConfig, ResourceLimiter, Store, StoreLimits,
    StoreLimitsBuilder, Trap, UpdateDeadline,
};

use super::artifacts::ArtifactStore;
use super::bindings::{Planner, PlannerPre};
use super::compile::Compiler;
use super::convert;
use super::limits::{InstanceShape, PluginLimits, Runtime, MAX_BUCKETS, MAX_TARGETS_PER_LINE};
use super::model::{LoadError, PlanInput, PluginFailed, PluginInvalid, PluginPlan};
use super::precheck::{check_shape, Shape};
use crate::engine::TenantId;

/// WebAssembly's page size: memory limits are rounded up to whole pages.
const WASM_PAGE_BYTES: usize = 64 << 10;
/// Native stack a plugin may use. wasmtime's default; deep recursion traps cleanly.
const MAX_WASM_STACK_BYTES: usize = 512 << 10;
/// Characters kept of a wasmtime error message shown to a plugin author.
const MAX_ERROR_CHARS: usize = 300;
/// How often the engine's epoch advances: the granularity of the time limit.
const EPOCH_TICK: Duration = Duration::from_millis(5);
/// Bytes of lifted result one planned line may need at most: a line record, 8 targets of a
/// 200-byte key and 1,024 bucket indexes each, and a 200-byte limit key (rounded up).
const LIFT_BYTES_PER_LINE: usize = 64 + MAX_TARGETS_PER_LINE * (48 + 200 + MAX_BUCKETS * 4) + 256;
/// Lifted bytes every result may use besides its lines: the refusal reason (cut to 500
/// characters after lifting, so a longer one is useless) and the plan record.
const LIFT_BYTES_BASE: usize = 16 << 10;

/// Builds the engine configuration: the same function for the server and for its compiler
/// children, so an artifact compiled in a child always fits the server's engine (what the
/// compiled code depends on is `max_memory_bytes`; the pool's shape and size only bound
/// instantiation). `pool_slots` sizes the instance pool (the child needs one; it instantiates
/// nothing).
pub(crate) fn engine_config(max_memory_bytes: usize, shape: InstanceShape, pool_slots: u32) -> Config {
    let max_memory_bytes = max_memory_bytes.div_ceil(WASM_PAGE_BYTES).max(1) * WASM_PAGE_BYTES;
    let live = pool_slots.max(1);
    let mut pool = PoolingAllocationConfig::new();
    // Every live instance takes one slot of each kind below; `InstanceBudget` keeps the
    // number of live instances at or under `live`, so the pool is never exhausted.
    pool.total_component_instances(live)
        .total_core_instances(live.saturating_mul(shape.core_instances))
        .max_core_instances_per_component(shape.core_instances)
        .total_memories(live.saturating_mul(shape.memories))
        .max_memories_per_component(shape.memories)
        .max_memories_per_module(shape.memories)
        .total_tables(live.saturating_mul(shape.tables))
        .max_tables_per_component(shape.tables)
        .max_tables_per_module(shape.tables)
        .table_elements(shape.table_elements)
        // The memory cap, enforced by the pool's slots as well as by each store's limits.
        .max_memory_size(max_memory_bytes);

    let mut config = Config::new();
    config
        .wasm_component_model(true)
        // Plugins are synchronous: no component-model async, no per-store async state.
        .concurrency_support(false)
        // Fuel bounds a call's work deterministically (same plugin, same input, same
        // verdict); `fuel_per_call` is the budget.
        .consume_fuel(true)
        // And a time limit, since fuel does not bound everything: a bulk memory
        // operation costs one unit of fuel whatever its length. Checked at function entries
        // and loop headers; a ticker thread advances the epoch every `EPOCH_TICK`.
        .epoch_interruption(true)
        .max_wasm_stack(MAX_WASM_STACK_BYTES)
        // Each memory slot reserves just the cap: 256 slots of 16 MiB (plus guard pages)
        // rather than 4 GiB each. Costs explicit bounds checks, negligible for plans.
        .memory_reservation(max_memory_bytes as u64)
        // Instances come from pre-reserved slots, so a fresh one costs ~10-20 µs (measured),
        // paid once per `calls_per_instance` calls.
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
        .cranelift_opt_level(OptLevel::Speed)
        // A trap's message is enough for a plugin author; backtraces cost time on every
        // trap and would echo the plugin's internals.
        .wasm_backtrace_max_frames(None);
    config
}

/// What the hosts of one process share: the compile slots, the one-compile-per-tenant rule
/// (across every language profile) and the store of compiled artifacts.
pub struct HostShared {
    compile_slots: Arc<Semaphore>,
    /// Tenants with a compile of their own in progress: one each at a time.
    compiling_tenants: Arc<Mutex<HashSet<TenantId>>>,
    artifacts: Option<Arc<ArtifactStore>>,
}

impl HostShared {
    /// `max_concurrent_compiles` slots; artifacts kept in `artifacts` when set.
    pub fn new(max_concurrent_compiles: usize, artifacts: Option<Arc<ArtifactStore>>) -> anyhow::Result<Arc<Self>> {
        anyhow::ensure!(max_concurrent_compiles >= 1, "plugin max_concurrent_compiles must be at least 1");
        Ok(Arc::new(HostShared {
            compile_slots: Arc::new(Semaphore::new(max_concurrent_compiles)),
            compiling_tenants: Arc::default(),
            artifacts,
        }))
    }
}

/// Loads, validates and runs the tenant plugins of one language profile. One per profile and
/// process; cheap to share by reference.
pub struct PluginHost {
    runtime: Runtime,
    engine: Engine,
    /// Names this engine's configuration in artifact keys: wasmtime's own compatibility hash.
    engine_key: String,
    /// Built once, empty on purpose: a plugin may import nothing.
    linker: Linker<CallState>,
    limits: PluginLimits,
    cache: Mutex<Cache>,
    /// Components refused as invalid, by sha256, so the same bytes (an active version that
    /// today's limits refuse, re-planned on every order; a bomb uploaded again) are answered
    /// at once instead of compiled again. Only `Invalid` verdicts: never a transient failure.
    refused: Mutex<Refused>,
    budget: Arc<InstanceBudget>,
    compiler: Compiler,
    /// Compiles in progress by sha256. Weak: when every caller waiting for one has gone
    /// away, the compile is dropped (its child killed) and nothing is cached from it.
    in_flight: Mutex<HashMap<[u8; 32], WeakShared<LoadFuture>>>,
    shared: Arc<HostShared>,
    /// The first check of a call's time limit, in epoch ticks (`deadline_reached`).
    deadline_ticks: u64,
}

type LoadFuture = BoxFuture<'static, Result<PlannerPre<CallState>, LoadError>>;

/// Compiled plugins by sha256, oldest first for eviction. Only the compiled, pre-linked code is
/// shared: every `load` gets its own instance pool, so two tenants uploading the same bytes
/// never share an instance (or anything an instance remembers).
#[derive(Default)]
struct Cache {
    by_sha256: HashMap<[u8; 32], PlannerPre<CallState>>,
    order: VecDeque<[u8; 32]>,
}

/// Refusals remembered by sha256, oldest first for eviction.
#[derive(Default)]
struct Refused {
    by_sha256: HashMap<[u8; 32], PluginInvalid>,
    order: VecDeque<[u8; 32]>,
}

/// Refused components remembered (a few hundred bytes each).
const MAX_REMEMBERED_REFUSALS: usize = 1024;

/// A validated, compiled plugin, ready to plan, with its own pool of live instances. Shared
/// by every request of the tenant (and version) that loaded it, never across tenants.
pub struct LoadedPlugin {
    sha256: [u8; 32],
    runtime: Runtime,
    engine: Engine,
    /// Imports resolved and exports type-checked once, at load.
    pre: PlannerPre<CallState>,
    limits: PluginLimits,
    idle: Mutex<Vec<LiveInstance>>,
    budget: Arc<InstanceBudget>,
    deadline_ticks: u64,
}

/// One instantiated plugin and its private store.
struct LiveInstance {
    store: Store<CallState>,
    planner: Planner,
    calls: u32,
    _slot: LiveSlot,
}

/// What a store carries: its limits, and whether the memory cap was what stopped the call.
struct CallState {
    limits: StoreLimits,
    memory_cap_hit: bool,
    /// The current call's CPU budget (`plan_timeout`), when it started on the wall clock and
    /// on this thread's CPU clock, and whether it was stopped for waiting, not running.
    plan_timeout: Duration,
    call_started: Instant,
    cpu_at_start: Duration,
    starved: bool,
}

/// Instances alive across all plugins, so the pooling allocator's slots are never overdrawn
/// and idle instances never take more than half of them.
struct InstanceBudget {
    live: AtomicUsize,
    idle: AtomicUsize,
    max_live: usize,
    max_idle: usize,
}

/// One counted live instance; gives its place back when dropped.
struct LiveSlot(Arc<InstanceBudget>);

/// What one plan call cost, for `stockd plugin check`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallCost {
    pub fuel_used: u64,
}

impl PluginHost {
    /// A host of Rust plugins with its own compile slots and no artifact store; compiles run in
    /// children of this executable. Fails only on a configuration wasmtime cannot run (for
    /// example, no address space for the instance pool).
    pub fn new(limits: PluginLimits) -> anyhow::Result<Arc<PluginHost>> {
        let shared = HostShared::new(limits.max_concurrent_compiles, None)?;
        Self::for_runtime(Runtime::Rust, limits, shared)
    }

    /// The host of one language profile, sharing compile slots and artifacts with the others.
    pub fn for_runtime(runtime: Runtime, limits: PluginLimits, shared: Arc<HostShared>) -> anyhow::Result<Arc<Self>> {
        let compiler = Compiler::new(limits.compile.clone(), limits.max_memory_bytes, limits.instance)?;
        Self::with_compiler(runtime, limits, compiler, shared)
    }

    /// A host that compiles on its own threads: for the host's unit tests only, whose test
    /// binary cannot be a compiler child.
    #[cfg(test)]
    pub(crate) fn in_process(limits: PluginLimits) -> anyhow::Result<Arc<PluginHost>> {
        Self::in_process_with(limits, None)
    }

    /// [`Self::in_process`] keeping artifacts in `artifacts`.
    #[cfg(test)]
    pub(crate) fn in_process_with(
        limits: PluginLimits,
        artifacts: Option<Arc<ArtifactStore>>,
    ) -> anyhow::Result<Arc<PluginHost>> {
        let compiler = Compiler::in_process(limits.compile.clone(), limits.max_memory_bytes, limits.instance)?;
        let shared = HostShared::new(limits.max_concurrent_compiles, artifacts)?;
        Self::with_compiler(Runtime::Rust, limits, compiler, shared)
    }

    fn with_compiler(
        runtime: Runtime,
        limits: PluginLimits,
        compiler: Compiler,
        shared: Arc<HostShared>,
    ) -> anyhow::Result<Arc<PluginHost>> {
        anyhow::ensure!(limits.max_live_instances >= 2, "plugin max_live_instances must be at least 2");
        anyhow::ensure!(limits.calls_per_instance >= 1, "plugin calls_per_instance must be at least 1");
        anyhow::ensure!(limits.fuel_per_call >= 1, "plugin fuel_per_call must be at least 1");
        anyhow::ensure!(!limits.plan_timeout.is_zero(), "plugin plan_timeout_ms must be at least 1");
        let config = engine_config(limits.max_memory_bytes, limits.instance, limits.max_live_instances);
        let engine = Engine::new(&config).map_err(|e| anyhow::anyhow!("plugin engine ({runtime}): {e:#}"))?;
        let engine_key = {
            use std::hash::{Hash, Hasher};
            // SipHash with fixed keys: the same configuration gives the same key in every process.
            let mut hasher = std::hash::DefaultHasher::new();
            engine.precompile_compatibility_hash().hash(&mut hasher);
            format!("{:016x}", hasher.finish())
        };
        let linker = Linker::new(&engine);
        start_epoch_ticker(&engine)?;

        let live = usize::try_from(limits.max_live_instances)?;
        let budget = Arc::new(InstanceBudget {
            live: AtomicUsize::new(0),
            idle: AtomicUsize::new(0),
            max_live: live,
            max_idle: live / 2,
        });
        // The deadline is at least this long; one tick more covers the tick in progress.
        let deadline_ticks = u64::try_from(limits.plan_timeout.as_nanos().div_ceil(EPOCH_TICK.as_nanos()))?.max(1) + 1;
        Ok(Arc::new(PluginHost {
            runtime,
            engine,
            engine_key,
            linker,
            limits,
            cache: Mutex::default(),
            refused: Mutex::default(),
            budget,
            compiler,
            in_flight: Mutex::default(),
            shared,
            deadline_ticks,
        }))
    }

    /// The limits this host runs plugins under.
    pub fn limits(&self) -> &PluginLimits {
        &self.limits
    }

    /// The language profile this host runs.
    pub fn runtime(&self) -> Runtime {
        self.runtime
    }

    /// Kills compiles in progress and refuses new ones: the server is shutting down.
    pub fn stop_compiles(&self) {
        self.compiler.stop();
    }

    /// Validates and compiles an uploaded component: within the size limit, a component (not
    /// a core module), within the shape limits, compiles within the compile limits, imports
    /// nothing, exports the `planner` world, and instantiates within the memory and fuel
    /// limits. The same bytes compile once; later loads share the compiled code (each with an
    /// instance pool of its own). `tenant` is who asked, for the one-compile-per-tenant rule.
    pub async fn load(self: &Arc<Self>, tenant: &TenantId, wasm: Arc<[u8]>) -> Result<Arc<LoadedPlugin>, LoadError> {
        if wasm.len() > self.limits.max_wasm_bytes {
            return Err(PluginInvalid::new(format!(
                "the plugin is {} bytes; the limit is {} bytes",
                wasm.len(),
                self.limits.max_wasm_bytes
            ))
            .into());
        }
        check_header(&wasm)?;
        let sha256: [u8; 32] = Sha256::digest(&wasm).into();
        if let Some(pre) = self.cache().by_sha256.get(&sha256) {
            return Ok(Arc::new(self.with_own_pool(sha256, pre.clone())));
        }
        if let Some(invalid) = self.refused().by_sha256.get(&sha256) {
            return Err(invalid.clone().into());
        }
        let compile = self.join_or_start(tenant, sha256, wasm)?;
        let pre = compile.await?;
        Ok(Arc::new(self.with_own_pool(sha256, pre)))
    }

    /// The compile of `sha256` already in progress, or a new one. Holding the returned future
    /// keeps the compile alive; the last holder to drop it ends it.
    fn join_or_start(
        self: &Arc<Self>,
        tenant: &TenantId,
        sha256: [u8; 32],
        wasm: Arc<[u8]>,
    ) -> Result<Shared<LoadFuture>, LoadError> {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(running) = in_flight.get(&sha256).and_then(WeakShared::upgrade) {
            return Ok(running);
        }
        // Forget compiles nobody waits for any more, so the map stays as small as the work.
        in_flight.retain(|_, weak| weak.upgrade().is_some());
        let tenant_slot = TenantCompile::start(&self.shared.compiling_tenants, tenant).ok_or_else(|| {
            LoadError::Busy("another plugin of this tenant is being compiled; retry when it is done".into())
        })?;
        let host = Arc::clone(self);
        let compile = async move {
            let _tenant_slot = tenant_slot;
            let result = host.compile(sha256, &wasm).await;
            if let Err(LoadError::Invalid(invalid)) = &result {
                host.remember_refusal(sha256, invalid);
            }
            host.in_flight.lock().unwrap_or_else(PoisonError::into_inner).remove(&sha256);
            result
        }
        .boxed()
        .shared();
        if let Some(weak) = compile.downgrade() {
            in_flight.insert(sha256, weak);
        }
        Ok(compile)
    }

    /// Maps the stored artifact of these bytes when there is one; otherwise pre-checks,
    /// compiles in a child and stores the artifact. Then type-checks it and instantiates it
    /// once; caches the result only when all of that succeeded.
    async fn compile(self: &Arc<Self>, sha256: [u8; 32], wasm: &Arc<[u8]>) -> Result<PlannerPre<CallState>, LoadError> {
        let key = format!("{}-{}-{}", hex::encode(sha256), self.runtime, self.engine_key);
        if let Some(store) = self.shared.artifacts.clone() {
            if let Some(stored) = store.get(&key) {
                let started = std::time::Instant::now();
                let host = Arc::clone(self);
                let linked = tokio::task::spawn_blocking(move || host.link(sha256, &stored))
                    .await
                    .map_err(|_| LoadError::Unavailable("the plugin could not be loaded; try again".into()))?;
                match linked {
                    Ok(pre) => {
                        metrics::counter!("stockd_plugin_artifacts_total", "result" => "loaded").increment(1);
                        tracing::info!(runtime = %self.runtime, sha256 = %hex::encode(sha256),
                            ms = started.elapsed().as_millis() as u64, "plugin loaded from its stored artifact");
                        return Ok(pre);
                    }
                    // An artifact this engine cannot map (another wasmtime, a damaged file) is
                    // forgotten and compiled again; a verdict about the component stands.
                    Err(LoadError::Unavailable(_)) => store.remove(&key),
                    Err(other) => return Err(other),
                }
            }
        }
        let limits = self.compiler.limits();
        let _slot = tokio::time::timeout(limits.timeout, Arc::clone(&self.shared.compile_slots).acquire_owned())
            .await
            .map_err(|_| LoadError::Unavailable("every plugin compiler is busy; try again shortly".into()))?
            .map_err(|_| LoadError::Unavailable("the server is shutting down".into()))?;
        let shape = {
            let (wasm, shape_limits) = (Arc::clone(wasm), self.limits.shape);
            tokio::task::spawn_blocking(move || check_shape(&wasm, &shape_limits))
                .await
                .map_err(|_| LoadError::Unavailable("the plugin could not be checked; try again".into()))??
        };
        tracing::debug!(?shape, "plugin passed the shape checks");
        let started = std::time::Instant::now();
        let artifact = match self.compiler.compile(wasm).await {
            Ok(artifact) => artifact,
            Err(error) => {
                let result = if matches!(error, LoadError::Invalid(_)) { "refused" } else { "unavailable" };
                metrics::counter!("stockd_plugin_compiles_total", "result" => result).increment(1);
                return Err(error);
            }
        };
        metrics::counter!("stockd_plugin_compiles_total", "result" => "ok").increment(1);
        metrics::histogram!("stockd_plugin_compile_seconds").record(started.elapsed().as_secs_f64());
        tracing::info!(runtime = %self.runtime, sha256 = %hex::encode(sha256),
            ms = started.elapsed().as_millis() as u64, "plugin compiled");
        let host = Arc::clone(self);
        let store = self.shared.artifacts.clone();
        let pre = tokio::task::spawn_blocking(move || {
            let pre = host.link(sha256, artifact.path())?;
            // Kept only once it proved a valid planner, so a stored artifact is never a refusal.
            if let Some(store) = store {
                match store.put(&key, artifact.path()) {
                    Ok(()) => metrics::counter!("stockd_plugin_artifacts_total", "result" => "stored").increment(1),
                    Err(e) => tracing::warn!(error = %e, "a compiled plugin could not be stored; it is compiled again next time"),
                }
            }
            Ok::<_, LoadError>(pre)
        })
        .await
        .map_err(|_| LoadError::Unavailable("the plugin could not be loaded; try again".into()))??;
        Ok(pre)
    }

    /// Maps a compiled artifact and checks it as a planner: imports, exports, one real
    /// instantiation within the limits. Caches it on success.
    fn link(&self, sha256: [u8; 32], artifact: &std::path::Path) -> Result<PlannerPre<CallState>, LoadError> {
        // SAFETY: the artifact was written by this executable's compiler for this engine's
        // configuration, either a moment ago into this process's private (0700) directory or
        // earlier into the artifact store, a directory only this user may write
        // (`ArtifactStore::open` checks); wasmtime still checks its version and settings.
        let component = unsafe { Component::deserialize_file(&self.engine, artifact) }.map_err(|e| {
            let error = short_error(&e);
            // More core instances, memories or tables than the profile's pool slots hold: a
            // verdict about the component, the same every time.
            if error.contains("exceeds the configured maximum") {
                return LoadError::Invalid(PluginInvalid::new(format!(
                    "the component exceeds the {} runtime's instance limits: {error}",
                    self.runtime
                )));
            }
            tracing::error!(%error, "a compiled plugin could not be loaded");
            LoadError::Unavailable("the compiled plugin could not be loaded; try again".into())
        })?;
        check_imports(&self.engine, &component)?;
        let instance_pre = self.linker.instantiate_pre(&component).map_err(|e| {
            PluginInvalid::new(format!("the component's imports cannot be satisfied: {}", short_error(&e)))
        })?;
        let pre = PlannerPre::new(instance_pre).map_err(|e| {
            PluginInvalid::new(format!(
                "the component does not implement the stockd:plugin/planner@0.1.0 world: {}",
                short_error(&e)
            ))
        })?;
        // One real instantiation now: a plugin whose memory, tables or start-up work exceed
        // the limits is refused at upload, not on its first order.
        self.with_own_pool(sha256, pre.clone()).instantiate().map_err(|failed| match failed {
            PluginFailed::Unavailable(why) => LoadError::Unavailable(why),
            failed => {
                PluginInvalid::new(format!("the component cannot be instantiated within the limits: {failed}")).into()
            }
        })?;

        let mut cache = self.cache();
        if !cache.by_sha256.contains_key(&sha256) {
            while cache.order.len() >= self.limits.max_cached_plugins.max(1) {
                if let Some(oldest) = cache.order.pop_front() {
                    // Holders of the evicted plugin keep using it; only the cache forgets it.
                    cache.by_sha256.remove(&oldest);
                }
            }
            cache.by_sha256.insert(sha256, pre.clone());
            cache.order.push_back(sha256);
        }
        Ok(pre)
    }

    /// The structural figures of a component (functions, body sizes, locals, nesting), as the
    /// pre-checks measure them; for `stockd plugin check`.
    pub fn shape(&self, wasm: &[u8]) -> Result<Shape, PluginInvalid> {
        check_shape(wasm, &self.limits.shape)
    }

    /// A plugin handle over compiled code, with an empty instance pool of its own.
    fn with_own_pool(&self, sha256: [u8; 32], pre: PlannerPre<CallState>) -> LoadedPlugin {
        LoadedPlugin {
            sha256,
            runtime: self.runtime,
            engine: self.engine.clone(),
            pre,
            limits: self.limits.clone(),
            idle: Mutex::default(),
            budget: Arc::clone(&self.budget),
            deadline_ticks: self.deadline_ticks,
        }
    }

    fn remember_refusal(&self, sha256: [u8; 32], invalid: &PluginInvalid) {
        let mut refused = self.refused();
        if refused.by_sha256.insert(sha256, invalid.clone()).is_none() {
            refused.order.push_back(sha256);
            while refused.order.len() > MAX_REMEMBERED_REFUSALS {
                if let Some(oldest) = refused.order.pop_front() {
                    refused.by_sha256.remove(&oldest);
                }
            }
        }
    }

    fn refused(&self) -> MutexGuard<'_, Refused> {
        // Changed only in single, complete steps, like the cache.
        self.refused.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn cache(&self) -> MutexGuard<'_, Cache> {
        // The cache is only ever changed in single, complete steps: a panic elsewhere while
        // it was locked cannot have left it half-updated.
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A tenant's one compile in progress; frees the tenant's place when dropped.
struct TenantCompile {
    tenants: Arc<Mutex<HashSet<TenantId>>>,
    tenant: TenantId,
}

impl TenantCompile {
    /// Takes the tenant's place, or `None` when the tenant already has a compile running.
    fn start(tenants: &Arc<Mutex<HashSet<TenantId>>>, tenant: &TenantId) -> Option<TenantCompile> {
        let fresh = tenants.lock().unwrap_or_else(PoisonError::into_inner).insert(tenant.clone());
        fresh.then(|| TenantCompile { tenants: Arc::clone(tenants), tenant: tenant.clone() })
    }
}

impl Drop for TenantCompile {
    fn drop(&mut self) {
        self.tenants.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.tenant);
    }
}

/// How many times `plan_timeout` a call may take on the wall clock while the machine is too
/// busy to give it `plan_timeout` of CPU; then it is stopped as starved (`503`).
const STARVED_WALL_FACTOR: u32 = 4;

/// Called when a call's epoch deadline passes (every `plan_timeout` of wall clock at first).
/// The limit is on CPU time: a plugin that has run for `plan_timeout` on its thread is stopped
/// as too slow, deterministically, however busy the machine; one that has run for less, because
/// it was waiting for a CPU, gets the rest, up to `STARVED_WALL_FACTOR` times the limit of
/// wall clock, and is then stopped as starved.
fn deadline_reached(mut context: wasmtime::StoreContextMut<'_, CallState>) -> wasmtime::Result<UpdateDeadline> {
    let state = context.data_mut();
    let cpu = thread_cpu_time().saturating_sub(state.cpu_at_start);
    if cpu >= state.plan_timeout {
        return Ok(UpdateDeadline::Interrupt);
    }
    if state.call_started.elapsed() >= state.plan_timeout.saturating_mul(STARVED_WALL_FACTOR) {
        state.starved = true;
        return Ok(UpdateDeadline::Interrupt);
    }
    let left = state.plan_timeout - cpu;
    Ok(UpdateDeadline::Continue(u64::try_from(left.as_nanos().div_ceil(EPOCH_TICK.as_nanos())).unwrap_or(1).max(1)))
}

/// CPU time this thread has used so far.
fn thread_cpu_time() -> Duration {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `now` is a valid timespec to write to; the clock exists on every Linux.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(u64::try_from(now.tv_sec).unwrap_or(0), u32::try_from(now.tv_nsec).unwrap_or(0))
}

/// Advances the engine's epoch every [`EPOCH_TICK`] for as long as the engine lives.
fn start_epoch_ticker(engine: &Engine) -> anyhow::Result<()> {
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("stockd-plugin-epoch".into())
        .spawn(move || {
            while let Some(engine) = weak.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(EPOCH_TICK);
            }
        })
        .map_err(|e| anyhow::anyhow!("starting the plugin epoch ticker: {e}"))?;
    Ok(())
}

impl LoadedPlugin {
    /// The sha256 of the component's bytes, as lowercase hex.
    pub fn sha256(&self) -> String {
        hex::encode(self.sha256)
    }

    /// Runs the plugin on one order and validates its plan. Synchronous and CPU-bound
    /// (typically a microsecond or two, never more than the fuel budget or the wall-clock
    /// deadline): call it from the plan pool (`pool.rs`) or another thread that may block,
    /// never from an async worker. Safe to call from many threads at once.
    pub fn plan(&self, input: &PlanInput<'_>) -> Result<PluginPlan, PluginFailed> {
        self.plan_measured(input).0
    }

    /// [`Self::plan`], and what the call cost.
    pub fn plan_measured(&self, input: &PlanInput<'_>) -> (Result<PluginPlan, PluginFailed>, CallCost) {
        let mut cost = CallCost { fuel_used: 0 };
        let (order, context) = convert::to_wit(input);
        let mut instance = match self.take_idle() {
            Some(instance) => instance,
            None => match self.instantiate() {
                Ok(instance) => instance,
                Err(failed) => return (Err(failed), cost),
            },
        };
        if let Err(failed) = self.refuel(&mut instance.store) {
            return (Err(failed), cost);
        }
        // What a legal plan for this order can need to cross into the host, and no more: a
        // plan whose lines all point at one large list in guest memory would otherwise lift
        // into hundreds of MiB here.
        instance.store.set_hostcall_fuel(LIFT_BYTES_BASE + input.order.lines.len() * LIFT_BYTES_PER_LINE);
        instance.calls += 1;
        // On any failure below the instance is dropped, never returned to the pool.
        let called = instance.planner.call_plan(&mut instance.store, &order, &context);
        cost.fuel_used = self.limits.fuel_per_call.saturating_sub(instance.store.get_fuel().unwrap_or(0));
        let plan = match called {
            Ok(Ok(plan)) => plan,
            Ok(Err(reason)) => return (Err(PluginFailed::Refused(convert::bounded_reason(&reason))), cost),
            Err(error) => return (Err(self.classify(&error, instance.store.data())), cost),
        };
        let plan = match convert::from_wit(plan, input.order.lines.len()) {
            Ok(plan) => plan,
            Err(invalid) => return (Err(PluginFailed::InvalidPlan(invalid)), cost),
        };
        self.give_back(instance);
        (Ok(plan), cost)
    }

    /// A fresh instance in a fresh store.
    fn instantiate(&self) -> Result<LiveInstance, PluginFailed> {
        let slot = LiveSlot::take(&self.budget)
            .ok_or_else(|| PluginFailed::Unavailable("too many plugin calls in flight; try again".into()))?;
        let state = CallState {
            limits: StoreLimitsBuilder::new()
                .memory_size(self.limits.max_memory_bytes)
                .table_elements(self.limits.instance.table_elements)
                .instances(self.limits.instance.core_instances as usize)
                .memories(self.limits.instance.memories as usize)
                .tables(self.limits.instance.tables as usize)
                // Hitting the cap stops the plugin at once instead of letting its allocator
                // fail and limp on.
                .trap_on_grow_failure(true)
                .build(),
            memory_cap_hit: false,
            plan_timeout: self.limits.plan_timeout,
            call_started: Instant::now(),
            cpu_at_start: Duration::ZERO,
            starved: false,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|state| state);
        store.epoch_deadline_callback(deadline_reached);
        self.refuel(&mut store)?;
        let planner = self.pre.instantiate(&mut store).map_err(|error| self.classify(&error, store.data()))?;
        Ok(LiveInstance { store, planner, calls: 0, _slot: slot })
    }

    /// A full fuel budget and a fresh deadline, before every call.
    fn refuel(&self, store: &mut Store<CallState>) -> Result<(), PluginFailed> {
        let state = store.data_mut();
        state.call_started = Instant::now();
        state.cpu_at_start = thread_cpu_time();
        state.starved = false;
        store.set_epoch_deadline(self.deadline_ticks);
        // Fails only if the engine had fuel disabled, which `engine_config` never does.
        store
            .set_fuel(self.limits.fuel_per_call)
            .map_err(|e| PluginFailed::Unavailable(format!("plugin fuel: {}", short_error(&e))))
    }

    fn take_idle(&self) -> Option<LiveInstance> {
        let instance = self.idle().pop()?;
        self.budget.idle.fetch_sub(1, Ordering::Relaxed);
        Some(instance)
    }

    /// Keeps a healthy instance for the next call, unless it has served its calls or the
    /// plugin's (or the host's) idle pool is full; otherwise it is dropped here.
    fn give_back(&self, instance: LiveInstance) {
        if instance.calls >= self.limits.calls_per_instance {
            return;
        }
        let mut idle = self.idle();
        if idle.len() >= self.limits.max_instances_per_plugin || !self.budget.reserve_idle() {
            return;
        }
        idle.push(instance);
    }

    fn idle(&self) -> MutexGuard<'_, Vec<LiveInstance>> {
        // Instances are pushed and popped whole: a poisoned lock still guards a valid pool.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A short, typed reason for a failed call or instantiation.
    fn classify(&self, error: &wasmtime::Error, state: &CallState) -> PluginFailed {
        if state.memory_cap_hit {
            return PluginFailed::OutOfMemory { limit_bytes: self.limits.max_memory_bytes };
        }
        match error.downcast_ref::<Trap>() {
            Some(Trap::OutOfFuel) => PluginFailed::OutOfFuel { fuel: self.limits.fuel_per_call },
            // Waiting for a CPU, not running: the machine is overloaded, retry.
            Some(Trap::Interrupt) if state.starved => {
                PluginFailed::Unavailable("the server was too busy to finish the plan in time; retry".into())
            }
            Some(Trap::Interrupt) => PluginFailed::TimedOut {
                limit_ms: u64::try_from(self.limits.plan_timeout.as_millis()).unwrap_or(u64::MAX),
            },
            Some(Trap::UnreachableCodeReached) if self.runtime == Runtime::Rust => {
                PluginFailed::Trap("reached `unreachable` (a panic in a Rust plugin)".into())
            }
            Some(Trap::UnreachableCodeReached) => {
                PluginFailed::Trap("reached `unreachable` (an uncaught exception or error in the plugin)".into())
            }
            Some(trap) => PluginFailed::Trap(trap.to_string()),
            // wasmtime's error type for this is private; its message is stable.
            None if error.chain().any(|cause| cause.to_string().contains("fuel allocated for hostcalls")) => {
                PluginFailed::InvalidPlan("the plan is larger than any valid plan for this order could be".into())
            }
            None => PluginFailed::Trap(short_error(error)),
        }
    }
}

impl Drop for LoadedPlugin {
    fn drop(&mut self) {
        let idle = self.idle.get_mut().unwrap_or_else(PoisonError::into_inner);
        self.budget.idle.fetch_sub(idle.len(), Ordering::Relaxed);
    }
}

impl std::fmt::Debug for LoadedPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedPlugin").field("sha256", &self.sha256()).finish_non_exhaustive()
    }
}

impl InstanceBudget {
    fn reserve_idle(&self) -> bool {
        self.idle.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < self.max_idle).then_some(n + 1)).is_ok()
    }
}

impl LiveSlot {
    fn take(budget: &Arc<InstanceBudget>) -> Option<LiveSlot> {
        budget
            .live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < budget.max_live).then_some(n + 1))
            .ok()
            .map(|_| LiveSlot(Arc::clone(budget)))
    }
}

impl Drop for LiveSlot {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ResourceLimiter for CallState {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let verdict = self.limits.memory_growing(current, desired, maximum);
        if !matches!(verdict, Ok(true)) {
            self.memory_cap_hit = true;
        }
        verdict
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.memory_cap_hit = true;
        self.limits.memory_grow_failed(error)
    }

    fn table_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.limits.table_grow_failed(error)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

/// Tells a component from a core module or from anything else, before compiling.
fn check_header(wasm: &[u8]) -> Result<(), PluginInvalid> {
    const MAGIC: &[u8; 4] = b"\0asm";
    // Bytes 4..8: version (2 bytes) and layer (2 bytes): layer 0 is a core module, 1 a component.
    match wasm.get(..8) {
        Some(header) if header.starts_with(MAGIC) => match header[6..8] {
            [0, 0] => Err(PluginInvalid::new(
                "this is a core WebAssembly module, not a component: build the plugin for the \
                 wasm32-wasip2 target (or wrap the module with `wasm-tools component new`)",
            )),
            [1, 0] => Ok(()),
            _ => Err(PluginInvalid::new("unknown WebAssembly layer: not a component")),
        },
        _ => Err(PluginInvalid::new("not a WebAssembly binary (it does not start with \\0asm)")),
    }
}

/// A plugin may import types (the world's records) and nothing else: no functions, no
/// interfaces, no resources. Lists what it imports so its author sees what to remove.
fn check_imports(engine: &Engine, component: &Component) -> Result<(), PluginInvalid> {
    let component_type = component.component_type();
    let forbidden: Vec<&str> = component_type
        .imports(engine)
        .filter(|(_, import)| !matches!(import.ty, ComponentItem::Type(_)))
        .map(|(name, _)| name)
        .collect();
    if forbidden.is_empty() {
        return Ok(());
    }
    const SHOWN: usize = 8;
    let mut names = forbidden.iter().take(SHOWN).copied().collect::<Vec<_>>().join(", ");
    if forbidden.len() > SHOWN {
        names.push_str(&format!(" and {} more", forbidden.len() - SHOWN));
    }
    let hint = if forbidden.iter().any(|name| name.starts_with("wasi:")) {
        " (WASI comes with Rust's std: build the plugin #![no_std], see plugins/README.md)"
    } else {
        ""
    };
    Err(PluginInvalid::new(format!("plugins may import nothing, but this component imports {names}{hint}")))
}

/// A wasmtime error as one short line: its causes joined, cut to a few hundred characters.
pub(crate) fn short_error(error: &wasmtime::Error) -> String {
    let text = error.chain().map(ToString::to_string).collect::<Vec<_>>().join(": ").replace(['\n', '\r', '\t'], " ");
    let mut short: String = text.chars().take(MAX_ERROR_CHARS).collect();
    if short.len() < text.len() {
        short.push('…');
    }
    short
}
