//! `noisy-neighbour`: how much one tenant's flood of expensive plugin plans costs another
//! tenant. Tenant B runs [`B_CLIENTS`] closed-loop clients on its own hot key in three phases
//! on the same server: alone; while tenant A floods its own hot key with [`A_CLIENTS`] clients
//! planned by the built-in default (cheap); and while A floods the same way through the
//! `hostile-fuel-burner` plugin configured to burn most of the fuel budget on every plan.
//!
//! Each phase runs [`WARM_UP`] unmeasured, then the bench's duration measured (for A and B in
//! the same window). Judged: B's throughput under the fuel flood over B's throughput under the
//! cheap flood (target >= [`THROUGHPUT_RATIO_MIN`]), and B's p99 under the fuel flood over B's
//! p99 under the cheap flood (target <= [`P99_RATIO_MAX`]). A's refusals are counted by HTTP
//! status: a server that protects B may refuse A (429), but must not refuse B.
//!
//! The fixture is read from `--plugins-dir` (default `plugins/dist`, relative to the working
//! directory, like the tenant plugins of `config/stockd.toml`) before the server starts.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use reqwest::StatusCode;
use serde::Serialize;

use super::load::{self, Answer, Target};
use super::server::{random_hex, Server};
use super::{percentile, Stats};

/// The scenario's name, also its resource key prefix.
pub const NAME: &str = "noisy-neighbour";
/// The fixture tenant A floods through, as `plugins/build.sh` names it.
pub const FUEL_BURNER_FILE: &str = "hostile-fuel-burner.wasm";
/// Tenant A's plugin configuration: loop iterations per plan. Measured with the default limits
/// (`fuel_per_call` 10,000,000; a one-line order): ~4,900 fuel + ~8.75 per iteration, so this
/// burns ~8.49 million, 85% of the budget (pinned between 80% and 100% by a unit test in
/// `plugin::tests`), about 0.75 ms of CPU per plan here (0.87 ms measured at the full budget).
pub const FUEL_BURNER_CONFIG: &str = "burn = 970000";
/// Tenant A's closed-loop clients in the flood phases.
pub const A_CLIENTS: usize = 32;
/// Tenant B's closed-loop clients in every phase.
pub const B_CLIENTS: usize = 8;
/// Unmeasured run-in of each phase: connections, plugin instances and the server's batches
/// settle before the measured window starts.
pub const WARM_UP: Duration = Duration::from_secs(2);
/// Target: B keeps at least this share of its cheap-flood throughput under the fuel flood.
pub const THROUGHPUT_RATIO_MIN: f64 = 0.90;
/// Target: B's p99 under the fuel flood is at most this multiple of its cheap-flood p99.
pub const P99_RATIO_MAX: f64 = 1.2;

/// Reads the fuel-burner fixture, or says how to build it.
pub fn read_fixture(plugins_dir: &Path) -> anyhow::Result<Vec<u8>> {
    let path = plugins_dir.join(FUEL_BURNER_FILE);
    std::fs::read(&path).with_context(|| {
        format!(
            "the {NAME} scenario needs the plugin fixture {}, which cannot be read: build it with \
             `bash plugins/build.sh` from the repository root, or point --plugins-dir at the folder \
             holding it",
            path.display()
        )
    })
}

/// The three phases, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PhaseName {
    /// B alone.
    BAlone,
    /// B while A floods through the built-in plan.
    CheapFlood,
    /// B while A floods through the fuel-burning plugin.
    FuelFlood,
}

impl PhaseName {
    /// The name printed and used in idempotency keys.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BAlone => "b-alone",
            Self::CheapFlood => "cheap-flood",
            Self::FuelFlood => "fuel-flood",
        }
    }
}

