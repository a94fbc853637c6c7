//! A randomized model check of stockd, in the spirit of TigerBeetle's simulator, smaller.
//!
//! Each test starts real `stockd` processes (two on one fresh PostgreSQL database, or one on a
//! fresh SQLite file), with redis mode on a private `redis-server` the test owns, and drives
//! them with a seeded random mix of orders, reservations and their moves, adjustments,
//! replays, mode switches, plugin versions and faults (kill -9 and restart of a process, a
//! paused process, the database's table held, Redis restarted empty or from an older
//! snapshot). A reference model (`model.rs`) holds what every
//! acknowledged answer implies, and the servers are checked against it after every step and,
//! once everything has settled, in full: counters, ledger, reconciliation, Redis, replays.
//!
//! `STOCKD_MODEL_SEED` replays a run's choices (the seed is printed at the start and in every
//! failure); `STOCKD_MODEL_STEPS` sets the number of steps per test (default 250). Timing
//! (which request meets which sweep or settlement) is the machine's, so a seed reproduces the
//! sequence of operations, not every interleaving. See docs/TESTING.md.

#[path = "../api/helpers.rs"]
#[allow(dead_code)]
mod helpers;
mod model;
#[path = "../api/redis_support.rs"]
#[allow(dead_code)]
mod redis_support;
mod sim;

use helpers::Backend;

/// Two processes on one PostgreSQL database: requests go to either, faults hit either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_check_two_processes_on_postgresql() {
    sim::run(Backend::Postgres, 2, 0x5eed_0001).await;
}

/// One process on a SQLite file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_check_one_process_on_sqlite() {
    sim::run(Backend::Sqlite, 1, 0x5eed_0002).await;
}
