//! Tenant WebAssembly plugins over HTTP: upload, versions, activation and rollback; each example
//! plugin of `plugins/` planning real orders (flash sale, wallet, coupon, SMS quota,
//! marketplace); hostile fixtures failing only their own request while other tenants carry on;
//! no plugin state passing between tenants; and hot swaps under load.
//!
//! The components are built by `plugins/build.sh`, run once per test process by
//! `helpers::plugin_wasm`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::Barrier;

use crate::helpers::{
    assert_client_problem, assert_counts, assert_problem, deduct, entries_with_op, ops, plugin_wasm, reserve,
    spawn_app, spawn_app_with, unique, AppOptions, Reply, TenantClient,
};

/// A hostile plugin must be stopped well within this (fuel stops a loop within milliseconds).
const HOSTILE_DEADLINE: Duration = Duration::from_secs(10);
/// How long the hot-swap clients keep ordering in total.
const HOT_SWAP_LOAD: Duration = Duration::from_secs(2);
/// Bound for waiting on the background expiry of a reservation.
const EXPIRY_DEADLINE: Duration = Duration::from_secs(20);
/// Sweeping every 200 ms keeps expiry quick in tests.
const FAST_SWEEP: &str = "[reservations]\nsweep_interval_ms = 200";
/// The configured maximum component size (2 MiB).
const MAX_WASM_BYTES: usize = 2 << 20;
/// The longest configuration text an upload may carry.
const MAX_CONFIG_BYTES: usize = 4096;

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Uploads `plugins/dist/<name>.wasm` (with optional configuration text), asserts the 201 and
/// returns the new version.
async fn upload(shop: &TenantClient, name: &str, config: Option<&str>) -> i64 {
    let wasm = plugin_wasm(name);
    let reply = match config {
        Some(config) => shop.put_plugin_config(wasm.clone(), config).await,
        None => shop.put_plugin(wasm.clone()).await,
    };
    let body = reply.expect_json(201);
    assert_eq!(body["active"], true, "an upload is active at once: {body}");
    assert_eq!(body["sha256"], sha256_hex(&wasm), "sha256 of the uploaded bytes: {body}");
    body["version"].as_i64().unwrap_or_else(|| panic!("version is an integer: {body}"))
}

/// The `plugin` field of an order document planned by uploaded version `version`.
fn wasm_ref(version: i64) -> Value {
    json!({"name": "wasm", "version": version})
}

/// The `plugin` field of an order document planned by the built-in default.
fn builtin_ref() -> Value {
    json!({"name": "default", "version": 0})
}

/// `GET /v1/plugin` when the built-in default is active.
fn builtin_active() -> Value {
    json!({"version": 0, "sha256": null, "runtime": null, "uploaded_at": null, "name": "default"})
}

/// One order line without attributes.
fn line(key: &str, qty: i64) -> Value {
    json!({"key": key, "qty": qty})
}

/// One order line with attributes.
fn line_with(key: &str, qty: i64, attributes: &[(&str, &str)]) -> Value {
    let attributes: serde_json::Map<String, Value> =
        attributes.iter().map(|(name, value)| ((*name).to_owned(), json!(value))).collect();
    json!({"key": key, "qty": qty, "attributes": attributes})
}

/// An order body with an optional user.
fn order_body(order_id: &str, user: Option<&str>, action: &str, lines: Vec<Value>) -> Value {
    let mut body = json!({"order_id": order_id, "action": action, "lines": lines});
    if let Some(user) = user {
        body["user_id"] = json!(user);
    }
    body
}

/// Sends an order under a fresh idempotency key.
async fn place(shop: &TenantClient, body: &Value) -> Reply {
    shop.order(&unique("idem"), body).await
}

/// Asserts a `422 plugin_failed` problem with a non-empty reason; returns the problem.
#[track_caller]
fn assert_plugin_failed(reply: &Reply) -> Value {
    let problem = assert_problem(reply, 422, "plugin_failed");
    assert!(
        problem["detail"].as_str().is_some_and(|d| !d.trim().is_empty()),
        "plugin_failed carries a reason in detail: {problem}"
    );
    problem
}

/// Asserts a `422 plugin_invalid` problem with a non-empty reason; returns the reason.
#[track_caller]
fn assert_plugin_invalid(reply: &Reply, what: &str) -> String {
    let problem = assert_problem(reply, 422, "plugin_invalid");
    let detail = problem["detail"].as_str().unwrap_or_default().to_owned();
    assert!(!detail.trim().is_empty(), "{what}: plugin_invalid carries a reason in detail: {problem}");
    detail
}

/// Asserts a rejected (409) order whose line `index` failed for `reason`; returns the document.
#[track_caller]
fn assert_line_rejected(reply: &Reply, index: usize, reason: &str) -> Value {
    let doc = reply.expect_json(409);
    assert_eq!(doc["status"], "rejected", "{doc}");
    assert_eq!(doc["lines"][index]["status"], "rejected", "{doc}");
    assert_eq!(doc["lines"][index]["reason"], reason, "{doc}");
    assert_eq!(doc["lines"][index]["applied"], 0, "{doc}");
    doc
}

/// Places the order and asserts it was rejected because the user's limit is used up.
async fn assert_over_limit(shop: &TenantClient, body: &Value) -> Value {
    assert_line_rejected(&place(shop, body).await, 0, "limit_exceeded")
}

/// `GET /v1/reconciliation` found no drift (limit counters may or may not be counted among the
/// checked resources, so only the drift is asserted).
async fn assert_no_drift(shop: &TenantClient) {
    let report = shop.get("/v1/reconciliation").await.expect_json(200);
    assert_eq!(report["drift"], json!([]), "reconciliation report: {report}");
}

/// The `version` of a resource state.
async fn resource_version(shop: &TenantClient, key: &str) -> i64 {
    let state = shop.state(key).await;
    state["version"].as_i64().unwrap_or_else(|| panic!("version is an integer: {state}"))
}

/// Asserts an RFC 3339 timestamp within a minute of now.
#[track_caller]
fn assert_recent(value: &Value) {
    let text = value.as_str().unwrap_or_else(|| panic!("uploaded_at is a string, got {value}"));
    let at = chrono::DateTime::parse_from_rfc3339(text).unwrap_or_else(|e| panic!("{text:?} is not RFC 3339: {e}"));
    let age = chrono::Utc::now().signed_duration_since(at.with_timezone(&chrono::Utc));
    assert!(age.num_seconds().abs() < 60, "uploaded_at {text} is now-ish");
}

/// Asserts the active plugin is uploaded version `version` with these bytes.
async fn assert_active(shop: &TenantClient, version: i64, wasm: &[u8]) {
    let active = shop.get("/v1/plugin").await.expect_json(200);
    assert_eq!(active["version"], version, "{active}");
    assert_eq!(active["sha256"], sha256_hex(wasm), "{active}");
    assert_eq!(active["name"], "wasm", "{active}");
    assert_recent(&active["uploaded_at"]);
}

