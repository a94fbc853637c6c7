//! The wasmtime side: one engine for every plugin, a linker that provides nothing, compiled
//! components cached by sha256, and per plugin a small pool of live instances so a call costs
//! a fraction of a microsecond instead of an instantiation.
//!
//! Isolation: each instance has its own `Store` (memory capped by [`StoreLimits`], fuel reset
//! to the budget before every call). An instance serves at most
//! [`PluginLimits::calls_per_instance`] calls and is thrown away after any failure, so a trap
//! or a half-finished call never leaves state behind for the next order.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use sha2::{Digest, Sha256};
use wasmtime::component::{types::ComponentItem, Component, Linker};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, OptLevel, PoolingAllocationConfig, ResourceLimiter, Store, StoreLimits,
    StoreLimitsBuilder, Trap,
};

use super::bindings::{Planner, PlannerPre};
use super::convert;
use super::limits::PluginLimits;
use super::model::{PlanInput, PluginFailed, PluginInvalid, PluginPlan};

/// WebAssembly's page size: memory limits are rounded up to whole pages.
const WASM_PAGE_BYTES: usize = 64 << 10;
/// Native stack a plugin may use. wasmtime's default; deep recursion traps cleanly.
const MAX_WASM_STACK_BYTES: usize = 512 << 10;
/// Core module instances one component may create. A Rust plugin has one; components built
/// by other toolchains may add a few small helper modules.
const CORE_INSTANCES_PER_COMPONENT: u32 = 4;
/// Linear memories one plugin may have: Rust (and every toolchain without WASI) uses one.
const MEMORIES_PER_COMPONENT: u32 = 1;
/// Tables (function-pointer tables) one plugin may have.
const TABLES_PER_COMPONENT: u32 = 2;
/// Elements one table may hold: Rust plugins use a few dozen.
const MAX_TABLE_ELEMENTS: usize = 10_000;
/// Characters kept of a wasmtime error message shown to a plugin author.
const MAX_ERROR_CHARS: usize = 300;

/// Loads, validates and runs tenant plugins. One per process; cheap to share by reference.
pub struct PluginHost {
    engine: Engine,
    /// Built once, empty on purpose: a plugin may import nothing.
    linker: Linker<CallState>,
    limits: PluginLimits,
    cache: Mutex<Cache>,
    budget: Arc<InstanceBudget>,
}

/// Compiled plugins by sha256, oldest first for eviction. Only the compiled, pre-linked code is
/// shared: every `load` gets its own instance pool, so two tenants uploading the same bytes
/// never share an instance (or anything an instance remembers).
#[derive(Default)]
struct Cache {
    by_sha256: HashMap<[u8; 32], PlannerPre<CallState>>,
    order: VecDeque<[u8; 32]>,
}

