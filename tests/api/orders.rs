//! Orders: deduct, all-or-nothing rejection, the order document, and dry-run.

use serde_json::{json, Value};

use crate::helpers::{assert_counts, assert_problem, deduct, entries_with_op, ops, reserve, spawn_app};

/// A two-line deduct order moves available to consumed on both resources and answers the full
/// order document.
#[tokio::test]
async fn deduct_order_moves_available_to_consumed() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;
    shop.create_resource("sku-2", 100).await;

    let body = json!({
        "order_id": "ORD-10001", "user_id": "u-42", "action": "deduct",
        "lines": [{"key": "sku-1", "qty": 3, "attributes": {"warehouse": "east"}},
                  {"key": "sku-2", "qty": 1}]
    });
    let reply = shop.order("idem-1", &body).await;
    assert_eq!(reply.status(), 201, "body: {}", reply.text);
    assert!(reply.content_type().starts_with("application/json"), "{}", reply.content_type());
    assert!(!reply.replayed(), "a first answer is not a replay");
    let doc = reply.json();
    assert_eq!(
        doc,
        json!({
            "order_id": "ORD-10001", "status": "succeeded", "action": "deduct",
            "reservation_id": null, "expires_at": null,
            "lines": [
                {"key": "sku-1", "resource": "sku-1", "qty": 3, "applied": 3, "status": "applied", "reason": null},
                {"key": "sku-2", "resource": "sku-2", "qty": 1, "applied": 1, "status": "applied", "reason": null}
            ],
            "plugin": {"name": "default", "version": 0}
        })
    );

    let state = shop.state("sku-1").await;
    assert_counts(&state, 97, 0, 3, 100);
    assert_eq!(state["version"], 2);
    assert_counts(&shop.state("sku-2").await, 99, 0, 1, 100);

    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(ops(&ledger), ["create", "deduct"]);
    assert_eq!(ledger[1]["qty"], 3);
    assert_eq!(ledger[1]["order_id"], "ORD-10001");
    assert_eq!(ledger[1]["reservation_id"], Value::Null);
    assert_eq!(ledger[1]["plugin_version"], 0);
    assert_eq!(ledger[1]["available_after"], 97);
    assert_eq!(ledger[1]["consumed_after"], 3);
    let ledger2 = shop.assert_ledger_replays_to_state("sku-2").await;
    assert_eq!(ops(&ledger2), ["create", "deduct"]);
    // Both lines of one order come from the same request.
    assert!(ledger[1]["request_id"].is_string(), "request_id is recorded: {}", ledger[1]);
    assert_eq!(ledger[1]["request_id"], ledger2[1]["request_id"]);
}

/// One short line rejects the whole order: nothing is applied, the short line says
/// `insufficient`, the others `skipped`, and the answer is a 409 order document (not a problem).
#[tokio::test]
async fn order_with_one_short_line_applies_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-a", 10).await;
    shop.create_resource("sku-b", 2).await;
    shop.create_resource("sku-c", 10).await;

    let reply = shop.order("idem-1", &deduct("ORD-1", &[("sku-a", 5), ("sku-b", 3), ("sku-c", 1)])).await;
    assert_eq!(reply.status(), 409, "body: {}", reply.text);
    assert!(
        reply.content_type().starts_with("application/json"),
        "a rejected order is an order document, not problem+json: {}",
        reply.content_type()
    );
    assert_eq!(
        reply.json(),
        json!({
            "order_id": "ORD-1", "status": "rejected", "action": "deduct",
            "reservation_id": null, "expires_at": null,
            "lines": [
                {"key": "sku-a", "resource": "sku-a", "qty": 5, "applied": 0, "status": "skipped", "reason": "skipped"},
                {"key": "sku-b", "resource": "sku-b", "qty": 3, "applied": 0, "status": "rejected", "reason": "insufficient"},
                {"key": "sku-c", "resource": "sku-c", "qty": 1, "applied": 0, "status": "skipped", "reason": "skipped"}
            ],
            "plugin": {"name": "default", "version": 0}
        })
    );

    for (key, total) in [("sku-a", 10), ("sku-b", 2), ("sku-c", 10)] {
        let state = shop.state(key).await;
        assert_counts(&state, total, 0, 0, total);
        assert_eq!(state["version"], 1, "{key} untouched");
        assert_eq!(shop.assert_ledger_replays_to_state(key).await.len(), 1);
    }
}