/// `(version, active)` of every item of `GET /v1/plugin/versions`, asserting the page shape.
async fn versions(shop: &TenantClient) -> Vec<(i64, bool)> {
    let page = shop.get("/v1/plugin/versions").await.expect_json(200);
    assert_eq!(page["next_after"], Value::Null, "{page}");
    let items = page["items"].as_array().unwrap_or_else(|| panic!("items is an array: {page}"));
    items
        .iter()
        .map(|item| {
            assert!(item["sha256"].as_str().is_some_and(|s| s.len() == 64), "sha256 is hex: {item}");
            assert_recent(&item["uploaded_at"]);
            (
                item["version"].as_i64().unwrap_or_else(|| panic!("version is an integer: {item}")),
                item["active"].as_bool().unwrap_or_else(|| panic!("active is a bool: {item}")),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Upload, versions, activation
// ---------------------------------------------------------------------------------------------

/// Proves the plugin lifecycle: without an upload the built-in default is active; each upload
/// gets the next version (1, 2, 3, identical bytes included) and is active at once; versions
/// are listed oldest first with exactly one active; activating an older version rolls back,
/// version 0 goes back to the built-in default, a newer one rolls forward, and an unknown
/// version is 404 changing nothing. Each order (and ledger row) names the version that planned
/// it.
#[tokio::test]
async fn upload_get_list_activate_and_roll_back() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;

    assert_eq!(shop.get("/v1/plugin").await.expect_json(200), builtin_active());
    assert_eq!(shop.get("/v1/plugin/versions").await.expect_json(200), json!({"items": [], "next_after": null}));

    let default_wasm = plugin_wasm("default");
    let flash_wasm = plugin_wasm("flash-sale");
    assert_eq!(upload(&shop, "default", None).await, 1);
    assert_active(&shop, 1, &default_wasm).await;
    assert_eq!(versions(&shop).await, [(1, true)]);

    assert_eq!(upload(&shop, "flash-sale", Some("buckets=1")).await, 2);
    assert_active(&shop, 2, &flash_wasm).await;
    let page = shop.get("/v1/plugin/versions").await.expect_json(200);
    assert_eq!(page["items"][0]["sha256"], sha256_hex(&default_wasm), "{page}");
    assert_eq!(page["items"][1]["sha256"], sha256_hex(&flash_wasm), "{page}");
    assert_eq!(versions(&shop).await, [(1, false), (2, true)]);

    // Version 2 (flash sale) plans: a user id is required.
    let anonymous = |id: &str| order_body(id, None, "deduct", vec![line("sku-1", 1)]);
    assert_plugin_failed(&place(&shop, &anonymous("ORD-v2")).await);
    let planned_by_v2 = order_body("ORD-v2u", Some("u-1"), "deduct", vec![line("sku-1", 1)]);
    let first = shop.order("idem-v2u", &planned_by_v2).await;
    assert_eq!(first.expect_json(201)["plugin"], wasm_ref(2));

    // Roll back to version 1 (default wasm): anonymous orders work again.
    let activated = shop.activate_plugin(1).await.expect_json(200);
    assert_eq!(activated["version"], 1, "{activated}");
    assert_eq!(activated["sha256"], sha256_hex(&default_wasm), "{activated}");
    assert_eq!(activated["active"], true, "{activated}");
    assert_active(&shop, 1, &default_wasm).await;
    assert_eq!(versions(&shop).await, [(1, true), (2, false)]);
    assert_eq!(place(&shop, &anonymous("ORD-v1")).await.expect_json(201)["plugin"], wasm_ref(1));
    // A replay answers the stored outcome, planned by version 2, and applies nothing.
    let replay = shop.order("idem-v2u", &planned_by_v2).await;
    assert!(replay.replayed(), "a replay: {:?}", replay.headers);
    assert_eq!((replay.status(), replay.json()), (201, first.json()));

    // Version 0: the built-in default.
    let activated_builtin = shop.activate_plugin(0).await.expect_json(200);
    assert_eq!(activated_builtin["version"], 0, "{activated_builtin}");
    assert_eq!(activated_builtin["active"], true, "{activated_builtin}");
    assert_eq!(shop.get("/v1/plugin").await.expect_json(200), builtin_active());
    assert_eq!(versions(&shop).await, [(1, false), (2, false)]);
    assert_eq!(place(&shop, &anonymous("ORD-v0")).await.expect_json(201)["plugin"], builtin_ref());

    // Roll forward to version 2.
    assert_eq!(shop.activate_plugin(2).await.expect_json(200)["version"], 2);
    assert_active(&shop, 2, &flash_wasm).await;
    assert_plugin_failed(&place(&shop, &anonymous("ORD-v2-again")).await);

    // Unknown versions: 404, nothing changes.
    for unknown in [3, 99] {
        assert_problem(&shop.activate_plugin(unknown).await, 404, "plugin_version_not_found");
    }
    assert_active(&shop, 2, &flash_wasm).await;
    assert_eq!(versions(&shop).await, [(1, false), (2, true)]);

    // Identical bytes still make a new version; numbering goes on.
    assert_eq!(upload(&shop, "default", None).await, 3);
    assert_eq!(versions(&shop).await, [(1, false), (2, false), (3, true)]);
    assert_eq!(place(&shop, &anonymous("ORD-v3")).await.expect_json(201)["plugin"], wasm_ref(3));

    // The ledger names the planner of every applied order: v2, v1, built-in, v3.
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    let planned_by: Vec<&Value> = entries_with_op(&ledger, "deduct").iter().map(|e| &e["plugin_version"]).collect();
    assert_eq!(planned_by, [&json!(2), &json!(1), &json!(0), &json!(3)], "{ledger:?}");
    assert_counts(&shop.state("sku-1").await, 96, 0, 4, 100);

    // Checked last so that the rest runs whatever it says: the built-in has no sha256, so
    // activating it answers `null`, as GET /v1/plugin does.
    assert_eq!(activated_builtin["sha256"], Value::Null, "activate 0: {activated_builtin}");
}

/// Proves an upload must say `Content-Type: application/wasm`: any other type (or none) is
/// `415 unsupported_media_type` and stores nothing.
#[tokio::test]
async fn upload_without_application_wasm_is_415() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let wasm = plugin_wasm("default");
    for content_type in [Some("application/octet-stream"), Some("application/json"), Some("text/plain"), None] {
        let reply = shop.put_plugin_with(wasm.clone(), content_type, None).await;
        assert_problem(&reply, 415, "unsupported_media_type");
    }
    assert_eq!(shop.get("/v1/plugin").await.expect_json(200), builtin_active());
    assert_eq!(versions(&shop).await, Vec::<(i64, bool)>::new());
}

/// Proves invalid components are refused with `422 plugin_invalid` and a reason: bytes that are
/// not WebAssembly, a core module, a component of the wrong world, a component importing WASI
/// (filesystem). An oversized upload is `413 payload_too_large`, an oversized configuration a
/// client error. None of them is stored or takes a version number: the active plugin and the
/// version list are unchanged and the next good upload is version 2.
#[tokio::test]
async fn invalid_uploads_are_refused_and_change_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let good = plugin_wasm("default");
    assert_eq!(upload(&shop, "default", None).await, 1);

    for name in ["hostile-garbage", "hostile-core-module", "hostile-wrong-world", "hostile-wasi-fs"] {
        let detail = assert_plugin_invalid(&shop.put_plugin(plugin_wasm(name)).await, name);
        if name == "hostile-wasi-fs" {
            assert!(detail.to_ascii_lowercase().contains("wasi"), "the reason names the WASI import: {detail}");
        }
        assert_active(&shop, 1, &good).await;
        assert_eq!(versions(&shop).await, [(1, true)], "after {name}");
    }

    // A component header followed by padding: exactly 2 MiB is within the size limit (and then
    // refused because it does not compile), one byte more is too large.
    let mut padded = b"\0asm\x0d\0\x01\0".to_vec();
    padded.resize(MAX_WASM_BYTES, 0);
    assert_plugin_invalid(&shop.put_plugin(padded.clone()).await, "2 MiB of padding");
    padded.push(0);
    let headers = [("Content-Type", "application/wasm")];
    let reply = shop.send_over_raw_tcp("PUT", "/v1/plugin", &headers, padded).await;
    assert_problem(&reply, 413, "payload_too_large");

    // A configuration text over 4096 bytes.
    let config = "x".repeat(MAX_CONFIG_BYTES + 1);
    assert_client_problem(&shop.put_plugin_config(good.clone(), &config).await);

    assert_active(&shop, 1, &good).await;
    assert_eq!(versions(&shop).await, [(1, true)]);
    // The longest allowed configuration is fine.
    let config = format!("fallback=central\n#{}", "x".repeat(MAX_CONFIG_BYTES - "fallback=central\n#".len()));
    assert_eq!(shop.put_plugin_config(good.clone(), &config).await.expect_json(201)["version"], 2);
}

/// Proves plugin versions are per tenant: B does not see A's versions, cannot activate them
/// (404, exactly as an unknown version), keeps its built-in default and counts its own versions
/// from 1; A's plugin is unchanged by all of it.
#[tokio::test]
async fn plugin_versions_are_per_tenant() {
    let app = spawn_app().await;
    let a = app.create_tenant("tenant-a").await;
    let b = app.create_tenant("tenant-b").await;
    b.create_resource("sku-1", 10).await;
    assert_eq!(upload(&a, "default", None).await, 1);
    assert_eq!(upload(&a, "flash-sale", None).await, 2);

    assert_eq!(b.get("/v1/plugin/versions").await.expect_json(200), json!({"items": [], "next_after": null}));
    let unknown = b.activate_plugin(7).await;
    assert_problem(&unknown, 404, "plugin_version_not_found");
    for version in [1, 2] {
        let reply = b.activate_plugin(version).await;
        assert_problem(&reply, 404, "plugin_version_not_found");
        assert_eq!(reply.json(), unknown.json(), "A's version {version} looks exactly like an unknown one");
    }
    assert_eq!(b.get("/v1/plugin").await.expect_json(200), builtin_active());
    let doc = place(&b, &deduct("ORD-1", &[("sku-1", 1)])).await.expect_json(201);
    assert_eq!(doc["plugin"], builtin_ref());

    assert_eq!(upload(&b, "default", None).await, 1, "B counts its own versions");
    assert_eq!(versions(&b).await, [(1, true)]);
    assert_eq!(versions(&a).await, [(1, false), (2, true)]);
    assert_active(&a, 2, &plugin_wasm("flash-sale")).await;
}

// ---------------------------------------------------------------------------------------------
// The default plugin as wasm
// ---------------------------------------------------------------------------------------------

/// An order document with the fields that legitimately differ between two tenants removed:
/// the planner, and the reservation id (random) and expiry (clock) replaced by their presence.
fn comparable(mut doc: Value) -> Value {
    if let Some(object) = doc.as_object_mut() {
        object.remove("plugin");
        for field in ["reservation_id", "expires_at"] {
            let present = object.get(field).is_some_and(|v| !v.is_null());
            object.insert(field.to_owned(), json!(present));
        }
    }
    doc
}

/// A ledger entry without what differs between tenants (seq, time, request and reservation ids,
/// planner version).
fn comparable_entry(entry: &Value) -> Value {
    json!({
        "op": entry["op"], "qty": entry["qty"], "order_id": entry["order_id"],
        "reservation": !entry["reservation_id"].is_null(),
        "after": [entry["available_after"], entry["reserved_after"], entry["consumed_after"]],
    })
}

/// Proves the `default` example uploaded as wasm plans exactly like the built-in default: the
/// same sequence of orders (success, all-or-nothing rejection, missing resource, reserve,
/// confirm, dry-runs) gives the same statuses and order documents except the `plugin` field,
/// the same plans, and the same ledgers except `plugin_version` (0 vs 1).
#[tokio::test]
async fn default_wasm_plugin_behaves_exactly_like_no_plugin() {
    let app = spawn_app().await;
    let native = app.create_tenant("native").await;
    let wasm = app.create_tenant("wasm").await;
    for shop in [&native, &wasm] {
        shop.create_resource("sku-1", 10).await;
        shop.create_resource("sku-2", 5).await;
    }
    assert_eq!(upload(&wasm, "default", None).await, 1);

    let orders = [
        order_body(
            "ORD-1",
            Some("u-1"),
            "deduct",
            vec![line_with("sku-1", 3, &[("warehouse", "east")]), line("sku-2", 1)],
        ),
        deduct("ORD-2", &[("sku-1", 1), ("sku-2", 9)]),
        deduct("ORD-3", &[("sku-1", 1), ("ghost", 1)]),
        reserve("ORD-4", &[("sku-1", 2), ("sku-2", 2)], Some(600)),
        deduct("ORD-5", &[("sku-2", 2)]),
        deduct("ORD-6", &[("sku-1", 4)]),
        deduct("ORD-7", &[("sku-1", 1)]),
    ];
    for (n, body) in orders.iter().enumerate() {
        let dry_native = native.post("/v1/orders/dry-run", body).await.expect_json(200);
        let dry_wasm = wasm.post("/v1/orders/dry-run", body).await.expect_json(200);
        assert_eq!(dry_native["outcome"]["plugin"], builtin_ref());
        assert_eq!(dry_wasm["outcome"]["plugin"], wasm_ref(1));
        assert_eq!(comparable(dry_wasm["outcome"].clone()), comparable(dry_native["outcome"].clone()), "dry-run {n}");
        let strip_planner = |mut plan: Value| {
            if let Some(object) = plan.as_object_mut() {
                object.remove("planner");
            }
            plan
        };
        assert_eq!(strip_planner(dry_wasm["plan"].clone()), strip_planner(dry_native["plan"].clone()), "plan {n}");

        let key = format!("idem-{n}");
        let from_native = native.order(&key, body).await;
        let from_wasm = wasm.order(&key, body).await;
        assert_eq!(from_wasm.status(), from_native.status(), "order {n}: {} vs {}", from_wasm.text, from_native.text);
        assert_eq!(from_native.json()["plugin"], builtin_ref());
        assert_eq!(from_wasm.json()["plugin"], wasm_ref(1));
        assert_eq!(comparable(from_wasm.json()), comparable(from_native.json()), "order {n}");
        if n == 3 {
            // Settle the reservation the same way on both.
            for (shop, reply) in [(&native, &from_native), (&wasm, &from_wasm)] {
                let id = reply.json()["reservation_id"].as_str().expect("a reservation id").to_owned();
                assert_eq!(shop.confirm(&id).await.expect_json(200)["state"], "confirmed");
            }
        }
    }

    for key in ["sku-1", "sku-2"] {
        let native_ledger = native.assert_ledger_replays_to_state(key).await;
        let wasm_ledger = wasm.assert_ledger_replays_to_state(key).await;
        let project = |entries: &[Value]| entries.iter().map(comparable_entry).collect::<Vec<_>>();
        assert_eq!(project(&wasm_ledger), project(&native_ledger), "{key}");
        assert_eq!(native.state(key).await["available"], wasm.state(key).await["available"]);
        // Rows written by planned orders name their planner (the `create` of POST /v1/resources
        // and a confirm are not planned: not checked).
        let planned = |e: &&Value| e["op"] == "deduct" || e["op"] == "reserve";
        for entry in wasm_ledger.iter().filter(planned) {
            assert_eq!(entry["plugin_version"], 1, "{key}: {entry}");
        }
        for entry in native_ledger.iter().filter(planned) {
            assert_eq!(entry["plugin_version"], 0, "{key}: {entry}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Flash sale
// ---------------------------------------------------------------------------------------------

/// A flash-sale order for one piece of `sku` by `user`.
fn flash_order(order_id: &str, user: Option<&str>, action: &str, sku: &str, qty: i64) -> Value {
    order_body(order_id, user, action, vec![line(sku, qty)])
}

/// Proves the flash-sale plugin's one-piece-per-user limit: u-1 buys sku-1 (201), u-1 again is
/// 409 `limit_exceeded` with nothing applied (dry-run says the same), 2 pieces at once are over
/// the limit too, u-2 can buy, and an order without a user id is refused by the plugin
/// (`422 plugin_failed`, also on dry-run). The limit is per SKU. Uploaded without
/// configuration, the plugin lists 8 buckets, which the core ignores for these 1-bucket
/// resources.
#[tokio::test]
async fn flash_sale_allows_one_piece_per_user_and_sku() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 10).await;
    assert_eq!(upload(&shop, "flash-sale", None).await, 1);

    let doc = place(&shop, &flash_order("F-1", Some("u-1"), "deduct", "sku-1", 1)).await.expect_json(201);
    assert_eq!(doc["status"], "succeeded");
    assert_eq!(doc["plugin"], wasm_ref(1));
    assert_eq!(
        doc["lines"],
        json!([{"key": "sku-1", "resource": "sku-1", "qty": 1, "applied": 1, "status": "applied", "reason": null}])
    );

    let again = flash_order("F-2", Some("u-1"), "deduct", "sku-1", 1);
    let dry = shop.post("/v1/orders/dry-run", &again).await.expect_json(200);
    assert_eq!(dry["outcome"]["lines"][0]["reason"], "limit_exceeded", "{dry}");
    let doc = assert_line_rejected(&place(&shop, &again).await, 0, "limit_exceeded");
    assert_eq!(doc["plugin"], wasm_ref(1));
    assert_over_limit(&shop, &flash_order("F-3", Some("u-3"), "deduct", "sku-1", 2)).await;

    place(&shop, &flash_order("F-4", Some("u-2"), "deduct", "sku-1", 1)).await.expect_json(201);
    // The limit is per SKU: u-1 may still buy sku-2.
    place(&shop, &flash_order("F-5", Some("u-1"), "deduct", "sku-2", 1)).await.expect_json(201);

    let anonymous = flash_order("F-6", None, "deduct", "sku-1", 1);
    assert_plugin_failed(&place(&shop, &anonymous).await);
    assert_plugin_failed(&shop.post("/v1/orders/dry-run", &anonymous).await);

    assert_counts(&shop.state("sku-1").await, 8, 0, 2, 10);
    assert_counts(&shop.state("sku-2").await, 9, 0, 1, 10);
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(ops(&ledger), ["create", "deduct", "deduct"]);
    for entry in &ledger[1..] {
        assert_eq!(entry["plugin_version"], 1, "{entry}");
    }
    assert_no_drift(&shop).await;
}

/// Proves a released reservation gives the per-user limit back (the same user can buy again)
/// while a confirmed one does not.
#[tokio::test]
async fn flash_sale_release_gives_the_limit_back_and_confirm_does_not() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    upload(&shop, "flash-sale", Some("buckets=1")).await;

    // u-1: reserve, a second reserve is over the limit, release, then buying works.
    let held = place(&shop, &flash_order("R-1", Some("u-1"), "reserve", "sku-1", 1)).await.expect_json(201);
    let id = held["reservation_id"].as_str().expect("reservation_id").to_owned();
    assert_over_limit(&shop, &flash_order("R-2", Some("u-1"), "reserve", "sku-1", 1)).await;
    assert_eq!(shop.release(&id).await.expect_json(200)["state"], "released");
    place(&shop, &flash_order("R-3", Some("u-1"), "deduct", "sku-1", 1)).await.expect_json(201);
    assert_over_limit(&shop, &flash_order("R-4", Some("u-1"), "deduct", "sku-1", 1)).await;

    // u-2: reserve, confirm, and the limit stays used.
    let held = place(&shop, &flash_order("R-5", Some("u-2"), "reserve", "sku-1", 1)).await.expect_json(201);
    let id = held["reservation_id"].as_str().expect("reservation_id").to_owned();
    assert_eq!(shop.confirm(&id).await.expect_json(200)["state"], "confirmed");
    assert_over_limit(&shop, &flash_order("R-6", Some("u-2"), "deduct", "sku-1", 1)).await;
    assert_over_limit(&shop, &flash_order("R-7", Some("u-2"), "reserve", "sku-1", 1)).await;

    assert_counts(&shop.state("sku-1").await, 8, 0, 2, 10);
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(ops(&ledger), ["create", "reserve", "release", "deduct", "reserve", "confirm"]);
    assert_no_drift(&shop).await;
}

/// Proves an expired reservation gives the per-user limit back, like a release.
#[tokio::test]
async fn flash_sale_expiry_gives_the_limit_back() {
    let app = spawn_app_with(AppOptions::default().toml(FAST_SWEEP)).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    upload(&shop, "flash-sale", Some("buckets=1")).await;

    let mut body = flash_order("E-1", Some("u-1"), "reserve", "sku-1", 1);
    body["ttl_seconds"] = json!(1);
    let held = place(&shop, &body).await.expect_json(201);
    let id = held["reservation_id"].as_str().expect("reservation_id").to_owned();
    let deadline = Instant::now() + EXPIRY_DEADLINE;
    loop {
        let current = shop.reservation(&id).await.expect_json(200);
        if current["state"] == "expired" {
            break;
        }
        assert!(Instant::now() < deadline, "reservation {id} did not expire: {current}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    place(&shop, &flash_order("E-2", Some("u-1"), "deduct", "sku-1", 1)).await.expect_json(201);
    assert_over_limit(&shop, &flash_order("E-3", Some("u-1"), "deduct", "sku-1", 1)).await;
    assert_counts(&shop.state("sku-1").await, 9, 0, 1, 10);
    shop.assert_ledger_replays_to_state("sku-1").await;
}

/// Proves the flash sale under a race: 64 distinct users, 2 attempts each (same user), on a
/// stock of 50 (`?config=buckets%3D1`): exactly 50 orders succeed, each by a different user
/// (nobody gets two pieces), every other answer is a 409 for `insufficient`, `sold_out` or
/// `limit_exceeded`, and state, ledger and reconciliation agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flash_sale_race_sells_fifty_pieces_to_fifty_distinct_users() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-hot", 50).await;
    upload(&shop, "flash-sale", Some("buckets=1")).await;

    let barrier = Arc::new(Barrier::new(64));
    let clients = (0..64).map(|client| {
        let shop = shop.clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            let user = format!("u-{client}");
            barrier.wait().await;
            let mut replies = Vec::new();
            for attempt in 0..2 {
                let order_id = format!("{user}-o{attempt}");
                let body = flash_order(&order_id, Some(&user), "deduct", "sku-hot", 1);
                replies.push((user.clone(), order_id.clone(), shop.order(&order_id, &body).await));
            }
            replies
        })
    });
    let replies: Vec<(String, String, Reply)> =
        join_all(clients).await.into_iter().flat_map(|r| r.expect("client task does not panic")).collect();

    let mut winners: Vec<&str> = Vec::new();
    let mut winning_orders: HashSet<&str> = HashSet::new();
    for (user, order_id, reply) in &replies {
        match reply.status() {
            201 => {
                assert_eq!(reply.json()["plugin"], wasm_ref(1));
                winners.push(user);
                winning_orders.insert(order_id);
            }
            409 => {
                let doc = reply.json();
                assert_eq!(doc["status"], "rejected", "{doc}");
                let reason = doc["lines"][0]["reason"].as_str().unwrap_or_default();
                assert!(["insufficient", "sold_out", "limit_exceeded"].contains(&reason), "{doc}");
            }
            _ => panic!("unexpected answer {} {}", reply.status, reply.text),
        }
    }
    assert_eq!(winners.len(), 50, "exactly the stock is sold");
    let distinct: HashSet<&str> = winners.iter().copied().collect();
    assert_eq!(distinct.len(), 50, "no user bought twice: {winners:?}");

    assert_counts(&shop.state("sku-hot").await, 0, 0, 50, 50);
    let ledger = shop.assert_ledger_replays_to_state("sku-hot").await;
    let deducts = entries_with_op(&ledger, "deduct");
    assert_eq!(deducts.len(), 50);
    let in_ledger: HashSet<&str> = deducts.iter().filter_map(|e| e["order_id"].as_str()).collect();
    assert_eq!(in_ledger, winning_orders, "the ledger holds exactly the winning orders");
    for entry in deducts {
        assert_eq!(entry["plugin_version"], 1, "{entry}");
    }
    assert_no_drift(&shop).await;
}

// ---------------------------------------------------------------------------------------------
// Wallet, coupon, SMS quota, marketplace
// ---------------------------------------------------------------------------------------------

/// Proves the wallet plugin: line key `acct-1` with attribute currency EUR (or none: the default
/// EUR) pays from the balance `acct-1:EUR`, USD from `acct-1:USD`; an order paying from two
/// accounts where one lacks funds is rejected as a whole and applies nothing.
#[tokio::test]
async fn wallet_pays_from_the_account_balance_in_the_currency_all_or_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource_of_kind("acct-1:EUR", "balance", 10_000).await;
    shop.create_resource_of_kind("acct-1:USD", "balance", 5_000).await;
    shop.create_resource_of_kind("acct-2:EUR", "balance", 100).await;
    assert_eq!(upload(&shop, "wallet", None).await, 1);

    let pay = order_body("P-1", None, "deduct", vec![line_with("acct-1", 2_500, &[("currency", "EUR")])]);
    let doc = place(&shop, &pay).await.expect_json(201);
    assert_eq!(doc["plugin"], wasm_ref(1));
    assert_eq!(
        doc["lines"],
        json!([{"key": "acct-1", "resource": "acct-1:EUR", "qty": 2500, "applied": 2500, "status": "applied", "reason": null}])
    );
    assert_counts(&shop.state("acct-1:EUR").await, 7_500, 0, 2_500, 10_000);

    let doc = place(&shop, &order_body("P-2", None, "deduct", vec![line("acct-1", 500)])).await.expect_json(201);
    assert_eq!(doc["lines"][0]["resource"], "acct-1:EUR", "no currency: the default EUR");
    let usd = order_body("P-3", None, "deduct", vec![line_with("acct-1", 1_000, &[("currency", "USD")])]);
    assert_eq!(place(&shop, &usd).await.expect_json(201)["lines"][0]["resource"], "acct-1:USD");
    assert_counts(&shop.state("acct-1:EUR").await, 7_000, 0, 3_000, 10_000);
    assert_counts(&shop.state("acct-1:USD").await, 4_000, 0, 1_000, 5_000);

    let versions_before = [resource_version(&shop, "acct-1:EUR").await, resource_version(&shop, "acct-2:EUR").await];
    let split = order_body(
        "P-4",
        None,
        "deduct",
        vec![line_with("acct-1", 1_000, &[("currency", "EUR")]), line_with("acct-2", 500, &[("currency", "EUR")])],
    );
    let doc = assert_line_rejected(&place(&shop, &split).await, 1, "insufficient");
    assert_eq!(doc["lines"][1]["resource"], "acct-2:EUR");
    assert_eq!(doc["lines"][0]["status"], "skipped", "{doc}");
    assert_eq!(doc["lines"][0]["resource"], "acct-1:EUR", "{doc}");
    assert_eq!(doc["lines"][0]["applied"], 0, "{doc}");
    assert_counts(&shop.state("acct-1:EUR").await, 7_000, 0, 3_000, 10_000);
    assert_counts(&shop.state("acct-2:EUR").await, 100, 0, 0, 100);
    let versions_after = [resource_version(&shop, "acct-1:EUR").await, resource_version(&shop, "acct-2:EUR").await];
    assert_eq!(versions_after, versions_before, "nothing applied");

    for key in ["acct-1:EUR", "acct-1:USD", "acct-2:EUR"] {
        shop.assert_ledger_replays_to_state(key).await;
    }
    assert_no_drift(&shop).await;
}

