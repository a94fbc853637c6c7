//! Test fixture: a plugin that is expensive but legal. It spins `burn = N` loop iterations
//! (its configuration text; 0 when absent), then plans exactly like `plugins/default`: each
//! line takes from the resource named by its key, all-or-nothing. Configured to burn most of
//! the fuel budget, every order succeeds yet costs the host milliseconds of CPU, which is what
//! a noisy tenant looks like (`stockd bench --scenarios noisy-neighbour`).
#![no_std]

use stockd_plugin_sdk::*;

struct FuelBurner;

impl Guest for FuelBurner {
    fn plan(order: Order, ctx: Context) -> Result<Plan, String> {
        let burn: u64 = config_value(&ctx.config, "burn").and_then(|v| v.parse().ok()).unwrap_or(0);
        let mut turns: u64 = 0;
        for _ in 0..burn {
            // `black_box` keeps the optimizer from folding the loop into one addition.
            turns = core::hint::black_box(turns.wrapping_add(order.lines.len() as u64));
        }
        core::hint::black_box(turns);
        Ok(default_plan(&order))
    }
}

export_planner!(FuelBurner);
