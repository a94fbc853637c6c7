//! Test harness: starts the real `stockd` binary on a free port against a fresh database and
//! talks HTTP to it, plus the asserters every test shares (problem documents, ledger replay,
//! reconciliation).
//!
//! The server is a child process, not an in-process task, so the crash tests can `kill -9` it and
//! start it again on the same database, and so no test depends on the server's internals.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use reqwest::{Method, RequestBuilder, StatusCode};
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

/// How long the server may take to print `listening on http://ADDR`.
const STARTUP_DEADLINE: Duration = Duration::from_secs(30);
/// How long a SIGTERM'd or SIGKILL'd server may take to exit.
const EXIT_DEADLINE: Duration = Duration::from_secs(30);
/// Upper bound for one HTTP exchange, so a hung server fails the test instead of hanging it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How much of the server's stdout/stderr we keep for failure messages.
const LOG_CAPTURE_MAX_BYTES: usize = 256 * 1024;
/// Bound on the pages walked by `ledger()`: 10^7 entries is far beyond any test.
const LEDGER_MAX_PAGES: usize = 10_000;
/// Page size used when walking a whole ledger.
const LEDGER_PAGE_LIMIT: usize = 1_000;
/// Write/read size for `post_over_raw_tcp`.
const RAW_CHUNK_BYTES: usize = 64 * 1024;
/// Upper bound on a response read by `post_over_raw_tcp`.
const RAW_RESPONSE_MAX_BYTES: usize = 1024 * 1024;
/// The line the server prints on stdout once it accepts connections.
const LISTENING_PREFIX: &str = "listening on http://";

/// The storage backend the suite runs against. Chosen once, from `STOCKD_TEST_BACKEND`; each
/// variant knows how to give one test a fresh, empty database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
    /// MySQL or MariaDB (CI runs MariaDB), on the server at `STOCKD_TEST_MYSQL_URL`.
    Mysql,
}

impl Backend {
    pub fn from_env() -> Backend {
        match std::env::var("STOCKD_TEST_BACKEND") {
            Err(_) => Backend::Sqlite,
            Ok(name) => match name.as_str() {
                "" | "sqlite" => Backend::Sqlite,
                "postgres" => Backend::Postgres,
                "mysql" => Backend::Mysql,
                other => panic!("STOCKD_TEST_BACKEND={other:?} is not a backend this suite knows"),
            },
        }
    }

    /// Whether the database is a server that several stockd processes share as equals (not
    /// a file that one process writes through its own writer).
    pub fn is_server(self) -> bool {
        match self {
            Backend::Sqlite => false,
            Backend::Postgres | Backend::Mysql => true,
        }
    }

    /// A database nobody else uses, for one test (and its restarts): a file in the test's
    /// directory, or a new database on the PostgreSQL or MySQL server that is dropped with the
    /// returned guard.
    async fn fresh_database(self, dir: &Path) -> (String, Option<ServerDatabase>) {
        let db = match self {
            Backend::Sqlite => return (format!("sqlite://{}", dir.join("stockd.db").display()), None),
            Backend::Postgres => ServerDatabase::Postgres(PgDatabase::create().await),
            Backend::Mysql => ServerDatabase::Mysql(MysqlDatabase::create().await),
        };
        (db.url(), Some(db))
    }
}

/// A test's own database on a database server; dropping it drops the database.
enum ServerDatabase {
    Postgres(PgDatabase),
    Mysql(MysqlDatabase),
}

impl ServerDatabase {
    fn url(&self) -> String {
        match self {
            ServerDatabase::Postgres(db) => db.url(),
            ServerDatabase::Mysql(db) => db.url(),
        }
    }
}

/// `admin_url` with its database (the last path segment) replaced by `name`; a query string
/// (`?ssl-mode=...`) is kept.
fn url_with_database(admin_url: &str, name: &str) -> String {
    let (url, query) = match admin_url.split_once('?') {
        Some((url, query)) => (url, format!("?{query}")),
        None => (admin_url, String::new()),
    };
    let base = url.rsplit_once('/').map(|(base, _)| base).unwrap_or(url);
    format!("{base}/{name}{query}")
}

/// Creates a database no other test uses on the `server` (`PostgreSQL`, `MySQL`) at
/// `admin_url`, through a connection of type `C`, and returns its name: `stockd_test_` and 16
/// hex digits. An unreachable server fails the test: no test is skipped for a missing service.
async fn create_test_database<C>(server: &str, admin_url: &str) -> String
where
    C: sqlx::Connection,
    for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
    for<'q> <C::Database as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, C::Database>,
{
    let name = format!("stockd_test_{:016x}", rand::random::<u64>());
    let admin = C::connect(admin_url)
        .await
        .unwrap_or_else(|e| panic!("{server} at {admin_url} must be reachable for this suite: {e}"));
    execute_all(admin, &[&format!("CREATE DATABASE {name}")]).await;
    name
}

/// Runs `clean_up` on a small runtime of its own on another thread and waits for it. Drop runs
/// outside any runtime guarantee; failure only leaves a stray database behind, never fails a test.
fn block_on_own_runtime<F: std::future::Future<Output = ()> + Send + 'static>(clean_up: F) {
    let _ = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(clean_up);
    })
    .join();
}

