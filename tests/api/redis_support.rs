//! Redis for the redis-mode tests: the shared server the test command guarantees on 6379 (each
//! test under its own key prefix), or a private `redis-server` on a free port for tests that
//! stop, restart or count the commands of Redis. Plus the requests those tests repeat.

use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::process::{Child, Command};

use crate::helpers::{spawn_app_with, unique, AppOptions, Reply, TenantClient, TestApp};

/// How long a private Redis may take to answer PING after it starts.
const REDIS_START_DEADLINE: Duration = Duration::from_secs(20);
/// How long settlement may take to bring the database to the expected state.
pub const SETTLE_DEADLINE: Duration = Duration::from_secs(30);

/// The shared Redis (`STOCKD_TEST_REDIS_URL`, default the local one on 6379).
pub fn shared_redis_url() -> String {
    std::env::var("STOCKD_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A server with redis mode on `redis_url`, under a key prefix no other test uses, reclaiming
/// entries of dead consumers after half a second.
pub async fn redis_app(redis_url: &str, extra_toml: &str) -> (TestApp, String) {
    let prefix = unique("t");
    let opts = AppOptions::default()
        .env("STOCKD_REDIS_URL", redis_url)
        .env("STOCKD_REDIS_PREFIX", &prefix)
        .toml(&format!("[redis]\nclaim_idle_ms = 500\ndrain_timeout_ms = 20000\n{extra_toml}"));
    (spawn_app_with(opts).await, prefix)
}

/// An async connection to a Redis, for looking past the API.
pub async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(url).unwrap_or_else(|e| panic!("redis url {url}: {e}"));
    client.get_multiplexed_async_connection().await.unwrap_or_else(|e| panic!("redis at {url} must answer: {e}"))
}

/// The key of a resource's settlement stream (see `src/hotpath/mod.rs`).
pub fn stream_key(prefix: &str, tenant: &str, key: &str) -> String {
    format!("{prefix}:{{{tenant}:{key}}}:x")
}

/// Creates a resource in redis mode and asserts the 201.
pub async fn create_redis_resource(shop: &TenantClient, key: &str, total: i64) -> Value {
    let state = shop
        .post("/v1/resources", &json!({"key": key, "kind": "inventory", "total": total, "mode": "redis"}))
        .await
        .expect_json(201);
    assert_eq!(state["mode"], "redis", "{state}");
    state
}

/// A one-line deduction, optionally for a user.
pub fn deduct_one(order_id: &str, key: &str, qty: i64, user: Option<&str>) -> Value {
    let mut body = json!({"order_id": order_id, "action": "deduct", "lines": [{"key": key, "qty": qty}]});
    if let Some(user) = user {
        body["user_id"] = json!(user);
    }
    body
}

/// Sends an order, retrying while the server answers 503 (Redis reconnecting or a warm
/// draining), like a careful client with the same idempotency key.
pub async fn order_through_503(shop: &TenantClient, key: &str, body: &Value) -> Reply {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let reply = shop.order(key, body).await;
        if reply.status() != 503 || tokio::time::Instant::now() >= deadline {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The tenant's reconciliation report.
pub async fn reconciliation(shop: &TenantClient) -> Value {
    shop.get("/v1/reconciliation").await.expect_json(200)
}

/// The report's entry for one redis-mode resource.
#[track_caller]
pub fn redis_entry(report: &Value, key: &str) -> Value {
    let entries = report["redis"].as_array().unwrap_or_else(|| panic!("report has a redis list: {report}"));
    entries.iter().find(|e| e["key"] == key).cloned().unwrap_or_else(|| panic!("{key} in the redis list: {report}"))
}

/// Waits until the database shows `consumed` for the resource and Redis has no backlog left;
/// returns the final reconciliation report.
pub async fn wait_settled(shop: &TenantClient, key: &str, consumed: i64) -> Value {
    let deadline = tokio::time::Instant::now() + SETTLE_DEADLINE;
    loop {
        let state = shop.state(key).await;
        let report = reconciliation(shop).await;
        let entry = redis_entry(&report, key);
        if state["consumed"] == consumed && entry["backlog"] == 0 {
            return report;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key} did not settle to consumed {consumed}: state {state}, report {report}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A private `redis-server` on a free loopback port, keeping its snapshot (only when asked,
/// with `SAVE`) in its own directory. Killed when dropped.
pub struct RedisServer {
    pub port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl RedisServer {
    pub async fn start() -> RedisServer {
        let port = free_port();
        let dir = tempfile::tempdir().expect("a temporary directory can be created");
        let mut server = RedisServer { port, dir, child: None };
        server.launch(&[]).await;
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts `redis-server` with these extra arguments and waits for PING.
    pub async fn launch(&mut self, extra: &[&str]) {
        assert!(self.child.is_none(), "launch() while redis-server runs");
        let port = self.port.to_string();
        let child = Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("redis-server is installed (scripts/test.sh installs it)");
        self.child = Some(child);
        wait_for_ping(&self.url()).await;
    }

    /// SIGKILL: whatever was not saved is lost.
    pub async fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Starts it again on the same port and directory (loading the last `SAVE`, if any).
    pub async fn restart(&mut self) {
        self.kill9().await;
        self.launch(&[]).await;
    }
}

/// Waits until a Redis answers PING.
pub async fn wait_for_ping(url: &str) {
    let deadline = tokio::time::Instant::now() + REDIS_START_DEADLINE;
    loop {
        if let Ok(client) = redis::Client::open(url) {
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                let pong: Result<String, _> = redis::cmd("PING").query_async(&mut conn).await;
                if pong.is_ok() {
                    return;
                }
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "redis at {url} did not answer PING");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port can be bound");
    listener.local_addr().expect("a bound socket has an address").port()
}
