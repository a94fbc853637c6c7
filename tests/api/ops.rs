//! Operations endpoints: health, readiness, metrics, OpenAPI, reconciliation, unknown routes.

use reqwest::Method;

use crate::helpers::{
    assert_counts, assert_problem, assert_problem_status, deduct, send, spawn_app, spawn_app_with, AppOptions,
};
use crate::redis_support::TableHold;

/// `/healthz` and `/readyz` answer 200 without credentials.
#[tokio::test]
async fn health_and_readiness_answer_200() {
    let app = spawn_app().await;
    let health = app.get_anonymous("/healthz").await;
    assert_eq!(health.status(), 200, "body: {}", health.text);
    let ready = app.get_anonymous("/readyz").await;
    assert_eq!(ready.status(), 200, "body: {}", ready.text);
}

/// `/metrics` is Prometheus text that counts HTTP requests and deductions after an order.
#[tokio::test]
async fn metrics_count_requests_and_deductions() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.order("idem-1", &deduct("ORD-1", &[("sku-1", 2)])).await.expect_json(201);

    let metrics = app.get_anonymous("/metrics").await;
    assert_eq!(metrics.status(), 200, "body: {}", metrics.text);
    assert!(metrics.content_type().starts_with("text/plain"), "{}", metrics.content_type());
    assert!(metrics.text.contains("stockd_http_requests_total"), "{}", metrics.text);
    assert!(metrics.text.contains("stockd_deductions_total"), "{}", metrics.text);
    assert!(!metrics.text.contains(&shop.api_key), "metrics never show keys");
    assert!(!metrics.text.contains(&app.admin_token), "metrics never show the admin token");
}

/// `/openapi.json` is an OpenAPI 3 document describing the order and resource routes.
#[tokio::test]
async fn openapi_document_describes_the_api() {
    let app = spawn_app().await;
    let reply = app.get_anonymous("/openapi.json").await;
    let doc = reply.expect_json(200);
    let version = doc["openapi"].as_str().expect("openapi is a version string");
    assert!(version.starts_with("3."), "OpenAPI 3, got {version}");
    let paths = doc["paths"].as_object().expect("paths is an object");
    for path in [
        "/v1/orders",
        "/v1/orders/dry-run",
        "/v1/resources",
        "/v1/resources/{key}",
        "/v1/resources/{key}/ledger",
        "/v1/resources/{key}/adjustments",
        "/v1/reservations/{id}",
        "/v1/admin/tenants",
    ] {
        assert!(paths.contains_key(path), "OpenAPI paths include {path}: {:?}", paths.keys());
    }
}

/// Proves docs/API.md (the contract) and `/openapi.json` list the same operations: every
/// method and path of the generated document is a row of the contract's route table, and every
/// row is an operation of the document.
#[tokio::test]
async fn the_contract_and_the_openapi_document_list_the_same_routes() {
    let app = spawn_app().await;
    let doc = app.get_anonymous("/openapi.json").await.expect_json(200);
    let mut served: Vec<String> = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths is an object") {
        for method in item.as_object().expect("a path item is an object").keys() {
            served.push(format!("{} {path}", method.to_uppercase()));
        }
    }
    let contract =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/API.md")).expect("docs/API.md is readable");
    let table = contract.split("| method | path | auth | section |").nth(1).expect("the route table");
    let documented: Vec<String> = table
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            Some(format!("{} {}", cells.get(1)?, cells.get(2)?.trim_matches('`')))
        })
        .collect();
    served.sort();
    let mut documented_sorted = documented.clone();
    documented_sorted.sort();
    assert_eq!(served, documented_sorted, "docs/API.md's route table and /openapi.json differ");
}

/// Reconciliation of a busy tenant checks every resource and finds no drift.
#[tokio::test]
async fn reconciliation_checks_every_resource_and_finds_no_drift() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.assert_reconciliation_clean(0).await;
    for key in ["sku-1", "sku-2", "sku-3"] {
        shop.create_resource(key, 20).await;
    }
    shop.order("o-1", &deduct("ORD-1", &[("sku-1", 2), ("sku-2", 3)])).await.expect_json(201);
    shop.adjust("sku-3", "adj-1", -5).await.expect_json(200);
    shop.assert_reconciliation_clean(3).await;

    assert_problem(&app.get_anonymous("/v1/reconciliation").await, 401, "unauthorized");
}

/// Unknown routes are 404 problem+json `not_found`, with and without credentials.
#[tokio::test]
async fn unknown_route_is_a_not_found_problem() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    assert_problem(&app.get_anonymous("/nope").await, 404, "not_found");
    assert_problem(&shop.get("/v1/nope").await, 404, "not_found");
    assert_problem(&shop.get("/v1/resources/sku-1/nope").await, 404, "not_found");
}

/// A known path with a method it does not serve is a 405 problem document.
#[tokio::test]
async fn wrong_method_is_a_problem_document() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let reply = send(shop.request(Method::DELETE, "/v1/orders")).await;
    assert_problem_status(&reply, 405);
    let reply = send(shop.request(Method::PUT, "/v1/resources")).await;
    assert_problem_status(&reply, 405);
}

/// Proves load beyond `[server] max_in_flight_requests` is shed at once rather than queued:
/// with a limit of 2 and two orders held in flight (the resources table is locked, so their
/// commit waits), another request is answered `503` with `Retry-After` straight away, naming the
/// limit, while `/healthz` still answers; once the lock is released the two held orders commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_in_flight_limit_are_shed_at_once() {
    let opts = AppOptions::default().toml("[server]\nmax_in_flight_requests = 2\n[database]\nbusy_timeout_ms = 60000");
    let app = spawn_app_with(opts).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;

    let hold = TableHold::take(app.database_url()).await;
    let held: Vec<_> = (0..2)
        .map(|n| {
            let shop = shop.clone();
            tokio::spawn(async move {
                let key = format!("held-{n}");
                shop.order(&key, &deduct(&key, &[("sku-1", 1)])).await
            })
        })
        .collect();
    // Both orders are in flight once the gauge says so (`/metrics` is never shed).
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let metrics = app.get_anonymous("/metrics").await;
        if metrics.text.lines().any(|line| line == "stockd_http_requests_in_flight 2") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the two orders never were in flight:\n{}", metrics.text);
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let shed = shop.get("/v1/resources/sku-1").await;
    assert_eq!(shed.status(), 503, "{}", shed.text);
    assert!(shed.header("retry-after").is_some(), "a shed request says when to retry");
    assert!(shed.text.contains("in flight"), "{}", shed.text);
    assert_eq!(app.get_anonymous("/healthz").await.status(), 200, "probes are never shed");

    hold.release().await;
    for order in held {
        let reply = order.await.expect("the held order's task ends");
        assert_eq!(reply.status(), 201, "{}", reply.text);
    }
    assert_counts(&shop.state("sku-1").await, 8, 0, 2, 10);
}