/// The PostgreSQL server the suite creates its databases on (`STOCKD_TEST_PG_URL`, default the
/// local server with trust auth). Any database of that server works as the admin connection.
pub fn pg_admin_url() -> String {
    std::env::var("STOCKD_TEST_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// A throwaway PostgreSQL database for one test, dropped (connections and all) when the test ends.
pub struct PgDatabase {
    name: String,
}

impl PgDatabase {
    async fn create() -> PgDatabase {
        PgDatabase { name: create_test_database::<sqlx::PgConnection>("PostgreSQL", &pg_admin_url()).await }
    }

    fn url(&self) -> String {
        url_with_database(&pg_admin_url(), &self.name)
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        block_on_own_runtime(async move {
            use sqlx::Connection;
            if let Ok(mut admin) = sqlx::PgConnection::connect(&pg_admin_url()).await {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(&mut admin).await;
                let _ = admin.close().await;
            }
        });
    }
}

/// The MySQL/MariaDB server the suite creates its databases on (`STOCKD_TEST_MYSQL_URL`,
/// default the local server's root without a password). Any database of that server works as
/// the admin connection.
pub fn mysql_admin_url() -> String {
    std::env::var("STOCKD_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/mysql".to_owned())
}

/// Bound, in seconds, on the metadata-lock wait of dropping a test's MySQL database: a
/// connection the clean-up could not kill must not hang the suite (the default is a day).
const MYSQL_DROP_LOCK_WAIT_SECONDS: u32 = 10;

/// A throwaway MySQL database for one test, dropped (connections and all) when the test ends.
/// Created with the server's default character set and collation, as an operator's would be.
pub struct MysqlDatabase {
    name: String,
}

impl MysqlDatabase {
    async fn create() -> MysqlDatabase {
        MysqlDatabase { name: create_test_database::<sqlx::MySqlConnection>("MySQL", &mysql_admin_url()).await }
    }

    fn url(&self) -> String {
        url_with_database(&mysql_admin_url(), &self.name)
    }
}

impl Drop for MysqlDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        block_on_own_runtime(async move {
            use sqlx::Connection;
            let Ok(mut admin) = sqlx::MySqlConnection::connect(&mysql_admin_url()).await else { return };
            // MySQL has no `DROP DATABASE ... WITH (FORCE)`: end the sessions still using the
            // database (a sibling process, a held table) first, or the drop waits on their locks.
            // (`id` is signed in MariaDB and unsigned in MySQL: the cast reads both.)
            let sessions: Vec<(i64,)> = sqlx::query_as(
                "SELECT CAST(id AS SIGNED) FROM information_schema.processlist WHERE db = ? AND id <> CONNECTION_ID()",
            )
            .bind(&name)
            .fetch_all(&mut admin)
            .await
            .unwrap_or_default();
            for (id,) in sessions {
                // The session may have ended on its own meanwhile.
                let _ = sqlx::query(&format!("KILL {id}")).execute(&mut admin).await;
            }
            let _ = sqlx::query(&format!("SET SESSION lock_wait_timeout = {MYSQL_DROP_LOCK_WAIT_SECONDS}"))
                .execute(&mut admin)
                .await;
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name}")).execute(&mut admin).await;
            let _ = admin.close().await;
        });
    }
}

/// Extra configuration for one test's server.
#[derive(Debug, Clone, Default)]
pub struct AppOptions {
    /// TOML appended to the generated config file (e.g. `[reservations]` or `[[tenants]]`).
    pub extra_toml: String,
    /// Extra environment variables for the server process.
    pub env: Vec<(String, String)>,
}

impl AppOptions {
    pub fn toml(mut self, text: &str) -> AppOptions {
        self.extra_toml.push_str(text);
        self.extra_toml.push('\n');
        self
    }

    pub fn env(mut self, name: &str, value: &str) -> AppOptions {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }
}

/// A running `stockd` child process with its own temporary directory and database.
pub struct TestApp {
    /// `127.X.Y.Z:PORT` of the current process (the port changes on `restart()`).
    pub addr: String,
    /// The loopback address this app's processes listen on, its own for its whole life (see
    /// [`own_loopback_ip`]).
    ip: std::net::Ipv4Addr,
    pub admin_token: String,
    pub client: reqwest::Client,
    /// Shared with every `TenantClient`, so they follow the server across restarts.
    base_url: Arc<RwLock<String>>,
    child: Option<Child>,
    logs: Arc<Mutex<String>>,
    opts: AppOptions,
    database_url: String,
    config_path: PathBuf,
    /// The test's database on a database server, dropped after the child has been killed.
    _database: Option<ServerDatabase>,
    /// Declared last: the directory is removed only after the child has been killed.
    dir: TempDir,
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(AppOptions::default()).await
}

pub async fn spawn_app_with(opts: AppOptions) -> TestApp {
    spawn_app_on(Backend::from_env(), opts).await
}

/// Like [`spawn_app_with`], on a backend the caller chooses instead of `STOCKD_TEST_BACKEND`
/// (the model check in `tests/model/` picks its own topology).
pub async fn spawn_app_on(backend: Backend, opts: AppOptions) -> TestApp {
    let dir = tempfile::tempdir().expect("a temporary directory can be created");
    let (database_url, database) = backend.fresh_database(dir.path()).await;
    let config_path = dir.path().join("stockd.toml");
    let config = format!(
        "# Written by tests/api/helpers.rs; listen address, database and admin token come from env.\n{}",
        opts.extra_toml
    );
    std::fs::write(&config_path, config).expect("the config file can be written");

    let mut app = TestApp {
        addr: String::new(),
        ip: own_loopback_ip(),
        admin_token: random_hex_32(),
        client: http_client(),
        base_url: Arc::new(RwLock::new(String::new())),
        child: None,
        logs: Arc::new(Mutex::new(String::new())),
        opts,
        database_url,
        config_path,
        _database: database,
        dir,
    };
    app.start().await;
    app
}

