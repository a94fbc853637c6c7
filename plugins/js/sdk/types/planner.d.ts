// world stockd:plugin/planner@0.1.0
/**
* What the order does to its lines.
*/
/**
* What the order does to its lines.
* # Variants
* 
* ## `"deduct"`
* 
* Consume now: available moves to consumed.
* ## `"reserve"`
* 
* Hold: available moves to reserved until confirmed, released or expired.
*/
export type Action = 'deduct' | 'reserve';
/**
* What a resource counts.
*/
/**
* What a resource counts.
* # Variants
* 
* ## `"inventory"`
* 
* ## `"balance"`
* 
* ## `"coupon"`
* 
* ## `"quota"`
*/
export type Kind = 'inventory' | 'balance' | 'coupon' | 'quota';
/**
* How an order ends when some of its lines cannot apply.
*/
/**
* How an order ends when some of its lines cannot apply.
* # Variants
* 
* ## `"all-or-nothing"`
* 
* Every line applies, or none does.
* ## `"allow-partial"`
* 
* Lines that can apply do; the order is `partial` when some could not.
* ## `"mandatory-lines"`
* 
* Like `allow-partial`, but the order is rejected unless every line marked
* `mandatory` applied.
*/
export type Policy = 'all-or-nothing' | 'allow-partial' | 'mandatory-lines';
/**
* One line of the order as the client sent it (already validated by the core).
*/
/**
* One line of the order as the client sent it (already validated by the core).
*/
export interface OrderLine {
  /**
  * The client's line key (1-200 characters of `[A-Za-z0-9._:@-]`).
  */
  key: string,
  /**
  * Quantity in the resource's smallest unit, 1..=10^12.
  */
  qty: bigint,
  /**
  * Free-form attributes (warehouse, currency, campaign, ...), sorted by name.
  */
  attributes: Array<[string, string]>,
}
/**
* The order to plan.
*/
/**
* The order to plan.
*/
export interface Order {
  orderId: string,
  userId?: string,
  action: Action,
  /**
  * 1..=100 lines, each key at most once.
  */
  lines: Array<OrderLine>,
}
/**
* What the core tells the plugin besides the order. The plugin has no clock and no
* randomness of its own: it gets them here.
*/
/**
* What the core tells the plugin besides the order. The plugin has no clock and no
* randomness of its own: it gets them here.
*/
export interface Context {
  /**
  * The tenant id.
  */
  tenant: string,
  /**
  * The core's clock, milliseconds since the Unix epoch (UTC).
  */
  nowMs: bigint,
  /**
  * A random seed the core chose for this request (for random bucket orders).
  */
  seed: bigint,
  /**
  * The tenant's plugin configuration text, as uploaded; may be empty.
  */
  config: string,
}
/**
* One resource a planned line may deduct from.
*/
/**
* One resource a planned line may deduct from.
*/
export interface Target {
  /**
  * The canonical resource key (1-200 characters of `[A-Za-z0-9._:@-]`).
  */
  resource: string,
  /**
  * The kind the resource must be, when the plugin cares.
  */
  kind?: Kind,
  /**
  * When set, a missing resource (e.g. a new quota period) is created with this
  * allowance (0..=10^15) instead of failing with `resource_not_found`.
  */
  createIfMissing?: bigint,
  /**
  * The order in which the resource's buckets are tried (each < 1024, at most 1024);
  * empty means the core's default order.
  */
  buckets: Uint32Array,
}
/**
* A per-user limit the core enforces atomically with the deduction: the line applies
* only if used(key) + qty <= max.
*/
/**
* A per-user limit the core enforces atomically with the deduction: the line applies
* only if used(key) + qty <= max.
*/
export interface UserLimit {
  /**
  * The limit counter's key (1-200 characters of `[A-Za-z0-9._:@-]`).
  */
  key: string,
  /**
  * The most the user may ever take under this key, >= 0.
  */
  max: bigint,
}
/**
* The plan for one order line.
*/
/**
* The plan for one order line.
*/
export interface PlannedLine {
  /**
  * Index into `order.lines`; each order line is planned at most once.
  */
  line: number,
  /**
  * Quantity to deduct or reserve, 1..=10^12.
  */
  qty: bigint,
  /**
  * For `mandatory-lines`: the order fails unless this line applies.
  */
  mandatory: boolean,
  /**
  * 1..=8 targets: the first is the primary resource, the rest are fallbacks tried in
  * order (e.g. another warehouse).
  */
  targets: Array<Target>,
  /**
  * The per-user limit this line counts against, if any.
  */
  limit?: UserLimit,
}
/**
* The plugin's decision for the whole order.
*/
/**
* The plugin's decision for the whole order.
*/
export interface Plan {
  policy: Policy,
  /**
  * One entry per planned order line.
  */
  lines: Array<PlannedLine>,
}
/**
* Plans an order. `err` refuses the order with a reason (at most 500 characters are kept).
*/
export function plan(order: Order, ctx: Context): Plan;
export type Result<T, E> = { tag: 'ok', val: T } | { tag: 'err', val: E };
