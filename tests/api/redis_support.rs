//! Redis for the redis-mode tests: the shared server the test command guarantees on 6379 (each
//! test under its own key prefix), or a private `redis-server` on a free port for tests that
//! stop, restart or count the commands of Redis. Plus the requests those tests repeat.

use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::process::{Child, Command};

use crate::helpers::{spawn_app_on, spawn_app_with, unique, AppOptions, Backend, Reply, TenantClient, TestApp};

/// How long a private Redis may take to answer PING after it starts.
const REDIS_START_DEADLINE: Duration = Duration::from_secs(20);
/// How long settlement may take to bring the database to the expected state.
pub const SETTLE_DEADLINE: Duration = Duration::from_secs(30);

/// The shared Redis (`STOCKD_TEST_REDIS_URL`, default the local one on 6379).
pub fn shared_redis_url() -> String {
    std::env::var("STOCKD_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A server with redis mode on `redis_url`, under a key prefix no other test uses, reclaiming
/// entries of dead consumers after half a second. An empty `redis_url` leaves the topology to
/// `extra_toml` (cluster nodes, sentinels).
pub async fn redis_app(redis_url: &str, extra_toml: &str) -> (TestApp, String) {
    let prefix = unique("t");
    let mut opts = AppOptions::default()
        .env("STOCKD_REDIS_PREFIX", &prefix)
        .toml(&format!("[redis]\nclaim_idle_ms = 500\ndrain_timeout_ms = 20000\n{extra_toml}"));
    if !redis_url.is_empty() {
        opts = opts.env("STOCKD_REDIS_URL", redis_url);
    }
    (spawn_app_with(opts).await, prefix)
}

/// A server on `backend`, whatever the suite's, with redis mode on the shared Redis under a key
/// prefix no other test uses.
pub async fn redis_app_on(backend: Backend) -> TestApp {
    let opts = AppOptions::default()
        .env("STOCKD_REDIS_PREFIX", &unique("t"))
        .env("STOCKD_REDIS_URL", &shared_redis_url())
        .toml("[redis]\nclaim_idle_ms = 500\ndrain_timeout_ms = 20000");
    spawn_app_on(backend, opts).await
}

/// An async connection to a Redis, for looking past the API.
pub async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(url).unwrap_or_else(|e| panic!("redis url {url}: {e}"));
    client.get_multiplexed_async_connection().await.unwrap_or_else(|e| panic!("redis at {url} must answer: {e}"))
}

/// The key of a resource's settlement stream (see `src/redis_mode/mod.rs`).
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

/// Sends an order, retrying while the server answers `503 unavailable` (Redis reconnecting or
/// failing over, a warm draining), like a careful client with the same idempotency key.
pub async fn order_through_503(shop: &TenantClient, key: &str, body: &Value) -> Reply {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let reply = shop.order(key, body).await;
        let unavailable = reply.status() == 503 && reply.json()["code"] == "unavailable";
        if !unavailable || tokio::time::Instant::now() >= deadline {
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
        if state["consumed"] == consumed && entry["backlog"] == 0 && entry["unsettled"] == 0 {
            return report;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key} did not settle to consumed {consumed}: state {state}, report {report}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Holds the database's resources table so settlement cannot commit (reads go on): an
/// exclusive SQLite transaction, a PostgreSQL table lock, or a MySQL table read lock (which,
/// like PostgreSQL's `EXCLUSIVE` mode, lets other sessions read the table and makes every
/// write to it wait). Dropping the guard releases it.
pub enum TableHold {
    Sqlite(sqlx::SqliteConnection),
    Postgres(sqlx::PgConnection),
    Mysql(sqlx::MySqlConnection),
}

impl TableHold {
    pub async fn take(database_url: &str) -> TableHold {
        TableHold::take_on(Backend::from_env(), database_url).await
    }

    /// Like [`TableHold::take`] on a backend the caller names (the model check's own topology).
    pub async fn take_on(backend: Backend, database_url: &str) -> TableHold {
        use sqlx::Connection;
        match backend {
            Backend::Sqlite => {
                let mut conn = sqlx::SqliteConnection::connect(database_url).await.expect("the SQLite file opens");
                sqlx::query("BEGIN EXCLUSIVE").execute(&mut conn).await.expect("an exclusive transaction starts");
                TableHold::Sqlite(conn)
            }
            Backend::Postgres => {
                let mut conn = sqlx::PgConnection::connect(database_url).await.expect("PostgreSQL answers");
                sqlx::query("BEGIN").execute(&mut conn).await.expect("BEGIN");
                sqlx::query("LOCK TABLE resources IN EXCLUSIVE MODE").execute(&mut conn).await.expect("LOCK TABLE");
                TableHold::Postgres(conn)
            }
            Backend::Mysql => {
                let mut conn = sqlx::MySqlConnection::connect(database_url).await.expect("MySQL answers");
                sqlx::query("LOCK TABLES resources READ").execute(&mut conn).await.expect("LOCK TABLES");
                TableHold::Mysql(conn)
            }
        }
    }

    pub async fn release(self) {
        let rolled_back = match self {
            TableHold::Sqlite(mut conn) => sqlx::query("ROLLBACK").execute(&mut conn).await.map(|_| ()),
            TableHold::Postgres(mut conn) => sqlx::query("ROLLBACK").execute(&mut conn).await.map(|_| ()),
            TableHold::Mysql(mut conn) => sqlx::query("UNLOCK TABLES").execute(&mut conn).await.map(|_| ()),
        };
        rolled_back.expect("the hold is released");
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
        RedisServer::start_with(&[]).await
    }

    /// Starts one with extra `redis-server` arguments (cluster mode, replication, ...).
    pub async fn start_with(extra: &[&str]) -> RedisServer {
        // A cluster node also listens on port + 10000 (its cluster bus), which must be free too.
        let port = if extra.contains(&"--cluster-enabled") { free_cluster_port() } else { free_port() };
        let dir = tempfile::tempdir().expect("a temporary directory can be created");
        let mut server = RedisServer { port, dir, child: None };
        server.launch(extra).await;
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Where it keeps its snapshot (`dump.rdb`, written by `SAVE`, loaded at start).
    #[allow(dead_code)] // used by the model check (tests/model/), which shares this file
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Starts `redis-server` with these extra arguments and waits for PING.
    pub async fn launch(&mut self, extra: &[&str]) {
        assert!(self.child.is_none(), "launch() while redis-server runs");
        let port = self.port.to_string();
        let child = Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.dir.path().join("redis.log"))
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

/// A loopback port below 55536 that is free, with port + 10000 free as well.
fn free_cluster_port() -> u16 {
    for _ in 0..1000 {
        let port = free_port();
        if port < 55_536 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port pair for a cluster node");
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port can be bound");
    listener.local_addr().expect("a bound socket has an address").port()
}

/// A three-master Redis Cluster on loopback ports (no replicas).
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub async fn start() -> RedisCluster {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            nodes.push(RedisServer::start_with(&["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]).await);
        }
        let addresses: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .await
            .expect("redis-cli is installed");
        assert!(created.status.success(), "redis-cli --cluster create: {}", String::from_utf8_lossy(&created.stdout));
        let cluster = RedisCluster { nodes };
        // Every node must agree that the cluster is up before it serves every slot.
        let deadline = tokio::time::Instant::now() + REDIS_START_DEADLINE;
        for node in &cluster.nodes {
            loop {
                let mut conn = redis_conn(&node.url()).await;
                let info: String =
                    redis::cmd("CLUSTER").arg("INFO").query_async(&mut conn).await.expect("CLUSTER INFO");
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(tokio::time::Instant::now() < deadline, "cluster did not come up: {info}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        cluster
    }

    /// The `[redis]` settings pointing stockd at this cluster.
    pub fn toml(&self) -> String {
        let urls: Vec<String> = self.nodes.iter().map(|n| format!("\"{}\"", n.url())).collect();
        format!("cluster_nodes = [{}]", urls.join(", "))
    }
}

/// A TCP relay between a replica and its master, which the test can cut: while cut, whatever
/// the master sends is dropped, so the replica silently misses writes (what an asynchronous
/// replica does when it lags at the moment its master dies).
pub struct ReplicationLink {
    pub port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl ReplicationLink {
    pub async fn start(master_port: u16) -> ReplicationLink {
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port can be bound");
        let port = listener.local_addr().expect("bound").port();
        let cut = std::sync::Arc::new(AtomicBool::new(false));
        let relay_cut = cut.clone();
        let task = tokio::spawn(async move {
            while let Ok((replica, _)) = listener.accept().await {
                let Ok(master) = tokio::net::TcpStream::connect(("127.0.0.1", master_port)).await else { continue };
                let (mut from_replica, mut to_replica) = replica.into_split();
                let (mut from_master, mut to_master) = master.into_split();
                let cut = relay_cut.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = from_master.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        if !cut.load(Ordering::SeqCst) && to_replica.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = from_replica.read(&mut buf).await {
                        if n == 0 || to_master.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        ReplicationLink { port, cut, task }
    }

    /// From now on the replica receives nothing more from its master.
    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for ReplicationLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A master, one replica (replicating through a [`ReplicationLink`]) and three Sentinels
/// (quorum 2) on loopback ports.
pub struct SentinelSetup {
    pub master: RedisServer,
    pub replica: RedisServer,
    pub link: ReplicationLink,
    pub sentinels: Vec<RedisServer>,
}

impl SentinelSetup {
    pub async fn start() -> SentinelSetup {
        let master = RedisServer::start().await;
        let link = ReplicationLink::start(master.port).await;
        let link_port = link.port.to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &link_port]).await;
        wait_for_replica(&master.url(), &replica.url(), &replica.dir.path().join("redis.log")).await;
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            let port = free_port();
            let dir = tempfile::tempdir().expect("a temporary directory can be created");
            let conf = dir.path().join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor mymaster 127.0.0.1 {} 2\n\
                     sentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\n\
                     sentinel parallel-syncs mymaster 1\n",
                    dir.path().display(),
                    master.port
                ),
            )
            .expect("the sentinel config can be written");
            let child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .expect("redis-server --sentinel starts");
            let sentinel = RedisServer { port, dir, child: Some(child) };
            wait_for_ping(&sentinel.url()).await;
            sentinels.push(sentinel);
        }
        SentinelSetup { master, replica, link, sentinels }
    }

    /// The `[redis]` settings pointing stockd at the Sentinels.
    pub fn toml(&self) -> String {
        let urls: Vec<String> = self.sentinels.iter().map(|s| format!("\"{}\"", s.url())).collect();
        format!("sentinels = [{}]\nsentinel_master = \"mymaster\"", urls.join(", "))
    }

    /// Waits until the Sentinels name `port` as the master.
    pub async fn wait_for_master(&self, port: u16) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let mut conn = redis_conn(&self.sentinels[0].url()).await;
            let addr: Vec<String> = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg("mymaster")
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            if addr.get(1).map(String::as_str) == Some(port.to_string().as_str()) {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "sentinels did not promote {port}: {addr:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Waits until a master has a replica in sync (`master_link_status:up` as it sees it).
async fn wait_for_replica(master_url: &str, replica_url: &str, log_of_replica: &std::path::Path) {
    let deadline = tokio::time::Instant::now() + REDIS_START_DEADLINE;
    loop {
        let mut conn = redis_conn(master_url).await;
        let info: String = redis::cmd("INFO").arg("replication").query_async(&mut conn).await.expect("INFO");
        if info.contains("slave0:") && info.contains("state=online") {
            return;
        }
        let mut replica = redis_conn(replica_url).await;
        let seen: String = redis::cmd("INFO").arg("replication").query_async(&mut replica).await.expect("INFO");
        if tokio::time::Instant::now() >= deadline {
            let log = std::fs::read_to_string(log_of_replica).unwrap_or_default();
            panic!("the replica did not sync: {info}\nreplica: {seen}\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
