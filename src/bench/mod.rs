//! `stockd bench`: a closed-loop load generator for stockd.
//!
//! It starts its own server (a child process of this executable on a free port with a fresh
//! database) or targets `--url`, creates a tenant and the scenario's resources, runs each named
//! scenario with N concurrent clients for a fixed time, then checks the invariants over HTTP
//! (no negative state, `available + reserved + consumed == total`, reconciliation without drift,
//! acknowledged successes == consumed) and prints one table (and optionally a JSON file):
//! throughput, p50/p95/p99/max latency, rejections by reason, the server's peak RSS and CPU time
//! per operation and, when it started the server, what each scenario wrote to disk per
//! operation ([`storage`]).
//!
//! `--orders N` replaces the duration by a fixed amount of work, and `--exec-before-load` /
//! `--exec-after-load` run a command around each load, so a profiler attached to the server
//! (`scripts/bench/callgrind.sh`) counts exactly the load.
//!
//! Baselines measured in the same run on the same database: `ceiling` (`GET /healthz` under the
//! same clients), `row-lock`, `guarded-per-request` and `segmented` (see [`baseline`]); each
//! stockd scenario (and `segmented`) is printed with its throughput ratio to the first three.
//! `segmented` splits the stock over 100 rows and refuses an order when its row is empty: the
//! `false SO` column (JSON `false_sold_outs`) counts those refusals made while stock remained.
//! `redis-lua` ([`redis_lua`], needs `STOCKD_REDIS_URL`) is the classic Redis Lua pre-deduction
//! design run the same way: one script per order on the Redis, the order queued on a stream.
//!
//! Against them, stockd's own designs for one hot SKU: `hot-key` (db mode, one row),
//! `hot-key-buckets` (db mode, the resource split over 16 bucket rows) and `redis-hot-key`
//! (redis mode, [`redis_hot`]).
//!
//! `core-hot-key`, `core-uniform` and `core-multi-line` ([`core`]) run the storage core alone:
//! the same orders handed to `Storage::execute_order` in the bench's own process, without HTTP,
//! so that a scenario and its `core-` twin in one run show what HTTP costs an order.
//!
//! `noisy-neighbour` ([`noisy`]) is printed in a table of its own: one tenant's latency and
//! throughput while another floods the server with cheap, then with fuel-burning plugin plans.

pub mod baseline;
pub mod core;
pub mod load;
pub mod noisy;
pub mod plugin_plans;
pub mod redis_hot;
pub mod redis_lua;
pub mod server;
pub mod storage;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;

use baseline::Naive;
use load::{Limit, Target, Workload};
use server::{DbAccess, Server};

/// The storage backend of the server the bench starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// A fresh SQLite file in a temp dir.
    Sqlite,
    /// A fresh database on `--database-url`, dropped at the end.
    Postgres,
    /// A fresh database on `--database-url` (MySQL or MariaDB, InnoDB), dropped at the end.
    Mysql,
}

impl Backend {
    /// The server a fresh database is created on when `--database-url` is not given: the local
    /// one with its default administrator and no password.
    pub fn default_admin_url(self) -> Option<&'static str> {
        match self {
            Self::Sqlite => None,
            Self::Postgres => Some("postgres://postgres@127.0.0.1:5432/postgres"),
            Self::Mysql => Some("mysql://root@127.0.0.1:3306/mysql"),
        }
    }
}

