// @ts-check
/**
 * Flash sales: every line deducts its SKU's inventory, each user may take at most one piece
 * of each SKU (the limit `flash:{sku}:{user}`, max 1, enforced by stockd atomically with the
 * deduction), and the SKU's buckets are tried starting from one picked by the user id, so
 * concurrent buyers spread over the buckets instead of queueing on the first one.
 *
 * Configuration: `buckets = N` (1..=1024, default 8), the number of buckets the flash-sale
 * SKUs were created with. Orders without a `user_id` are refused.
 *
 * The same rules as the Rust example `plugins/flash-sale`, with the same plans and refusals.
 */
import { checkedKey, configNumber, planned, requireUser, stableHash, target } from "../sdk/stockd.js";

/** Buckets a flash-sale SKU is split into unless the configuration says otherwise. */
const DEFAULT_BUCKETS = 8;

/**
 * @param {import("../sdk/stockd.js").Order} order
 * @param {import("../sdk/stockd.js").Context} ctx
 * @returns {import("../sdk/stockd.js").Plan}
 */
export function plan(order, ctx) {
  const user = requireUser(order, "a flash sale allows one piece per user and SKU");
  const buckets = configNumber(ctx.config, "buckets", DEFAULT_BUCKETS, 1, 1024);
  const bucketsInOrder = bucketOrder(user, buckets);
  const lines = order.lines.map((line, index) => {
    const limit = { key: checkedKey(`flash:${line.key}:${user}`, "limit key"), max: 1n };
    const sku = { ...target(line.key), kind: /** @type {const} */ ("inventory"), buckets: bucketsInOrder };
    return { ...planned(index, line, [sku]), limit };
  });
  return { policy: "all-or-nothing", lines };
}

/**
 * All `count` buckets, starting at the user's own (a stable hash of the id) and wrapping
 * around, so a full bucket falls back to the next one.
 * @param {string} user
 * @param {number} count
 */
function bucketOrder(user, count) {
  const start = Number(stableHash(user) % BigInt(count));
  return Uint32Array.from({ length: count }, (_, i) => (start + i) % count);
}
