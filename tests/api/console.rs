//! The browser console (`/console`): served by the server itself, and driven in a real browser
//! (Playwright's `playwright-core` from `tests/console/`, on Debian's Chromium) by
//! `tests/console/console.test.mjs`. This file starts the server and the script, and does for
//! the script what only a test can do: change the database behind the server's back.
//! Screenshots land in `$CARGO_TARGET_DIR/console-artifacts/<backend>/`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

use crate::helpers::{deduct, plugin_wasm, spawn_app, spawn_app_with, tamper, unique, AppOptions, Backend};

/// Everything the browser test needs, or a failure that says how to get it: the suite never
/// skips a test because a tool is missing.
fn browser_prerequisites() -> (PathBuf, String) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/console");
    assert!(
        dir.join("node_modules/playwright-core").is_dir(),
        "playwright-core is not installed: run `npm ci --prefix tests/console` (the README test command does)"
    );
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&chromium).exists(),
        "no Chromium at {chromium}: `apt-get install chromium` (the README test command does), or set CHROMIUM"
    );
    (dir, chromium)
}

fn artifacts_dir() -> PathBuf {
    let target =
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target").into());
    Path::new(&target).join("console-artifacts").join(format!("{:?}", Backend::from_env()).to_lowercase())
}

/// The console's assets come from the binary with a policy that keeps the page to its own
/// origin, and its page names its script and stylesheet by relative paths under /console/.
#[tokio::test]
async fn the_console_is_served_by_the_server_with_a_strict_content_security_policy() {
    let app = spawn_app().await;
    let page = app.get_anonymous("/console/").await;
    assert_eq!(page.status(), 200);
    assert!(page.content_type().starts_with("text/html"), "{}", page.content_type());
    let csp = page.header("content-security-policy").unwrap_or_default().to_string();
    for directive in ["default-src 'none'", "script-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"] {
        assert!(csp.contains(directive), "CSP lacks {directive}: {csp}");
    }
    assert!(page.text.contains("src=\"console.js\"") && page.text.contains("href=\"console.css\""), "{}", page.text);
    let script = app.get_anonymous("/console/console.js").await;
    assert_eq!(script.status(), 200);
    assert!(script.content_type().starts_with("text/javascript"), "{}", script.content_type());
    for sink in [".innerHTML", ".outerHTML", "insertAdjacentHTML", "document.write"] {
        assert!(!script.text.contains(sink), "the console builds elements, never HTML from data ({sink})");
    }
    assert_eq!(app.get_anonymous("/console/console.css").await.status(), 200);
    // `/console` without the slash redirects, so relative asset paths resolve under it.
    let no_redirects = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("a plain HTTP client always builds");
    let bare = no_redirects.get(app.url("/console")).send().await.expect("the server answers");
    assert_eq!(bare.status(), 308);
    assert_eq!(bare.headers().get("location").and_then(|v| v.to_str().ok()), Some("/console/"));
}

/// In a real browser: a tenant signs in, watches available fall while a load runs and its key
/// rise to the top, sees a reservation about to expire, the resource's chart and ledger, restocks
/// it, activates another plugin version and sees the dry run change, and sees a drift appear
/// after one is forced in the database; then the operator signs in, creates a tenant and reads
/// the health page.
#[tokio::test]
async fn the_console_shows_a_live_sale_a_plugin_change_and_a_forced_drift_in_a_real_browser() {
    let (dir, chromium) = browser_prerequisites();
    // Webhooks may target this machine, and are retried quickly, so that the console has
    // delivery attempts to show.
    let app = spawn_app_with(AppOptions::default().toml(
        "[events.webhooks]\nallow_private_targets = true\nretry_initial_ms = 200\nretry_max_ms = 1000\npoll_interval_ms = 50",
    ))
    .await;
    let shop = app.create_tenant(&unique("console")).await;
    // Nothing listens on port 9 here: every attempt fails to connect, and the console says so.
    shop.post("/v1/webhooks", &json!({"url": "http://127.0.0.1:9/stockd", "types": ["resource.low_stock"]}))
        .await
        .expect_json(201);
    let sku = "flash-sku-1";
    shop.post("/v1/resources", &json!({"key": sku, "kind": "inventory", "total": 5000, "buckets": 4}))
        .await
        .expect_json(201);
    // Neighbours in other states, planned by the built-in plan before the plugin arrives.
    shop.post("/v1/resources", &json!({"key": "coupon-spring", "kind": "coupon", "total": 500, "low_stock": 450}))
        .await
        .expect_json(201);
    shop.create_resource("sku-sold-out", 3).await;
    shop.post("/v1/resources", &json!({"key": "wallet-eur", "kind": "balance", "total": 100_000}))
        .await
        .expect_json(201);
    shop.order(&unique("c"), &deduct("ord-coupons", &[("coupon-spring", 60)])).await.expect_json(201);
    shop.order(&unique("s"), &deduct("ord-sold-out", &[("sku-sold-out", 3)])).await.expect_json(201);
    shop.patch("/v1/resources/wallet-eur", &json!({"status": "inactive"})).await.expect_json(200);
    let uploaded = shop.put_plugin_config(plugin_wasm("flash-sale"), "buckets = 4").await.expect_json(201);
    let version = uploaded["version"].as_i64().unwrap_or_else(|| panic!("an upload answers its version: {uploaded}"));

    let artifacts = artifacts_dir();
    let mut child = Command::new("node")
        .arg(dir.join("console.test.mjs"))
        .current_dir(&dir)
        .env("STOCKD_URL", format!("http://{}", app.addr))
        .env("STOCKD_API_KEY", &shop.api_key)
        .env("STOCKD_ADMIN_TOKEN", &app.admin_token)
        .env("STOCKD_TENANT", &shop.id)
        .env("STOCKD_RESOURCE", sku)
        .env("STOCKD_PLUGIN_VERSION", version.to_string())
        .env("STOCKD_ARTIFACTS", &artifacts)
        .env("CHROMIUM", &chromium)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("node cannot be started ({e}): the browser tests need Node.js 20 or newer"));
    let mut stdin = child.stdin.take().expect("stdin was piped");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout was piped")).lines();
    let mut transcript = String::new();

    let run = async {
        while let Some(line) = stdout.next_line().await.expect("the script's output is text") {
            transcript.push_str(&line);
            transcript.push('\n');
            if let Some(key) = line.strip_prefix("ASK drift ") {
                // A counter changed without a ledger entry: what reconciliation exists to find.
                let statement = format!(
                    "UPDATE resource_buckets SET available = available + 1, total = total + 1
                     WHERE tenant_id = '{}' AND resource_key = '{key}' AND bucket = 0",
                    shop.id
                );
                tamper(app.database_url(), &[&statement]).await;
                stdin.write_all(b"ok\n").await.expect("the script reads its stdin");
            }
        }
        child.wait_with_output().await.expect("the script ends")
    };
    let output = tokio::time::timeout(Duration::from_secs(180), run)
        .await
        .unwrap_or_else(|_| panic!("the browser test did not end within 180 s; so far:\n{transcript}"));
    assert!(
        output.status.success(),
        "the browser test failed ({}):\n{transcript}\n{}\nserver log:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        app.logs()
    );
    assert!(transcript.ends_with("PASSED\n"), "{transcript}");
    for shot in ["resources.png", "resource.png", "plugins-default.png", "reconciliation.png", "operator-health.png"] {
        assert!(artifacts.join(shot).is_file(), "screenshot {shot} missing in {}", artifacts.display());
    }
}