/// Proves the coupon plugin: claiming campaign `spring` takes from `campaign:spring` (kind
/// coupon); the same user's second claim is `limit_exceeded`, another user succeeds, and when
/// the campaign runs out the next user gets `insufficient`; a claim without a user id is
/// refused by the plugin.
#[tokio::test]
async fn coupon_is_claimed_once_per_user_from_the_campaign_stock() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource_of_kind("campaign:spring", "coupon", 2).await;
    assert_eq!(upload(&shop, "coupon", None).await, 1);

    let claim = |id: &str, user: Option<&str>| order_body(id, user, "deduct", vec![line("spring", 1)]);
    let doc = place(&shop, &claim("C-1", Some("u-1"))).await.expect_json(201);
    assert_eq!(doc["plugin"], wasm_ref(1));
    assert_eq!(
        doc["lines"],
        json!([{"key": "spring", "resource": "campaign:spring", "qty": 1, "applied": 1, "status": "applied", "reason": null}])
    );
    let doc = assert_line_rejected(&place(&shop, &claim("C-2", Some("u-1"))).await, 0, "limit_exceeded");
    assert_eq!(doc["lines"][0]["resource"], "campaign:spring");
    place(&shop, &claim("C-3", Some("u-2"))).await.expect_json(201);
    assert_line_rejected(&place(&shop, &claim("C-4", Some("u-3"))).await, 0, "insufficient");
    assert_plugin_failed(&place(&shop, &claim("C-5", None)).await);

    let state = shop.state("campaign:spring").await;
    assert_eq!(state["kind"], "coupon");
    assert_counts(&state, 0, 0, 2, 2);
    let ledger = shop.assert_ledger_replays_to_state("campaign:spring").await;
    assert_eq!(ops(&ledger), ["create", "deduct", "deduct"]);
    assert_no_drift(&shop).await;
}

