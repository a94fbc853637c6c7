//! The `stockd` child process and an HTTP client for it: a small copy of what
//! `tests/api/helpers.rs` does (that file belongs to another test binary), trimmed to what the
//! fault tests use.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::header::{HeaderMap, CONTENT_TYPE, RETRY_AFTER};
use reqwest::{Method, RequestBuilder, StatusCode};
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

/// How long the server may take to print `listening on http://ADDR`.
const STARTUP_DEADLINE: Duration = Duration::from_secs(30);
/// Upper bound for one HTTP exchange, so a hung server fails the test instead of hanging it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How much of the server's stdout/stderr we keep for failure messages.
const LOG_CAPTURE_MAX_BYTES: usize = 256 * 1024;
/// Page size and page bound used when walking a whole ledger.
const LEDGER_PAGE_LIMIT: usize = 1_000;
const LEDGER_MAX_PAGES: usize = 10_000;
/// The line the server prints on stdout once it accepts connections.
const LISTENING_PREFIX: &str = "listening on http://";

/// A running `stockd serve` with its own directory and config file; killed on drop.
pub struct Stockd {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    child: Child,
    logs: Arc<Mutex<String>>,
    _dir: TempDir,
}

impl Stockd {
    /// Starts `stockd serve --config <file>` (the file holds `config_toml`) on `database_url`.
    pub async fn start(database_url: &str, admin_token: &str, config_toml: &str) -> Stockd {
        let dir = tempfile::tempdir().expect("a temporary directory can be created");
        let config_path = dir.path().join("stockd.toml");
        std::fs::write(&config_path, format!("# Written by tests/faults/harness.rs.\n{config_toml}\n"))
            .expect("the config file can be written");
        let mut child = Command::new(env!("CARGO_BIN_EXE_stockd"))
            .arg("serve")
            .arg("--config")
            .arg(&config_path)
            .current_dir(dir.path())
            .env("STOCKD_LISTEN", "127.0.0.1:0")
            .env("STOCKD_DATABASE_URL", database_url)
            .env("STOCKD_ADMIN_TOKEN", admin_token)
            .env("RUST_LOG", "warn")
            .env_remove("STOCKD_REDIS_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the stockd binary can be started");

        let logs = Arc::new(Mutex::new(String::new()));
        let (addr_tx, addr_rx) = oneshot::channel();
        tokio::spawn(drain(child.stdout.take().expect("stdout is piped"), "stdout", logs.clone(), Some(addr_tx)));
        tokio::spawn(drain(child.stderr.take().expect("stderr is piped"), "stderr", logs.clone(), None));
        let addr = match tokio::time::timeout(STARTUP_DEADLINE, addr_rx).await {
            Ok(Ok(addr)) => addr,
            outcome => {
                let _ = child.start_kill();
                // Give the stderr drain a moment to collect the reason.
                tokio::time::sleep(Duration::from_millis(200)).await;
                let logs = logs.lock().map(|l| l.clone()).unwrap_or_default();
                panic!("stockd printed no `{LISTENING_PREFIX}ADDR` line ({outcome:?}); output:\n{logs}");
            }
        };
        Stockd { addr, child, logs, _dir: dir }
    }

    /// Everything the server printed so far (bounded), for failure messages.
    pub fn logs(&self) -> String {
        self.logs.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Whether the process is still running (it must never need a restart here).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// A client with this bearer token (a tenant key or the admin token).
    pub fn client(&self, bearer: &str) -> Api {
        Api { http: http_client(), base: format!("http://{}", self.addr), bearer: bearer.to_owned() }
    }
}

/// Reads a pipe of the child until it closes, keeping a bounded copy; reports the listening
/// address once (stdout only). Never stops early, so the pipe never fills.
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

/// A reqwest client that never goes through a proxy and never hangs forever.
fn http_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().timeout(REQUEST_TIMEOUT).build().expect("a plain HTTP client always builds")
}

