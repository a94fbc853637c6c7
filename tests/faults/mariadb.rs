//! A throwaway MariaDB server for one test: `mariadb-install-db` in a temporary directory and
//! `mariadbd` started on a free port, so a test can stop and start *its* database without
//! disturbing any other test.
//!
//! `mariadbd` refuses to run as root, so when the tests run as root it is started with
//! `--user=mysql` (the OS user the mariadb-server package creates) and switches to that user
//! itself; the temporary directory is handed to that user first. Otherwise it runs as the
//! current user.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use sqlx::Connection;
use tempfile::TempDir;
use tokio::process::Command;
use tokio::time::Instant;

use crate::process::{describe, free_port, output_bounded, read_log, run_checked, running_as_root};

/// Where Debian installs the server (`/usr/sbin`) and its tools (`/usr/bin`); `PATH` is not
/// enough, since `/usr/sbin` is often missing from an unprivileged user's.
const BIN_DIRS: [&str; 4] = ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"];
/// The OS user the server runs as when the tests run as root.
const OS_USER: &str = "mysql";
/// The database stockd runs on (created at start; the server's own `mysql` is not for it).
const DATABASE: &str = "stockd";
/// Attempts at starting on a free port (another process may take the port we picked first).
const START_ATTEMPTS: usize = 5;
/// Bound on a start (until the server accepts a connection) and on a stop (until it exits).
const START_DEADLINE: Duration = Duration::from_secs(60);
const STOP_DEADLINE: Duration = Duration::from_secs(60);
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Server settings, the same for `mariadb-install-db` and every start. A test writes little
/// and several run side by side: a small buffer pool and redo log (the defaults are 128 MiB
/// and 96 MiB). The character set of Debian's packaged configuration, which `--no-defaults`
/// leaves out (the compiled-in default is latin1). No reverse DNS for 127.0.0.1.
const SERVER_OPTIONS: [&str; 5] = [
    "--innodb-buffer-pool-size=64M",
    "--innodb-log-file-size=16M",
    "--character-set-server=utf8mb4",
    "--collation-server=utf8mb4_general_ci",
    "--skip-name-resolve",
];

/// One MariaDB server of one test; killed and removed on drop.
pub struct ThrowawayMariadb {
    server: PathBuf,
    data: PathBuf,
    port: u16,
    as_root: bool,
    /// The running `mariadbd` (a std child: drop must wait for it synchronously, before the
    /// directory goes).
    child: Option<std::process::Child>,
    /// Declared last: removed after the server has been killed.
    dir: TempDir,
}

impl ThrowawayMariadb {
    /// Creates a fresh data directory (user `root` without a password, for TCP from 127.0.0.1
    /// too), starts the server on it and creates the database stockd runs on.
    pub async fn start_new() -> ThrowawayMariadb {
        let server = binary(&["mariadbd", "mysqld"]);
        let install_db = binary(&["mariadb-install-db", "mysql_install_db"]);
        let as_root = running_as_root();
        let dir = tempfile::tempdir().expect("a temporary directory can be created");
        if as_root {
            // The server's user must own the directory it writes its data, log and socket into.
            run_checked(Command::new("chown").arg(format!("{OS_USER}:")).arg(dir.path()), "chown").await;
        }
        let mut db = ThrowawayMariadb { server, data: dir.path().join("data"), port: 0, as_root, child: None, dir };
        let mut install = Command::new(install_db);
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", db.data.display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            .args(SERVER_OPTIONS)
            .arg(db.tmpdir_option())
            .args(db.user_option())
            .current_dir(db.dir.path())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let installed = output_bounded(&mut install).await;
        assert!(installed.status.success(), "mariadb-install-db failed:\n{}", describe(&installed));
        db.start_on_free_port().await;

        let mut admin = sqlx::MySqlConnection::connect(&db.admin_url())
            .await
            .unwrap_or_else(|e| panic!("the throwaway MariaDB accepts root: {e}\nserver log:\n{}", db.server_log()));
        sqlx::query(&format!("CREATE DATABASE {DATABASE}"))
            .execute(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("creating database {DATABASE}: {e}"));
        let _ = admin.close().await;
        db
    }

