//! Resources: create, read, list, PATCH status, adjustments, and the ledger endpoint.

use serde_json::{json, Value};

use crate::helpers::{assert_counts, assert_problem, deduct, entries_with_op, ops, reserve, spawn_app, unique};

/// A new resource starts full: available == total, version 1, one `create` ledger entry.
#[tokio::test]
async fn created_resource_starts_full_with_one_create_entry() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;

    let reply =
        shop.post("/v1/resources", &json!({"key": "sku-1:wh-east:owner-7", "kind": "inventory", "total": 100})).await;
    let state = reply.expect_json(201);
    assert_eq!(state["key"], "sku-1:wh-east:owner-7");
    assert_eq!(state["kind"], "inventory");
    assert_eq!(state["status"], "active");
    assert_counts(&state, 100, 0, 0, 100);
    assert_eq!(state["buckets"], 1);
    assert_eq!(state["mode"], "db");
    assert_eq!(state["version"], 1);
    let updated_at = state["updated_at"].as_str().expect("updated_at is a string");
    chrono::DateTime::parse_from_rfc3339(updated_at).expect("updated_at is RFC 3339");

    assert_eq!(shop.state("sku-1:wh-east:owner-7").await, state, "GET shows the same state");

    let ledger = shop.assert_ledger_replays_to_state("sku-1:wh-east:owner-7").await;
    assert_eq!(ledger.len(), 1);
    let create = &ledger[0];
    assert_eq!(create["op"], "create");
    assert_eq!(create["qty"], 100);
    assert_eq!(create["available_after"], 100);
    assert_eq!(create["reserved_after"], 0);
    assert_eq!(create["consumed_after"], 0);
    assert_eq!(create["order_id"], Value::Null);
    assert_eq!(create["reservation_id"], Value::Null);
    chrono::DateTime::parse_from_rfc3339(create["at"].as_str().expect("at is a string")).expect("at is RFC 3339");
}

/// Every documented kind is accepted, explicit `buckets: 1` and `mode: "db"` too.
#[tokio::test]
async fn every_documented_kind_can_be_created() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    for kind in ["inventory", "balance", "coupon", "quota"] {
        let state = shop.create_resource_of_kind(&format!("r-{kind}"), kind, 5).await;
        assert_eq!(state["kind"], kind);
    }
    let reply = shop
        .post("/v1/resources", &json!({"key": "explicit", "kind": "balance", "total": 0, "buckets": 1, "mode": "db"}))
        .await;
    let state = reply.expect_json(201);
    assert_counts(&state, 0, 0, 0, 0);
    assert_eq!(state["buckets"], 1);
    assert_eq!(state["mode"], "db");
}

/// The largest allowed total (10^15) is accepted; one more is refused.
#[tokio::test]
async fn total_is_bounded_by_ten_to_the_fifteen() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let state = shop.create_resource("big", 1_000_000_000_000_000).await;
    assert_counts(&state, 1_000_000_000_000_000, 0, 0, 1_000_000_000_000_000);

    let reply = shop
        .post("/v1/resources", &json!({"key": "bigger", "kind": "inventory", "total": 1_000_000_000_000_001_i64}))
        .await;
    assert_problem(&reply, 400, "validation_failed");
    assert_problem(&shop.get("/v1/resources/bigger").await, 404, "resource_not_found");
}

/// Bad resource bodies are 400 validation_failed and create nothing.
#[tokio::test]
async fn invalid_resource_bodies_create_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let bad_bodies = [
        json!({"key": "r", "total": 10}),
        json!({"key": "r", "kind": "gold", "total": 10}),
        json!({"key": "r", "kind": "inventory"}),
        json!({"key": "r", "kind": "inventory", "total": -1}),
        json!({"key": "r", "kind": "inventory", "total": 1.5}),
        json!({"key": "r", "kind": "inventory", "total": "10"}),
        json!({"key": "r", "kind": "inventory", "total": 10, "buckets": 1025}),
        json!({"key": "r", "kind": "inventory", "total": 10, "buckets": 0}),
        json!({"key": "r", "kind": "inventory", "total": 10, "mode": "redis"}),
        json!({"key": "r", "kind": "inventory", "total": 10, "mode": "memory"}),
        json!({"key": "r", "kind": "inventory", "total": 10, "colour": "red"}),
        json!({"kind": "inventory", "total": 10}),
        json!({"key": "a b", "kind": "inventory", "total": 10}),
        json!({"key": "", "kind": "inventory", "total": 10}),
        json!({"key": "x".repeat(201), "kind": "inventory", "total": 10}),
    ];
    for body in bad_bodies {
        let reply = shop.post("/v1/resources", &body).await;
        assert_eq!(reply.status(), 400, "body {body} answered {}", reply.text);
        assert_problem(&reply, 400, "validation_failed");
    }
    let page = shop.get("/v1/resources").await.expect_json(200);
    assert_eq!(page["items"], json!([]));
}

