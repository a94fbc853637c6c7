//! Marketplaces: an order holds items from independent sellers, so lines that can apply do
//! (partial success). Each line is a SKU stocked per warehouse as `{sku}:{warehouse}`: the
//! line's `warehouse` attribute is tried first, then the fallback warehouse.
//!
//! Configuration: `fallback = NAME`, the warehouse tried when the line's own is short or when
//! the line names none (default `central`).
#![no_std]

use stockd_plugin_sdk::*;

/// The warehouse tried second unless the configuration names another.
const DEFAULT_FALLBACK: &str = "central";

struct Marketplace;

impl Guest for Marketplace {
    fn plan(order: Order, ctx: Context) -> Result<Plan, String> {
        let fallback = config_value(&ctx.config, "fallback").unwrap_or(DEFAULT_FALLBACK);
        let mut lines = Vec::with_capacity(order.lines.len());
        for (index, line) in order.lines.iter().enumerate() {
            let mut warehouses = Vec::with_capacity(2);
            if let Some(own) = attribute(line, "warehouse") {
                warehouses.push(own);
            }
            if !warehouses.contains(&fallback) {
                warehouses.push(fallback);
            }
            let mut targets = Vec::with_capacity(warehouses.len());
            for warehouse in warehouses {
                let resource = checked_key(format!("{}:{warehouse}", line.key), "stock key")?;
                targets.push(Target { kind: Some(Kind::Inventory), ..target(resource) });
            }
            lines.push(planned(index, line, targets));
        }
        Ok(Plan { policy: Policy::AllowPartial, lines })
    }
}

export_planner!(Marketplace);
