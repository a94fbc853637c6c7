//! A retry with an answered Idempotency-Key gets the first answer, byte for byte, whatever
//! changed since: the tenant's plugin, its verdicts, the server's limits, the stock of a
//! redis-mode resource (sold out since). The first outcome was applied; anything else would
//! tell the client it was not.

use serde_json::{json, Value};

use crate::helpers::{
    assert_counts, deduct, entries_with_op, plugin_wasm, spawn_app, spawn_app_with, AppOptions, Reply, TenantClient,
};
use crate::redis_support::{deduct_one, redis_app, shared_redis_url, wait_settled, TableHold};

/// The first answer again, byte for byte, marked as a replay.
#[track_caller]
fn assert_same_answer(first: &Reply, again: &Reply) {
    assert_eq!(again.status(), first.status(), "same status; body: {}", again.text);
    assert_eq!(again.text, first.text, "same bytes");
    assert!(again.replayed(), "marked Idempotent-Replayed: true");
}

/// An order deducting 3 of `sku-1` (100 in stock) without a user, answered 201.
async fn answered_order(shop: &TenantClient) -> (serde_json::Value, Reply) {
    shop.create_resource("sku-1", 100).await;
    let body = deduct("order-1", &[("sku-1", 3)]);
    let first = shop.order("order-1", &body).await;
    assert_eq!(first.status(), 201, "{}", first.text);
    (body, first)
}

/// Proves a replay is not re-planned by a plugin version activated since: the order was planned
/// by the built-in plan and applied; the tenant then uploads a plugin that traps on every order
/// (a new active version). The retry answers the first 201, byte for byte, and applies nothing.
#[tokio::test]
async fn a_replay_after_a_plugin_version_change_returns_the_first_answer() {
    assert_replay_outlives_plugin("hostile-trap").await;
}

/// Proves a replay is not refused by a plugin that now refuses the order: the flash-sale
/// plugin refuses orders without a user, and the answered order had none. The retry answers
/// the first 201; a new order without a user is refused (422 plugin_failed).
#[tokio::test]
async fn a_replay_after_the_plugin_starts_refusing_returns_the_first_answer() {
    assert_replay_outlives_plugin("flash-sale").await;
}

/// Answers an order under the built-in plan, activates `plugin` (which fails or refuses every
/// order without a user), and checks a new such order is refused (422) while the retry gets the
/// first answer and applies nothing more.
async fn assert_replay_outlives_plugin(plugin: &str) {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let (body, first) = answered_order(&shop).await;

    shop.put_plugin(plugin_wasm(plugin)).await.expect_json(201);
    let fresh = shop.order("order-2", &deduct("order-2", &[("sku-1", 1)])).await;
    assert_eq!(fresh.status(), 422, "a new order meets {plugin}: {}", fresh.text);

    assert_same_answer(&first, &shop.order("order-1", &body).await);
    assert_counts(&shop.state("sku-1").await, 97, 0, 3, 100);
}

/// Proves a replay is not refused by a limit lowered since: a 3-line order is answered under
/// `orders.max_lines = 3`; after a restart with `max_lines = 2` the retry answers the first 201,
/// byte for byte, while a new 3-line order is refused (400).
#[tokio::test]
async fn a_replay_after_max_lines_was_lowered_returns_the_first_answer() {
    let mut app = spawn_app_with(AppOptions::default().toml("[orders]\nmax_lines = 3")).await;
    let shop = app.create_tenant("shop").await;
    for key in ["a", "b", "c"] {
        shop.create_resource(key, 10).await;
    }
    let body = deduct("order-1", &[("a", 1), ("b", 1), ("c", 1)]);
    let first = shop.order("order-1", &body).await;
    assert_eq!(first.status(), 201, "{}", first.text);

    app.rewrite_config("[orders]\nmax_lines = 2");
    app.restart().await;
    let fresh = shop.order("order-2", &deduct("order-2", &[("a", 1), ("b", 1), ("c", 1)])).await;
    assert_eq!(fresh.status(), 400, "a new 3-line order is over the limit: {}", fresh.text);

    assert_same_answer(&first, &shop.order("order-1", &body).await);
    assert_counts(&shop.state("a").await, 9, 0, 1, 10);
}