/// A line naming a resource that does not exist rejects the order with `resource_not_found`.
#[tokio::test]
async fn order_line_on_missing_resource_rejects_the_order() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;

    let reply = shop.order("idem-1", &deduct("ORD-1", &[("sku-1", 1), ("ghost", 1)])).await;
    let doc = reply.expect_json(409);
    assert_eq!(doc["status"], "rejected");
    assert_eq!(doc["lines"][0]["status"], "skipped");
    assert_eq!(doc["lines"][0]["reason"], "skipped");
    assert_eq!(doc["lines"][1]["status"], "rejected");
    assert_eq!(doc["lines"][1]["reason"], "resource_not_found");
    assert_eq!(doc["lines"][1]["applied"], 0);
    assert_counts(&shop.state("sku-1").await, 10, 0, 0, 10);
    assert_problem(&shop.get("/v1/resources/ghost").await, 404, "resource_not_found");
}

/// A rejected order is stored: its retry returns the same 409 and applies nothing, even after
/// stock arrived; a new key then succeeds.
#[tokio::test]
async fn rejected_order_replays_its_rejection_even_after_restock() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 2).await;
    let body = deduct("ORD-1", &[("sku-1", 5)]);

    let first = shop.order("idem-1", &body).await;
    assert_eq!(first.status(), 409, "body: {}", first.text);
    shop.adjust("sku-1", "restock", 10).await.expect_json(200);

    let retry = shop.order("idem-1", &body).await;
    assert_eq!(retry.status(), 409, "body: {}", retry.text);
    assert!(retry.replayed());
    assert_eq!(retry.json(), first.json());
    assert_counts(&shop.state("sku-1").await, 12, 0, 0, 12);

    let fresh = shop.order("idem-2", &body).await;
    assert_eq!(fresh.expect_json(201)["status"], "succeeded");
    assert_counts(&shop.state("sku-1").await, 7, 0, 5, 12);
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(ops(&ledger), ["create", "adjust", "deduct"]);
}

/// Taking exactly what is available succeeds and leaves 0; one more is `insufficient`.
#[tokio::test]
async fn order_can_take_the_last_unit_and_no_more() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 7).await;

    shop.order("idem-1", &deduct("ORD-1", &[("sku-1", 7)])).await.expect_json(201);
    assert_counts(&shop.state("sku-1").await, 0, 0, 7, 7);

    let doc = shop.order("idem-2", &deduct("ORD-2", &[("sku-1", 1)])).await.expect_json(409);
    assert_eq!(doc["lines"][0]["reason"], "insufficient");
    assert_counts(&shop.state("sku-1").await, 0, 0, 7, 7);
    shop.assert_ledger_replays_to_state("sku-1").await;
}

/// A deduct cannot consume stock that is held by a reservation.
#[tokio::test]
async fn deduct_cannot_take_reserved_stock() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 5).await;
    shop.order("r-1", &reserve("R-1", &[("sku-1", 3)], Some(600))).await.expect_json(201);

    let doc = shop.order("d-1", &deduct("D-1", &[("sku-1", 3)])).await.expect_json(409);
    assert_eq!(doc["lines"][0]["reason"], "insufficient");
    shop.order("d-2", &deduct("D-2", &[("sku-1", 2)])).await.expect_json(201);
    assert_counts(&shop.state("sku-1").await, 0, 3, 2, 5);
    shop.assert_ledger_replays_to_state("sku-1").await;
}