/// Creating a key twice is 409 resource_exists and leaves the first resource untouched.
#[tokio::test]
async fn duplicate_resource_is_a_conflict_and_changes_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let first = shop.create_resource("sku-1", 10).await;

    let reply = shop.post("/v1/resources", &json!({"key": "sku-1", "kind": "balance", "total": 99})).await;
    assert_problem(&reply, 409, "resource_exists");

    assert_eq!(shop.state("sku-1").await, first);
    assert_eq!(shop.ledger("sku-1").await.len(), 1);
}

/// A key that was never created is 404 resource_not_found on every resource route.
#[tokio::test]
async fn unknown_resource_is_not_found_everywhere() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    assert_problem(&shop.get("/v1/resources/nope").await, 404, "resource_not_found");
    assert_problem(&shop.get("/v1/resources/nope/ledger").await, 404, "resource_not_found");
    assert_problem(&shop.patch("/v1/resources/nope", &json!({"status": "inactive"})).await, 404, "resource_not_found");
    assert_problem(&shop.adjust("nope", "adj-1", 5).await, 404, "resource_not_found");
    assert_problem(&shop.get("/v1/resources/nope").await, 404, "resource_not_found");
}

/// The list is ordered by key, filtered by prefix, and paged with an exclusive `after`.
#[tokio::test]
async fn resource_list_pages_by_key_with_prefix() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    for key in ["a-3", "b-1", "a-1", "a-5", "a-2", "a-4"] {
        shop.create_resource(key, 1).await;
    }

    let keys = |page: &Value| -> Vec<String> {
        page["items"]
            .as_array()
            .expect("items is an array")
            .iter()
            .map(|s| s["key"].as_str().unwrap_or("").to_owned())
            .collect()
    };

    let all = shop.get("/v1/resources").await.expect_json(200);
    assert_eq!(keys(&all), ["a-1", "a-2", "a-3", "a-4", "a-5", "b-1"]);
    assert_eq!(all["next_after"], Value::Null);
    assert_eq!(all["items"][0]["total"], 1, "items are full states: {all}");
    assert_eq!(all["items"][0]["version"], 1, "items are full states: {all}");

    let page1 = shop.get("/v1/resources?prefix=a-&limit=2").await.expect_json(200);
    assert_eq!(keys(&page1), ["a-1", "a-2"]);
    assert_eq!(page1["next_after"], "a-2");
    let page2 = shop.get("/v1/resources?prefix=a-&limit=2&after=a-2").await.expect_json(200);
    assert_eq!(keys(&page2), ["a-3", "a-4"]);
    assert_eq!(page2["next_after"], "a-4");
    let page3 = shop.get("/v1/resources?prefix=a-&limit=2&after=a-4").await.expect_json(200);
    assert_eq!(keys(&page3), ["a-5"]);
    assert_eq!(page3["next_after"], Value::Null);

    let b_only = shop.get("/v1/resources?prefix=b").await.expect_json(200);
    assert_eq!(keys(&b_only), ["b-1"]);
    let none = shop.get("/v1/resources?prefix=zzz").await.expect_json(200);
    assert_eq!(keys(&none), Vec::<String>::new());
    assert_eq!(none["next_after"], Value::Null);
}

/// Without `limit` a page holds 100 states, and the cursor leads to the rest.
#[tokio::test]
async fn resource_list_defaults_to_pages_of_one_hundred() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    for i in 0..103 {
        shop.create_resource(&format!("k-{i:03}"), 1).await;
    }
    let page1 = shop.get("/v1/resources").await.expect_json(200);
    assert_eq!(page1["items"].as_array().map(Vec::len), Some(100));
    assert_eq!(page1["items"][99]["key"], "k-099");
    assert_eq!(page1["next_after"], "k-099");
    let page2 = shop.get("/v1/resources?after=k-099").await.expect_json(200);
    assert_eq!(page2["items"].as_array().map(Vec::len), Some(3));
    assert_eq!(page2["items"][0]["key"], "k-100");
    assert_eq!(page2["next_after"], Value::Null);
}

