//! Tenant isolation: another tenant's resources, reservations and idempotency keys answer exactly
//! as if they did not exist.

use serde_json::json;

use crate::helpers::{assert_counts, assert_problem, deduct, reserve, spawn_app, Reply, TenantClient};

/// What a status and body look like for comparison (headers such as dates may differ).
fn shape(reply: &Reply) -> (u16, String, String) {
    (reply.status(), reply.content_type().to_owned(), reply.text.clone())
}

/// Everything tenant `b` can try on resource `key`, without changing anything if it exists.
async fn probe_resource(b: &TenantClient, key: &str, round: &str) -> Vec<(u16, String, String)> {
    vec![
        shape(&b.get(&format!("/v1/resources/{key}")).await),
        shape(&b.get(&format!("/v1/resources/{key}/ledger")).await),
        shape(&b.patch(&format!("/v1/resources/{key}"), &json!({"status": "inactive"})).await),
        shape(&b.adjust(key, &format!("adj-{round}"), -5).await),
    ]
}

/// Tenant B gets exactly the same status and body for A's resource as for a key nobody has.
#[tokio::test]
async fn other_tenants_resource_looks_missing() {
    let app = spawn_app().await;
    let a = app.create_tenant("tenant-a").await;
    let b = app.create_tenant("tenant-b").await;

    // Before anyone has `sku-1`, then after A created it: B must not see a difference.
    let missing = probe_resource(&b, "sku-1", "before").await;
    assert_problem(&b.get("/v1/resources/sku-1").await, 404, "resource_not_found");
    let created = a.create_resource("sku-1", 10).await;
    let hidden = probe_resource(&b, "sku-1", "after").await;
    assert_eq!(hidden, missing);

    assert_eq!(a.state("sku-1").await, created, "B's attempts changed nothing");
    let b_list = b.get("/v1/resources").await.expect_json(200);
    assert_eq!(b_list["items"], json!([]));
    let a_list = a.get("/v1/resources").await.expect_json(200);
    assert_eq!(a_list["items"].as_array().map(Vec::len), Some(1));
}

/// B's order naming A's key is rejected with `resource_not_found` and A's stock is untouched.
#[tokio::test]
async fn other_tenants_resource_cannot_be_ordered() {
    let app = spawn_app().await;
    let a = app.create_tenant("tenant-a").await;
    let b = app.create_tenant("tenant-b").await;
    a.create_resource("sku-1", 10).await;

    let doc = b.order("idem-1", &deduct("ORD-1", &[("sku-1", 1)])).await.expect_json(409);
    assert_eq!(doc["lines"][0]["status"], "rejected");
    assert_eq!(doc["lines"][0]["reason"], "resource_not_found");
    let doc = b.order("idem-2", &reserve("ORD-2", &[("sku-1", 1)], Some(60))).await.expect_json(409);
    assert_eq!(doc["lines"][0]["reason"], "resource_not_found");

    let state = a.state("sku-1").await;
    assert_counts(&state, 10, 0, 0, 10);
    assert_eq!(state["version"], 1);
}

/// Both tenants may use the same resource key; each sees only its own counter.
#[tokio::test]
async fn same_key_in_two_tenants_is_two_resources() {
    let app = spawn_app().await;
    let a = app.create_tenant("tenant-a").await;
    let b = app.create_tenant("tenant-b").await;
    a.create_resource("sku-1", 10).await;
    b.create_resource("sku-1", 50).await;

    a.order("idem-a", &deduct("ORD-A", &[("sku-1", 3)])).await.expect_json(201);
    b.order("idem-b", &deduct("ORD-B", &[("sku-1", 7)])).await.expect_json(201);

    assert_counts(&a.state("sku-1").await, 7, 0, 3, 10);
    assert_counts(&b.state("sku-1").await, 43, 0, 7, 50);
    a.assert_ledger_replays_to_state("sku-1").await;
    b.assert_ledger_replays_to_state("sku-1").await;
    a.assert_reconciliation_clean(1).await;
    b.assert_reconciliation_clean(1).await;
}

