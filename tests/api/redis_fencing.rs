//! Redis mode where paths meet (docs/REDIS.md, "Fencing"): processes with a stale view of a
//! resource's mode, a warm or adjustment whose request is cancelled half-way, a process that
//! dies with a resource closed, and moves of reservations the database refused. Each test drives
//! real processes over HTTP and looks into Redis.

use std::collections::HashMap;
use std::time::Duration;

use futures::future::join_all;
use serde_json::{json, Value};

use crate::helpers::{assert_counts, assert_problem, plugin_wasm, reserve, AppOptions, TenantClient, TestApp};
use crate::redis_support::{
    create_redis_resource, deduct_one, order_through_503, reconciliation, redis_app, redis_conn, redis_entry,
    shared_redis_url, wait_settled, RedisServer, TableHold,
};

/// A sibling of `app` on the same database, Redis and prefix that reads which resources are in
/// redis mode once, at start: a process whose view of modes stays stale for the whole test.
async fn stale_sibling(app: &TestApp, redis_url: &str, prefix: &str, extra_toml: &str) -> TestApp {
    let opts = AppOptions::default()
        .env("STOCKD_REDIS_PREFIX", prefix)
        .env("STOCKD_REDIS_URL", redis_url)
        .toml(&format!("[redis]\nclaim_idle_ms = 500\nmode_refresh_ms = 3600000\n{extra_toml}"));
    app.spawn_sibling_with(opts).await
}

/// The fields of a resource's Redis hash.
async fn redis_hash(prefix: &str, key: &str) -> HashMap<String, String> {
    let mut redis = redis_conn(&shared_redis_url()).await;
    redis::cmd("HGETALL")
        .arg(format!("{prefix}:{{shop:{key}}}:r"))
        .query_async(&mut redis)
        .await
        .expect("HGETALL works")
}

/// Sends `n` one-piece orders named `<tag><i>` at once and returns each status and body.
async fn burst(shop: &TenantClient, tag: &str, key: &str, n: usize) -> Vec<(u16, Value)> {
    let replies = join_all((0..n).map(|i| {
        let id = format!("{tag}{i}");
        async move {
            let reply = shop.order(&id, &deduct_one(&id, key, 1, None)).await;
            (reply.status(), reply.json())
        }
    }))
    .await;
    replies
}

/// Right after a switch to db mode through A, B (still seeing redis mode) restocks and sells.
/// B's restock must not put stock back into Redis, and nothing B sells may bypass the
/// database: every 201 is in the ledger, none is a settlement failure, and no more is sold than
/// exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_process_neither_restocks_redis_nor_sells_from_it_after_a_switch_to_db() {
    let (app_a, prefix) = redis_app(&shared_redis_url(), "").await;
    let shop_a = app_a.create_tenant("shop").await;
    create_redis_resource(&shop_a, "sku-1", 100).await;
    let app_b = stale_sibling(&app_a, &shared_redis_url(), &prefix, "").await;
    let shop_b = app_b.tenant_with_key("shop", &shop_a.api_key);
    shop_b.order("warmup", &deduct_one("warmup", "sku-1", 1, None)).await.expect_json(201);
    wait_settled(&shop_a, "sku-1", 1).await;

    let back = shop_a.patch("/v1/resources/sku-1", &json!({"mode": "db"})).await.expect_json(200);
    assert_eq!(back["mode"], "db", "{back}");
    let restocked = shop_b.adjust("sku-1", "restock-1", 10).await.expect_json(200);
    assert_counts(&restocked, 109, 0, 1, 110);
    let hash = redis_hash(&prefix, "sku-1").await;
    assert!(!hash.contains_key("avail"), "a db-mode resource has no stock in Redis after B's restock: {hash:?}");

    let (from_a, from_b) = tokio::join!(burst(&shop_a, "a", "sku-1", 60), burst(&shop_b, "b", "sku-1", 60));
    let mut sold = 0;
    for (status, body) in from_a.iter().chain(&from_b) {
        match status {
            201 => sold += 1,
            409 => assert_eq!(body["lines"][0]["reason"], "insufficient", "{body}"),
            _ => panic!("an order answered {status}: {body}"),
        }
    }
    assert_eq!(sold, 109, "exactly the 109 pieces in stock are sold, through either process");
    let state = shop_a.state("sku-1").await;
    assert_counts(&state, 0, 0, 110, 110);
    shop_a.assert_ledger_replays_to_state("sku-1").await;
    let report = reconciliation(&shop_a).await;
    assert_eq!(report["settlement_failures"], json!([]), "{report}");
    assert_eq!(report["drift"], json!([]), "{report}");
    let hash = redis_hash(&prefix, "sku-1").await;
    assert!(!hash.contains_key("avail"), "Redis never sold sku-1 again: {hash:?}");
}

