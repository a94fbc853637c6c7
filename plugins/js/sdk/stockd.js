// @ts-check
/**
 * Everything a stockd planning plugin written in JavaScript needs besides its own rules: the
 * same helpers as the Rust SDK (`plugins/sdk`), giving the same answers on the same input, so a
 * plugin ported between the two plans and refuses orders identically.
 *
 * A plugin is an ES module exporting `plan(order, ctx)`, built into a component by
 * componentize-js against the `planner` world of `wit/stockd-plugin.wit`. The shapes follow
 * jco's mapping of the WIT (see `types/planner.d.ts`): records are objects with camelCase
 * fields (`createIfMissing`), enums are strings (`"all-or-nothing"`), an `option` is the
 * value or `undefined`, and every `s64`/`u64` (`qty`, `max`, `createIfMissing`, `nowMs`,
 * `seed`) is a BigInt.
 *
 * Returning a plan answers `ok`. A refusal (`err`) is a thrown string or {@link Refusal};
 * every helper here that can refuse throws a `Refusal`. Any other exception (a `TypeError`
 * from a bug, say) traps the instance, which stockd reports as `plugin_failed`, like a
 * panic in Rust.
 *
 * ```js
 * import { defaultPlan, requireUser } from "../sdk/stockd.js";
 *
 * export function plan(order, ctx) {
 *   requireUser(order, "purchases are limited per user"); // refuses an order without one
 *   return defaultPlan(order);
 * }
 * ```
 *
 * @typedef {import("./types/planner").Order} Order
 * @typedef {import("./types/planner").OrderLine} OrderLine
 * @typedef {import("./types/planner").Context} Context
 * @typedef {import("./types/planner").Plan} Plan
 * @typedef {import("./types/planner").PlannedLine} PlannedLine
 * @typedef {import("./types/planner").Target} Target
 * @typedef {import("./types/planner").UserLimit} UserLimit
 * @typedef {import("./types/planner").Kind} Kind
 * @typedef {import("./types/planner").Policy} Policy
 */

import { ESCAPED_RUNS } from "./escapes.js";

/**
 * The refusal of an order: thrown out of `plan`, it becomes the `err` of the result and the
 * client gets `422 plugin_failed` with this reason (its first 500 characters). componentize-js
 * lowers a thrown string, or the `payload` of a thrown object, as the error.
 */
export class Refusal extends Error {
  /** @param {string} reason */
  constructor(reason) {
    super(reason);
    this.name = "Refusal";
    /** The text componentize-js hands to stockd as the `err` value. */
    this.payload = reason;
  }
}

/**
 * Refuses the order with `reason`.
 * @param {string} reason
 * @returns {never}
 */
export function refuse(reason) {
  throw new Refusal(reason);
}

/** Longest resource or limit key stockd accepts. */
export const MAX_KEY_LEN = 200;

const KEY_PATTERN = /^[A-Za-z0-9._:@-]+$/;

/**
 * Whether `key` is a key stockd accepts: 1-200 characters of `[A-Za-z0-9._:@-]`. A plan with
 * any other key is refused by the host, so plugins check keys they build from client input
 * and refuse the order with a readable reason instead.
 * @param {string} key
 */
export function isValidKey(key) {
  return key.length >= 1 && key.length <= MAX_KEY_LEN && KEY_PATTERN.test(key);
}

/**
 * Returns `key` if it is a valid key; otherwise refuses the order, naming what it was built for.
 * @param {string} key
 * @param {string} what
 * @returns {string}
 */
export function checkedKey(key, what) {
  if (isValidKey(key)) {
    return key;
  }
  return refuse(`${what} ${debugString(key)} is not 1-${MAX_KEY_LEN} characters of [A-Za-z0-9._:@-]`);
}

/**
 * The value of `name` in the tenant's plugin configuration: lines (or `;`-separated items) of
 * `name = value`; `#` starts a comment. The last occurrence wins.
 * @param {string} config
 * @param {string} name
 * @returns {string | undefined}
 */
