"""{{name}}: a stockd planning plugin in Python.

stockd calls ``plan`` once for every order of your tenant, with the order (its lines, each a
``key``, a ``qty`` and ``attributes``) and a context (``tenant``, ``now_ms``, ``seed``, and
``config``, the configuration text uploaded with the plugin). The plan says, for each line, which
resource it takes from (then which fallbacks), under which per-user limit, and whether the order
may partly succeed; stockd does the deductions, atomically and exactly once.

This starting point plans like stockd's built-in default, but insists on inventory: each line
takes its own quantity from the resource named by its key, which must be an ``inventory``
resource, and either every line applies or none does. The comments show where the other
decisions go; ``cases.toml`` holds sample orders and the plans they must produce.

A plugin imports nothing (no clock, randomness, files, network or printing): ``time``,
``random`` and ``print`` must not decide anything. ``refuse(reason)`` refuses the order with that
reason; any other exception fails only the order being planned.
"""

import wit_world
from stockd_plugin import Context, Kind, Order, Plan, Policy, planned, target


class WitWorld(wit_world.WitWorld):
    def plan(self, order: Order, ctx: Context) -> Plan:
        # Configuration, ``name = value`` lines (a bad value refuses the order readably):
        #     buckets = config_number(ctx.config, "buckets", 8, 1, 1024)
        # Per-user limits need a user; refuse orders without one:
        #     user = require_user(order, "purchases are limited per user")
        lines = []
        for index, line in enumerate(order.lines):
            # The resource this line takes from. Keys you build from client input (attributes,
            # the user id) must be checked, so a bad one refuses the order readably:
            #     warehouse = attribute(line, "warehouse") or "main"
            #     resource = checked_key(f"{line.key}:{warehouse}", "stock key")
            # kind: the kind the resource must be (None accepts any); create_if_missing: an
            # allowance to create a missing resource with; buckets: the order a bucketed
            # resource's buckets are tried in (empty: stockd's default).
            primary = target(line.key, kind=Kind.INVENTORY)
            # Fallbacks: up to 7 more targets, tried in order when the ones before run short:
            #     fallback = target(checked_key(f"{line.key}:central", "fallback key"))
            # A per-user limit, enforced by stockd atomically with the deduction:
            #     limit=UserLimit(key=checked_key(f"max5:{line.key}:{user}", "limit key"), max=5)
            lines.append(planned(index, line, [primary]))
        # ALL_OR_NOTHING, ALLOW_PARTIAL (lines that can apply do) or MANDATORY_LINES.
        return Plan(policy=Policy.ALL_OR_NOTHING, lines=lines)
