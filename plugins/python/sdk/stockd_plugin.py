"""Everything a stockd planning plugin written in Python needs besides its own rules: the same
helpers as the Rust SDK (``plugins/sdk``), giving the same answers on the same input, so a
plugin ported between the two plans and refuses orders identically.

A plugin is a module (``app.py``) defining ``class WitWorld(wit_world.WitWorld)`` with a
``plan(self, order, ctx)`` method, built into a component by componentize-py against the
``planner`` world of ``wit/stockd-plugin.wit``. The types are componentize-py's bindings of the
WIT (module ``wit_world``): dataclasses with snake_case fields (``Target.create_if_missing``),
enums (``Policy.ALL_OR_NOTHING``, ``Kind.INVENTORY``), ``None`` for an absent option and plain
``int`` for every number.

Returning a plan answers ``ok``. A refusal (``err``) is ``raise Err(reason)``
(``componentize_py_types.Err``); every helper here that can refuse raises it, and
:func:`refuse` does it for you. Any other exception traps the instance, which stockd reports
as ``plugin_failed``, like a panic in Rust.

.. code-block:: python

    import wit_world
    from wit_world import Order, Context, Plan
    from stockd_plugin import default_plan, require_user

    class WitWorld(wit_world.WitWorld):
        def plan(self, order: Order, ctx: Context) -> Plan:
            require_user(order, "purchases are limited per user")
            return default_plan(order)
"""

import re
from bisect import bisect_left
from typing import NoReturn, Optional, Sequence, Tuple

from componentize_py_types import Err
from wit_world import Context, Kind, Order, OrderLine, Plan, PlannedLine, Policy, Target, UserLimit

from stockd_plugin_escapes import ESCAPED_RUNS

__all__ = [
    "Context", "Err", "Kind", "Order", "OrderLine", "Plan", "PlannedLine", "Policy", "Target",
    "UserLimit", "MAX_KEY_LEN", "attribute", "checked_key", "config_number", "config_value",
    "debug_string", "default_plan", "is_valid_key", "planned", "refuse", "require_user",
    "stable_hash", "target", "trim", "utc_year_month",
]

#: Longest resource or limit key stockd accepts.
MAX_KEY_LEN = 200

_KEY = re.compile(r"[A-Za-z0-9._:@-]+")


def refuse(reason: str) -> NoReturn:
    """Refuses the order: the client gets ``422 plugin_failed`` with ``reason`` (its first 500
    characters)."""
    raise Err(reason)


def is_valid_key(key: str) -> bool:
    """Whether ``key`` is a key stockd accepts: 1-200 characters of ``[A-Za-z0-9._:@-]``. A plan
    with any other key is refused by the host, so plugins check keys they build from client
    input and refuse the order with a readable reason instead."""
    return 1 <= len(key) <= MAX_KEY_LEN and _KEY.fullmatch(key) is not None


def checked_key(key: str, what: str) -> str:
    """Returns ``key`` if it is a valid key; otherwise refuses the order, naming what it was
    built for."""
    if not is_valid_key(key):
        refuse(f"{what} {debug_string(key)} is not 1-{MAX_KEY_LEN} characters of [A-Za-z0-9._:@-]")
    return key


def config_value(config: str, name: str) -> Optional[str]:
    """The value of ``name`` in the tenant's plugin configuration: lines (or ``;``-separated
    items) of ``name = value``; ``#`` starts a comment. The last occurrence wins."""
    found = None
    for item in re.split(r"[\n;]", config):
        key, equals, value = item.split("#", 1)[0].partition("=")
        if equals and trim(key) == name:
            found = trim(value)
    return found


# Exactly what Rust's `str::parse::<i64>` accepts: an optional sign and ASCII digits.
_INTEGER = re.compile(r"[+-]?[0-9]+")


def config_number(config: str, name: str, default: int, low: int, high: int) -> int:
    """A numeric configuration value: ``default`` when absent; refuses the order when present
    but not a whole number in ``low..=high``."""
    text = config_value(config, name)
    if text is None:
        return default
    if _INTEGER.fullmatch(text) is not None and low <= int(text) <= high:
        return int(text)
    refuse(f"config {name}={debug_string(text)} must be a number between {low} and {high}")


def attribute(line: OrderLine, name: str) -> Optional[str]:
    """The value of the attribute ``name`` on an order line, if the client sent it."""
    return next((value for key, value in line.attributes if key == name), None)


def require_user(order: Order, why: str) -> str:
    """The user id; refuses the order when it has none, saying why this plugin needs one."""
    if order.user_id is None:
        refuse(f"order {debug_string(order.order_id)} has no user_id; {why}")
    return order.user_id