export function configValue(config, name) {
  let found;
  for (const item of config.split(/[\n;]/)) {
    const text = item.split("#")[0];
    const equals = text.indexOf("=");
    if (equals >= 0 && trim(text.slice(0, equals)) === name) {
      found = trim(text.slice(equals + 1));
    }
  }
  return found;
}

/**
 * A numeric configuration value: `defaultValue` when absent; refuses the order when present
 * but not a whole number in `min..=max`. The result has the type of `defaultValue`: a number
 * (then `min` and `max` must be safe integers) or a BigInt (for values beyond 2^53).
 * @template {number | bigint} N
 * @param {string} config
 * @param {string} name
 * @param {N} defaultValue
 * @param {N} min
 * @param {N} max
 * @returns {N}
 */
export function configNumber(config, name, defaultValue, min, max) {
  const text = configValue(config, name);
  if (text === undefined) {
    return defaultValue;
  }
  // Exactly what Rust's `str::parse::<i64>` accepts: an optional sign and ASCII digits.
  if (/^[+-]?[0-9]+$/.test(text)) {
    const n = BigInt(text);
    if (n >= BigInt(min) && n <= BigInt(max)) {
      return /** @type {N} */ (typeof defaultValue === "bigint" ? n : Number(n));
    }
  }
  return refuse(`config ${name}=${debugString(text)} must be a number between ${min} and ${max}`);
}

/**
 * The value of the attribute `name` on an order line, if the client sent it.
 * @param {OrderLine} line
 * @param {string} name
 * @returns {string | undefined}
 */
export function attribute(line, name) {
  const found = line.attributes.find(([key]) => key === name);
  return found === undefined ? undefined : found[1];
}

/**
 * The user id; refuses the order when it has none, saying why this plugin needs one.
 * @param {Order} order
 * @param {string} why
 * @returns {string}
 */
export function requireUser(order, why) {
  if (order.userId === undefined) {
    return refuse(`order ${debugString(order.orderId)} has no user_id; ${why}`);
  }
  return order.userId;
}

const FNV_OFFSET = 0xcbf29ce484222325n;
const FNV_PRIME = 0x100000001b3n;

/**
 * A stable 64-bit hash (FNV-1a over the UTF-8 bytes), as a BigInt: the same text gives the
 * same number in every build, on every machine and in every SDK, so bucket orders are
 * reproducible.
 * @param {string} text
 * @returns {bigint}
 */
export function stableHash(text) {
  let hash = FNV_OFFSET;
  for (const byte of new TextEncoder().encode(text)) {
    hash = BigInt.asUintN(64, (hash ^ BigInt(byte)) * FNV_PRIME);
  }
  return hash;
}

/**
 * The UTC calendar month of a Unix time in milliseconds, as `[year, month]` with month 1..=12.
 * Plugins have no clock: they get `now` from `ctx.nowMs`.
 * @param {bigint} unixMs
 * @returns {[number, number]}
 */
export function utcYearMonth(unixMs) {
  // Howard Hinnant's days-to-civil algorithm. The day count is exact in a Number for every
  // s64 time (|days| < 2^47), and so is every step below.
  const msPerDay = 86_400_000n;
  const floorDays = unixMs / msPerDay - (unixMs % msPerDay < 0n ? 1n : 0n);
  const days = Number(floorDays) + 719_468;
  const era = Math.floor(days / 146_097);
  const dayOfEra = days - era * 146_097;
  const yearOfEra =
    Math.floor((dayOfEra - Math.floor(dayOfEra / 1460) + Math.floor(dayOfEra / 36_524) - Math.floor(dayOfEra / 146_096)) / 365);
  const dayOfYear = dayOfEra - (365 * yearOfEra + Math.floor(yearOfEra / 4) - Math.floor(yearOfEra / 100));
  const shiftedMonth = Math.floor((5 * dayOfYear + 2) / 153);
  const month = shiftedMonth < 10 ? shiftedMonth + 3 : shiftedMonth - 9;
  const year = yearOfEra + era * 400 + (month <= 2 ? 1 : 0);
  return [year, month];
}