/// One tenant's load in one phase's measured window.
#[derive(Debug, Serialize)]
pub struct TenantLoad {
    pub clients: usize,
    pub duration_secs: f64,
    pub requests: u64,
    pub ok: u64,
    pub ok_per_sec: f64,
    pub p50_us: u32,
    pub p95_us: u32,
    pub p99_us: u32,
    pub max_us: u32,
    /// Refused requests by HTTP status and reason (`429 ...`, `422 plugin_failed`), or
    /// `timeout` / `transport` when no answer came.
    pub refusals: BTreeMap<String, u64>,
}

impl TenantLoad {
    fn new(clients: usize, stats: &Stats) -> Self {
        let mut sorted = stats.latencies_us.clone();
        sorted.sort_unstable();
        let secs = stats.elapsed.as_secs_f64().max(1e-9);
        Self {
            clients,
            duration_secs: secs,
            requests: stats.requests,
            ok: stats.ok,
            ok_per_sec: stats.ok as f64 / secs,
            p50_us: percentile(&sorted, 50.0),
            p95_us: percentile(&sorted, 95.0),
            p99_us: percentile(&sorted, 99.0),
            max_us: sorted.last().copied().unwrap_or(0),
            refusals: stats.rejections.clone(),
        }
    }
}

/// One phase: B's load, and A's when A floods.
#[derive(Debug, Serialize)]
pub struct Phase {
    pub phase: PhaseName,
    pub tenant_b: TenantLoad,
    pub tenant_a: Option<TenantLoad>,
}

/// The scenario's report (the `noisy_neighbour` object of its JSON row).
#[derive(Debug, Serialize)]
pub struct Report {
    pub warm_up_secs: f64,
    /// Tenant A's plugin configuration in the fuel flood.
    pub fuel_burner_config: &'static str,
    pub phases: Vec<Phase>,
    /// B's ok/s under the fuel flood over B's ok/s under the cheap flood.
    pub throughput_ratio: Option<f64>,
    pub throughput_ratio_min: f64,
    /// B's p99 under the fuel flood over B's p99 under the cheap flood.
    pub p99_ratio: Option<f64>,
    pub p99_ratio_max: f64,
    /// Both ratios are known and within their targets.
    pub targets_met: bool,
}

/// What the run hands back: the report, B's raw stats under the fuel flood (the row's own
/// numbers) and the invariant violations over both tenants.
pub struct Outcome {
    pub report: Report,
    pub b_under_fuel_flood: Stats,
    pub violations: Vec<String>,
}

/// One tenant of the scenario: its API, its hot key, its clients, and what all its acknowledged
/// successes consumed so far (warm-ups included, for the invariant check).
struct Tenant {
    target: Arc<Target>,
    key: String,
    clients: usize,
    consumed_expected: i64,
}

impl Tenant {
    /// Creates a tenant with its own HTTP client (so the two tenants never share connections)
    /// and its hot key of [`load::TOTAL`] units, far more than a run can sell.
    async fn create(server: &Server, name: &str, clients: usize) -> anyhow::Result<Self> {
        let client = super::http_client(clients, super::CLIENT_TIMEOUT)?;
        let api_key = load::create_tenant(&client, &server.base, &server.admin_token).await?;
        let target = Arc::new(Target { client, base: server.base.clone(), api_key });
        let key = format!("{NAME}:{name}");
        load::create_resource(&target, &key, None).await?;
        Ok(Self { target, key, clients, consumed_expected: 0 })
    }
}