/// 32 random hex characters (128 bits).
pub fn random_hex_32() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// One HTTP response, read completely.
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

    #[track_caller]
    pub fn expect_json(&self, status: u16) -> Value {
        assert_eq!(self.status(), status, "unexpected status; body: {}", self.text);
        self.json()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed").is_some_and(|v| v.eq_ignore_ascii_case("true"))
    }

    /// The problem `code` of a problem+json body, if it is one.
    pub fn problem_code(&self) -> Option<String> {
        let problem = self.header(CONTENT_TYPE.as_str()).is_some_and(|ct| ct.starts_with("application/problem+json"));
        let body: Value = serde_json::from_str(&self.text).ok()?;
        problem.then(|| body["code"].as_str().map(str::to_owned)).flatten()
    }

    /// `Retry-After` in seconds, if present and a number.
    pub fn retry_after_seconds(&self) -> Option<u64> {
        self.header(RETRY_AFTER.as_str()).and_then(|v| v.trim().parse().ok())
    }

    /// Why this is not the contract's `503 unavailable` (problem+json, `code: "unavailable"`,
    /// a `Retry-After`, nothing internal leaked); `None` if it is.
    pub fn unavailable_violation(&self) -> Option<String> {
        let lower = self.text.to_ascii_lowercase();
        let why = if self.status() != 503 {
            "status is not 503"
        } else if self.problem_code().as_deref() != Some("unavailable") {
            "not a problem+json document with code \"unavailable\""
        } else if self.json()["status"] != 503 {
            "problem `status` field is not 503"
        } else if self.retry_after_seconds().is_none() {
            "no numeric Retry-After header"
        } else if ["select", "insert", "postgres", "mysql", "mariadb", "sqlx", "panicked"]
            .iter()
            .any(|n| lower.contains(n))
        {
            "body leaks internals"
        } else {
            return None;
        };
        Some(format!("{why}: {} {:?} {}", self.status, self.headers, self.text))
    }
}

/// Sends a request and reads the whole response; transport errors are returned.
pub async fn try_send(request: RequestBuilder) -> Result<Reply, reqwest::Error> {
    let response = request.send().await?;
    let status = response.status();
    let headers = response.headers().clone();
    let text = response.text().await?;
    Ok(Reply { status, headers, text })
}

/// Sends a request and reads the whole response; a transport error fails the test.
pub async fn send(request: RequestBuilder) -> Reply {
    try_send(request).await.unwrap_or_else(|e| panic!("request failed at the transport level: {e:?}"))
}

/// A client of one `stockd` process with one bearer token.
#[derive(Clone)]
pub struct Api {
    http: reqwest::Client,
    base: String,
    bearer: String,
}