/// A loopback address of the whole `127.0.0.0/8` block (Linux answers on every one) that no
/// other app of this run is likely to have. Tests run side by side, and a test that kills its
/// server may still have requests under way to the port it had; the kernel hands ports out again,
/// so on one shared `127.0.0.1` such a request can reach another test's server and take, say, one
/// of its in-flight permits. On an address of its own, a port reused by another app is another
/// socket address, and the stray request is refused.
fn own_loopback_ip() -> std::net::Ipv4Addr {
    let [a, b, c]: [u8; 3] = rand::random();
    // Not 127.0.0.0/24 (127.0.0.1 and neighbours, which other programs of the machine use), and
    // never a .0 or .255 host.
    std::net::Ipv4Addr::new(127, a.max(1), b, c.clamp(1, 254))
}

/// A reqwest client that never goes through a proxy and never hangs forever.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().timeout(REQUEST_TIMEOUT).build().expect("a plain HTTP client always builds")
}

/// 32 random hex characters (128 bits).
pub fn random_hex_32() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// A key no other request in this run uses (idempotency keys, order ids, resource keys).
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

impl TestApp {
    /// Starts the server process on the existing directory/database and waits for its
    /// listening line.
    async fn start(&mut self) {
        assert!(self.child.is_none(), "start() while a server process is running");
        // The server's temporary files (its plugin compiler's directory) go under the test's
        // own directory: a process the test kills cannot remove them, its TempDir does.
        let tmp = self.dir.path().join("tmp");
        std::fs::create_dir_all(&tmp).expect("the test's temporary directory");
        let mut command = Command::new(env!("CARGO_BIN_EXE_stockd"));
        command
            .arg("serve")
            .env("TMPDIR", &tmp)
            .arg("--config")
            .arg(&self.config_path)
            .current_dir(self.dir.path())
            .env("STOCKD_LISTEN", format!("{}:0", self.ip))
            .env("STOCKD_DATABASE_URL", &self.database_url)
            .env("STOCKD_ADMIN_TOKEN", &self.admin_token)
            .env("RUST_LOG", "warn")
            // The backend choice lives in `Backend`; nothing leaks in from the caller's shell.
            .env_remove("STOCKD_REDIS_URL")
            // Compiled plugins are kept under this process's own directory unless the test
            // shares a cache between processes on purpose (`AppOptions::env`).
            .env("XDG_CACHE_HOME", self.dir.path().join("cache"))
            .envs(self.opts.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().expect("the stockd binary can be started");

        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        let (addr_tx, addr_rx) = oneshot::channel();
        tokio::spawn(drain(stdout, "stdout", self.logs.clone(), Some(addr_tx)));
        let stderr_task = tokio::spawn(drain(stderr, "stderr", self.logs.clone(), None));

        let addr = match tokio::time::timeout(STARTUP_DEADLINE, addr_rx).await {
            Ok(Ok(addr)) => addr,
            Ok(Err(_stdout_closed)) => {
                let status = tokio::time::timeout(EXIT_DEADLINE, child.wait()).await;
                let _ = tokio::time::timeout(Duration::from_secs(5), stderr_task).await;
                panic!("stockd exited before printing its listening line ({status:?}); output:\n{}", self.logs());
            }
            Err(_elapsed) => {
                let _ = child.start_kill();
                panic!(
                    "stockd printed no `{LISTENING_PREFIX}ADDR` line within {STARTUP_DEADLINE:?}; output:\n{}",
                    self.logs()
                );
            }
        };
        self.addr = addr;
        *self.base_url.write().expect("lock is never poisoned: no code panics holding it") =
            format!("http://{}", self.addr);
        self.child = Some(child);
    }

    /// Everything the server printed so far (bounded), for failure messages.
    pub fn logs(&self) -> String {
        self.logs.lock().map(|l| l.clone()).unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// The server's process id, for tests that look at the process from outside (`/proc`).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().and_then(Child::id).expect("the server process is running")
    }

    /// Whether the server process is still running (it has not exited, crashed or aborted).
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// SIGKILL the server and wait until it is gone.
    pub async fn kill9(&mut self) {
        let mut child = self.child.take().expect("kill9() needs a running server");
        child.start_kill().expect("SIGKILL can be sent to our own child");
        tokio::time::timeout(EXIT_DEADLINE, child.wait())
            .await
            .expect("a SIGKILL'd process exits at once")
            .expect("waiting on our own child works");
    }

    /// SIGTERM the server, wait for it to exit, and return its exit status.
    pub async fn terminate(&mut self) -> ExitStatus {
        match self.terminate_within(EXIT_DEADLINE).await {
            Some(status) => status,
            None => panic!("stockd did not exit within {EXIT_DEADLINE:?} of SIGTERM; output:\n{}", self.logs()),
        }
    }

    /// SIGTERM the server and wait up to `deadline` for it to exit: its exit status, or `None`
    /// if it is still running (it is then killed when the `TestApp` is dropped).
    pub async fn terminate_within(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let pid = self.pid().to_string();
        let sent = std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("the kill command exists");
        assert!(sent.success(), "kill -TERM {pid} failed");
        let child = self.child.as_mut().expect("pid() checked the child exists");
        let status = tokio::time::timeout(deadline, child.wait()).await.ok()?;
        self.child = None;
        Some(status.expect("waiting on our own child works"))
    }

    /// Replaces the extra configuration (as `AppOptions::toml` gave it); takes effect at the
    /// next `restart`.
    pub fn rewrite_config(&self, extra_toml: &str) {
        let config = format!("# Rewritten by tests/api/helpers.rs.\n{extra_toml}\n");
        std::fs::write(&self.config_path, config).expect("the config file can be rewritten");
    }

    /// Sets (`Some`) or removes (`None`) an environment variable of the server process; takes
    /// effect at the next `restart` (e.g. a fault hook for one incarnation only).
    pub fn set_env(&mut self, name: &str, value: Option<&str>) {
        self.opts.env.retain(|(k, _)| k != name);
        if let Some(value) = value {
            self.opts.env.push((name.to_owned(), value.to_owned()));
        }
    }

    /// Start the server again on the same directory and database (new port). A process still
    /// running is SIGKILL'd first.
    pub async fn restart(&mut self) {
        if self.child.is_some() {
            self.kill9().await;
        }
        self.start().await;
    }

    pub async fn admin_get(&self, path: &str) -> Reply {
        send(self.client.get(self.url(path)).bearer_auth(&self.admin_token)).await
    }

    pub async fn admin_post(&self, path: &str, body: &Value) -> Reply {
        send(self.client.post(self.url(path)).bearer_auth(&self.admin_token).json(body)).await
    }

    pub async fn admin_put(&self, path: &str, body: &Value) -> Reply {
        send(self.client.put(self.url(path)).bearer_auth(&self.admin_token).json(body)).await
    }

    pub async fn admin_delete(&self, path: &str) -> Reply {
        send(self.client.delete(self.url(path)).bearer_auth(&self.admin_token)).await
    }

    /// GET without any credentials.
    pub async fn get_anonymous(&self, path: &str) -> Reply {
        send(self.client.get(self.url(path))).await
    }

    /// Another server process on the same database, with the same admin token and config: what
    /// several stateless processes behind a load balancer look like. The original keeps owning
    /// the database; the sibling only its own directory.
    pub async fn spawn_sibling(&self) -> TestApp {
        let dir = tempfile::tempdir().expect("a temporary directory can be created");
        let config_path = dir.path().join("stockd.toml");
        std::fs::copy(&self.config_path, &config_path).expect("the config file can be copied");
        self.sibling(dir, config_path, self.opts.clone()).await
    }

    /// Another server process on the same database, like `spawn_sibling`, but configured by
    /// `opts` alone instead of this process's config (e.g. one process with `[redis]` and one
    /// without, as during a rolling change of configuration).
    pub async fn spawn_sibling_with(&self, opts: AppOptions) -> TestApp {
        let dir = tempfile::tempdir().expect("a temporary directory can be created");
        let config_path = dir.path().join("stockd.toml");
        let config = format!(
            "# Written by tests/api/helpers.rs for a sibling; database and admin token come from env.\n{}",
            opts.extra_toml
        );
        std::fs::write(&config_path, config).expect("the config file can be written");
        self.sibling(dir, config_path, opts).await
    }

    /// Starts a process on this one's database and admin token with the config at `config_path`.
    async fn sibling(&self, dir: TempDir, config_path: PathBuf, opts: AppOptions) -> TestApp {
        let mut sibling = TestApp {
            addr: String::new(),
            ip: own_loopback_ip(),
            admin_token: self.admin_token.clone(),
            client: http_client(),
            base_url: Arc::new(RwLock::new(String::new())),
            child: None,
            logs: Arc::new(Mutex::new(String::new())),
            opts,
            database_url: self.database_url.clone(),
            config_path,
            _database: None,
            dir,
        };
        sibling.start().await;
        sibling
    }

    /// Creates a tenant through the admin API and returns a client holding its API key.
    pub async fn create_tenant(&self, id: &str) -> TenantClient {
        let reply = self.admin_post("/v1/admin/tenants", &json!({"id": id, "name": format!("Tenant {id}")})).await;
        let body = reply.expect_json(201);
        let api_key = body["api_key"].as_str().expect("api_key is a string");
        self.tenant_with_key(id, api_key)
    }

    /// A client for a tenant whose key the test already knows (config-declared, second key).
    pub fn tenant_with_key(&self, id: &str, api_key: &str) -> TenantClient {
        TenantClient {
            id: id.to_owned(),
            api_key: api_key.to_owned(),
            client: self.client.clone(),
            base_url: self.base_url.clone(),
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
    }
}

/// Reads one of the child's pipes line by line until it closes, keeping a bounded copy, and
/// reports the listening address once (stdout only). Never stops early, so the pipe never fills.
async fn drain(
    pipe: impl AsyncRead + Unpin,
    name: &'static str,
    logs: Arc<Mutex<String>>,
    mut addr_tx: Option<oneshot::Sender<String>>,
) {
    let mut lines = BufReader::new(pipe).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(start) = line.find(LISTENING_PREFIX) {
            let rest = &line[start + LISTENING_PREFIX.len()..];
            let addr = rest.split_whitespace().next().unwrap_or_default().trim_end_matches('/');
            if let Some(tx) = addr_tx.take() {
                let _ = tx.send(addr.to_owned());
            }
        }
        if let Ok(mut logs) = logs.lock() {
            if logs.len() < LOG_CAPTURE_MAX_BYTES {
                logs.push_str(&format!("[{name}] {line}\n"));
            }
        }
    }
}

/// One HTTP response, read completely, so tests can look at it as often as they like.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub text: String,
}

