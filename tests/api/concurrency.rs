//! Concurrency: many clients racing on the same keys end with exact arithmetic, no 5xx, no
//! deadlock, and a ledger that replays to the state.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use serde_json::Value;
use tokio::sync::Barrier;

use crate::helpers::{
    assert_counts, assert_problem, assert_problem_status, deduct, entries_with_op, metric, reserve, spawn_app, tamper,
    unique, Backend, Reply, TenantClient,
};

/// Bound on how long a client keeps retrying `409 idempotency_in_progress`.
const IN_PROGRESS_DEADLINE: Duration = Duration::from_secs(30);

/// Sends an order, retrying while the server says the same key is still in flight (the
/// contract allows `409 idempotency_in_progress` with `Retry-After`), like a careful client.
async fn order_until_settled(shop: &TenantClient, key: &str, body: &Value) -> Reply {
    let deadline = tokio::time::Instant::now() + IN_PROGRESS_DEADLINE;
    loop {
        let reply = shop.order(key, body).await;
        let in_progress = reply.status() == 409
            && reply.content_type().starts_with("application/problem+json")
            && reply.json()["code"] == "idempotency_in_progress";
        if !in_progress {
            return reply;
        }
        assert!(
            reply.header("retry-after").is_some(),
            "idempotency_in_progress carries Retry-After: {:?}",
            reply.headers
        );
        assert!(tokio::time::Instant::now() < deadline, "key {key} stayed in progress");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Asserts `reply` is a rejected order whose lines are only `rejected/insufficient` (at least
/// one) or `skipped/skipped`.
#[track_caller]
fn assert_rejected_for_insufficient(reply: &Reply) {
    let doc = reply.expect_json(409);
    assert_eq!(doc["status"], "rejected", "{doc}");
    let lines = doc["lines"].as_array().expect("lines is an array");
    let mut insufficient = 0;
    for line in lines {
        assert_eq!(line["applied"], 0, "{doc}");
        match (line["status"].as_str(), line["reason"].as_str()) {
            (Some("rejected"), Some("insufficient")) => insufficient += 1,
            (Some("skipped"), Some("skipped")) => {}
            other => panic!("unexpected line outcome {other:?} in {doc}"),
        }
    }
    assert!(insufficient >= 1, "at least one line is insufficient: {doc}");
}

/// 64 clients x 2 orders of qty 1 on a stock of 50: exactly 50 succeed, 78 are rejected as
/// insufficient, and state, ledger and reconciliation agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_racing_for_fifty_units_get_exactly_fifty() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-hot", 50).await;

    let barrier = Arc::new(Barrier::new(64));
    let clients = (0..64).map(|client| {
        let shop = shop.clone();
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
    let rejected: Vec<&Reply> = replies.iter().filter(|r| r.status() == 409).collect();
    let other: Vec<String> = replies
        .iter()
        .filter(|r| r.status() != 201 && r.status() != 409)
        .map(|r| format!("{} {}", r.status, r.text))
        .collect();
    assert!(other.is_empty(), "unexpected answers: {other:?}");
    assert_eq!(created, 50);
    assert_eq!(rejected.len(), 78);
    for reply in rejected {
        assert_rejected_for_insufficient(reply);
    }

    assert_counts(&shop.state("sku-hot").await, 0, 0, 50, 50);
    let ledger = shop.assert_ledger_replays_to_state("sku-hot").await;
    let deducts = entries_with_op(&ledger, "deduct");
    assert_eq!(deducts.len(), 50);
    let orders: HashSet<&str> = deducts.iter().filter_map(|e| e["order_id"].as_str()).collect();
    assert_eq!(orders.len(), 50, "50 distinct orders in the ledger");
    shop.assert_reconciliation_clean(1).await;
}

/// 40 concurrent copies of one request: applied once, and all 40 answers carry the same status
/// and body (one fresh answer, 39 replays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_concurrent_replays_apply_once() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;
    let body = deduct("ORD-1", &[("sku-1", 7)]);

    let barrier = Arc::new(Barrier::new(40));
    let copies = (0..40).map(|_| {
        let shop = shop.clone();
        let barrier = barrier.clone();
        let body = body.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            order_until_settled(&shop, "the-one-key", &body).await
        })
    });
    let replies: Vec<Reply> =
        join_all(copies).await.into_iter().map(|r| r.expect("client task does not panic")).collect();

    let first = &replies[0];
    assert_eq!(first.status(), 201, "body: {}", first.text);
    for reply in &replies {
        assert_eq!(reply.status(), first.status(), "body: {}", reply.text);
        assert_eq!(reply.json(), first.json());
    }
    let fresh = replies.iter().filter(|r| !r.replayed()).count();
    assert_eq!(fresh, 1, "exactly one answer is the original, the rest are replays");

    assert_counts(&shop.state("sku-1").await, 93, 0, 7, 100);
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(entries_with_op(&ledger, "deduct").len(), 1);
}

/// 40 concurrent requests under one key, half of them with another body, racing plain orders
/// under fresh keys (so they share batches decided together): exactly one of the pair is
/// applied; every copy of the winner answers its outcome, every copy of the loser answers
/// `422 idempotency_key_mismatch`; the plain orders each apply once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_with_two_bodies_in_one_burst_applies_one_of_them_once() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;
    let bodies = [deduct("ORD-A", &[("sku-1", 3)]), deduct("ORD-B", &[("sku-1", 5)])];

    let barrier = Arc::new(Barrier::new(60));
    let contested = (0..40).map(|i| {
        let (shop, barrier, body) = (shop.clone(), barrier.clone(), bodies[i % 2].clone());
        tokio::spawn(async move {
            barrier.wait().await;
            (i % 2, order_until_settled(&shop, "the-contested-key", &body).await)
        })
    });
    let plain = (0..20).map(|i| {
        let (shop, barrier) = (shop.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            order_until_settled(&shop, &format!("plain-{i}"), &deduct(&format!("P-{i}"), &[("sku-1", 1)])).await
        })
    });
    let (contested, plain) = tokio::join!(join_all(contested), join_all(plain));
    let contested: Vec<(usize, Reply)> = contested.into_iter().map(|r| r.expect("client task")).collect();
    for reply in plain {
        assert_eq!(reply.expect("client task").status(), 201);
    }

    let winners: HashSet<usize> = contested.iter().filter(|(_, r)| r.status() == 201).map(|(b, _)| *b).collect();
    assert_eq!(winners.len(), 1, "exactly one body wins the key");
    let winner = *winners.iter().next().expect("a winner");
    let first = contested.iter().find(|(b, _)| *b == winner).map(|(_, r)| r.json()).expect("winner answer");
    for (body, reply) in &contested {
        if *body == winner {
            assert_eq!(reply.status(), 201, "{}", reply.text);
            assert_eq!(reply.json(), first, "every copy of the winner answers its outcome");
        } else {
            assert_problem(reply, 422, "idempotency_key_mismatch");
        }
    }
    let qty = if winner == 0 { 3 } else { 5 };
    assert_counts(&shop.state("sku-1").await, 100 - 20 - qty, 0, 20 + qty, 100);
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(entries_with_op(&ledger, "deduct").len(), 21);
    shop.assert_reconciliation_clean(1).await;
}

