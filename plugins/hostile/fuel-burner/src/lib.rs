//! Test and benchmark fixture: an expensive but well-behaved plugin. Every call first spins
//! `burn` loop iterations, read from the tenant's plugin configuration (`burn = 2000000`;
//! default 0, at most 10^12), then plans exactly like the built-in default: each line takes
//! its quantity from the resource named by its key, all-or-nothing.
//!
//! One iteration costs a few units of fuel, so `burn` sets how long a call holds a plan thread
//! without the plugin ever misbehaving; a `burn` beyond the fuel budget fails the order with
//! `plugin_failed` (out of fuel), as any plugin that does too much would.
#![no_std]

use stockd_plugin_sdk::*;

/// Largest `burn` accepted: far beyond any fuel budget, so fuel (or a time limit) stops it.
const MAX_BURN: i64 = 1_000_000_000_000;

struct FuelBurner;

impl Guest for FuelBurner {
    fn plan(order: Order, ctx: Context) -> Result<Plan, String> {
        let burn = config_number(&ctx.config, "burn", 0, 0, MAX_BURN)?;
        let mut turns: u64 = 0;
        for _ in 0..burn {
            // `black_box` keeps the optimizer from replacing the loop by its result.
            turns = core::hint::black_box(turns.wrapping_add(1));
        }
        core::hint::black_box(turns);
        Ok(default_plan(&order))
    }
}

export_planner!(FuelBurner);
