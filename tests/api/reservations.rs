//! Reservations: reserve → confirm / release, the state machine's conflicts, and expiry.

use std::time::Duration;

use serde_json::{json, Value};

use crate::helpers::{
    assert_counts, assert_problem, deduct, entries_with_op, reserve, spawn_app, spawn_app_with, AppOptions,
    TenantClient,
};

/// Bound for waiting on the background expiry (the contract says "within a few seconds").
const EXPIRY_DEADLINE: Duration = Duration::from_secs(20);
/// Sweeping every 200 ms keeps expiry quick in tests.
const FAST_SWEEP: &str = "[reservations]\nsweep_interval_ms = 200";

/// Reserves the lines and returns (reservation id, order document); asserts the 201.
async fn reserve_ok(shop: &TenantClient, lines: &[(&str, i64)], ttl: Option<u64>) -> (String, Value) {
    let idem = crate::helpers::unique("rsv");
    let doc = shop.order(&idem, &reserve(&idem, lines, ttl)).await.expect_json(201);
    let id = doc["reservation_id"]
        .as_str()
        .unwrap_or_else(|| panic!("a succeeded reserve has a reservation_id: {doc}"))
        .to_owned();
    (id, doc)
}

/// Polls the reservation until it reaches `state`, failing after `EXPIRY_DEADLINE`.
async fn wait_for_state(shop: &TenantClient, id: &str, state: &str) -> Value {
    let deadline = tokio::time::Instant::now() + EXPIRY_DEADLINE;
    loop {
        let current = shop.reservation(id).await.expect_json(200);
        if current["state"] == state {
            return current;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "reservation {id} did not become {state} within {EXPIRY_DEADLINE:?}: {current}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A reserve holds stock (available → reserved) and the reservation document shows it held.
#[tokio::test]
async fn reserve_holds_stock_and_shows_a_held_reservation() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;
    shop.create_resource("sku-2", 10).await;

    let before = chrono::Utc::now();
    let reply = shop.order("idem-1", &reserve("ORD-1", &[("sku-1", 3), ("sku-2", 1)], Some(900))).await;
    let doc = reply.expect_json(201);
    assert_eq!(doc["status"], "succeeded");
    assert_eq!(doc["action"], "reserve");
    assert_eq!(doc["order_id"], "ORD-1");
    let id = doc["reservation_id"].as_str().expect("reservation_id is a string").to_owned();
    assert!(id.starts_with("rsv_"), "reservation id {id:?} starts with rsv_");
    let expires_at = chrono::DateTime::parse_from_rfc3339(doc["expires_at"].as_str().expect("expires_at is a string"))
        .expect("expires_at is RFC 3339");
    let ttl_from_before = (expires_at.with_timezone(&chrono::Utc) - before).num_seconds();
    assert!((840..=960).contains(&ttl_from_before), "expires_at is about 900 s ahead: {expires_at}");
    assert_eq!(
        doc["lines"],
        json!([
            {"key": "sku-1", "resource": "sku-1", "qty": 3, "applied": 3, "status": "applied", "reason": null},
            {"key": "sku-2", "resource": "sku-2", "qty": 1, "applied": 1, "status": "applied", "reason": null}
        ])
    );

    assert_counts(&shop.state("sku-1").await, 97, 3, 0, 100);
    assert_counts(&shop.state("sku-2").await, 9, 1, 0, 10);

    let reservation = shop.reservation(&id).await.expect_json(200);
    assert_eq!(
        reservation,
        json!({
            "id": id, "order_id": "ORD-1", "state": "held",
            "lines": [{"key": "sku-1", "resource": "sku-1", "qty": 3},
                      {"key": "sku-2", "resource": "sku-2", "qty": 1}],
            "expires_at": doc["expires_at"]
        })
    );

    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    let reserves = entries_with_op(&ledger, "reserve");
    assert_eq!(reserves.len(), 1);
    assert_eq!(reserves[0]["qty"], 3);
    assert_eq!(reserves[0]["reservation_id"], id.as_str());
    assert_eq!(reserves[0]["order_id"], "ORD-1");
}

/// Without `ttl_seconds` a reservation still gets an expiry (the configured default).
#[tokio::test]
async fn reserve_without_ttl_uses_the_default() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let (id, doc) = reserve_ok(&shop, &[("sku-1", 1)], None).await;
    let expires_at = doc["expires_at"].as_str().expect("a reservation always has expires_at");
    let expires_at = chrono::DateTime::parse_from_rfc3339(expires_at).expect("RFC 3339");
    assert!(expires_at > chrono::Utc::now(), "default expiry is in the future: {expires_at}");
    assert_eq!(shop.reservation(&id).await.expect_json(200)["state"], "held");
}

/// Confirm moves reserved to consumed; confirming again answers the same 200 and moves nothing.
#[tokio::test]
async fn confirm_consumes_the_hold_once() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let (id, _) = reserve_ok(&shop, &[("sku-1", 4)], Some(600)).await;

    let confirmed = shop.confirm(&id).await.expect_json(200);
    assert_eq!(confirmed["id"], id.as_str());
    assert_eq!(confirmed["state"], "confirmed");
    assert_counts(&shop.state("sku-1").await, 6, 0, 4, 10);

    let again = shop.confirm(&id).await.expect_json(200);
    assert_eq!(again, confirmed);
    assert_eq!(shop.reservation(&id).await.expect_json(200), confirmed);
    assert_counts(&shop.state("sku-1").await, 6, 0, 4, 10);

    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    let confirms = entries_with_op(&ledger, "confirm");
    assert_eq!(confirms.len(), 1);
    assert_eq!(confirms[0]["qty"], 4);
    assert_eq!(confirms[0]["reservation_id"], id.as_str());
}

