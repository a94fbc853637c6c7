//! Orders read from the ledger (`GET /v1/orders/{order_id}`) and reversals (`POST
//! /v1/orders/{order_id}/reversals`): consumed back to available on the resource and bucket the
//! order took from, never more than it took minus earlier reversals (also under a race across
//! processes), replayed by key, all or nothing, with the per-user limit given back; in redis
//! mode through Redis and settled like a sale.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use serde_json::{json, Value};
use tokio::sync::Barrier;

use crate::helpers::{
    assert_counts, assert_problem, deduct, entries_with_op, plugin_wasm, reserve, spawn_app, spawn_app_with, unique,
    AppOptions, Backend, Reply, TenantClient,
};
use crate::redis_support::{
    create_redis_resource, deduct_one, reconciliation, redis_app, redis_entry, shared_redis_url, SETTLE_DEADLINE,
};

fn reversal_path(order_id: &str) -> String {
    format!("/v1/orders/{order_id}/reversals")
}

async fn reverse(shop: &TenantClient, order_id: &str, key: &str, body: &Value) -> Reply {
    shop.post_with_key(&reversal_path(order_id), key, body).await
}

fn lines(lines: &[(&str, i64)]) -> Value {
    json!({"lines": lines.iter().map(|(k, q)| json!({"key": k, "qty": q})).collect::<Vec<_>>(), "reason": "returned"})
}

/// The order's line of `key`.
#[track_caller]
fn line<'a>(order: &'a Value, key: &str) -> &'a Value {
    order["lines"]
        .as_array()
        .and_then(|l| l.iter().find(|l| l["key"] == key))
        .unwrap_or_else(|| panic!("order has a line {key}: {order}"))
}

/// Proves the lookup reads the order from the ledger, and that an order this tenant never
/// applied, or another tenant's, answers 404 `order_not_found` on both routes, exactly alike.
#[tokio::test]
async fn an_order_is_read_from_its_ledger_and_another_tenants_is_not_found() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let other = app.create_tenant("other").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 10).await;
    shop.order("k-1", &deduct("ORD-1", &[("sku-1", 3), ("sku-2", 1)])).await.expect_json(201);

    let order = shop.get("/v1/orders/ORD-1").await.expect_json(200);
    assert_eq!(order["order_id"], "ORD-1");
    let one = line(&order, "sku-1");
    assert_eq!((&one["resource"], &one["deducted"], &one["held"]), (&json!("sku-1"), &json!(3), &json!(0)));
    assert_eq!((&one["reversed"], &one["reversible"]), (&json!(0), &json!(3)));
    assert_eq!(line(&order, "sku-2")["reversible"], 1);

    let unknown = assert_problem(&shop.get("/v1/orders/ORD-404").await, 404, "order_not_found");
    let foreign = assert_problem(&other.get("/v1/orders/ORD-1").await, 404, "order_not_found");
    assert_eq!(unknown, foreign);
    let r1 = assert_problem(&reverse(&other, "ORD-1", "r-x", &json!({})).await, 404, "order_not_found");
    let r2 = assert_problem(&reverse(&shop, "ORD-404", "r-x", &json!({})).await, 404, "order_not_found");
    assert_eq!(r1, r2);
    assert_counts(&shop.state("sku-1").await, 7, 0, 3, 10);
}

