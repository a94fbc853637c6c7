// @ts-check
/**
 * A test fixture the host must survive, in JavaScript: its behaviour is chosen by the whole
 * plugin configuration text (surrounding whitespace ignored).
 *
 * - `loop`: never returns (an endless loop; fuel or the time limit stops it);
 * - `memory`: allocates without end (the memory limit stops it);
 * - `throw`: throws an `Error`, which is not a refusal: the instance traps;
 * - anything else: plans exactly like stockd's built-in default.
 */
import { defaultPlan, trim } from "../sdk/stockd.js";

/** Bytes added to the hoard per step of the `memory` mode: large, so that few steps (each an
 * allocation and a memory.grow) reach the memory limit long before the time limit, even on a
 * machine busy with other work. */
const HOARD_STEP_BYTES = 16 << 20;

/**
 * @param {import("../sdk/stockd.js").Order} order
 * @param {import("../sdk/stockd.js").Context} ctx
 * @returns {import("../sdk/stockd.js").Plan}
 */
export function plan(order, ctx) {
  switch (trim(ctx.config)) {
    case "loop":
      for (;;) {
        // Nothing: burns fuel until the host stops it.
      }
    case "memory": {
      const hoard = [];
      for (;;) {
        // Zeroed by the engine with bulk memory operations, so memory, not fuel, runs out.
        hoard.push(new Uint8Array(HOARD_STEP_BYTES));
      }
    }
    case "throw":
      throw new Error("the hostile fixture throws on purpose");
    default:
      return defaultPlan(order);
  }
}