/// Release returns the hold to available; releasing again answers 200 and moves nothing.
#[tokio::test]
async fn release_returns_the_hold_once() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 10).await;
    let (id, _) = reserve_ok(&shop, &[("sku-1", 4), ("sku-2", 2)], Some(600)).await;

    let released = shop.release(&id).await.expect_json(200);
    assert_eq!(released["state"], "released");
    assert_counts(&shop.state("sku-1").await, 10, 0, 0, 10);
    assert_counts(&shop.state("sku-2").await, 10, 0, 0, 10);

    let again = shop.release(&id).await.expect_json(200);
    assert_eq!(again, released);
    assert_counts(&shop.state("sku-1").await, 10, 0, 0, 10);

    for key in ["sku-1", "sku-2"] {
        let ledger = shop.assert_ledger_replays_to_state(key).await;
        assert_eq!(entries_with_op(&ledger, "release").len(), 1, "{key}");
    }
}

/// Confirm after release is 409 reservation_released; nothing moves.
#[tokio::test]
async fn confirm_after_release_is_a_conflict() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let (id, _) = reserve_ok(&shop, &[("sku-1", 4)], Some(600)).await;
    shop.release(&id).await.expect_json(200);

    assert_problem(&shop.confirm(&id).await, 409, "reservation_released");
    assert_counts(&shop.state("sku-1").await, 10, 0, 0, 10);
    assert_eq!(shop.reservation(&id).await.expect_json(200)["state"], "released");
    shop.assert_ledger_replays_to_state("sku-1").await;
}

/// Release after confirm is 409 reservation_confirmed; nothing moves.
#[tokio::test]
async fn release_after_confirm_is_a_conflict() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let (id, _) = reserve_ok(&shop, &[("sku-1", 4)], Some(600)).await;
    shop.confirm(&id).await.expect_json(200);

    assert_problem(&shop.release(&id).await, 409, "reservation_confirmed");
    assert_counts(&shop.state("sku-1").await, 6, 0, 4, 10);
    assert_eq!(shop.reservation(&id).await.expect_json(200)["state"], "confirmed");
    shop.assert_ledger_replays_to_state("sku-1").await;
}

/// Confirm and release accept (and ignore) an Idempotency-Key header.
#[tokio::test]
async fn confirm_and_release_ignore_an_idempotency_key() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let (first, _) = reserve_ok(&shop, &[("sku-1", 1)], Some(600)).await;
    let (second, _) = reserve_ok(&shop, &[("sku-1", 2)], Some(600)).await;

    let path = format!("/v1/reservations/{first}/confirm");
    let reply =
        crate::helpers::send(shop.request(reqwest::Method::POST, &path).header("Idempotency-Key", "same")).await;
    assert_eq!(reply.expect_json(200)["state"], "confirmed");
    let path = format!("/v1/reservations/{second}/release");
    let reply =
        crate::helpers::send(shop.request(reqwest::Method::POST, &path).header("Idempotency-Key", "same")).await;
    assert_eq!(reply.expect_json(200)["state"], "released");
    assert_counts(&shop.state("sku-1").await, 9, 0, 1, 10);
}

