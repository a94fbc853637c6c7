//! The limits every plugin runs under, and the bounds the host enforces on the plans plugins
//! return. One [`PluginLimits`] per language profile ([`Runtime`]) configures the host that
//! runs that profile's components, for all tenants.

use std::time::Duration;

use super::compile::CompileLimits;
use super::precheck::ShapeLimits;
use crate::engine::MAX_TOTAL;

/// What a plugin may use. The defaults are safe for a shared multi-tenant server; every field
/// is meant to come from configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginLimits {
    /// Largest component accepted by [`super::PluginHost::load`], in bytes. Does not bound
    /// compile time or memory: [`Self::shape`] and [`Self::compile`] do.
    pub max_wasm_bytes: usize,
    /// Structural limits checked before compiling.
    pub shape: ShapeLimits,
    /// How one compile is bounded (it runs in a child process).
    pub compile: CompileLimits,
    /// Compiles running at once in this process.
    pub max_concurrent_compiles: usize,
    /// Time limit of one plan call (and of an instantiation), besides fuel: CPU time, with a
    /// wall-clock backstop of a few times it for a starved call.
    pub plan_timeout: Duration,
    /// Fuel one `plan` call may burn (about one unit per WebAssembly instruction). A fresh
    /// instance gets the same budget again for its instantiation.
    pub fuel_per_call: u64,
    /// Largest linear memory one plugin instance may grow to, in bytes.
    pub max_memory_bytes: usize,
    /// Idle instances kept per loaded plugin, ready for the next call.
    pub max_instances_per_plugin: usize,
    /// Calls one instance serves before it is replaced by a fresh one; `1` gives every call a
    /// fresh instance (no state at all can pass between orders, at ~10 µs per call).
    pub calls_per_instance: u32,
    /// Instances alive at once across all plugins, idle or running. Sizes the pooling
    /// allocator; at most half of it is kept idle, and a call that would need more gets
    /// [`super::PluginFailed::Unavailable`].
    pub max_live_instances: u32,
    /// Compiled plugins remembered by sha256, so loading the same bytes again is free.
    pub max_cached_plugins: usize,
    /// What one instance may hold besides its memory: core instances, memories, tables and
    /// table elements. Sizes the instance pool's slots as well as each store's limits.
    pub instance: InstanceShape,
}

/// The parts of one instance besides its linear memory's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceShape {
    /// Core module instances one component may create.
    pub core_instances: u32,
    /// Linear memories one component may have.
    pub memories: u32,
    /// Tables (function-pointer tables) one component may have.
    pub tables: u32,
    /// Elements one table may hold.
    pub table_elements: usize,
}

impl InstanceShape {
    /// A Rust plugin: one core instance (a few small helper modules allowed for other
    /// toolchains), one memory, a table of a few dozen functions.
    pub const RUST: InstanceShape = InstanceShape { core_instances: 4, memories: 1, tables: 2, table_elements: 10_000 };
}

/// A language profile: which limits a component runs under, chosen at upload
/// (`PUT /v1/plugin?runtime=`) and stored with the version. A JavaScript or Python component
/// carries its language's whole engine (SpiderMonkey, CPython), so it is 100-1,000 times the
/// size of a Rust one and needs far more memory, fuel and compile time; giving every plugin
/// those budgets would widen what a hostile Rust-sized plugin could take.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Deserialize, serde::Serialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Runtime {
    /// `#![no_std]` Rust (or any toolchain of its size): the tight defaults.
    Rust,
    /// JavaScript built with componentize-js (StarlingMonkey).
    Js,
    /// Python built with componentize-py (CPython).
    Python,
}

