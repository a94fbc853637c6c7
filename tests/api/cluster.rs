//! Several stateless stockd processes on one database, clients spread across them: the
//! promises hold across processes because the database decides, not in-process locks. One
//! process's refusal of one order must not fail the others it commits with.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use serde_json::{json, Value};
use tokio::sync::Barrier;

use crate::helpers::{
    assert_counts, deduct, entries_with_op, reserve, spawn_app_with, try_send, unique, AppOptions, Reply, TenantClient,
    TestApp,
};
use crate::redis_support::{deduct_one, redis_app, shared_redis_url};

const FAST_SWEEP: &str = "[reservations]\nsweep_interval_ms = 200";
/// How long reservations may take to expire with three sweepers running.
const EXPIRY_DEADLINE: Duration = Duration::from_secs(20);

/// Three processes on one database; returns them and the tenant as seen by each.
async fn cluster(opts: AppOptions) -> (Vec<TestApp>, Vec<TenantClient>) {
    let first = spawn_app_with(opts).await;
    let shop = first.create_tenant("shop").await;
    let second = first.spawn_sibling().await;
    let third = first.spawn_sibling().await;
    let apps = vec![first, second, third];
    let clients = apps.iter().map(|app| app.tenant_with_key(&shop.id, &shop.api_key)).collect();
    (apps, clients)
}

/// 64 clients spread over three processes, 2 orders each, on a stock of 50: exactly 50 succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_racing_for_fifty_units_sell_exactly_fifty() {
    let (_apps, shops) = cluster(AppOptions::default()).await;
    shops[0].create_resource("sku-hot", 50).await;

    let barrier = Arc::new(Barrier::new(64));
    let clients = (0..64).map(|client| {
        let shop = shops[client % shops.len()].clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            let mut replies = Vec::new();
            for n in 0..2 {
                let key = format!("c{client}-o{n}");
                replies.push(shop.order(&key, &deduct(&key, &[("sku-hot", 1)])).await);
            }
            replies
        })
    });
    let replies: Vec<Reply> =
        join_all(clients).await.into_iter().flat_map(|r| r.expect("client task does not panic")).collect();

    let created = replies.iter().filter(|r| r.status() == 201).count();
    let rejected = replies.iter().filter(|r| r.status() == 409).count();
    let other: Vec<String> = replies
        .iter()
        .filter(|r| ![201, 409].contains(&r.status()))
        .map(|r| format!("{} {}", r.status, r.text))
        .collect();
    assert!(other.is_empty(), "unexpected answers: {other:?}");
    assert_eq!((created, rejected), (50, 78));

    // Every process reads the same state.
    for shop in &shops {
        assert_counts(&shop.state("sku-hot").await, 0, 0, 50, 50);
    }
    let ledger = shops[1].assert_ledger_replays_to_state("sku-hot").await;
    assert_eq!(entries_with_op(&ledger, "deduct").len(), 50);
    shops[2].assert_reconciliation_clean(1).await;
}

/// 30 copies of one request sent concurrently to three processes: applied once, and every
/// answer carries the same status and body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_replays_sent_to_different_processes_apply_once() {
    let (_apps, shops) = cluster(AppOptions::default()).await;
    shops[0].create_resource("sku-1", 100).await;
    let body = deduct("ORD-1", &[("sku-1", 7)]);

    let barrier = Arc::new(Barrier::new(30));
    let copies = (0..30).map(|i| {
        let shop = shops[i % shops.len()].clone();
        let barrier = barrier.clone();
        let body = body.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            shop.order("the-one-key", &body).await
        })
    });
    let replies: Vec<Reply> =
        join_all(copies).await.into_iter().map(|r| r.expect("client task does not panic")).collect();

    let first = &replies[0];
    assert_eq!(first.status(), 201, "body: {}", first.text);
    for reply in &replies {
        assert_eq!(reply.status(), 201, "body: {}", reply.text);
        assert_eq!(reply.json(), first.json());
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1, "exactly one original answer");
    assert_counts(&shops[2].state("sku-1").await, 93, 0, 7, 100);
    let ledger = shops[1].assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(entries_with_op(&ledger, "deduct").len(), 1);
}