/**
 * A target with only a resource key: no kind check, no creation, default bucket order.
 * Spread it to set the rest: `{ ...target(key), kind: "inventory" }`.
 * @param {string} resource
 * @returns {Target}
 */
export function target(resource) {
  return { resource, kind: undefined, createIfMissing: undefined, buckets: new Uint32Array(0) };
}

/**
 * A planned line for order line `index` with the given targets: the line's own quantity, not
 * mandatory, no per-user limit.
 * @param {number} index
 * @param {OrderLine} line
 * @param {Target[]} targets
 * @returns {PlannedLine}
 */
export function planned(index, line, targets) {
  return { line: index, qty: line.qty, mandatory: false, targets, limit: undefined };
}

/**
 * The plan of stockd's built-in default: each line takes its own quantity from the resource
 * named by its key, all-or-nothing, no kind check, no per-user limit, no creation.
 * @param {Order} order
 * @returns {Plan}
 */
export function defaultPlan(order) {
  return { policy: "all-or-nothing", lines: order.lines.map((line, index) => planned(index, line, [target(line.key)])) };
}

// Whitespace as Rust's `str::trim` knows it (Unicode White_Space), which differs from
// `String.prototype.trim` in two characters (U+0085 and U+FEFF).
const WHITESPACE = "\t\n\v\f\r \u0085\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000";

/**
 * `text` without leading and trailing whitespace, exactly like Rust's `str::trim`.
 * @param {string} text
 */
export function trim(text) {
  let start = 0;
  let end = text.length;
  while (start < end && WHITESPACE.includes(text[start])) start++;
  while (end > start && WHITESPACE.includes(text[end - 1])) end--;
  return text.slice(start, end);
}

// The code points Rust's `{:?}` writes as `\u{...}`, as sorted runs [first, last]: decoded
// once, when the component is built (module scope runs before the snapshot).
/** @type {number[]} */
const RUN_FIRSTS = [];
/** @type {number[]} */
const RUN_LASTS = [];
for (let i = 0, next = 0; i < ESCAPED_RUNS.length; i += 2) {
  const first = next + ESCAPED_RUNS[i];
  next = first + ESCAPED_RUNS[i + 1];
  RUN_FIRSTS.push(first);
  RUN_LASTS.push(next - 1);
}

/**
 * Whether Rust's `{:?}` escapes the code point `code` (binary search over the runs).
 * @param {number} code
 */
function isEscaped(code) {
  let low = 0;
  let high = RUN_FIRSTS.length;
  while (low < high) {
    const middle = (low + high) >> 1;
    if (RUN_LASTS[middle] < code) {
      low = middle + 1;
    } else {
      high = middle;
    }
  }
  return low < RUN_FIRSTS.length && RUN_FIRSTS[low] <= code;
}

/** @type {Record<string, string>} */
const SHORT_ESCAPES = { "\0": "\\0", "\t": "\\t", "\r": "\\r", "\n": "\\n", "\\": "\\\\", '"': '\\"' };

/**
 * `text` quoted the way Rust's `{:?}` quotes a string, so refusal reasons read the same as
 * the Rust SDK's: `"a\"b"`, `"tab\there"`, `"\u{7f}"`.
 * @param {string} text
 */
export function debugString(text) {
  // One regular expression pass: most text is plain ASCII and passes through untouched, and
  // the engine's regular expressions cost far less fuel than a loop over the characters.
  return `"${text.replace(NOT_PLAIN, escapeChar)}"`;
}

// Everything but printable ASCII without `"` and `\`, one code point at a time.
const NOT_PLAIN = /[^\x20\x21\x23-\x5b\x5d-\x7e]/gu;

/** @param {string} char */
function escapeChar(char) {
  const short = SHORT_ESCAPES[char];
  if (short !== undefined) {
    return short;
  }
  const code = /** @type {number} */ (char.codePointAt(0));
  return isEscaped(code) ? `\\u{${code.toString(16)}}` : char;
}
