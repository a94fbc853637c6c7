//! `stockd bench` runs end to end: it starts its own server on a fresh database of the suite's
//! backend, drives scenarios and baselines, checks the invariants (it exits non-zero on any
//! violation) and writes its JSON report. No assertion here is about speed.

use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::helpers::{mysql_admin_url, pg_admin_url, plugin_dist, unique, Backend};
use crate::redis_support::shared_redis_url;

/// How long one short bench run may take, start-up and invariant checks included.
const BENCH_DEADLINE: Duration = Duration::from_secs(120);

/// Runs `stockd bench` with `args` plus `--json` in a temporary directory against the suite's
/// backend; asserts it succeeds within [`BENCH_DEADLINE`] and returns its table and JSON report.
pub(crate) async fn bench(args: &[&str]) -> (String, Value) {
    bench_with_env(args, &[]).await
}

/// [`bench`] with `env` set for the bench (and so for the server it starts); nothing else of
/// Redis leaks in from the caller's shell.
async fn bench_with_env(args: &[&str], env: &[(&str, &str)]) -> (String, Value) {
    let dir = tempfile::tempdir().expect("a temporary directory can be created");
    let json = dir.path().join("bench.json");
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_stockd"));
    command
        .arg("bench")
        .args(args)
        .arg("--json")
        .arg(&json)
        .current_dir(dir.path())
        .env("RUST_LOG", "warn")
        .env_remove("STOCKD_ADMIN_TOKEN")
        .env_remove("STOCKD_REDIS_URL")
        .env_remove("STOCKD_REDIS_PREFIX")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    match Backend::from_env() {
        Backend::Sqlite => {}
        Backend::Postgres => {
            command.args(["--backend", "postgres", "--database-url", &pg_admin_url()]);
        }
        Backend::Mysql => {
            command.args(["--backend", "mysql", "--database-url", &mysql_admin_url()]);
        }
    }
    let output: Output = tokio::time::timeout(BENCH_DEADLINE, command.output())
        .await
        .expect("the bench finishes within its deadline")
        .expect("the stockd binary runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench failed: {}\n{stdout}\n{stderr}", output.status);
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("the JSON report is written"))
        .expect("the JSON report parses");
    (stdout, report)
}

