//! Plugins written in JavaScript and Python, over HTTP on the suite's backend: the examples of
//! `plugins/js/` and `plugins/python/` (built by `plugins/build-components.sh`) upload with their
//! `?runtime=` and plan exactly what their Rust originals plan, order after order (the same dry-run
//! plans, the same outcomes, the same refusals); and a hostile JavaScript plugin (an endless loop,
//! a memory grab, a throw) fails only its own orders while another tenant keeps ordering.
//!
//! Every server here keeps compiled plugins in one directory under the target folder, so each
//! component is compiled once per build of the server, not once per test and backend.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::helpers::{component_wasm, plugin_wasm, spawn_app_with, AppOptions, Reply, TenantClient, TestApp};

/// An upload of a JavaScript or Python component may compile for a minute or more (the debug
/// build's Cranelift, a busy machine); then it answers 202 and the status is polled.
const UPLOAD_DEADLINE: Duration = Duration::from_secs(600);

/// How often a hostile order answered 503 (its plan starved of CPU) is asked again.
const STARVED_RETRIES: usize = 4;

/// A server whose compiled plugins live in the suite's shared artifact directory.
async fn server() -> TestApp {
    let cache = concat!(env!("CARGO_TARGET_TMPDIR"), "/plugin-artifacts");
    spawn_app_with(AppOptions::default().env("XDG_CACHE_HOME", cache)).await
}

/// Uploads `wasm` for `runtime` with `config`, waiting out a 202; returns the version.
async fn upload(shop: &TenantClient, wasm: Vec<u8>, runtime: &str, config: &str) -> i64 {
    let request = shop
        .request(reqwest::Method::PUT, "/v1/plugin")
        .header(reqwest::header::CONTENT_TYPE, "application/wasm")
        .query(&[("runtime", runtime), ("config", config)])
        .timeout(UPLOAD_DEADLINE)
        .body(wasm);
    let reply: Reply = crate::helpers::send(request).await;
    let uploaded = match reply.status() {
        201 => reply.json(),
        202 => {
            let location = reply.header("location").unwrap_or_default().to_owned();
            let deadline = Instant::now() + UPLOAD_DEADLINE;
            loop {
                let status = shop.get(&location).await.expect_json(200);
                match status["state"].as_str() {
                    Some("compiling") if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(250)).await
                    }
                    _ => break status,
                }
            }
        }
        status => panic!("uploading a {runtime} plugin answered {status}: {}", reply.text),
    };
    assert_eq!(uploaded["runtime"].as_str().or(Some(runtime)), Some(runtime), "{uploaded}");
    uploaded["version"].as_i64().unwrap_or_else(|| panic!("the {runtime} upload became a version: {uploaded}"))
}

/// A tenant of `app` named `id` running `wasm` for `runtime` with `config`, with `resources`.
async fn tenant_with(
    app: &TestApp,
    id: &str,
    (wasm, runtime): (Vec<u8>, &str),
    config: &str,
    resources: &[(&str, i64)],
) -> TenantClient {
    let tenant = app.create_tenant(id).await;
    for (key, total) in resources {
        tenant.create_resource(key, *total).await;
    }
    upload(&tenant, wasm, runtime, config).await;
    tenant
}

/// What a reply says, without what differs between tenants by construction (the planner's
/// version is 1 for all; reservation ids are random).
fn comparable(reply: &Reply) -> Value {
    let mut body = reply.json();
    if let Some(object) = body.as_object_mut() {
        object.remove("reservation_id");
        object.remove("expires_at");
    }
    json!({"status": reply.status(), "body": body})
}

/// Sends every order to every tenant, dry run first, and asserts each tenant's answers equal
/// the first's (the Rust original's).
async fn assert_same_answers(tenants: &[(&str, TenantClient)], orders: &[Value]) {
    for (n, order) in orders.iter().enumerate() {
        let mut answers = Vec::new();
        for (name, tenant) in tenants {
            let dry = comparable(&tenant.post("/v1/orders/dry-run", order).await);
            let real = comparable(&tenant.order(&format!("k-{n}"), order).await);
            answers.push((*name, dry, real));
        }
        let (first, dry, real) = &answers[0];
        for (name, other_dry, other_real) in &answers[1..] {
            assert_eq!(other_dry, dry, "order {n} {order}: the {name} dry run differs from {first}'s");
            assert_eq!(other_real, real, "order {n} {order}: the {name} answer differs from {first}'s");
        }
    }
}

/// The flash-sale example in Rust, JavaScript and Python: one tenant each on one server, the
/// same SKUs (one of 8 buckets); the same orders give the same plans (bucket order by the user's
/// hash, the per-user limit key) and outcomes: the second piece of a user is refused, an order
/// without a user is refused with the same reason, a multi-line order, a sold-out SKU.
#[tokio::test]
async fn js_and_python_flash_sales_plan_and_answer_like_the_rust_one() {
    let app = server().await;
    let resources = [("sku-a", 100), ("sku-b", 1)];
    let config = "buckets = 1";
    let rust = tenant_with(&app, "fs-rust", (plugin_wasm("flash-sale"), "rust"), config, &resources).await;
    let js = tenant_with(&app, "fs-js", (component_wasm("js-flash-sale"), "js"), config, &resources).await;
    let python =
        tenant_with(&app, "fs-python", (component_wasm("python-flash-sale"), "python"), config, &resources).await;
    let order = |id: &str, user: Option<&str>, lines: &[(&str, i64)]| {
        let lines: Vec<Value> = lines.iter().map(|(k, q)| json!({"key": k, "qty": q})).collect();
        let mut body = json!({"order_id": id, "action": "deduct", "lines": lines});
        if let Some(user) = user {
            body["user_id"] = json!(user);
        }
        body
    };
    let orders = [
        order("o-1", Some("alice"), &[("sku-a", 1)]),
        order("o-2", Some("alice"), &[("sku-a", 1)]),
        order("o-3", None, &[("sku-a", 1)]),
        order("o-4", Some("bob"), &[("sku-a", 1), ("sku-b", 1)]),
        order("o-5", Some("carol"), &[("sku-b", 1)]),
        order("o-6", Some("dave"), &[("sku-a", 2)]),
    ];
    assert_same_answers(&[("rust", rust), ("js", js), ("python", python)], &orders).await;
}

