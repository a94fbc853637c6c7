// Unit tests of the SDK's helpers, run by Node directly (`npm test`): the SDK is plain
// JavaScript, so what it computes here is what it computes inside a component. The expected
// values come from the Rust SDK (`plugins/sdk`), which the JavaScript one must match.
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  Refusal,
  attribute,
  checkedKey,
  configNumber,
  configValue,
  debugString,
  defaultPlan,
  isValidKey,
  requireUser,
  stableHash,
  trim,
  utcYearMonth,
} from "./stockd.js";

/** The reason `run` refuses with (it must refuse). */
function refusal(run) {
  try {
    run();
  } catch (error) {
    assert.ok(error instanceof Refusal, `expected a Refusal, got ${error}`);
    return error.payload;
  }
  assert.fail("expected a refusal");
}

test("configuration lines are read like the Rust SDK reads them", () => {
  // Items split on newlines and `;`, `#` starts a comment, the last occurrence wins, and
  // only Rust's whitespace is trimmed: a byte-order mark is part of the name.
  const config = "buckets = 3;\ufeffbuckets = 9\nbuckets = 5\u0085 # the last one wins\nfallback=north=x";
  assert.equal(configValue(config, "buckets"), "5");
  assert.equal(configValue(config, "fallback"), "north=x");
  assert.equal(configValue(config, "missing"), undefined);
  assert.equal(configValue("", "buckets"), undefined);
});

test("configuration numbers are whole numbers in range, or a refusal", () => {
  assert.equal(configNumber("", "buckets", 8, 1, 1024), 8);
  assert.equal(configNumber("buckets = +7", "buckets", 8, 1, 1024), 7);
  assert.equal(configNumber("allowance = 1000000000000000", "allowance", 1000n, 0n, 10n ** 15n), 10n ** 15n);
  assert.equal(
    refusal(() => configNumber("buckets = 0x10", "buckets", 8, 1, 1024)),
    'config buckets="0x10" must be a number between 1 and 1024',
  );
  assert.equal(
    refusal(() => configNumber("buckets = 1\u00a02\t\"x\"", "buckets", 8, 1, 1024)),
    'config buckets="1\\u{a0}2\\t\\"x\\"" must be a number between 1 and 1024',
  );
  assert.equal(refusal(() => configNumber("buckets = 1025", "buckets", 8, 1, 1024)).startsWith("config buckets=\"1025\""), true);
});

test("keys are checked and quoted like Rust's {:?}", () => {
  assert.equal(isValidKey("sku-1:east@x.y_z"), true);
  assert.equal(isValidKey(""), false);
  assert.equal(isValidKey("a".repeat(200)), true);
  assert.equal(isValidKey("a".repeat(201)), false);
  assert.equal(checkedKey("flash:sku-1:u-42", "limit key"), "flash:sku-1:u-42");
  assert.equal(
    refusal(() => checkedKey('flash:sku-1:say"hi"/\\x', "limit key")),
    'limit key "flash:sku-1:say\\"hi\\"/\\\\x" is not 1-200 characters of [A-Za-z0-9._:@-]',
  );
  assert.equal(debugString("Müller\tcafe\u0301\u00a0\0\u{1f600}\u{e0100}"), '"Müller\\tcafe\\u{301}\\u{a0}\\0\u{1f600}\\u{e0100}"');
});

test("order helpers read users and attributes", () => {
  const line = { key: "sku-1", qty: 2n, attributes: [["colour", "red"], ["warehouse", "east"]] };
  const order = { orderId: 'o"1', userId: undefined, action: /** @type {const} */ ("deduct"), lines: [line] };
  assert.equal(attribute(line, "warehouse"), "east");
  assert.equal(attribute(line, "missing"), undefined);
  assert.equal(refusal(() => requireUser(order, "why")), 'order "o\\"1" has no user_id; why');
  assert.equal(requireUser({ ...order, userId: "u-42" }, "why"), "u-42");
  assert.deepEqual(defaultPlan(order), {
    policy: "all-or-nothing",
    lines: [{ line: 0, qty: 2n, mandatory: false, targets: [{ resource: "sku-1", kind: undefined, createIfMissing: undefined, buckets: new Uint32Array(0) }], limit: undefined }],
  });
});

test("the stable hash is 64-bit FNV-1a over UTF-8", () => {
  assert.equal(stableHash(""), 0xcbf29ce484222325n);
  assert.equal(stableHash("a"), 0xaf63dc4c8601ec8cn);
  assert.equal(stableHash("foobar"), 0x85944171f73967e8n);
  // The bucket each user starts at in the flash-sale example, as the Rust plugin picks it.
  assert.equal(stableHash("u-42") % 5n, 4n);
  assert.equal(stableHash("alice@example.com") % 5n, 3n);
});

test("UTC months follow the proleptic Gregorian calendar", () => {
  const cases = [
    [0n, [1970, 1]],
    [1796040000000n, [2026, 11]],
    [-1n, [1969, 12]],
    [-86400000n, [1969, 12]],
    [951782400000n, [2000, 2]],
    [951868799999n, [2000, 2]],
    [253402300799999n, [9999, 12]],
    [-62135596800000n, [1, 1]],
  ];
  for (const [ms, month] of cases) {
    assert.deepEqual(utcYearMonth(ms), month, `${ms}`);
  }
});

test("trim removes exactly Rust's whitespace", () => {
  assert.equal(trim("\u0085 a b\u3000\t"), "a b");
  assert.equal(trim("\ufeffa"), "\ufeffa");
});