/// Multi-line orders listing the same keys in opposite orders, from clients on three
/// processes: the sums are exact, and no batch deadlocked another process's batch (every
/// process locks a batch's rows in one global order before it writes), so none was retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_line_orders_in_opposite_orders_across_processes_are_exact() {
    let (apps, shops) = cluster(AppOptions::default()).await;
    let keys = ["k-1", "k-2", "k-3"];
    for key in keys {
        shops[0].create_resource(key, 90).await;
    }
    let orders: [[usize; 3]; 2] = [[0, 1, 2], [2, 1, 0]];

    let barrier = Arc::new(Barrier::new(24));
    let clients = (0..24).map(|client| {
        let shop = shops[client % shops.len()].clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            let mut replies = Vec::new();
            for n in 0..5 {
                let lines: Vec<(&str, i64)> = orders[(client + n) % 2].iter().map(|&i| (keys[i], 1)).collect();
                let key = format!("c{client}-o{n}");
                replies.push(shop.order(&key, &deduct(&key, &lines)).await);
            }
            replies
        })
    });
    let replies: Vec<Reply> =
        join_all(clients).await.into_iter().flat_map(|r| r.expect("client task does not panic")).collect();

    let created = replies.iter().filter(|r| r.status() == 201).count();
    let rejected = replies.iter().filter(|r| r.status() == 409).count();
    assert_eq!((created, rejected), (90, 30), "answers: {:?}", replies.iter().map(|r| r.status()).collect::<Vec<_>>());
    for key in keys {
        assert_counts(&shops[0].state(key).await, 0, 0, 90, 90);
        shops[1].assert_ledger_replays_to_state(key).await;
    }
    shops[2].assert_reconciliation_clean(3).await;
    for app in &apps {
        let metrics = app.get_anonymous("/metrics").await.text;
        let retried = metrics.lines().filter(|l| l.starts_with("stockd_batch_retries_total")).collect::<Vec<_>>();
        assert!(retried.iter().all(|l| l.ends_with(" 0")), "no batch was rerun: {retried:?}");
    }
}