/// An inactive resource refuses orders with `resource_inactive`; activating it again restores it.
#[tokio::test]
async fn inactive_resource_refuses_orders_until_reactivated() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 10).await;

    let state = shop.patch("/v1/resources/sku-1", &json!({"status": "inactive"})).await.expect_json(200);
    assert_eq!(state["status"], "inactive");
    assert_counts(&state, 10, 0, 0, 10);
    assert_eq!(shop.state("sku-1").await["status"], "inactive");

    let reply = shop.order("o-1", &deduct("o-1", &[("sku-2", 1), ("sku-1", 1)])).await;
    let doc = reply.expect_json(409);
    assert_eq!(doc["status"], "rejected");
    assert_eq!(doc["lines"][0]["status"], "skipped");
    assert_eq!(doc["lines"][0]["reason"], "skipped");
    assert_eq!(doc["lines"][1]["status"], "rejected");
    assert_eq!(doc["lines"][1]["reason"], "resource_inactive");

    let reply = shop.order("o-2", &reserve("o-2", &[("sku-1", 1)], Some(60))).await;
    let doc = reply.expect_json(409);
    assert_eq!(doc["lines"][0]["reason"], "resource_inactive");
    assert_eq!(doc["reservation_id"], Value::Null);

    let state = shop.patch("/v1/resources/sku-1", &json!({"status": "active"})).await.expect_json(200);
    assert_eq!(state["status"], "active");
    let reply = shop.order("o-3", &deduct("o-3", &[("sku-1", 4)])).await;
    assert_eq!(reply.expect_json(201)["status"], "succeeded");
    assert_counts(&shop.state("sku-1").await, 6, 0, 4, 10);
    assert_counts(&shop.state("sku-2").await, 10, 0, 0, 10);
    shop.assert_ledger_replays_to_state("sku-1").await;
    shop.assert_ledger_replays_to_state("sku-2").await;
}

/// PATCH without a change, with an unknown field or with an unknown status is 400.
#[tokio::test]
async fn patch_needs_a_known_change() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let before = shop.create_resource("sku-1", 10).await;
    for body in [
        json!({}),
        json!({"status": "paused"}),
        json!({"colour": "red"}),
        json!({"status": "inactive", "total": 5}),
        json!({"buckets": 4}),
        json!({"mode": "redis"}),
        json!({"status": true}),
    ] {
        let reply = shop.patch("/v1/resources/sku-1", &body).await;
        assert_problem(&reply, 400, "validation_failed");
    }
    assert_eq!(shop.state("sku-1").await, before);
}

/// A restock and a write-off move total and available and are recorded as signed `adjust` entries.
#[tokio::test]
async fn adjustments_move_total_and_are_ledgered() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;

    let state = shop.adjust("sku-1", "restock-1", 50).await.expect_json(200);
    assert_counts(&state, 150, 0, 0, 150);
    assert_eq!(state["version"], 2);

    let state = shop.adjust("sku-1", "writeoff-1", -30).await.expect_json(200);
    assert_counts(&state, 120, 0, 0, 120);
    assert_eq!(state["version"], 3);

    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(ops(&ledger), ["create", "adjust", "adjust"]);
    assert_eq!(ledger[1]["qty"], 50);
    assert_eq!(ledger[2]["qty"], -30);
    assert_eq!(ledger[2]["available_after"], 120);
}

/// A replayed adjustment is applied once and answers the same body with `Idempotent-Replayed`.
#[tokio::test]
async fn replayed_adjustment_is_applied_once() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;

    let first = shop.adjust("sku-1", "restock-1", 25).await;
    assert_eq!(first.status(), 200, "body: {}", first.text);
    assert!(!first.replayed());
    let second = shop.adjust("sku-1", "restock-1", 25).await;
    assert_eq!(second.status(), 200);
    assert!(second.replayed(), "replay carries Idempotent-Replayed: true");
    assert_eq!(second.json(), first.json());

    assert_counts(&shop.state("sku-1").await, 125, 0, 0, 125);
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(entries_with_op(&ledger, "adjust").len(), 1);

    // The same key with another delta is a different request.
    let mismatch = shop.adjust("sku-1", "restock-1", 26).await;
    assert_problem(&mismatch, 422, "idempotency_key_mismatch");
    assert_counts(&shop.state("sku-1").await, 125, 0, 0, 125);
}

/// A write-off larger than what is available is 409 insufficient, changes nothing, and replays
/// as the same 409.
#[tokio::test]
async fn write_off_beyond_available_is_refused_and_replayed() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    // Hold 6 so available (4) is below total (10): the check is against available.
    let held = shop.order("r-1", &reserve("r-1", &[("sku-1", 6)], Some(600))).await;
    held.expect_json(201);
    let before = shop.state("sku-1").await;
    assert_counts(&before, 4, 6, 0, 10);

    let reply = shop.adjust("sku-1", "writeoff-1", -5).await;
    assert_problem(&reply, 409, "insufficient");
    assert_eq!(shop.state("sku-1").await, before);

    let replay = shop.adjust("sku-1", "writeoff-1", -5).await;
    assert_problem(&replay, 409, "insufficient");
    assert!(replay.replayed(), "the stored 409 is replayed");
    assert_eq!(replay.json(), reply.json());

    // Exactly what is available can be written off.
    let state = shop.adjust("sku-1", "writeoff-2", -4).await.expect_json(200);
    assert_counts(&state, 0, 6, 0, 6);
    shop.assert_ledger_replays_to_state("sku-1").await;
}

