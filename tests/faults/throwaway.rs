//! The database server a fault test stops and starts, chosen like the HTTP suite's backend
//! (`STOCKD_TEST_BACKEND`): a throwaway MariaDB for `mysql`, otherwise a throwaway PostgreSQL.
//! SQLite is a file inside the server's own process, with no database server to stop, so the
//! default (SQLite) pass runs these tests on PostgreSQL.

use crate::mariadb::ThrowawayMariadb;
use crate::pg::ThrowawayPg;

/// One database server of one test; stopped and removed on drop.
pub enum ThrowawayDb {
    Postgres(ThrowawayPg),
    Mariadb(ThrowawayMariadb),
}

impl ThrowawayDb {
    /// A fresh server of the kind `STOCKD_TEST_BACKEND` names, started.
    pub async fn start_new() -> ThrowawayDb {
        match std::env::var("STOCKD_TEST_BACKEND").as_deref() {
            Err(_) | Ok("" | "sqlite" | "postgres") => ThrowawayDb::Postgres(ThrowawayPg::start_new().await),
            Ok("mysql") => ThrowawayDb::Mariadb(ThrowawayMariadb::start_new().await),
            Ok(other) => panic!("STOCKD_TEST_BACKEND={other:?} is not a backend these tests know"),
        }
    }

    /// What the server is, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            ThrowawayDb::Postgres(_) => "PostgreSQL",
            ThrowawayDb::Mariadb(_) => "MariaDB",
        }
    }

    /// stockd's `STOCKD_DATABASE_URL` for it.
    pub fn url(&self) -> String {
        match self {
            ThrowawayDb::Postgres(pg) => pg.url(),
            ThrowawayDb::Mariadb(mariadb) => mariadb.url(),
        }
    }

    /// Stops the server: open sessions end, their transactions roll back.
    pub async fn stop(&mut self) {
        match self {
            ThrowawayDb::Postgres(pg) => pg.stop().await,
            ThrowawayDb::Mariadb(mariadb) => mariadb.stop().await,
        }
    }

    /// Starts the stopped server again, on the same port and data.
    pub async fn start(&mut self) {
        match self {
            ThrowawayDb::Postgres(pg) => pg.start().await,
            ThrowawayDb::Mariadb(mariadb) => mariadb.start().await,
        }
    }

    /// The server's log so far, for failure messages.
    pub fn server_log(&self) -> String {
        match self {
            ThrowawayDb::Postgres(pg) => pg.server_log(),
            ThrowawayDb::Mariadb(mariadb) => mariadb.server_log(),
        }
    }
}
