//! A throwaway PostgreSQL server for one test: `initdb` in a temporary directory, started on a
//! free port, so a test can stop and start *its* database without disturbing any other test.
//!
//! PostgreSQL refuses to run as root, so when the tests run as root every server command runs
//! as the unprivileged `postgres` OS user (which the postgresql package creates) via `runuser`;
//! otherwise it runs as the current user.

use std::path::PathBuf;
use std::process::{Output, Stdio};

use tempfile::TempDir;
use tokio::process::Command;

use crate::process::{describe, free_port, output_bounded, read_log, run_checked, running_as_root};

/// Where Debian/Ubuntu install the server binaries, one directory per major version.
const PG_LIB_DIR: &str = "/usr/lib/postgresql";
/// The OS user the server runs as when the tests run as root.
const PG_OS_USER: &str = "postgres";
/// Attempts at starting on a free port (another process may take the port we picked first).
const START_ATTEMPTS: usize = 5;
/// Seconds `pg_ctl -w` waits for the server before it gives up (passed as `-t`).
const PG_CTL_WAIT_SECONDS: &str = "50";

/// One PostgreSQL server of one test; stopped and removed on drop.
pub struct ThrowawayPg {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    as_root: bool,
    /// Declared last: removed after the server has been stopped.
    dir: TempDir,
}

impl ThrowawayPg {
    /// Creates a fresh cluster (superuser `postgres`, trust auth) and starts it.
    pub async fn start_new() -> ThrowawayPg {
        let bin = pg_bin_dir();
        let as_root = running_as_root();
        let dir = tempfile::tempdir().expect("a temporary directory can be created");
        if as_root {
            // The server's user must own the directory it writes its data and socket into.
            run_checked(Command::new("chown").arg(format!("{PG_OS_USER}:")).arg(dir.path()), "chown").await;
        }
        let mut pg = ThrowawayPg { data: dir.path().join("data"), bin, port: 0, as_root, dir };
        let data = pg.data.display().to_string();
        let mut initdb = pg.command("initdb");
        initdb.args(["-D", &data, "-U", "postgres", "--auth=trust", "--no-locale", "-E", "UTF8", "--no-sync"]);
        let initdb = output_bounded(&mut initdb).await;
        assert!(initdb.status.success(), "initdb failed:\n{}", describe(&initdb));
        pg.start_on_free_port().await;
        pg
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// `pg_ctl -m fast stop -w`: open sessions are terminated, in-flight transactions roll back.
    pub async fn stop(&self) {
        let out = self.pg_ctl(&["-m", "fast", "stop"]).await;
        assert!(out.status.success(), "pg_ctl stop failed:\n{}\nserver log:\n{}", describe(&out), self.server_log());
    }

    /// Starts the stopped server again, on the same port and data.
    pub async fn start(&self) {
        let out = self.pg_ctl_start().await;
        assert!(out.status.success(), "pg_ctl start failed:\n{}\nserver log:\n{}", describe(&out), self.server_log());
    }

    async fn start_on_free_port(&mut self) {
        let mut failures = String::new();
        for _ in 0..START_ATTEMPTS {
            self.port = free_port();
            let out = self.pg_ctl_start().await;
            if out.status.success() {
                return;
            }
            failures.push_str(&format!("port {}:\n{}\n", self.port, describe(&out)));
        }
        panic!("the throwaway PostgreSQL did not start:\n{failures}server log:\n{}", self.server_log());
    }

    async fn pg_ctl_start(&self) -> Output {
        let socket_dir = self.dir.path().display();
        let options = format!("-p {} -k {socket_dir} -c listen_addresses=127.0.0.1", self.port);
        let log = self.log_path().display().to_string();
        // `-l`: the server writes its log there, not to our pipes, which would otherwise stay
        // open (and `output()` wait) for as long as the server runs.
        self.pg_ctl(&["-o", &options, "-l", &log, "start"]).await
    }

    async fn pg_ctl(&self, args: &[&str]) -> Output {
        let data = self.data.display().to_string();
        let mut pg_ctl = self.command("pg_ctl");
        pg_ctl.args(["-D", &data, "-w", "-t", PG_CTL_WAIT_SECONDS]).args(args);
        output_bounded(&mut pg_ctl).await
    }

    /// A server binary, run as the `postgres` OS user when we are root.
    fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        let mut command = if self.as_root {
            let mut c = Command::new("runuser");
            c.args(["-u", PG_OS_USER, "--"]).arg(program);
            c
        } else {
            Command::new(program)
        };
        // The server's user may not be allowed into the test's working directory.
        command.current_dir(self.dir.path()).stdin(Stdio::null()).kill_on_drop(true);
        command
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// The server's log so far, for failure messages.
    pub fn server_log(&self) -> String {
        read_log(&self.log_path())
    }
}

impl Drop for ThrowawayPg {
    fn drop(&mut self) {
        // Blocking is fine here: the test is over. `immediate`: the data is thrown away anyway.
        let data = self.data.display().to_string();
        let program = self.bin.join("pg_ctl");
        let mut command = if self.as_root {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", PG_OS_USER, "--"]).arg(program);
            c
        } else {
            std::process::Command::new(program)
        };
        let _ = command
            .args(["-D", &data, "-m", "immediate", "-w", "-t", PG_CTL_WAIT_SECONDS, "stop"])
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// `/usr/lib/postgresql/<highest version>/bin`, which must hold `initdb` and `pg_ctl`.
fn pg_bin_dir() -> PathBuf {
    let mut found: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(PG_LIB_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version: Option<Vec<u32>> =
                entry.file_name().to_str()?.split('.').map(|part| part.parse().ok()).collect();
            let bin = entry.path().join("bin");
            let complete = bin.join("initdb").is_file() && bin.join("pg_ctl").is_file();
            Some((version?, bin)).filter(|_| complete)
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "no PostgreSQL server binaries (initdb, pg_ctl) under {PG_LIB_DIR}/*/bin: the fault tests run \
             their own throwaway PostgreSQL; install the `postgresql` package"
        ),
    }
}