/// Multi-line orders over the same three keys, listed in every order by 32 concurrent clients:
/// no deadlock, no 5xx, exactly `stock` orders succeed and every key is consumed equally. And
/// the orders were decided together by batch admission, which never failed: a batch whose
/// locked rows cannot be read falls back to deciding its orders one by one, correct but slow,
/// which nothing else here would notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_line_orders_in_opposite_key_orders_do_not_deadlock() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let keys = ["k-1", "k-2", "k-3"];
    for key in keys {
        shop.create_resource(key, 200).await;
    }
    let permutations: [[usize; 3]; 6] = [[0, 1, 2], [2, 1, 0], [1, 2, 0], [0, 2, 1], [2, 0, 1], [1, 0, 2]];

    let barrier = Arc::new(Barrier::new(32));
    let clients = (0..32).map(|client| {
        let shop = shop.clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            let mut replies = Vec::new();
            for n in 0..10 {
                let order = permutations[(client * 10 + n) % permutations.len()];
                let lines: Vec<(&str, i64)> = order.iter().map(|&i| (keys[i], 1)).collect();
                let key = format!("c{client}-o{n}");
                replies.push(shop.order(&key, &deduct(&key, &lines)).await);
            }
            replies
        })
    });
    let replies: Vec<Reply> =
        join_all(clients).await.into_iter().flat_map(|r| r.expect("client task does not panic")).collect();

    let created = replies.iter().filter(|r| r.status() == 201).count();
    let mut rejected = 0;
    for reply in &replies {
        match reply.status() {
            201 => {}
            409 => {
                assert_rejected_for_insufficient(reply);
                rejected += 1;
            }
            _ => panic!("unexpected answer {} {}", reply.status, reply.text),
        }
    }
    assert_eq!(created, 200);
    assert_eq!(rejected, 120);
    for key in keys {
        assert_counts(&shop.state(key).await, 0, 0, 200, 200);
        let ledger = shop.assert_ledger_replays_to_state(key).await;
        assert_eq!(entries_with_op(&ledger, "deduct").len(), 200, "{key}");
    }
    shop.assert_reconciliation_clean(3).await;
    let admitted = metric(&app, "stockd_orders_admitted_in_batch_total", &[]).await;
    assert!(admitted > 0.0, "no order of 320 was decided by batch admission");
    let logs = app.logs();
    assert!(!logs.contains("batch admission failed"), "batch admission failed:\n{logs}");
}