/// `stockd bench` options.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Storage backend of the server started by the bench.
    #[arg(long, value_enum, default_value = "sqlite")]
    pub backend: Backend,
    /// Server on which a fresh database is created (and dropped) for `--backend postgres` or
    /// `--backend mysql`: any database of it, as the administrator [default:
    /// postgres://postgres@127.0.0.1:5432/postgres, or mysql://root@127.0.0.1:3306/mysql].
    #[arg(long)]
    pub database_url: Option<String>,
    /// Target an already running server on 127.0.0.1 instead of starting one (no baselines, no RSS).
    #[arg(long)]
    pub url: Option<String>,
    /// The `--url` server's process id, to report its CPU time per operation and its RSS.
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// Admin token of the `--url` server.
    #[arg(long, env = "STOCKD_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Concurrent closed-loop clients.
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Seconds each scenario runs.
    #[arg(long, default_value_t = 10)]
    pub duration_secs: u64,
    /// Instead of --duration-secs: each HTTP scenario stops after exactly this many orders,
    /// between all clients (reserve-confirm[-buckets] and deduct-reverse: each with its follow-up call;
    /// ceiling: health checks). The baselines and noisy-neighbour still run for the duration.
    #[arg(long)]
    pub orders: Option<u64>,
    /// How long the load generator waits for one answer (raise it for a server under valgrind).
    #[arg(long, default_value_t = 30)]
    pub client_timeout_secs: u64,
    /// A shell command (`sh -c`) run just before each HTTP scenario's load, after its setup, with
    /// STOCKD_BENCH_SCENARIO set to the scenario's name; the bench stops if it fails.
    #[arg(long)]
    pub exec_before_load: Option<String>,
    /// A shell command run just after each HTTP scenario's load, before its checks (as above).
    #[arg(long)]
    pub exec_after_load: Option<String>,
    /// Comma-separated scenarios: hot-key, hot-key-buckets (hot-key on a resource of 16
    /// buckets), uniform, multi-line, replay-storm, reserve-confirm, reserve-confirm-buckets (one
    /// key of 16 buckets), deduct-reverse (each order deducts 2 and reverses 1), ceiling, row-lock, guarded-per-request, segmented (stock split
    /// over 100 rows, 10 units each per sale); and redis-hot-key (needs STOCKD_REDIS_URL),
    /// redis-lua (baseline: one Redis Lua script per order, DECRBY + XADD to a stream, 1,000
    /// units per sale; needs STOCKD_REDIS_URL) and
    /// noisy-neighbour (fixed 32 + 8 clients, three phases of --duration-secs each; needs
    /// hostile-fuel-burner.wasm in --plugins-dir); flash-sale-builtin, flash-sale-rust,
    /// flash-sale-js, flash-sale-python (one-piece orders of new users on one SKU, planned by the
    /// built-in plan or the flash-sale example of that language from --plugins-dir; 2 s warm-up);
    /// core-hot-key, core-uniform, core-multi-line (those orders handed straight to the storage
    /// core in the bench's own process, no HTTP, on a database of their own).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ceiling,hot-key,hot-key-buckets,uniform,multi-line,replay-storm,reserve-confirm,row-lock,guarded-per-request,segmented"
    )]
    pub scenarios: Vec<String>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Where the built plugins are (`plugins/build.sh` writes them to plugins/dist).
    #[arg(long, default_value = "plugins/dist")]
    pub plugins_dir: PathBuf,
}

