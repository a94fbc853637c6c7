//! `stockd bench` runs end to end: it starts its own server on a fresh database of the suite's
//! backend, drives scenarios and baselines, checks the invariants (it exits non-zero on any
//! violation) and writes its JSON report.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

use crate::helpers::Backend;

/// How long one short bench run may take, start-up and invariant checks included.
const BENCH_DEADLINE: Duration = Duration::from_secs(120);

/// A one-second run of the hot key, the HTTP ceiling and both baselines passes its own
/// invariant checks and reports every scenario it ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_bench_run_checks_its_invariants_and_reports_every_scenario() {
    let dir = tempfile::tempdir().expect("a temporary directory can be created");
    let json = dir.path().join("bench.json");
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_stockd"));
    command
        .args(["bench", "--clients", "8", "--duration-secs", "1"])
        .args(["--scenarios", "ceiling,hot-key,row-lock,guarded-per-request", "--json"])
        .arg(&json)
        .current_dir(dir.path())
        .env("RUST_LOG", "warn")
        .env_remove("STOCKD_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if Backend::from_env() == Backend::Postgres {
        command.args(["--backend", "postgres", "--database-url", &crate::helpers::pg_admin_url()]);
    }
    let output = tokio::time::timeout(BENCH_DEADLINE, command.output())
        .await
        .expect("the bench finishes within its deadline")
        .expect("the stockd binary runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench failed: {}\n{stdout}\n{stderr}", output.status);

    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("the JSON report is written"))
        .expect("the JSON report parses");
    let text = report.to_string();
    for scenario in ["ceiling", "hot-key", "row-lock", "guarded-per-request"] {
        assert!(text.contains(scenario), "{scenario} is in the report: {text}");
        assert!(stdout.contains(scenario), "{scenario} is in the table: {stdout}");
    }
}
