//! Tenants, API keys and authentication (`/v1/admin/*` and bearer checks on tenant routes).

use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::{assert_problem, send, spawn_app};

/// A tenant created through the admin API gets a working API key shown once.
#[tokio::test]
async fn admin_creates_a_tenant_whose_key_works() {
    let app = spawn_app().await;

    let reply = app.admin_post("/v1/admin/tenants", &json!({"id": "acme", "name": "Acme"})).await;
    let body = reply.expect_json(201);
    assert_eq!(body["id"], "acme");
    assert_eq!(body["name"], "Acme");
    let api_key = body["api_key"].as_str().expect("api_key is a string");
    // >= 128 bits of randomness: at least 22 base64 or 32 hex characters.
    assert!(api_key.len() >= 22, "api key {api_key:?} is too short to hold 128 bits");

    let acme = app.tenant_with_key("acme", api_key);
    let page = acme.get("/v1/resources").await.expect_json(200);
    assert_eq!(page["items"], json!([]));
    assert_eq!(page["next_after"], Value::Null);
}

/// Two tenants get two different keys, and neither appears in the admin listing.
#[tokio::test]
async fn tenant_list_shows_every_tenant_and_no_keys() {
    let app = spawn_app().await;
    let acme = app.create_tenant("acme").await;
    let globex = app.create_tenant("globex").await;
    assert_ne!(acme.api_key, globex.api_key);

    let reply = app.admin_get("/v1/admin/tenants").await;
    let body = reply.expect_json(200);
    let items = body["items"].as_array().expect("items is an array");
    let mut ids: Vec<&str> = items.iter().map(|t| t["id"].as_str().unwrap_or("")).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["acme", "globex"]);
    for item in items {
        assert_eq!(item["name"], format!("Tenant {}", item["id"].as_str().unwrap_or("")));
        let created_at = item["created_at"].as_str().expect("created_at is a string");
        chrono::DateTime::parse_from_rfc3339(created_at).expect("created_at is RFC 3339");
        assert!(item.get("api_key").is_none(), "listing shows a key: {item}");
    }
    assert!(!reply.text.contains(&acme.api_key), "listing leaks acme's key");
    assert!(!reply.text.contains(&globex.api_key), "listing leaks globex's key");
}

/// A second tenant with an existing id is refused with 409 tenant_exists; the first keeps working.
#[tokio::test]
async fn duplicate_tenant_id_is_a_conflict() {
    let app = spawn_app().await;
    let acme = app.create_tenant("acme").await;

    let reply = app.admin_post("/v1/admin/tenants", &json!({"id": "acme", "name": "Other Acme"})).await;
    assert_problem(&reply, 409, "tenant_exists");

    acme.get("/v1/resources").await.expect_json(200);
    let list = app.admin_get("/v1/admin/tenants").await.expect_json(200);
    assert_eq!(list["items"].as_array().map(Vec::len), Some(1));
    assert_eq!(list["items"][0]["name"], "Tenant acme");
}

/// Tenant ids outside `[a-z0-9-]{1,64}` are refused with 400 and create nothing.
#[tokio::test]
async fn tenant_ids_outside_the_allowed_alphabet_are_refused() {
    let app = spawn_app().await;
    let too_long = "a".repeat(65);
    let bad_ids = ["", "Acme", "a_b", "a b", "../x", "a/b", "ä", too_long.as_str()];
    for id in bad_ids {
        let reply = app.admin_post("/v1/admin/tenants", &json!({"id": id, "name": "Bad"})).await;
        assert_problem(&reply, 400, "validation_failed");
    }
    for body in [json!({"name": "No id"}), json!({"id": 7, "name": "Number"}), json!([])] {
        let reply = app.admin_post("/v1/admin/tenants", &body).await;
        assert_problem(&reply, 400, "validation_failed");
    }
    let list = app.admin_get("/v1/admin/tenants").await.expect_json(200);
    assert_eq!(list["items"], json!([]));

    // The longest allowed id is fine.
    let longest = "a".repeat(64);
    let reply = app.admin_post("/v1/admin/tenants", &json!({"id": longest, "name": "Long"})).await;
    assert_eq!(reply.expect_json(201)["id"], longest);
}