impl Reply {
    pub fn status(&self) -> u16 {
        self.status.as_u16()
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text))
    }

    /// Asserts the status code and returns the JSON body.
    #[track_caller]
    pub fn expect_json(&self, status: u16) -> Value {
        assert_eq!(self.status(), status, "unexpected status; body: {}", self.text);
        self.json()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn content_type(&self) -> &str {
        self.header(CONTENT_TYPE.as_str()).unwrap_or("")
    }

    /// Whether the server said this answer is a replay of a stored outcome.
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed").is_some_and(|v| v.eq_ignore_ascii_case("true"))
    }
}

/// Parses an HTTP/1.1 response read off a raw socket (content-length or chunked body).
fn parse_raw_response(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw);
    let (head, body) =
        text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no complete HTTP response head in {text:?}"));
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let code: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let mut headers = HeaderMap::new();
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            headers.append(
                HeaderName::from_bytes(name.trim().as_bytes()).expect("server sends valid header names"),
                HeaderValue::from_str(value.trim()).expect("server sends valid header values"),
            );
        }
    }
    let chunked = headers
        .get("transfer-encoding")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let text = if chunked { decode_chunked(body) } else { body.to_owned() };
    Reply { status: StatusCode::from_u16(code).expect("server sends valid status codes"), headers, text }
}