/// Proves a partial reversal gives back exactly its quantity, its replay returns the first
/// outcome byte for byte, the same key with another body is a mismatch, "everything" takes
/// what is left, and a reversal beyond that is a stored `409 exceeds_reversible`; the ledger
/// replays to the state and reconciliation finds no drift.
#[tokio::test]
async fn reversals_give_back_what_the_order_took_once_and_replay_their_first_outcome() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 10).await;
    shop.order("k-1", &deduct("ORD-1", &[("sku-1", 3), ("sku-2", 1)])).await.expect_json(201);

    let first = reverse(&shop, "ORD-1", "rev-1", &lines(&[("sku-1", 2)])).await;
    let doc = first.expect_json(201);
    assert_eq!((&doc["order_id"], &doc["reason"]), (&json!("ORD-1"), &json!("returned")));
    assert!(doc["reversal_id"].as_str().is_some_and(|id| id.starts_with("rev_")), "{doc}");
    assert_eq!(doc["lines"], json!([{"key": "sku-1", "resource": "sku-1", "qty": 2}]));
    assert_counts(&shop.state("sku-1").await, 9, 0, 1, 10);

    let replay = reverse(&shop, "ORD-1", "rev-1", &lines(&[("sku-1", 2)])).await;
    assert_eq!((replay.status(), &replay.text, replay.replayed()), (201, &first.text, true));
    assert_problem(&reverse(&shop, "ORD-1", "rev-1", &lines(&[("sku-1", 1)])).await, 422, "idempotency_key_mismatch");
    assert_counts(&shop.state("sku-1").await, 9, 0, 1, 10);

    let rest = reverse(&shop, "ORD-1", "rev-2", &json!({})).await.expect_json(201);
    assert_eq!(rest["reason"], Value::Null);
    assert_eq!(
        rest["lines"],
        json!([
            {"key": "sku-1", "resource": "sku-1", "qty": 1},
            {"key": "sku-2", "resource": "sku-2", "qty": 1}
        ])
    );
    let beyond = reverse(&shop, "ORD-1", "rev-3", &lines(&[("sku-1", 1)])).await;
    assert_problem(&beyond, 409, "exceeds_reversible");
    let again = reverse(&shop, "ORD-1", "rev-3", &lines(&[("sku-1", 1)])).await;
    assert_eq!((again.status(), &again.text, again.replayed()), (409, &beyond.text, true));
    assert_problem(&reverse(&shop, "ORD-1", "rev-4", &json!({})).await, 409, "exceeds_reversible");

    let order = shop.get("/v1/orders/ORD-1").await.expect_json(200);
    assert_eq!((&line(&order, "sku-1")["reversed"], &line(&order, "sku-1")["reversible"]), (&json!(3), &json!(0)));
    for key in ["sku-1", "sku-2"] {
        assert_counts(&shop.state(key).await, 10, 0, 0, 10);
        let ledger = shop.assert_ledger_replays_to_state(key).await;
        let reversals = entries_with_op(&ledger, "reverse");
        assert!(reversals.iter().all(|e| e["order_id"] == "ORD-1" && e["reverses"].is_string()), "{ledger:?}");
    }
    shop.assert_reconciliation_clean(2).await;
    let events = shop.get("/v1/events?types=order.reversed").await.expect_json(200);
    let data: Vec<&Value> =
        events["items"].as_array().map(|i| i.iter().map(|e| &e["data"]).collect()).unwrap_or_default();
    assert_eq!(data.len(), 2, "{events}");
    assert_eq!(data[0]["reversal_id"], doc["reversal_id"]);
    assert_eq!(data[0]["lines"], doc["lines"]);
}

/// Proves a multi-line reversal is all or nothing, and that the body is bounded.
#[tokio::test]
async fn a_multi_line_reversal_with_one_line_beyond_its_take_applies_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 10).await;
    shop.order("k-1", &deduct("ORD-1", &[("sku-1", 3), ("sku-2", 1)])).await.expect_json(201);

    let refused = reverse(&shop, "ORD-1", "rev-1", &lines(&[("sku-1", 1), ("sku-2", 2)])).await;
    assert!(assert_problem(&refused, 409, "exceeds_reversible")["detail"]
        .as_str()
        .is_some_and(|d| d.contains("sku-2")));
    assert_problem(&reverse(&shop, "ORD-1", "rev-2", &lines(&[("sku-9", 1)])).await, 409, "exceeds_reversible");
    assert_counts(&shop.state("sku-1").await, 7, 0, 3, 10);
    assert_counts(&shop.state("sku-2").await, 9, 0, 1, 10);

    let long = json!({"reason": "x".repeat(501)});
    for bad in [
        long,
        json!({"lines": []}),
        lines(&[("sku-1", 0)]),
        lines(&[("sku-1", 1), ("sku-1", 1)]),
        json!({"lines": [{"key": "sku-1", "qty": 1, "extra": 1}]}),
    ] {
        assert_problem(&reverse(&shop, "ORD-1", &unique("bad"), &bad).await, 400, "validation_failed");
    }
    let missing = shop.post(&reversal_path("ORD-1"), &json!({})).await;
    assert_problem(&missing, 400, "idempotency_key_missing");
    shop.order("k-2", &deduct("ORD-1", &[("sku-1", 1)])).await.expect_json(201);
    let order = shop.get("/v1/orders/ORD-1").await.expect_json(200);
    assert_eq!(line(&order, "sku-1")["deducted"], 4, "two requests of one order id are one order: {order}");
}

