"""Unit tests of the SDK's helpers, run by CPython directly: the SDK is plain Python, so what
it computes here is what it computes inside a component. The expected values come from the Rust
SDK (``plugins/sdk``), which the Python one must match. It needs the SDK and componentize-py's
bindings of the WIT on the path; from the repository root:

    plugins/python/.venv/bin/componentize-py -d wit -w planner bindings plugins/python/.bindings
    PYTHONPATH=plugins/python/.bindings:plugins/python/sdk python3 -m unittest discover -s plugins/python/tests
"""

import unittest

from stockd_plugin import (
    Err, OrderLine, Order, Plan, PlannedLine, Policy, Target, attribute, checked_key, config_number,
    config_value, debug_string, default_plan, is_valid_key, require_user, stable_hash, trim,
    utc_year_month,
)
from wit_world import Action


def refusal(run) -> str:
    """The reason ``run`` refuses with (it must refuse)."""
    try:
        run()
    except Err as refused:
        return refused.value
    raise AssertionError("expected a refusal")


class Helpers(unittest.TestCase):
    def test_configuration_lines_are_read_like_the_rust_sdk_reads_them(self):
        # Items split on newlines and `;`, `#` starts a comment, the last occurrence wins, and
        # only Rust's whitespace is trimmed: a byte-order mark is part of the name.
        config = "buckets = 3;\ufeffbuckets = 9\nbuckets = 5\u0085 # the last one wins\nfallback=north=x"
        self.assertEqual(config_value(config, "buckets"), "5")
        self.assertEqual(config_value(config, "fallback"), "north=x")
        self.assertIsNone(config_value(config, "missing"))
        self.assertIsNone(config_value("", "buckets"))

    def test_configuration_numbers_are_whole_numbers_in_range_or_a_refusal(self):
        self.assertEqual(config_number("", "buckets", 8, 1, 1024), 8)
        self.assertEqual(config_number("buckets = +7", "buckets", 8, 1, 1024), 7)
        self.assertEqual(
            refusal(lambda: config_number("buckets = 0x10", "buckets", 8, 1, 1024)),
            'config buckets="0x10" must be a number between 1 and 1024',
        )
        # int() would take these; Rust's parse does not.
        self.assertEqual(
            refusal(lambda: config_number("buckets = 1_000", "buckets", 8, 1, 1024)),
            'config buckets="1_000" must be a number between 1 and 1024',
        )
        self.assertEqual(
            refusal(lambda: config_number("buckets = \u0663", "buckets", 8, 1, 1024)),
            'config buckets="\u0663" must be a number between 1 and 1024',
        )
        self.assertEqual(
            refusal(lambda: config_number("buckets = 1\u00a02\t\"x\"", "buckets", 8, 1, 1024)),
            'config buckets="1\\u{a0}2\\t\\"x\\"" must be a number between 1 and 1024',
        )

    def test_keys_are_checked_and_quoted_like_rusts_debug(self):
        self.assertTrue(is_valid_key("sku-1:east@x.y_z"))
        self.assertFalse(is_valid_key(""))
        self.assertTrue(is_valid_key("a" * 200))
        self.assertFalse(is_valid_key("a" * 201))
        self.assertFalse(is_valid_key("sku\n"))
        self.assertEqual(checked_key("flash:sku-1:u-42", "limit key"), "flash:sku-1:u-42")
        self.assertEqual(
            refusal(lambda: checked_key('flash:sku-1:say"hi"/\\x', "limit key")),
            'limit key "flash:sku-1:say\\"hi\\"/\\\\x" is not 1-200 characters of [A-Za-z0-9._:@-]',
        )
        self.assertEqual(
            debug_string("Müller\tcafe\u0301\u00a0\0\U0001f600\U000e0100"),
            '"Müller\\tcafe\\u{301}\\u{a0}\\0\U0001f600\\u{e0100}"',
        )

    def test_order_helpers_read_users_and_attributes(self):
        line = OrderLine(key="sku-1", qty=2, attributes=[("colour", "red"), ("warehouse", "east")])
        order = Order(order_id='o"1', user_id=None, action=Action.DEDUCT, lines=[line])
        self.assertEqual(attribute(line, "warehouse"), "east")
        self.assertIsNone(attribute(line, "missing"))
        self.assertEqual(refusal(lambda: require_user(order, "why")), 'order "o\\"1" has no user_id; why')
        order.user_id = "u-42"
        self.assertEqual(require_user(order, "why"), "u-42")
        self.assertEqual(default_plan(order), Plan(policy=Policy.ALL_OR_NOTHING, lines=[
            PlannedLine(line=0, qty=2, mandatory=False, limit=None,
                        targets=[Target(resource="sku-1", kind=None, create_if_missing=None, buckets=[])]),
        ]))

    def test_the_stable_hash_is_64_bit_fnv_1a_over_utf_8(self):
        self.assertEqual(stable_hash(""), 0xCBF29CE484222325)
        self.assertEqual(stable_hash("a"), 0xAF63DC4C8601EC8C)
        self.assertEqual(stable_hash("foobar"), 0x85944171F73967E8)
        # The bucket each user starts at in the flash-sale example, as the Rust plugin picks it.
        self.assertEqual(stable_hash("u-42") % 5, 4)
        self.assertEqual(stable_hash("alice@example.com") % 5, 3)

    def test_utc_months_follow_the_proleptic_gregorian_calendar(self):
        cases = [
            (0, (1970, 1)), (1796040000000, (2026, 11)), (-1, (1969, 12)), (-86400000, (1969, 12)),
            (951782400000, (2000, 2)), (951868799999, (2000, 2)), (253402300799999, (9999, 12)),
            (-62135596800000, (1, 1)),
        ]
        for unix_ms, month in cases:
            self.assertEqual(utc_year_month(unix_ms), month, unix_ms)

    def test_trim_removes_exactly_rusts_whitespace(self):
        self.assertEqual(trim("\u0085 a b\u3000\t"), "a b")
        self.assertEqual(trim("\ufeffa"), "\ufeffa")
        self.assertEqual(trim("\x1ca"), "\x1ca")


if __name__ == "__main__":
    unittest.main()