/// An unknown reservation id is 404 reservation_not_found for GET, confirm and release.
#[tokio::test]
async fn unknown_reservation_is_not_found() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    for id in ["rsv_00000000000000000000000000", "nope"] {
        assert_problem(&shop.reservation(id).await, 404, "reservation_not_found");
        assert_problem(&shop.confirm(id).await, 404, "reservation_not_found");
        assert_problem(&shop.release(id).await, 404, "reservation_not_found");
    }
}

/// A rejected reserve creates no reservation: reservation_id and expires_at are null.
#[tokio::test]
async fn rejected_reserve_holds_nothing() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 1).await;

    let doc = shop.order("idem-1", &reserve("ORD-1", &[("sku-1", 5), ("sku-2", 2)], Some(60))).await.expect_json(409);
    assert_eq!(doc["status"], "rejected");
    assert_eq!(doc["reservation_id"], Value::Null);
    assert_eq!(doc["expires_at"], Value::Null);
    assert_eq!(doc["lines"][0]["status"], "skipped");
    assert_eq!(doc["lines"][1]["reason"], "insufficient");
    assert_counts(&shop.state("sku-1").await, 10, 0, 0, 10);
    assert_counts(&shop.state("sku-2").await, 1, 0, 0, 1);
}

/// A held reservation past its TTL is expired by the server: its stock returns to available,
/// each line gets exactly one `expire` entry, confirm is then 409 reservation_expired and
/// release answers 200 with state `expired`.
#[tokio::test]
async fn held_reservation_expires_exactly_once() {
    let app = spawn_app_with(AppOptions::default().toml(FAST_SWEEP)).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 10).await;
    let (id, _) = reserve_ok(&shop, &[("sku-1", 3), ("sku-2", 2)], Some(1)).await;
    // A long hold on the same resource must survive the sweep.
    let (long_id, _) = reserve_ok(&shop, &[("sku-1", 1)], Some(3600)).await;

    let expired = wait_for_state(&shop, &id, "expired").await;
    assert_eq!(expired["id"], id.as_str());

    assert_counts(&shop.state("sku-1").await, 9, 1, 0, 10);
    assert_counts(&shop.state("sku-2").await, 10, 0, 0, 10);

    assert_problem(&shop.confirm(&id).await, 409, "reservation_expired");
    let released = shop.release(&id).await.expect_json(200);
    assert_eq!(released["state"], "expired");

    // Let the sweeper run many more times (a second reservation has to expire too) before
    // counting: the first one must still have exactly one `expire` entry per line.
    let (later, _) = reserve_ok(&shop, &[("sku-2", 1)], Some(1)).await;
    wait_for_state(&shop, &later, "expired").await;

    let ledger1 = shop.assert_ledger_replays_to_state("sku-1").await;
    let expires1 = entries_with_op(&ledger1, "expire");
    assert_eq!(expires1.len(), 1, "one expire entry for sku-1");
    assert_eq!(expires1[0]["qty"], 3);
    assert_eq!(expires1[0]["reservation_id"], id.as_str());
    let ledger2 = shop.assert_ledger_replays_to_state("sku-2").await;
    let expires2 = entries_with_op(&ledger2, "expire");
    assert_eq!(expires2.len(), 2, "one expire entry per expired reservation on sku-2");
    assert_eq!(expires2[0]["qty"], 2);
    assert_eq!(expires2[0]["reservation_id"], id.as_str());
    assert_eq!(expires2[1]["qty"], 1);
    assert_eq!(expires2[1]["reservation_id"], later.as_str());
    assert_eq!(entries_with_op(&ledger1, "release").len(), 0, "release of an expired one moves nothing");

    assert_eq!(shop.reservation(&long_id).await.expect_json(200)["state"], "held");
    assert_counts(&shop.state("sku-1").await, 9, 1, 0, 10);
    shop.assert_reconciliation_clean(2).await;
}