/// Proves a held reservation is not reversible (`409 reservation_held`: release it), a
/// confirmed one is, and a released one has nothing left to reverse.
#[tokio::test]
async fn a_held_reservation_is_refused_and_a_confirmed_one_is_reversible() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let held = shop.order("k-1", &reserve("ORD-H", &[("sku-1", 4)], None)).await.expect_json(201);
    let id = held["reservation_id"].as_str().expect("a reservation id").to_owned();
    assert_eq!(line(&shop.get("/v1/orders/ORD-H").await.expect_json(200), "sku-1")["held"], 4);
    assert_problem(&reverse(&shop, "ORD-H", "rev-1", &json!({})).await, 409, "reservation_held");
    assert_problem(&reverse(&shop, "ORD-H", "rev-2", &lines(&[("sku-1", 1)])).await, 409, "reservation_held");
    assert_counts(&shop.state("sku-1").await, 6, 4, 0, 10);

    shop.post_empty(&format!("/v1/reservations/{id}/confirm")).await.expect_json(200);
    let order = shop.get("/v1/orders/ORD-H").await.expect_json(200);
    assert_eq!((&line(&order, "sku-1")["confirmed"], &line(&order, "sku-1")["held"]), (&json!(4), &json!(0)));
    reverse(&shop, "ORD-H", "rev-3", &lines(&[("sku-1", 3)])).await.expect_json(201);
    assert_counts(&shop.state("sku-1").await, 9, 0, 1, 10);

    let released = shop.order("k-2", &reserve("ORD-R", &[("sku-1", 2)], None)).await.expect_json(201);
    let id = released["reservation_id"].as_str().expect("a reservation id").to_owned();
    shop.post_empty(&format!("/v1/reservations/{id}/release")).await.expect_json(200);
    assert_eq!(line(&shop.get("/v1/orders/ORD-R").await.expect_json(200), "sku-1")["released"], 2);
    assert_problem(&reverse(&shop, "ORD-R", "rev-4", &json!({})).await, 409, "exceeds_reversible");
    shop.assert_ledger_replays_to_state("sku-1").await;
    shop.assert_reconciliation_clean(1).await;
}

/// Proves a partial-success order (marketplace plugin: lines mapped to `{sku}:{warehouse}`)
/// can reverse only the line that applied, addressed by the key the client sent.
#[tokio::test]
async fn a_partial_order_reverses_only_the_line_that_applied_by_its_own_key() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-a:central", 5).await;
    shop.create_resource("sku-b:central", 0).await;
    shop.put_plugin(plugin_wasm("marketplace")).await.expect_json(201);
    let doc = shop.order("k-1", &deduct("ORD-P", &[("sku-a", 2), ("sku-b", 1)])).await.expect_json(201);
    assert_eq!(doc["status"], "partial", "{doc}");

    let order = shop.get("/v1/orders/ORD-P").await.expect_json(200);
    assert_eq!(order["lines"].as_array().map(Vec::len), Some(1), "{order}");
    assert_eq!(line(&order, "sku-a")["resource"], "sku-a:central");
    assert_problem(&reverse(&shop, "ORD-P", "rev-1", &lines(&[("sku-b", 1)])).await, 409, "exceeds_reversible");
    let back = reverse(&shop, "ORD-P", "rev-2", &lines(&[("sku-a", 2)])).await.expect_json(201);
    assert_eq!(back["lines"], json!([{"key": "sku-a", "resource": "sku-a:central", "qty": 2}]));
    assert_counts(&shop.state("sku-a:central").await, 5, 0, 0, 5);
}

