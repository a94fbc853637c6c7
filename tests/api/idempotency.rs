//! Idempotency keys on orders: replay, mismatch, missing and malformed keys.

use reqwest::header::HeaderValue;
use reqwest::Method;
use serde_json::json;

use crate::helpers::{assert_counts, assert_problem, deduct, entries_with_op, send, spawn_app};

/// The same key and body sent again answers the same status and body with
/// `Idempotent-Replayed: true` and applies nothing the second time.
#[tokio::test]
async fn replayed_order_is_applied_once() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let body = deduct("ORD-1", &[("sku-1", 3)]);

    let first = shop.order("idem-1", &body).await;
    assert_eq!(first.status(), 201, "body: {}", first.text);
    assert!(!first.replayed());
    for _ in 0..3 {
        let again = shop.order("idem-1", &body).await;
        assert_eq!(again.status(), 201);
        assert!(again.replayed(), "replay carries Idempotent-Replayed: true");
        assert_eq!(again.json(), first.json());
    }

    assert_counts(&shop.state("sku-1").await, 7, 0, 3, 10);
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(entries_with_op(&ledger, "deduct").len(), 1);
}

/// The body is compared canonically: the same JSON with other field order and whitespace is the
/// same request and replays.
#[tokio::test]
async fn reordered_json_is_the_same_request() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;

    let compact = r#"{"order_id":"ORD-1","action":"deduct","lines":[{"key":"sku-1","qty":2}]}"#;
    let reordered =
        "{ \"lines\": [ { \"qty\": 2, \"key\": \"sku-1\" } ],\n  \"action\": \"deduct\", \"order_id\": \"ORD-1\" }";
    let raw = |text: &'static str| {
        shop.request(Method::POST, "/v1/orders")
            .header("Idempotency-Key", "idem-1")
            .header("content-type", "application/json")
            .body(text)
    };
    let first = send(raw(compact)).await;
    assert_eq!(first.status(), 201, "body: {}", first.text);
    let second = send(raw(reordered)).await;
    assert_eq!(second.status(), 201, "body: {}", second.text);
    assert!(second.replayed());
    assert_eq!(second.json(), first.json());
    assert_counts(&shop.state("sku-1").await, 8, 0, 2, 10);
}

/// The same key with a different body is 422 idempotency_key_mismatch and applies nothing.
#[tokio::test]
async fn same_key_with_another_body_is_a_mismatch() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 10).await;

    shop.order("idem-1", &deduct("ORD-1", &[("sku-1", 3)])).await.expect_json(201);

    for other in [
        deduct("ORD-1", &[("sku-1", 4)]),
        deduct("ORD-2", &[("sku-1", 3)]),
        deduct("ORD-1", &[("sku-2", 3)]),
        json!({"order_id": "ORD-1", "action": "reserve", "lines": [{"key": "sku-1", "qty": 3}]}),
    ] {
        let reply = shop.order("idem-1", &other).await;
        assert_problem(&reply, 422, "idempotency_key_mismatch");
    }
    assert_counts(&shop.state("sku-1").await, 7, 0, 3, 10);
    assert_counts(&shop.state("sku-2").await, 10, 0, 0, 10);
    assert_eq!(shop.state("sku-2").await["version"], 1);
}

/// The same key on another path (an adjustment) is a different request: 422, nothing applied.
#[tokio::test]
async fn same_key_on_another_path_is_a_mismatch() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.order("idem-1", &deduct("ORD-1", &[("sku-1", 3)])).await.expect_json(201);

    let reply = shop.adjust("sku-1", "idem-1", 5).await;
    assert_problem(&reply, 422, "idempotency_key_mismatch");
    assert_counts(&shop.state("sku-1").await, 7, 0, 3, 10);
}

/// An order without `Idempotency-Key` is 400 idempotency_key_missing and applies nothing.
#[tokio::test]
async fn order_without_idempotency_key_is_refused() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;

    let reply = shop.post("/v1/orders", &deduct("ORD-1", &[("sku-1", 1)])).await;
    assert_problem(&reply, 400, "idempotency_key_missing");
    let state = shop.state("sku-1").await;
    assert_counts(&state, 10, 0, 0, 10);
    assert_eq!(state["version"], 1);
}

/// Keys longer than 255 chars or with characters outside visible ASCII are 400
/// validation_failed; a 255-char key of visible ASCII is fine.
#[tokio::test]
async fn malformed_idempotency_keys_are_refused() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let body = deduct("ORD-1", &[("sku-1", 1)]);

    let too_long = "k".repeat(256);
    let bad: Vec<HeaderValue> = vec![
        HeaderValue::from_str(&too_long).expect("ASCII is a valid header value"),
        HeaderValue::from_static("a b"),
        HeaderValue::from_static("tab\there"),
        HeaderValue::from_bytes("ключ".as_bytes()).expect("obs-text is a valid header value"),
    ];
    for key in bad {
        let reply =
            send(shop.request(Method::POST, "/v1/orders").header("Idempotency-Key", key.clone()).json(&body)).await;
        assert_problem(&reply, 400, "validation_failed");
    }

    // An empty key is not a key: refused as missing or invalid, never applied.
    let empty = send(shop.request(Method::POST, "/v1/orders").header("Idempotency-Key", "").json(&body)).await;
    let problem = crate::helpers::assert_client_problem(&empty);
    assert_eq!(empty.status(), 400);
    assert!(
        problem["code"] == "validation_failed" || problem["code"] == "idempotency_key_missing",
        "empty key: {problem}"
    );
    assert_counts(&shop.state("sku-1").await, 10, 0, 0, 10);

    let longest = "!~".repeat(127) + "k";
    assert_eq!(longest.len(), 255);
    shop.order(&longest, &body).await.expect_json(201);
    let again = shop.order(&longest, &body).await;
    assert!(again.replayed());
    assert_counts(&shop.state("sku-1").await, 9, 0, 1, 10);
}