/// Proves the SMS-quota plugin creates the period resource on first use: with no resource at
/// all, an order of 2 for `acct-7` creates `acct-7:YYYY-MM` (the current UTC month) of kind quota
/// with the configured allowance 5 (ledger `create` 5 then `deduct` 2, both by version 1), and
/// 4 more are `insufficient` while the remaining 3 apply.
///
/// A new month getting a fresh quota cannot be shown by waiting here; the resource key carrying
/// the current UTC month is checked instead, and the month roll (across a year boundary) is
/// covered by the plugin host's unit test
/// `sms_quota_uses_the_utc_month_of_now_and_creates_it_with_the_allowance` in src/plugin/tests.rs.
#[tokio::test]
async fn sms_quota_creates_the_current_month_with_the_allowance() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    assert_eq!(upload(&shop, "sms-quota", Some("allowance=5")).await, 1);

    let month_before = chrono::Utc::now().format("%Y-%m").to_string();
    let doc = place(&shop, &order_body("S-1", None, "deduct", vec![line("acct-7", 2)])).await.expect_json(201);
    let month_after = chrono::Utc::now().format("%Y-%m").to_string();
    let resource = doc["lines"][0]["resource"].as_str().unwrap_or_default().to_owned();
    assert!(
        resource == format!("acct-7:{month_before}") || resource == format!("acct-7:{month_after}"),
        "the period resource is acct-7:<current UTC month>: {doc}"
    );
    assert_eq!(doc["plugin"], wasm_ref(1));
    assert_eq!(doc["lines"][0]["applied"], 2, "{doc}");

    let state = shop.state(&resource).await;
    assert_eq!(state["kind"], "quota", "{state}");
    assert_counts(&state, 3, 0, 2, 5);
    let ledger = shop.assert_ledger_replays_to_state(&resource).await;
    assert_eq!(ops(&ledger), ["create", "deduct"]);
    assert_eq!(ledger[0]["qty"], 5);
    assert_eq!(ledger[1]["qty"], 2);
    for entry in &ledger {
        assert_eq!(entry["plugin_version"], 1, "{entry}");
    }

    let doc = assert_line_rejected(
        &place(&shop, &order_body("S-2", None, "deduct", vec![line("acct-7", 4)])).await,
        0,
        "insufficient",
    );
    assert_eq!(doc["lines"][0]["resource"], resource.as_str());
    assert_counts(&shop.state(&resource).await, 3, 0, 2, 5);
    place(&shop, &order_body("S-3", None, "deduct", vec![line("acct-7", 3)])).await.expect_json(201);
    assert_counts(&shop.state(&resource).await, 0, 0, 5, 5);

    let listed = shop.get("/v1/resources").await.expect_json(200);
    let keys: Vec<&str> = listed["items"].as_array().into_iter().flatten().filter_map(|s| s["key"].as_str()).collect();
    assert_eq!(keys, [resource.as_str()], "exactly one resource was created");
    shop.assert_ledger_replays_to_state(&resource).await;
    assert_no_drift(&shop).await;
}

