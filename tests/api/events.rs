//! The transactional outbox and its feed: every event type written exactly where its change
//! commits (and nowhere else), in the tenant's sequence, paged and long-polled by
//! `GET /v1/events` (docs/EVENTS.md).

use std::time::Duration;

use futures::future::join_all;
use serde_json::{json, Value};

use crate::helpers::{
    assert_problem, deduct, reserve, spawn_app, spawn_app_with, tamper, unique, AppOptions, TenantClient,
};
use crate::redis_support::{create_redis_resource, deduct_one, order_through_503, redis_app, shared_redis_url};

const DEADLINE: Duration = Duration::from_secs(20);

/// Every event of the tenant, walking all pages; asserts the sequence runs 1, 2, 3, ... and
/// every id is unique.
async fn all_events(shop: &TenantClient) -> Vec<Value> {
    let mut events: Vec<Value> = Vec::new();
    let mut after = 0;
    loop {
        let page = shop.get(&format!("/v1/events?after={after}&limit=50")).await.expect_json(200);
        let items = page["items"].as_array().unwrap_or_else(|| panic!("a page has items: {page}")).clone();
        if items.is_empty() {
            assert_eq!(page["next_after"], after, "an empty page keeps the cursor: {page}");
            break;
        }
        after = page["next_after"].as_i64().unwrap_or_else(|| panic!("next_after is a number: {page}"));
        assert_eq!(Some(after), items.last().and_then(|e| e["seq"].as_i64()), "{page}");
        events.extend(items);
    }
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["seq"], i as i64 + 1, "sequence numbers run without gaps: {events:#?}");
        assert!(e["id"].as_str().is_some_and(|id| id.starts_with("evt_")), "{e}");
        assert!(e["timestamp"].as_str().is_some_and(|t| chrono::DateTime::parse_from_rfc3339(t).is_ok()), "{e}");
    }
    let mut ids: Vec<&str> = events.iter().filter_map(|e| e["id"].as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), events.len(), "event ids are unique");
    events
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap_or("?")).collect()
}

/// Polls the feed until it holds `n` events, failing after `DEADLINE`.
async fn wait_for_events(shop: &TenantClient, n: usize) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let events = all_events(shop).await;
        if events.len() >= n {
            return events;
        }
        assert!(tokio::time::Instant::now() < deadline, "{n} events within {DEADLINE:?}: {:?}", types(&events));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Proves the stock events follow the stock exactly: falling to the threshold emits
/// `resource.low_stock`, reaching 0 `resource.sold_out`, leaving 0 `resource.restocked`; a
/// refused order and a replay emit nothing; each applied order emits one `order.applied` with the
/// document the client was answered.
#[tokio::test]
async fn orders_and_adjustments_emit_their_events_in_sequence() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let created = shop
        .post("/v1/resources", &json!({"key": "sku-1", "kind": "inventory", "total": 5, "low_stock": 2}))
        .await
        .expect_json(201);
    assert_eq!(created["low_stock"], 2, "{created}");
    assert_eq!(all_events(&shop).await, Vec::<Value>::new(), "creating a resource emits nothing");

    let first = shop.order("k1", &deduct("ORD-1", &[("sku-1", 3)])).await.expect_json(201);
    let replay = shop.order("k1", &deduct("ORD-1", &[("sku-1", 3)])).await;
    assert!(replay.replayed());
    shop.order("k2", &deduct("ORD-2", &[("sku-1", 2)])).await.expect_json(201);
    shop.order("k3", &deduct("ORD-3", &[("sku-1", 1)])).await.expect_json(409);
    shop.adjust("sku-1", "r1", 4).await.expect_json(200);
    shop.adjust("sku-1", "r2", 10).await.expect_json(200);

    let events = all_events(&shop).await;
    assert_eq!(
        types(&events),
        ["order.applied", "resource.low_stock", "order.applied", "resource.sold_out", "resource.restocked",],
        "{events:#?}"
    );
    assert_eq!(events[0]["data"], first, "order.applied carries the order document as answered");
    assert_eq!(events[1]["data"], json!({"key": "sku-1", "available": 2, "low_stock": 2}));
    assert_eq!(events[3]["data"], json!({"key": "sku-1", "available": 0, "low_stock": 2}));
    assert_eq!(events[4]["data"], json!({"key": "sku-1", "available": 4, "low_stock": 2}));
    assert_eq!(events[2]["data"]["order_id"], "ORD-2");
}