/// Concurrent reserves, confirms, releases and deducts on one key settle to exact sums.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reservations_and_deducts_settle_exactly() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;

    let barrier = Arc::new(Barrier::new(48));
    let reservers = (0..32).map(|client| {
        let shop = shop.clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            let key = unique("rsv");
            let doc = shop.order(&key, &reserve(&key, &[("sku-1", 2)], Some(600))).await.expect_json(201);
            let id = doc["reservation_id"].as_str().expect("reservation_id").to_owned();
            let settled = if client % 2 == 0 { shop.confirm(&id).await } else { shop.release(&id).await };
            settled.expect_json(200)["state"].as_str().unwrap_or_default().to_owned()
        })
    });
    let deducters = (0..16).map(|_| {
        let shop = shop.clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            let key = unique("ded");
            let doc = shop.order(&key, &deduct(&key, &[("sku-1", 1)])).await.expect_json(201);
            doc["status"].as_str().unwrap_or_default().to_owned()
        })
    });
    let (settled, deducted) = tokio::join!(join_all(reservers), join_all(deducters));
    let settled: Vec<String> = settled.into_iter().map(|r| r.expect("task does not panic")).collect();
    assert_eq!(settled.iter().filter(|s| *s == "confirmed").count(), 16);
    assert_eq!(settled.iter().filter(|s| *s == "released").count(), 16);
    for status in deducted {
        assert_eq!(status.expect("task does not panic"), "succeeded");
    }

    // 16 confirmed x 2 + 16 deducted x 1 consumed; released holds are available again.
    assert_counts(&shop.state("sku-1").await, 52, 0, 48, 100);
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(entries_with_op(&ledger, "reserve").len(), 32);
    assert_eq!(entries_with_op(&ledger, "confirm").len(), 16);
    assert_eq!(entries_with_op(&ledger, "release").len(), 16);
    assert_eq!(entries_with_op(&ledger, "deduct").len(), 16);
    shop.assert_reconciliation_clean(1).await;
}

/// Confirms and releases racing on one reservation: exactly one of them takes effect, and every
/// answer agrees with the winner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_confirm_and_release_settle_once() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let doc = shop.order("idem-1", &reserve("ORD-1", &[("sku-1", 4)], Some(600))).await.expect_json(201);
    let id = doc["reservation_id"].as_str().expect("reservation_id").to_owned();

    let barrier = Arc::new(Barrier::new(20));
    let racers = (0..20).map(|i| {
        let shop = shop.clone();
        let barrier = barrier.clone();
        let id = id.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            let confirm = i % 2 == 0;
            let reply = if confirm { shop.confirm(&id).await } else { shop.release(&id).await };
            (confirm, reply)
        })
    });
    let results: Vec<(bool, Reply)> =
        join_all(racers).await.into_iter().map(|r| r.expect("task does not panic")).collect();

    let final_state = shop.reservation(&id).await.expect_json(200)["state"].clone();
    let confirmed = final_state == "confirmed";
    assert!(confirmed || final_state == "released", "final state {final_state}");
    for (is_confirm, reply) in &results {
        if *is_confirm == confirmed {
            assert_eq!(reply.expect_json(200)["state"], final_state);
        } else {
            let code = if confirmed { "reservation_confirmed" } else { "reservation_released" };
            crate::helpers::assert_problem(reply, 409, code);
        }
    }
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    let settles = entries_with_op(&ledger, "confirm").len() + entries_with_op(&ledger, "release").len();
    assert_eq!(settles, 1);
    if confirmed {
        assert_counts(&shop.state("sku-1").await, 6, 0, 4, 10);
    } else {
        assert_counts(&shop.state("sku-1").await, 10, 0, 0, 10);
    }
}