impl Api {
    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.http.request(method, format!("{}{path}", self.base)).bearer_auth(&self.bearer)
    }

    /// `POST path` with an `Idempotency-Key` and a JSON body, unsent.
    pub fn keyed(&self, path: &str, idempotency_key: &str, body: &Value) -> RequestBuilder {
        self.request(Method::POST, path).header("Idempotency-Key", idempotency_key).json(body)
    }

    pub async fn get(&self, path: &str) -> Reply {
        send(self.request(Method::GET, path)).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Reply {
        send(self.request(Method::POST, path).json(body)).await
    }

    /// Creates a tenant (this client must hold the admin token); returns its API key.
    pub async fn create_tenant(&self, id: &str) -> String {
        let body = self.post("/v1/admin/tenants", &json!({"id": id, "name": id})).await.expect_json(201);
        body["api_key"].as_str().expect("api_key is a string").to_owned()
    }

    pub async fn create_resource(&self, key: &str, total: i64) {
        self.post("/v1/resources", &json!({"key": key, "kind": "inventory", "total": total})).await.expect_json(201);
    }

    pub async fn state(&self, key: &str) -> Value {
        self.get(&format!("/v1/resources/{key}")).await.expect_json(200)
    }

    pub fn order(&self, idempotency_key: &str, body: &Value) -> RequestBuilder {
        self.keyed("/v1/orders", idempotency_key, body)
    }

    pub fn adjust(&self, key: &str, idempotency_key: &str, delta: i64) -> RequestBuilder {
        self.keyed(
            &format!("/v1/resources/{key}/adjustments"),
            idempotency_key,
            &json!({"delta": delta, "reason": "fault-test"}),
        )
    }

    pub fn confirm(&self, reservation_id: &str) -> RequestBuilder {
        self.request(Method::POST, &format!("/v1/reservations/{reservation_id}/confirm"))
    }

    /// `GET /readyz` (no credentials needed, sending them does no harm).
    pub async fn readyz(&self) -> Result<Reply, reqwest::Error> {
        try_send(self.request(Method::GET, "/readyz")).await
    }

    /// Every ledger entry of a resource, walking all pages.
    pub async fn ledger(&self, key: &str) -> Vec<Value> {
        let mut entries = Vec::new();
        let mut after = String::new();
        for _ in 0..LEDGER_MAX_PAGES {
            let cursor = if after.is_empty() { String::new() } else { format!("&after={after}") };
            let page = self.get(&format!("/v1/resources/{key}/ledger?limit={LEDGER_PAGE_LIMIT}{cursor}")).await;
            let page = page.expect_json(200);
            entries.extend(page["items"].as_array().unwrap_or_else(|| panic!("ledger page has items: {page}")).clone());
            match &page["next_after"] {
                Value::Null => return entries,
                Value::String(seq) => after = seq.clone(),
                other => panic!("next_after is a string or null, got {other}"),
            }
        }
        panic!("ledger of {key} has more than {LEDGER_MAX_PAGES} pages");
    }

    /// Replays the resource's ledger with the contract's op semantics and asserts it gives the
    /// current state, that every entry's `*_after` values match the replay so far, and that
    /// `version` equals the number of entries. Returns the entries.
    pub async fn assert_ledger_replays_to_state(&self, key: &str) -> Vec<Value> {
        let state = self.state(key).await;
        let entries = self.ledger(key).await;
        let mut counts = HashMap::from([("available", 0i64), ("reserved", 0), ("consumed", 0)]);
        let mut total = 0i64;
        for (i, entry) in entries.iter().enumerate() {
            let qty = entry["qty"].as_i64().unwrap_or_else(|| panic!("qty is an integer: {entry}"));
            let (from, to, by) = match entry["op"].as_str().unwrap_or_default() {
                "create" if i == 0 => (None, Some("available"), qty),
                "adjust" => (None, Some("available"), qty),
                "deduct" => (Some("available"), Some("consumed"), qty),
                "reserve" => (Some("available"), Some("reserved"), qty),
                "confirm" => (Some("reserved"), Some("consumed"), qty),
                "release" | "expire" => (Some("reserved"), Some("available"), qty),
                "reverse" => (Some("consumed"), Some("available"), qty),
                other => panic!("{key}: unexpected ledger op {other:?} at position {i}: {entry}"),
            };
            if from.is_none() {
                total += by;
            }
            for (field, delta) in [(from, -by), (to, by)] {
                if let Some(field) = field {
                    *counts.get_mut(field).expect("known counter") += delta;
                }
            }
            for field in ["available", "reserved", "consumed"] {
                assert!(counts[field] >= 0, "{key}: {field} < 0 after entry {entry}");
                assert_eq!(
                    entry[format!("{field}_after")].as_i64(),
                    Some(counts[field]),
                    "{key}: {field}_after differs from the replay so far: {entry}"
                );
            }
        }
        for field in ["available", "reserved", "consumed"] {
            assert_eq!(state[field].as_i64(), Some(counts[field]), "{key}: ledger replay != state {state}");
        }
        assert_eq!(state["total"].as_i64(), Some(total), "{key}: total != create + adjustments; state {state}");
        assert_eq!(state["version"].as_u64(), Some(entries.len() as u64), "{key}: version != ledger length");
        entries
    }

    /// Asserts `GET /v1/reconciliation` checked `checked` resources and found no drift.
    pub async fn assert_reconciliation_clean(&self, checked: u64) {
        let report = self.get("/v1/reconciliation").await.expect_json(200);
        assert_eq!(report["checked"], checked, "reconciliation report: {report}");
        assert_eq!(report["drift"], json!([]), "reconciliation report: {report}");
    }
}

/// The `order_id`s of a ledger's entries with this op.
pub fn order_ids_with_op(entries: &[Value], op: &str) -> Vec<String> {
    entries
        .iter()
        .filter(|e| e["op"] == op)
        .map(|e| e["order_id"].as_str().unwrap_or_else(|| panic!("{op} entry names its order: {e}")).to_owned())
        .collect()
}
