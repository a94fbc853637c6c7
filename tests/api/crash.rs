//! Process faults: `kill -9` under load and restart, and graceful SIGTERM. Every acknowledged
//! request is present exactly once afterwards; requests in flight at the crash are either wholly
//! applied (and replay) or not applied at all (and their key is free).

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::join_all;
use serde_json::Value;
use tokio::sync::Notify;

use crate::helpers::{assert_counts, deduct, entries_with_op, reserve, spawn_app, try_send, TenantClient, TestApp};

/// How many concurrent clients keep the server busy.
const LOAD_CLIENTS: usize = 16;
/// Orders acknowledged before the fault is injected.
const ACKS_BEFORE_FAULT: usize = 400;
/// Bound on each client's loop (it normally stops at the first transport error).
const MAX_ORDERS_PER_CLIENT: usize = 5_000;
/// Bound on reaching `ACKS_BEFORE_FAULT` and on clients noticing the fault.
const LOAD_DEADLINE: Duration = Duration::from_secs(120);

/// What the load clients saw.
#[derive(Default)]
struct LoadRecord {
    /// Idempotency key (also the order id) and body of every 201.
    acked: Vec<(String, Value)>,
    /// Keys whose request got no HTTP answer (in flight or refused at the fault).
    unanswered: Vec<String>,
    /// Any other answer, which the contract does not allow here.
    unexpected: Vec<String>,
}

/// Runs `LOAD_CLIENTS` clients sending single-line deduct orders of qty 1 on `key`, each with a
/// unique idempotency key, until their first transport error. Calls `fault` once
/// `ACKS_BEFORE_FAULT` orders have been acknowledged, then waits for every client to stop.
async fn run_load_with_fault<F, Fut>(shop: &TenantClient, key: &'static str, fault: F) -> LoadRecord
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let record = Arc::new(Mutex::new(LoadRecord::default()));
    let acks = Arc::new(AtomicUsize::new(0));
    let enough = Arc::new(Notify::new());
    let clients: Vec<_> = (0..LOAD_CLIENTS)
        .map(|client| {
            let shop = shop.clone();
            let record = record.clone();
            let acks = acks.clone();
            let enough = enough.clone();
            tokio::spawn(async move {
                for n in 0..MAX_ORDERS_PER_CLIENT {
                    let idem = format!("load-c{client}-n{n}");
                    let request = shop.keyed("/v1/orders", &idem, &deduct(&idem, &[(key, 1)]));
                    match try_send(request).await {
                        Ok(reply) if reply.status() == 201 => {
                            let body = reply.json();
                            record.lock().expect("no panics while locked").acked.push((idem, body));
                            if acks.fetch_add(1, Ordering::SeqCst) + 1 == ACKS_BEFORE_FAULT {
                                enough.notify_one();
                            }
                        }
                        Ok(reply) => {
                            let line = format!("{idem}: {} {}", reply.status, reply.text);
                            record.lock().expect("no panics while locked").unexpected.push(line);
                        }
                        Err(_) => {
                            record.lock().expect("no panics while locked").unanswered.push(idem);
                            return;
                        }
                    }
                }
            })
        })
        .collect();

    tokio::time::timeout(LOAD_DEADLINE, enough.notified())
        .await
        .expect("the server acknowledges enough orders under load");
    fault().await;
    tokio::time::timeout(LOAD_DEADLINE, join_all(clients))
        .await
        .expect("every client stops after the fault")
        .into_iter()
        .for_each(|r| r.expect("client task does not panic"));

    let mut record = record.lock().expect("no panics while locked");
    std::mem::take(&mut *record)
}