/// Proves the marketplace plugin: a line tries its own warehouse then the fallback `central`,
/// applying to the first that can take it (`sku-1:east` has 1, so 3 come from `sku-1:central`);
/// with partial success allowed, a line neither warehouse can fill is `rejected` (naming its
/// primary resource) while the others apply: status `partial`, 201. When no line can apply the
/// order is rejected (409).
#[tokio::test]
async fn marketplace_falls_back_to_central_and_allows_partial_success() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1:east", 1).await;
    shop.create_resource("sku-1:central", 5).await;
    shop.create_resource("sku-2:east", 1).await;
    shop.create_resource("sku-2:central", 1).await;
    assert_eq!(upload(&shop, "marketplace", Some("fallback=central")).await, 1);

    let doc = place(&shop, &order_body("M-1", None, "deduct", vec![line_with("sku-1", 3, &[("warehouse", "east")])]))
        .await
        .expect_json(201);
    assert_eq!(doc["status"], "succeeded");
    assert_eq!(doc["plugin"], wasm_ref(1));
    assert_eq!(
        doc["lines"],
        json!([{"key": "sku-1", "resource": "sku-1:central", "qty": 3, "applied": 3, "status": "applied", "reason": null}])
    );
    assert_counts(&shop.state("sku-1:east").await, 1, 0, 0, 1);
    assert_counts(&shop.state("sku-1:central").await, 2, 0, 3, 5);

    // The own warehouse first when it can take the line.
    let doc = place(&shop, &order_body("M-2", None, "deduct", vec![line_with("sku-1", 1, &[("warehouse", "east")])]))
        .await
        .expect_json(201);
    assert_eq!(doc["lines"][0]["resource"], "sku-1:east");

    // sku-2 (2 wanted, 1 + 1 held) cannot be filled; sku-1 (east now empty) falls back.
    let mixed = order_body(
        "M-3",
        None,
        "deduct",
        vec![line_with("sku-2", 2, &[("warehouse", "east")]), line_with("sku-1", 1, &[("warehouse", "east")])],
    );
    let doc = place(&shop, &mixed).await.expect_json(201);
    assert_eq!(doc["status"], "partial", "{doc}");
    assert_eq!(
        doc["lines"],
        json!([
            {"key": "sku-2", "resource": "sku-2:east", "qty": 2, "applied": 0, "status": "rejected", "reason": "insufficient"},
            {"key": "sku-1", "resource": "sku-1:central", "qty": 1, "applied": 1, "status": "applied", "reason": null}
        ])
    );
    assert_counts(&shop.state("sku-2:east").await, 1, 0, 0, 1);
    assert_counts(&shop.state("sku-2:central").await, 1, 0, 0, 1);
    assert_counts(&shop.state("sku-1:central").await, 1, 0, 4, 5);

    // Nothing can apply: rejected.
    let doc = assert_line_rejected(
        &place(&shop, &order_body("M-4", None, "deduct", vec![line_with("sku-2", 5, &[("warehouse", "east")])])).await,
        0,
        "insufficient",
    );
    assert_eq!(doc["lines"][0]["resource"], "sku-2:east");

    for key in ["sku-1:east", "sku-1:central", "sku-2:east", "sku-2:central"] {
        shop.assert_ledger_replays_to_state(key).await;
    }
    assert_no_drift(&shop).await;
}