/// Proves nothing is emitted for a change that rolled back: an all-or-nothing order whose second
/// line fails leaves no `order.applied` and no stock event, though its first line alone would
/// have sold the resource out.
#[tokio::test]
async fn a_rejected_multi_line_order_emits_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 2).await;
    shop.create_resource("sku-2", 1).await;
    let rejected = shop.order("k1", &deduct("ORD-1", &[("sku-1", 2), ("sku-2", 5)])).await.expect_json(409);
    assert_eq!(rejected["status"], "rejected", "{rejected}");
    shop.order("k2", &deduct("ORD-2", &[("sku-2", 1)])).await.expect_json(201);
    let events = all_events(&shop).await;
    assert_eq!(types(&events), ["order.applied", "resource.sold_out"], "{events:#?}");
    assert_eq!(events[1]["data"]["key"], "sku-2");
}

/// Proves each reservation move emits its event (held, confirmed, released, expired) under the
/// order's ordering, and a release that gives stock back to a sold-out resource restocks it.
#[tokio::test]
async fn reservations_emit_held_confirmed_released_and_expired() {
    let app = spawn_app_with(AppOptions::default().toml("[reservations]\nsweep_interval_ms = 200")).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 3).await;

    let held = shop.order("k1", &reserve("ORD-1", &[("sku-1", 1)], Some(900))).await.expect_json(201);
    let id1 = held["reservation_id"].as_str().expect("a reservation id").to_owned();
    shop.confirm(&id1).await.expect_json(200);
    let held = shop.order("k2", &reserve("ORD-2", &[("sku-1", 2)], Some(900))).await.expect_json(201);
    let id2 = held["reservation_id"].as_str().expect("a reservation id").to_owned();
    shop.release(&id2).await.expect_json(200);
    shop.release(&id2).await.expect_json(200);
    let held = shop.order("k3", &reserve("ORD-3", &[("sku-1", 2)], Some(1))).await.expect_json(201);
    let id3 = held["reservation_id"].as_str().expect("a reservation id").to_owned();

    let events = wait_for_events(&shop, 13).await;
    assert_eq!(
        types(&events),
        [
            "order.applied",
            "reservation.held",
            "reservation.confirmed",
            "order.applied",
            "reservation.held",
            "resource.sold_out",
            "reservation.released",
            "resource.restocked",
            "order.applied",
            "reservation.held",
            "resource.sold_out",
            "reservation.expired",
            "resource.restocked",
        ],
        "the second release emitted nothing: {events:#?}"
    );
    let ids = [&id1, &id1, &id2, &id2, &id3, &id3];
    let moves = events.iter().filter(|e| e["type"].as_str().is_some_and(|t| t.starts_with("reservation.")));
    for (e, id) in moves.zip(ids) {
        assert_eq!(&e["data"]["reservation_id"], id, "{e}");
        assert_eq!(e["data"]["lines"][0]["resource"], "sku-1", "{e}");
    }
    assert_eq!(events[11]["data"]["state"], "expired");
}

/// Proves the stock events of a bucketed resource follow its total across buckets: sold out
/// only when every bucket is empty.
#[tokio::test]
async fn a_bucketed_resource_is_sold_out_when_all_its_buckets_are() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.post("/v1/resources", &json!({"key": "hot", "kind": "inventory", "total": 8, "buckets": 4}))
        .await
        .expect_json(201);
    for i in 0..7 {
        shop.order(&format!("k{i}"), &deduct(&format!("ORD-{i}"), &[("hot", 1)])).await.expect_json(201);
    }
    assert!(!types(&all_events(&shop).await).contains(&"resource.sold_out"));
    shop.order("k7", &deduct("ORD-7", &[("hot", 1)])).await.expect_json(201);
    let events = all_events(&shop).await;
    assert_eq!(types(&events).iter().filter(|t| **t == "order.applied").count(), 8);
    assert_eq!(events.last().map(|e| e["type"].clone()), Some(json!("resource.sold_out")), "{events:#?}");
}

