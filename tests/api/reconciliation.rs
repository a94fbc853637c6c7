//! Incremental reconciliation: each pass replays, per resource (bucket), only the ledger rows
//! written since the last pass that found it clean (its checkpoint), and never hides drift.
//!
//! The white-box steps change the database behind the server's back (tables `resources` and
//! `ledger` of the migrations), as a bug or an operator could: a counter moved without a ledger
//! row, and a ledger row changed or deleted below a checkpoint. The first is found by every
//! pass; the second only by a full pass (`?pass=full`, or every `[reconciliation] full_every`-th
//! background pass), after which the incremental passes report it too.

use std::time::Duration;

use serde_json::{json, Value};

use crate::helpers::{deduct, reserve, spawn_app_with, tamper, AppOptions, TenantClient, TestApp};

/// No background pass runs unless a test asks for one: the counts below are the requests' own.
fn no_background_pass() -> AppOptions {
    AppOptions::default().toml("[reconciliation]\ninterval_seconds = 0")
}

/// `sku-1` with 100, then `orders` deductions of 2: the ledger has `orders + 1` rows.
async fn shop_with_orders(app: &TestApp, orders: usize) -> TenantClient {
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;
    for n in 0..orders {
        shop.order(&format!("idem-{n}"), &deduct(&format!("ORD-{n}"), &[("sku-1", 2)])).await.expect_json(201);
    }
    shop
}

/// [`shop_with_orders`] with 3 orders, reconciled once: `sku-1` has a checkpoint at version 4.
async fn checkpointed_shop(app: &TestApp) -> TenantClient {
    let shop = shop_with_orders(app, 3).await;
    shop.assert_reconciliation_clean(1).await;
    shop
}

/// The first order's ledger row (version 2, below the checkpoint) takes one more than it did.
const FIRST_ORDER_TAKES_ONE_MORE: &str =
    "UPDATE ledger SET qty = qty + 1 WHERE tenant_id = 'shop' AND resource_key = 'sku-1' AND version_after = 2";

async fn report(shop: &TenantClient, path: &str) -> Value {
    shop.get(path).await.expect_json(200)
}

/// Proves a pass reads only the ledger rows written since the last clean pass: the first reads
/// the whole ledger (4 rows), the next none, then exactly the 2 rows of two new orders; a full
/// pass reads all 6 again. The report keeps its fields and adds `pass` and `ledger_rows_read`.
#[tokio::test]
async fn a_pass_reads_only_the_ledger_rows_written_since_the_last_clean_one() {
    let app = spawn_app_with(no_background_pass()).await;
    let shop = shop_with_orders(&app, 3).await;

    let first = report(&shop, "/v1/reconciliation").await;
    assert_eq!(
        (&first["checked"], &first["drift"], &first["pass"], &first["ledger_rows_read"]),
        (&json!(1), &json!([]), &json!("incremental"), &json!(4)),
        "{first}"
    );
    for field in ["redis", "redis_reachable", "settlement_failures"] {
        assert!(first.get(field).is_some(), "the report keeps {field}: {first}");
    }
    let again = report(&shop, "/v1/reconciliation").await;
    assert_eq!((&again["drift"], &again["ledger_rows_read"]), (&json!([]), &json!(0)), "{again}");

    for n in 3..5 {
        shop.order(&format!("idem-{n}"), &deduct(&format!("ORD-{n}"), &[("sku-1", 2)])).await.expect_json(201);
    }
    let later = report(&shop, "/v1/reconciliation").await;
    assert_eq!((&later["drift"], &later["ledger_rows_read"]), (&json!([]), &json!(2)), "{later}");

    let full = report(&shop, "/v1/reconciliation?pass=full").await;
    assert_eq!(
        (&full["checked"], &full["drift"], &full["pass"], &full["ledger_rows_read"]),
        (&json!(1), &json!([]), &json!("full"), &json!(6)),
        "{full}"
    );
    let bad = shop.get("/v1/reconciliation?pass=partial").await;
    assert_eq!(bad.status(), 400, "{}", bad.text);
    assert_eq!(bad.json()["code"], "validation_failed", "{}", bad.text);
}

