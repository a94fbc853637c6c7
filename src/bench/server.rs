//! The server under test: a child process of the current executable on a free port with a
//! fresh database (SQLite file in a temp dir, or a fresh PostgreSQL or MySQL database that is
//! dropped at the end), or an already running server given by `--url`.

use std::path::PathBuf;
use std::process::Stdio;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context};
use sqlx::mysql::MySqlConnectOptions;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::Backend;

/// Where the bench process itself can reach the server's database (for the baselines).
#[derive(Debug, Clone)]
pub enum DbAccess {
    /// Path of the SQLite file the server uses.
    Sqlite(PathBuf),
    /// URL of the fresh PostgreSQL database the server uses.
    Postgres(String),
    /// URL of the fresh MySQL (or MariaDB) database the server uses.
    Mysql(String),
}

/// The database servers the bench creates a database on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DbServer {
    Postgres,
    Mysql,
}

/// A database the bench created on a server (PostgreSQL or MySQL) and drops at the end (not
/// `Clone`: it is dropped once).
#[derive(Debug)]
pub struct FreshDatabase {
    server: DbServer,
    admin_url: String,
    name: String,
    /// The URL of the new database: `admin_url` with its database name replaced.
    pub url: String,
}

impl FreshDatabase {
    /// Creates `stockd_bench_<random>` through `admin_url` (any database of the server).
    pub async fn create(backend: Backend, admin_url: &str) -> anyhow::Result<Self> {
        let server = match backend {
            Backend::Postgres => DbServer::Postgres,
            Backend::Mysql => DbServer::Mysql,
            Backend::Sqlite => bail!("a SQLite database is a file, not created on a server"),
        };
        let name = format!("stockd_bench_{}", random_hex(6));
        // The name is ours (letters, digits, underscores): no quoting needed on either server.
        let sql = format!("CREATE DATABASE {name}");
        let created = async {
            match server {
                DbServer::Postgres => {
                    let mut conn = PgConnectOptions::from_str(admin_url)?.connect().await?;
                    sqlx::query(&sql).execute(&mut conn).await?;
                    conn.close().await
                }
                DbServer::Mysql => {
                    let mut conn = MySqlConnectOptions::from_str(admin_url)?.connect().await?;
                    sqlx::query(&sql).execute(&mut conn).await?;
                    conn.close().await
                }
            }
        };
        created.await.with_context(|| format!("creating database {name} through {admin_url}"))?;
        let url = with_database(admin_url, &name);
        Ok(Self { server, admin_url: admin_url.to_string(), name, url })
    }

    /// How the bench reaches the database itself.
    pub fn access(&self) -> DbAccess {
        match self.server {
            DbServer::Postgres => DbAccess::Postgres(self.url.clone()),
            DbServer::Mysql => DbAccess::Mysql(self.url.clone()),
        }
    }

    /// Drops the database. PostgreSQL's connections to it are ended first; MySQL waits for
    /// the open transactions on its tables, and its connections' next statements then fail.
    pub async fn drop_database(self) {
        let dropped = async {
            match self.server {
                DbServer::Postgres => {
                    let mut conn = PgConnectOptions::from_str(&self.admin_url)?.connect().await?;
                    sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name))
                        .execute(&mut conn)
                        .await?;
                    conn.close().await
                }
                DbServer::Mysql => {
                    let mut conn = MySqlConnectOptions::from_str(&self.admin_url)?.connect().await?;
                    sqlx::query(&format!("DROP DATABASE IF EXISTS {}", self.name)).execute(&mut conn).await?;
                    conn.close().await
                }
            }
        };
        if let Err(err) = dropped.await {
            eprintln!("bench: could not drop database {}: {err}", self.name);
        }
    }
}

/// A running (or external) server and what is needed to clean up after it.
pub struct Server {
    /// Base URL, e.g. `http://127.0.0.1:40123`.
    pub base: String,
    /// The admin token to create the tenant with.
    pub admin_token: String,
    /// The child's pid (for `/proc/<pid>/status`), when we started it.
    pub pid: Option<u32>,
    /// Direct access to its database, when we created it.
    pub db: Option<DbAccess>,
    child: Option<Child>,
    temp_dir: Option<PathBuf>,
    fresh: Option<FreshDatabase>,
    /// The Redis and the key prefix of this run's server, whose keys `stop` deletes.
    redis_keys: Option<(String, String)>,
}

/// A process's CPU time so far (user + system, µs): fields 14 and 15 of `/proc/<pid>/stat`,
/// counted after the command name (which may hold spaces and parentheses).
pub fn cpu_us_of(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 1..)?.split_whitespace().collect();
    // After the name: field 3 (state) is index 0, so utime (14) is 11 and stime (15) is 12.
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok().filter(|t| *t > 0)?;
    Some(ticks.saturating_mul(1_000_000) / per_second)
}

/// A random lowercase hex string of `bytes` random bytes.
pub fn random_hex(bytes: usize) -> String {
    let raw: Vec<u8> = (0..bytes).map(|_| rand::random::<u8>()).collect();
    hex::encode(raw)
}

/// Replaces the database name (the URL path) of a PostgreSQL or MySQL URL.
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (url, String::new()),
    };
    let host_start = base.find("://").map_or(0, |i| i + 3);
    let authority_end = base[host_start..].find('/').map_or(base.len(), |i| host_start + i);
    format!("{}/{db}{query}", &base[..authority_end])
}