/// The upper bounds are inclusive: qty 10^12, 100 lines, a 128-char order_id and user_id.
#[tokio::test]
async fn order_limits_are_inclusive() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("big", 1_000_000_000_000_000).await;
    let doc = shop.order("idem-big", &deduct("ORD-BIG", &[("big", 1_000_000_000_000)])).await.expect_json(201);
    assert_eq!(doc["lines"][0]["applied"], 1_000_000_000_000_i64);
    assert_counts(&shop.state("big").await, 999_000_000_000_000, 0, 1_000_000_000_000, 1_000_000_000_000_000);

    let keys: Vec<String> = (0..100).map(|i| format!("line-{i:03}")).collect();
    for key in &keys {
        shop.create_resource(key, 1).await;
    }
    let lines: Vec<(&str, i64)> = keys.iter().map(|k| (k.as_str(), 1)).collect();
    let mut body = deduct(&"o".repeat(128), &lines);
    body["user_id"] = json!("u".repeat(128));
    let doc = shop.order("idem-100", &body).await.expect_json(201);
    assert_eq!(doc["lines"].as_array().map(Vec::len), Some(100));
    assert_counts(&shop.state("line-000").await, 0, 0, 1, 1);
    assert_counts(&shop.state("line-099").await, 0, 0, 1, 1);
}

/// `user_id` and string line attributes are accepted and do not change the outcome.
#[tokio::test]
async fn order_accepts_user_id_and_attributes() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let body = json!({
        "order_id": "ORD-1", "user_id": "user@example.com", "action": "deduct",
        "lines": [{"key": "sku-1", "qty": 2,
                   "attributes": {"warehouse": "east", "channel": "web", "campaign": "bf-2026"}}]
    });
    let doc = shop.order("idem-1", &body).await.expect_json(201);
    assert_eq!(doc["status"], "succeeded");
    assert_eq!(doc["lines"][0]["applied"], 2);
    assert_counts(&shop.state("sku-1").await, 8, 0, 2, 10);
}

/// Dry-run answers 200 with a plan and the outcome it would produce, and applies and records
/// nothing (no version change, no ledger entry, no idempotency record).
#[tokio::test]
async fn dry_run_reports_the_outcome_and_changes_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 1).await;

    let good = deduct("ORD-1", &[("sku-1", 3)]);
    let reply = shop.post("/v1/orders/dry-run", &good).await;
    let body = reply.expect_json(200);
    assert!(body["plan"].is_object(), "plan is an object: {body}");
    assert_eq!(
        body["outcome"],
        json!({
            "order_id": "ORD-1", "status": "succeeded", "action": "deduct",
            "reservation_id": null, "expires_at": null,
            "lines": [{"key": "sku-1", "resource": "sku-1", "qty": 3, "applied": 3, "status": "applied", "reason": null}],
            "plugin": {"name": "default", "version": 0}
        })
    );

    let short = deduct("ORD-2", &[("sku-1", 3), ("sku-2", 2)]);
    let body = shop.post("/v1/orders/dry-run", &short).await.expect_json(200);
    assert_eq!(body["outcome"]["status"], "rejected");
    assert_eq!(body["outcome"]["lines"][0]["status"], "skipped");
    assert_eq!(body["outcome"]["lines"][1]["reason"], "insufficient");

    // A dry-run reserve creates no reservation either.
    let body = shop.post("/v1/orders/dry-run", &reserve("ORD-3", &[("sku-1", 2)], Some(60))).await.expect_json(200);
    assert_eq!(body["outcome"]["status"], "succeeded");

    for (key, total) in [("sku-1", 10), ("sku-2", 1)] {
        let state = shop.state(key).await;
        assert_counts(&state, total, 0, 0, total);
        assert_eq!(state["version"], 1);
        assert_eq!(shop.ledger(key).await.len(), 1);
    }

    // Nothing was recorded under an idempotency key either: a real order with any key applies.
    let reply = shop.order("idem-after-dry-run", &good).await;
    assert!(!reply.replayed());
    assert_eq!(reply.expect_json(201)["status"], "succeeded");
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(entries_with_op(&ledger, "deduct").len(), 1);
    assert_eq!(entries_with_op(&ledger, "reserve").len(), 0);
}

/// Dry-run validates its body like a real order.
#[tokio::test]
async fn dry_run_validates_like_an_order() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    for body in [
        deduct("ORD-1", &[("sku-1", 0)]),
        json!({"order_id": "ORD-1", "action": "deduct", "lines": []}),
        json!({"order_id": "ORD-1", "action": "deduct", "lines": [{"key": "sku-1", "qty": 1}], "extra": 1}),
    ] {
        let reply = shop.post("/v1/orders/dry-run", &body).await;
        assert_problem(&reply, 400, "validation_failed");
    }
}