/// Proves a counter changed without a ledger row after a checkpoint exists is reported by the
/// next pass with exact amounts, and by every pass after it (also after more orders): drift is
/// never folded into the checkpoint.
#[tokio::test]
async fn a_counter_corrupted_after_a_checkpoint_is_reported_by_every_later_pass() {
    let app = spawn_app_with(no_background_pass()).await;
    let shop = checkpointed_shop(&app).await;

    tamper(
        app.database_url(),
        &["UPDATE resources SET available = available + 1, total = total + 1
           WHERE tenant_id = 'shop' AND \"key\" = 'sku-1'"],
    )
    .await;
    let drift = |available: i64, consumed: i64, version: i64| {
        json!([{
            "key": "sku-1",
            "expected": {"available": available, "reserved": 0, "consumed": consumed, "total": 100, "version": version},
            "actual": {"available": available + 1, "reserved": 0, "consumed": consumed, "total": 101, "version": version},
        }])
    };
    for _ in 0..2 {
        let found = report(&shop, "/v1/reconciliation").await;
        assert_eq!(found["drift"], drift(94, 6, 4), "{found}");
    }
    shop.order("idem-9", &deduct("ORD-9", &[("sku-1", 2)])).await.expect_json(201);
    let found = report(&shop, "/v1/reconciliation").await;
    assert_eq!(found["drift"], drift(92, 8, 5), "{found}");
    let full = report(&shop, "/v1/reconciliation?pass=full").await;
    assert_eq!(full["drift"], drift(92, 8, 5), "{full}");
}

/// Proves what incremental reconciliation cannot see and what finds it: a ledger row changed
/// below the checkpoint leaves the incremental pass clean (it does not read that row again),
/// while a full pass reports it; the full pass forgets the checkpoint, so from then on the
/// incremental passes report it too. A ledger row deleted below the checkpoint likewise.
#[tokio::test]
async fn history_changed_below_a_checkpoint_is_found_by_a_full_pass_and_then_by_every_pass() {
    let app = spawn_app_with(no_background_pass()).await;
    let shop = checkpointed_shop(&app).await;

    tamper(app.database_url(), &[FIRST_ORDER_TAKES_ONE_MORE]).await;
    let blind = report(&shop, "/v1/reconciliation").await;
    assert_eq!((&blind["drift"], &blind["ledger_rows_read"]), (&json!([]), &json!(0)), "{blind}");

    let expected = json!({"available": 93, "reserved": 0, "consumed": 7, "total": 100, "version": 4});
    let actual = json!({"available": 94, "reserved": 0, "consumed": 6, "total": 100, "version": 4});
    let want = json!([{"key": "sku-1", "expected": expected, "actual": actual}]);
    let full = report(&shop, "/v1/reconciliation?pass=full").await;
    assert_eq!(full["drift"], want, "{full}");
    let after = report(&shop, "/v1/reconciliation").await;
    assert_eq!((&after["drift"], &after["ledger_rows_read"]), (&want, &json!(4)), "{after}");

    tamper(
        app.database_url(),
        &[
            "UPDATE ledger SET qty = qty - 1 WHERE tenant_id = 'shop' AND resource_key = 'sku-1' AND version_after = 2",
            "DELETE FROM ledger WHERE tenant_id = 'shop' AND resource_key = 'sku-1' AND version_after = 3",
        ],
    )
    .await;
    let repaired_then_deleted = report(&shop, "/v1/reconciliation?pass=full").await;
    let expected = json!({"available": 96, "reserved": 0, "consumed": 4, "total": 100, "version": 3});
    let want = json!([{"key": "sku-1", "expected": expected, "actual": actual}]);
    assert_eq!(repaired_then_deleted["drift"], want, "{repaired_then_deleted}");
}

