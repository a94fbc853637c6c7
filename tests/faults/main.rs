//! Fault-injection tests for `stockd` on a database server.
//!
//! Each test runs its own throwaway database server and real `stockd serve` processes against
//! it, so stopping the database disturbs no other test: PostgreSQL (`pg::ThrowawayPg`: initdb in
//! a temporary directory, a free port, an unprivileged OS user), or MariaDB with
//! `STOCKD_TEST_BACKEND=mysql` (`mariadb::ThrowawayMariadb`: mariadb-install-db in a temporary
//! directory, a free port, the `mysql` OS user when run as root); see `throwaway.rs`. They need
//! the server binaries (`/usr/lib/postgresql/*/bin`, or `mariadbd` and `mariadb-install-db`)
//! and fail, never skip, without them.

mod database;
mod harness;
mod mariadb;
mod pg;
mod process;
mod throwaway;