impl Server {
    /// Uses a server that is already running; only 127.0.0.1 / localhost is accepted.
    pub fn external(url: &str, admin_token: Option<String>) -> anyhow::Result<Self> {
        let base = url.trim_end_matches('/').to_string();
        let rest = base.strip_prefix("http://").context("--url must be http://127.0.0.1:PORT")?;
        if !(rest.starts_with("127.0.0.1:") || rest.starts_with("localhost:")) {
            bail!("--url must target 127.0.0.1 (got {url})");
        }
        let admin_token = admin_token.context("--url needs --admin-token (or STOCKD_ADMIN_TOKEN)")?;
        Ok(Self { base, admin_token, pid: None, db: None, child: None, temp_dir: None, fresh: None, redis_keys: None })
    }

    /// Measures the CPU time and RSS of the process `pid` (an external server's).
    pub fn with_pid(mut self, pid: Option<u32>) -> Self {
        self.pid = self.pid.or(pid);
        self
    }

    /// Starts `stockd serve` as a child process on a fresh database and waits until it listens.
    /// `admin_db_url` is the server a PostgreSQL or MySQL database is created on.
    pub async fn start(backend: Backend, admin_db_url: Option<&str>) -> anyhow::Result<Self> {
        let admin_token = random_hex(24);
        let (db_url, db, temp_dir, fresh) = match backend {
            Backend::Sqlite => {
                let dir = std::env::temp_dir().join(format!("stockd-bench-{}", random_hex(6)));
                std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
                let file = dir.join("bench.db");
                (format!("sqlite://{}", file.display()), DbAccess::Sqlite(file), Some(dir), None)
            }
            Backend::Postgres | Backend::Mysql => {
                let admin_db_url = admin_db_url.context("--database-url is needed for this backend")?;
                let fresh = FreshDatabase::create(backend, admin_db_url).await?;
                (fresh.url.clone(), fresh.access(), None, Some(fresh))
            }
        };
        // A Redis key prefix of the run's own (unless one is given), deleted with its keys when
        // the server stops: a fresh database beside another run's Redis keys is not fresh.
        let redis_keys = match (std::env::var("STOCKD_REDIS_URL"), std::env::var_os("STOCKD_REDIS_PREFIX")) {
            (Ok(url), None) => Some((url, format!("stockd-bench-{}", random_hex(6)))),
            _ => None,
        };
        let exe = std::env::current_exe().context("locating the stockd executable")?;
        let mut command = Command::new(exe);
        if let Some((_, prefix)) = &redis_keys {
            command.env("STOCKD_REDIS_PREFIX", prefix);
        }
        let mut child = command
            .arg("serve")
            .env("STOCKD_LISTEN", "127.0.0.1:0")
            .env("STOCKD_DATABASE_URL", &db_url)
            .env("STOCKD_ADMIN_TOKEN", &admin_token)
            .env("RUST_LOG", std::env::var("STOCKD_BENCH_SERVER_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting `stockd serve`")?;
        let pid = child.id();
        let stdout = child.stdout.take().context("server stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut server = Self {
            base: String::new(),
            admin_token,
            pid,
            db: Some(db),
            child: Some(child),
            temp_dir,
            fresh,
            redis_keys,
        };
        let wait = async {
            while let Some(line) = lines.next_line().await? {
                if let Some(addr) = line.trim().strip_prefix("listening on ") {
                    return Ok::<_, anyhow::Error>(Some(addr.to_string()));
                }
            }
            Ok(None)
        };
        let addr = match tokio::time::timeout(Duration::from_secs(60), wait).await {
            Ok(Ok(Some(addr))) => addr,
            Ok(Ok(None)) => {
                server.stop().await;
                bail!("the server exited before listening")
            }
            Ok(Err(err)) => {
                server.stop().await;
                return Err(err.context("reading the server's stdout"));
            }
            Err(_) => {
                server.stop().await;
                bail!("the server did not listen within 60 s")
            }
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        server.base = addr.trim_end_matches('/').to_string();
        Ok(server)
    }

    /// Peak resident set size of the server so far (VmHWM), in KiB.
    /// The server's CPU time so far (user + system, µs), from `/proc/<pid>/stat`.
    pub fn cpu_us(&self) -> Option<u64> {
        cpu_us_of(self.pid?)
    }

    pub fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid?)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    /// Stops the child, removes the temp dir and drops the PostgreSQL or MySQL database.
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
        }
        if let Some(dir) = self.temp_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
        if let Some(fresh) = self.fresh.take() {
            fresh.drop_database().await;
        }
        if let Some((url, prefix)) = self.redis_keys.take() {
            if tokio::time::timeout(Duration::from_secs(60), delete_keys(&url, &prefix)).await.is_err() {
                eprintln!("bench: the Redis keys under {prefix}: were not all deleted within 60 s");
            }
        }
    }
}

/// Deletes every Redis key under `prefix:` (the request records a redis-mode run leaves live
/// for `idempotency.retention_hours`).
async fn delete_keys(url: &str, prefix: &str) {
    let Ok(client) = redis::Client::open(url) else { return };
    let Ok(mut con) = client.get_multiplexed_async_connection().await else {
        eprintln!("bench: could not reach Redis to delete the keys under {prefix}:");
        return;
    };
    let mut cursor: u64 = 0;
    loop {
        let page: redis::RedisResult<(u64, Vec<String>)> = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut con)
            .await;
        let Ok((next, keys)) = page else { return };
        if !keys.is_empty() {
            let _: redis::RedisResult<i64> = redis::cmd("UNLINK").arg(&keys).query_async(&mut con).await;
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn replaces_the_database_name() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "b"),
            "postgres://postgres@127.0.0.1:5432/b"
        );
        assert_eq!(with_database("postgres://u@h:1", "b"), "postgres://u@h:1/b");
        assert_eq!(with_database("postgres://u@h/x?sslmode=disable", "b"), "postgres://u@h/b?sslmode=disable");
        assert_eq!(with_database("mysql://root@127.0.0.1:3306/mysql", "b"), "mysql://root@127.0.0.1:3306/b");
    }
}