/// Raw counts of one scenario (merged over its clients).
#[derive(Debug, Default)]
pub struct Stats {
    /// Latency of each request, µs.
    pub latencies_us: Vec<u32>,
    /// Requests answered (or failed).
    pub requests: u64,
    /// Successful answers (2xx).
    pub ok: u64,
    /// Answers marked `Idempotent-Replayed: true`.
    pub replayed: u64,
    /// Units the acknowledged successes must have consumed.
    pub consumed_expected: i64,
    /// Non-success answers by reason code.
    pub rejections: BTreeMap<String, u64>,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl Stats {
    /// The merged stats of client tasks, with the wall time since `started`.
    async fn joined(handles: Vec<tokio::task::JoinHandle<Stats>>, started: Instant) -> anyhow::Result<Stats> {
        let mut total = Stats::default();
        for h in handles {
            total.merge(h.await.context("a bench client task failed")?);
        }
        total.elapsed = started.elapsed();
        Ok(total)
    }

    fn merge(&mut self, other: Stats) {
        self.latencies_us.extend(other.latencies_us);
        self.requests += other.requests;
        self.ok += other.ok;
        self.replayed += other.replayed;
        self.consumed_expected += other.consumed_expected;
        for (k, v) in other.rejections {
            *self.rejections.entry(k).or_insert(0) += v;
        }
    }
}

/// One row of the report.
#[derive(Debug, Serialize)]
pub struct ScenarioResult {
    pub scenario: String,
    pub backend: Backend,
    pub clients: usize,
    pub duration_secs: f64,
    pub requests: u64,
    pub ok: u64,
    pub replayed: u64,
    pub ok_per_sec: f64,
    pub requests_per_sec: f64,
    pub p50_us: u32,
    pub p95_us: u32,
    pub p99_us: u32,
    pub max_us: u32,
    pub rejections: BTreeMap<String, u64>,
    pub invariants_ok: bool,
    pub violations: Vec<String>,
    pub server_peak_rss_kib: Option<u64>,
    /// The server's CPU time (user + system) over the scenario's load, per successful operation:
    /// far less sensitive to a shared machine than ok/s, so the figure to compare builds by.
    /// `None` when the bench cannot see the server's process (`--url` without `--server-pid`) or
    /// the scenario does not load the server (the baselines).
    pub server_cpu_us_per_op: Option<f64>,
    /// What the scenario wrote to disk, per successful operation; `None`s with `--url` and for
    /// `ceiling` and `noisy-neighbour`.
    #[serde(flatten)]
    pub storage: storage::Usage,
    pub ratio_to_ceiling: Option<f64>,
    pub ratio_to_row_lock: Option<f64>,
    pub ratio_to_guarded_per_request: Option<f64>,
    /// Only for the baselines: orders refused while the stock as a whole was not gone (always 0
    /// but for `segmented`, whose picked segment may be empty while others are not).
    pub false_sold_outs: Option<u64>,
    /// Only for the baselines: the stock's segments and sales ([`baseline::Report`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<baseline::Report>,
    /// Only for `redis-hot-key`: how settlement into the database kept up with the sales.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub settlement: Option<redis_hot::Settlement>,
    /// Only for `noisy-neighbour`, whose row's own numbers are tenant B's under the fuel flood
    /// (the phase it is judged on): every phase, both tenants and the judged ratios.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub noisy_neighbour: Option<noisy::Report>,
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn summarize(
    name: &str,
    args: &BenchArgs,
    mut stats: Stats,
    violations: Vec<String>,
    rss: Option<u64>,
) -> ScenarioResult {
    stats.latencies_us.sort_unstable();
    let secs = stats.elapsed.as_secs_f64().max(1e-9);
    let l = &stats.latencies_us;
    ScenarioResult {
        scenario: name.to_string(),
        backend: args.backend,
        clients: args.clients,
        duration_secs: secs,
        requests: stats.requests,
        ok: stats.ok,
        replayed: stats.replayed,
        ok_per_sec: stats.ok as f64 / secs,
        requests_per_sec: stats.requests as f64 / secs,
        p50_us: percentile(l, 50.0),
        p95_us: percentile(l, 95.0),
        p99_us: percentile(l, 99.0),
        max_us: l.last().copied().unwrap_or(0),
        rejections: stats.rejections,
        invariants_ok: violations.is_empty(),
        violations,
        server_peak_rss_kib: rss,
        server_cpu_us_per_op: None,
        storage: storage::Usage::default(),
        ratio_to_ceiling: None,
        ratio_to_row_lock: None,
        ratio_to_guarded_per_request: None,
        false_sold_outs: None,
        baseline: None,
        settlement: None,
        noisy_neighbour: None,
    }
}

enum Scenario {
    Http(Workload),
    Naive(Naive),
    /// The hot key in redis mode ([`redis_hot`]).
    RedisHotKey,
    /// The Redis Lua pre-deduction baseline ([`redis_lua`]) on the Redis at this URL.
    RedisLua(String),
    /// Tenant B while tenant A floods ([`noisy`]), with the fuel burner's bytes.
    NoisyNeighbour(Vec<u8>),
    /// A flash sale planned by the built-in plan or a plugin of one language
    /// ([`plugin_plans`]), with the plugin's bytes.
    PluginPlans(plugin_plans::Planner, Option<Vec<u8>>),
    /// An HTTP workload's orders handed straight to the storage core ([`core`]).
    Core(Workload),
}

/// Refuses a scenario named twice: a scenario's resources are named after it, so a second run
/// would start from the first one's stock and sales, and its invariant check (the resource's
/// whole history against the run's own acknowledged sales) would fail without a fault.
fn once_each(names: &[String]) -> anyhow::Result<()> {
    let mut seen = std::collections::HashSet::new();
    match names.iter().map(|n| n.trim()).find(|n| !seen.insert(*n)) {
        Some(twice) => bail!("--scenarios names {twice} twice; run the bench again to repeat a scenario"),
        None => Ok(()),
    }
}

/// The scenario named `name`. Reads the plugins and settings a scenario needs now, so a missing
/// one stops the bench before it starts a server.
fn parse_scenario(name: &str, plugins_dir: &Path) -> anyhow::Result<Scenario> {
    Ok(match name.trim() {
        "hot-key" => Scenario::Http(Workload::HotKey),
        "hot-key-buckets" => Scenario::Http(Workload::HotKeyBuckets),
        "uniform" => Scenario::Http(Workload::Uniform),
        "multi-line" => Scenario::Http(Workload::MultiLine),
        "replay-storm" => Scenario::Http(Workload::ReplayStorm),
        "reserve-confirm" => Scenario::Http(Workload::ReserveConfirm),
        "reserve-confirm-buckets" => Scenario::Http(Workload::ReserveConfirmBuckets),
        "deduct-reverse" => Scenario::Http(Workload::DeductReverse),
        "ceiling" => Scenario::Http(Workload::Ceiling),
        "row-lock" => Scenario::Naive(Naive::RowLock),
        "guarded-per-request" => Scenario::Naive(Naive::Guarded),
        "segmented" => Scenario::Naive(Naive::Segmented),
        redis_hot::NAME => Scenario::RedisHotKey,
        redis_lua::NAME => Scenario::RedisLua(redis_lua::redis_url_from_env()?),
        noisy::NAME => Scenario::NoisyNeighbour(noisy::read_fixture(plugins_dir)?),
        other => match (plugin_plans::Planner::parse(other), core::parse(other)) {
            (Some(planner), _) => Scenario::PluginPlans(planner, planner.read(plugins_dir)?),
            (None, Some(w)) => Scenario::Core(w),
            (None, None) => bail!("unknown scenario {other:?}"),
        },
    })
}

/// `stockd bench`: runs the scenarios, prints the table, writes the JSON.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    // Before the bench's own first SQLite connection (baselines, sizes), so that the `core-`
    // scenarios' storage runs SQLite as the server does.
    crate::storage::sqlite::library::configure();
    once_each(&args.scenarios)?;
    let scenarios =
        args.scenarios.iter().map(|s| parse_scenario(s, &args.plugins_dir)).collect::<anyhow::Result<Vec<_>>>()?;
    if args.clients == 0 || args.duration_secs == 0 || args.orders == Some(0) || args.client_timeout_secs == 0 {
        bail!("--clients, --duration-secs, --orders and --client-timeout-secs must be positive");
    }
    let mut server = match &args.url {
        Some(url) => Server::external(url, args.admin_token.clone())?.with_pid(args.server_pid),
        None => {
            let admin_url = args.database_url.as_deref().or(args.backend.default_admin_url());
            Server::start(args.backend, admin_url).await?
        }
    };
    let per_scenario = match args.orders {
        Some(n) => format!("{n} orders"),
        None => format!("{} s", args.duration_secs),
    };
    eprintln!(
        "bench: server at {} ({:?}), {} clients, {per_scenario} per scenario",
        server.base, args.backend, args.clients
    );
    let outcome = run_all(&args, &server, &scenarios).await;
    server.stop().await;
    let mut results = outcome?;
    add_ratios(&mut results);
    print_table(&results);
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&results)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench: results written to {}", path.display());
    }
    if results.iter().any(|r| !r.invariants_ok) {
        bail!("invariant violations (see the table)");
    }
    Ok(())
}