/// Admin routes answer 401 without a token or with a wrong one, and 403 to a tenant key.
#[tokio::test]
async fn admin_routes_need_the_admin_token() {
    let app = spawn_app().await;
    let acme = app.create_tenant("acme").await;

    let anonymous = send(app.client.get(app.url("/v1/admin/tenants"))).await;
    assert_problem(&anonymous, 401, "unauthorized");

    let wrong =
        send(app.client.get(app.url("/v1/admin/tenants")).bearer_auth("0123456789abcdef0123456789abcdef")).await;
    assert_problem(&wrong, 401, "unauthorized");

    let as_tenant = acme.get("/v1/admin/tenants").await;
    assert_problem(&as_tenant, 403, "forbidden");

    let create_as_tenant = acme.post("/v1/admin/tenants", &json!({"id": "evil", "name": "Evil"})).await;
    assert_problem(&create_as_tenant, 403, "forbidden");
    let list = app.admin_get("/v1/admin/tenants").await.expect_json(200);
    assert_eq!(list["items"].as_array().map(Vec::len), Some(1), "no tenant `evil`: {list}");
}

/// Tenant routes answer 401 without a key, with an unknown key, and with the admin token.
#[tokio::test]
async fn tenant_routes_need_a_tenant_key() {
    let app = spawn_app().await;
    let acme = app.create_tenant("acme").await;
    acme.create_resource("sku-1", 10).await;

    let anonymous = app.get_anonymous("/v1/resources/sku-1").await;
    assert_problem(&anonymous, 401, "unauthorized");

    let unknown = acme.with_api_key("not-a-key").get("/v1/resources/sku-1").await;
    assert_problem(&unknown, 401, "unauthorized");

    let admin = acme.with_api_key(&app.admin_token).get("/v1/resources/sku-1").await;
    assert_problem(&admin, 401, "unauthorized");

    let not_bearer =
        send(app.client.get(app.url("/v1/resources/sku-1")).header("Authorization", format!("Basic {}", acme.api_key)))
            .await;
    assert_problem(&not_bearer, 401, "unauthorized");

    // An unauthenticated write changes nothing.
    let anonymous_order = send(
        app.client
            .post(app.url("/v1/orders"))
            .header("Idempotency-Key", "k-1")
            .json(&crate::helpers::deduct("o-1", &[("sku-1", 1)])),
    )
    .await;
    assert_problem(&anonymous_order, 401, "unauthorized");
    let state = acme.state("sku-1").await;
    assert_eq!(state["available"], 10);
    assert_eq!(state["version"], 1);
}

/// A second API key works for the same tenant's data, and the first one keeps working.
#[tokio::test]
async fn second_api_key_sees_the_same_tenant() {
    let app = spawn_app().await;
    let acme = app.create_tenant("acme").await;
    acme.create_resource("sku-1", 10).await;

    let reply = app.admin_post("/v1/admin/tenants/acme/api-keys", &json!({})).await;
    let body = reply.expect_json(201);
    assert!(body["key_id"].is_string(), "key_id is a string: {body}");
    let second_key = body["api_key"].as_str().expect("api_key is a string");
    assert_ne!(second_key, acme.api_key);

    let second = acme.with_api_key(second_key);
    assert_eq!(second.state("sku-1").await["total"], 10);
    assert_eq!(acme.state("sku-1").await["total"], 10);
}

/// Asking for a key for a tenant that does not exist is 404 tenant_not_found.
#[tokio::test]
async fn api_key_for_unknown_tenant_is_not_found() {
    let app = spawn_app().await;
    let reply = app.admin_post("/v1/admin/tenants/nobody/api-keys", &json!({})).await;
    assert_problem(&reply, 404, "tenant_not_found");
}

/// A revoked key fails with 401 on the very next request; the tenant's other key still works.
#[tokio::test]
async fn revoked_key_is_refused_at_once() {
    let app = spawn_app().await;
    let acme = app.create_tenant("acme").await;
    acme.create_resource("sku-1", 10).await;
    let body = app.admin_post("/v1/admin/tenants/acme/api-keys", &json!({})).await.expect_json(201);
    let key_id = body["key_id"].as_str().expect("key_id is a string").to_owned();
    let second = acme.with_api_key(body["api_key"].as_str().expect("api_key is a string"));
    second.state("sku-1").await;

    let reply = app.admin_delete(&format!("/v1/admin/tenants/acme/api-keys/{key_id}")).await;
    assert_eq!(reply.status(), 204, "body: {}", reply.text);
    assert_eq!(reply.text, "");

    assert_problem(&second.get("/v1/resources/sku-1").await, 401, "unauthorized");
    assert_eq!(acme.state("sku-1").await["available"], 10);

    // Revoking it again: the key id is no longer known.
    let again = app.admin_delete(&format!("/v1/admin/tenants/acme/api-keys/{key_id}")).await;
    assert_problem(&again, 404, "api_key_not_found");
}

