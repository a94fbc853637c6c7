//! stockd: a multi-tenant server that deducts consumable resources (inventory, balances,
//! coupons, quotas) without overselling, double-charging or losing an acknowledged request.
//!
//! Crate map:
//! - [`api`]: the REST contract over axum: extractors, handlers, problem+json, OpenAPI.
//! - [`engine`]: the pure domain: newtypes, plans, order outcomes, ledger arithmetic.
//! - [`pipeline`]: the one path of every mutating request: validate, plan, route (database or
//!   redis mode), execute; a key's first answer wins over anything that would answer now.
//! - [`apply`]: every state change on the database, written once over a narrow storage port.
//! - [`storage`]: the storage trait and its backends (SQLite, PostgreSQL), each with group commit;
//!   a backend is SQL text and plumbing behind [`apply::port::Port`].
//! - [`redis_mode`]: redis mode (flash sales): Lua pre-deduction, stream write-behind, sold-out.
//! - [`events`]: the transactional outbox: event types, the feed, webhooks, the broker sink.
//! - [`webhooks`]: delivery of the outbox to tenants' receivers (Standard Webhooks, SSRF-guarded).
//! - [`jobs`]: reservation expiry, reconciliation, idempotency purge, Redis settlement.
//! - [`plugin`]: tenant planning plugins (WebAssembly components) run by wasmtime.
//! - [`auth`]: API keys and the admin token (hashed, constant-time).
//! - [`ratelimit`]: per-tenant request rate limits (a token bucket per tenant).
//! - [`config`], [`startup`], [`cli`], [`telemetry`]: running the process.
//! - [`bench`]: `stockd bench`, the closed-loop load generator and its baselines.

pub mod api;
pub mod apply;
pub mod auth;
pub mod bench;
pub mod cli;
pub mod config;
pub mod engine;
pub mod events;
pub mod jobs;
pub mod pipeline;
pub mod plugin;
pub mod problem;
pub mod ratelimit;
pub mod redis_mode;
pub mod startup;
pub mod storage;
pub mod telemetry;
pub mod time;
pub mod webhooks;