// ---------------------------------------------------------------------------------------------
// Hostile plugins
// ---------------------------------------------------------------------------------------------

/// Proves each hostile fixture (endless loop, memory bomb, panic, out-of-range line, negative
/// quantity, negative limit) uploads fine but fails every order and dry-run it plans with
/// `422 plugin_failed` (the loop within 10 s) and applies nothing (resource version unchanged),
/// while another tenant without a plugin, ordering concurrently all along, gets every order
/// served; after the tenant uploads a good plugin its next order works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_plugins_fail_only_their_own_orders() {
    let app = spawn_app().await;
    let evil = app.create_tenant("evil").await;
    let good = app.create_tenant("good").await;
    evil.create_resource("sku-1", 100).await;
    evil.create_resource("sku-2", 100).await;
    good.create_resource("sku-1", 1_000_000).await;

    // The neighbour: 4 clients ordering until the hostile part is over.
    let stop = Arc::new(AtomicBool::new(false));
    let neighbours: Vec<_> = (0..4)
        .map(|client| {
            let good = good.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) || n == 0 {
                    let key = format!("good-{client}-{n}");
                    let reply = good.order(&key, &deduct(&key, &[("sku-1", 1)])).await;
                    statuses.push((reply.status(), reply.text));
                    n += 1;
                }
                statuses
            })
        })
        .collect();

    let fixtures = [
        ("hostile-loop", None),
        ("hostile-memory-bomb", None),
        ("hostile-trap", None),
        ("hostile-bad-index", None),
        ("hostile-negative", None),
        ("hostile-negative", Some("field=limit")),
    ];
    for (name, config) in fixtures {
        let what = format!("{name} {config:?}");
        let version = upload(&evil, name, config).await;
        let before = [resource_version(&evil, "sku-1").await, resource_version(&evil, "sku-2").await];
        for attempt in 0..3 {
            let body = order_body(&format!("{name}-{attempt}"), Some("u-1"), "deduct", vec![line("sku-1", 1)]);
            let started = Instant::now();
            let reply = place(&evil, &body).await;
            let took = started.elapsed();
            assert!(took < HOSTILE_DEADLINE, "{what}: answered after {took:?}");
            assert_plugin_failed(&reply);
            // Two lines, and a reserve: same verdict.
            let two =
                order_body(&format!("{name}-two-{attempt}"), None, "reserve", vec![line("sku-1", 1), line("sku-2", 1)]);
            assert_plugin_failed(&place(&evil, &two).await);
        }
        let started = Instant::now();
        assert_plugin_failed(&evil.post("/v1/orders/dry-run", &deduct("DRY", &[("sku-1", 1)])).await);
        assert!(started.elapsed() < HOSTILE_DEADLINE, "{what}: dry-run too slow");
        let after = [resource_version(&evil, "sku-1").await, resource_version(&evil, "sku-2").await];
        assert_eq!(after, before, "{what} (version {version}) applied nothing");
    }

    // A good plugin again: the tenant is served.
    let version = upload(&evil, "default", None).await;
    let doc = place(&evil, &deduct("AFTER", &[("sku-1", 2)])).await.expect_json(201);
    assert_eq!(doc["plugin"], wasm_ref(version));

    stop.store(true, Ordering::SeqCst);
    let mut served = 0;
    for neighbour in join_all(neighbours).await {
        for (status, text) in neighbour.expect("neighbour task does not panic") {
            assert_eq!(status, 201, "the other tenant is served: {text}");
            served += 1;
        }
    }
    assert!(served >= 4, "the neighbours ordered meanwhile");
    assert_counts(&good.state("sku-1").await, 1_000_000 - served, 0, served, 1_000_000);
    good.assert_ledger_replays_to_state("sku-1").await;
    assert_counts(&evil.state("sku-1").await, 98, 0, 2, 100);
    let ledger = evil.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(ops(&ledger), ["create", "deduct"]);
    assert_counts(&evil.state("sku-2").await, 100, 0, 0, 100);
    assert_no_drift(&evil).await;
    assert_no_drift(&good).await;
}