/// A one-second run of the hot key (on one row and on 16 buckets), the HTTP ceiling, the three
/// database baselines and the Redis Lua baseline (on the suite's Redis) passes its own invariant
/// checks and reports every scenario it ran; the segmented and Redis Lua baselines report their
/// stock's sales and sold-outs, and only segmented refuses orders while stock remains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_bench_run_checks_its_invariants_and_reports_every_scenario() {
    let redis_url = shared_redis_url();
    // The server the bench starts gets Redis too: under a prefix of its own.
    let server_prefix = unique("bench");
    let scenarios =
        ["ceiling", "hot-key", "hot-key-buckets", "row-lock", "guarded-per-request", "segmented", "redis-lua"];
    let (stdout, report) = bench_with_env(
        &["--clients", "8", "--duration-secs", "1", "--scenarios", &scenarios.join(",")],
        &[("STOCKD_REDIS_URL", &redis_url), ("STOCKD_REDIS_PREFIX", &server_prefix)],
    )
    .await;
    let text = report.to_string();
    for scenario in scenarios {
        assert!(text.contains(scenario), "{scenario} is in the report: {text}");
        assert!(stdout.contains(scenario), "{scenario} is in the table: {stdout}");
    }
    // The server's CPU time per operation, for the scenarios that load it.
    let rows = report.as_array().expect("the report is an array of rows");
    let row = |name: &str| rows.iter().find(|r| r["scenario"] == name).cloned().unwrap_or_default();
    for name in ["ceiling", "hot-key", "hot-key-buckets"] {
        let cpu = row(name)["server_cpu_us_per_op"].as_f64();
        assert!(cpu.is_some_and(|us| us > 0.0 && us < 1_000_000.0), "{name}: cpu µs/op {cpu:?}: {text}");
    }
    assert_eq!(row("row-lock")["server_cpu_us_per_op"], Value::Null, "a baseline does not load the server");
    assert!(stdout.contains("cpu us/op"), "{stdout}");

    // The baselines' stock: one row that never runs out, or 100 segments of 10 units per sale.
    assert_eq!(row("hot-key")["false_sold_outs"], Value::Null, "not counted over HTTP: {text}");
    for name in ["row-lock", "guarded-per-request"] {
        let r = row(name);
        assert_eq!(r["false_sold_outs"], 0, "{name}: {r}");
        assert_eq!((r["baseline"]["segments"].clone(), r["baseline"]["sales"].clone()), (json!(1), json!(1)), "{r}");
    }
    let segmented = row("segmented");
    assert_eq!(segmented["invariants_ok"], true, "{segmented}");
    assert_eq!(segmented["violations"], json!([]), "{segmented}");
    let stock = &segmented["baseline"];
    assert_eq!((stock["segments"].clone(), stock["units_per_segment"].clone()), (json!(100), json!(10)), "{stock}");
    let sales = stock["sales"].as_i64().expect("the number of sales");
    assert!(sales >= 1, "{stock}");
    assert_eq!(stock["units_stocked"].as_i64(), Some(sales * 1_000), "every sale stocks 100 x 10 units: {stock}");
    let false_sold_outs = segmented["false_sold_outs"].as_u64().expect("false sold-outs are counted");
    assert_eq!(stock["false_sold_outs"].as_u64(), Some(false_sold_outs), "{segmented}");
    assert_eq!(segmented["rejections"]["false_sold_out"].as_u64().unwrap_or(0), false_sold_outs, "{segmented}");
    // A sale that ended emptied its 100 segments one after another: orders were refused on the
    // empty ones before the last unit went.
    if sales > 1 {
        assert!(false_sold_outs > 0, "{segmented}");
    }
    assert!(stdout.contains("false SO"), "{stdout}");

    // hot-key-buckets: stockd's db mode on the hot key split over 16 bucket rows, checked like
    // hot-key (its checks include the resource's bucket count).
    let buckets = row("hot-key-buckets");
    assert_eq!(
        (buckets["invariants_ok"].clone(), buckets["violations"].clone()),
        (json!(true), json!([])),
        "{buckets}"
    );
    assert!(buckets["ok"].as_u64().is_some_and(|ok| ok > 0), "{buckets}");
    assert_eq!(buckets["baseline"], Value::Null, "served over HTTP: {buckets}");

    // redis-lua: a baseline on Redis, 1,000 units per sale on one key; never a false sold-out,
    // and every unit stocked but those left was acknowledged (checked by the bench itself).
    let lua = row("redis-lua");
    assert_eq!((lua["invariants_ok"].clone(), lua["violations"].clone()), (json!(true), json!([])), "{lua}");
    assert!(lua["ok"].as_u64().is_some_and(|ok| ok > 0), "{lua}");
    assert_eq!(lua["server_cpu_us_per_op"], Value::Null, "a baseline does not load the server: {lua}");
    assert_eq!(lua["false_sold_outs"], 0, "{lua}");
    let stock = &lua["baseline"];
    assert_eq!((stock["segments"].clone(), stock["units_per_segment"].clone()), (json!(1), json!(1_000)), "{stock}");
    let sales = stock["sales"].as_i64().expect("the number of sales");
    assert!(sales >= 1, "{stock}");
    assert_eq!(stock["units_stocked"].as_i64(), Some(sales * 1_000), "every sale stocks 1,000 units: {stock}");
    let sold_outs = stock["sold_outs"].as_u64().expect("sold-outs are counted");
    assert_eq!(lua["rejections"]["insufficient"].as_u64().unwrap_or(0), sold_outs, "{lua}");
    assert_eq!(lua["requests"].as_u64(), lua["ok"].as_u64().map(|ok| ok + sold_outs), "no request failed: {lua}");
    assert!(sold_outs >= u64::try_from(sales - 1).unwrap_or(0), "each new sale follows a sold-out: {stock}");
    let ok = lua["ok"].as_i64().expect("the ok count");
    assert!(ok >= (sales - 1) * 1_000 && ok <= sales * 1_000, "{ok} sold over {sales} sales: {stock}");
}

/// The `core-` scenarios hand the HTTP scenarios' orders straight to the storage core, on a
/// database of their own beside the server's: each applies orders, reports the bench process's
/// CPU per order and what the orders left on disk, and passes its invariant checks (every
/// resource sums to its total, and they consumed what the acknowledged orders took).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_scenarios_apply_orders_through_the_storage_core_and_check_them() {
    let scenarios = ["core-hot-key", "core-multi-line"];
    let (stdout, report) =
        bench(&["--clients", "8", "--duration-secs", "1", "--scenarios", &scenarios.join(",")]).await;
    let rows = report.as_array().expect("the report is an array of rows");
    for name in scenarios {
        let row = rows.iter().find(|r| r["scenario"] == name).cloned().unwrap_or_default();
        assert!(stdout.contains(name), "{name} is in the table: {stdout}");
        assert_eq!((row["invariants_ok"].clone(), row["violations"].clone()), (json!(true), json!([])), "{row}");
        assert!(row["ok"].as_u64().is_some_and(|ok| ok > 0), "orders applied: {row}");
        assert_eq!(row["requests"], row["ok"], "every order applied: {row}");
        let cpu = row["server_cpu_us_per_op"].as_f64();
        assert!(cpu.is_some_and(|us| us > 0.0 && us < 1_000_000.0), "{name}: cpu µs/op {cpu:?}: {row}");
        let bytes = row["bytes_per_order"].as_f64();
        assert!(bytes.is_some_and(|b| b > 0.0), "{name}: bytes per order {bytes:?}: {row}");
    }
}