/// Proves a changed body under an answered key is still a mismatch (422), not a replay, even
/// when the changed body would itself be refused now.
#[tokio::test]
async fn a_different_body_under_an_answered_key_is_a_mismatch_even_when_refused_now() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let (_, _) = answered_order(&shop).await;
    shop.put_plugin(plugin_wasm("hostile-trap")).await.expect_json(201);

    let other = shop.order("order-1", &deduct("order-1", &[("sku-1", 4)])).await;
    assert_eq!(other.status(), 422, "{}", other.text);
    assert_eq!(other.json()["code"], "idempotency_key_mismatch", "{}", other.text);
}

/// Pieces of the redis-mode resource the sold-out replay tests sell in one order.
const REDIS_STOCK: i64 = 5;

/// Creates `sku-1` with [`REDIS_STOCK`] pieces and switches it to redis mode (which warms Redis
/// from the database).
async fn redis_sku(shop: &TenantClient) {
    shop.create_resource("sku-1", REDIS_STOCK).await;
    let switched = shop.patch("/v1/resources/sku-1", &json!({"mode": "redis"})).await.expect_json(200);
    assert_eq!(switched["mode"], "redis", "{switched}");
}

/// Asserts a new order on `sku-1` is answered `409` for `sold_out`: the process knows the
/// resource is sold out and answers from memory.
async fn assert_known_sold_out(shop: &TenantClient, idempotency_key: &str) {
    let late = shop.order(idempotency_key, &deduct_one(idempotency_key, "sku-1", 1, None)).await;
    let doc = late.expect_json(409);
    assert_eq!(doc["lines"][0]["reason"], "sold_out", "{doc}");
}

/// Order `k1` buys the whole stock of the redis-mode `sku-1` (201), then `k2` is refused as
/// sold out. Returns `k1`'s body and its first answer.
async fn sell_out(shop: &TenantClient) -> (Value, Reply) {
    let body = deduct_one("O-1", "sku-1", REDIS_STOCK, None);
    let first = shop.order("k1", &body).await;
    assert_eq!(first.status(), 201, "{}", first.text);
    assert_known_sold_out(shop, "k2").await;
    (body, first)
}

/// Waits until the sale is in the database, then asserts it is there once: one `deduct` in the
/// ledger, the state replaying from it, no drift.
async fn assert_sold_once(shop: &TenantClient) {
    let report = wait_settled(shop, "sku-1", REDIS_STOCK).await;
    assert_eq!(report["drift"], json!([]), "{report}");
    assert_eq!(report["settlement_failures"], json!([]), "{report}");
    assert_counts(&shop.state("sku-1").await, 0, 0, REDIS_STOCK, REDIS_STOCK);
    let ledger = shop.assert_ledger_replays_to_state("sku-1").await;
    assert_eq!(entries_with_op(&ledger, "deduct").len(), 1, "the sale applied once");
}

/// Proves a retry of a redis-mode sale that sold the last pieces gets its first answer while
/// the sale is not yet settled, although the process now answers new orders `sold_out` from
/// memory: the database's resources table is held (settlement cannot commit; the database
/// still shows nothing sold), `k1` buys everything, `k2` is refused `sold_out`, and `k1`
/// again answers the first 201, byte for byte, marked as a replay. Once the hold is released
/// the sale settles exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_mode_replay_after_sold_out_returns_the_first_answer_before_settlement() {
    let (app, _prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    redis_sku(&shop).await;

    let hold = TableHold::take(app.database_url()).await;
    let (body, first) = sell_out(&shop).await;
    assert_counts(&shop.state("sku-1").await, REDIS_STOCK, 0, 0, REDIS_STOCK);
    assert_same_answer(&first, &shop.order("k1", &body).await);
    assert_counts(&shop.state("sku-1").await, REDIS_STOCK, 0, 0, REDIS_STOCK);
    hold.release().await;

    assert_sold_once(&shop).await;
}

