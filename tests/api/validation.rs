//! Bad input: every malformed, mistyped, out-of-range or hostile request is a 4xx problem+json
//! (never a 5xx), and the resource state is unchanged afterwards.

use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::{
    assert_client_problem, assert_counts, assert_problem, send, spawn_app, unique, Reply, TenantClient,
};

/// Sends a raw body to `path` as JSON with a fresh idempotency key.
async fn post_raw(shop: &TenantClient, path: &str, body: String) -> Reply {
    send(
        shop.request(Method::POST, path)
            .header("Idempotency-Key", unique("bad"))
            .header("content-type", "application/json")
            .body(body),
    )
    .await
}

/// Order bodies that must each be refused with 400 validation_failed, named for failure
/// messages. `sku-1` exists with total 100.
fn invalid_order_bodies() -> Vec<(&'static str, String)> {
    let line = |qty: &str| format!(r#"{{"order_id":"O-1","action":"deduct","lines":[{{"key":"sku-1","qty":{qty}}}]}}"#);
    let with_key =
        |key: &str| json!({"order_id": "O-1", "action": "deduct", "lines": [{"key": key, "qty": 1}]}).to_string();
    let hundred_and_one: Vec<Value> = (0..101).map(|i| json!({"key": format!("k-{i}"), "qty": 1})).collect();
    vec![
        ("truncated JSON", r#"{"order_id": "O-1", "action": "deduct", "lines": ["#.to_owned()),
        ("not JSON", "hello".to_owned()),
        ("empty body", String::new()),
        ("JSON array", "[]".to_owned()),
        ("JSON null", "null".to_owned()),
        ("JSON string", r#""order""#.to_owned()),
        ("trailing garbage", format!("{} x", line("1"))),
        ("duplicate field", r#"{"order_id":"O-1","order_id":"O-2","action":"deduct","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("duplicate line field", r#"{"order_id":"O-1","action":"deduct","lines":[{"key":"sku-1","qty":1,"qty":99}]}"#.to_owned()),
        ("unknown top-level field", r#"{"order_id":"O-1","action":"deduct","coupon":"FREE","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("unknown line field", r#"{"order_id":"O-1","action":"deduct","lines":[{"key":"sku-1","qty":1,"price":3}]}"#.to_owned()),
        ("qty 0", line("0")),
        ("qty -1", line("-1")),
        ("qty 1.5", line("1.5")),
        ("qty 1.0", line("1.0")),
        ("qty 1e3", line("1e3")),
        ("qty as string", line(r#""3""#)),
        ("qty null", line("null")),
        ("qty 2^63", line("9223372036854775808")),
        ("qty 2^64", line("18446744073709551616")),
        ("qty -2^63-1", line("-9223372036854775809")),
        ("qty 10^12+1", line("1000000000001")),
        ("qty missing", r#"{"order_id":"O-1","action":"deduct","lines":[{"key":"sku-1"}]}"#.to_owned()),
        ("no lines", r#"{"order_id":"O-1","action":"deduct","lines":[]}"#.to_owned()),
        ("lines missing", r#"{"order_id":"O-1","action":"deduct"}"#.to_owned()),
        ("lines an object", r#"{"order_id":"O-1","action":"deduct","lines":{"key":"sku-1","qty":1}}"#.to_owned()),
        ("101 lines", json!({"order_id": "O-1", "action": "deduct", "lines": hundred_and_one}).to_string()),
        ("duplicate keys", r#"{"order_id":"O-1","action":"deduct","lines":[{"key":"sku-1","qty":1},{"key":"sku-1","qty":2}]}"#.to_owned()),
        ("key ../x", with_key("../x")),
        ("key with space", with_key("a b")),
        ("key of 201 chars", with_key(&"k".repeat(201))),
        ("unicode key", with_key("skü-1")),
        ("emoji key", with_key("sku-🙂")),
        ("empty key", with_key("")),
        ("key with NUL", with_key("sku-1\u{0}")),
        ("key with newline", with_key("sku-1\n")),
        ("key with slash", with_key("sku/1")),
        ("key with percent", with_key("sku%2F1")),
        ("key with quote", with_key("sku-1'; DROP TABLE resources; --")),
        ("key a number", r#"{"order_id":"O-1","action":"deduct","lines":[{"key":1,"qty":1}]}"#.to_owned()),
        ("order_id missing", r#"{"action":"deduct","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("order_id empty", r#"{"order_id":"","action":"deduct","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("order_id of 129 chars", json!({"order_id": "o".repeat(129), "action": "deduct", "lines": [{"key": "sku-1", "qty": 1}]}).to_string()),
        ("order_id non-ASCII", r#"{"order_id":"ORD-é","action":"deduct","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("order_id with newline", r#"{"order_id":"ORD\n1","action":"deduct","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("order_id a number", r#"{"order_id":17,"action":"deduct","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("user_id empty", r#"{"order_id":"O-1","user_id":"","action":"deduct","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("user_id of 129 chars", json!({"order_id": "O-1", "user_id": "u".repeat(129), "action": "deduct", "lines": [{"key": "sku-1", "qty": 1}]}).to_string()),
        ("user_id non-ASCII", r#"{"order_id":"O-1","user_id":"ユーザー","action":"deduct","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("action unknown", r#"{"order_id":"O-1","action":"steal","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("action missing", r#"{"order_id":"O-1","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("action a number", r#"{"order_id":"O-1","action":5,"lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("ttl on deduct", r#"{"order_id":"O-1","action":"deduct","ttl_seconds":60,"lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("ttl 0", r#"{"order_id":"O-1","action":"reserve","ttl_seconds":0,"lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("ttl -1", r#"{"order_id":"O-1","action":"reserve","ttl_seconds":-1,"lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("ttl 604801", r#"{"order_id":"O-1","action":"reserve","ttl_seconds":604801,"lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("ttl 1.5", r#"{"order_id":"O-1","action":"reserve","ttl_seconds":1.5,"lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("attributes a string", r#"{"order_id":"O-1","action":"deduct","lines":[{"key":"sku-1","qty":1,"attributes":"x"}]}"#.to_owned()),
        ("attribute value a number", r#"{"order_id":"O-1","action":"deduct","lines":[{"key":"sku-1","qty":1,"attributes":{"a":1}}]}"#.to_owned()),
        ("deeply nested", format!("{}{}", "[".repeat(10_000), "]".repeat(10_000))),
    ]
}

/// Every invalid order body is 400 validation_failed on `/v1/orders`, and nothing changes.
#[tokio::test]
async fn invalid_orders_are_refused_and_change_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let before = shop.create_resource("sku-1", 100).await;

    let mut failures = Vec::new();
    for (name, body) in invalid_order_bodies() {
        let reply = post_raw(&shop, "/v1/orders", body).await;
        let problem_ok = reply.status() == 400
            && reply.content_type().starts_with("application/problem+json")
            && reply.json()["code"] == "validation_failed";
        if !problem_ok {
            failures.push(format!("{name}: {} {}", reply.status(), reply.text));
        }
        // Whatever the answer, it is never a 5xx and never leaks internals.
        assert!(!reply.status.is_server_error(), "{name}: {} {}", reply.status, reply.text);
        crate::helpers::assert_no_leak(&reply);
    }
    assert!(failures.is_empty(), "not 400 validation_failed:\n{}", failures.join("\n"));

    assert_eq!(shop.state("sku-1").await, before);
    assert_eq!(shop.ledger("sku-1").await.len(), 1);
    let page = shop.get("/v1/resources").await.expect_json(200);
    assert_eq!(page["items"].as_array().map(Vec::len), Some(1), "no resource was created");
}

/// The same invalid bodies are 400 validation_failed on dry-run too.
#[tokio::test]
async fn invalid_dry_runs_are_refused() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let before = shop.create_resource("sku-1", 100).await;

    let mut failures = Vec::new();
    for (name, body) in invalid_order_bodies() {
        let reply = post_raw(&shop, "/v1/orders/dry-run", body).await;
        let problem_ok = reply.status() == 400
            && reply.content_type().starts_with("application/problem+json")
            && reply.json()["code"] == "validation_failed";
        if !problem_ok {
            failures.push(format!("{name}: {} {}", reply.status(), reply.text));
        }
    }
    assert!(failures.is_empty(), "not 400 validation_failed:\n{}", failures.join("\n"));
    assert_eq!(shop.state("sku-1").await, before);
}

/// A validation error names the offending field in `detail`.
#[tokio::test]
async fn validation_errors_name_the_field() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;
    let cases = [
        ("qty", r#"{"order_id":"O-1","action":"deduct","lines":[{"key":"sku-1","qty":0}]}"#.to_owned()),
        ("qty", r#"{"order_id":"O-1","action":"deduct","lines":[{"key":"sku-1","qty":1.5}]}"#.to_owned()),
        ("lines", json!({"order_id": "O-1", "action": "deduct", "lines": (0..101).map(|i| json!({"key": format!("k-{i}"), "qty": 1})).collect::<Vec<_>>()}).to_string()),
        ("order_id", r#"{"order_id":"","action":"deduct","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("key", r#"{"order_id":"O-1","action":"deduct","lines":[{"key":"a b","qty":1}]}"#.to_owned()),
        ("coupon", r#"{"order_id":"O-1","action":"deduct","coupon":"x","lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
        ("ttl_seconds", r#"{"order_id":"O-1","action":"deduct","ttl_seconds":5,"lines":[{"key":"sku-1","qty":1}]}"#.to_owned()),
    ];
    for (field, body) in cases {
        let reply = post_raw(&shop, "/v1/orders", body).await;
        let problem = assert_problem(&reply, 400, "validation_failed");
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(field), "detail names {field:?}: {}", reply.text);
    }
    assert_counts(&shop.state("sku-1").await, 100, 0, 0, 100);
}

/// Hostile keys in resource paths are 4xx problem documents and create nothing.
#[tokio::test]
async fn hostile_keys_in_paths_are_client_errors() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let before = shop.create_resource("sku-1", 100).await;
    let long = "k".repeat(201);
    let paths = [
        "/v1/resources/..%2Fx".to_owned(),
        "/v1/resources/a%20b".to_owned(),
        "/v1/resources/sk%C3%BC".to_owned(),
        "/v1/resources/sku-1%00".to_owned(),
        "/v1/resources/%2e%2e".to_owned(),
        format!("/v1/resources/{long}"),
        "/v1/resources/sku-1'%20OR%20'1'='1".to_owned(),
    ];
    for path in &paths {
        assert_client_problem(&shop.get(path).await);
        assert_client_problem(&shop.get(&format!("{path}/ledger")).await);
        assert_client_problem(&shop.patch(path, &json!({"status": "inactive"})).await);
        let adjust = shop.post_with_key(&format!("{path}/adjustments"), &unique("adj"), &json!({"delta": 5})).await;
        assert_client_problem(&adjust);
    }
    assert_eq!(shop.state("sku-1").await, before);
    let page = shop.get("/v1/resources").await.expect_json(200);
    assert_eq!(page["items"].as_array().map(Vec::len), Some(1));
}

/// Resource keys use exactly `[A-Za-z0-9._:@-]`, 1..=200 chars: the edges are accepted.
#[tokio::test]
async fn resource_keys_accept_the_whole_documented_alphabet() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    for key in [
        "a".to_owned(),
        "k".repeat(200),
        "AZaz09._:@-".to_owned(),
        "acct-9:2026-11".to_owned(),
        "user@example.com".to_owned(),
    ] {
        let state = shop.create_resource(&key, 3).await;
        assert_eq!(state["key"], key.as_str());
        assert_eq!(shop.state(&key).await["key"], key.as_str());
        let doc =
            shop.order(&unique("idem"), &crate::helpers::deduct("O-1", &[(key.as_str(), 1)])).await.expect_json(201);
        assert_eq!(doc["lines"][0]["resource"], key.as_str());
        assert_counts(&shop.state(&key).await, 2, 0, 1, 3);
    }
}

/// A 5 MiB body is 413 payload_too_large on every JSON route, and nothing changes.
#[tokio::test]
async fn five_mib_body_is_too_large() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let before = shop.create_resource("sku-1", 100).await;
    let padding = "x".repeat(5 * 1024 * 1024);
    let order =
        format!(r#"{{"order_id":"O-1","action":"deduct","lines":[{{"key":"sku-1","qty":1}}],"pad":"{padding}"}}"#);
    let resource = format!(r#"{{"key":"sku-2","kind":"inventory","total":1,"pad":"{padding}"}}"#);
    let json = ("Content-Type", "application/json");
    for (path, body) in [("/v1/orders", order.clone()), ("/v1/orders/dry-run", order), ("/v1/resources", resource)] {
        let reply = shop.post_over_raw_tcp(path, &[json, ("Idempotency-Key", "big-1")], body.into_bytes()).await;
        assert_problem(&reply, 413, "payload_too_large");
    }

    assert_eq!(shop.state("sku-1").await, before);
    assert_eq!(shop.ledger("sku-1").await.len(), 1);
    assert_problem(&shop.get("/v1/resources/sku-2").await, 404, "resource_not_found");
}

/// A JSON route refuses other content types (and none) with 415 unsupported_media_type;
/// `application/json; charset=utf-8` is JSON.
#[tokio::test]
async fn non_json_content_type_is_unsupported() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let before = shop.create_resource("sku-1", 100).await;
    let body = r#"{"order_id":"O-1","action":"deduct","lines":[{"key":"sku-1","qty":1}]}"#;

    for content_type in [Some("text/plain"), Some("application/xml"), Some("application/x-www-form-urlencoded"), None] {
        let mut request = shop.request(Method::POST, "/v1/orders").header("Idempotency-Key", unique("ct")).body(body);
        if let Some(ct) = content_type {
            request = request.header("content-type", ct);
        }
        let reply = send(request).await;
        assert_problem(&reply, 415, "unsupported_media_type");
    }
    let reply = send(
        shop.request(Method::POST, "/v1/resources")
            .header("content-type", "text/plain")
            .body(r#"{"key":"sku-2","kind":"inventory","total":1}"#),
    )
    .await;
    assert_problem(&reply, 415, "unsupported_media_type");
    assert_eq!(shop.state("sku-1").await, before);

    let reply = send(
        shop.request(Method::POST, "/v1/orders")
            .header("Idempotency-Key", unique("ct"))
            .header("content-type", "application/json; charset=utf-8")
            .body(body),
    )
    .await;
    assert_eq!(reply.expect_json(201)["status"], "succeeded");
}
