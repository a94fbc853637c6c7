// @ts-check
/**
 * {{name}}: a stockd planning plugin in JavaScript.
 *
 * stockd calls `plan` once for every order of your tenant, with the order (its lines, each a
 * `key`, a `qty` and `attributes`) and a context (`tenant`, `nowMs`, `seed`, and `config`, the
 * configuration text uploaded with the plugin). The plan says, for each line, which resource it
 * takes from (then which fallbacks), under which per-user limit, and whether the order may partly
 * succeed; stockd does the deductions, atomically and exactly once.
 *
 * This starting point plans like stockd's built-in default, but insists on inventory: each line
 * takes its own quantity from the resource named by its key, which must be an `inventory`
 * resource, and either every line applies or none does. The comments show where the other
 * decisions go; `cases.toml` holds sample orders and the plans they must produce.
 *
 * A plugin imports nothing (no clock, randomness, files, network or console), so `Date`,
 * `Math.random` and `console` must not decide anything. `qty`, `max` and `createIfMissing` are
 * BigInts. Throwing a string (or `refuse(reason)`) refuses the order with that reason; any other
 * exception fails only the order being planned.
 */
import { planned, target } from "./sdk/stockd.js";

/**
 * @param {import("./sdk/stockd.js").Order} order
 * @param {import("./sdk/stockd.js").Context} ctx
 * @returns {import("./sdk/stockd.js").Plan}
 */
export function plan(order, ctx) {
  // Configuration, `name = value` lines (a bad value refuses the order readably):
  //     const buckets = configNumber(ctx.config, "buckets", 8, 1, 1024);
  void ctx;
  // Per-user limits need a user; refuse orders without one:
  //     const user = requireUser(order, "purchases are limited per user");
  const lines = order.lines.map((line, index) => {
    // The resource this line takes from. Keys you build from client input (attributes, the
    // user id) must be checked, so a bad one refuses the order readably:
    //     const warehouse = attribute(line, "warehouse") ?? "main";
    //     const resource = checkedKey(`${line.key}:${warehouse}`, "stock key");
    const primary = {
      ...target(line.key),
      // The kind the resource must be: a line whose resource is of another kind fails as
      // `resource_not_found`. `undefined` accepts any kind.
      kind: /** @type {const} */ ("inventory"),
      // A missing resource (a new quota period, say) created on first use with this
      // allowance, instead of failing the line:
      //     createIfMissing: 1000n,
      // For a bucketed resource, the order its buckets are tried in (empty: stockd's default).
    };
    // Fallbacks: up to 7 more targets, tried in order when the ones before run short:
    //     const fallback = target(checkedKey(`${line.key}:central`, "fallback key"));
    //     return planned(index, line, [primary, fallback]);
    return {
      ...planned(index, line, [primary]),
      // A per-user limit, enforced by stockd atomically with the deduction:
      //     limit: { key: checkedKey(`max5:${line.key}:${user}`, "limit key"), max: 5n },
      // With policy "mandatory-lines", the lines the order cannot do without:
      //     mandatory: true,
    };
  });
  // "all-or-nothing", "allow-partial" (lines that can apply do) or "mandatory-lines".
  return { policy: "all-or-nothing", lines };
}
