#!/usr/bin/env bash
# The ceiling of redis mode: redis-benchmark calling the bare deduct script (src/hotpath/scripts.rs,
# by EVALSHA) on one hot key with the same argument sizes stockd sends, against the Redis at
# REDIS_URL_HOST:REDIS_PORT. Each call uses a new request key, so every call is a fresh sale (a
# decrement, a stored outcome and a stream entry). The keys it creates are deleted afterwards.
#
#   bash scripts/bench/redis-lua.sh            # 64 clients, 200000 calls, 127.0.0.1:6379
#   CLIENTS=64 CALLS=200000 REDIS_PORT=6379 bash scripts/bench/redis-lua.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

HOST="${REDIS_URL_HOST:-127.0.0.1}"
PORT="${REDIS_PORT:-6379}"
CLIENTS="${CLIENTS:-64}"
CALLS="${CALLS:-200000}"
PREFIX="redis-lua-bench-$$"
cli() { redis-cli -h "$HOST" -p "$PORT" "$@"; }

# The script text, exactly as stockd loads it.
script=$(python3 - <<'EOF'
import re
s = open("src/hotpath/scripts.rs").read()
print(re.search(r'pub const DEDUCT: &str = r#"(.*?)"#;', s, re.S).group(1))
EOF
)
sha=$(cli SCRIPT LOAD "$script")
res="$PREFIX:{bench:k}:r"
cli HSET "$res" avail 1000000000000000 backlog 0 open 1 inactive 0 >/dev/null
cli XGROUP CREATE "$PREFIX:{bench:k}:x" settle 0 MKSTREAM >/dev/null

# Argument sizes of a real one-line order: four order documents (~234 bytes) and the
# settlement record (~700 bytes).
body=$(printf '%*s' 234 '' | tr ' ' 'b')
record=$(printf '%*s' 700 '' | tr ' ' 'r')

cleanup() {
  cli --scan --pattern "$PREFIX:*" | xargs -r -n 500 redis-cli -h "$HOST" -p "$PORT" DEL >/dev/null
}
trap cleanup EXIT

echo "redis-benchmark: EVALSHA deduct, $CLIENTS clients, $CALLS calls (CSV: rps and latency in ms)"
redis-benchmark -h "$HOST" -p "$PORT" -c "$CLIENTS" -n "$CALLS" -r 1000000000 --csv \
  EVALSHA "$sha" 6 "$res" "$PREFIX:{bench:k}:l" "$PREFIX:{bench:k}:q:__rand_int__" "$PREFIX:{bench:k}:x" \
  "$PREFIX:{bench:k}:v" "$PREFIX:{bench:k}:e" \
  1 "" 0 "request-hash-0123456789abcdef" 86400 "$body" "$body" "$body" "$body" "$record" \
  "$PREFIX:soldout" "0 bench k" deduct "" 0 "" | sed -E 's/^"EVALSHA[^"]*"/"EVALSHA deduct"/'
echo "stock left: $(cli HGET "$res" avail) (of 1000000000000000)"