/// Proves a bucketed order goes back to the buckets it took from, and gives the per-user limit
/// back: the flash sale's one piece per user may be bought again after its reversal.
#[tokio::test]
async fn a_bucketed_flash_sale_order_goes_back_to_its_bucket_and_frees_its_limit() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.post("/v1/resources", &json!({"key": "sku-f", "kind": "inventory", "total": 40, "buckets": 4}))
        .await
        .expect_json(201);
    shop.put_plugin_config(plugin_wasm("flash-sale"), "buckets = 4").await.expect_json(201);
    let buy = |order: &str| json!({"order_id": order, "user_id": "u-1", "action": "deduct", "lines": [{"key": "sku-f", "qty": 1}]});
    shop.order("k-1", &buy("F-1")).await.expect_json(201);
    let again = shop.order("k-2", &buy("F-2")).await.expect_json(409);
    assert_eq!(again["lines"][0]["reason"], "limit_exceeded");

    let order = shop.get("/v1/orders/F-1").await.expect_json(200);
    let buckets = line(&order, "sku-f")["buckets"].clone();
    let taken: Vec<&Value> =
        buckets.as_array().map(|b| b.iter().filter(|b| b["taken"] == 1).collect()).unwrap_or_default();
    assert_eq!(taken.len(), 1, "{order}");
    let bucket = taken[0]["bucket"].clone();
    let back = reverse(&shop, "F-1", "rev-1", &json!({})).await.expect_json(201);
    assert_eq!(back["lines"][0]["buckets"], json!([{"bucket": bucket, "qty": 1}]));
    let state = shop.state("sku-f").await;
    assert_counts(&state, 40, 0, 0, 40);
    let ledger = shop.ledger("sku-f").await;
    let reversals = entries_with_op(&ledger, "reverse");
    assert_eq!((reversals.len(), &reversals[0]["bucket"]), (1, &bucket));

    shop.order("k-3", &buy("F-3")).await.expect_json(201);
    shop.assert_reconciliation_clean(1).await;
}

/// Proves concurrent reversals of one order never give back more than it took: 64 clients,
/// each reversing 1 piece of an order that took 20, spread over two processes on PostgreSQL
/// (one database) or one process on SQLite: exactly 20 succeed, the rest are
/// `409 exceeds_reversible`, and the ledger reconciles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_racing_reversals_never_exceed_what_the_order_took() {
    let app = spawn_app_with(AppOptions::default()).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-r", 50).await;
    shop.create_resource("sku-s", 50).await;
    shop.order("k-1", &deduct("ORD-RACE", &[("sku-r", 20), ("sku-s", 20)])).await.expect_json(201);
    let sibling = match Backend::from_env() {
        Backend::Postgres | Backend::Mysql => Some(app.spawn_sibling().await),
        Backend::Sqlite => None,
    };
    let shops: Vec<TenantClient> = match &sibling {
        Some(other) => vec![shop.clone(), other.tenant_with_key(&shop.id, &shop.api_key)],
        None => vec![shop.clone()],
    };

    let barrier = Arc::new(Barrier::new(64));
    let clients = (0..64).map(|client| {
        let shop = shops[client % shops.len()].clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            // Both lines, in the two orders, so locks are asked for both ways round.
            let body = if client % 2 == 0 {
                lines(&[("sku-r", 1), ("sku-s", 1)])
            } else {
                lines(&[("sku-s", 1), ("sku-r", 1)])
            };
            reverse(&shop, "ORD-RACE", &format!("race-{client}"), &body).await
        })
    });
    let replies: Vec<Reply> = join_all(clients).await.into_iter().map(|r| r.expect("client task")).collect();
    let reversed = replies.iter().filter(|r| r.status() == 201).count();
    let refused = replies.iter().filter(|r| r.status() == 409 && r.json()["code"] == "exceeds_reversible").count();
    let other: Vec<String> = replies
        .iter()
        .filter(|r| ![201, 409].contains(&r.status()))
        .map(|r| format!("{} {}", r.status(), r.text))
        .collect();
    assert!(other.is_empty(), "unexpected answers: {other:?}");
    assert_eq!((reversed, refused), (20, 44));

    for key in ["sku-r", "sku-s"] {
        assert_counts(&shops[shops.len() - 1].state(key).await, 50, 0, 0, 50);
        let ledger = shop.assert_ledger_replays_to_state(key).await;
        assert_eq!(entries_with_op(&ledger, "reverse").len(), 20);
    }
    let order = shops[0].get("/v1/orders/ORD-RACE").await.expect_json(200);
    assert_eq!((&line(&order, "sku-r")["reversed"], &line(&order, "sku-s")["reversible"]), (&json!(20), &json!(0)));
    shop.assert_reconciliation_clean(2).await;
}

