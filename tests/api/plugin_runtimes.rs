//! Language profiles of plugins (`PUT /v1/plugin?runtime=rust|js|python`): each has its own
//! limits, the upload is bounded by its profile's size, a compile longer than
//! `[plugins] upload_wait_ms` answers `202` and activates the version when done, and a compiled
//! plugin is kept on disk so another process (or a restart) maps it instead of compiling.
//! The JavaScript and Python examples themselves are exercised in `plugin_languages.rs`.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::helpers::{assert_problem, metric, plugin_wasm, spawn_app_with, AppOptions, Reply, TenantClient};

/// How long a small plugin's compile (and the status poll that follows it) may take.
const COMPILE_DEADLINE: Duration = Duration::from_secs(60);

/// `PUT /v1/plugin` with `query` and the component.
async fn put(shop: &TenantClient, wasm: Vec<u8>, query: &[(&str, &str)]) -> Reply {
    let request = shop
        .request(reqwest::Method::PUT, "/v1/plugin")
        .header(reqwest::header::CONTENT_TYPE, "application/wasm")
        .query(query)
        .body(wasm);
    crate::helpers::send(request).await
}

/// The runtime is validated: an unknown one and a disabled one are refused with 400 before
/// anything compiles; a Rust-sized upload's limit is the Rust profile's (413 naming it) even
/// though the route takes JavaScript-sized bodies; versions and the active plugin say their
/// runtime, and a Rust version stays `rust`.
#[tokio::test]
async fn the_runtime_is_validated_and_bounds_the_upload() {
    let app = spawn_app_with(AppOptions::default().toml("[plugins.python]\nenabled = false")).await;
    let shop = app.create_tenant("shop").await;
    let wasm = plugin_wasm("flash-sale");

    let reply = put(&shop, wasm.clone(), &[("runtime", "cobol")]).await;
    let problem = assert_problem(&reply, 400, "validation_failed");
    assert!(problem["detail"].as_str().unwrap_or_default().contains("runtime"), "{problem}");
    let reply = put(&shop, wasm.clone(), &[("runtime", "python")]).await;
    let problem = assert_problem(&reply, 400, "validation_failed");
    assert!(problem["detail"].as_str().unwrap_or_default().contains("not enabled"), "{problem}");

    // 3 MiB: over the Rust profile's 2 MiB, far under the JavaScript profile's size.
    let mut big = wasm.clone();
    big.resize(3 << 20, 0);
    let reply = put(&shop, big, &[]).await;
    let problem = assert_problem(&reply, 413, "payload_too_large");
    assert!(problem["detail"].as_str().unwrap_or_default().contains("rust runtime"), "{problem}");

    let uploaded = put(&shop, wasm.clone(), &[("runtime", "rust")]).await.expect_json(201);
    assert_eq!(uploaded["runtime"], "rust", "{uploaded}");
    let active = shop.get("/v1/plugin").await.expect_json(200);
    assert_eq!((active["version"].clone(), active["runtime"].clone()), (json!(1), json!("rust")), "{active}");
    let versions = shop.get("/v1/plugin/versions").await.expect_json(200);
    assert_eq!(versions["items"][0]["runtime"], "rust", "{versions}");
    let builtin = shop.post_empty("/v1/plugin/versions/0/activate").await.expect_json(200);
    assert_eq!(builtin["runtime"], Value::Null, "{builtin}");
    let again = shop.post_empty("/v1/plugin/versions/1/activate").await.expect_json(200);
    assert_eq!(again["runtime"], "rust", "{again}");
}

