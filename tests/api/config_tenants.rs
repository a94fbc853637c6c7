//! Tenants declared in the TOML config: their keys (from an env var or a SHA-256 hash) work at
//! once, their seed resources exist, and seeding is idempotent across restarts.

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::helpers::{assert_counts, assert_problem, deduct, random_hex_32, spawn_app_with, AppOptions};

/// A tenant with its key in an env var and one seed resource.
fn env_key_tenant() -> &'static str {
    r#"
[[tenants]]
id = "cfg-shop"
name = "Config Shop"
api_key_env = "CFG_SHOP_KEY"

[[tenants.resources]]
key = "sku-seed"
kind = "inventory"
total = 40
"#
}

/// A config tenant's env-var key works at once and sees its seeded resource, fresh.
#[tokio::test]
async fn config_tenant_uses_its_env_key_and_sees_its_seed() {
    let key = random_hex_32();
    let app = spawn_app_with(AppOptions::default().toml(env_key_tenant()).env("CFG_SHOP_KEY", &key)).await;
    let shop = app.tenant_with_key("cfg-shop", &key);

    let state = shop.state("sku-seed").await;
    assert_eq!(state["kind"], "inventory");
    assert_eq!(state["status"], "active");
    assert_counts(&state, 40, 0, 0, 40);
    assert_eq!(state["version"], 1);
    let ledger = shop.assert_ledger_replays_to_state("sku-seed").await;
    assert_eq!(ledger.len(), 1);
    assert_eq!(ledger[0]["op"], "create");
    assert_eq!(ledger[0]["qty"], 40);

    shop.order("idem-1", &deduct("ORD-1", &[("sku-seed", 5)])).await.expect_json(201);
    assert_counts(&shop.state("sku-seed").await, 35, 0, 5, 40);

    let wrong = shop.with_api_key(&random_hex_32());
    assert_problem(&wrong.get("/v1/resources/sku-seed").await, 401, "unauthorized");
}

/// A config tenant whose key is given only as its SHA-256 hash accepts that key.
#[tokio::test]
async fn config_tenant_accepts_a_key_given_by_its_hash() {
    let key = random_hex_32();
    let hash = hex::encode(Sha256::digest(key.as_bytes()));
    let toml = format!(
        r#"
[[tenants]]
id = "cfg-hash"
name = "Hashed"
api_key_sha256 = "{hash}"

[[tenants.resources]]
key = "coupon-bf"
kind = "coupon"
total = 1000
"#
    );
    let app = spawn_app_with(AppOptions::default().toml(&toml)).await;
    let shop = app.tenant_with_key("cfg-hash", &key);
    let state = shop.state("coupon-bf").await;
    assert_eq!(state["kind"], "coupon");
    assert_counts(&state, 1000, 0, 0, 1000);

    // The hash itself is not a key.
    let by_hash = shop.with_api_key(&hash);
    assert_problem(&by_hash.get("/v1/resources/coupon-bf").await, 401, "unauthorized");
}

/// Restarting does not seed again: totals, consumption and the ledger carry over unchanged.
#[tokio::test]
async fn seeding_is_idempotent_across_restarts() {
    let key = random_hex_32();
    let mut app = spawn_app_with(AppOptions::default().toml(env_key_tenant()).env("CFG_SHOP_KEY", &key)).await;
    let shop = app.tenant_with_key("cfg-shop", &key);
    shop.order("idem-1", &deduct("ORD-1", &[("sku-seed", 5)])).await.expect_json(201);

    app.restart().await;
    let state = shop.state("sku-seed").await;
    assert_counts(&state, 35, 0, 5, 40);
    let ledger = shop.assert_ledger_replays_to_state("sku-seed").await;
    assert_eq!(crate::helpers::ops(&ledger), ["create", "deduct"]);

    let status = app.terminate().await;
    assert_eq!(status.code(), Some(0));
    app.restart().await;
    assert_counts(&shop.state("sku-seed").await, 35, 0, 5, 40);
    shop.assert_ledger_replays_to_state("sku-seed").await;
    let list = app.admin_get("/v1/admin/tenants").await.expect_json(200);
    let ids: Vec<&str> =
        list["items"].as_array().expect("items is an array").iter().filter_map(|t| t["id"].as_str()).collect();
    assert_eq!(ids, ["cfg-shop"], "the config tenant exists once");
}

