#!/usr/bin/env bash
# Hot-key load over HTTP with wrk, beside the same server's /healthz in the same run.
# Starts a release server on a fresh SQLite database in a temp dir, creates a tenant and one
# resource, then runs wrk (64 connections, 2 threads) against /healthz and against
# POST /v1/orders (qty 1 on the one key, a unique Idempotency-Key per request), and finally
# prints the resource and the reconciliation report. Needs wrk (apt-get install wrk).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/stockd-target}"
duration="${DURATION:-10s}"
connections="${CONNECTIONS:-64}"
port="${PORT:-18099}"
cargo build --release --locked -q
dir=$(mktemp -d)
trap 'kill $(cat "$dir/pid") 2>/dev/null || true; rm -rf "$dir"' EXIT
admin="load-admin-token-$RANDOM$RANDOM"
(cd "$dir" && STOCKD_LISTEN="127.0.0.1:$port" STOCKD_ADMIN_TOKEN="$admin" RUST_LOG=warn \
  "$CARGO_TARGET_DIR/release/stockd" serve >"$dir/out.log" 2>"$dir/err.log" & echo $! >"$dir/pid")
for _ in $(seq 1 50); do grep -q listening "$dir/out.log" 2>/dev/null && break; sleep 0.1; done
s="http://127.0.0.1:$port"
key=$(curl -s -X POST "$s/v1/admin/tenants" -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' \
  -d '{"id":"load","name":"Load"}' | sed -E 's/.*"api_key":"([^"]+)".*/\1/')
curl -s -X POST "$s/v1/resources" -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
  -d '{"key":"hot","kind":"inventory","total":1000000000}' >/dev/null
cat >"$dir/order.lua" <<LUA
-- Each wrk thread gets its own id, so every request carries a distinct Idempotency-Key.
local threads = 0
function setup(thread) threads = threads + 1; thread:set("tid", threads) end
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", "/v1/orders", {
    ["Authorization"] = "Bearer $key", ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = "k-" .. tid .. "-" .. n },
    '{"order_id":"o","action":"deduct","lines":[{"key":"hot","qty":1}]}')
end
LUA
echo "== /healthz ($connections connections, $duration)"
wrk -t2 -c"$connections" -d"$duration" "$s/healthz" | grep -E 'Latency|Requests/sec|Non-2xx'
echo "== hot-key deduct ($connections connections, $duration)"
wrk -t2 -c"$connections" -d"$duration" -s "$dir/order.lua" "$s/v1/orders" | grep -E 'Latency|Requests/sec|Non-2xx'
curl -s "$s/v1/resources/hot" -H "Authorization: Bearer $key"; echo
curl -s "$s/v1/reconciliation" -H "Authorization: Bearer $key"; echo
curl -s "$s/metrics" | grep -E '^stockd_batch_size_(sum|count)'