fn decode_chunked(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size_line, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
            .unwrap_or_else(|_| panic!("bad chunk size line {size_line:?}"));
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// Sends a request and reads the whole response; a transport error fails the test.
pub async fn send(request: RequestBuilder) -> Reply {
    try_send(request).await.unwrap_or_else(|e| panic!("request failed at the transport level: {e:?}"))
}

/// Sends a request and reads the whole response; transport errors are returned (crash tests).
pub async fn try_send(request: RequestBuilder) -> Result<Reply, reqwest::Error> {
    let response = request.send().await?;
    let status = response.status();
    let headers = response.headers().clone();
    let text = response.text().await?;
    Ok(Reply { status, headers, text })
}

/// Asserts `reply` is an RFC 7807 problem document with this status and stable `code`, and
/// leaks nothing internal. Returns the document.
#[track_caller]
pub fn assert_problem(reply: &Reply, status: u16, code: &str) -> Value {
    let body = assert_problem_status(reply, status);
    assert_eq!(body["code"], code, "unexpected problem code; body: {}", reply.text);
    body
}

/// Like `assert_problem` for answers whose `code` the contract does not fix (e.g. 405).
#[track_caller]
pub fn assert_problem_status(reply: &Reply, status: u16) -> Value {
    assert_eq!(reply.status(), status, "unexpected status; body: {}", reply.text);
    assert!(
        reply.content_type().starts_with("application/problem+json"),
        "content-type is {:?}, not application/problem+json; body: {}",
        reply.content_type(),
        reply.text
    );
    assert_no_leak(reply);
    let body = reply.json();
    assert_eq!(body["status"], status, "problem `status` field; body: {}", reply.text);
    assert!(body["code"].is_string(), "problem has a string `code`: {}", reply.text);
    assert!(body["type"].is_string(), "problem has a string `type`: {}", reply.text);
    assert!(body["title"].is_string(), "problem has a string `title`: {}", reply.text);
    body
}

/// Asserts a client error (4xx, never 5xx) answered as problem+json; returns the document.
#[track_caller]
pub fn assert_client_problem(reply: &Reply) -> Value {
    assert!(reply.status.is_client_error(), "expected a 4xx, got {}; body: {}", reply.status, reply.text);
    assert_problem_status(reply, reply.status())
}

/// No SQL, storage engine names or panic messages in a body.
#[track_caller]
pub fn assert_no_leak(reply: &Reply) {
    let lower = reply.text.to_ascii_lowercase();
    for needle in ["SELECT", "INSERT"] {
        assert!(!reply.text.contains(needle), "body leaks {needle:?}: {}", reply.text);
    }
    for needle in ["sqlite", "panicked", "postgres", "mysql", "mariadb"] {
        assert!(!lower.contains(needle), "body leaks {needle:?}: {}", reply.text);
    }
}

/// The four counters of a resource state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub available: i64,
    pub reserved: i64,
    pub consumed: i64,
    pub total: i64,
}

impl Counts {
    pub fn new(available: i64, reserved: i64, consumed: i64, total: i64) -> Counts {
        Counts { available, reserved, consumed, total }
    }

    /// The counters of a resource state document.
    pub fn of(state: &Value) -> Counts {
        let field =
            |name: &str| state[name].as_i64().unwrap_or_else(|| panic!("state field {name} is an integer: {state}"));
        Counts::new(field("available"), field("reserved"), field("consumed"), field("total"))
    }

    /// The `*_after` counters of a ledger entry (total follows from the invariant).
    fn after(entry: &Value) -> (i64, i64, i64) {
        let field =
            |name: &str| entry[name].as_i64().unwrap_or_else(|| panic!("ledger field {name} is an integer: {entry}"));
        (field("available_after"), field("reserved_after"), field("consumed_after"))
    }

    #[track_caller]
    fn assert_invariant(&self) {
        assert!(self.available >= 0 && self.reserved >= 0 && self.consumed >= 0, "{self:?}");
        assert_eq!(self.available + self.reserved + self.consumed, self.total, "{self:?}");
    }
}