/// Config tenants are listed by the admin API, their ids are taken, and they are isolated from
/// tenants created through the API.
#[tokio::test]
async fn config_tenant_is_a_tenant_like_any_other() {
    let key = random_hex_32();
    let app = spawn_app_with(AppOptions::default().toml(env_key_tenant()).env("CFG_SHOP_KEY", &key)).await;
    let shop = app.tenant_with_key("cfg-shop", &key);

    let list = app.admin_get("/v1/admin/tenants").await.expect_json(200);
    let items = list["items"].as_array().expect("items is an array");
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["id"], "cfg-shop");
    assert_eq!(items[0]["name"], "Config Shop");

    let taken = app.admin_post("/v1/admin/tenants", &json!({"id": "cfg-shop", "name": "Impostor"})).await;
    assert_problem(&taken, 409, "tenant_exists");

    let other = app.create_tenant("api-shop").await;
    assert_problem(&other.get("/v1/resources/sku-seed").await, 404, "resource_not_found");
    assert_eq!(other.get("/v1/resources").await.expect_json(200)["items"], json!([]));
    assert_counts(&shop.state("sku-seed").await, 40, 0, 0, 40);
}

/// A config tenant's plugin file is uploaded at start-up as version 1 and plans its orders; a
/// restart with the same file and config makes no new version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_tenant_plugin_is_installed_once_and_plans_orders() {
    let key = random_hex_32();
    // The bytes are written into the test's own file so the config can name a path.
    let wasm = crate::helpers::plugin_wasm("flash-sale");
    let dir = tempfile::tempdir().expect("a temporary directory can be created");
    let path = dir.path().join("flash-sale.wasm");
    std::fs::write(&path, &wasm).expect("the plugin file can be written");
    let toml = format!(
        r#"
[[tenants]]
id = "cfg-flash"
name = "Config Flash"
api_key_env = "CFG_FLASH_KEY"
plugin = "{}"
plugin_config = "buckets = 1"

[[tenants.resources]]
key = "sku-flash"
kind = "inventory"
total = 10
"#,
        path.display()
    );
    let mut app = spawn_app_with(AppOptions::default().toml(&toml).env("CFG_FLASH_KEY", &key)).await;
    let shop = app.tenant_with_key("cfg-flash", &key);

    let active = shop.get("/v1/plugin").await.expect_json(200);
    assert_eq!(active["version"], 1, "{active}");
    assert_eq!(active["sha256"], hex::encode(Sha256::digest(&wasm)));

    let body =
        json!({"order_id": "O-1", "user_id": "u-1", "action": "deduct", "lines": [{"key": "sku-flash", "qty": 1}]});
    let doc = shop.order("idem-1", &body).await.expect_json(201);
    assert_eq!(doc["plugin"], json!({"name": "wasm", "version": 1}));
    // The flash-sale plan's per-user limit: the same user cannot buy a second piece.
    let again =
        json!({"order_id": "O-2", "user_id": "u-1", "action": "deduct", "lines": [{"key": "sku-flash", "qty": 1}]});
    let refused = shop.order("idem-2", &again).await.expect_json(409);
    assert_eq!(refused["lines"][0]["reason"], "limit_exceeded");

    app.restart().await;
    let versions = shop.get("/v1/plugin/versions").await.expect_json(200);
    assert_eq!(versions["items"].as_array().map(Vec::len), Some(1), "{versions}");
    assert_eq!(shop.get("/v1/plugin").await.expect_json(200)["version"], 1);
}