/// Without STOCKD_REDIS_URL the redis-lua scenario refuses to start and names the variable.
#[tokio::test]
async fn redis_lua_without_a_redis_url_fails_naming_the_variable() {
    let stderr = bench_refused(&["--scenarios", "redis-lua"]).await;
    assert!(stderr.contains("STOCKD_REDIS_URL"), "names the variable: {stderr}");
    assert!(stderr.contains("redis-lua"), "names the scenario: {stderr}");
}

/// Runs `stockd bench` with `args` and neither an admin token nor Redis in its environment;
/// asserts it fails within [`BENCH_DEADLINE`] and returns what it wrote to stderr.
async fn bench_refused(args: &[&str]) -> String {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_stockd"))
        .arg("bench")
        .args(args)
        .env_remove("STOCKD_ADMIN_TOKEN")
        .env_remove("STOCKD_REDIS_URL")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(BENCH_DEADLINE, output)
        .await
        .expect("the bench stops within its deadline")
        .expect("the stockd binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "the bench must fail: {stderr}");
    stderr
}

/// A one-second-per-phase noisy-neighbour run uploads the fuel burner for tenant A, reports
/// tenant B in all three phases (A only in the two floods) with both judged ratios, and passes
/// the invariant checks of both tenants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_noisy_neighbour_run_reports_three_phases_and_clean_invariants() {
    let dist = plugin_dist().to_str().expect("the plugins folder is valid UTF-8").to_owned();
    let (stdout, report) =
        bench(&["--duration-secs", "1", "--scenarios", "noisy-neighbour", "--plugins-dir", &dist]).await;

    let rows = report.as_array().expect("the report is a list of rows");
    assert_eq!(rows.len(), 1, "{report}");
    let row = &rows[0];
    assert_eq!(row["scenario"], "noisy-neighbour", "{row}");
    assert_eq!(row["invariants_ok"], true, "{row}");
    assert_eq!(row["violations"], json!([]), "{row}");
    let detail = &row["noisy_neighbour"];
    let phases: Vec<&Value> = detail["phases"].as_array().expect("phases").iter().collect();
    let names: Vec<&str> = phases.iter().map(|p| p["phase"].as_str().expect("a phase name")).collect();
    assert_eq!(names, ["b-alone", "cheap-flood", "fuel-flood"], "{detail}");
    for phase in &phases {
        assert_eq!(phase["tenant_b"]["clients"], 8, "{phase}");
        assert!(phase["tenant_b"]["ok"].as_u64().expect("B's ok count") > 0, "B is served in every phase: {phase}");
    }
    assert_eq!(phases[0]["tenant_a"], Value::Null, "A is idle while B runs alone: {detail}");
    for phase in &phases[1..] {
        assert_eq!(phase["tenant_a"]["clients"], 32, "{phase}");
        assert!(phase["tenant_a"]["requests"].as_u64().expect("A's request count") > 0, "A floods: {phase}");
    }
    assert_eq!(detail["fuel_burner_config"], "burn = 970000", "{detail}");
    assert!(detail["throughput_ratio"].is_f64(), "{detail}");
    assert!(detail["p99_ratio"].is_f64(), "{detail}");

    for line in ["b-alone", "cheap-flood", "fuel-flood", "invariants ok"] {
        assert!(stdout.contains(line), "{line:?} is in the table: {stdout}");
    }
}

/// Without the fuel burner the noisy-neighbour scenario refuses to start and says how to
/// build it.
#[tokio::test]
async fn noisy_neighbour_without_the_fixture_fails_with_how_to_build_it() {
    let empty = tempfile::tempdir().expect("a temporary directory can be created");
    let dir = empty.path().to_str().expect("the temporary directory is valid UTF-8");
    let stderr = bench_refused(&["--scenarios", "noisy-neighbour", "--plugins-dir", dir]).await;
    assert!(stderr.contains("hostile-fuel-burner.wasm"), "names the missing file: {stderr}");
    assert!(stderr.contains("plugins/build.sh"), "says how to build it: {stderr}");
}
