//! `stockd plugin check FILE [--cases cases.toml] [--config stockd.toml]`: validates a
//! component exactly as an upload to a server with that configuration would (the same
//! structural checks, the same isolated compile under the same limits), then runs it on
//! sample orders and prints each plan (or why the plugin failed) with the fuel it used
//! against the budget, so a plugin's author can test and tune it before uploading.
//!
//! The cases file is TOML: optional `tenant`, `now_ms`, `seed` and `config` (the tenant's
//! plugin configuration text), and a list of `[[orders]]`, each written exactly like the body
//! of `POST /v1/orders`:
//!
//! ```toml
//! config = "fallback = central"
//! now_ms = 1795000000000
//!
//! [[orders]]
//! order_id = "ORD-1"
//! user_id = "u-42"
//! action = "deduct"
//! lines = [{ key = "sku-1", qty = 2, attributes = { warehouse = "east" } }]
//! ```
//!
//! An order may say what it must produce, in an `expect` table (see [`super::expect`]):
//!
//! ```toml
//! [orders.expect]
//! policy = "all_or_nothing"
//! lines = [{ line = 0, qty = 2, targets = [{ resource = "sku-1:east" }, { resource = "sku-1:central" }] }]
//! ```
//!
//! or `refused = "has no user_id"`. A plugin refusing an order is an answer, not an error; the
//! check fails (non-zero exit) when the component is invalid, when any order makes it trap,
//! run out of fuel or memory, or return a plan the host rejects, and when any answer differs
//! from its order's `expect`.

use std::io::Write;
use std::path::Path;

use anyhow::Context as _;
use serde::Deserialize;

use super::expect::{Answer, Expectation};
use super::host::PluginHost;
use super::limits::{PluginLimits, Runtime};
use super::model::{PlanInput, PluginFailed};
use super::LoadError;
use crate::engine::order::OrderBody;
use crate::engine::{OrderRequest, TenantId};

/// Lines an order may have: the API's own limit.
const MAX_ORDER_LINES: usize = 100;
/// The tenant id plans see unless the cases file names one.
const DEFAULT_TENANT: &str = "check";
/// The seed plans see unless the cases file gives one.
const DEFAULT_SEED: u64 = 42;

/// The orders used when no cases file is given: two lines with the attributes the example
/// plugins read, once with a user id and once without.
pub(crate) const SAMPLE_CASES: &str = r#"
[[orders]]
order_id = "sample-with-user"
user_id = "u-42"
action = "deduct"
lines = [
  { key = "sku-1", qty = 1, attributes = { warehouse = "east", currency = "EUR" } },
  { key = "sku-2", qty = 3 },
]

[[orders]]
order_id = "sample-without-user"
action = "reserve"
lines = [{ key = "sku-1", qty = 2 }]
"#;

/// A cases file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Cases {
    tenant: Option<String>,
    now_ms: Option<i64>,
    seed: Option<u64>,
    #[serde(default)]
    config: String,
    /// Each an order body, plus an optional `expect`: read by [`read_case`].
    orders: Vec<toml::Table>,
}

/// One order of a cases file and what it must produce, if anything.
struct Case {
    order: OrderRequest,
    expect: Option<Expectation>,
}

/// Reads `orders[index]`: the body exactly as `POST /v1/orders` takes it, and its `expect`.
fn read_case(index: usize, mut table: toml::Table) -> anyhow::Result<Case> {
    let expect = table
        .remove("expect")
        .map(Expectation::from_toml)
        .transpose()
        .map_err(|e| anyhow::anyhow!("orders[{index}].expect: {e}"))?;
    let body: OrderBody = toml::Value::Table(table).try_into().with_context(|| format!("orders[{index}]"))?;
    let order = body.validate(MAX_ORDER_LINES).map_err(|(field, e)| anyhow::anyhow!("orders[{index}].{field}: {e}"))?;
    Ok(Case { order, expect })
}

/// Checks the plugin at `path` under `limits` (a server's configured limits) and prints the
/// plans it makes for the orders in `cases`, or for two sample orders. Errors when the plugin
/// is invalid or misbehaves on any order.
pub async fn check(
    path: &Path,
    cases: Option<&Path>,
    runtime: Runtime,
    limits: PluginLimits,
    artifacts: Option<std::sync::Arc<super::ArtifactStore>>,
) -> anyhow::Result<()> {
    let wasm = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let cases_text = match cases {
        Some(file) => std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?,
        None => SAMPLE_CASES.to_string(),
    };
    let shared = super::HostShared::new(limits.max_concurrent_compiles, artifacts)?;
    let host = PluginHost::for_runtime(runtime, limits, shared)?;
    let now_ms = crate::time::now_ms();
    let mut report = Vec::new();
    let result = check_to(&mut report, &host, &path.display().to_string(), &wasm, &cases_text, now_ms).await;
    std::io::stdout().lock().write_all(&report)?;
    result
}