/// A process that has not yet seen a switch into redis mode sends the order to Redis at once
/// (the database copy refuses it), rather than answering 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_process_sends_an_order_of_a_resource_that_entered_redis_mode_to_redis() {
    let (app_a, prefix) = redis_app(&shared_redis_url(), "").await;
    let shop_a = app_a.create_tenant("shop").await;
    shop_a.create_resource("sku-1", 5).await;
    let app_b = stale_sibling(&app_a, &shared_redis_url(), &prefix, "").await;
    let shop_b = app_b.tenant_with_key("shop", &shop_a.api_key);
    shop_a.patch("/v1/resources/sku-1", &json!({"mode": "redis"})).await.expect_json(200);

    let doc = shop_b.order("b1", &deduct_one("b1", "sku-1", 2, None)).await.expect_json(201);
    assert_eq!(doc["status"], "succeeded", "{doc}");
    assert_eq!(redis_hash(&prefix, "sku-1").await.get("avail").map(String::as_str), Some("3"));
    wait_settled(&shop_a, "sku-1", 2).await;
    shop_a.assert_ledger_replays_to_state("sku-1").await;
}

/// An adjustment of a redis-mode resource held up by a database lock until its request timed
/// out: sales go on meanwhile, and once the lock is gone the adjustment completes and Redis is
/// open with the adjusted stock; a cancelled request never leaves the resource closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adjustment_whose_request_timed_out_completes_and_leaves_redis_open() {
    let (app, prefix) = redis_app(
        &shared_redis_url(),
        "[server]\nrequest_timeout_ms = 1500\n[plugins]\ncompile_timeout_ms = 1000\nplan_timeout_ms = 500\n",
    )
    .await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-1", 10).await;
    shop.order("o1", &deduct_one("o1", "sku-1", 1, None)).await.expect_json(201);
    wait_settled(&shop, "sku-1", 1).await;

    let hold = TableHold::take(app.database_url()).await;
    let timed_out = shop.adjust("sku-1", "restock-1", 5).await;
    assert_eq!(timed_out.status(), 503, "{}", timed_out.text);
    // Sold by Redis while the database is held (settled once it is free).
    shop.order("o2", &deduct_one("o2", "sku-1", 1, None)).await.expect_json(201);
    hold.release().await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let state = shop.state("sku-1").await;
        let hash = redis_hash(&prefix, "sku-1").await;
        let open = hash.get("open").map(String::as_str) == Some("1");
        if state["total"] == 15 && open && state["consumed"] == 2 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not adjusted and open: {state} {hash:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = wait_settled(&shop, "sku-1", 2).await;
    let entry = redis_entry(&report, "sku-1");
    assert_eq!((entry["redis_available"].clone(), entry["drift"].clone()), (json!(13), json!(0)), "{report}");
    let replayed = shop.adjust("sku-1", "restock-1", 5).await.expect_json(200);
    assert_eq!(replayed["total"], 15, "the retry replays the adjustment: {replayed}");
    shop.order("o3", &deduct_one("o3", "sku-1", 1, None)).await.expect_json(201);
}