/// Proves a retry of a redis-mode sale that sold the last pieces gets its first answer once the
/// sale is settled into the database, while the process answers new orders `sold_out` from
/// memory: the first 201, byte for byte, marked as a replay, and nothing applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_mode_replay_after_sold_out_returns_the_first_answer_after_settlement() {
    let (app, _prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    redis_sku(&shop).await;

    let (body, first) = sell_out(&shop).await;
    assert_sold_once(&shop).await;
    assert_known_sold_out(&shop, "k3").await;
    assert_same_answer(&first, &shop.order("k1", &body).await);
    assert_sold_once(&shop).await;
}

/// Proves that with `[redis] replay_from_database = false` (replays rely on Redis's record
/// alone) a retry of a redis-mode sale that sold the last pieces still gets its first answer,
/// not the `sold_out` the process answers new orders from memory: at once, and again once the
/// sale is settled; the sale applies once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_mode_replay_after_sold_out_returns_the_first_answer_without_database_replays() {
    let (app, _prefix) = redis_app(&shared_redis_url(), "replay_from_database = false").await;
    let shop = app.create_tenant("shop").await;
    redis_sku(&shop).await;

    let (body, first) = sell_out(&shop).await;
    assert_same_answer(&first, &shop.order("k1", &body).await);
    assert_sold_once(&shop).await;
    assert_known_sold_out(&shop, "k3").await;
    assert_same_answer(&first, &shop.order("k1", &body).await);
    assert_sold_once(&shop).await;
}

/// Creates the redis-mode `sku-1` and sends order `k0` for more than its stock: refused by
/// Redis (`409 insufficient`, an outcome kept in Redis alone). Returns its body and answer.
async fn refused_by_redis(shop: &TenantClient) -> (Value, Reply) {
    redis_sku(shop).await;
    let body = deduct_one("O-0", "sku-1", REDIS_STOCK + 1, None);
    let refused = shop.order("k0", &body).await;
    assert_eq!(refused.json()["lines"][0]["reason"], "insufficient", "{}", refused.text);
    (body, refused)
}

/// Proves a retry of an order Redis refused (`409 insufficient`, an outcome kept in Redis) gets
/// that refusal again, byte for byte, after the resource sold out and the sale settled: `k0`
/// asks for more than the stock and is refused, `k1` buys the whole stock, and once the sale is
/// in the database `k0` again must answer its first `409`, not the `sold_out` the process answers
/// new orders from memory. Found by the model check (`tests/model/`, seed 103).
///
/// Failed before refusals joined the settlement stream: once the resource was sold out and
/// settled, the process answered `sold_out` from memory, assuming every outcome was in the
/// database, but refusals were kept in Redis alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_mode_refusal_replayed_after_sold_out_returns_the_first_answer() {
    let (app, _prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    let (refused_body, refused) = refused_by_redis(&shop).await;
    let (_, _) = sell_out(&shop).await;
    assert_sold_once(&shop).await;
    assert_known_sold_out(&shop, "k3").await;
    assert_same_answer(&refused, &shop.order("k0", &refused_body).await);
}

/// Proves a retry of an order Redis refused (`409 insufficient`) gets that refusal again after
/// the resource left redis mode, and applies nothing, even though stock arrived meanwhile: the
/// contract's "a retry of it returns the same 409 ... whatever changed since: ... the
/// resource's mode". Found by the model check (`tests/model/`, seeds 105 and 106).
///
/// Failed before refusals joined the settlement stream: refusals were kept in Redis alone, and
/// after the switch the retry was decided afresh on the database path (applied, 201).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_mode_refusal_replayed_after_a_switch_to_db_returns_the_first_answer() {
    let (app, _prefix) = redis_app(&shared_redis_url(), "").await;
    let shop = app.create_tenant("shop").await;
    let (refused_body, refused) = refused_by_redis(&shop).await;
    shop.adjust("sku-1", "restock-1", 10).await.expect_json(200);
    let switched = shop.patch("/v1/resources/sku-1", &json!({"mode": "db"})).await.expect_json(200);
    assert_eq!(switched["mode"], "db", "{switched}");

    assert_same_answer(&refused, &shop.order("k0", &refused_body).await);
    assert_counts(&shop.state("sku-1").await, REDIS_STOCK + 10, 0, 0, REDIS_STOCK + 10);
}