/// Adjustment bodies: delta must be a non-zero integer within ±10^12, reason at most 200 chars,
/// and the Idempotency-Key header is required.
#[tokio::test]
async fn invalid_adjustments_change_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let before = shop.create_resource("sku-1", 100).await;
    let path = "/v1/resources/sku-1/adjustments";

    let missing = shop.post(path, &json!({"delta": 5})).await;
    assert_problem(&missing, 400, "idempotency_key_missing");

    let bad_bodies = [
        json!({"delta": 0}),
        json!({"delta": 1_000_000_000_001_i64}),
        json!({"delta": -1_000_000_000_001_i64}),
        json!({"delta": 1.5}),
        json!({"delta": "5"}),
        json!({}),
        json!({"delta": 5, "reason": "r".repeat(201)}),
        json!({"delta": 5, "note": "unknown field"}),
    ];
    for body in bad_bodies {
        let reply = shop.post_with_key(path, &unique("adj"), &body).await;
        assert_problem(&reply, 400, "validation_failed");
    }
    assert_eq!(shop.state("sku-1").await, before);

    // The bounds themselves are fine.
    let state = shop
        .post_with_key(path, "max", &json!({"delta": 1_000_000_000_000_i64, "reason": "r".repeat(200)}))
        .await
        .expect_json(200);
    assert_counts(&state, 1_000_000_000_100, 0, 0, 1_000_000_000_100);
}

/// The ledger pages oldest first with `after` = seq, and `next_after` is the last seq as a string.
#[tokio::test]
async fn ledger_pages_oldest_first_by_seq() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    for i in 1..=4 {
        shop.adjust("sku-1", &format!("adj-{i}"), i).await.expect_json(200);
    }

    let page1 = shop.get("/v1/resources/sku-1/ledger?limit=2").await.expect_json(200);
    let items1 = page1["items"].as_array().expect("items is an array").clone();
    assert_eq!(ops(&items1), ["create", "adjust"]);
    assert_eq!(items1[1]["qty"], 1);
    let seq = items1[1]["seq"].as_i64().expect("seq is an integer");
    assert_eq!(page1["next_after"], seq.to_string());

    let page2 = shop.get(&format!("/v1/resources/sku-1/ledger?limit=2&after={seq}")).await.expect_json(200);
    let items2 = page2["items"].as_array().expect("items is an array").clone();
    assert_eq!(items2.iter().map(|e| e["qty"].clone()).collect::<Vec<_>>(), [json!(2), json!(3)]);
    let seq2 = items2[1]["seq"].as_i64().expect("seq is an integer");
    assert_eq!(page2["next_after"], seq2.to_string());

    let page3 = shop.get(&format!("/v1/resources/sku-1/ledger?limit=2&after={seq2}")).await.expect_json(200);
    let items3 = page3["items"].as_array().expect("items is an array").clone();
    assert_eq!(items3.len(), 1);
    assert_eq!(items3[0]["qty"], 4);
    assert_eq!(items3[0]["available_after"], 20);
    assert_eq!(page3["next_after"], Value::Null);

    let all = shop.get("/v1/resources/sku-1/ledger").await.expect_json(200);
    assert_eq!(all["items"].as_array().map(Vec::len), Some(5));
    assert_eq!(all["next_after"], Value::Null);
    let entries = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(entries.len(), 5);
}

/// `newest=true` pages the ledger from its end: the last entries, oldest first, and no cursor
/// (nothing is newer yet); not together with `after`.
#[tokio::test]
async fn the_newest_ledger_entries_come_oldest_first_without_a_cursor() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    for i in 1..=4 {
        shop.adjust("sku-1", &format!("adj-{i}"), i).await.expect_json(200);
    }
    let page = shop.get("/v1/resources/sku-1/ledger?newest=true&limit=2").await.expect_json(200);
    let items = page["items"].as_array().expect("items is an array").clone();
    assert_eq!(items.iter().map(|e| e["qty"].clone()).collect::<Vec<_>>(), [json!(3), json!(4)], "{page}");
    assert!(items[0]["seq"].as_i64() < items[1]["seq"].as_i64(), "{page}");
    assert_eq!(page["next_after"], Value::Null, "{page}");
    let whole = shop.get("/v1/resources/sku-1/ledger?newest=true").await.expect_json(200);
    assert_eq!(
        ops(whole["items"].as_array().expect("items is an array")),
        ["create", "adjust", "adjust", "adjust", "adjust"]
    );
    assert_problem(&shop.get("/v1/resources/sku-1/ledger?newest=true&after=1").await, 400, "validation_failed");
}
