//! The connection to Redis: one server, a Redis Cluster, or the master a set of Sentinels
//! names. One multiplexed connection per process, shared by every request; when a command fails
//! because the connection broke, timed out or reached a server that is no longer the master
//! (`READONLY` after a failover), the connection is dropped and the next command connects
//! again, asking the Sentinels for the current master first. Nothing is retried here: the
//! caller answers `503 unavailable` and the client retries with the same idempotency key,
//! which the Lua scripts make harmless.
//!
//! Every connection made is counted ([`Link::generation`]): what Redis holds may have changed
//! beyond this process's knowledge across a new connection (a restart, possibly from an older
//! snapshot, or a failover), so the process reads the resources' modes again before it sells
//! through it (`RedisMode::catch_up`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};

/// Where Redis is.
pub enum Topology {
    /// `redis://host:port/db`.
    Single(String),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
    /// Sentinel addresses and the master's service name.
    Sentinel { sentinels: Vec<String>, master: String },
}

enum Source {
    Single(redis::Client),
    Cluster(ClusterClient),
    Sentinel(tokio::sync::Mutex<SentinelClient>),
}

/// A live connection of either shape; cheap to clone (both are handles to one socket task).
#[derive(Clone)]
pub enum Conn {
    Plain(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Plain(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Plain(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Plain(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The process's way to Redis.
pub struct Link {
    source: Source,
    current: Mutex<Option<Conn>>,
    /// How many connections were made (the first is 1).
    generation: AtomicU64,
    /// Held while a connection is made, so that callers who find none at once make one between
    /// them: each connection made counts as a new generation, and a second one made beside the
    /// first would make every mode view read meanwhile look older than the connection (a sale
    /// answered `503`, "being warmed or switched", by a process that had just caught up).
    connecting: tokio::sync::Mutex<()>,
    timeout: Duration,
    /// A plain client for pub/sub (one node is enough: PUBLISH reaches every node of a cluster).
    pubsub: Option<redis::Client>,
}

impl Link {
    /// Builds the link; connects lazily, so a process starts while Redis is down.
    pub fn new(topology: Topology, timeout: Duration) -> RedisResult<Self> {
        let (source, pubsub) = match topology {
            Topology::Single(url) => {
                let client = redis::Client::open(url.as_str())?;
                (Source::Single(client.clone()), Some(client))
            }
            Topology::Cluster(nodes) => {
                let pubsub = nodes.first().map(|n| redis::Client::open(n.as_str())).transpose()?;
                let client =
                    ClusterClient::builder(nodes).connection_timeout(timeout).response_timeout(timeout).build()?;
                (Source::Cluster(client), pubsub)
            }
            Topology::Sentinel { sentinels, master } => {
                let client = SentinelClient::build(sentinels, master, None, SentinelServerType::Master)?;
                (Source::Sentinel(tokio::sync::Mutex::new(client)), None)
            }
        };
        Ok(Self {
            source,
            current: Mutex::new(None),
            generation: AtomicU64::new(0),
            connecting: tokio::sync::Mutex::new(()),
            timeout,
            pubsub,
        })
    }

    fn config(&self) -> AsyncConnectionConfig {
        AsyncConnectionConfig::new().set_connection_timeout(Some(self.timeout)).set_response_timeout(Some(self.timeout))
    }

    /// The connection made last, unless it was forgotten as broken.
    fn current(&self) -> Option<Conn> {
        self.current.lock().ok().and_then(|c| c.clone())
    }

    /// The current connection, connecting first if there is none.
    pub async fn conn(&self) -> RedisResult<Conn> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _one = self.connecting.lock().await;
        // Another caller may have connected while this one waited.
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let conn = match &self.source {
            Source::Single(client) => {
                Conn::Plain(client.get_multiplexed_async_connection_with_config(&self.config()).await?)
            }
            Source::Cluster(client) => Conn::Cluster(client.get_async_connection().await?),
            Source::Sentinel(sentinel) => {
                let client =
                    tokio::time::timeout(self.timeout, async { sentinel.lock().await.async_get_client().await })
                        .await
                        .map_err(|_| RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut)))??;
                Conn::Plain(client.get_multiplexed_async_connection_with_config(&self.config()).await?)
            }
        };
        if let Ok(mut current) = self.current.lock() {
            *current = Some(conn.clone());
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(conn)
    }

    /// How many connections this process has made to Redis so far: a higher count than the one
    /// a view of Redis was taken under means the view may be older than what Redis holds.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Looks at a failed command: if the connection is no good any more, forget it.
    pub fn judge(&self, err: &RedisError) {
        let stale = err.is_io_error()
            || err.is_timeout()
            || err.is_connection_dropped()
            || err.is_connection_refusal()
            || err.is_unrecoverable_error()
            || matches!(err.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"));
        if stale {
            if let Ok(mut current) = self.current.lock() {
                current.take();
            }
        }
    }

    /// Runs one command or script on the current connection, forgetting it if it broke.
    pub async fn query<T: redis::FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        let mut conn = self.conn().await?;
        let result = cmd.query_async(&mut conn).await;
        if let Err(err) = &result {
            self.judge(err);
        }
        result
    }

    /// A client for pub/sub: the single node, the first cluster seed, or the current master.
    pub async fn pubsub_client(&self) -> RedisResult<redis::Client> {
        match (&self.pubsub, &self.source) {
            (Some(client), _) => Ok(client.clone()),
            (None, Source::Sentinel(sentinel)) => sentinel.lock().await.async_get_client().await,
            (None, _) => Err(RedisError::from((redis::ErrorKind::Client, "no pub/sub node configured"))),
        }
    }
}