/// Runs the three phases on `server` and checks both tenants' invariants.
pub async fn run(server: &Server, fuel_burner: &[u8], duration: Duration) -> anyhow::Result<Outcome> {
    let mut a = Tenant::create(server, "a", A_CLIENTS).await.context("setting up tenant A")?;
    let mut b = Tenant::create(server, "b", B_CLIENTS).await.context("setting up tenant B")?;
    let mut phases = Vec::new();
    let mut b_under_fuel_flood = Stats::default();
    for name in [PhaseName::BAlone, PhaseName::CheapFlood, PhaseName::FuelFlood] {
        if name == PhaseName::FuelFlood {
            upload_fuel_burner(&a.target, fuel_burner).await?;
        }
        eprintln!("bench: {NAME} {} ...", name.as_str());
        let flood = (name != PhaseName::BAlone).then_some(&mut a);
        let (b_stats, a_stats) = phase(name, &mut b, flood, duration).await?;
        phases.push(Phase {
            phase: name,
            tenant_b: TenantLoad::new(B_CLIENTS, &b_stats),
            tenant_a: a_stats.as_ref().map(|s| TenantLoad::new(A_CLIENTS, s)),
        });
        if name == PhaseName::FuelFlood {
            b_under_fuel_flood = b_stats;
        }
    }
    let mut violations = Vec::new();
    for (label, tenant) in [("tenant A", &a), ("tenant B", &b)] {
        let (problems, _) = load::check_keys(&tenant.target, &format!("{NAME}:"), 1, tenant.consumed_expected)
            .await
            .with_context(|| format!("checking {label}"))?;
        violations.extend(problems.into_iter().map(|p| format!("{label}: {p}")));
    }
    Ok(Outcome { report: report(phases), b_under_fuel_flood, violations })
}

/// `PUT /v1/plugin` for tenant A: the fuel burner with [`FUEL_BURNER_CONFIG`].
async fn upload_fuel_burner(a: &Target, wasm: &[u8]) -> anyhow::Result<()> {
    let resp = a
        .client
        .put(format!("{}/v1/plugin", a.base))
        .bearer_auth(&a.api_key)
        .header(reqwest::header::CONTENT_TYPE, "application/wasm")
        .query(&[("config", FUEL_BURNER_CONFIG)])
        .body(wasm.to_vec())
        .send()
        .await
        .context("uploading the fuel burner for tenant A")?;
    let status = resp.status();
    if status != StatusCode::CREATED {
        bail!("uploading the fuel burner for tenant A: {status} {}", resp.text().await.unwrap_or_default());
    }
    Ok(())
}

/// When a phase's clients record, and when they stop.
#[derive(Clone, Copy)]
struct Window {
    measured_from: Instant,
    until: Instant,
}

/// Runs B (and A, when flooding) for [`WARM_UP`] plus `duration`; returns the stats of the
/// measured window, B's first.
async fn phase(
    name: PhaseName,
    b: &mut Tenant,
    a: Option<&mut Tenant>,
    duration: Duration,
) -> anyhow::Result<(Stats, Option<Stats>)> {
    let measured_from = Instant::now() + WARM_UP;
    let window = Window { measured_from, until: measured_from + duration };
    let run = random_hex(3);
    let spawn = |tenant: &Tenant| -> Vec<_> {
        (0..tenant.clients)
            .map(|task| {
                let (target, key) = (tenant.target.clone(), tenant.key.clone());
                let idem_prefix = format!("{NAME}-{}-{run}-{task}", name.as_str());
                tokio::spawn(client_loop(target, key, idem_prefix, window))
            })
            .collect()
    };
    let a_handles = a.as_ref().map(|a| spawn(a));
    let b_handles = spawn(b);
    let b_stats = join(b_handles, b, measured_from).await?;
    let a_stats = match (a, a_handles) {
        (Some(a), Some(handles)) => Some(join(handles, a, measured_from).await?),
        _ => None,
    };
    Ok((b_stats, a_stats))
}

/// Merges one tenant's client stats and adds their successes to its expected consumption.
async fn join(
    handles: Vec<tokio::task::JoinHandle<Stats>>,
    tenant: &mut Tenant,
    measured_from: Instant,
) -> anyhow::Result<Stats> {
    let total = Stats::joined(handles, measured_from).await?;
    tenant.consumed_expected += total.consumed_expected;
    Ok(total)
}