/// The check itself, writing its report to `out`; `now_ms` applies when the cases file has none.
pub(crate) async fn check_to(
    out: &mut (dyn Write + Send),
    host: &std::sync::Arc<PluginHost>,
    name: &str,
    wasm: &[u8],
    cases_text: &str,
    now_ms: i64,
) -> anyhow::Result<()> {
    let limits = host.limits().clone();
    let uploader = TenantId::parse(DEFAULT_TENANT).context("invalid tenant")?;
    let plugin = host.load(&uploader, std::sync::Arc::from(wasm)).await.map_err(|e| match e {
        LoadError::Invalid(invalid) => anyhow::anyhow!("{name}: invalid plugin: {invalid}"),
        other => anyhow::anyhow!("{name}: could not be checked: {other}"),
    })?;
    writeln!(out, "{name}: valid stockd plugin ({} bytes, sha256 {})", wasm.len(), plugin.sha256())?;
    let shape = host.shape(wasm)?;
    let shape_limits = limits.shape;
    writeln!(
        out,
        "shape: {} functions (limit {}), largest body {} bytes (limit {}), most locals {} (limit {}), \
         deepest nesting {} (limit {})",
        shape.functions,
        shape_limits.max_functions,
        shape.largest_body_bytes,
        shape_limits.max_function_body_bytes,
        shape.most_locals,
        shape_limits.max_locals_per_function,
        shape.deepest_blocks,
        shape_limits.max_block_depth,
    )?;

    let cases: Cases = toml::from_str(cases_text).context("invalid cases file")?;
    let tenant = TenantId::parse(cases.tenant.as_deref().unwrap_or(DEFAULT_TENANT)).context("invalid tenant")?;
    let orders = cases
        .orders
        .into_iter()
        .enumerate()
        .map(|(i, table)| read_case(i, table))
        .collect::<anyhow::Result<Vec<Case>>>()
        .context("invalid cases file")?;

    let (mut misbehaved, mut expected, mut unexpected) = (0, 0, 0);
    for Case { order, expect } in &orders {
        let input = PlanInput {
            tenant: &tenant,
            order,
            now_ms: cases.now_ms.unwrap_or(now_ms),
            seed: cases.seed.unwrap_or(DEFAULT_SEED),
            config: &cases.config,
        };
        let lines = order.lines.len();
        write!(out, "order {} ({lines} line{}): ", order.order_id, if lines == 1 { "" } else { "s" })?;
        let (planned, cost) = plugin.plan_measured(&input);
        let answer = match &planned {
            Ok(plan) => {
                writeln!(out, "{}", serde_json::to_string_pretty(plan)?)?;
                Some(Answer::Planned(plan))
            }
            Err(PluginFailed::Refused(reason)) => {
                writeln!(out, "refused: {reason}")?;
                Some(Answer::Refused(reason))
            }
            Err(failed) => {
                misbehaved += 1;
                writeln!(out, "FAILED ({}): {failed}", failed.kind())?;
                None
            }
        };
        let budget = limits.fuel_per_call;
        let share = cost.fuel_used as f64 * 100.0 / budget as f64;
        writeln!(out, "  fuel: {} of {budget} ({share:.1}% of the budget)", cost.fuel_used)?;
        // A misbehaving plugin has already failed the check; its answer is not compared.
        if let (Some(expect), Some(answer)) = (expect, answer) {
            match expect.compare(answer) {
                Ok(()) => {
                    expected += 1;
                    writeln!(out, "  expect: as expected")?;
                }
                Err(difference) => {
                    unexpected += 1;
                    writeln!(out, "  expect: MISMATCH: {difference}")?;
                }
            }
        }
    }
    let total = orders.len();
    let checked = expected + unexpected;
    writeln!(out, "{total} orders: {misbehaved} failed; {checked} with expectations, {unexpected} not met")?;
    anyhow::ensure!(misbehaved == 0, "{name}: the plugin failed on {misbehaved} of {total} orders");
    anyhow::ensure!(unexpected == 0, "{name}: {unexpected} of {total} orders did not plan as expected");
    Ok(())
}