/// Proves the background job's periodic full pass (`full_every`) finds history changed below a
/// checkpoint: with a pass every second and every 2nd one full, the drift gauge reaches 1, and
/// the tenant's own (incremental) reconciliation reports the drift from then on.
#[tokio::test]
async fn the_background_jobs_full_pass_finds_history_changed_below_a_checkpoint() {
    let app =
        spawn_app_with(AppOptions::default().toml("[reconciliation]\ninterval_seconds = 1\nfull_every = 2")).await;
    let shop = checkpointed_shop(&app).await;
    tamper(app.database_url(), &[FIRST_ORDER_TAKES_ONE_MORE]).await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let metrics = app.get_anonymous("/metrics").await;
        if metrics.text.lines().any(|line| line == "stockd_reconciliation_drift_resources 1") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no full pass found the drift:\n{}", metrics.text);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let found = report(&shop, "/v1/reconciliation").await;
    assert_eq!(found["drift"].as_array().map(Vec::len), Some(1), "{found}");
    assert_eq!(found["pass"], "incremental", "{found}");
}

/// Proves the watermark never skips an entry while the rows it guards are written: three
/// processes write the same rows (one hot row, one of four buckets, reservations confirmed or
/// released) while incremental passes, each storing its checkpoints, run on every process. Every
/// pass is clean, and after the load an incremental pass and a full one agree. An entry that
/// committed below a checkpoint a pass had already stored would be missing from every later
/// incremental replay: that pass would report drift.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn incremental_passes_beside_writers_in_three_processes_never_skip_an_entry() {
    let first = spawn_app_with(no_background_pass()).await;
    let shop = first.create_tenant("shop").await;
    let apps = vec![first.spawn_sibling().await, first.spawn_sibling().await];
    let shops: Vec<TenantClient> = std::iter::once(shop.clone())
        .chain(apps.iter().map(|app| app.tenant_with_key(&shop.id, &shop.api_key)))
        .collect();
    shop.create_resource("sku-hot", 1_000_000).await;
    let body = json!({"key": "sku-split", "kind": "inventory", "total": 1_000_000, "buckets": 4});
    shop.post("/v1/resources", &body).await.expect_json(201);

    let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
    let writers = (0..24).map(|client| {
        let shop = shops[client % shops.len()].clone();
        tokio::spawn(async move {
            let mut n = 0;
            while tokio::time::Instant::now() < deadline {
                let key = format!("c{client}-o{n}");
                let sku = if n % 2 == 0 { "sku-hot" } else { "sku-split" };
                if n % 3 == 0 {
                    let held = shop.order(&key, &reserve(&key, &[(sku, 1)], None)).await.expect_json(201);
                    let id = held["reservation_id"].as_str().expect("a reservation id").to_string();
                    let moved = if n % 2 == 0 { shop.confirm(&id).await } else { shop.release(&id).await };
                    assert_eq!(moved.status(), 200, "{}", moved.text);
                } else {
                    shop.order(&key, &deduct(&key, &[(sku, 1)])).await.expect_json(201);
                }
                n += 1;
            }
            n
        })
    });
    let passes = shops.iter().cloned().map(|shop| {
        tokio::spawn(async move {
            let mut clean = 0;
            while tokio::time::Instant::now() < deadline {
                let report = report(&shop, "/v1/reconciliation").await;
                assert_eq!(report["drift"], json!([]), "a pass beside the writers: {report}");
                clean += 1;
            }
            clean
        })
    });
    let (written, passed) = tokio::join!(futures::future::join_all(writers), futures::future::join_all(passes));
    let written: usize = written.into_iter().map(|n| n.expect("a writer")).sum();
    let passed: usize = passed.into_iter().map(|n| n.expect("a pass loop")).sum();
    assert!(written > 100 && passed > 6, "the load ran: {written} orders, {passed} passes");

    let incremental = report(&shop, "/v1/reconciliation").await;
    let full = report(&shop, "/v1/reconciliation?pass=full").await;
    for report in [&incremental, &full] {
        assert_eq!((&report["checked"], &report["drift"]), (&json!(2), &json!([])), "{report}");
    }
    assert!(full["ledger_rows_read"].as_u64() > Some(written as u64), "{full}");
    drop(apps);
}
