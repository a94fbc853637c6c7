//! Test fixture: never returns. stockd must stop it when its fuel runs out.
#![no_std]

use stockd_plugin_sdk::*;

struct Spin;

impl Guest for Spin {
    fn plan(order: Order, _ctx: Context) -> Result<Plan, String> {
        let mut turns: u64 = 0;
        loop {
            // `black_box` keeps the optimizer from proving anything about the loop.
            turns = core::hint::black_box(turns.wrapping_add(order.lines.len() as u64));
        }
    }
}

export_planner!(Spin);