/// A process that died while it held a resource closed (what `kill -9` in the middle of a warm
/// leaves: closed, with a lease) does not keep it closed: once the lease runs out, the
/// settlement loop warms it again and sales resume with the database's stock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_left_closed_by_a_dead_process_reopens_when_its_lease_runs_out() {
    let (app, prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-1", 10).await;
    shop.order("o1", &deduct_one("o1", "sku-1", 1, None)).await.expect_json(201);
    wait_settled(&shop, "sku-1", 1).await;

    // What a process killed between closing and loading leaves behind: closed, owned by a
    // process that is gone, its lease about to run out.
    let mut redis = redis_conn(&shared_redis_url()).await;
    let (secs, _micros): (i64, i64) = redis::cmd("TIME").query_async(&mut redis).await.expect("TIME");
    let _: i64 = redis::cmd("HSET")
        .arg(format!("{prefix}:{{shop:sku-1}}:r"))
        .arg("open")
        .arg("0")
        .arg("owner")
        .arg("stockd-dead")
        .arg("lease")
        .arg(secs * 1000 + 1000)
        .query_async(&mut redis)
        .await
        .expect("HSET");
    let closed = shop.order("o2", &deduct_one("o2", "sku-1", 1, None)).await;
    assert_eq!(closed.status(), 503, "closed while the lease runs: {}", closed.text);

    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let reply = loop {
        let reply = shop.order("o2", &deduct_one("o2", "sku-1", 1, None)).await;
        if reply.status() != 503 {
            break reply;
        }
        assert!(tokio::time::Instant::now() < deadline, "still closed: {}", reply.text);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    reply.expect_json(201);
    let report = wait_settled(&shop, "sku-1", 2).await;
    assert_eq!(redis_entry(&report, "sku-1")["drift"], 0, "{report}");
}

/// Reservations Redis made and the database refused at settlement (Redis held stock the
/// database did not, as after Redis came back from an older snapshot): their later release
/// and expiry settle as recorded failures of their own, so the backlog drains and a warm works.
/// The warm forgets one still held: the database never counted its stock as reserved, so its
/// release after the warm would give Redis stock the warm already gave it (it used to: `drift`
/// 13); the database answers for it instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_of_reservations_the_database_refused_settle_as_failures_and_let_a_warm_through() {
    let (app, prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-1", 10).await;
    let mut redis = redis_conn(&shared_redis_url()).await;
    let _: i64 = redis::cmd("HINCRBY")
        .arg(format!("{prefix}:{{shop:sku-1}}:r"))
        .arg("avail")
        .arg(30)
        .query_async(&mut redis)
        .await
        .expect("HINCRBY");

    let expiring = shop.order("r1", &reserve("r1", &[("sku-1", 12)], Some(1))).await.expect_json(201);
    let released = shop.order("r2", &reserve("r2", &[("sku-1", 11)], Some(300))).await.expect_json(201);
    let kept = shop.order("r3", &reserve("r3", &[("sku-1", 13)], Some(300))).await.expect_json(201);
    let ids = [&expiring, &released].map(|doc| doc["reservation_id"].as_str().expect("an id").to_string());
    let failures = wait_failures(&shop, 3).await;
    assert!(failures.iter().all(|f| f["reason"] == "insufficient"), "{failures:?}");
    shop.release(&ids[1]).await.expect_json(200);

    let failures = wait_failures(&shop, 5).await;
    for id in &ids {
        let reasons: Vec<&str> = failures
            .iter()
            .filter(|f| f["reservation_id"] == id.as_str())
            .filter_map(|f| f["reason"].as_str())
            .collect();
        assert_eq!(reasons.len(), 2, "{id}: {failures:?}");
        assert!(reasons.contains(&"insufficient") && reasons.contains(&"reservation_refused"), "{id}: {failures:?}");
    }
    let warmed = shop.post("/v1/resources/sku-1/warm", &json!({})).await.expect_json(200);
    assert_eq!((warmed["redis_available"].clone(), warmed["drift"].clone()), (json!(10), json!(0)), "{warmed}");
    let kept = kept["reservation_id"].as_str().expect("an id");
    assert_problem(&shop.release(kept).await, 404, "reservation_not_found");
    let report = reconciliation(&shop).await;
    let entry = redis_entry(&report, "sku-1");
    assert_eq!((entry["redis_available"].clone(), entry["drift"].clone()), (json!(10), json!(0)), "{report}");
    assert_counts(&shop.state("sku-1").await, 10, 0, 0, 10);
}

/// The tenant's settlement failures once there are `n` of them.
async fn wait_failures(shop: &TenantClient, n: usize) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let report = reconciliation(shop).await;
        let failures = report["settlement_failures"].as_array().cloned().unwrap_or_default();
        if failures.len() >= n {
            return failures;
        }
        assert!(tokio::time::Instant::now() < deadline, "fewer than {n} settlement failures: {report}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A stream entry the settlement consumer cannot read is kept, with its raw fields, as a dead
/// letter listed by reconciliation before it is acknowledged: nothing Redis acknowledged is
/// deleted unrecorded, and the resource's backlog still drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_stream_entry_becomes_a_dead_letter_before_it_is_acknowledged() {
    let (app, prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    let other = app.create_tenant("other").await;
    create_redis_resource(&shop, "sku-1", 10).await;
    let mut redis = redis_conn(&shared_redis_url()).await;
    let stream = format!("{prefix}:{{shop:sku-1}}:x");
    for fields in [vec![("r", "{not json"), ("d", "0")], vec![("junk", "\u{1F4A5}")]] {
        // As a script would: the entry and its count in `pending`, in one transaction.
        let mut pipe = redis::pipe();
        pipe.atomic();
        pipe.cmd("XADD").arg(&stream).arg("*").arg(&fields);
        pipe.cmd("HINCRBY").arg(format!("{prefix}:{{shop:sku-1}}:r")).arg("pending").arg(1);
        let _: (String, i64) = pipe.query_async(&mut redis).await.expect("XADD");
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let letters = loop {
        let report = reconciliation(&shop).await;
        let letters = report["dead_letters"].as_array().cloned().unwrap_or_default();
        if letters.len() == 2 {
            break letters;
        }
        assert!(tokio::time::Instant::now() < deadline, "no dead letters: {report}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let payloads: Vec<Value> =
        letters.iter().map(|l| serde_json::from_str(l["payload"].as_str().expect("payload")).expect("JSON")).collect();
    assert!(payloads.contains(&json!({"r": "{not json", "d": "0"})), "{letters:?}");
    assert!(payloads.contains(&json!({"junk": "\u{1F4A5}"})), "{letters:?}");
    assert!(letters.iter().all(|l| l["key"] == "sku-1" && !l["reason"].as_str().unwrap_or("").is_empty()));
    // XPENDING's summary starts with the number of entries delivered and not acknowledged.
    let summary: Vec<redis::Value> =
        redis::cmd("XPENDING").arg(&stream).arg("settle").query_async(&mut redis).await.expect("XPENDING");
    let unacknowledged: i64 =
        summary.first().cloned().map(redis::from_redis_value).transpose().ok().flatten().unwrap_or(-1);
    assert_eq!(unacknowledged, 0, "every entry acknowledged");
    assert_eq!(reconciliation(&other).await["dead_letters"], json!([]), "another tenant sees none");
    let warmed = shop.post("/v1/resources/sku-1/warm", &json!({})).await.expect_json(200);
    assert_eq!((warmed["unsettled"].clone(), warmed["drift"].clone()), (json!(0), json!(0)), "{warmed}");
}

/// Per-user limits hold across mode switches: what a user bought on the database path counts in
/// Redis (the first use of a limit key in Redis starts from the database's count), and what
/// they bought in Redis counts on the database path again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_user_limits_hold_across_mode_switches() {
    let (app, _prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    shop.put_plugin_config(plugin_wasm("flash-sale"), "buckets=1").await.expect_json(201);
    shop.create_resource("sku-1", 10).await;
    let reason = |reply: &Value| reply["lines"][0]["reason"].as_str().unwrap_or("").to_string();

    shop.order("a1", &deduct_one("a1", "sku-1", 1, Some("u1"))).await.expect_json(201);
    shop.patch("/v1/resources/sku-1", &json!({"mode": "redis"})).await.expect_json(200);
    let again = shop.order("a2", &deduct_one("a2", "sku-1", 1, Some("u1"))).await.expect_json(409);
    assert_eq!(reason(&again), "limit_exceeded", "u1 bought on the database path already: {again}");
    shop.order("b1", &deduct_one("b1", "sku-1", 1, Some("u2"))).await.expect_json(201);
    let twice = shop.order("b2", &deduct_one("b2", "sku-1", 1, Some("u2"))).await.expect_json(409);
    assert_eq!(reason(&twice), "limit_exceeded", "{twice}");

    shop.patch("/v1/resources/sku-1", &json!({"mode": "db"})).await.expect_json(200);
    let back = shop.order("b3", &deduct_one("b3", "sku-1", 1, Some("u2"))).await.expect_json(409);
    assert_eq!(reason(&back), "limit_exceeded", "u2 bought in Redis: {back}");
    shop.order("c1", &deduct_one("c1", "sku-1", 1, Some("u3"))).await.expect_json(201);
    assert_counts(&shop.state("sku-1").await, 7, 0, 3, 10);
}

/// Redis keeps a reservation only until its end is settled: once confirmed, released or
/// expired and written to the database, its fields leave Redis (nothing grows with the number
/// of reservations ever made), and reads and moves of it are answered from the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_leaves_redis_once_its_end_is_settled() {
    let (app, prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    create_redis_resource(&shop, "sku-1", 10).await;
    let mut ids = Vec::new();
    for (n, ttl) in [(1, 300), (2, 300), (3, 1)] {
        let key = format!("r{n}");
        let doc = shop.order(&key, &reserve(&key, &[("sku-1", 1)], Some(ttl))).await.expect_json(201);
        ids.push(doc["reservation_id"].as_str().expect("an id").to_string());
    }
    shop.confirm(&ids[0]).await.expect_json(200);
    shop.release(&ids[1]).await.expect_json(200);

    let mut redis = redis_conn(&shared_redis_url()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let fields: i64 =
            redis::cmd("HLEN").arg(format!("{prefix}:{{shop:sku-1}}:v")).query_async(&mut redis).await.expect("HLEN");
        let state = shop.state("sku-1").await;
        if fields == 0 && state["reserved"] == 0 && state["consumed"] == 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{fields} reservation fields left in Redis; {state}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (id, end) in ids.iter().zip(["confirmed", "released", "expired"]) {
        let doc = shop.reservation(id).await.expect_json(200);
        assert_eq!(doc["state"], end, "{doc}");
    }
    let again = shop.release(&ids[0]).await;
    assert_eq!(again.status(), 409, "a confirmed reservation is not released: {}", again.text);
    assert_counts(&shop.state("sku-1").await, 9, 0, 1, 10);
}

/// Stock a release returned in Redis and sold again at once settles in stream order, whichever
/// processes hold the entries: the release reaches the database before the reservation that
/// took its stock, which is never refused for want of stock the database was about to get.
/// Each round holds the database while the release and the new reservation are read by the
/// settlement consumers of two processes, then lets their commits race.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sale_of_returned_stock_settles_after_the_release_across_processes() {
    let (app_a, prefix) = redis_app(&shared_redis_url(), "").await;
    let shop_a = app_a.create_tenant("shop").await;
    let app_b = app_a.spawn_sibling().await;
    let shop_b = app_b.tenant_with_key("shop", &shop_a.api_key);
    create_redis_resource(&shop_a, "sku-1", 5).await;
    let stream = format!("{prefix}:{{shop:sku-1}}:x");
    let mut redis = redis_conn(&shared_redis_url()).await;

    let first = shop_a.order("r0", &reserve("r0", &[("sku-1", 5)], Some(300))).await.expect_json(201);
    let mut held = first["reservation_id"].as_str().expect("an id").to_string();
    wait_reserved(&shop_a, 5).await;
    for round in 1..=4 {
        let (releaser, buyer) = if round % 2 == 0 { (&shop_a, &shop_b) } else { (&shop_b, &shop_a) };
        let hold = TableHold::take(app_a.database_url()).await;
        releaser.release(&held).await.expect_json(200);
        wait_delivered(&mut redis, &stream, 1).await;
        let key = format!("r{round}");
        let doc = buyer.order(&key, &reserve(&key, &[("sku-1", 5)], Some(300))).await.expect_json(201);
        held = doc["reservation_id"].as_str().expect("an id").to_string();
        // Without one settling process per stream, the process whose consumer is not stuck on
        // the release reads the new reservation within milliseconds; with it, nobody reads it
        // until the release is settled. Either way the commits race once the hold ends.
        let _ = delivered_within(&mut redis, &stream, 2, Duration::from_secs(2)).await;
        hold.release().await;
        wait_reserved(&shop_a, 5).await;
        let report = reconciliation(&shop_a).await;
        assert_eq!(report["settlement_failures"], json!([]), "round {round}: {report}");
    }
    assert_counts(&shop_a.state("sku-1").await, 0, 5, 0, 5);
    shop_a.assert_ledger_replays_to_state("sku-1").await;
}

/// Redis restarted from a snapshot taken while a resource was in redis mode, after the
/// resource left it: the snapshot brings the resource's keys back, open, with the stock and the
/// reservations of then. A process whose view of the modes is stale (it refreshes once an hour
/// here, every `mode_refresh_ms` normally) must not sell from them, nor move a reservation there:
/// a sale in a stream of a db-mode resource is one nobody is bound to settle. A new connection
/// to Redis makes the process read the modes again before it uses Redis. It used to sell from
/// the restored stock (7 answered `201` of 5 in the database; the model check saw one such sale
/// lost, finding 7 in docs/TESTING.md) and confirm a reservation the database had released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_process_neither_sells_nor_moves_reservations_in_a_redis_restored_from_before_a_switch_to_db() {
    let mut server = RedisServer::start().await;
    let (app_a, prefix) = redis_app(&server.url(), "").await;
    let shop_a = app_a.create_tenant("shop").await;
    create_redis_resource(&shop_a, "sku-1", 10).await;
    let app_b = stale_sibling(&app_a, &server.url(), &prefix, "").await;
    let shop_b = app_b.tenant_with_key("shop", &shop_a.api_key);
    shop_b.order("warmup", &deduct_one("warmup", "sku-1", 1, None)).await.expect_json(201);
    let doc = shop_b.order("r1", &reserve("r1", &[("sku-1", 1)], Some(3600))).await.expect_json(201);
    let held = doc["reservation_id"].as_str().expect("a reservation id").to_owned();
    wait_settled(&shop_a, "sku-1", 1).await;
    wait_reserved(&shop_a, 1).await;
    let mut redis = redis_conn(&server.url()).await;
    let _: String = redis::cmd("SAVE").query_async(&mut redis).await.expect("SAVE");

    // sku-1 leaves redis mode through A; the reservation is released and 4 pieces sold on the
    // database path. B is not told.
    let back = shop_a.patch("/v1/resources/sku-1", &json!({"mode": "db"})).await.expect_json(200);
    assert_eq!(back["mode"], "db", "{back}");
    shop_a.release(&held).await.expect_json(200);
    for n in 0..4 {
        let key = format!("a{n}");
        shop_a.order(&key, &deduct_one(&key, "sku-1", 1, None)).await.expect_json(201);
    }
    assert_counts(&shop_a.state("sku-1").await, 5, 0, 5, 10);

    // Redis comes back with the snapshot: sku-1 open with 8 available, the reservation held.
    drop(redis);
    server.restart().await;
    let stream = format!("{prefix}:{{shop:sku-1}}:x");
    let mut redis = redis_conn(&server.url()).await;
    let entries: i64 = redis::cmd("XLEN").arg(&stream).query_async(&mut redis).await.expect("XLEN");
    let avail: Option<i64> = redis::cmd("HGET")
        .arg(format!("{prefix}:{{shop:sku-1}}:r"))
        .arg("avail")
        .query_async(&mut redis)
        .await
        .expect("HGET");
    assert_eq!(avail, Some(8), "the snapshot holds sku-1's stock of then");

    let mut sold = 0;
    for n in 0..7 {
        let key = format!("b{n}");
        let reply = order_through_503(&shop_b, &key, &deduct_one(&key, "sku-1", 1, None)).await;
        match reply.status() {
            201 => sold += 1,
            409 => assert_eq!(reply.json()["lines"][0]["reason"], "insufficient", "{}", reply.text),
            other => panic!("an order answered {other}: {}", reply.text),
        }
    }
    assert_eq!(sold, 5, "exactly the 5 pieces the database holds are sold");
    let confirm = shop_b.confirm(&held).await;
    assert_eq!(confirm.status(), 409, "the database released it: {}", confirm.text);
    assert_eq!(confirm.json()["code"], "reservation_released", "{}", confirm.text);
    assert_eq!(shop_b.reservation(&held).await.expect_json(200)["state"], "released");

    let after: i64 = redis::cmd("XLEN").arg(&stream).query_async(&mut redis).await.expect("XLEN");
    assert_eq!(after, entries, "nothing was sold or moved in the restored Redis");
    assert_counts(&shop_a.state("sku-1").await, 0, 0, 10, 10);
    shop_a.assert_ledger_replays_to_state("sku-1").await;
    let report = reconciliation(&shop_a).await;
    assert_eq!(report["settlement_failures"], json!([]), "{report}");
}

/// Waits until the stream has `n` entries delivered to consumers and not yet acknowledged.
async fn wait_delivered(redis: &mut redis::aio::MultiplexedConnection, stream: &str, n: i64) {
    assert!(delivered_within(redis, stream, n, Duration::from_secs(20)).await, "fewer than {n} entries delivered");
}

/// Whether the stream has `n` entries delivered and not yet acknowledged within `wait`.
async fn delivered_within(redis: &mut redis::aio::MultiplexedConnection, stream: &str, n: i64, wait: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let summary: Vec<redis::Value> =
            redis::cmd("XPENDING").arg(stream).arg("settle").query_async(redis).await.expect("XPENDING");
        let pending: i64 =
            summary.first().cloned().map(redis::from_redis_value).transpose().ok().flatten().unwrap_or(0);
        if pending >= n {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the database holds `reserved` reserved and nothing is left to settle.
async fn wait_reserved(shop: &TenantClient, reserved: i64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let report = reconciliation(shop).await;
        let state = shop.state("sku-1").await;
        let entry = redis_entry(&report, "sku-1");
        if state["reserved"] == reserved && entry["unsettled"] == 0 {
            return;
        }
        if !report["settlement_failures"].as_array().is_none_or(|f| f.is_empty()) {
            panic!("a settlement was refused: {report}");
        }
        assert!(tokio::time::Instant::now() < deadline, "not settled: {state} {report}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