/// Proves a redis-mode order is reversed through Redis: Redis's stock grows at once, the
/// reversal settles into the database as a `reverse` entry exactly once, a replay returns the
/// first outcome, a reversal beyond the take is refused, and Redis and the database agree.
#[tokio::test]
async fn a_redis_mode_order_is_reversed_through_redis_and_settled_once() {
    let (app, _prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-x", 10).await;
    shop.order("k-1", &deduct_one("ORD-X", "sku-x", 3, None)).await.expect_json(201);
    // The sale is known here once settled.
    let order = poll(SETTLE_DEADLINE, || async {
        let reply = shop.get("/v1/orders/ORD-X").await;
        (reply.status() == 200).then(|| reply.json())
    })
    .await;
    assert_eq!(line(&order, "sku-x")["deducted"], 3);

    let first = reverse(&shop, "ORD-X", "rev-1", &lines(&[("sku-x", 2)])).await;
    let doc = first.expect_json(201);
    assert_eq!(doc["lines"], json!([{"key": "sku-x", "resource": "sku-x", "qty": 2}]));
    let replay = reverse(&shop, "ORD-X", "rev-1", &lines(&[("sku-x", 2)])).await;
    assert_eq!((replay.status(), &replay.text, replay.replayed()), (201, &first.text, true));
    assert_problem(&reverse(&shop, "ORD-X", "rev-2", &lines(&[("sku-x", 2)])).await, 409, "exceeds_reversible");

    let state = poll(SETTLE_DEADLINE, || async {
        let state = shop.state("sku-x").await;
        (state["consumed"] == 1).then_some(state)
    })
    .await;
    assert_counts(&state, 9, 0, 1, 10);
    let ledger = shop.assert_ledger_replays_to_state("sku-x").await;
    assert_eq!(entries_with_op(&ledger, "reverse").len(), 1);
    let report = reconciliation(&shop).await;
    assert_eq!(report["drift"], json!([]), "{report}");
    let redis = redis_entry(&report, "sku-x");
    assert_eq!((&redis["redis_available"], &redis["drift"]), (&json!(9), &json!(0)), "{report}");
    let replay = reverse(&shop, "ORD-X", "rev-1", &lines(&[("sku-x", 2)])).await;
    assert_eq!((replay.status(), &replay.text), (201, &first.text), "replayed from the database once settled");
    // Its stock sells again.
    shop.order("k-2", &deduct_one("ORD-Y", "sku-x", 9, None)).await.expect_json(201);
}

/// Proves concurrent reversals of a redis-mode order never exceed its take (Redis keeps the
/// order's count, settled or not), and that a redis-mode reversal gives the per-user limit back
/// in Redis: the flash sale's one piece per user may be bought again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_reversals_of_a_redis_mode_order_never_exceed_its_take_and_free_the_limit() {
    let (app, _prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-z", 20).await;
    shop.order("k-1", &deduct_one("ORD-Z", "sku-z", 5, None)).await.expect_json(201);
    poll(SETTLE_DEADLINE, || async { (shop.get("/v1/orders/ORD-Z").await.status() == 200).then_some(()) }).await;

    let barrier = Arc::new(Barrier::new(16));
    let clients = (0..16).map(|client| {
        let (shop, barrier) = (shop.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            reverse(&shop, "ORD-Z", &format!("z-{client}"), &lines(&[("sku-z", 1)])).await
        })
    });
    let replies: Vec<Reply> = join_all(clients).await.into_iter().map(|r| r.expect("client task")).collect();
    let statuses: Vec<u16> = replies.iter().map(Reply::status).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 201).count(), 5, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 409).count(), 11, "{statuses:?}");
    let state = poll(SETTLE_DEADLINE, || async {
        let state = shop.state("sku-z").await;
        (state["consumed"] == 0).then_some(state)
    })
    .await;
    assert_counts(&state, 20, 0, 0, 20);
    assert_eq!(line(&shop.get("/v1/orders/ORD-Z").await.expect_json(200), "sku-z")["reversed"], 5);
    let report = reconciliation(&shop).await;
    assert_eq!((&report["drift"], &redis_entry(&report, "sku-z")["drift"]), (&json!([]), &json!(0)), "{report}");

    shop.put_plugin_config(plugin_wasm("flash-sale"), "buckets = 1").await.expect_json(201);
    let buy = |order: &str| json!({"order_id": order, "user_id": "u-1", "action": "deduct", "lines": [{"key": "sku-z", "qty": 1}]});
    shop.order("f-1", &buy("F-1")).await.expect_json(201);
    assert_eq!(shop.order("f-2", &buy("F-2")).await.expect_json(409)["lines"][0]["reason"], "limit_exceeded");
    poll(SETTLE_DEADLINE, || async { (shop.get("/v1/orders/F-1").await.status() == 200).then_some(()) }).await;
    reverse(&shop, "F-1", "f-rev", &json!({})).await.expect_json(201);
    shop.order("f-3", &buy("F-3")).await.expect_json(201);
}