_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_U64 = (1 << 64) - 1


def stable_hash(text: str) -> int:
    """A stable 64-bit hash (FNV-1a over the UTF-8 bytes): the same text gives the same number
    in every build, on every machine and in every SDK (unlike ``hash()``, which is salted),
    so bucket orders are reproducible."""
    value = _FNV_OFFSET
    for byte in text.encode("utf-8"):
        value = ((value ^ byte) * _FNV_PRIME) & _U64
    return value


def utc_year_month(unix_ms: int) -> Tuple[int, int]:
    """The UTC calendar month of a Unix time in milliseconds, as ``(year, month)`` with month
    1..=12. Plugins have no clock: they get ``now`` from ``ctx.now_ms``."""
    # Howard Hinnant's days-to-civil algorithm; `//` floors, like Rust's `div_euclid` here.
    days = unix_ms // 86_400_000 + 719_468
    era = days // 146_097
    day_of_era = days - era * 146_097
    year_of_era = (day_of_era - day_of_era // 1460 + day_of_era // 36_524 - day_of_era // 146_096) // 365
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)
    shifted_month = (5 * day_of_year + 2) // 153
    month = shifted_month + 3 if shifted_month < 10 else shifted_month - 9
    year = year_of_era + era * 400 + (1 if month <= 2 else 0)
    return year, month


def target(
    resource: str,
    kind: Optional[Kind] = None,
    create_if_missing: Optional[int] = None,
    buckets: Sequence[int] = (),
) -> Target:
    """A target: by default only a resource key, with no kind check, no creation and the
    default bucket order."""
    return Target(resource=resource, kind=kind, create_if_missing=create_if_missing, buckets=list(buckets))


def planned(
    index: int,
    line: OrderLine,
    targets: Sequence[Target],
    mandatory: bool = False,
    limit: Optional[UserLimit] = None,
) -> PlannedLine:
    """A planned line for order line ``index`` with the given targets and the line's own
    quantity: by default not mandatory and without a per-user limit."""
    return PlannedLine(line=index, qty=line.qty, mandatory=mandatory, targets=list(targets), limit=limit)


def default_plan(order: Order) -> Plan:
    """The plan of stockd's built-in default: each line takes its own quantity from the
    resource named by its key, all-or-nothing, no kind check, no per-user limit, no creation."""
    lines = [planned(index, line, [target(line.key)]) for index, line in enumerate(order.lines)]
    return Plan(policy=Policy.ALL_OR_NOTHING, lines=lines)


# Whitespace as Rust's `str::trim` knows it (Unicode White_Space), which differs from
# `str.strip()` (that one also strips U+001C..U+001F).
_WHITESPACE = (
    "\t\n\v\f\r \u0085\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
    "\u200a\u2028\u2029\u202f\u205f\u3000"
)


def trim(text: str) -> str:
    """``text`` without leading and trailing whitespace, exactly like Rust's ``str::trim``."""
    return text.strip(_WHITESPACE)


def _decode_runs() -> Tuple[list, list]:
    firsts, lasts, following = [], [], 0
    for i in range(0, len(ESCAPED_RUNS), 2):
        first = following + ESCAPED_RUNS[i]
        following = first + ESCAPED_RUNS[i + 1]
        firsts.append(first)
        lasts.append(following - 1)
    return firsts, lasts


# The code points Rust's `{:?}` writes as `\u{...}`, as sorted runs (first, last).
_RUN_FIRSTS, _RUN_LASTS = _decode_runs()
_SHORT_ESCAPES = {"\0": "\\0", "\t": "\\t", "\r": "\\r", "\n": "\\n", "\\": "\\\\", '"': '\\"'}
# Everything but printable ASCII without `"` and `\`.
_NOT_PLAIN = re.compile(r'[^\x20\x21\x23-\x5b\x5d-\x7e]')


def _escape(match: "re.Match[str]") -> str:
    char = match.group()
    short = _SHORT_ESCAPES.get(char)
    if short is not None:
        return short
    code = ord(char)
    run = bisect_left(_RUN_LASTS, code)
    if run < len(_RUN_FIRSTS) and _RUN_FIRSTS[run] <= code:
        return f"\\u{{{code:x}}}"
    return char


def debug_string(text: str) -> str:
    """``text`` quoted the way Rust's ``{:?}`` quotes a string, so refusal reasons read the
    same as the Rust SDK's: ``"a\\"b"``, ``"tab\\there"``, ``"\\u{7f}"``."""
    return '"' + _NOT_PLAIN.sub(_escape, text) + '"'
