// @ts-check
/**
 * Marketplaces: an order holds items from independent sellers, so lines that can apply do
 * (partial success). Each line is a SKU stocked per warehouse as `{sku}:{warehouse}`: the
 * line's `warehouse` attribute is tried first, then the fallback warehouse.
 *
 * Configuration: `fallback = NAME`, the warehouse tried when the line's own is short or when
 * the line names none (default `central`).
 *
 * The same rules as the Rust example `plugins/marketplace`, with the same plans and refusals.
 */
import { attribute, checkedKey, configValue, planned, target } from "../sdk/stockd.js";

/** The warehouse tried second unless the configuration names another. */
const DEFAULT_FALLBACK = "central";

/**
 * @param {import("../sdk/stockd.js").Order} order
 * @param {import("../sdk/stockd.js").Context} ctx
 * @returns {import("../sdk/stockd.js").Plan}
 */
export function plan(order, ctx) {
  const fallback = configValue(ctx.config, "fallback") ?? DEFAULT_FALLBACK;
  const lines = order.lines.map((line, index) => {
    const warehouses = [];
    const own = attribute(line, "warehouse");
    if (own !== undefined) {
      warehouses.push(own);
    }
    if (!warehouses.includes(fallback)) {
      warehouses.push(fallback);
    }
    const targets = warehouses.map((warehouse) => ({
      ...target(checkedKey(`${line.key}:${warehouse}`, "stock key")),
      kind: /** @type {const} */ ("inventory"),
    }));
    return planned(index, line, targets);
  });
  return { policy: "allow-partial", lines };
}