/// Proves `stockd bench --scenarios deduct-reverse` (each order deducts 2, then reverses 1)
/// runs and its invariants hold: consumed equals what the acknowledged orders took minus what
/// the acknowledged reversals gave back, and reconciliation finds no drift.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deduct_reverse_bench_scenario_holds_its_invariants() {
    let (stdout, report) =
        crate::bench::bench(&["--clients", "4", "--duration-secs", "1", "--scenarios", "deduct-reverse"]).await;
    let row = report
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["scenario"] == "deduct-reverse"))
        .unwrap_or_else(|| panic!("the report has a deduct-reverse row: {report}\n{stdout}"));
    assert_eq!(row["invariants_ok"], true, "{row}");
    assert!(row["ok"].as_u64().is_some_and(|ok| ok >= 2), "{row}");
    assert_eq!(row["rejections"], json!({}), "{row}");
}

/// Polls `probe` until it yields, failing after `deadline`.
async fn poll<T, F, Fut>(deadline: Duration, probe: F) -> T
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(found) = probe().await {
            return found;
        }
        assert!(tokio::time::Instant::now() < end, "not reached within {deadline:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Proves an order Redis sold and has not settled yet is not answered like one never applied:
/// the lookup and a reversal answer `503` with `Retry-After` (nothing stored), and once the sale
/// settles the same requests succeed; an order id nobody used is still `404`.
#[tokio::test]
async fn an_order_redis_sold_and_not_yet_settled_is_a_retry_not_a_404() {
    // Settlement's first run hangs for 8 s: Redis sells, the database's ledger knows nothing.
    let app = spawn_app_with(
        AppOptions::default()
            .env("STOCKD_REDIS_PREFIX", &unique("t"))
            .env("STOCKD_REDIS_URL", &shared_redis_url())
            .env("STOCKD_FAULT_HANG_JOB", "settlement:8000")
            .toml("[redis]\nclaim_idle_ms = 500\ndrain_timeout_ms = 20000\n"),
    )
    .await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-x", 10).await;
    shop.order("k-1", &deduct_one("ORD-X", "sku-x", 3, None)).await.expect_json(201);

    let lookup = shop.get("/v1/orders/ORD-X").await;
    assert_problem(&lookup, 503, "unavailable");
    assert!(lookup.header("retry-after").is_some(), "{:?}", lookup.headers);
    let reversal = reverse(&shop, "ORD-X", "rev-1", &lines(&[("sku-x", 1)])).await;
    assert_eq!(reversal.status(), 503, "{}", reversal.text);
    assert!(reversal.header("retry-after").is_some(), "{:?}", reversal.headers);
    assert_problem(&shop.get("/v1/orders/ORD-NOBODY").await, 404, "order_not_found");
    assert_eq!(shop.state("sku-x").await["consumed"], 0, "still unsettled when the answers were given");

    let order = poll(SETTLE_DEADLINE, || async {
        let reply = shop.get("/v1/orders/ORD-X").await;
        (reply.status() == 200).then(|| reply.json())
    })
    .await;
    assert_eq!(line(&order, "sku-x")["deducted"], 3);
    let doc = reverse(&shop, "ORD-X", "rev-1", &lines(&[("sku-x", 1)])).await.expect_json(201);
    assert_eq!(doc["lines"], json!([{"key": "sku-x", "resource": "sku-x", "qty": 1}]));
}