/// B gets exactly the same answer for A's reservation as for a made-up id of the same shape,
/// and cannot confirm or release it.
#[tokio::test]
async fn other_tenants_reservation_looks_missing() {
    let app = spawn_app().await;
    let a = app.create_tenant("tenant-a").await;
    let b = app.create_tenant("tenant-b").await;
    a.create_resource("sku-1", 10).await;
    let doc = a.order("idem-1", &reserve("ORD-1", &[("sku-1", 4)], Some(600))).await.expect_json(201);
    let real = doc["reservation_id"].as_str().expect("reservation_id is a string").to_owned();
    // Same length and prefix, different last character: an id that exists nowhere.
    let last = real.chars().last().expect("ids are not empty");
    let fake = format!("{}{}", &real[..real.len() - last.len_utf8()], if last == 'Z' { 'Y' } else { 'Z' });

    // The id itself may appear in the detail; compare with it masked.
    let masked = |reply: Reply, id: &str| -> (u16, String, String) {
        let (status, content_type, text) = shape(&reply);
        (status, content_type, text.replace(id, "<id>"))
    };
    for action in ["", "/confirm", "/release"] {
        let path_real = format!("/v1/reservations/{real}{action}");
        let path_fake = format!("/v1/reservations/{fake}{action}");
        let (hidden, missing) = if action.is_empty() {
            (b.get(&path_real).await, b.get(&path_fake).await)
        } else {
            (b.post_empty(&path_real).await, b.post_empty(&path_fake).await)
        };
        assert_problem(&hidden, 404, "reservation_not_found");
        assert_eq!(masked(hidden, &real), masked(missing, &fake), "action {action:?}");
    }

    let reservation = a.reservation(&real).await.expect_json(200);
    assert_eq!(reservation["state"], "held");
    assert_counts(&a.state("sku-1").await, 6, 4, 0, 10);
}

/// B reusing A's idempotency key (same body) applies B's own order; it is no replay of A's.
#[tokio::test]
async fn idempotency_keys_are_scoped_to_the_tenant() {
    let app = spawn_app().await;
    let a = app.create_tenant("tenant-a").await;
    let b = app.create_tenant("tenant-b").await;
    a.create_resource("sku-1", 10).await;
    b.create_resource("sku-1", 10).await;
    let body = deduct("ORD-1", &[("sku-1", 2)]);

    let first_a = a.order("shared-key", &body).await;
    assert_eq!(first_a.status(), 201);
    let first_b = b.order("shared-key", &body).await;
    assert_eq!(first_b.status(), 201, "body: {}", first_b.text);
    assert!(!first_b.replayed(), "B's request is B's own, not a replay of A's");

    // B reusing another of A's keys with a different body: B's own new request, no mismatch.
    a.order("other-key", &deduct("ORD-2", &[("sku-1", 1)])).await.expect_json(201);
    let reply = b.order("other-key", &deduct("ORD-3", &[("sku-1", 5)])).await;
    assert_eq!(reply.status(), 201, "body: {}", reply.text);
    assert!(!reply.replayed());

    assert_counts(&a.state("sku-1").await, 7, 0, 3, 10);
    assert_counts(&b.state("sku-1").await, 3, 0, 7, 10);

    // And each tenant's replay returns its own outcome.
    let replay_b = b.order("shared-key", &body).await;
    assert!(replay_b.replayed());
    assert_eq!(replay_b.json(), first_b.json());
    assert_counts(&b.state("sku-1").await, 3, 0, 7, 10);
}

/// Reconciliation only counts the calling tenant's resources.
#[tokio::test]
async fn reconciliation_is_scoped_to_the_tenant() {
    let app = spawn_app().await;
    let a = app.create_tenant("tenant-a").await;
    let b = app.create_tenant("tenant-b").await;
    for key in ["a-1", "a-2", "a-3"] {
        a.create_resource(key, 5).await;
    }
    b.create_resource("b-1", 5).await;
    a.assert_reconciliation_clean(3).await;
    b.assert_reconciliation_clean(1).await;
}