/// How long the load generator waits for an answer unless told otherwise.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// The load generator's HTTP client, keeping a connection per closed-loop client.
fn http_client(clients: usize, timeout: Duration) -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(clients)
        .timeout(timeout)
        .build()
        .context("building the HTTP client")
}

async fn run_all(args: &BenchArgs, server: &Server, scenarios: &[Scenario]) -> anyhow::Result<Vec<ScenarioResult>> {
    let client = http_client(args.clients, Duration::from_secs(args.client_timeout_secs))?;
    let api_key = load::create_tenant(&client, &server.base, &server.admin_token).await?;
    let target = Arc::new(Target { client, base: server.base.clone(), api_key });
    let duration = Duration::from_secs(args.duration_secs);
    let limit = args.orders.map_or(Limit::Time(duration), Limit::Orders);
    let mut results = Vec::new();
    for scenario in scenarios {
        match scenario {
            Scenario::Http(w) => {
                eprintln!("bench: {} ...", w.name());
                load::create_resources(&target, *w).await.with_context(|| format!("setting up {}", w.name()))?;
                let probe = match server.db.as_ref().filter(|_| *w != Workload::Ceiling) {
                    Some(db) => storage::Probe::start(db).await,
                    None => None,
                };
                exec_hook(args.exec_before_load.as_deref(), w.name()).await?;
                let cpu = server.cpu_us();
                let stats = load::run(&target, *w, args.clients, limit).await?;
                let cpu = cpu_per_op(cpu, server.cpu_us(), stats.ok);
                exec_hook(args.exec_after_load.as_deref(), w.name()).await?;
                let usage = match probe {
                    Some(p) => p.finish(stats.ok).await,
                    None => storage::Usage::default(),
                };
                let violations =
                    load::check(&target, *w, &stats).await.with_context(|| format!("checking {}", w.name()))?;
                let mut row = summarize(w.name(), args, stats, violations, server.peak_rss_kib());
                row.server_cpu_us_per_op = cpu;
                row.storage = usage;
                results.push(row);
            }
            Scenario::RedisHotKey => {
                eprintln!("bench: {} ...", redis_hot::NAME);
                redis_hot::create_resource(&target).await?;
                let probe = match &server.db {
                    Some(db) => storage::Probe::start(db).await,
                    None => None,
                };
                exec_hook(args.exec_before_load.as_deref(), redis_hot::NAME).await?;
                let cpu = server.cpu_us();
                let stats = redis_hot::run(&target, args.clients, limit).await?;
                let cpu = cpu_per_op(cpu, server.cpu_us(), stats.ok);
                exec_hook(args.exec_after_load.as_deref(), redis_hot::NAME).await?;
                // Sized (and the WAL sampled) until after the check, which waits until every sale
                // is settled into the database.
                let (violations, settlement) = redis_hot::check(&target, &stats).await?;
                let usage = match probe {
                    Some(p) => p.finish(stats.ok).await,
                    None => storage::Usage::default(),
                };
                let mut row = summarize(redis_hot::NAME, args, stats, violations, server.peak_rss_kib());
                row.server_cpu_us_per_op = cpu;
                row.storage = usage;
                row.settlement = Some(settlement);
                results.push(row);
            }
            Scenario::NoisyNeighbour(fuel_burner) => {
                let outcome = noisy::run(server, fuel_burner, duration).await.context("running noisy-neighbour")?;
                let mut row =
                    summarize(noisy::NAME, args, outcome.b_under_fuel_flood, outcome.violations, server.peak_rss_kib());
                row.clients = noisy::B_CLIENTS;
                row.noisy_neighbour = Some(outcome.report);
                results.push(row);
            }
            Scenario::PluginPlans(planner, wasm) => {
                let name = planner.name();
                eprintln!("bench: {name} ...");
                let prepared = plugin_plans::prepare(&target.client, server, *planner, wasm.as_deref())
                    .await
                    .with_context(|| format!("setting up {name}"))?;
                let warm_up =
                    plugin_plans::run(&prepared.target, args.clients, Limit::Time(plugin_plans::WARM_UP)).await?;
                exec_hook(args.exec_before_load.as_deref(), name).await?;
                let cpu = server.cpu_us();
                let stats = plugin_plans::run(&prepared.target, args.clients, limit).await?;
                let cpu = cpu_per_op(cpu, server.cpu_us(), stats.ok);
                exec_hook(args.exec_after_load.as_deref(), name).await?;
                let violations = plugin_plans::check(&prepared.target, &stats, &warm_up)
                    .await
                    .with_context(|| format!("checking {name}"))?;
                let mut row = summarize(name, args, stats, violations, server.peak_rss_kib());
                row.server_cpu_us_per_op = cpu;
                results.push(row);
            }
            Scenario::RedisLua(url) => {
                eprintln!("bench: {} ...", redis_lua::NAME);
                let run = redis_lua::run(url, args.clients, duration)
                    .await
                    .with_context(|| format!("running {}", redis_lua::NAME))?;
                let mut row = summarize(redis_lua::NAME, args, run.stats, run.violations, None);
                row.false_sold_outs = Some(run.report.false_sold_outs);
                row.baseline = Some(run.report);
                results.push(row);
            }
            Scenario::Core(w) => {
                let name = core::name(*w);
                let Some(db) = &server.db else {
                    eprintln!("bench: skipping {name} (no direct database access with --url)");
                    continue;
                };
                eprintln!("bench: {name} ...");
                let hooks = (args.exec_before_load.as_deref(), args.exec_after_load.as_deref());
                let run =
                    core::run(db, *w, args.clients, limit, hooks).await.with_context(|| format!("running {name}"))?;
                let mut row = summarize(&name, args, run.stats, run.violations, None);
                row.server_cpu_us_per_op = run.cpu_us_per_op;
                row.storage = run.usage;
                results.push(row);
            }
            Scenario::Naive(n) => {
                let Some(server_db) = &server.db else {
                    eprintln!("bench: skipping {} (no direct database access with --url)", n.name());
                    continue;
                };
                // On SQLite a file of its own beside the server's: the baseline's writers would
                // otherwise hold the server's database, whose writer then cannot begin.
                let own = match server_db {
                    DbAccess::Sqlite(path) => Some(core::sibling_sqlite(path, n.name())),
                    _ => None,
                };
                let db = own.clone().map_or_else(|| server_db.clone(), DbAccess::Sqlite);
                eprintln!("bench: {} ...", n.name());
                let measured = async {
                    baseline::setup(&db, *n).await.with_context(|| format!("setting up {}", n.name()))?;
                    let probe = storage::Probe::start(&db).await;
                    let run = baseline::run(&db, *n, args.clients, duration).await?;
                    let usage = match probe {
                        Some(p) => p.finish(run.stats.ok).await,
                        None => storage::Usage::default(),
                    };
                    anyhow::Ok((run, usage))
                }
                .await;
                if let Some(file) = &own {
                    core::remove_sqlite(file);
                }
                let (run, usage) = measured?;
                let mut row = summarize(n.name(), args, run.stats, run.violations, None);
                row.storage = usage;
                row.false_sold_outs = Some(run.report.false_sold_outs);
                row.baseline = Some(run.report);
                results.push(row);
            }
        }
    }
    Ok(results)
}