/// Proves a hot resource under concurrent orders (decided together by batch admission) emits one
/// `order.applied` per sale, exactly one `resource.low_stock` and one `resource.sold_out`, after
/// the last sale.
#[tokio::test]
async fn concurrent_orders_on_a_hot_resource_emit_one_sold_out() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.post("/v1/resources", &json!({"key": "hot", "kind": "inventory", "total": 20, "low_stock": 5}))
        .await
        .expect_json(201);
    let replies = join_all((0..40).map(|i| {
        let shop = shop.clone();
        async move { shop.order(&format!("k{i}"), &deduct(&format!("ORD-{i}"), &[("hot", 1)])).await }
    }))
    .await;
    let sold = replies.iter().filter(|r| r.status() == 201).count();
    assert_eq!(sold, 20);
    let events = all_events(&shop).await;
    let applied = types(&events).iter().filter(|t| **t == "order.applied").count();
    assert_eq!(applied, 20, "{:?}", types(&events));
    let sold_out: Vec<usize> =
        events.iter().enumerate().filter(|(_, e)| e["type"] == "resource.sold_out").map(|(i, _)| i).collect();
    assert_eq!(sold_out.len(), 1, "{:?}", types(&events));
    let low: Vec<usize> =
        events.iter().enumerate().filter(|(_, e)| e["type"] == "resource.low_stock").map(|(i, _)| i).collect();
    assert_eq!(low.len(), 1, "{:?}", types(&events));
    assert!(low[0] < sold_out[0], "low stock before sold out: {:?}", types(&events));
    assert!(sold_out[0] > 0 && events[..sold_out[0]].iter().filter(|e| e["type"] == "order.applied").count() == 20);
}

/// Proves the feed filters by type, pages with `limit`, and refuses bad parameters with
/// problem+json; another tenant's events are never seen.
#[tokio::test]
async fn the_feed_filters_pages_and_isolates_tenants() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let other = app.create_tenant("other").await;
    shop.create_resource("sku-1", 3).await;
    other.create_resource("sku-1", 3).await;
    for i in 0..3 {
        shop.order(&format!("k{i}"), &deduct(&format!("ORD-{i}"), &[("sku-1", 1)])).await.expect_json(201);
    }
    let sold_out = shop.get("/v1/events?types=resource.sold_out").await.expect_json(200);
    assert_eq!(types(sold_out["items"].as_array().expect("items")), ["resource.sold_out"], "{sold_out}");
    assert_eq!(sold_out["next_after"], 4);
    let two = shop.get("/v1/events?types=order.applied,resource.sold_out&limit=2").await.expect_json(200);
    assert_eq!(two["items"].as_array().map(Vec::len), Some(2));
    assert_eq!(two["next_after"], 2);
    let rest = shop.get("/v1/events?after=2&limit=100").await.expect_json(200);
    assert_eq!(types(rest["items"].as_array().expect("items")), ["order.applied", "resource.sold_out"]);
    assert_eq!(all_events(&other).await, Vec::<Value>::new(), "the other tenant sees none of them");

    for bad in ["types=order.nope", "limit=0", "limit=1001", "after=-1", "wait=3600", "after=x", "colour=red"] {
        let reply = shop.get(&format!("/v1/events?{bad}")).await;
        assert_problem(&reply, 400, "validation_failed");
    }
}

/// Proves a long poll answers as soon as an event commits, and an idle one answers empty after
/// its wait.
#[tokio::test]
async fn a_long_poll_answers_when_an_event_commits() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 3).await;
    let started = tokio::time::Instant::now();
    let idle = shop.get("/v1/events?wait=1").await.expect_json(200);
    assert_eq!(idle, json!({"items": [], "next_after": 0}));
    assert!(started.elapsed() >= Duration::from_millis(900), "an idle poll waits");

    let poll = {
        let shop = shop.clone();
        tokio::spawn(async move { shop.get("/v1/events?wait=15&types=order.applied").await })
    };
    // The poll is parked (the server counts it), with no event yet. Then one commits.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !app.get_anonymous("/metrics").await.text.contains("stockd_event_polls_waiting 1") {
        assert!(tokio::time::Instant::now() < deadline, "the poll is counted as waiting");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!poll.is_finished(), "the poll waits for an event");
    shop.order("k1", &deduct("ORD-1", &[("sku-1", 1)])).await.expect_json(201);
    let reply = tokio::time::timeout(Duration::from_secs(10), poll)
        .await
        .expect("the poll answers well before its wait")
        .expect("the poll task");
    let page = reply.expect_json(200);
    assert_eq!(types(page["items"].as_array().expect("items")), ["order.applied"], "{page}");
}