/// Three sweepers racing over the same due reservations: each expires exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sweepers_expire_each_reservation_exactly_once() {
    let (_apps, shops) = cluster(AppOptions::default().toml(FAST_SWEEP)).await;
    shops[0].create_resource("sku-1", 100).await;
    shops[0].create_resource("sku-2", 100).await;
    let mut ids = Vec::new();
    for n in 0..20 {
        let shop = &shops[n % shops.len()];
        let key = format!("rsv-{n}");
        let doc = shop.order(&key, &reserve(&key, &[("sku-1", 2), ("sku-2", 1)], Some(1))).await.expect_json(201);
        ids.push(doc["reservation_id"].as_str().expect("reservation id").to_owned());
    }

    let deadline = tokio::time::Instant::now() + EXPIRY_DEADLINE;
    for id in &ids {
        loop {
            let state = shops[0].reservation(id).await.expect_json(200);
            if state["state"] == "expired" {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{id} did not expire: {state}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    assert_counts(&shops[1].state("sku-1").await, 100, 0, 0, 100);
    assert_counts(&shops[2].state("sku-2").await, 100, 0, 0, 100);
    for key in ["sku-1", "sku-2"] {
        let ledger = shops[0].assert_ledger_replays_to_state(key).await;
        let expired: Vec<&str> =
            entries_with_op(&ledger, "expire").iter().filter_map(|e| e["reservation_id"].as_str()).collect();
        let distinct: HashSet<&str> = expired.iter().copied().collect();
        assert_eq!(expired.len(), 20, "{key}: one expire entry per reservation");
        assert_eq!(distinct.len(), 20, "{key}: no reservation expired twice");
    }
}

/// Load on three processes, one killed with SIGKILL mid-run: the other two keep answering,
/// and afterwards every acknowledged order is in the ledger exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_process_leaves_the_others_serving_and_loses_nothing() {
    let (mut apps, shops) = cluster(AppOptions::default()).await;
    shops[0].create_resource("sku-1", 1_000_000).await;

    let acknowledged = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..12)
        .map(|w| {
            let shop = shops[w % shops.len()].clone();
            let acknowledged = acknowledged.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut n = 0;
                let mut after_kill_ok = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 2_000 {
                    n += 1;
                    let key = format!("w{w}-o{n}");
                    let body = deduct(&key, &[("sku-1", 1)]);
                    match try_send(shop.keyed("/v1/orders", &key, &body)).await {
                        Ok(reply) if reply.status() == 201 => {
                            acknowledged.lock().expect("not poisoned").push(key);
                            after_kill_ok += 1;
                        }
                        // The killed process's clients see connection errors; that is expected.
                        _ if w % 3 == 2 => tokio::time::sleep(Duration::from_millis(20)).await,
                        Ok(reply) => panic!("surviving process answered {} {}", reply.status, reply.text),
                        Err(err) => panic!("surviving process failed: {err}"),
                    }
                }
                after_kill_ok
            })
        })
        .collect();

    // Let load build up, kill the third process, and keep going on the other two.
    tokio::time::sleep(Duration::from_millis(700)).await;
    apps[2].kill9().await;
    let before = acknowledged.lock().expect("not poisoned").len();
    tokio::time::sleep(Duration::from_millis(700)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    join_all(workers).await.into_iter().for_each(|r| {
        r.expect("worker does not panic");
    });
    let acknowledged = acknowledged.lock().expect("not poisoned").clone();
    assert!(acknowledged.len() > before, "the surviving processes kept acknowledging orders");

    let ledger = shops[0].assert_ledger_replays_to_state("sku-1").await;
    let deducts = entries_with_op(&ledger, "deduct");
    let in_ledger: Vec<&str> = deducts.iter().filter_map(|e| e["order_id"].as_str()).collect();
    let distinct: HashSet<&str> = in_ledger.iter().copied().collect();
    assert_eq!(in_ledger.len(), distinct.len(), "no order applied twice");
    for key in &acknowledged {
        assert!(distinct.contains(key.as_str()), "acknowledged order {key} is in the ledger");
    }
    let state = shops[1].state("sku-1").await;
    assert_eq!(state["consumed"], Value::from(in_ledger.len() as i64));
    shops[0].assert_reconciliation_clean(1).await;
}

/// db-mode resources of tenant X in the group-commit test, each with this stock.
const X_KEYS: [&str; 5] = ["x-0", "x-1", "x-2", "x-3", "x-4"];
const X_STOCK: i64 = 1_000;
/// Clients sending tenant R's refused orders in a loop during X's burst.
const R_LOOPERS: usize = 4;
/// How long the first of R's refused orders may take to be answered.
const R_FIRST_ANSWER_DEADLINE: Duration = Duration::from_secs(30);