/// A validated, compiled plugin, ready to plan, with its own pool of live instances. Shared
/// by every request of the tenant (and version) that loaded it, never across tenants.
pub struct LoadedPlugin {
    sha256: [u8; 32],
    engine: Engine,
    /// Imports resolved and exports type-checked once, at load.
    pre: PlannerPre<CallState>,
    limits: PluginLimits,
    idle: Mutex<Vec<LiveInstance>>,
    budget: Arc<InstanceBudget>,
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

impl PluginHost {
    /// Builds the shared engine. Fails only on a configuration wasmtime cannot run (for
    /// example, no address space for the instance pool).
    pub fn new(limits: PluginLimits) -> anyhow::Result<PluginHost> {
        anyhow::ensure!(limits.max_live_instances >= 2, "plugin max_live_instances must be at least 2");
        anyhow::ensure!(limits.calls_per_instance >= 1, "plugin calls_per_instance must be at least 1");
        anyhow::ensure!(limits.fuel_per_call >= 1, "plugin fuel_per_call must be at least 1");
        let max_memory_bytes = limits.max_memory_bytes.div_ceil(WASM_PAGE_BYTES).max(1) * WASM_PAGE_BYTES;
        let live = limits.max_live_instances;

        let mut pool = PoolingAllocationConfig::new();
        // Every live instance takes one slot of each kind below; `InstanceBudget` keeps the
        // number of live instances at or under `live`, so the pool is never exhausted.
        pool.total_component_instances(live)
            .total_core_instances(live.saturating_mul(CORE_INSTANCES_PER_COMPONENT))
            .max_core_instances_per_component(CORE_INSTANCES_PER_COMPONENT)
            .total_memories(live.saturating_mul(MEMORIES_PER_COMPONENT))
            .max_memories_per_component(MEMORIES_PER_COMPONENT)
            .max_memories_per_module(MEMORIES_PER_COMPONENT)
            .total_tables(live.saturating_mul(TABLES_PER_COMPONENT))
            .max_tables_per_component(TABLES_PER_COMPONENT)
            .max_tables_per_module(TABLES_PER_COMPONENT)
            .table_elements(MAX_TABLE_ELEMENTS)
            // The memory cap, enforced by the pool's slots as well as by each store's limits.
            .max_memory_size(max_memory_bytes);

        let mut config = Config::new();
        config
            .wasm_component_model(true)
            // Plugins are synchronous: no component-model async, no per-store async state.
            .concurrency_support(false)
            // Fuel bounds a call's work deterministically (same plugin, same input, same
            // verdict), with no timer thread; `fuel_per_call` is the budget.
            .consume_fuel(true)
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
        let engine = Engine::new(&config).map_err(|e| anyhow::anyhow!("plugin engine: {e:#}"))?;
        let linker = Linker::new(&engine);

        let live = usize::try_from(live)?;
        let budget = Arc::new(InstanceBudget {
            live: AtomicUsize::new(0),
            idle: AtomicUsize::new(0),
            max_live: live,
            max_idle: live / 2,
        });
        Ok(PluginHost { engine, linker, limits, cache: Mutex::default(), budget })
    }

    /// The limits this host runs plugins under.
    pub fn limits(&self) -> &PluginLimits {
        &self.limits
    }

    /// Validates and compiles an uploaded component: within the size limit, a component (not
    /// a core module), imports nothing, exports the `planner` world, and instantiates within
    /// the memory and fuel limits. The same bytes load once; later loads return the cached
    /// plugin. CPU-heavy on a cache miss (compilation): call it from a blocking thread.
    pub fn load(&self, wasm: &[u8]) -> Result<Arc<LoadedPlugin>, PluginInvalid> {
        if wasm.len() > self.limits.max_wasm_bytes {
            return Err(PluginInvalid::new(format!(
                "the plugin is {} bytes; the limit is {} bytes",
                wasm.len(),
                self.limits.max_wasm_bytes
            )));
        }
        check_header(wasm)?;
        let sha256: [u8; 32] = Sha256::digest(wasm).into();
        if let Some(pre) = self.cache().by_sha256.get(&sha256) {
            return Ok(Arc::new(self.with_own_pool(sha256, pre.clone())));
        }

        let component = Component::new(&self.engine, wasm)
            .map_err(|e| PluginInvalid::new(format!("the component does not compile: {}", short_error(&e))))?;
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
        let plugin = self.with_own_pool(sha256, pre.clone());
        // One real instantiation now: a plugin whose memory, tables or start-up work exceed
        // the limits is refused at upload, not on its first order. The instance is kept.
        let first = plugin.instantiate().map_err(|failed| {
            PluginInvalid::new(format!("the component cannot be instantiated within the limits: {failed}"))
        })?;
        plugin.give_back(first);

        let mut cache = self.cache();
        if !cache.by_sha256.contains_key(&sha256) {
            while cache.order.len() >= self.limits.max_cached_plugins.max(1) {
                if let Some(oldest) = cache.order.pop_front() {
                    // Holders of the evicted plugin keep using it; only the cache forgets it.
                    cache.by_sha256.remove(&oldest);
                }
            }
            cache.by_sha256.insert(sha256, pre);
            cache.order.push_back(sha256);
        }
        Ok(Arc::new(plugin))
    }