/// Proves a sale Redis made is an `order.applied` once it settles, and a sale the database then
/// refuses is a `settlement.failed`.
#[tokio::test]
async fn redis_mode_sales_emit_their_events_when_they_settle() {
    let (app, _prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant(&unique("shop")).await;
    create_redis_resource(&shop, "sku-1", 5).await;
    let reply = order_through_503(&shop, "k1", &deduct_one("ORD-1", "sku-1", 2, None)).await;
    let doc = reply.expect_json(201);
    let events = wait_for_events(&shop, 1).await;
    assert_eq!(types(&events), ["order.applied"], "{events:#?}");
    assert_eq!(events[0]["data"], doc);

    // The database copy loses its stock behind stockd's back: the next sale Redis makes cannot
    // settle, and says so.
    tamper(
        app.database_url(),
        &[&format!(
            "UPDATE resources SET available = 0, total = reserved + consumed WHERE tenant_id = '{}' AND \"key\" = 'sku-1'",
            shop.id
        )],
    )
    .await;
    order_through_503(&shop, "k2", &deduct_one("ORD-2", "sku-1", 1, None)).await.expect_json(201);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let failed = loop {
        let events = all_events(&shop).await;
        if let Some(failed) = events.iter().find(|e| e["type"] == "settlement.failed") {
            break failed.clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "a settlement failure event: {:?}", types(&events));
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(failed["data"]["key"], "sku-1", "{failed}");
    assert_eq!(failed["data"]["reason"], "insufficient", "{failed}");
    assert_eq!(failed["data"]["order_id"], "ORD-2", "{failed}");
    assert_eq!(failed["data"]["qty"], 1, "{failed}");
}

/// Proves a counter changed behind the ledger's back after a clean pass is reported once by
/// `reconciliation.drift`, not again by every later pass.
#[tokio::test]
async fn drift_found_in_history_proven_clean_emits_one_event() {
    let app = spawn_app_with(AppOptions::default().toml("[reconciliation]\ninterval_seconds = 0")).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.order("k1", &deduct("ORD-1", &[("sku-1", 2)])).await.expect_json(201);
    shop.assert_reconciliation_clean(1).await;
    tamper(
        app.database_url(),
        &["UPDATE resources SET available = available + 1, total = total + 1 WHERE tenant_id = 'shop' AND \"key\" = 'sku-1'"],
    )
    .await;
    for _ in 0..3 {
        let report = shop.get("/v1/reconciliation").await.expect_json(200);
        assert_eq!(report["drift"].as_array().map(Vec::len), Some(1), "{report}");
    }
    let events = all_events(&shop).await;
    let drift: Vec<&Value> = events.iter().filter(|e| e["type"] == "reconciliation.drift").collect();
    assert_eq!(drift.len(), 1, "{events:#?}");
    assert_eq!(drift[0]["data"]["key"], "sku-1");
    assert_eq!(drift[0]["data"]["expected"]["available"], 8, "{}", drift[0]);
    assert_eq!(drift[0]["data"]["actual"]["available"], 9, "{}", drift[0]);
}

/// Proves the low-stock threshold is set, changed and cleared by PATCH and validated, and that a
/// new threshold moves the band without an event (no stock moved).
#[tokio::test]
async fn the_low_stock_threshold_is_patched_and_validated() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let patched = shop.patch("/v1/resources/sku-1", &json!({"low_stock": 12})).await.expect_json(200);
    assert_eq!(patched["low_stock"], 12, "{patched}");
    // Already under the new threshold: the next sale is not a crossing.
    shop.order("k1", &deduct("ORD-1", &[("sku-1", 1)])).await.expect_json(201);
    let cleared = shop.patch("/v1/resources/sku-1", &json!({"low_stock": null})).await.expect_json(200);
    assert!(cleared.get("low_stock").is_none(), "{cleared}");
    shop.patch("/v1/resources/sku-1", &json!({"low_stock": 5})).await.expect_json(200);
    shop.order("k2", &deduct("ORD-2", &[("sku-1", 4)])).await.expect_json(201);
    assert_eq!(types(&all_events(&shop).await), ["order.applied", "order.applied", "resource.low_stock"]);

    for bad in [json!({"low_stock": -1}), json!({"low_stock": 1_000_000_000_000_001_i64}), json!({"low_stock": "x"})] {
        let reply = shop.patch("/v1/resources/sku-1", &bad).await;
        assert_eq!(reply.status(), 400, "{bad}: {}", reply.text);
    }
    let reply =
        shop.post("/v1/resources", &json!({"key": "sku-2", "kind": "inventory", "total": 1, "low_stock": -3})).await;
    assert_problem(&reply, 400, "validation_failed");
    let reply = shop.patch("/v1/resources/nope", &json!({"low_stock": 1})).await;
    assert_problem(&reply, 404, "resource_not_found");
}

/// Proves a reader that follows the feed with `after=<last seq>` misses nothing while three
/// processes commit a tenant's events concurrently: sequence numbers are given in commit order,
/// so no event can commit later under a number the reader has already passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_following_the_feed_misses_nothing_while_three_processes_write() {
    let first = spawn_app().await;
    let shop = first.create_tenant("shop").await;
    let second = first.spawn_sibling().await;
    let third = first.spawn_sibling().await;
    let shops: Vec<TenantClient> =
        [&first, &second, &third].iter().map(|app| app.tenant_with_key(&shop.id, &shop.api_key)).collect();
    for k in 0..6 {
        shop.create_resource(&format!("sku-{k}"), 1_000).await;
    }
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (shop, done) = (shops[1].clone(), done.clone());
        tokio::spawn(async move {
            let (mut seen, mut after) = (Vec::new(), 0);
            loop {
                let finished = done.load(std::sync::atomic::Ordering::SeqCst);
                let page = shop.get(&format!("/v1/events?after={after}&wait=1&limit=7")).await.expect_json(200);
                let items = page["items"].as_array().cloned().unwrap_or_default();
                after = page["next_after"].as_i64().unwrap_or(after);
                let empty = items.is_empty();
                seen.extend(items.into_iter().filter_map(|e| e["seq"].as_i64()));
                if finished && empty {
                    return seen;
                }
            }
        })
    };
    let writers = (0..24).map(|c| {
        let shop = shops[c % 3].clone();
        tokio::spawn(async move {
            for n in 0..5 {
                let key = format!("c{c}-{n}");
                shop.order(&key, &deduct(&key, &[(&format!("sku-{}", (c + n) % 6), 1)])).await.expect_json(201);
            }
        })
    });
    for writer in join_all(writers).await {
        writer.expect("a writer");
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = reader.await.expect("the reader");
    let all = all_events(&shop).await;
    assert_eq!(all.len(), 120, "one order.applied per order");
    assert_eq!(seen, (1..=120).collect::<Vec<i64>>(), "the reader saw every event once, in order");
}