/// Makes the database refuse every deduction of `poison` (a trigger on the ledger), behind the
/// server's back: an order for it fails in the middle of whatever batch it is in.
async fn poison_deductions(database_url: &str) {
    let statements: &[&str] = match Backend::from_env() {
        Backend::Sqlite => &["CREATE TRIGGER poison BEFORE INSERT ON ledger
                              WHEN NEW.resource_key = 'poison' AND NEW.op = 'deduct'
                              BEGIN SELECT RAISE(ABORT, 'poisoned'); END"],
        Backend::Postgres => &[
            "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.resource_key = 'poison' AND NEW.op = 'deduct' THEN RAISE EXCEPTION 'poisoned'; END IF;
                 RETURN NEW;
             END $$",
            "CREATE TRIGGER poison BEFORE INSERT ON ledger FOR EACH ROW EXECUTE FUNCTION poison()",
        ],
        Backend::Mysql => &["CREATE TRIGGER poison BEFORE INSERT ON ledger FOR EACH ROW
                             BEGIN
                                 IF NEW.resource_key = 'poison' AND NEW.op = 'deduct' THEN
                                     SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'poisoned';
                                 END IF;
                             END"],
    };
    tamper(database_url, statements).await;
}

/// An order whose write fails in the middle of a batch fails alone: batch admission, which
/// decided it with the others, is undone as a whole and the batch decided again order by order,
/// so every other order of the batch still applies exactly once and the failed one leaves
/// nothing behind (no ledger entry, no count moved, no stored answer: a retry after the fault is
/// gone applies it). Bursts of concurrent orders go on until the server reports an admission
/// that failed (so a mixed batch was seen), within a deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_failing_inside_a_batch_fails_alone() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-ok", 100_000).await;
    shop.create_resource("poison", 100_000).await;
    poison_deductions(app.database_url()).await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let (mut applied, mut failed) = (0, Vec::new());
    let mut round = 0;
    while !app.logs().contains("batch admission failed") {
        assert!(tokio::time::Instant::now() < deadline, "no batch mixed a failing order with others");
        let barrier = Arc::new(Barrier::new(24));
        let clients = (0..24).map(|client| {
            let (shop, barrier) = (shop.clone(), barrier.clone());
            let sku = if client % 6 == 0 { "poison" } else { "sku-ok" };
            let key = format!("r{round}-c{client}");
            tokio::spawn(async move {
                barrier.wait().await;
                let reply = shop.order(&key, &deduct(&key, &[(sku, 1)])).await;
                (sku, key, reply)
            })
        });
        for (sku, key, reply) in join_all(clients).await.into_iter().map(|r| r.expect("client task")) {
            match sku {
                "sku-ok" => {
                    assert_eq!(reply.status(), 201, "{key}: {}", reply.text);
                    applied += 1;
                }
                _ => {
                    let problem = assert_problem_status(&reply, reply.status());
                    assert!(reply.status() >= 500, "{key}: {}", reply.text);
                    assert!(!reply.text.contains("poisoned"), "the database's error stays inside: {problem}");
                    failed.push(key);
                }
            }
        }
        round += 1;
    }

    assert_counts(&shop.state("sku-ok").await, 100_000 - applied, 0, applied, 100_000);
    assert_eq!(entries_with_op(&shop.assert_ledger_replays_to_state("sku-ok").await, "deduct").len() as i64, applied);
    assert_counts(&shop.state("poison").await, 100_000, 0, 0, 100_000);
    assert!(entries_with_op(&shop.ledger("poison").await, "deduct").is_empty());

    // Nothing of the failed orders was stored: with the fault gone, a retry applies each once.
    let drop = match Backend::from_env() {
        Backend::Postgres => "DROP TRIGGER poison ON ledger",
        Backend::Sqlite | Backend::Mysql => "DROP TRIGGER poison",
    };
    tamper(app.database_url(), &[drop]).await;
    for key in &failed {
        shop.order(key, &deduct(key, &[("poison", 1)])).await.expect_json(201);
    }
    let n = failed.len() as i64;
    assert_counts(&shop.state("poison").await, 100_000 - n, 0, n, 100_000);
    shop.assert_reconciliation_clean(2).await;
}

/// Sets the kind of `tenant`'s row `unreadable` behind the server's back, past the schema's
/// CHECK: `gift-card` is a kind this server does not know (as a newer version's might).
async fn set_kind(database_url: &str, tenant: &str, kind: &str) {
    let update =
        format!("UPDATE resources SET kind = '{kind}' WHERE tenant_id = '{tenant}' AND \"key\" = 'unreadable'");
    let past_check = match Backend::from_env() {
        Backend::Sqlite => "PRAGMA ignore_check_constraints = ON",
        Backend::Postgres => "ALTER TABLE resources DROP CONSTRAINT IF EXISTS resources_kind_check",
        Backend::Mysql => "SET SESSION check_constraint_checks = 0",
    };
    tamper(database_url, &[past_check, &update]).await;
}

/// A resource row the server cannot read never fails another tenant's orders: a batch that
/// mixes them with orders naming it is decided again order by order, and every other order
/// still applies exactly once. The orders naming it apply once or fail alone (the guarded
/// UPDATE of the order-by-order path does not need the row's kind unless the plan names one),
/// with nothing of the stored value in the answer. Bursts of concurrent orders from both
/// tenants go on until the server reports an admission that failed (so a mixed batch was
/// seen), within a deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_server_cannot_read_never_fails_another_tenants_orders() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let other = app.create_tenant("other").await;
    shop.create_resource("sku-ok", 100_000).await;
    other.create_resource("unreadable", 100_000).await;
    set_kind(app.database_url(), &other.id, "gift-card").await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let (mut applied, mut applied_unreadable) = (0, 0);
    let mut round = 0;
    while !app.logs().contains("batch admission failed") {
        assert!(tokio::time::Instant::now() < deadline, "no batch mixed an unreadable row with others");
        let barrier = Arc::new(Barrier::new(24));
        let clients = (0..24).map(|client| {
            let barrier = barrier.clone();
            let (tenant, sku) = if client % 6 == 0 { (other.clone(), "unreadable") } else { (shop.clone(), "sku-ok") };
            let key = format!("r{round}-c{client}");
            tokio::spawn(async move {
                barrier.wait().await;
                let reply = tenant.order(&key, &deduct(&key, &[(sku, 1)])).await;
                (sku, key, reply)
            })
        });
        for (sku, key, reply) in join_all(clients).await.into_iter().map(|r| r.expect("client task")) {
            if sku == "sku-ok" {
                assert_eq!(reply.status(), 201, "{key}: {}", reply.text);
                applied += 1;
            } else if reply.status() == 201 {
                applied_unreadable += 1;
            } else {
                let problem = assert_problem_status(&reply, 500);
                assert!(!reply.text.contains("gift-card"), "the stored value stays inside: {problem}");
            }
        }
        round += 1;
    }

    assert_counts(&shop.state("sku-ok").await, 100_000 - applied, 0, applied, 100_000);
    assert_eq!(entries_with_op(&shop.assert_ledger_replays_to_state("sku-ok").await, "deduct").len() as i64, applied);
    // Readable again, the row holds exactly the orders that were answered 201 for it.
    set_kind(app.database_url(), &other.id, "inventory").await;
    assert_counts(&other.state("unreadable").await, 100_000 - applied_unreadable, 0, applied_unreadable, 100_000);
    let taken = entries_with_op(&other.assert_ledger_replays_to_state("unreadable").await, "deduct").len() as i64;
    assert_eq!(taken, applied_unreadable, "the orders naming the unreadable row that answered 201, each once");
}