/// After a restart: every acknowledged key replays its 201 with `Idempotent-Replayed: true`
/// and the same body; the ledger holds each acknowledged order exactly once; unanswered keys are
/// either in the ledger (and replay) or free (and apply now); ledger == state; no drift.
async fn assert_load_survived(shop: &TenantClient, key: &str, record: &LoadRecord) {
    assert!(record.unexpected.is_empty(), "unexpected answers under load: {:#?}", record.unexpected);
    assert!(record.acked.len() >= ACKS_BEFORE_FAULT);
    println!("load: {} acknowledged, {} unanswered at the fault", record.acked.len(), record.unanswered.len());

    for (idem, body) in &record.acked {
        let reply = shop.order(idem, &deduct(idem, &[(key, 1)])).await;
        assert_eq!(reply.status(), 201, "acknowledged {idem} replays 201: {}", reply.text);
        assert!(reply.replayed(), "acknowledged {idem} is answered as a replay");
        assert_eq!(&reply.json(), body, "acknowledged {idem} replays the same body");
    }

    let ledger = shop.assert_ledger_replays_to_state(key).await;
    let deducts = entries_with_op(&ledger, "deduct");
    let in_ledger: HashSet<String> =
        deducts.iter().map(|e| e["order_id"].as_str().expect("deduct entries name their order").to_owned()).collect();
    assert_eq!(in_ledger.len(), deducts.len(), "no order appears twice in the ledger");
    let state = shop.state(key).await;
    assert_eq!(state["consumed"].as_u64(), Some(in_ledger.len() as u64), "consumed == orders in ledger");
    for (idem, _) in &record.acked {
        assert!(in_ledger.contains(idem), "acknowledged {idem} is in the ledger");
    }

    // In-flight requests were all-or-nothing: applied ones replay, the others' keys are free.
    for idem in &record.unanswered {
        let reply = shop.order(idem, &deduct(idem, &[(key, 1)])).await;
        assert_eq!(reply.status(), 201, "unanswered {idem} settles with 201: {}", reply.text);
        assert_eq!(
            reply.replayed(),
            in_ledger.contains(idem),
            "unanswered {idem}: replayed iff it was applied before the crash"
        );
    }

    let ledger = shop.assert_ledger_replays_to_state(key).await;
    let deducts = entries_with_op(&ledger, "deduct");
    let orders: HashSet<&str> = deducts.iter().filter_map(|e| e["order_id"].as_str()).collect();
    assert_eq!(orders.len(), deducts.len(), "no order appears twice in the ledger");
    assert_eq!(orders.len(), record.acked.len() + record.unanswered.len());
    let state = shop.state(key).await;
    assert_eq!(state["consumed"].as_u64(), Some(orders.len() as u64));
    shop.assert_reconciliation_clean(1).await;
}

/// kill -9 in the middle of a stream of orders from 16 clients, then restart on the same
/// database: every acknowledged order is there exactly once and replays; nothing is half-applied
/// or stuck in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_orders_survive_kill_9_exactly_once() {
    let mut app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-load", 1_000_000).await;

    let app_ref: &mut TestApp = &mut app;
    let record = run_load_with_fault(&shop, "sku-load", move || app_ref.kill9()).await;
    app.restart().await;

    assert_load_survived(&shop, "sku-load", &record).await;
}

/// SIGTERM during a stream of orders: the server finishes in-flight requests and exits with
/// status 0, and after a restart every acknowledged order is there exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_exits_zero_and_keeps_every_acknowledged_order() {
    let mut app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-load", 1_000_000).await;

    let mut exit = None;
    let (exit_ref, app_ref) = (&mut exit, &mut app);
    let record = run_load_with_fault(&shop, "sku-load", move || async move {
        *exit_ref = Some(app_ref.terminate().await);
    })
    .await;
    let status = exit.expect("the fault ran");
    assert_eq!(status.code(), Some(0), "exit status after SIGTERM: {status:?}\n{}", app.logs());
    app.restart().await;

    assert_load_survived(&shop, "sku-load", &record).await;
}

/// SIGTERM on an idle server exits with status 0, and the data is there after a restart.
#[tokio::test]
async fn sigterm_shuts_down_with_exit_status_zero() {
    let mut app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let first = shop.order("idem-1", &deduct("ORD-1", &[("sku-1", 3)])).await;
    assert_eq!(first.status(), 201);

    let status = app.terminate().await;
    assert_eq!(status.code(), Some(0), "exit status after SIGTERM: {status:?}\n{}", app.logs());

    app.restart().await;
    assert_counts(&shop.state("sku-1").await, 7, 0, 3, 10);
    let replay = shop.order("idem-1", &deduct("ORD-1", &[("sku-1", 3)])).await;
    assert!(replay.replayed());
    assert_eq!(replay.json(), first.json());
    shop.assert_ledger_replays_to_state("sku-1").await;
}

/// A held reservation survives kill -9 and can be confirmed after the restart; tenants and keys
/// survive too.
#[tokio::test]
async fn held_reservation_survives_kill_9() {
    let mut app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let doc = shop.order("idem-1", &reserve("ORD-1", &[("sku-1", 4)], Some(3600))).await.expect_json(201);
    let id = doc["reservation_id"].as_str().expect("reservation_id").to_owned();

    app.kill9().await;
    app.restart().await;

    assert_eq!(shop.reservation(&id).await.expect_json(200)["state"], "held");
    assert_counts(&shop.state("sku-1").await, 6, 4, 0, 10);
    assert_eq!(shop.confirm(&id).await.expect_json(200)["state"], "confirmed");
    assert_counts(&shop.state("sku-1").await, 6, 0, 4, 10);
    shop.assert_ledger_replays_to_state("sku-1").await;
    let tenants = app.admin_get("/v1/admin/tenants").await.expect_json(200);
    assert_eq!(tenants["items"].as_array().map(Vec::len), Some(1));
}