    /// `mysql://root@127.0.0.1:PORT/stockd`.
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/{DATABASE}", self.port)
    }

    /// The server's own database, which exists before stockd's does.
    fn admin_url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/mysql", self.port)
    }

    /// SIGTERM and wait for the exit: a normal shutdown, which ends open sessions and rolls
    /// their transactions back (like `pg_ctl -m fast stop`).
    pub async fn stop(&mut self) {
        let mut child = self.child.take().expect("stop() needs a running server");
        let pid = child.id().to_string();
        let sent = std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("the kill command exists");
        assert!(sent.success(), "kill -TERM {pid} (mariadbd) failed");
        let until = Instant::now() + STOP_DEADLINE;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < until => tokio::time::sleep(POLL_INTERVAL).await,
                outcome => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "mariadbd did not stop within {STOP_DEADLINE:?} of SIGTERM ({outcome:?})\nserver log:\n{}",
                        self.server_log()
                    );
                }
            }
        }
    }

    /// Starts the stopped server again, on the same port and data.
    pub async fn start(&mut self) {
        if let Err(why) = self.launch().await {
            panic!("mariadbd did not start again on port {}: {why}\nserver log:\n{}", self.port, self.server_log());
        }
    }

    async fn start_on_free_port(&mut self) {
        let mut failures = String::new();
        for _ in 0..START_ATTEMPTS {
            self.port = free_port();
            match self.launch().await {
                Ok(()) => return,
                Err(why) => failures.push_str(&format!("port {}: {why}\n", self.port)),
            }
        }
        panic!("the throwaway MariaDB did not start:\n{failures}server log:\n{}", self.server_log());
    }

    /// Starts `mariadbd` on `self.port` and waits until it accepts a connection.
    async fn launch(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "launch() while mariadbd runs");
        let dir = self.dir.path();
        // Its output goes to a file, not to pipes nobody reads.
        let output = std::fs::File::options()
            .create(true)
            .append(true)
            .open(dir.join("mariadbd.out"))
            .expect("the output file can be opened");
        let mut child = std::process::Command::new(&self.server)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.data.display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", dir.join("mariadbd.sock").display()))
            .arg(format!("--pid-file={}", dir.join("mariadbd.pid").display()))
            .arg(format!("--log-error={}", self.log_path().display()))
            .args(SERVER_OPTIONS)
            .arg(self.tmpdir_option())
            .args(self.user_option())
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(output.try_clone().expect("a file handle can be cloned"))
            .stderr(output)
            .spawn()
            .unwrap_or_else(|e| panic!("{} could not be started: {e}", self.server.display()));
        let until = Instant::now() + START_DEADLINE;
        loop {
            if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
                return Err(format!("mariadbd exited with {status}"));
            }
            if let Ok(conn) = sqlx::MySqlConnection::connect(&self.admin_url()).await {
                let _ = conn.close().await;
                self.child = Some(child);
                return Ok(());
            }
            if Instant::now() >= until {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no connection accepted within {START_DEADLINE:?}"));
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// `--user=mysql` when we are root (the server switches to it), nothing otherwise.
    /// Each server's temporary files in its own directory: a MariaDB that starts deletes every
    /// `#sql*` file in its tmpdir, which in a shared `/tmp` are another running server's
    /// temporary tables (seen: a parallel test's `mariadb-install-db` failing with "Could not
    /// remove temporary table '/tmp/#sql-temptable-…'" and "Unknown table 'mysql.tmp_user_sys'").
    fn tmpdir_option(&self) -> String {
        format!("--tmpdir={}", self.dir.path().display())
    }

    fn user_option(&self) -> Option<String> {
        self.as_root.then(|| format!("--user={OS_USER}"))
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// The server's log so far, for failure messages.
    pub fn server_log(&self) -> String {
        read_log(&self.log_path())
    }
}

impl Drop for ThrowawayMariadb {
    fn drop(&mut self) {
        // Blocking is fine here: the test is over. SIGKILL: the data is thrown away anyway.
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The first of `names` in [`BIN_DIRS`], or on `PATH`.
fn binary(names: &[&str]) -> PathBuf {
    let in_dirs = names.iter().flat_map(|name| BIN_DIRS.iter().map(move |dir| Path::new(dir).join(name)));
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .flat_map(|dir| names.iter().map(move |name| dir.join(name)));
    match in_dirs.chain(on_path).find(|candidate| candidate.is_file()) {
        Some(found) => found,
        None => panic!(
            "none of {names:?} in {BIN_DIRS:?} or on PATH: the fault tests run their own throwaway MariaDB; \
             install the `mariadb-server` package"
        ),
    }
}