/// Replays ledger entries from the first one with the contract's op semantics, checking every
/// entry's `*_after` values and the invariant along the way, and returns the resulting counts.
#[track_caller]
pub fn replay_ledger(entries: &[Value]) -> Counts {
    assert!(!entries.is_empty(), "a resource's ledger starts with its `create` entry");
    assert_eq!(entries[0]["op"], "create", "first entry is `create`: {}", entries[0]);
    let mut counts = Counts::new(0, 0, 0, 0);
    let mut last_seq: Option<i64> = None;
    for entry in entries {
        let seq = entry["seq"].as_i64().unwrap_or_else(|| panic!("seq is an integer: {entry}"));
        if let Some(last) = last_seq {
            assert!(seq > last, "ledger seqs increase: {last} then {seq}");
        }
        last_seq = Some(seq);
        let qty = entry["qty"].as_i64().unwrap_or_else(|| panic!("qty is an integer: {entry}"));
        let op = entry["op"].as_str().unwrap_or_else(|| panic!("op is a string: {entry}"));
        if op != "adjust" {
            assert!(qty > 0 || (op == "create" && qty == 0), "{op} qty is positive: {entry}");
        }
        match op {
            "create" => {
                assert_eq!(counts, Counts::new(0, 0, 0, 0), "`create` comes only first");
                counts.available = qty;
                counts.total = qty;
            }
            "adjust" => {
                counts.available += qty;
                counts.total += qty;
            }
            "deduct" => {
                counts.available -= qty;
                counts.consumed += qty;
            }
            "reserve" => {
                counts.available -= qty;
                counts.reserved += qty;
            }
            "confirm" => {
                counts.reserved -= qty;
                counts.consumed += qty;
            }
            "release" | "expire" => {
                counts.reserved -= qty;
                counts.available += qty;
            }
            "reverse" => {
                counts.consumed -= qty;
                counts.available += qty;
            }
            other => panic!("unknown ledger op {other:?}: {entry}"),
        }
        counts.assert_invariant();
        assert_eq!(
            Counts::after(entry),
            (counts.available, counts.reserved, counts.consumed),
            "entry's *_after values differ from the replay so far: {entry}"
        );
    }
    counts
}

/// The ops of ledger entries, in order.
pub fn ops(entries: &[Value]) -> Vec<String> {
    entries.iter().map(|e| e["op"].as_str().unwrap_or_default().to_owned()).collect()
}

/// The entries with this op.
pub fn entries_with_op<'a>(entries: &'a [Value], op: &str) -> Vec<&'a Value> {
    entries.iter().filter(|e| e["op"] == op).collect()
}

/// Asserts a state document's four counters.
#[track_caller]
pub fn assert_counts(state: &Value, available: i64, reserved: i64, consumed: i64, total: i64) {
    assert_eq!(Counts::of(state), Counts::new(available, reserved, consumed, total), "state: {state}");
}

/// `{"order_id", "action": "deduct", "lines": [...]}`.
pub fn deduct(order_id: &str, lines: &[(&str, i64)]) -> Value {
    json!({"order_id": order_id, "action": "deduct", "lines": order_lines(lines)})
}

/// `{"order_id", "action": "reserve", "ttl_seconds"?, "lines": [...]}`.
pub fn reserve(order_id: &str, lines: &[(&str, i64)], ttl_seconds: Option<u64>) -> Value {
    let mut body = json!({"order_id": order_id, "action": "reserve", "lines": order_lines(lines)});
    if let Some(ttl) = ttl_seconds {
        body["ttl_seconds"] = json!(ttl);
    }
    body
}

fn order_lines(lines: &[(&str, i64)]) -> Vec<Value> {
    lines.iter().map(|(key, qty)| json!({"key": key, "qty": qty})).collect()
}

/// A client acting as one tenant (bearer = that tenant's API key). Follows its `TestApp`
/// across restarts.
#[derive(Clone)]
pub struct TenantClient {
    pub id: String,
    pub api_key: String,
    client: reqwest::Client,
    base_url: Arc<RwLock<String>>,
}

impl TenantClient {
    pub fn url(&self, path: &str) -> String {
        let base = self.base_url.read().expect("lock is never poisoned: no code panics holding it");
        format!("{base}{path}")
    }

    /// The same tenant with another API key (or a wrong one).
    pub fn with_api_key(&self, api_key: &str) -> TenantClient {
        TenantClient { api_key: api_key.to_owned(), ..self.clone() }
    }