/// The quantity the counter fixture planned for a one-line order: the number of calls its
/// instance has served, counting this one.
async fn counter_calls(shop: &TenantClient, order_id: &str) -> i64 {
    let doc = place(shop, &deduct(order_id, &[("c-1", 1)])).await.expect_json(201);
    assert_eq!(doc["lines"][0]["status"], "applied", "{doc}");
    doc["lines"][0]["applied"].as_i64().unwrap_or_else(|| panic!("applied is an integer: {doc}"))
}

/// Proves no plugin state leaks where it must not, with the `hostile-counter` fixture (it
/// plans each line's quantity as the number of calls its instance has served, and panics on
/// order id `trap`): tenant B uploading the very same bytes after tenant A used them starts
/// from a fresh count (A's orders leave nothing in B's instance); after a trap the next order
/// runs on a fresh instance; and an instance serves at most 100 calls.
#[tokio::test]
async fn hostile_counter_shows_no_state_leaks() {
    let app = spawn_app().await;
    let a = app.create_tenant("tenant-a").await;
    let b = app.create_tenant("tenant-b").await;
    for shop in [&a, &b] {
        shop.create_resource("c-1", 1_000_000).await;
    }
    upload(&a, "hostile-counter", None).await;
    let a_first = counter_calls(&a, "A-1").await;
    let mut a_counts = vec![a_first];
    for n in 2..=5 {
        a_counts.push(counter_calls(&a, &format!("A-{n}")).await);
    }

    upload(&b, "hostile-counter", None).await;
    let b_first = counter_calls(&b, "B-1").await;
    assert_eq!(
        b_first, a_first,
        "B's first order must be planned like A's first was (fresh state); A's counts were {a_counts:?}: \
         state leaked from tenant A's plugin instance into tenant B's"
    );

    // A trap throws the instance away: the next order starts over.
    assert_plugin_failed(&place(&a, &deduct("trap", &[("c-1", 1)])).await);
    assert_eq!(counter_calls(&a, "A-after-trap").await, a_first, "a trapped instance is not reused");

    // At most 100 calls per instance.
    let mut seen = Vec::new();
    for n in 0..110 {
        seen.push(counter_calls(&a, &format!("A-bulk-{n}")).await);
    }
    assert!(seen.iter().all(|&calls| (1..=100).contains(&calls)), "calls per instance stay within 100: {seen:?}");
    a.assert_ledger_replays_to_state("c-1").await;
    b.assert_ledger_replays_to_state("c-1").await;
}