/// Proves one order's "retry later" answer does not fail the other orders of its group
/// commit. Two processes share the database, one with `[redis]`, one without; tenant R's
/// `hot` is switched to redis mode through the first. Through the process without Redis, which
/// takes `hot` for a db-mode resource, R's orders on `hot` reach the database path, whose guard
/// refuses them (the database copy Redis was warmed from is never sold); meanwhile 50
/// concurrent orders of tenant X on db-mode resources go through the same process, so they
/// share batches with R's (R's are sent in a loop from before X's burst until all of X's are
/// answered). Every one of X's orders is 201 and X's stock drops by exactly what they bought;
/// nothing is taken from R's database copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_order_does_not_fail_the_other_orders_of_its_batch() {
    let (app, _prefix) = redis_app(&shared_redis_url(), "").await;
    let plain = app.spawn_sibling_with(AppOptions::default()).await;
    let r = app.create_tenant("r").await;
    let x = app.create_tenant("x").await;
    r.create_resource("hot", 100).await;
    let switched = r.patch("/v1/resources/hot", &json!({"mode": "redis"})).await.expect_json(200);
    assert_eq!(switched["mode"], "redis", "{switched}");
    for key in X_KEYS {
        x.create_resource(key, X_STOCK).await;
    }
    let r_plain = plain.tenant_with_key(&r.id, &r.api_key);
    let x_plain = plain.tenant_with_key(&x.id, &x.api_key);

    // R's orders, in a loop on several clients until X's burst is answered.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (answered_tx, mut answered_rx) = tokio::sync::watch::channel(0usize);
    let answered_tx = Arc::new(answered_tx);
    let loopers: Vec<_> = (0..R_LOOPERS)
        .map(|_| {
            let (shop, stop, answered) = (r_plain.clone(), stop.clone(), answered_tx.clone());
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let key = unique("r");
                    let reply = shop.order(&key, &deduct_one(&key, "hot", 1, None)).await;
                    statuses.push(reply.status());
                    answered.send_modify(|n| *n += 1);
                }
                statuses
            })
        })
        .collect();
    tokio::time::timeout(R_FIRST_ANSWER_DEADLINE, answered_rx.wait_for(|n| *n > 0))
        .await
        .expect("the first of R's orders is answered")
        .expect("the loopers hold the sender");

    let barrier = Arc::new(Barrier::new(50));
    let burst = (0..50).map(|i| {
        let (shop, barrier) = (x_plain.clone(), barrier.clone());
        let (key, qty) = (X_KEYS[i % X_KEYS.len()], 1 + (i as i64 % 3));
        tokio::spawn(async move {
            barrier.wait().await;
            let idempotency_key = format!("x-{i}");
            let reply = shop.order(&idempotency_key, &deduct_one(&idempotency_key, key, qty, None)).await;
            (key, qty, reply)
        })
    });
    let replies: Vec<(&str, i64, Reply)> =
        join_all(burst).await.into_iter().map(|r| r.expect("client task does not panic")).collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let r_statuses: Vec<u16> =
        join_all(loopers).await.into_iter().flat_map(|r| r.expect("looper task does not panic")).collect();

    let mut failed: HashMap<String, usize> = HashMap::new();
    for (.., reply) in replies.iter().filter(|(.., r)| r.status() != 201) {
        *failed.entry(format!("{} {}", reply.status, reply.text)).or_default() += 1;
    }
    let r_answers: HashSet<u16> = r_statuses.iter().copied().collect();
    assert!(
        failed.is_empty(),
        "{} of X's 50 orders failed beside R's {} refused orders (answered {r_answers:?}); X's answers: {failed:?}",
        failed.values().sum::<usize>(),
        r_statuses.len(),
    );
    for key in X_KEYS {
        let bought: i64 = replies.iter().filter(|(k, ..)| *k == key).map(|(_, qty, _)| qty).sum();
        assert_counts(&x.state(key).await, X_STOCK - bought, 0, bought, X_STOCK);
        let ledger = x_plain.assert_ledger_replays_to_state(key).await;
        assert_eq!(entries_with_op(&ledger, "deduct").len(), replies.iter().filter(|(k, ..)| *k == key).count());
    }
    x.assert_reconciliation_clean(X_KEYS.len() as u64).await;

    assert_counts(&r_plain.state("hot").await, 100, 0, 0, 100);
    let ledger = r_plain.assert_ledger_replays_to_state("hot").await;
    assert!(entries_with_op(&ledger, "deduct").is_empty(), "nothing taken from R's database copy: {ledger:?}");
    drop(plain);
}