    /// A plugin handle over compiled code, with an empty instance pool of its own.
    fn with_own_pool(&self, sha256: [u8; 32], pre: PlannerPre<CallState>) -> LoadedPlugin {
        LoadedPlugin {
            sha256,
            engine: self.engine.clone(),
            pre,
            limits: self.limits.clone(),
            idle: Mutex::default(),
            budget: Arc::clone(&self.budget),
        }
    }

    fn cache(&self) -> MutexGuard<'_, Cache> {
        // The cache is only ever changed in single, complete steps: a panic elsewhere while
        // it was locked cannot have left it half-updated.
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl LoadedPlugin {
    /// The sha256 of the component's bytes, as lowercase hex.
    pub fn sha256(&self) -> String {
        hex::encode(self.sha256)
    }

    /// Runs the plugin on one order and validates its plan. Synchronous and CPU-bound
    /// (typically a microsecond or two, never more than the fuel budget): call it from a
    /// blocking or writer thread. Safe to call from many threads at once.
    pub fn plan(&self, input: &PlanInput<'_>) -> Result<PluginPlan, PluginFailed> {
        let (order, context) = convert::to_wit(input);
        let mut instance = match self.take_idle() {
            Some(instance) => instance,
            None => self.instantiate()?,
        };
        self.refuel(&mut instance.store)?;
        instance.calls += 1;
        // On any failure below the instance is dropped, never returned to the pool.
        let plan = match instance.planner.call_plan(&mut instance.store, &order, &context) {
            Ok(Ok(plan)) => plan,
            Ok(Err(reason)) => return Err(PluginFailed::Refused(convert::bounded_reason(&reason))),
            Err(error) => return Err(self.classify(&error, instance.store.data())),
        };
        let plan = convert::from_wit(plan, input.order.lines.len()).map_err(PluginFailed::InvalidPlan)?;
        self.give_back(instance);
        Ok(plan)
    }

    /// A fresh instance in a fresh store.
    fn instantiate(&self) -> Result<LiveInstance, PluginFailed> {
        let slot = LiveSlot::take(&self.budget)
            .ok_or_else(|| PluginFailed::Unavailable("too many plugin calls in flight; try again".into()))?;
        let state = CallState {
            limits: StoreLimitsBuilder::new()
                .memory_size(self.limits.max_memory_bytes)
                .table_elements(MAX_TABLE_ELEMENTS)
                .instances(CORE_INSTANCES_PER_COMPONENT as usize)
                .memories(MEMORIES_PER_COMPONENT as usize)
                .tables(TABLES_PER_COMPONENT as usize)
                // Hitting the cap stops the plugin at once instead of letting its allocator
                // fail and limp on.
                .trap_on_grow_failure(true)
                .build(),
            memory_cap_hit: false,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|state| state);
        self.refuel(&mut store)?;
        let planner = self.pre.instantiate(&mut store).map_err(|error| self.classify(&error, store.data()))?;
        Ok(LiveInstance { store, planner, calls: 0, _slot: slot })
    }

    fn refuel(&self, store: &mut Store<CallState>) -> Result<(), PluginFailed> {
        // Fails only if the engine had fuel disabled, which `PluginHost::new` never does.
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
            Some(Trap::UnreachableCodeReached) => {
                PluginFailed::Trap("reached `unreachable` (a panic in a Rust plugin)".into())
            }
            Some(trap) => PluginFailed::Trap(trap.to_string()),
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
fn short_error(error: &wasmtime::Error) -> String {
    let text = error.chain().map(ToString::to_string).collect::<Vec<_>>().join(": ").replace(['\n', '\r', '\t'], " ");
    let mut short: String = text.chars().take(MAX_ERROR_CHARS).collect();
    if short.len() < text.len() {
        short.push('…');
    }
    short
}
