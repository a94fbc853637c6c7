//! What the throwaway database servers (`pg.rs`, `mariadb.rs`) share: a free port, whether we
//! run as root, and running their tools with a deadline.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use tokio::process::Command;

/// Bound on one run of a server tool (`initdb`, `pg_ctl start` and `stop`, `mariadb-install-db`).
const TOOL_TIMEOUT: Duration = Duration::from_secs(60);

pub fn running_as_root() -> bool {
    // /proc/self/status: `Uid:\treal\teffective\tsaved\tfs`.
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status is readable on Linux");
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|ids| ids.split_whitespace().nth(1));
    uid == Some("0")
}

/// A port nobody listens on right now (the OS picks it; we release it for the server).
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a local port can be bound");
    listener.local_addr().expect("a bound socket has an address").port()
}

pub async fn run_checked(command: &mut Command, what: &str) {
    let out = output_bounded(command.stdin(Stdio::null())).await;
    assert!(out.status.success(), "{what} failed:\n{}", describe(&out));
}

pub fn describe(out: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `output()` with a deadline, so a wedged `pg_ctl` fails the test instead of hanging it.
pub async fn output_bounded(command: &mut Command) -> Output {
    let std = command.as_std();
    let program = format!("{:?} {:?}", std.get_program(), std.get_args().collect::<Vec<_>>());
    tokio::time::timeout(TOOL_TIMEOUT, command.output())
        .await
        .unwrap_or_else(|_| panic!("{program} did not finish within {TOOL_TIMEOUT:?}"))
        .unwrap_or_else(|e| panic!("{program} could not be run: {e}"))
}

/// A server's log file so far, for failure messages.
pub fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("(no server log: {e})"))
}
