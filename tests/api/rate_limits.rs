//! Per-tenant request rate limits: a tenant past its token bucket gets `429 rate_limited` with
//! `Retry-After` and the IETF `RateLimit-Policy` / `RateLimit` headers, no other tenant does,
//! the tenant is served again once the wait is over, a refused idempotent call is applied once
//! when retried, a tenant's own rate (config or admin API) beats the server default, and a rate
//! changed through the admin API applies without a restart.

use std::time::Duration;

use futures::future::join_all;
use serde_json::json;

use crate::helpers::{
    assert_counts, assert_problem, deduct, entries_with_op, random_hex_32, spawn_app_with, unique, AppOptions, Reply,
    TenantClient,
};

/// Requests a flooding tenant sends at once.
const FLOOD: usize = 30;
/// Bound on waiting for a limited tenant to be served again, or for a rate change to reach
/// another process (its auth cache is set to 200 ms below).
const DEADLINE: Duration = Duration::from_secs(20);

/// A `[[tenants]]` entry whose key is in env var `key_env`, with its own rate if given, and a
/// resource `sku` of `total`.
fn config_tenant(id: &str, key_env: &str, rate: Option<(u32, u32)>, total: i64) -> String {
    let rate = rate.map_or(String::new(), |(rps, burst)| {
        format!("rate_limit = {{ requests_per_second = {rps}, burst = {burst} }}\n")
    });
    format!(
        "[[tenants]]\nid = \"{id}\"\nname = \"{id}\"\napi_key_env = \"{key_env}\"\n{rate}\n\
         [[tenants.resources]]\nkey = \"sku\"\nkind = \"inventory\"\ntotal = {total}\n"
    )
}

/// Tenant `flood` (5/s, burst 5, from its config entry) and tenant `calm` (the server default),
/// each with a resource `sku` of 100.
fn two_config_tenants(flood_key: &str, calm_key: &str) -> AppOptions {
    AppOptions::default()
        .toml(&config_tenant("flood", "FLOOD_KEY", Some((5, 5)), 100))
        .toml(&config_tenant("calm", "CALM_KEY", None, 100))
        .env("FLOOD_KEY", flood_key)
        .env("CALM_KEY", calm_key)
}

/// `n` GETs of `path` sent at once.
async fn burst(shop: &TenantClient, path: &str, n: usize) -> Vec<Reply> {
    join_all((0..n).map(|_| shop.get(path))).await
}

/// Asserts a `429 rate_limited` with its headers (policy `q`/`w` as given) and returns
/// Retry-After in seconds.
#[track_caller]
fn assert_rate_limited(reply: &Reply, quota: u32, window_s: u32) -> u64 {
    assert_problem(reply, 429, "rate_limited");
    let retry_after: u64 = reply
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("Retry-After is whole seconds: {:?}", reply.headers));
    assert!(retry_after >= 1, "Retry-After is at least 1: {retry_after}");
    assert_eq!(reply.header("ratelimit-policy"), Some(format!("\"tenant\";q={quota};w={window_s}").as_str()));
    assert_eq!(reply.header("ratelimit"), Some(format!("\"tenant\";r=0;t={retry_after}").as_str()));
    retry_after
}

/// Asserts a served answer carries the `RateLimit` header of this policy.
#[track_caller]
fn assert_served_with_headers(reply: &Reply, quota: u32, window_s: u32) {
    assert_eq!(reply.status(), 200, "served: {}", reply.text);
    assert_eq!(reply.header("ratelimit-policy"), Some(format!("\"tenant\";q={quota};w={window_s}").as_str()));
    let remaining = reply.header("ratelimit").unwrap_or_else(|| panic!("RateLimit header: {:?}", reply.headers));
    assert!(remaining.starts_with("\"tenant\";r="), "RateLimit is a structured field: {remaining}");
}

/// Sends `request` until it is not `429`, waiting each Retry-After; bounded by `DEADLINE`.
async fn served<F, Fut>(mut request: F) -> Reply
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Reply>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let reply = request().await;
        if reply.status() != 429 {
            return reply;
        }
        assert!(tokio::time::Instant::now() < deadline, "still rate limited after {DEADLINE:?}: {}", reply.text);
        let wait: u64 = reply.header("retry-after").and_then(|v| v.parse().ok()).unwrap_or(1);
        tokio::time::sleep(Duration::from_secs(wait)).await;
    }
}