impl Runtime {
    pub const ALL: [Runtime; 3] = [Runtime::Rust, Runtime::Js, Runtime::Python];

    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::Rust => "rust",
            Runtime::Js => "js",
            Runtime::Python => "python",
        }
    }

    /// The runtime named `name` (as stored and as the API spells it).
    pub fn parse(name: &str) -> Option<Runtime> {
        Runtime::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl std::fmt::Display for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Default for PluginLimits {
    fn default() -> Self {
        Self {
            // Real plugins are 10-100 KiB; 2 MiB leaves room and keeps compile time short.
            max_wasm_bytes: 2 << 20,
            shape: ShapeLimits::default(),
            compile: CompileLimits::default(),
            // One child at a time: however many tenants upload bombs, compiling takes at most
            // one core from the server, for at most the compile deadline each.
            max_concurrent_compiles: 1,
            // A plan takes microseconds and its fuel ~10 ms at most; 100 ms is only reached by
            // work fuel does not count (bulk memory operations) or a machine far overloaded.
            plan_timeout: Duration::from_millis(100),
            // A 10-line plan of the default plugin burns ~17k; an endless loop stops after ~1 ms.
            fuel_per_call: 10_000_000,
            // A Rust plugin starts at ~1.1 MiB (1 MiB stack + data) and needs little more.
            max_memory_bytes: 16 << 20,
            // Enough for the threads that plan concurrently for one tenant on a small host.
            max_instances_per_plugin: 4,
            // Amortizes the ~10 µs instantiation to ~0.1 µs per call while bounding how much
            // state a plugin could carry from one order to the next.
            calls_per_instance: 100,
            // 256 memory slots of 16 MiB + guard: ~12 GiB of address space, no resident memory.
            max_live_instances: 256,
            max_cached_plugins: 256,
            instance: InstanceShape::RUST,
        }
    }
}

impl PluginLimits {
    /// The default limits of a language profile: [`PluginLimits::default`] for Rust; for
    /// JavaScript and Python, budgets measured on the example plugins with room to spare
    /// (docs/PLUGINS-JS-PYTHON.md has the figures).
    pub fn for_runtime(runtime: Runtime) -> PluginLimits {
        let rust = PluginLimits::default();
        let big = PluginLimits {
            max_wasm_bytes: 40 << 20,
            shape: ShapeLimits {
                max_functions: 100_000,
                max_function_body_bytes: 2 << 20,
                max_locals_per_function: 50_000,
                max_block_depth: 2_000,
            },
            compile: CompileLimits {
                timeout: Duration::from_secs(180),
                memory_bytes: 6 << 30,
                cpu: Duration::from_secs(180),
                artifact_bytes: 256 << 20,
            },
            plan_timeout: Duration::from_millis(250),
            // A 100-line plan: 43 million in JavaScript, 11.6 million in Python (measured).
            fuel_per_call: 500_000_000,
            // Instantiated: 9 MiB (JavaScript), 12.3 MiB (Python); neither grew on 100 lines.
            max_memory_bytes: 128 << 20,
            max_instances_per_plugin: 2,
            // Instantiating a whole language runtime costs milliseconds: reuse one for long.
            calls_per_instance: 10_000,
            max_live_instances: 16,
            max_cached_plugins: 16,
            // componentize-py links CPython from 38 core instances; componentize-js uses fewer.
            instance: InstanceShape { core_instances: 64, memories: 4, tables: 8, table_elements: 200_000 },
            ..rust.clone()
        };
        match runtime {
            Runtime::Rust => rust,
            Runtime::Js | Runtime::Python => big,
        }
    }
}

/// Most targets (primary + fallbacks) one planned line may have.
pub const MAX_TARGETS_PER_LINE: usize = 8;
/// Bucket indexes must be below this, and a bucket order may list at most this many.
pub const MAX_BUCKETS: usize = 1024;
/// Largest allowance a plan may create a missing resource with (a resource's largest total).
pub const MAX_CREATE_ALLOWANCE: i64 = MAX_TOTAL;
/// Characters kept of a reason a plugin gives for refusing an order.
pub const MAX_REASON_CHARS: usize = 500;