/// Revoking an unknown key id, or another tenant's key through the wrong tenant, is 404 and
/// revokes nothing.
#[tokio::test]
async fn revoking_an_unknown_key_is_not_found() {
    let app = spawn_app().await;
    let acme = app.create_tenant("acme").await;
    app.create_tenant("globex").await;
    let body = app.admin_post("/v1/admin/tenants/acme/api-keys", &json!({})).await.expect_json(201);
    let key_id = body["key_id"].as_str().expect("key_id is a string");
    let second = acme.with_api_key(body["api_key"].as_str().expect("api_key is a string"));

    let unknown = app.admin_delete("/v1/admin/tenants/acme/api-keys/no-such-key").await;
    assert_problem(&unknown, 404, "api_key_not_found");

    let wrong_tenant = app.admin_delete(&format!("/v1/admin/tenants/globex/api-keys/{key_id}")).await;
    assert_problem(&wrong_tenant, 404, "api_key_not_found");

    second.get("/v1/resources").await.expect_json(200);
}

/// The tenant creation route only takes JSON objects with known fields.
#[tokio::test]
async fn tenant_creation_rejects_unknown_fields() {
    let app = spawn_app().await;
    let reply = app
        .admin_post("/v1/admin/tenants", &json!({"id": "acme", "name": "Acme", "api_key": "chosen-by-caller"}))
        .await;
    assert_problem(&reply, 400, "validation_failed");
    let raw = send(
        app.client
            .request(Method::POST, app.url("/v1/admin/tenants"))
            .bearer_auth(&app.admin_token)
            .header("content-type", "application/json")
            .body("{\"id\": \"acme\","),
    )
    .await;
    assert_problem(&raw, 400, "validation_failed");
    let list = app.admin_get("/v1/admin/tenants").await.expect_json(200);
    assert_eq!(list["items"], json!([]));
}

/// Proves the admin's key list shows each key's id and dates, revoked ones marked, and never a
/// key or its hash; an unknown tenant is 404 and a tenant's own key cannot read it.
#[tokio::test]
async fn the_admin_lists_a_tenants_keys_without_their_secrets() {
    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    let second = app.admin_post("/v1/admin/tenants/shop/api-keys", &json!({})).await.expect_json(201);
    let second_id = second["key_id"].as_str().unwrap_or_default().to_owned();
    app.create_tenant("other").await;

    let list = app.admin_get("/v1/admin/tenants/shop/api-keys").await.expect_json(200);
    let items = list["items"].as_array().unwrap_or_else(|| panic!("items: {list}")).clone();
    assert_eq!(items.len(), 2, "{list}");
    assert_eq!(items[1]["key_id"], second_id.as_str(), "oldest first: {list}");
    assert!(items.iter().all(|k| k["revoked_at"].is_null() && k["created_at"].is_string()), "{list}");
    let text = list.to_string();
    for secret in [shop.api_key.as_str(), second["api_key"].as_str().unwrap_or("?")] {
        assert!(!text.contains(secret), "a key is never listed: {list}");
    }
    assert!(items.iter().all(|k| k.as_object().is_some_and(|o| o.len() == 3)), "only id and dates: {list}");

    assert_eq!(app.admin_delete(&format!("/v1/admin/tenants/shop/api-keys/{second_id}")).await.status(), 204);
    let after = app.admin_get("/v1/admin/tenants/shop/api-keys").await.expect_json(200);
    assert!(after["items"][0]["revoked_at"].is_null() && after["items"][1]["revoked_at"].is_string(), "{after}");

    assert_problem(&app.admin_get("/v1/admin/tenants/nobody/api-keys").await, 404, "tenant_not_found");
    assert_eq!(
        app.admin_get("/v1/admin/tenants/other/api-keys").await.json()["items"].as_array().map(Vec::len),
        Some(1)
    );
    let by_tenant = shop.get("/v1/admin/tenants/shop/api-keys").await;
    assert!(matches!(by_tenant.status(), 401 | 403), "a tenant key is not the admin token: {}", by_tenant.status());
}
