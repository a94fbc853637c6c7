//! The plugin host against real components: the example plugins in `plugins/` and the hostile
//! fixtures in `plugins/hostile/`, built by `plugins/build.sh` (once per test run; needs the
//! wasm32-wasip2 target, which the script adds through rustup when it is missing).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::*;
use crate::engine::{DefaultPlanner, Kind, OrderRequest, Planner, TenantId};

/// 2026-11-30T12:00:00Z.
const NOW_MS: i64 = 1_796_040_000_000;

/// The bytes of `plugins/dist/<name>.wasm`, building every plugin first (once per process).
fn wasm(name: &str) -> Vec<u8> {
    static DIST: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let dist = match DIST.get_or_init(build_plugins) {
        Ok(dist) => dist,
        Err(e) => panic!("{e}"),
    };
    let path = dist.join(format!("{name}.wasm"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn build_plugins() -> Result<PathBuf, String> {
    let plugins = Path::new(env!("CARGO_MANIFEST_DIR")).join("plugins");
    let output = Command::new("bash")
        .arg(plugins.join("build.sh"))
        .output()
        .map_err(|e| format!("cannot run plugins/build.sh: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "plugins/build.sh failed (it needs cargo and the wasm32-wasip2 target):\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(plugins.join("dist"))
}

/// One host for the tests that use the default limits, so each component compiles once.
fn shared_host() -> &'static Arc<PluginHost> {
    static HOST: OnceLock<Arc<PluginHost>> = OnceLock::new();
    HOST.get_or_init(|| new_host(PluginLimits::default()))
}

/// A host that compiles on a thread of this test process (the test binary cannot be the
/// compiler child; the HTTP suite covers the child).
fn new_host(limits: PluginLimits) -> Arc<PluginHost> {
    PluginHost::in_process(limits).unwrap_or_else(|e| panic!("{e:#}"))
}

fn block_on<F: std::future::Future>(future: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
    runtime.unwrap_or_else(|e| panic!("{e}")).block_on(future)
}

/// Loads as a tenant of its own, so parallel tests never meet the one-compile-per-tenant rule.
fn load_bytes(host: &Arc<PluginHost>, bytes: &[u8]) -> Result<Arc<LoadedPlugin>, LoadError> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let uploader = TenantId::parse(format!("uploader-{n}")).unwrap_or_else(|e| panic!("{e}"));
    block_on(host.load(&uploader, Arc::from(bytes)))
}

fn load(host: &Arc<PluginHost>, name: &str) -> Arc<LoadedPlugin> {
    load_bytes(host, &wasm(name)).unwrap_or_else(|e| panic!("{name} refused: {e}"))
}

fn order(json: serde_json::Value) -> OrderRequest {
    let body: crate::engine::order::OrderBody = serde_json::from_value(json).unwrap_or_else(|e| panic!("{e}"));
    body.validate(100).unwrap_or_else(|(field, e)| panic!("{field}: {e}"))
}

/// An order of `lines` lines `sku-0`, `sku-1`, ... for user `u-42`.
fn order_of(lines: usize) -> OrderRequest {
    let lines: Vec<_> = (0..lines).map(|i| serde_json::json!({"key": format!("sku-{i}"), "qty": i + 1})).collect();
    order(serde_json::json!({"order_id": "ORD-1", "user_id": "u-42", "action": "deduct", "lines": lines}))
}

fn tenant() -> TenantId {
    TenantId::parse("acme").unwrap_or_else(|e| panic!("{e}"))
}

fn plan_with(
    plugin: &LoadedPlugin,
    order: &OrderRequest,
    config: &str,
    now_ms: i64,
) -> Result<PluginPlan, PluginFailed> {
    plugin.plan(&PlanInput { tenant: &tenant(), order, now_ms, seed: 7, config })
}

fn plan(plugin: &LoadedPlugin, order: &OrderRequest, config: &str) -> PluginPlan {
    plan_with(plugin, order, config, NOW_MS).unwrap_or_else(|e| panic!("plan failed: {e}"))
}

fn resources(line: &PluginLine) -> Vec<&str> {
    line.targets.iter().map(|t| t.resource.as_str()).collect()
}

fn invalid(host: &Arc<PluginHost>, bytes: &[u8]) -> String {
    match load_bytes(host, bytes) {
        Ok(plugin) => panic!("accepted {plugin:?}"),
        Err(LoadError::Invalid(invalid)) => invalid.reason().to_string(),
        Err(other) => panic!("not refused as invalid: {other}"),
    }
}

fn failed(result: Result<PluginPlan, PluginFailed>) -> PluginFailed {
    match result {
        Ok(plan) => panic!("planned {plan:?}"),
        Err(failed) => failed,
    }
}

/// FNV-1a, as the SDK's `stable_hash`, to predict the flash sale's bucket order.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[test]
fn host_and_plugins_can_be_shared_between_threads() {
    // Proves at compile time what the core relies on: one host, plugins used from any thread.
    fn shared<T: Send + Sync>() {}
    shared::<PluginHost>();
    shared::<LoadedPlugin>();
    shared::<Arc<LoadedPlugin>>();
}

#[test]
fn default_plugin_plans_exactly_like_the_native_default() {
    // Proves the `default` example is the built-in planner as a plugin, for 1 and 10 lines.
    let plugin = load(shared_host(), "default");
    for lines in [1, 10] {
        let order = order_of(lines);
        let native = DefaultPlanner.plan(&tenant(), &order, NOW_MS).unwrap_or_else(|e| panic!("{e}"));
        let plan = plan(&plugin, &order, "");
        assert_eq!(plan.policy, PluginPolicy::AllOrNothing);
        // What the core executes: the converted plan equals the native one, line for line.
        let converted = crate::plugin::registry::to_plan(plan, 0, lines).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(converted.policy, native.policy);
        assert_eq!(converted.lines, native.lines);
    }
}

#[test]
fn flash_sale_allows_one_piece_per_user_and_sku_and_spreads_users_over_buckets() {
    // Proves the limit key, the max of 1, the kind and the user-rotated bucket order.
    let plugin = load(shared_host(), "flash-sale");
    let four = plan(&plugin, &order_of(2), "buckets = 4");
    let start = (fnv1a("u-42") % 4) as u16;
    let rotated: Vec<u16> = (0..4).map(|i| (start + i) % 4).collect();
    for (i, line) in four.lines.iter().enumerate() {
        assert_eq!(resources(line), vec![format!("sku-{i}")]);
        assert_eq!(line.targets[0].kind, Some(Kind::Inventory));
        assert_eq!(line.targets[0].buckets, rotated);
        let limit = line.limit.as_ref().map(|l| (l.key.to_string(), l.max));
        assert_eq!(limit, Some((format!("flash:sku-{i}:u-42"), 1)));
    }
    assert_eq!(plan(&plugin, &order_of(1), "").lines[0].targets[0].buckets.len(), 8);

    let anonymous =
        order(serde_json::json!({"order_id": "A", "action": "deduct", "lines": [{"key": "sku-1", "qty": 1}]}));
    let refused = failed(plan_with(&plugin, &anonymous, "", NOW_MS));
    assert!(matches!(&refused, PluginFailed::Refused(r) if r.contains("no user_id")), "{refused}");
    let bad_config = failed(plan_with(&plugin, &order_of(1), "buckets = 5000", NOW_MS));
    assert!(matches!(&bad_config, PluginFailed::Refused(r) if r.contains("buckets")), "{bad_config}");
}

#[test]
fn wallet_pays_from_the_account_balance_in_the_line_currency() {
    // Proves `{account}:{currency}` from the attribute, then the configured default, then EUR.
    let plugin = load(shared_host(), "wallet");
    let order = order(serde_json::json!({"order_id": "PAY-1", "action": "deduct", "lines": [
        {"key": "acct-1", "qty": 1250, "attributes": {"currency": "USD"}},
        {"key": "acct-2", "qty": 99}]}));
    let plan_default = plan(&plugin, &order, "");
    assert_eq!(plan_default.policy, PluginPolicy::AllOrNothing);
    assert_eq!(resources(&plan_default.lines[0]), vec!["acct-1:USD"]);
    assert_eq!(resources(&plan_default.lines[1]), vec!["acct-2:EUR"]);
    assert_eq!(plan_default.lines[0].targets[0].kind, Some(Kind::Balance));
    assert_eq!(plan_default.lines[0].qty.get(), 1250);
    assert_eq!(resources(&plan(&plugin, &order, "currency = CHF").lines[1]), vec!["acct-2:CHF"]);
}

#[test]
fn coupon_claims_campaign_stock_once_per_user() {
    // Proves the campaign resource, the coupon kind and the once-per-user limit.
    let plugin = load(shared_host(), "coupon");
    let order = order(serde_json::json!({"order_id": "C-1", "user_id": "u-7", "action": "reserve",
        "lines": [{"key": "spring-26", "qty": 1}]}));
    let line = &plan(&plugin, &order, "").lines[0];
    assert_eq!(resources(line), vec!["campaign:spring-26"]);
    assert_eq!(line.targets[0].kind, Some(Kind::Coupon));
    assert_eq!(line.limit.as_ref().map(|l| (l.key.as_str(), l.max)), Some(("coupon:spring-26:u-7", 1)));
}

#[test]
fn sms_quota_uses_the_utc_month_of_now_and_creates_it_with_the_allowance() {
    // Proves the period key follows the core's clock across a year boundary, and the allowance.
    let plugin = load(shared_host(), "sms-quota");
    let order =
        order(serde_json::json!({"order_id": "S-1", "action": "deduct", "lines": [{"key": "acct-9", "qty": 3}]}));
    let line = &plan(&plugin, &order, "").lines[0];
    assert_eq!(resources(line), vec!["acct-9:2026-11"]);
    assert_eq!((line.targets[0].kind, line.targets[0].create_if_missing), (Some(Kind::Quota), Some(1000)));
    let new_year_eve_ms = 1_798_761_599_999; // 2026-12-31T23:59:59.999Z
    let at = |now_ms| plan_with(&plugin, &order, "allowance = 500", now_ms).map(|p| p.lines[0].clone());
    let last_ms = at(new_year_eve_ms).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((resources(&last_ms), last_ms.targets[0].create_if_missing), (vec!["acct-9:2026-12"], Some(500)));
    let first_ms = at(new_year_eve_ms + 1).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(resources(&first_ms), vec!["acct-9:2027-01"]);
}

#[test]
fn marketplace_allows_partial_success_and_falls_back_to_another_warehouse() {
    // Proves the policy and the [own warehouse, fallback] target order, without duplicates.
    let plugin = load(shared_host(), "marketplace");
    let order = order(serde_json::json!({"order_id": "M-1", "action": "deduct", "lines": [
        {"key": "sku-1", "qty": 2, "attributes": {"warehouse": "east"}},
        {"key": "sku-2", "qty": 1},
        {"key": "sku-3", "qty": 1, "attributes": {"warehouse": "central"}}]}));
    let plan_default = plan(&plugin, &order, "");
    assert_eq!(plan_default.policy, PluginPolicy::AllowPartial);
    assert_eq!(resources(&plan_default.lines[0]), vec!["sku-1:east", "sku-1:central"]);
    assert_eq!(resources(&plan_default.lines[1]), vec!["sku-2:central"]);
    assert_eq!(resources(&plan_default.lines[2]), vec!["sku-3:central"]);
    let plan_north = plan(&plugin, &order, "fallback = north");
    assert_eq!(resources(&plan_north.lines[0]), vec!["sku-1:east", "sku-1:north"]);
}

#[test]
fn an_endless_loop_runs_out_of_fuel_within_milliseconds() {
    // Proves fuel stops a plugin that never returns, and roughly how long that takes.
    let plugin = load(shared_host(), "hostile-loop");
    let started = Instant::now();
    let failure = failed(plan_with(&plugin, &order_of(1), "", NOW_MS));
    let took = started.elapsed();
    assert_eq!(failure, PluginFailed::OutOfFuel { fuel: PluginLimits::default().fuel_per_call });
    println!("endless loop stopped after {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn a_memory_bomb_is_stopped_at_the_memory_cap() {
    // Proves a plugin allocating without end fails with out-of-memory, not the server.
    let plugin = load(shared_host(), "hostile-memory-bomb");
    let failure = failed(plan_with(&plugin, &order_of(1), "", NOW_MS));
    assert_eq!(failure, PluginFailed::OutOfMemory { limit_bytes: PluginLimits::default().max_memory_bytes });
}

#[test]
fn a_panicking_plugin_fails_with_a_trap() {
    // Proves a guest panic (`unreachable`) is reported as a short trap reason.
    let plugin = load(shared_host(), "hostile-trap");
    let failure = failed(plan_with(&plugin, &order_of(1), "", NOW_MS));
    assert!(matches!(&failure, PluginFailed::Trap(r) if r.contains("unreachable")), "{failure}");
    assert!(failure.to_string().len() < 200);
}

#[test]
fn plans_that_break_the_contract_are_refused() {
    // Proves an out-of-range line index, a negative quantity and a negative limit never reach
    // the core.
    let bad_index = load(shared_host(), "hostile-bad-index");
    let failure = failed(plan_with(&bad_index, &order_of(2), "", NOW_MS));
    assert!(matches!(&failure, PluginFailed::InvalidPlan(r) if r.contains("line 2 is out of range")), "{failure}");
    let negative = load(shared_host(), "hostile-negative");
    let failure = failed(plan_with(&negative, &order_of(1), "", NOW_MS));
    assert!(matches!(&failure, PluginFailed::InvalidPlan(r) if r.starts_with("lines[0].qty -1")), "{failure}");
    let failure = failed(plan_with(&negative, &order_of(1), "field = limit", NOW_MS));
    assert!(matches!(&failure, PluginFailed::InvalidPlan(r) if r.contains("limit.max -1 is negative")), "{failure}");
}

#[test]
fn components_that_import_anything_are_refused_at_load() {
    // Proves "imports nothing it may not": a std plugin reading files imports WASI filesystem.
    let reason = invalid(shared_host(), &wasm("hostile-wasi-fs"));
    assert!(reason.contains("plugins may import nothing"), "{reason}");
    assert!(reason.contains("wasi:"), "{reason}");
    assert!(reason.contains("no_std"), "{reason}");
    assert!(reason.len() < 500, "{reason}");
}

#[test]
fn anything_but_a_planner_component_is_refused_at_load() {
    // Proves core modules, garbage, wrong exports, truncated and oversized files are refused
    // with a reason a plugin author can act on.
    let host = shared_host();
    assert!(invalid(host, &wasm("hostile-core-module")).contains("core WebAssembly module, not a component"));
    assert!(invalid(host, &wasm("hostile-garbage")).contains("not a WebAssembly binary"));
    assert!(invalid(host, b"").contains("not a WebAssembly binary"));
    let wrong = invalid(host, &wasm("hostile-wrong-world"));
    assert!(wrong.contains("does not implement the stockd:plugin/planner@0.1.0 world"), "{wrong}");
    let default = wasm("default");
    let truncated = invalid(host, &default[..default.len() / 2]);
    assert!(truncated.starts_with("the component does not compile"), "{truncated}");
    assert!(truncated.len() < 400, "{truncated}");
    let small = new_host(PluginLimits { max_wasm_bytes: 1000, ..PluginLimits::default() });
    let too_big = invalid(&small, &default);
    assert!(too_big.contains("the limit is 1000 bytes"), "{too_big}");
}

#[test]
fn the_same_bytes_compile_once_and_name_their_sha256() {
    // Proves the sha256 cache shares compiled code but never instances: a second load of the
    // same bytes (another tenant's upload, say) gets its own handle and its own instance pool.
    let bytes = wasm("default");
    let first = load_bytes(shared_host(), &bytes).unwrap_or_else(|e| panic!("{e}"));
    let second = load_bytes(shared_host(), &bytes).unwrap_or_else(|e| panic!("{e}"));
    assert!(!Arc::ptr_eq(&first, &second));
    assert_eq!(first.sha256(), second.sha256());
    use sha2::Digest;
    assert_eq!(first.sha256(), hex::encode(sha2::Sha256::digest(&bytes)));
}

#[test]
fn instances_are_recycled_after_their_calls_and_after_any_failure() {
    // Proves no plugin state outlives `calls_per_instance` calls or a failed call: the
    // counter fixture's quantity is the number of calls its instance has served.
    let host = new_host(PluginLimits { calls_per_instance: 3, max_instances_per_plugin: 1, ..Default::default() });
    let plugin = load(&host, "hostile-counter");
    let order = order_of(1);
    let mut served = Vec::new();
    for _ in 0..5 {
        served.push(plan(&plugin, &order, "").lines[0].qty.get());
    }
    assert_eq!(served, vec![1, 2, 3, 1, 2]);
    let trap =
        self::order(serde_json::json!({"order_id": "trap", "action": "deduct", "lines": [{"key": "k", "qty": 1}]}));
    assert!(matches!(failed(plan_with(&plugin, &trap, "", NOW_MS)), PluginFailed::Trap(_)));
    assert_eq!(plan(&plugin, &order, "").lines[0].qty.get(), 1, "the trapped instance was reused");
}

#[test]
fn a_failing_plugin_leaves_the_host_and_other_plugins_working() {
    // Proves failures are contained: after fuel, memory and trap failures the same host still
    // plans with a good plugin and with the failing plugins' next calls.
    let host = shared_host();
    let good = load(host, "default");
    for name in ["hostile-loop", "hostile-memory-bomb", "hostile-trap"] {
        let bad = load(host, name);
        for _ in 0..3 {
            assert!(plan_with(&bad, &order_of(1), "", NOW_MS).is_err());
            assert_eq!(plan(&good, &order_of(3), "").lines.len(), 3);
        }
    }
}

#[test]
fn many_threads_plan_with_one_plugin_at_once() {
    // Proves concurrent calls on one plugin all succeed and stay correct.
    let plugin = load(shared_host(), "flash-sale");
    std::thread::scope(|scope| {
        for t in 0..4 {
            let plugin = &plugin;
            scope.spawn(move || {
                for i in 0..200 {
                    let order = order(serde_json::json!({"order_id": format!("o-{t}-{i}"),
                        "user_id": format!("user-{t}-{i}"), "action": "deduct",
                        "lines": [{"key": "sku-hot", "qty": 1}]}));
                    let plan = plan(plugin, &order, "");
                    let limit = plan.lines[0].limit.as_ref().map(|l| l.key.to_string());
                    assert_eq!(limit, Some(format!("flash:sku-hot:user-{t}-{i}")));
                }
            });
        }
    });
}

#[test]
fn check_prints_plans_and_fails_only_on_misbehaviour() {
    // Proves the `stockd plugin check` report: valid plugins print their plans (refusals are
    // answers), invalid or misbehaving ones make the check fail.
    let host = shared_host();
    let run = |name: &str, cases: &str| {
        let mut out = Vec::new();
        let result = block_on(check::check_to(&mut out, host, name, &wasm(name), cases, NOW_MS));
        (result, String::from_utf8_lossy(&out).into_owned())
    };
    let samples = check::SAMPLE_CASES;
    let (result, out) = run("flash-sale", samples);
    assert!(result.is_ok(), "{result:?}\n{out}");
    assert!(out.contains("flash-sale: valid stockd plugin"), "{out}");
    // What an author tunes by: the component's shape against the limits, and each plan's fuel
    // against the budget (flash-sale's 2-line sample plan burns ~12,000 of 10 million).
    assert!(out.contains("shape: ") && out.contains("functions (limit 20000)"), "{out}");
    let fuel_lines: Vec<&str> = out.lines().filter(|l| l.trim_start().starts_with("fuel: ")).collect();
    assert_eq!(fuel_lines.len(), 2, "one fuel line per order: {out}");
    assert!(fuel_lines.iter().all(|l| l.contains(" of 10000000 (")), "{out}");
    assert!(out.contains("\"flash:sku-1:u-42\""), "{out}");
    assert!(out.contains("order sample-without-user (1 line): refused:"), "{out}");

    let cases = "config = \"allowance = 7\"\nnow_ms = 1796040000000\n\n[[orders]]\norder_id = \"S\"\naction = \"deduct\"\nlines = [{ key = \"acct-1\", qty = 1 }]\n";
    let (result, out) = run("sms-quota", cases);
    assert!(result.is_ok(), "{result:?}\n{out}");
    assert!(out.contains("\"acct-1:2026-11\"") && out.contains("\"create_if_missing\": 7"), "{out}");

    let (result, out) = run("hostile-trap", samples);
    let error = result.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("failed on 2 of 2 orders"), "{error}\n{out}");
    let (result, _) = run("hostile-garbage", samples);
    assert!(result.err().map(|e| e.to_string()).unwrap_or_default().contains("invalid plugin"));
}

#[test]
fn check_compares_each_answer_with_its_expectation() {
    // Proves `expect` in a cases file: flash-sale's plan and refusal as expected pass, with one
    // line each saying so; a wrong limit key fails the check, naming where the plan differs,
    // while the other orders are still run and reported.
    let host = shared_host();
    let run = |cases: &str| {
        let mut out = Vec::new();
        let result = block_on(check::check_to(&mut out, host, "flash-sale", &wasm("flash-sale"), cases, NOW_MS));
        (result.map_err(|e| e.to_string()), String::from_utf8_lossy(&out).into_owned())
    };
    let cases = |limit_key: &str| {
        format!(
            "config = \"buckets = 2\"\n\n[[orders]]\norder_id = \"A\"\nuser_id = \"u-1\"\naction = \"deduct\"\n\
             lines = [{{ key = \"sku-1\", qty = 1 }}]\n\n[orders.expect]\npolicy = \"all_or_nothing\"\n\
             lines = [{{ line = 0, qty = 1, limit = {{ key = \"{limit_key}\", max = 1 }}, \
             targets = [{{ resource = \"sku-1\", kind = \"inventory\" }}] }}]\n\n\
             [[orders]]\norder_id = \"B\"\naction = \"deduct\"\nlines = [{{ key = \"sku-1\", qty = 1 }}]\n\
             expect = {{ refused = \"has no user_id\" }}\n"
        )
    };
    let (result, out) = run(&cases("flash:sku-1:u-1"));
    assert_eq!(result, Ok(()), "{out}");
    assert_eq!(out.matches("  expect: as expected").count(), 2, "{out}");
    assert!(out.contains("2 orders: 0 failed; 2 with expectations, 0 not met"), "{out}");

    let (result, out) = run(&cases("flash:sku-1:u-2"));
    assert_eq!(result, Err("flash-sale: 1 of 2 orders did not plan as expected".to_owned()), "{out}");
    assert!(
        out.contains(
            "  expect: MISMATCH: plan.lines[0].limit.key: expected \"flash:sku-1:u-2\", the plan has \"flash:sku-1:u-1\""
        ),
        "{out}"
    );
    assert!(out.contains("order B (1 line): refused:"), "the other order still runs: {out}");

    let (result, _) =
        run("[[orders]]\norder_id = \"C\"\naction = \"deduct\"\nlines = [{ key = \"k\", qty = 1 }]\nexpect = 3\n");
    assert!(result.is_err_and(|e| e.contains("invalid cases file")), "a malformed expect is refused");
}

/// Measures the cost of one plan call (conversion, call, validation) for the default plugin,
/// on a live instance and with a fresh instance per call, and proves thousands of calls in a
/// row (through instance recycling) all succeed. For figures worth quoting, run it in release
/// mode with more samples:
/// `STOCKD_PLUGIN_LATENCY_SAMPLES=20000 cargo test --release --lib plugin::tests::plan_call_latency -- --nocapture`.
#[test]
fn plan_call_latency() {
    let fresh_host = new_host(PluginLimits { calls_per_instance: 1, ..PluginLimits::default() });
    let setups =
        [(shared_host(), 1, "live instance"), (shared_host(), 10, "live instance"), (&fresh_host, 1, "fresh instance")];
    for (host, lines, instance) in setups {
        let plugin = load(host, "default");
        let order = order_of(lines);
        let tenant = tenant();
        let input = PlanInput { tenant: &tenant, order: &order, now_ms: NOW_MS, seed: 7, config: "" };
        for _ in 0..200 {
            assert!(plugin.plan(&input).is_ok());
        }
        let samples: usize =
            std::env::var("STOCKD_PLUGIN_LATENCY_SAMPLES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000);
        let mut samples_ns: Vec<u128> = (0..samples.max(1))
            .map(|_| {
                let started = Instant::now();
                let result = plugin.plan(&input);
                let took = started.elapsed().as_nanos();
                assert!(result.is_ok());
                took
            })
            .collect();
        samples_ns.sort_unstable();
        let at =
            |q: f64| samples_ns[((samples_ns.len() as f64 * q) as usize).min(samples_ns.len() - 1)] as f64 / 1000.0;
        println!("default plugin, {lines:>2}-line order, {instance}: p50 {:.2} µs, p99 {:.2} µs", at(0.50), at(0.99));
    }
}

#[test]
fn the_benchs_fuel_burner_burns_between_80_and_100_percent_of_the_default_budget() {
    // Proves the noisy-neighbour bench's plugin is expensive yet legal: configured as the bench
    // configures it, a plan succeeds within the default fuel budget but not within 80% of it.
    let config = crate::bench::noisy::FUEL_BURNER_CONFIG;
    let default_fuel = PluginLimits::default().fuel_per_call;
    let plugin = load(shared_host(), "hostile-fuel-burner");
    let planned = plan(&plugin, &order_of(1), config);
    assert_eq!(resources(&planned.lines[0]), vec!["sku-0"]);

    let tight = PluginLimits { fuel_per_call: default_fuel / 10 * 8, ..PluginLimits::default() };
    let tight_host = new_host(tight);
    let failure = failed(plan_with(&load(&tight_host, "hostile-fuel-burner"), &order_of(1), config, NOW_MS));
    assert_eq!(failure, PluginFailed::OutOfFuel { fuel: default_fuel / 10 * 8 });
}
