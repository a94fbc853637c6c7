//! Fault-injection tests for `stockd` on PostgreSQL.
//!
//! Each test runs its own throwaway PostgreSQL server (`pg::ThrowawayPg`: initdb in a temporary
//! directory, a free port, an unprivileged OS user) and real `stockd serve` processes against it,
//! so stopping the database disturbs no other test. They need the PostgreSQL server binaries
//! (`/usr/lib/postgresql/*/bin`) and fail, never skip, without them.

mod database;
mod harness;
mod pg;
mod process;