/// Proves the limit is per tenant: `flood` (5/s, burst 5) sending 30 requests at once gets
/// `429 rate_limited` with Retry-After and RateLimit headers for some of them, while `calm`,
/// flooding at the same moment on the same server, gets none; admin and ops routes are not
/// tenant-limited; and after waiting Retry-After, `flood` is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_is_limited_and_another_is_not() {
    let (flood_key, calm_key) = (random_hex_32(), random_hex_32());
    let app = spawn_app_with(two_config_tenants(&flood_key, &calm_key)).await;
    let flood = app.tenant_with_key("flood", &flood_key);
    let calm = app.tenant_with_key("calm", &calm_key);

    let (flooded, calmed) =
        tokio::join!(burst(&flood, "/v1/resources/sku", FLOOD), burst(&calm, "/v1/resources", FLOOD));

    let limited: Vec<&Reply> = flooded.iter().filter(|r| r.status() == 429).collect();
    assert!(!limited.is_empty(), "30 requests at once exceed a burst of 5");
    let served_now = flooded.iter().filter(|r| r.status() == 200).count();
    assert_eq!(served_now + limited.len(), FLOOD, "every answer is 200 or 429");
    assert!(served_now >= 5, "the burst of 5 is served: {served_now}");
    let mut retry_after = 0;
    for reply in &limited {
        retry_after = retry_after.max(assert_rate_limited(reply, 5, 1));
    }
    for reply in &calmed {
        assert_eq!(reply.status(), 200, "the calm tenant is never limited: {}", reply.text);
        assert!(reply.header("ratelimit").is_some(), "served answers carry RateLimit: {:?}", reply.headers);
    }

    // Admin and ops routes are not tenant-limited; the OpenAPI document says which are.
    app.admin_get("/v1/admin/tenants").await.expect_json(200);
    assert_eq!(app.get_anonymous("/healthz").await.status(), 200);
    let openapi = app.get_anonymous("/openapi.json").await.expect_json(200);
    assert!(openapi["paths"]["/v1/orders"]["post"]["responses"]["429"].is_object(), "tenant routes document 429");
    assert!(openapi["paths"]["/v1/admin/tenants"]["post"]["responses"]["429"].is_null(), "admin routes do not");

    // After the wait the server named, the tenant is served again.
    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    let again = flood.get("/v1/resources/sku").await;
    assert_served_with_headers(&again, 5, 1);
}

/// Proves a `429` is never stored as an idempotent outcome: an order refused for its rate
/// applies nothing, and the same order with the same Idempotency-Key, retried after the wait,
/// is processed (not replayed), applied exactly once, and replayed afterwards.
#[tokio::test]
async fn a_rate_limited_order_is_applied_once_when_retried() {
    let key = random_hex_32();
    let toml = config_tenant("slow", "SLOW_KEY", Some((1, 2)), 10);
    let app = spawn_app_with(AppOptions::default().toml(&toml).env("SLOW_KEY", &key)).await;
    let slow = app.tenant_with_key("slow", &key);

    // Empty the bucket, then order at once; a token may come back in between, so try a few
    // times (with a fresh key each: a served attempt would be a real order).
    let mut refused = None;
    for _ in 0..5 {
        let emptied = burst(&slow, "/v1/resources/sku", 10).await;
        assert!(emptied.iter().any(|r| r.status() == 429), "10 requests at once exceed a burst of 2");
        let (idem, order) = (unique("idem"), deduct(&unique("ORD"), &[("sku", 3)]));
        let reply = slow.order(&idem, &order).await;
        if reply.status() == 429 {
            assert_rate_limited(&reply, 2, 2);
            refused = Some((idem, order));
            break;
        }
        reply.expect_json(201);
    }
    let (idem, order) = refused.expect("an order sent into an empty bucket is refused");
    let before = served(|| slow.get("/v1/resources/sku")).await.expect_json(200);

    let first = served(|| slow.order(&idem, &order)).await;
    let document = first.expect_json(201);
    assert!(!first.replayed(), "the retry is processed, not a replay of the 429");
    assert_eq!(document["status"], "succeeded", "{document}");
    let replay = served(|| slow.order(&idem, &order)).await;
    assert!(replay.replayed(), "the next retry replays the stored outcome");
    assert_eq!((replay.status(), replay.json()), (201, document));

    let after = served(|| slow.get("/v1/resources/sku")).await.expect_json(200);
    let available = before["available"].as_i64().expect("available is an integer");
    assert_counts(&after, available - 3, 0, 10 - (available - 3), 10);
    let ledger = served(|| slow.get("/v1/resources/sku/ledger?limit=1000")).await.expect_json(200);
    let items = ledger["items"].as_array().expect("items is an array").clone();
    let mine: Vec<_> =
        entries_with_op(&items, "deduct").into_iter().filter(|e| e["order_id"] == order["order_id"]).collect();
    assert_eq!(mine.len(), 1, "applied exactly once: {ledger}");
}

