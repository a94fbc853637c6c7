"""Flash sales: every line deducts its SKU's inventory, each user may take at most one piece of
each SKU (the limit ``flash:{sku}:{user}``, max 1, enforced by stockd atomically with the
deduction), and the SKU's buckets are tried starting from one picked by the user id, so
concurrent buyers spread over the buckets instead of queueing on the first one.

Configuration: ``buckets = N`` (1..=1024, default 8), the number of buckets the flash-sale SKUs
were created with. Orders without a ``user_id`` are refused.

The same rules as the Rust example ``plugins/flash-sale``, with the same plans and refusals.
"""

from typing import List

import wit_world
from stockd_plugin import (
    Context, Kind, Order, Plan, Policy, UserLimit, checked_key, config_number, planned,
    require_user, stable_hash, target,
)

#: Buckets a flash-sale SKU is split into unless the configuration says otherwise.
DEFAULT_BUCKETS = 8


class WitWorld(wit_world.WitWorld):
    def plan(self, order: Order, ctx: Context) -> Plan:
        user = require_user(order, "a flash sale allows one piece per user and SKU")
        buckets = config_number(ctx.config, "buckets", DEFAULT_BUCKETS, 1, 1024)
        order_of_buckets = bucket_order(user, buckets)
        lines = []
        for index, line in enumerate(order.lines):
            limit = UserLimit(key=checked_key(f"flash:{line.key}:{user}", "limit key"), max=1)
            sku = target(line.key, kind=Kind.INVENTORY, buckets=order_of_buckets)
            lines.append(planned(index, line, [sku], limit=limit))
        return Plan(policy=Policy.ALL_OR_NOTHING, lines=lines)


def bucket_order(user: str, count: int) -> List[int]:
    """All ``count`` buckets, starting at the user's own (a stable hash of the id) and wrapping
    around, so a full bucket falls back to the next one."""
    start = stable_hash(user) % count
    return [(start + i) % count for i in range(count)]
