//! A retry with an answered Idempotency-Key gets the first answer, byte for byte, whatever
//! changed since: the tenant's plugin, its verdicts, the server's limits. The first outcome
//! was applied; anything else would tell the client it was not.

use crate::helpers::{assert_counts, deduct, plugin_wasm, spawn_app, spawn_app_with, AppOptions, Reply, TenantClient};

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