/// Proves a tenant's own rate beats the server default, from its config entry and from the
/// admin API: with a default of 2/s (burst 2), `big` (config: 1000/s) and `api` (created with
/// 1000/s) are never limited by 20 requests at once while `small` (the default) is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_rate_beats_the_server_default() {
    let big_key = random_hex_32();
    let toml = format!(
        "[rate_limits]\nrequests_per_second = 2\nburst = 2\n\n{}",
        config_tenant("big", "BIG_KEY", Some((1000, 1000)), 1)
    );
    let app = spawn_app_with(AppOptions::default().toml(&toml).env("BIG_KEY", &big_key)).await;
    let big = app.tenant_with_key("big", &big_key);
    let small = app.create_tenant("small").await;
    let created = app
        .admin_post(
            "/v1/admin/tenants",
            &json!({"id": "api", "name": "Api", "rate_limit": {"requests_per_second": 1000, "burst": 1000}}),
        )
        .await
        .expect_json(201);
    assert_eq!(created["rate_limit"], json!({"requests_per_second": 1000, "burst": 1000}), "{created}");
    let api = app.tenant_with_key("api", created["api_key"].as_str().expect("api_key is a string"));

    let (bigs, smalls, apis) = tokio::join!(
        burst(&big, "/v1/resources", 20),
        burst(&small, "/v1/resources", 20),
        burst(&api, "/v1/resources", 20)
    );
    for reply in bigs.iter().chain(&apis) {
        assert_served_with_headers(reply, 1000, 1);
    }
    let limited: Vec<&Reply> = smalls.iter().filter(|r| r.status() == 429).collect();
    assert!(!limited.is_empty(), "20 requests at once exceed the default burst of 2");
    for reply in limited {
        assert_rate_limited(reply, 2, 1);
    }

    let listed = app.admin_get("/v1/admin/tenants").await.expect_json(200);
    let rate_of = |id: &str| {
        listed["items"]
            .as_array()
            .and_then(|items| items.iter().find(|t| t["id"] == id))
            .map(|t| t["rate_limit"].clone())
    };
    assert_eq!(rate_of("big"), Some(json!({"requests_per_second": 1000, "burst": 1000})), "{listed}");
    assert_eq!(rate_of("small"), Some(json!(null)), "null: the server default; {listed}");
}

/// Proves a rate set through the admin API applies without a restart: at once in the process
/// that took the change, and within the auth cache time in another process on the same
/// database; `DELETE` goes back to the server default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_changed_through_the_admin_api_applies_without_restart() {
    let app = spawn_app_with(AppOptions::default().toml("[auth]\ncache_ttl_ms = 200")).await;
    let shop = app.create_tenant("shop").await;
    let sibling = app.spawn_sibling().await;
    let shop_there = sibling.tenant_with_key("shop", &shop.api_key);
    // Both processes have the key cached with the default rate: nothing is limited.
    for reply in burst(&shop, "/v1/resources", 20).await.iter().chain(&burst(&shop_there, "/v1/resources", 20).await) {
        assert_eq!(reply.status(), 200, "the default is generous: {}", reply.text);
    }

    let set = app
        .admin_put("/v1/admin/tenants/shop/rate-limit", &json!({"requests_per_second": 2, "burst": 2}))
        .await
        .expect_json(200);
    assert_eq!(set["rate_limit"], json!({"requests_per_second": 2, "burst": 2}), "{set}");
    let here = burst(&shop, "/v1/resources", 20).await;
    assert!(here.iter().any(|r| r.status() == 429), "the new rate applies at once where it was set");

    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let there = burst(&shop_there, "/v1/resources", 20).await;
        if let Some(limited) = there.iter().find(|r| r.status() == 429) {
            assert_rate_limited(limited, 2, 1);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the other process never applied the new rate");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    assert_eq!(app.admin_delete("/v1/admin/tenants/shop/rate-limit").await.status(), 204);
    let one = json!({"requests_per_second": 1, "burst": 1});
    assert_problem(&app.admin_put("/v1/admin/tenants/nobody/rate-limit", &one).await, 404, "tenant_not_found");
    let no_burst = json!({"requests_per_second": 1, "burst": 0});
    assert_problem(&app.admin_put("/v1/admin/tenants/shop/rate-limit", &no_burst).await, 400, "validation_failed");
    // Back to the default: a burst of 20 goes through once the old bucket is forgotten.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while burst(&shop, "/v1/resources", 20).await.iter().any(|r| r.status() == 429) {
        assert!(tokio::time::Instant::now() < deadline, "the default rate never came back");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
