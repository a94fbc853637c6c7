//! `flash-sale-builtin`, `flash-sale-rust`, `flash-sale-js`, `flash-sale-python`: what a
//! tenant's planning plugin costs per order, by language. The same flash sale each time, for a
//! tenant of its own: one SKU of [`load::TOTAL`] units, every order one piece for a user never
//! seen before (so the plugin's one-per-user limit always lets it through), planned by the
//! built-in default (no plugin) or by the flash-sale example built from Rust, JavaScript or
//! Python (`plugins/dist/flash-sale.wasm`, `js-flash-sale.wasm`, `python-flash-sale.wasm`,
//! uploaded with the matching `?runtime=`).
//!
//! The upload, and so the compile (or the mapping of a stored artifact), happens before the
//! measured window, followed by [`WARM_UP`] of unmeasured orders that fill the plugin's instance
//! pool. The invariant check is the HTTP scenarios' (consumed == acknowledged successes, no
//! drift).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::load::{self, Limit, Target};
use super::server::Server;
use super::Stats;

/// Unmeasured orders' time before each measured window.
pub const WARM_UP: Duration = Duration::from_secs(2);
/// How long an upload (a JavaScript or Python compile the first time) may take.
const UPLOAD_DEADLINE: Duration = Duration::from_secs(600);
/// The SKU's key.
const SKU: &str = "flash:sku";

/// Which planner a scenario's tenant uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Planner {
    Builtin,
    Rust,
    Js,
    Python,
}

impl Planner {
    pub fn parse(name: &str) -> Option<Planner> {
        Some(match name {
            "flash-sale-builtin" => Planner::Builtin,
            "flash-sale-rust" => Planner::Rust,
            "flash-sale-js" => Planner::Js,
            "flash-sale-python" => Planner::Python,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Planner::Builtin => "flash-sale-builtin",
            Planner::Rust => "flash-sale-rust",
            Planner::Js => "flash-sale-js",
            Planner::Python => "flash-sale-python",
        }
    }

    /// The component file in `--plugins-dir` and its runtime; `None` for the built-in plan.
    fn component(self) -> Option<(&'static str, &'static str)> {
        match self {
            Planner::Builtin => None,
            Planner::Rust => Some(("flash-sale.wasm", "rust")),
            Planner::Js => Some(("js-flash-sale.wasm", "js")),
            Planner::Python => Some(("python-flash-sale.wasm", "python")),
        }
    }

    /// Reads the scenario's component now, so a missing one stops the bench before it starts.
    pub fn read(self, plugins_dir: &Path) -> anyhow::Result<Option<Vec<u8>>> {
        let Some((file, _)) = self.component() else { return Ok(None) };
        let path = plugins_dir.join(file);
        std::fs::read(&path).map(Some).with_context(|| {
            format!(
                "the {} scenario needs {}: build it with `bash plugins/build.sh` (Rust) or \
                 `bash plugins/build-components.sh` (JavaScript, Python), or point --plugins-dir at it",
                self.name(),
                path.display()
            )
        })
    }
}

/// A prepared scenario: its tenant, with the plugin active and the SKU created.
pub struct Prepared {
    pub target: Arc<Target>,
}

/// Creates the scenario's tenant, uploads its plugin (waiting out a `202`) and creates the SKU.
pub async fn prepare(
    client: &reqwest::Client,
    server: &Server,
    planner: Planner,
    wasm: Option<&[u8]>,
) -> anyhow::Result<Prepared> {
    let api_key = load::create_tenant(client, &server.base, &server.admin_token).await?;
    let target = Arc::new(Target { client: client.clone(), base: server.base.clone(), api_key });
    if let (Some(wasm), Some((_, runtime))) = (wasm, planner.component()) {
        upload(&target, wasm, runtime).await.with_context(|| format!("uploading {}'s plugin", planner.name()))?;
    }
    load::create_resource(&target, SKU, None).await?;
    Ok(Prepared { target })
}

async fn upload(t: &Target, wasm: &[u8], runtime: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    let resp = t
        .client
        .put(format!("{}/v1/plugin", t.base))
        .bearer_auth(&t.api_key)
        .query(&[("runtime", runtime), ("config", "buckets=1")])
        .header("Content-Type", "application/wasm")
        .timeout(UPLOAD_DEADLINE)
        .body(wasm.to_vec())
        .send()
        .await?;
    let status = resp.status();
    let location = resp.headers().get("location").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    match (status, location) {
        (StatusCode::CREATED, _) => {}
        (StatusCode::ACCEPTED, Some(location)) => loop {
            let status = load::get_json(t, &location).await?;
            match status["state"].as_str() {
                Some("active") => break,
                Some("compiling") if started.elapsed() < UPLOAD_DEADLINE => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                _ => bail!("the upload ended {status}"),
            }
        },
        (status, _) => bail!("upload answered {status}: {body}"),
    }
    eprintln!("bench: {runtime} plugin active after {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Runs `clients` closed loops of one-piece orders, each for a new user, until `limit`.
pub async fn run(t: &Arc<Target>, clients: usize, limit: Limit) -> anyhow::Result<Stats> {
    // The order id doubles as the user id: every order is a new user's.
    load::run_one_piece_orders(
        t,
        clients,
        limit,
        "fs",
        |id| json!({"order_id": id, "user_id": id, "action": "deduct", "lines": [{"key": SKU, "qty": 1}]}),
    )
    .await
}

/// The scenario's invariants: the SKU consumed exactly the acknowledged orders, no drift.
pub async fn check(t: &Target, stats: &Stats, warm_up: &Stats) -> anyhow::Result<Vec<String>> {
    let (problems, _) = load::check_keys(t, "flash:", 1, stats.consumed_expected + warm_up.consumed_expected).await?;
    Ok(problems)
}