/// Runs `command` with `sh -c` (when given), STOCKD_BENCH_SCENARIO set to `scenario`.
async fn exec_hook(command: Option<&str>, scenario: &str) -> anyhow::Result<()> {
    let Some(command) = command else { return Ok(()) };
    let status = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .env("STOCKD_BENCH_SCENARIO", scenario)
        .stdin(std::process::Stdio::null())
        .status()
        .await
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed ({status}) around {scenario}");
    }
    Ok(())
}

/// CPU µs per successful operation between two readings of the server's CPU time.
fn cpu_per_op(before: Option<u64>, after: Option<u64>, ok: u64) -> Option<f64> {
    let spent = after?.checked_sub(before?)?;
    (ok > 0).then(|| spent as f64 / ok as f64)
}

fn add_ratios(results: &mut [ScenarioResult]) {
    let find = |name: &str| results.iter().find(|r| r.scenario == name).map(|r| r.ok_per_sec).filter(|v| *v > 0.0);
    let (ceiling, row_lock, guarded) = (find("ceiling"), find("row-lock"), find("guarded-per-request"));
    for r in results.iter_mut() {
        if ["ceiling", "row-lock", "guarded-per-request"].contains(&r.scenario.as_str()) || r.noisy_neighbour.is_some()
        {
            continue;
        }
        r.ratio_to_ceiling = ceiling.map(|c| r.ok_per_sec / c);
        r.ratio_to_row_lock = row_lock.map(|c| r.ok_per_sec / c);
        r.ratio_to_guarded_per_request = guarded.map(|c| r.ok_per_sec / c);
    }
}