/// A release past the deadline that the sweeper has not reached yet expires the reservation,
/// as a confirm then does: `200` with state `expired`, one `expire` in the ledger and no
/// `release`, the same record the sweeper would have made. (It used to release it: a
/// reservation made in Redis then ended `released` there and `expired` in the database, whose
/// sweeper got there first; finding 5 in docs/TESTING.md.)
#[tokio::test]
async fn a_release_past_the_deadline_before_the_sweep_expires_the_reservation() {
    // The sweeper does not come round during the test.
    let app = spawn_app_with(AppOptions::default().toml("[reservations]\nsweep_interval_ms = 3600000")).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let (late, doc) = reserve_ok(&shop, &[("sku-1", 3)], Some(1)).await;
    let (in_time, _) = reserve_ok(&shop, &[("sku-1", 2)], Some(3600)).await;
    let deadline = chrono::DateTime::parse_from_rfc3339(doc["expires_at"].as_str().expect("expires_at"))
        .expect("expires_at is RFC 3339")
        .with_timezone(&chrono::Utc);
    let waited = tokio::time::Instant::now() + EXPIRY_DEADLINE;
    while chrono::Utc::now() <= deadline + chrono::Duration::milliseconds(50) {
        assert!(tokio::time::Instant::now() < waited, "the deadline {deadline} passed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(shop.reservation(&late).await.expect_json(200)["state"], "held", "not swept yet");

    let released = shop.release(&late).await.expect_json(200);
    assert_eq!(released["state"], "expired", "{released}");
    assert_eq!(shop.release(&late).await.expect_json(200)["state"], "expired");
    assert_problem(&shop.confirm(&late).await, 409, "reservation_expired");
    assert_eq!(shop.release(&in_time).await.expect_json(200)["state"], "released");
    assert_counts(&shop.state("sku-1").await, 10, 0, 0, 10);

    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    let expired = entries_with_op(&ledger, "expire");
    assert_eq!(expired.len(), 1, "{ledger:?}");
    assert_eq!((expired[0]["reservation_id"].clone(), expired[0]["qty"].clone()), (json!(late), json!(3)));
    let released = entries_with_op(&ledger, "release");
    assert_eq!(released.len(), 1, "only the one released in time: {ledger:?}");
    assert_eq!(released[0]["reservation_id"], in_time.as_str());
    shop.assert_reconciliation_clean(1).await;
}

/// A confirmed reservation is never expired, even after its TTL passes.
#[tokio::test]
async fn confirmed_reservation_does_not_expire() {
    let app = spawn_app_with(AppOptions::default().toml(FAST_SWEEP)).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    // TTL 2 s leaves ample time to confirm before it could expire.
    let (confirmed, _) = reserve_ok(&shop, &[("sku-1", 2)], Some(2)).await;
    shop.confirm(&confirmed).await.expect_json(200);

    // A reservation made later with the same TTL expires later: once it has expired, the
    // sweeper has run past the confirmed one's expiry time.
    let (marker, _) = reserve_ok(&shop, &[("sku-1", 1)], Some(2)).await;
    wait_for_state(&shop, &marker, "expired").await;

    assert_eq!(shop.reservation(&confirmed).await.expect_json(200)["state"], "confirmed");
    assert_counts(&shop.state("sku-1").await, 8, 0, 2, 10);
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(entries_with_op(&ledger, "expire").len(), 1);
    assert_eq!(entries_with_op(&ledger, "confirm").len(), 1);
}

/// Confirms and releases that arrive together are decided in one batch with the batch's orders
/// (admission), each exactly as on its own: a confirm and a release of every reservation race,
/// with a second confirm of every other one and fresh orders on the same keys. Each reservation
/// ends confirmed or released with one move in the ledger, every loser hears the state machine's
/// answer (200 for the same end state, 409 for the other), the counters balance, and the
/// server's metrics show moves decided by admission.
#[tokio::test]
async fn racing_confirms_and_releases_are_decided_in_the_batch_each_once() {
    const HOLDS: usize = 24;
    // A little linger so that concurrent requests share batches even on a fast machine.
    let app = spawn_app_with(AppOptions::default().toml("[batch]\nmax_wait_us = 2000")).await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 1_000).await;
    shop.create_resource("sku-2", 1_000).await;
    let mut ids = Vec::new();
    for i in 0..HOLDS {
        let lines: &[(&str, i64)] = if i % 3 == 0 { &[("sku-1", 2), ("sku-2", 1)] } else { &[("sku-1", 1)] };
        ids.push(reserve_ok(&shop, lines, Some(600)).await.0);
    }

    let mut racers = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let mut moves = vec!["confirm", "release"];
        if i % 2 == 0 {
            moves.push("confirm");
        }
        for how in moves {
            let (shop, id) = (shop.clone(), id.clone());
            racers.push(tokio::spawn(async move {
                let reply = if how == "confirm" { shop.confirm(&id).await } else { shop.release(&id).await };
                (id, how, reply.status(), reply.json())
            }));
        }
        let (shop, idem) = (shop.clone(), crate::helpers::unique("buy"));
        racers.push(tokio::spawn(async move {
            let reply = shop.order(&idem, &deduct(&idem, &[("sku-2", 1)])).await;
            (idem, "order", reply.status(), reply.json())
        }));
    }
    let mut end: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut answers = Vec::new();
    for racer in racers {
        answers.push(racer.await.expect("a racer does not panic"));
    }
    for (id, how, status, body) in &answers {
        match *how {
            "order" => assert_eq!(*status, 201, "an order beside the moves: {body}"),
            _ if *status == 200 => {
                let state = body["state"].as_str().unwrap_or_default().to_string();
                assert_eq!(state, if *how == "confirm" { "confirmed" } else { "released" }, "{how} {id}: {body}");
                let first = end.entry(id.clone()).or_insert_with(|| state.clone());
                assert_eq!(*first, state, "reservation {id} answered two end states");
            }
            _ => assert_eq!(*status, 409, "{how} {id}: {body}"),
        }
    }
    assert_eq!(end.len(), HOLDS, "every reservation ended: {end:?}");
    for (id, state) in &end {
        assert_eq!(shop.reservation(id).await.expect_json(200)["state"], state.as_str(), "reservation {id}");
    }

    let confirmed = |i: usize| end[&ids[i]] == "confirmed";
    let (mut consumed1, mut consumed2) = (0, 0);
    for i in 0..HOLDS {
        if confirmed(i) {
            consumed1 += if i % 3 == 0 { 2 } else { 1 };
            consumed2 += i64::from(i % 3 == 0);
        }
    }
    assert_counts(&shop.state("sku-1").await, 1_000 - consumed1, 0, consumed1, 1_000);
    let orders = HOLDS as i64;
    assert_counts(&shop.state("sku-2").await, 1_000 - consumed2 - orders, 0, consumed2 + orders, 1_000);
    for key in ["sku-1", "sku-2"] {
        let ledger = shop.assert_ledger_replays_to_state(key).await;
        let moves = entries_with_op(&ledger, "confirm").len() + entries_with_op(&ledger, "release").len();
        let held = if key == "sku-1" { HOLDS } else { HOLDS.div_ceil(3) };
        assert_eq!(moves, held, "one move per reservation on {key}");
    }
    shop.assert_reconciliation_clean(2).await;
    let metrics = app.get_anonymous("/metrics").await.text;
    let admitted: f64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("stockd_moves_admitted_in_batch_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(admitted > 0.0, "no confirm or release was decided by batch admission:\n{metrics}");
}

/// Proves `GET /v1/reservations` lists exactly the tenant's held reservations, the soonest to
/// expire first: a confirmed or released one leaves the list, another tenant's never shows, and
/// `limit` is bounded.
#[tokio::test]
async fn held_reservations_are_listed_soonest_to_expire_first_and_only_the_tenants_own() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let other = app.create_tenant("other").await;
    shop.create_resource("sku-1", 100).await;
    other.create_resource("sku-1", 100).await;
    let (late, _) = reserve_ok(&shop, &[("sku-1", 1)], Some(3000)).await;
    let (soon, _) = reserve_ok(&shop, &[("sku-1", 2)], Some(1000)).await;
    let (middle, _) = reserve_ok(&shop, &[("sku-1", 3)], Some(2000)).await;
    let (confirmed, _) = reserve_ok(&shop, &[("sku-1", 4)], Some(500)).await;
    let (released, _) = reserve_ok(&shop, &[("sku-1", 5)], Some(500)).await;
    reserve_ok(&other, &[("sku-1", 1)], Some(10)).await;
    shop.confirm(&confirmed).await.expect_json(200);
    shop.release(&released).await.expect_json(200);

    let ids = |page: &Value| -> Vec<String> {
        page["items"]
            .as_array()
            .unwrap_or_else(|| panic!("a page has items: {page}"))
            .iter()
            .map(|r| r["id"].as_str().unwrap_or_default().to_owned())
            .collect()
    };
    let page = shop.get("/v1/reservations").await.expect_json(200);
    assert_eq!(ids(&page), [soon.clone(), middle.clone(), late], "{page}");
    assert!(page["items"].as_array().is_some_and(|items| items.iter().all(|r| r["state"] == "held")), "{page}");
    assert_eq!(page["items"][0]["lines"][0]["qty"], 2, "{page}");
    assert_eq!(ids(&shop.get("/v1/reservations?limit=2").await.expect_json(200)), [soon, middle]);

    for bad in ["/v1/reservations?limit=0", "/v1/reservations?limit=1001", "/v1/reservations?state=held"] {
        assert_problem(&shop.get(bad).await, 400, "validation_failed");
    }
}
