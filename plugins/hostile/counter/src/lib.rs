//! Test fixture: keeps state between calls, to show how long an instance lives. Each line's
//! quantity is the number of calls this instance has served, counting this one; an order
//! whose id is `trap` panics instead.
#![no_std]

use core::sync::atomic::{AtomicI64, Ordering};

use stockd_plugin_sdk::*;

/// Calls served by this instance: survives between calls, dies with the instance.
static CALLS: AtomicI64 = AtomicI64::new(0);

struct Counter;

impl Guest for Counter {
    fn plan(order: Order, _ctx: Context) -> Result<Plan, String> {
        let calls = CALLS.fetch_add(1, Ordering::Relaxed) + 1;
        if order.order_id == "trap" {
            panic!("asked to trap");
        }
        let lines = order
            .lines
            .iter()
            .enumerate()
            .map(|(index, line)| PlannedLine { qty: calls, ..planned(index, line, vec![target(line.key.clone())]) })
            .collect();
        Ok(Plan { policy: Policy::AllOrNothing, lines })
    }
}

export_planner!(Counter);