/// The marketplace example in Rust and JavaScript: partial success and the warehouse fallback
/// plan and answer the same.
#[tokio::test]
async fn a_js_marketplace_plans_and_answers_like_the_rust_one() {
    let app = server().await;
    let resources = [("sku-1:east", 1), ("sku-1:central", 5), ("sku-2:east", 1), ("sku-2:central", 1)];
    let config = "fallback = central";
    let rust = tenant_with(&app, "mp-rust", (plugin_wasm("marketplace"), "rust"), config, &resources).await;
    let js = tenant_with(&app, "mp-js", (component_wasm("js-marketplace"), "js"), config, &resources).await;
    let line = |key: &str, qty: i64, warehouse: Option<&str>| match warehouse {
        Some(w) => json!({"key": key, "qty": qty, "attributes": {"warehouse": w}}),
        None => json!({"key": key, "qty": qty}),
    };
    let orders = [
        json!({"order_id": "m-1", "action": "deduct", "lines": [line("sku-1", 1, Some("east")), line("sku-2", 1, Some("east"))]}),
        json!({"order_id": "m-2", "action": "deduct", "lines": [line("sku-1", 2, Some("east")), line("sku-2", 5, None)]}),
        json!({"order_id": "m-3", "action": "reserve", "ttl_seconds": 60, "lines": [line("sku-1", 1, None)]}),
        json!({"order_id": "m-4", "action": "deduct", "lines": [line("sku-3", 1, Some("east"))]}),
    ];
    assert_same_answers(&[("rust", rust), ("js", js)], &orders).await;
}

/// A JavaScript plugin that loops forever, grabs memory without end or throws fails only its
/// own orders (422 plugin_failed, each for its own reason) and leaves nothing behind: another
/// tenant orders throughout without one failure, and the same plugin configured to plan
/// normally then plans.
#[tokio::test]
async fn a_hostile_js_plugin_fails_only_its_own_orders() {
    let app = server().await;
    let honest = app.create_tenant("honest").await;
    honest.create_resource("sku-1", 1_000_000).await;
    let hostile = app.create_tenant("hostile").await;
    hostile.create_resource("sku-1", 100).await;
    let wasm = component_wasm("js-hostile");
    upload(&hostile, wasm.clone(), "js", "plan").await;

    let running = Arc::new(AtomicBool::new(true));
    let background = {
        let (honest, running) = (honest.clone(), Arc::clone(&running));
        tokio::spawn(async move {
            let mut n = 0u64;
            while running.load(Ordering::Relaxed) {
                n += 1;
                let order =
                    json!({"order_id": format!("h-{n}"), "action": "deduct", "lines": [{"key": "sku-1", "qty": 1}]});
                let reply = honest.order(&format!("h-{n}"), &order).await;
                assert_eq!(reply.status(), 201, "the honest tenant's order {n}: {}", reply.text);
            }
            n
        })
    };
    let order = json!({"order_id": "x-1", "action": "deduct", "lines": [{"key": "sku-1", "qty": 1}]});
    let reasons: [(&str, &[&str]); 3] =
        [("loop", &["time limit", "fuel"]), ("memory", &["memory limit"]), ("throw", &["trapped"])];
    for (config, expected) in reasons {
        upload(&hostile, wasm.clone(), "js", config).await;
        // A plan starved of CPU (the machine busy with other tests) is answered 503, retry, by
        // design; asked again, the plugin's own limit answers.
        let mut reply = hostile.order(&format!("x-{config}"), &order).await;
        for _ in 0..STARVED_RETRIES {
            if reply.status() != 503 {
                break;
            }
            reply = hostile.order(&format!("x-{config}"), &order).await;
        }
        assert_eq!(reply.status(), 422, "{config}: {}", reply.text);
        let problem = reply.json();
        assert_eq!(problem["code"], "plugin_failed", "{config}: {problem}");
        let detail = problem["detail"].as_str().unwrap_or_default().to_lowercase();
        assert!(expected.iter().any(|e| detail.contains(e)), "{config}: the reason names it ({expected:?}): {problem}");
    }
    running.store(false, Ordering::Relaxed);
    let served = background.await.expect("the honest tenant's orders all succeeded");
    assert!(served > 0, "the honest tenant ordered while the hostile plugin failed");

    upload(&hostile, wasm, "js", "plan").await;
    hostile.order("x-after", &order).await.expect_json(201);
    assert_eq!(hostile.state("sku-1").await["consumed"], 1, "only the planned order took stock");
}
