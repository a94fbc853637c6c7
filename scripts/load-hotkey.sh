#!/usr/bin/env bash
# Hot-key load over HTTP with wrk, beside the same server's /healthz in the same run.
# Starts PROCESSES (default 1) release servers on one fresh database (SQLite in a temp dir, or
# DATABASE_URL=postgres://... which must be an empty database), creates a tenant and one
# resource, then runs wrk (CONNECTIONS=64 in all, spread over the processes) against /healthz
# and against POST /v1/orders (qty 1 on the one key, a unique Idempotency-Key per request),
# and finally prints the resource and the reconciliation report. PLUGIN=path.wasm uploads that
# plugin for the tenant first (e.g. plugins/dist/default.wasm, to compare against the native
# default plan). Needs wrk (apt-get install wrk).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/stockd-target}"
duration="${DURATION:-10s}"
connections="${CONNECTIONS:-64}"
port="${PORT:-18099}"
processes="${PROCESSES:-1}"
cargo build --release --locked -q
dir=$(mktemp -d)
trap 'kill $(cat "$dir"/pid.*) 2>/dev/null || true; rm -rf "$dir"' EXIT
admin="load-admin-token-$RANDOM$RANDOM"
database_url="${DATABASE_URL:-sqlite://$dir/stockd.db}"
for p in $(seq 1 "$processes"); do
  # `exec` makes the background job the server itself, so the recorded pid is the one to kill.
  (cd "$dir" && exec env STOCKD_LISTEN="127.0.0.1:$((port + p - 1))" STOCKD_ADMIN_TOKEN="$admin" RUST_LOG=warn \
    STOCKD_DATABASE_URL="$database_url" \
    "$CARGO_TARGET_DIR/release/stockd" serve >"$dir/out.$p.log" 2>"$dir/err.$p.log") &
  echo $! >"$dir/pid.$p"
  for _ in $(seq 1 100); do grep -q listening "$dir/out.$p.log" 2>/dev/null && break; sleep 0.1; done
done
s="http://127.0.0.1:$port"
# Runs wrk against every process at once (connections split evenly) and sums requests/s.
wrk_all() {
  local path="$1"; shift
  local pids=()
  for p in $(seq 1 "$processes"); do
    wrk --latency -t$((2 > processes ? 2 / processes : 1)) -c$((connections / processes)) -d"$duration" "$@" \
      "http://127.0.0.1:$((port + p - 1))$path" -- "p$p" >"$dir/wrk.$p.txt" &
    pids+=($!)
  done
  wait "${pids[@]}"
  cat "$dir"/wrk.*.txt | grep -E 'Latency|Non-2xx| 50%| 99%'
  awk '/Requests\/sec/ {sum += $2} END {printf "Requests/sec (all processes): %.0f\n", sum}' "$dir"/wrk.*.txt
  rm -f "$dir"/wrk.*.txt
}
key=$(curl -s -X POST "$s/v1/admin/tenants" -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' \
  -d '{"id":"load","name":"Load"}' | sed -E 's/.*"api_key":"([^"]+)".*/\1/')
curl -s -X POST "$s/v1/resources" -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
  -d '{"key":"hot","kind":"inventory","total":1000000000}' >/dev/null
if [ -n "${PLUGIN:-}" ]; then
  curl -s -X PUT "$s/v1/plugin" -H "Authorization: Bearer $key" -H 'Content-Type: application/wasm' \
    --data-binary @"$PLUGIN"; echo
fi
cat >"$dir/order.lua" <<LUA
-- Each wrk process (its argument) and thread gets its own id, so every request carries a
-- distinct Idempotency-Key.
local threads = 0
function setup(thread) threads = threads + 1; thread:set("tid", threads) end
local n = 0
local prefix = "p"
function init(args) prefix = args[1] or "p" end
request = function()
  n = n + 1
  return wrk.format("POST", "/v1/orders", {
    ["Authorization"] = "Bearer $key", ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = "k-" .. prefix .. "-" .. tid .. "-" .. n },
    '{"order_id":"o","action":"deduct","lines":[{"key":"hot","qty":1}]}')
end
LUA
echo "== /healthz ($connections connections over $processes process(es), $duration)"
wrk_all /healthz
echo "== hot-key deduct ($connections connections over $processes process(es), $duration)"
wrk_all /v1/orders -s "$dir/order.lua"
curl -s "$s/v1/resources/hot" -H "Authorization: Bearer $key"; echo
curl -s "$s/v1/reconciliation" -H "Authorization: Bearer $key"; echo
curl -s "$s/metrics" | grep -E '^stockd_batch_size_(sum|count)'
