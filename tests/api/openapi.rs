//! The OpenAPI document against the server: the bounds it states for query parameters are the
//! bounds the server enforces, and a value outside them is refused with `400 validation_failed`.

use serde_json::Value;

use crate::helpers::{assert_problem, spawn_app, spawn_app_with, AppOptions, TenantClient, TestApp};

/// A server with tenant `shop`, its resource `sku-1`, and the document it serves.
async fn shop_with_a_resource() -> (TestApp, TenantClient, Value) {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    let doc = app.get_anonymous("/openapi.json").await.expect_json(200);
    (app, shop, doc)
}

/// The schema of one parameter of one operation in the served document.
fn parameter(doc: &Value, method: &str, path: &str, name: &str) -> Value {
    let parameters = doc["paths"][path][method]["parameters"].as_array().cloned().unwrap_or_default();
    parameters.into_iter().find(|p| p["name"] == name).unwrap_or(Value::Null)
}

/// Every paged list's `limit` is a query parameter (not a path one, as the document once said)
/// bounded 1..=1000, and the server refuses 0 and 1001 and serves 1000.
#[tokio::test]
async fn page_limits_are_documented_query_bounds_and_enforced() {
    let (_app, shop, doc) = shop_with_a_resource().await;
    let lists = [
        ("/v1/resources", "/v1/resources"),
        ("/v1/resources/{key}/ledger", "/v1/resources/sku-1/ledger"),
        ("/v1/events", "/v1/events"),
    ];
    for (documented, served) in lists {
        let limit = parameter(&doc, "get", documented, "limit");
        assert_eq!(limit["in"], "query", "{documented}: {limit}");
        assert_eq!(limit["required"], false, "{documented}: {limit}");
        assert_eq!(
            (&limit["schema"]["minimum"], &limit["schema"]["maximum"]),
            (&1.into(), &1000.into()),
            "{documented}"
        );
        for refused in ["0", "1001", "4294967296", "x"] {
            let reply = shop.get(&format!("{served}?limit={refused}")).await;
            assert_problem(&reply, 400, "validation_failed");
        }
        shop.get(&format!("{served}?limit=1000")).await.expect_json(200);
    }
}

/// The ledger's `after` is documented as 1-19 digits, and the server refuses a sign or a longer
/// run of digits, which it once parsed as a number.
#[tokio::test]
async fn ledger_cursor_is_digits_only() {
    let (_app, shop, doc) = shop_with_a_resource().await;
    let after = parameter(&doc, "get", "/v1/resources/{key}/ledger", "after");
    assert_eq!(
        (&after["in"], &after["schema"]["pattern"], &after["schema"]["maxLength"]),
        (&"query".into(), &"^[0-9]*$".into(), &19.into())
    );

    for refused in ["%2B0", "-1", "00000000000000000000", "1.0"] {
        let reply = shop.get(&format!("/v1/resources/sku-1/ledger?after={refused}")).await;
        assert_problem(&reply, 400, "validation_failed");
    }
    let page = shop.get("/v1/resources/sku-1/ledger?after=0").await.expect_json(200);
    assert_eq!(page["items"].as_array().map(Vec::len), Some(1), "the create entry: {page}");
}

/// The feed's `wait` is documented up to this server's `[events] max_wait_seconds`, and one
/// more second is refused.
#[tokio::test]
async fn event_wait_is_bounded_by_the_servers_setting() {
    let app = spawn_app_with(AppOptions::default().toml("[events]\nmax_wait_seconds = 2\n")).await;
    let shop = app.create_tenant("shop").await;
    let doc = app.get_anonymous("/openapi.json").await.expect_json(200);
    let wait = parameter(&doc, "get", "/v1/events", "wait");
    assert_eq!(
        (&wait["in"], &wait["schema"]["minimum"], &wait["schema"]["maximum"]),
        (&"query".into(), &0.into(), &2.into())
    );
    assert_problem(&shop.get("/v1/events?wait=3").await, 400, "validation_failed");
}
