//! Tenant plugins: WebAssembly components that plan orders (which resource each line takes
//! from, fallbacks, bucket order, per-user limits, partial success), run by wasmtime.
//!
//! The contract is `wit/stockd-plugin.wit` (world `stockd:plugin/planner@0.1.0`): records in,
//! records out, no imports. [`PluginHost`] owns the one engine every plugin shares; it
//! validates an uploaded component ([`PluginHost::load`]: size, a component and not a core
//! module, implements the world, imports nothing), compiles it once per sha256 and hands out
//! an [`Arc<LoadedPlugin>`]. [`LoadedPlugin::plan`] runs the plugin on one order, bounded in
//! fuel and memory, and validates every index, key and number it returns before the core
//! sees them. A plugin that traps, runs out of fuel or memory, refuses the order or returns a
//! bad plan fails that call only ([`PluginFailed`]); its instance is thrown away and the host
//! carries on. [`check`] is the `stockd plugin check` command, [`scaffold`] `stockd plugin new`.
//!
//! Example plugins and hostile test fixtures live in `plugins/` (see `plugins/README.md`);
//! `plugins/build.sh` builds them into `plugins/dist/`.

pub mod artifacts;
mod bindings;
pub mod check;
pub mod compile;
mod convert;
mod expect;
mod host;
mod limits;
mod model;
pub mod pool;
pub mod precheck;
pub mod registry;
pub mod scaffold;
pub mod stored;

#[cfg(test)]
mod tests;

pub use artifacts::ArtifactStore;
pub use check::check;
pub use compile::CompileLimits;
pub use host::{CallCost, HostShared, LoadedPlugin, PluginHost};
pub use limits::{InstanceShape, PluginLimits, Runtime};
pub use model::{
    LoadError, PlanInput, PluginFailed, PluginInvalid, PluginLine, PluginPlan, PluginPolicy, PluginTarget, UserLimit,
};
pub use pool::{PlanPool, PoolError, PoolSettings};
pub use precheck::{Shape, ShapeLimits};
pub use registry::{Active, PlanFailure, Registry};