// ---------------------------------------------------------------------------------------------
// Hot swap
// ---------------------------------------------------------------------------------------------

/// Proves plugins can be replaced under load: 16 clients keep ordering (deduct 1, each its own
/// resource, fresh idempotency keys) for about 2 s while the default wasm is uploaded three times
/// (`?config=v1`, `v2`, `v3`: identical bytes, still new versions 1, 2, 3). Every answer is 201;
/// each order and each of its ledger rows name the same version, one of 0..=3; each client sees
/// versions only go up; and every order sent after the last upload answered runs on version 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_swapping_the_plugin_under_load_fails_no_request() {
    const CLIENTS: usize = 16;
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    for client in 0..CLIENTS {
        shop.create_resource(&format!("hs-{client}"), 1_000_000).await;
    }

    let last_swapped = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let barrier = Arc::new(Barrier::new(CLIENTS + 1));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let shop = shop.clone();
            let last_swapped = last_swapped.clone();
            let stop = stop.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let resource = format!("hs-{client}");
                let mut results = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let after_last_swap = last_swapped.load(Ordering::SeqCst);
                    let order_id = format!("hs-{client}-{n}");
                    let reply = shop.order(&order_id, &deduct(&order_id, &[(&resource, 1)])).await;
                    results.push((order_id, after_last_swap, reply));
                    n += 1;
                }
                results
            })
        })
        .collect();

    barrier.wait().await;
    let step = HOT_SWAP_LOAD / 4;
    let wasm = plugin_wasm("default");
    let mut uploaded = Vec::new();
    for config in ["v1", "v2", "v3"] {
        tokio::time::sleep(step).await;
        let body = shop.put_plugin_config(wasm.clone(), config).await.expect_json(201);
        assert_eq!(body["sha256"], sha256_hex(&wasm));
        uploaded.push(body["version"].as_i64().unwrap_or_default());
    }
    last_swapped.store(true, Ordering::SeqCst);
    tokio::time::sleep(step).await;
    stop.store(true, Ordering::SeqCst);
    assert_eq!(uploaded, [1, 2, 3], "identical bytes still make new versions");

    let mut version_of_order: HashMap<String, i64> = HashMap::new();
    let mut seen_versions = BTreeSet::new();
    for (client, results) in join_all(clients).await.into_iter().enumerate() {
        let results = results.expect("client task does not panic");
        assert!(results.iter().any(|(_, after, _)| *after), "client {client} ordered after the last swap");
        let mut last_version = 0;
        for (order_id, after_last_swap, reply) in results {
            let doc = reply.expect_json(201);
            let plugin = &doc["plugin"];
            let version = plugin["version"].as_i64().unwrap_or_else(|| panic!("plugin version: {doc}"));
            let expected = if version == 0 { builtin_ref() } else { wasm_ref(version) };
            assert_eq!(plugin, &expected, "{doc}");
            assert!((0..=3).contains(&version), "{doc}");
            assert!(version >= last_version, "client {client}: version went back from {last_version} to {version}");
            if after_last_swap {
                assert_eq!(version, 3, "order {order_id} started after the last upload answered: {doc}");
            }
            last_version = version;
            seen_versions.insert(version);
            version_of_order.insert(order_id, version);
        }
    }
    assert!(seen_versions.contains(&3), "versions seen: {seen_versions:?}");

    for client in 0..CLIENTS {
        let ledger = shop.assert_ledger_replays_to_state(&format!("hs-{client}")).await;
        let deducts = entries_with_op(&ledger, "deduct");
        for entry in &deducts {
            let order_id = entry["order_id"].as_str().unwrap_or_default();
            let version = version_of_order.get(order_id).unwrap_or_else(|| panic!("unknown order in ledger: {entry}"));
            assert_eq!(entry["plugin_version"], *version, "ledger row and order document agree: {entry}");
        }
        let orders_of_client = version_of_order.keys().filter(|id| id.starts_with(&format!("hs-{client}-"))).count();
        assert_eq!(deducts.len(), orders_of_client, "hs-{client}: one deduct per order");
    }

    let page = shop.get("/v1/plugin/versions").await.expect_json(200);
    let items = page["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(items.len(), 3, "{page}");
    for item in &items {
        assert_eq!(item["sha256"], sha256_hex(&wasm), "{item}");
    }
    assert_eq!(versions(&shop).await, [(1, false), (2, false), (3, true)]);
    assert_no_drift(&shop).await;
}

// ---------------------------------------------------------------------------------------------
// Version cap
// ---------------------------------------------------------------------------------------------

/// Proves plugin versions per tenant are capped (`[plugins] max_versions_per_tenant = 3`): after
/// five uploads exactly the three newest remain, a pruned version answers 404
/// `plugin_version_not_found`, and numbering never restarts; the version that was active when
/// an upload began (the one a tenant rolled back to) is kept while the oldest inactive one goes;
/// other tenants' versions are untouched.
#[tokio::test]
async fn plugin_versions_beyond_the_cap_are_pruned_oldest_first() {
    let app = spawn_app_with(AppOptions::default().toml("[plugins]\nmax_versions_per_tenant = 3")).await;
    let shop = app.create_tenant("shop").await;
    let other = app.create_tenant("other").await;
    assert_eq!(upload(&other, "default", None).await, 1);

    for expected in 1..=5 {
        assert_eq!(upload(&shop, "default", None).await, expected);
    }
    assert_eq!(versions(&shop).await, [(3, false), (4, false), (5, true)]);
    for pruned in [1, 2] {
        assert_problem(&shop.activate_plugin(pruned).await, 404, "plugin_version_not_found");
    }
    assert_active(&shop, 5, &plugin_wasm("default")).await;

    // Roll back to 3, then upload: 3 was active when the upload began, so it stays; 4 goes.
    assert_eq!(shop.activate_plugin(3).await.expect_json(200)["version"], 3);
    assert_eq!(upload(&shop, "flash-sale", None).await, 6);
    assert_eq!(versions(&shop).await, [(3, false), (5, false), (6, true)]);
    assert_problem(&shop.activate_plugin(4).await, 404, "plugin_version_not_found");
    // The next upload began with 6 active: 3 is now the oldest inactive one.
    assert_eq!(upload(&shop, "default", None).await, 7);
    assert_eq!(versions(&shop).await, [(5, false), (6, false), (7, true)]);
    assert_eq!(shop.activate_plugin(6).await.expect_json(200)["version"], 6);
    assert_active(&shop, 6, &plugin_wasm("flash-sale")).await;

    assert_eq!(versions(&other).await, [(1, true)]);
}