    /// A request with this tenant's bearer token, for tests that need raw bodies or headers.
    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.client.request(method, self.url(path)).bearer_auth(&self.api_key)
    }

    pub async fn get(&self, path: &str) -> Reply {
        send(self.request(Method::GET, path)).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Reply {
        send(self.request(Method::POST, path).json(body)).await
    }

    pub async fn post_with_key(&self, path: &str, idempotency_key: &str, body: &Value) -> Reply {
        send(self.keyed(path, idempotency_key, body)).await
    }

    /// The request `post_with_key` sends, unsent (for concurrent and crash tests).
    pub fn keyed(&self, path: &str, idempotency_key: &str, body: &Value) -> RequestBuilder {
        self.request(Method::POST, path).header("Idempotency-Key", idempotency_key).json(body)
    }

    pub async fn patch(&self, path: &str, body: &Value) -> Reply {
        send(self.request(Method::PATCH, path).json(body)).await
    }

    /// POST without a body (reservation confirm/release).
    pub async fn post_empty(&self, path: &str) -> Reply {
        send(self.request(Method::POST, path)).await
    }

    /// POSTs `body` over a plain TCP connection, reading the answer while the body is still
    /// being written. A server may answer (e.g. 413) and close before a large body is fully
    /// sent; an ordinary client then reports a broken pipe instead of the answer.
    pub async fn post_over_raw_tcp(&self, path: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Reply {
        self.send_over_raw_tcp("POST", path, headers, body).await
    }

    /// Creates an `inventory` resource and asserts the 201.
    pub async fn create_resource(&self, key: &str, total: i64) -> Value {
        self.create_resource_of_kind(key, "inventory", total).await
    }

    pub async fn create_resource_of_kind(&self, key: &str, kind: &str, total: i64) -> Value {
        self.post("/v1/resources", &json!({"key": key, "kind": kind, "total": total})).await.expect_json(201)
    }

    /// The resource's state; asserts 200.
    pub async fn state(&self, key: &str) -> Value {
        self.get(&format!("/v1/resources/{key}")).await.expect_json(200)
    }

    pub async fn order(&self, idempotency_key: &str, body: &Value) -> Reply {
        self.post_with_key("/v1/orders", idempotency_key, body).await
    }

    pub async fn adjust(&self, key: &str, idempotency_key: &str, delta: i64) -> Reply {
        self.post_with_key(
            &format!("/v1/resources/{key}/adjustments"),
            idempotency_key,
            &json!({"delta": delta, "reason": "test"}),
        )
        .await
    }

    pub async fn reservation(&self, id: &str) -> Reply {
        self.get(&format!("/v1/reservations/{id}")).await
    }

    pub async fn confirm(&self, id: &str) -> Reply {
        self.post_empty(&format!("/v1/reservations/{id}/confirm")).await
    }

    pub async fn release(&self, id: &str) -> Reply {
        self.post_empty(&format!("/v1/reservations/{id}/release")).await
    }

    /// Every ledger entry of a resource, walking all pages.
    pub async fn ledger(&self, key: &str) -> Vec<Value> {
        let mut entries = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..LEDGER_MAX_PAGES {
            let path = match &after {
                None => format!("/v1/resources/{key}/ledger?limit={LEDGER_PAGE_LIMIT}"),
                Some(seq) => {
                    format!("/v1/resources/{key}/ledger?after={seq}&limit={LEDGER_PAGE_LIMIT}")
                }
            };
            let page = self.get(&path).await.expect_json(200);
            let items = page["items"].as_array().unwrap_or_else(|| panic!("ledger page has items: {page}"));
            entries.extend(items.iter().cloned());
            match &page["next_after"] {
                Value::Null => return entries,
                Value::String(seq) => after = Some(seq.clone()),
                other => panic!("next_after is a string or null, got {other}"),
            }
        }
        panic!("ledger of {key} has more than {LEDGER_MAX_PAGES} pages");
    }

    /// Replays the resource's whole ledger and asserts it gives exactly the current state and
    /// that `version` equals the number of entries. Returns the entries.
    pub async fn assert_ledger_replays_to_state(&self, key: &str) -> Vec<Value> {
        let state = self.state(key).await;
        let entries = self.ledger(key).await;
        let replayed = replay_ledger(&entries);
        assert_eq!(replayed, Counts::of(&state), "tenant {}: ledger replay != state {state}", self.id);
        assert_eq!(
            state["version"].as_u64(),
            Some(entries.len() as u64),
            "version == number of ledger entries; state {state}"
        );
        entries
    }

    /// Asserts `GET /v1/reconciliation` checked exactly `checked` resources and found no drift.
    pub async fn assert_reconciliation_clean(&self, checked: u64) {
        let report = self.get("/v1/reconciliation").await.expect_json(200);
        assert_eq!(report["checked"], checked, "reconciliation report: {report}");
        assert_eq!(report["drift"], json!([]), "reconciliation report: {report}");
    }
}

/// The bytes of the component `plugins/dist/<name>.wasm` (`default`, `flash-sale`, ...,
/// `hostile-loop`, ...), built by [`plugin_dist`].
pub fn plugin_wasm(name: &str) -> Vec<u8> {
    let path = plugin_dist().join(format!("{name}.wasm"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The folder `plugins/dist`. The first call in a test process runs `plugins/build.sh`, which
/// builds every example plugin and hostile fixture into it; a failed build fails every test
/// that needs one.
pub fn plugin_dist() -> &'static Path {
    static DIST: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    match DIST.get_or_init(build_plugins) {
        Ok(dist) => dist,
        Err(e) => panic!("{e}"),
    }
}

fn build_plugins() -> Result<PathBuf, String> {
    let output = std::process::Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/plugins/build.sh"))
        .output()
        .map_err(|e| format!("cannot run plugins/build.sh: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "plugins/build.sh failed ({}); it needs cargo and the wasm32-wasip2 target:\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(Path::new(env!("CARGO_MANIFEST_DIR")).join("plugins").join("dist"))
}

/// The bytes of the JavaScript or Python component `plugins/dist/<name>.wasm`
/// (`js-flash-sale`, `js-marketplace`, `js-hostile`, `python-flash-sale`). The first call in
/// a test process runs `plugins/build-components.sh` (it needs node, npm and python3, and
/// rebuilds only what changed); a failed build fails every test that needs one.
pub fn component_wasm(name: &str) -> Vec<u8> {
    static BUILT: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    let dist = match BUILT.get_or_init(build_components) {
        Ok(dist) => dist,
        Err(e) => panic!("{e}"),
    };
    let path = dist.join(format!("{name}.wasm"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn build_components() -> Result<PathBuf, String> {
    let output = std::process::Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/plugins/build-components.sh"))
        .output()
        .map_err(|e| format!("cannot run plugins/build-components.sh: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "plugins/build-components.sh failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(Path::new(env!("CARGO_MANIFEST_DIR")).join("plugins").join("dist"))
}

impl TenantClient {
    /// `PUT /v1/plugin` with a component as `application/wasm` and no configuration.
    pub async fn put_plugin(&self, wasm: Vec<u8>) -> Reply {
        self.put_plugin_with(wasm, Some("application/wasm"), None).await
    }

    /// `PUT /v1/plugin?config=<text, url-encoded>` with a component as `application/wasm`.
    pub async fn put_plugin_config(&self, wasm: Vec<u8>, config: &str) -> Reply {
        self.put_plugin_with(wasm, Some("application/wasm"), Some(config)).await
    }

    /// `PUT /v1/plugin` with any (or no) content type and optional configuration text.
    pub async fn put_plugin_with(&self, body: Vec<u8>, content_type: Option<&str>, config: Option<&str>) -> Reply {
        let mut request = self.request(Method::PUT, "/v1/plugin").body(body);
        if let Some(content_type) = content_type {
            request = request.header(CONTENT_TYPE, content_type);
        }
        if let Some(config) = config {
            request = request.query(&[("config", config)]);
        }
        send(request).await
    }

    /// `POST /v1/plugin/versions/{version}/activate`.
    pub async fn activate_plugin(&self, version: i64) -> Reply {
        self.post_empty(&format!("/v1/plugin/versions/{version}/activate")).await
    }

    /// Like `post_over_raw_tcp`, for any method (e.g. an oversized `PUT /v1/plugin`). Unlike it,
    /// the write half stays open until the answer has been read: a client that half-closes after
    /// its body may see the server drop the connection unanswered (hyper treats the EOF as the
    /// client going away), which is not what these tests are about.
    pub async fn send_over_raw_tcp(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Reply {
        let base = self.url("");
        let authority = base.trim_start_matches("http://").to_owned();
        let stream = tokio::net::TcpStream::connect(&authority).await.expect("the server accepts connections");
        let (mut reader, mut writer) = stream.into_split();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.api_key,
            body.len()
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        // Returns the write half instead of dropping it: dropping it would send FIN.
        let writing = tokio::spawn(async move {
            if writer.write_all(head.as_bytes()).await.is_ok() {
                for chunk in body.chunks(RAW_CHUNK_BYTES) {
                    // The server may stop reading once it has answered.
                    if writer.write_all(chunk).await.is_err() {
                        break;
                    }
                }
            }
            writer
        });
        let mut raw = Vec::new();
        let reading = async {
            let mut buf = vec![0u8; RAW_CHUNK_BYTES];
            while let Ok(n) = reader.read(&mut buf).await {
                if n == 0 || raw.len() > RAW_RESPONSE_MAX_BYTES {
                    break;
                }
                raw.extend_from_slice(&buf[..n]);
            }
        };
        tokio::time::timeout(REQUEST_TIMEOUT, reading).await.expect("the server answers and closes the connection");
        writing.abort();
        parse_raw_response(&raw)
    }
}

impl TestApp {
    /// The database URL this test's server runs on, for the rare test that must tamper with
    /// storage behind the server's back (e.g. to prove reconciliation notices it).
    pub fn database_url(&self) -> &str {
        &self.database_url
    }
}

/// Runs statements directly on the test's database, behind the server's back.
///
/// The statements are plain standard SQL that SQLite, PostgreSQL and MySQL all read the same:
/// an identifier that is a reserved word in MySQL (`key`, `lines`) is written in double quotes
/// (`"key"`), which the MySQL connection reads as an identifier (see [`mysql_connect_ansi`]).
pub async fn tamper(database_url: &str, statements: &[&str]) {
    use sqlx::Connection;
    match Backend::from_env() {
        Backend::Sqlite => {
            let conn = sqlx::SqliteConnection::connect(database_url).await.expect("the test database opens");
            execute_all(conn, statements).await;
        }
        Backend::Postgres => {
            let conn = sqlx::PgConnection::connect(database_url).await.expect("the test database opens");
            execute_all(conn, statements).await;
        }
        Backend::Mysql => execute_all(mysql_connect_ansi(database_url).await, statements).await,
    }
}

/// Executes each statement on `conn` as plain SQL (not prepared: MySQL prepares no
/// `CREATE TRIGGER`), failing the test on the first error, then closes it.
async fn execute_all<C>(mut conn: C, statements: &[&str])
where
    C: sqlx::Connection,
    for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
{
    for sql in statements {
        sqlx::raw_sql(sql).execute(&mut conn).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let _ = conn.close().await;
}

/// A connection to a test's MySQL database for SQL written by the tests: with `ANSI_QUOTES`
/// added to the session's `sql_mode`, `"key"` is an identifier (as in SQLite and PostgreSQL),
/// not a string. (sqlx already adds `PIPES_AS_CONCAT`, so `||` concatenates.)
pub async fn mysql_connect_ansi(database_url: &str) -> sqlx::MySqlConnection {
    use sqlx::Connection;
    let mut conn = sqlx::MySqlConnection::connect(database_url).await.expect("the test database opens");
    sqlx::query("SET SESSION sql_mode = CONCAT(@@sql_mode, ',ANSI_QUOTES')")
        .execute(&mut conn)
        .await
        .expect("ANSI_QUOTES is a valid sql_mode");
    conn
}

/// The sum of the samples of `name` whose labels include every one of `labels` (`k="v"`).
pub async fn metric(app: &TestApp, name: &str, labels: &[&str]) -> f64 {
    let text = app.get_anonymous("/metrics").await.text;
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let (series, value) = rest.rsplit_once(' ')?;
            let matches = (series.is_empty() || series.starts_with('{')) && labels.iter().all(|l| series.contains(l));
            matches.then(|| value.trim().parse::<f64>().ok()).flatten()
        })
        .sum()
}