/// Polls the upload's status address until its compile has ended; returns the last status.
async fn until_ended(shop: &TenantClient, location: &str) -> Value {
    let deadline = Instant::now() + COMPILE_DEADLINE;
    loop {
        let status = shop.get(location).await.expect_json(200);
        if status["state"] != "compiling" {
            return status;
        }
        assert!(Instant::now() < deadline, "the upload still compiles after {COMPILE_DEADLINE:?}: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// With `upload_wait_ms = 1` every compile outlasts the wait: the upload answers 202 with a
/// Location, whose status says `compiling` and then `active` with the version, which is then
/// the active one and plans orders; another tenant's view of that address is a 404. A refused
/// component's status says `failed` with the problem the upload would have answered.
#[tokio::test]
async fn a_compile_longer_than_the_wait_answers_202_and_activates_when_done() {
    let app = spawn_app_with(AppOptions::default().toml("[plugins]\nupload_wait_ms = 1")).await;
    let shop = app.create_tenant("shop").await;
    let other = app.create_tenant("other").await;
    shop.create_resource("sku-1", 10).await;
    let wasm = plugin_wasm("flash-sale");

    let reply = put(&shop, wasm.clone(), &[("config", "buckets=1")]).await;
    let accepted = reply.expect_json(202);
    let location = reply.header("location").unwrap_or_else(|| panic!("a Location: {accepted}")).to_owned();
    assert_eq!(location, format!("/v1/plugin/uploads/{}", accepted["id"].as_str().unwrap_or_default()));
    assert_eq!((accepted["state"].clone(), accepted["runtime"].clone()), (json!("compiling"), json!("rust")));
    assert_problem(&other.get(&location).await, 404, "upload_not_found");

    let done = until_ended(&shop, &location).await;
    assert_eq!((done["state"].clone(), done["version"].clone()), (json!("active"), json!(1)), "{done}");
    let active = shop.get("/v1/plugin").await.expect_json(200);
    assert_eq!(active["version"], 1, "{active}");
    // The flash-sale plan: one piece per user.
    let order =
        |id: &str| json!({"order_id": id, "user_id": "u-1", "action": "deduct", "lines": [{"key": "sku-1", "qty": 1}]});
    shop.order("k-1", &order("o-1")).await.expect_json(201);
    let second = shop.order("k-2", &order("o-2")).await;
    assert_eq!(second.status(), 409, "the plugin's per-user limit applies: {}", second.text);

    let reply = put(&shop, plugin_wasm("hostile-wasi-fs"), &[]).await;
    let location = reply.header("location").map(str::to_owned);
    let failed = match reply.status() {
        202 => until_ended(&shop, &location.unwrap_or_default()).await,
        status => panic!("a compile outlasting 1 ms answers 202, not {status}: {}", reply.text),
    };
    assert_eq!(failed["state"], "failed", "{failed}");
    assert_eq!(failed["problem"]["code"], "plugin_invalid", "{failed}");
    assert_eq!(shop.get("/v1/plugin").await.expect_json(200)["version"], 1, "the refused upload changed nothing");
}

/// A compiled plugin is kept in the artifact directory: a second process on the same database
/// and directory plans the tenant's orders with it after mapping the stored artifact, without
/// compiling (its compile counter stays 0), and so does the first process after a restart.
#[tokio::test]
async fn another_process_and_a_restart_map_the_stored_artifact_without_compiling() {
    let cache = tempfile::tempdir().expect("a temporary directory");
    let shared = AppOptions::default().env("XDG_CACHE_HOME", cache.path().to_str().expect("UTF-8 path"));
    let mut first = spawn_app_with(shared.clone()).await;
    let shop = first.create_tenant("shop").await;
    shop.create_resource("sku-1", 100).await;
    put(&shop, plugin_wasm("flash-sale"), &[("config", "buckets=1")]).await.expect_json(201);
    assert_eq!(metric(&first, "stockd_plugin_compiles_total", &["result=\"ok\""]).await, 1.0);
    assert_eq!(metric(&first, "stockd_plugin_artifacts_total", &["result=\"stored\""]).await, 1.0);
    let stored = std::fs::read_dir(cache.path().join("stockd/plugins"))
        .expect("the artifact directory exists")
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "cwasm"))
        .count();
    assert_eq!(stored, 1, "one artifact on disk");

    let second = first.spawn_sibling_with(shared.clone()).await;
    let shop_there = second.tenant_with_key("shop", &shop.api_key);
    let order = |id: &str, user: &str| json!({"order_id": id, "user_id": user, "action": "deduct", "lines": [{"key": "sku-1", "qty": 1}]});
    shop_there.order("k-1", &order("o-1", "u-1")).await.expect_json(201);
    assert_eq!(shop_there.order("k-2", &order("o-2", "u-1")).await.status(), 409, "planned by the plugin");
    assert_eq!(metric(&second, "stockd_plugin_compiles_total", &[]).await, 0.0, "nothing compiled");
    assert_eq!(metric(&second, "stockd_plugin_artifacts_total", &["result=\"loaded\""]).await, 1.0);

    first.restart().await;
    let shop = first.tenant_with_key("shop", &shop.api_key);
    shop.order("k-3", &order("o-3", "u-2")).await.expect_json(201);
    assert_eq!(metric(&first, "stockd_plugin_compiles_total", &[]).await, 0.0, "nothing compiled after the restart");
    assert_eq!(metric(&first, "stockd_plugin_artifacts_total", &["result=\"loaded\""]).await, 1.0);
}

/// JavaScript and Python uploads (tens of MiB each) are held only so many at once: with
/// `max_concurrent_large_uploads = 1`, while one JavaScript upload's body is still arriving
/// another answers 503 with Retry-After; a Rust upload is not held back; once the first
/// client goes away the next JavaScript upload is read (and refused for what it is, 422).
#[tokio::test]
async fn large_uploads_are_bounded_and_the_excess_answers_503() {
    use tokio::io::AsyncWriteExt;

    let app = spawn_app_with(AppOptions::default().toml("[plugins]\nmax_concurrent_large_uploads = 1")).await;
    let shop = app.create_tenant("shop").await;
    let garbage = b"not a component".to_vec();

    // The first upload declares 1 MB and sends 10 bytes of it, then waits.
    let mut stalled = tokio::net::TcpStream::connect(&app.addr).await.expect("the server accepts a connection");
    let head = format!(
        "PUT /v1/plugin?runtime=js HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/wasm\r\nContent-Length: 1000000\r\n\r\n0123456789",
        app.addr, shop.api_key
    );
    stalled.write_all(head.as_bytes()).await.expect("the request starts");

    // Only once the stalled upload holds the one place: an upload that got there first holds
    // it until its compile ends, and the stalled one then would wait for its body holding none.
    let deadline = Instant::now() + COMPILE_DEADLINE;
    while metric(&app, "stockd_plugin_large_uploads_in_progress", &[]).await < 1.0 {
        assert!(Instant::now() < deadline, "the stalled upload never took its place");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = put(&shop, garbage.clone(), &[("runtime", "js")]).await;
    assert_problem(&refused, 503, "unavailable");
    assert!(refused.header("retry-after").is_some(), "a 503 says when to retry");
    assert_eq!(put(&shop, garbage.clone(), &[("runtime", "rust")]).await.status(), 422, "Rust uploads are not held");

    drop(stalled);
    let deadline = Instant::now() + COMPILE_DEADLINE;
    loop {
        let reply = put(&shop, garbage.clone(), &[("runtime", "js")]).await;
        if reply.status() == 422 {
            break;
        }
        assert_eq!(reply.status(), 503, "{}", reply.text);
        assert!(Instant::now() < deadline, "the first upload's place was never given back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
