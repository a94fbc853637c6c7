#!/usr/bin/env bash
# Instructions per order: the server's instruction count for a fixed number of orders, counted
# by valgrind's callgrind. Unlike ok/s or CPU time it barely moves on a shared, noisy machine,
# so it is the figure to compare two builds by (docs/PERFORMANCE.md, "Instructions per order").
# It is not exact: with concurrent clients the batches' sizes depend on timing, and a batch's
# fixed work is shared by its orders, so one build's count has moved by up to 3 % between runs
# (2026-12-06); count each build at least twice before reading a difference of a few percent.
#
# Usage: scripts/bench/callgrind.sh [STOCKD_BINARY] [sqlite|postgres] [ORDERS]
#   STOCKD_BINARY  default $CARGO_TARGET_DIR/release/stockd, else target/release/stockd
#   backend        default sqlite
#   ORDERS         orders per scenario, default 2000
# Environment: SCENARIOS (default hot-key,uniform; multi-line and replay-storm also work, not the
# scenarios of two requests per order),
# CLIENTS (concurrent clients, default 16), DATABASE_URL (the PostgreSQL server on which a fresh
# database is created and dropped; default postgres://postgres@127.0.0.1:5432/postgres),
# IDLE_SECS (length of the idle measurement, default 10; 0 skips it), KEEP_DUMPS (a directory to
# keep each load's dump in, as callgrind.BACKEND.SCENARIO.out, for callgrind_annotate).
#
# For each scenario, on a fresh database (a SQLite file in a temp dir, or a new PostgreSQL
# database), it starts `stockd serve` under `valgrind --tool=callgrind --separate-threads=no`
# (every thread of the server summed in one count), waits until /readyz answers, and runs
# `stockd bench --url ... --orders ORDERS` against it, which creates the tenant and the
# scenario's resources, then zeroes the counters (`callgrind_control -z`) just before the first
# order and dumps them (`callgrind_control -d`) as soon as the last one is answered. The load
# generator is the native `stockd bench` process, outside valgrind: only the server is counted
# (on PostgreSQL, stockd's own instructions, not the database server's). Printed: Ir of that
# dump / ORDERS. The script fails unless every order succeeded and the bench's checks passed.
#
# Nothing is subtracted: the count includes whatever the server's background work (timers, the
# SQLite checkpoint thread, the expiry and rebalance jobs) did during the load. The periodic
# reconciliation pass is switched off, because whether it falls inside the load depends on the
# wall time. The idle column is the same server's count per second with no load (measured after
# the load for IDLE_SECS), and idle/order that rate times the load's wall time divided by the
# orders: the share of the figure that is not the orders' (under 1.5 % in our runs).
#
# Under valgrind the server runs 20-50x slower, so the client timeout and the server's
# request_timeout_ms are raised to 10 minutes. Clients are concurrent so that group commit
# batches orders as it does natively; the count is fixed, not the time.
set -euo pipefail

BIN=${1:-${CARGO_TARGET_DIR:-target}/release/stockd}
BACKEND=${2:-sqlite}
ORDERS=${3:-2000}
SCENARIOS=${SCENARIOS:-hot-key,uniform}
CLIENTS=${CLIENTS:-16}
DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
IDLE_SECS=${IDLE_SECS:-10}
KEEP_DUMPS=${KEEP_DUMPS:-}

case "$BACKEND" in sqlite | postgres) ;; *)
    echo "backend must be sqlite or postgres, not $BACKEND" >&2
    exit 2
    ;;
esac
[ -x "$BIN" ] || {
    echo "no stockd binary at $BIN (build with cargo build --release)" >&2
    exit 2
}
for tool in valgrind callgrind_control curl psql python3; do
    [ "$tool" = psql ] && [ "$BACKEND" = sqlite ] && continue
    command -v "$tool" >/dev/null || {
        echo "$tool is needed" >&2
        exit 2
    }
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/stockd-callgrind.XXXXXX")
SERVER_PID=
PG_DB=