fn ms(us: u32) -> String {
    format!("{:.2}", f64::from(us) / 1000.0)
}

fn ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |v| format!("{v:.2}x"))
}

/// `reason=count,...`, or `-`.
fn counts(map: &BTreeMap<String, u64>) -> String {
    if map.is_empty() {
        return "-".into();
    }
    map.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

fn print_table(results: &[ScenarioResult]) {
    let (noisy, results): (Vec<&ScenarioResult>, Vec<&ScenarioResult>) =
        results.iter().partition(|r| r.noisy_neighbour.is_some());
    if !results.is_empty() {
        print_main_table(&results);
    }
    for r in &results {
        if let Some(s) = &r.settlement {
            println!(
                "{}: {} sales not yet settled when the load ended, settled {:.1} s later: {:.0} sales/s reached the database",
                r.scenario, s.backlog_at_load_end, s.drain_secs, s.settled_per_sec
            );
        }
    }
    for r in noisy {
        if !results.is_empty() {
            println!();
        }
        if let Some(report) = &r.noisy_neighbour {
            noisy::print(report, r.invariants_ok);
        }
        for v in &r.violations {
            println!("  {}: {v}", r.scenario);
        }
    }
}

/// The storage columns: bytes per order and, on SQLite, the WAL file's peak in MiB, or on
/// PostgreSQL the WAL (on MySQL the InnoDB redo log) written per order in bytes.
fn storage_cells(r: &ScenarioResult) -> (String, String) {
    let per_order = r.storage.bytes_per_order.map_or_else(|| "-".into(), |b| format!("{b:.0}"));
    let wal = match r.backend {
        Backend::Sqlite => r.storage.wal_peak_bytes.map(|b| format!("{:.1}", b as f64 / (1024.0 * 1024.0))),
        Backend::Postgres | Backend::Mysql => r.storage.wal_bytes_per_order.map(|b| format!("{b:.0}")),
    };
    (per_order, wal.unwrap_or_else(|| "-".into()))
}

fn print_main_table(results: &[&ScenarioResult]) {
    let wal_header = match results.first().map(|r| r.backend) {
        Some(Backend::Postgres | Backend::Mysql) => "walB/ord",
        _ => "wal MiB",
    };
    println!(
        "{:<20} {:>8} {:>7} {:>7} {:>7} {:>8} {:>7} {:>9} {:>7} {:>8} {:>6} {:>8} {:>8} {:>4} {:>8} {:>8}  rejections",
        "scenario",
        "ok/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "max ms",
        "rss MiB",
        "cpu us/op",
        "B/order",
        wal_header,
        "xceil",
        "xrowlock",
        "xguarded",
        "inv",
        "replayed",
        "false SO"
    );
    for r in results {
        let (per_order, wal) = storage_cells(r);
        println!(
            "{:<20} {:>8.0} {:>7} {:>7} {:>7} {:>8} {:>7} {:>9} {:>7} {:>8} {:>6} {:>8} {:>8} {:>4} {:>8} {:>8}  {}",
            r.scenario,
            r.ok_per_sec,
            ms(r.p50_us),
            ms(r.p95_us),
            ms(r.p99_us),
            ms(r.max_us),
            r.server_peak_rss_kib.map_or_else(|| "-".into(), |k| format!("{:.1}", k as f64 / 1024.0)),
            r.server_cpu_us_per_op.map_or_else(|| "-".into(), |us| format!("{us:.1}")),
            per_order,
            wal,
            ratio(r.ratio_to_ceiling),
            ratio(r.ratio_to_row_lock),
            ratio(r.ratio_to_guarded_per_request),
            if r.invariants_ok { "ok" } else { "FAIL" },
            r.replayed,
            r.false_sold_outs.map_or_else(|| "-".into(), |n| n.to_string()),
            counts(&r.rejections)
        );
    }
    for r in results.iter().filter(|r| !r.invariants_ok) {
        for v in &r.violations {
            println!("  {}: {v}", r.scenario);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scenario_named_twice_is_refused() {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(once_each(&names(&["ceiling", "hot-key", "uniform"])).is_ok());
        let err = once_each(&names(&["hot-key", "hot-key-buckets", " hot-key-buckets"])).expect_err("named twice");
        assert!(err.to_string().contains("hot-key-buckets twice"), "{err}");
    }
}
