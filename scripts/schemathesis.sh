#!/usr/bin/env bash
# Fuzzes a fresh `stockd serve` against its own OpenAPI document with schemathesis: every answer
# must be documented (status, content type, body schema), no answer may be a 5xx, and a request
# the document says is invalid must be refused. Any finding fails this script (and so the
# README's test command, scripts/test.sh, which runs it after the cargo tests). docs/TESTING.md
# says what it covers, what it leaves out and why.
#
# schemathesis is pinned to one version and installed from PyPI into a virtualenv under
# ${XDG_CACHE_HOME:-$HOME/.cache}/stockd-schemathesis when that virtualenv or that version is
# missing. The server is the debug binary cargo built in $CARGO_TARGET_DIR (built here if absent),
# on a free port, with a temporary SQLite database and a random admin token.
#
# Settings (environment): STOCKD_SCHEMATHESIS_EXAMPLES (test cases per operation and phase,
# default 40), STOCKD_SCHEMATHESIS_SEED (default 1, so a run is repeatable; any number explores
# other inputs).
set -euo pipefail
cd "$(dirname "$0")/.."

SCHEMATHESIS_VERSION=4.32.5
EXAMPLES="${STOCKD_SCHEMATHESIS_EXAMPLES:-40}"
SEED="${STOCKD_SCHEMATHESIS_SEED:-1}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/stockd-target}"
VENV="${XDG_CACHE_HOME:-$HOME/.cache}/stockd-schemathesis"

installed_version() { "$VENV/bin/schemathesis" --version 2>/dev/null | awk '{print $NF}'; }

if [ "$(installed_version)" != "$SCHEMATHESIS_VERSION" ]; then
  echo "== installing schemathesis $SCHEMATHESIS_VERSION into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION"
  [ "$(installed_version)" = "$SCHEMATHESIS_VERSION" ] || { echo "schemathesis $SCHEMATHESIS_VERSION did not install" >&2; exit 1; }
fi

STOCKD="$CARGO_TARGET_DIR/debug/stockd"
[ -x "$STOCKD" ] || cargo build --locked --bin stockd

WORK=$(mktemp -d "${TMPDIR:-/tmp}/stockd-schemathesis.XXXXXX")
SERVER_PID=
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

ADMIN_TOKEN="adm-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
# A long poll holds a request for up to [events] max_wait_seconds: one second here, so the
# document's bound on `wait` keeps every generated poll short.
cat >"$WORK/stockd.toml" <<'EOF'
[events]
max_wait_seconds = 1
EOF

STOCKD_LISTEN=127.0.0.1:0 STOCKD_DATABASE_URL="sqlite://$WORK/stockd.db" STOCKD_ADMIN_TOKEN="$ADMIN_TOKEN" \
  RUST_LOG="${RUST_LOG:-warn}" "$STOCKD" serve --config "$WORK/stockd.toml" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
ADDR=
for _ in $(seq 1 120); do
  ADDR=$(sed -n 's|^listening on http://||p' "$WORK/server.log" | head -n 1)
  [ -n "$ADDR" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || break
  sleep 0.25
done
[ -n "$ADDR" ] || { echo "stockd did not start:" >&2; cat "$WORK/server.log" >&2; exit 1; }

# The tenant whose key the tenant operations carry.
TENANT_KEY=$(curl -sSf -X POST "http://$ADDR/v1/admin/tenants" \
  -H "Authorization: Bearer $ADMIN_TOKEN" -H 'Content-Type: application/json' \
  -d '{"id": "schemathesis", "name": "schemathesis"}' |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["api_key"])')

# Each operation carries the token of the security scheme it declares: the tenant key for
# `api_key`, the admin token for `admin_token`.
cat >"$WORK/schemathesis.toml" <<'EOF'
[auth.openapi.api_key]
bearer = "${STOCKD_ST_TENANT_KEY}"

[auth.openapi.admin_token]
bearer = "${STOCKD_ST_ADMIN_TOKEN}"
EOF

echo "== schemathesis $SCHEMATHESIS_VERSION against http://$ADDR/openapi.json ($EXAMPLES examples per operation, seed $SEED)"
started=$SECONDS
status=0
STOCKD_ST_TENANT_KEY="$TENANT_KEY" STOCKD_ST_ADMIN_TOKEN="$ADMIN_TOKEN" \
  PYTHONPATH="$PWD/scripts/schemathesis" SCHEMATHESIS_HOOKS=hooks \
  "$VENV/bin/schemathesis" --no-color --config-file "$WORK/schemathesis.toml" run "http://$ADDR/openapi.json" \
  --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,negative_data_rejection \
  --phases examples,coverage,fuzzing \
  --max-examples "$EXAMPLES" \
  --seed "$SEED" \
  --workers 1 \
  --request-timeout 10 \
  --generation-database none \
  --suppress-health-check all \
  --report-dir "$WORK/report" || status=$?
echo "== schemathesis finished in $((SECONDS - started)) s (exit $status)"
if [ "$status" != 0 ]; then
  echo "== server log (last 50 lines)"
  tail -n 50 "$WORK/server.log"
fi
exit "$status"