# Stops the server this script started (by its pid) and drops its database.
stop_server() {
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
    if [ -n "$PG_DB" ]; then
        psql "$DATABASE_URL" -qAtc "DROP DATABASE IF EXISTS $PG_DB WITH (FORCE)" >/dev/null || true
        PG_DB=
    fi
}
cleanup() {
    stop_server
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The callgrind dump files of the current server, oldest first.
dumps() { ls -1tr "$WORK"/run/callgrind.out.*.* 2>/dev/null || true; }
# The Ir total of a dump file.
total_ir() { awk '/^(totals|summary):/ { print $2; exit }' "$1"; }

# Starts the server under callgrind on a fresh database; sets SERVER_PID and BASE.
start_server() {
    rm -rf "$WORK/run"
    mkdir -p "$WORK/run"
    local db_url
    if [ "$BACKEND" = sqlite ]; then
        db_url="sqlite://$WORK/run/stockd.db"
    else
        PG_DB="stockd_callgrind_$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')"
        psql "$DATABASE_URL" -qAtc "CREATE DATABASE $PG_DB" >/dev/null
        db_url="${DATABASE_URL%/*}/$PG_DB"
    fi
    cat >"$WORK/run/stockd.toml" <<EOF
[server]
listen = "127.0.0.1:0"
request_timeout_ms = 600000
shutdown_grace_ms = 5000

[database]
busy_timeout_ms = 60000
acquire_timeout_ms = 60000

[reconciliation]
interval_seconds = 0
EOF
    # The background job opens its redirections after the fork: without the file in place first,
    # the first read below can run before it exists and fail the script (seen when the machine
    # was busy).
    : >"$WORK/run/server.out"
    STOCKD_DATABASE_URL="$db_url" STOCKD_ADMIN_TOKEN="$TOKEN" RUST_LOG=warn \
        valgrind --tool=callgrind --separate-threads=no --dump-instr=no --dump-line=no \
        --callgrind-out-file="$WORK/run/callgrind.out.%p" \
        "$BIN" serve --config "$WORK/run/stockd.toml" >"$WORK/run/server.out" 2>"$WORK/run/server.err" &
    SERVER_PID=$!
    local deadline=$((SECONDS + 600)) addr=
    while [ -z "$addr" ]; do
        addr=$(sed -n 's/^listening on //p' "$WORK/run/server.out" | head -1)
        if ! kill -0 "$SERVER_PID" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
            echo "the server did not start; its stderr:" >&2
            tail -20 "$WORK/run/server.err" >&2
            exit 1
        fi
        [ -n "$addr" ] || sleep 1
    done
    BASE=${addr%/}
    until curl -sf -o /dev/null "$BASE/readyz"; do
        [ $SECONDS -lt $deadline ] || {
            echo "the server did not become ready" >&2
            exit 1
        }
        sleep 1
    done
}

# A field of the bench's JSON row.
field() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[0][sys.argv[2]])' "$WORK/run/bench.json" "$1"; }

TOKEN="callgrind-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
echo "$(basename "$BIN") under callgrind, $BACKEND, $ORDERS orders per scenario, $CLIENTS clients" >&2
printf '%-9s %-12s %7s %7s %15s %12s %9s %10s %10s\n' \
    backend scenario orders ok Ir instr/order load_s idle_Ir/s idle/order
IFS=, read -r -a scenario_list <<<"$SCENARIOS"
for scenario in "${scenario_list[@]}"; do
    start_server
    "$BIN" bench --url "$BASE" --server-pid "$SERVER_PID" --admin-token "$TOKEN" \
        --scenarios "$scenario" --orders "$ORDERS" --clients "$CLIENTS" --client-timeout-secs 600 \
        --exec-before-load "callgrind_control -z $SERVER_PID >/dev/null" \
        --exec-after-load "callgrind_control -d $SERVER_PID >/dev/null" \
        --json "$WORK/run/bench.json" >"$WORK/run/bench.out" 2>"$WORK/run/bench.err" || {
        echo "stockd bench failed:" >&2
        cat "$WORK/run/bench.out" "$WORK/run/bench.err" >&2
        exit 1
    }
    ok=$(field ok)
    load_s=$(field duration_secs)
    if [ "$ok" != "$ORDERS" ]; then
        echo "$scenario: $ok of $ORDERS orders succeeded; see:" >&2
        cat "$WORK/run/bench.out" >&2
        exit 1
    fi
    load_dump=$(dumps | tail -1)
    [ -n "$load_dump" ] || {
        echo "no callgrind dump was written" >&2
        exit 1
    }
    ir=$(total_ir "$load_dump")
    if [ -n "$KEEP_DUMPS" ]; then
        mkdir -p "$KEEP_DUMPS"
        cp "$load_dump" "$KEEP_DUMPS/callgrind.$BACKEND.$scenario.out"
    fi
    idle_rate=- idle_per_order=-
    if [ "$IDLE_SECS" -gt 0 ]; then
        callgrind_control -z "$SERVER_PID" >/dev/null 2>&1
        sleep "$IDLE_SECS"
        callgrind_control -d "$SERVER_PID" >/dev/null 2>&1
        idle_ir=$(total_ir "$(dumps | tail -1)")
        idle_rate=$(python3 -c "print(round($idle_ir / $IDLE_SECS))")
        idle_per_order=$(python3 -c "print(round($idle_ir / $IDLE_SECS * $load_s / $ORDERS))")
    fi
    per_order=$(python3 -c "print(round($ir / $ORDERS))")
    printf '%-9s %-12s %7s %7s %15s %12s %9.1f %10s %10s\n' \
        "$BACKEND" "$scenario" "$ORDERS" "$ok" "$ir" "$per_order" "$load_s" "$idle_rate" "$idle_per_order"
    stop_server
done