/// One client's closed loop of one-piece deductions of `key` until the window ends. Every
/// success counts toward `consumed_expected`; only requests sent inside the measured window
/// are recorded, their refusals keyed `"<status> <reason>"`.
async fn client_loop(t: Arc<Target>, key: String, idem_prefix: String, window: Window) -> Stats {
    let mut stats = Stats::default();
    let mut i: u64 = 0;
    while Instant::now() < window.until {
        i += 1;
        let idem = format!("{idem_prefix}-{i}");
        let sent = Instant::now();
        let answer = load::order(&t, &idem, &load::order_body(&idem, "deduct", std::slice::from_ref(&key))).await;
        if answer.ok {
            stats.consumed_expected += 1;
        }
        if sent < window.measured_from {
            continue;
        }
        let answer = match (&answer.reason, answer.status) {
            (Some(reason), Some(status)) => Answer { reason: Some(format!("{} {reason}", status.as_u16())), ..answer },
            _ => answer,
        };
        load::record(&mut stats, sent, &answer);
    }
    stats
}

fn report(phases: Vec<Phase>) -> Report {
    let b = |name: PhaseName| phases.iter().find(|p| p.phase == name).map(|p| &p.tenant_b);
    let (cheap, fuel) = (b(PhaseName::CheapFlood), b(PhaseName::FuelFlood));
    let throughput_ratio =
        cheap.zip(fuel).filter(|(c, _)| c.ok_per_sec > 0.0).map(|(c, f)| f.ok_per_sec / c.ok_per_sec);
    let p99_ratio =
        cheap.zip(fuel).filter(|(c, _)| c.p99_us > 0).map(|(c, f)| f64::from(f.p99_us) / f64::from(c.p99_us));
    let targets_met =
        throughput_ratio.is_some_and(|r| r >= THROUGHPUT_RATIO_MIN) && p99_ratio.is_some_and(|r| r <= P99_RATIO_MAX);
    Report {
        warm_up_secs: WARM_UP.as_secs_f64(),
        fuel_burner_config: FUEL_BURNER_CONFIG,
        phases,
        throughput_ratio,
        throughput_ratio_min: THROUGHPUT_RATIO_MIN,
        p99_ratio,
        p99_ratio_max: P99_RATIO_MAX,
        targets_met,
    }
}

/// Prints the scenario in the bench's table style: one line per phase, then the judged ratios.
pub fn print(report: &Report, invariants_ok: bool) {
    println!(
        "{NAME}: tenant B ({B_CLIENTS} clients, its hot key) while tenant A ({A_CLIENTS} clients, its own hot key) \
         floods; {:.0} s warm-up excluded",
        report.warm_up_secs
    );
    println!(
        "{:<20} {:>10} {:>8} {:>8} {:>8} {:>9} {:>10}  {:<24}  A refusals",
        "phase", "B ok/s", "p50 ms", "p95 ms", "p99 ms", "max ms", "A ok/s", "B refusals"
    );
    for p in &report.phases {
        let b = &p.tenant_b;
        println!(
            "{:<20} {:>10.0} {:>8} {:>8} {:>8} {:>9} {:>10}  {:<24}  {}",
            p.phase.as_str(),
            b.ok_per_sec,
            super::ms(b.p50_us),
            super::ms(b.p95_us),
            super::ms(b.p99_us),
            super::ms(b.max_us),
            p.tenant_a.as_ref().map_or_else(|| "-".into(), |a| format!("{:.0}", a.ok_per_sec)),
            super::counts(&b.refusals),
            p.tenant_a.as_ref().map_or_else(|| "-".into(), |a| super::counts(&a.refusals)),
        );
    }
    let judged = |value: Option<f64>, ok: bool| match value {
        Some(v) => format!("{v:.2}x ({})", if ok { "met" } else { "MISSED" }),
        None => "- (no data)".into(),
    };
    println!(
        "B fuel-flood / cheap-flood: throughput {} target >= {THROUGHPUT_RATIO_MIN:.2}; p99 {} target <= {P99_RATIO_MAX:.2}; \
         invariants {}",
        judged(report.throughput_ratio, report.throughput_ratio.is_some_and(|r| r >= THROUGHPUT_RATIO_MIN)),
        judged(report.p99_ratio, report.p99_ratio.is_some_and(|r| r <= P99_RATIO_MAX)),
        if invariants_ok { "ok" } else { "FAIL" },
    );
}