/// Proves events older than `[events] retention_hours` are deleted by the background purge,
/// and younger ones kept (the feed then starts after the purged numbers). Events outlive
/// idempotency records by an hour (replays of applied orders answer from them): with records
/// kept 1 h, events are kept 2 h.
#[tokio::test]
async fn events_past_their_retention_are_purged() {
    let app = spawn_app_with(
        AppOptions::default()
            .toml("[idempotency]\nretention_hours = 1\n[events]\nretention_hours = 1\npurge_interval_seconds = 1"),
    )
    .await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    for i in 0..3 {
        shop.order(&format!("k{i}"), &deduct(&format!("ORD-{i}"), &[("sku-1", 1)])).await.expect_json(201);
    }
    // The first two are three hours old.
    crate::retention::Db::connect(&app).await.age_events("tenant_id = 'shop' AND seq <= 2", 10_800_000).await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let page = shop.get("/v1/events").await.expect_json(200);
        let seqs: Vec<i64> = page["items"].as_array().into_iter().flatten().filter_map(|e| e["seq"].as_i64()).collect();
        if seqs == [3] {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "only the young event is left: {page}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Proves `newest=true` answers the feed's last events, oldest first, with the cursor a reader
/// then follows, and refuses being mixed with `after` or `wait`.
#[tokio::test]
async fn the_newest_events_start_a_reader_at_the_end_of_the_feed() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;
    for n in 0..5 {
        let key = unique("newest");
        shop.order(&key, &deduct(&format!("ord-{n}"), &[("sku-1", 1)])).await.expect_json(201);
    }
    let all = all_events(&shop).await;
    let last = all.last().and_then(|e| e["seq"].as_i64()).unwrap_or_else(|| panic!("events were written: {all:?}"));

    let page = shop.get("/v1/events?newest=true&limit=2").await.expect_json(200);
    let seqs: Vec<i64> = page["items"].as_array().into_iter().flatten().filter_map(|e| e["seq"].as_i64()).collect();
    assert_eq!(seqs, [last - 1, last], "{page}");
    assert_eq!(page["next_after"], last, "{page}");
    let orders = shop.get("/v1/events?newest=true&limit=2&types=order.applied").await.expect_json(200);
    let order_ids: Vec<&str> =
        orders["items"].as_array().into_iter().flatten().filter_map(|e| e["data"]["order_id"].as_str()).collect();
    assert_eq!(order_ids, ["ord-3", "ord-4"], "{orders}");
    let after_end = shop.get(&format!("/v1/events?after={last}")).await.expect_json(200);
    assert_eq!(after_end["items"], json!([]), "{after_end}");

    for bad in ["/v1/events?newest=true&after=0", "/v1/events?newest=true&wait=1", "/v1/events?newest=maybe"] {
        assert_problem(&shop.get(bad).await, 400, "validation_failed");
    }
}
