//! Black-box API tests for `stockd`.
//!
//! Every test starts the real binary (`stockd serve`) on a free port against a fresh database in
//! its own temporary directory and talks HTTP to it, exactly like a client would. All API tests
//! compile into this one test binary so the (large) server crate is linked once.
//!
//! The storage backend is chosen in one place, `helpers::Backend` (env `STOCKD_TEST_BACKEND`:
//! `sqlite`, the default, `postgres` or `mysql`), so the same suite runs against every backend.

mod bench;
mod bombs;
mod buckets;
mod cluster;
mod concurrency;
mod config_tenants;
mod console;
mod crash;
mod ended_sessions;
mod events;
mod helpers;
mod idempotency;
mod isolation;
mod jobs;
mod ledger_keys;
mod nats_sink;
mod openapi;
mod ops;
mod orders;
mod plugin_isolation;
mod plugin_languages;
mod plugin_new;
mod plugin_runtimes;
mod plugins;
mod procfs;
mod query_plans;
mod rate_limits;
mod reconciliation;
mod redis_fencing;
mod redis_mode;
mod redis_support;
mod replays;
mod reservations;
mod resources;
mod retention;
mod reversals;
mod tenants;
mod validation;
mod webhooks;
