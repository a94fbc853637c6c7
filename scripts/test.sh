#!/usr/bin/env bash
# Runs every check and test stockd has: formatting, lints, unit tests, and the black-box HTTP
# suite against the real server binary on each storage backend (SQLite, then PostgreSQL, then
# MySQL on MariaDB), the fault tests on a throwaway PostgreSQL and a throwaway MariaDB, and
# schemathesis against a fresh server and its own OpenAPI document (scripts/schemathesis.sh).
# This is the README's test command and exactly what CI runs. It starts PostgreSQL when none
# answers on 127.0.0.1:5432, MariaDB when none answers on 127.0.0.1:3306, Redis when none
# answers on 127.0.0.1:6379 and NATS with JetStream when none answers on 127.0.0.1:4222,
# installing each from Debian's packages if it is missing, and Chromium (Debian's package) with
# playwright-core (npm, pinned in tests/console/) for the console's browser test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Builds stay warm across fresh clones when the target directory lives outside the clone.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/stockd-target}"
export CARGO_TERM_COLOR=never
# The suite creates (and drops) one database per test on these servers.
export STOCKD_TEST_PG_URL="${STOCKD_TEST_PG_URL:-postgres://postgres:postgres@127.0.0.1:5432/postgres}"
export STOCKD_TEST_MYSQL_URL="${STOCKD_TEST_MYSQL_URL:-mysql://root@127.0.0.1:3306/mysql}"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

ensure_postgres() {
  answers 5432 && return 0
  echo "== starting PostgreSQL (none answers on 127.0.0.1:5432)"
  if ! ls -d /etc/postgresql/*/main >/dev/null 2>&1; then
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  local version
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>/dev/null \
    || as_root pg_ctlcluster "$version" main start
  for _ in $(seq 1 60); do answers 5432 && break; sleep 0.5; done
  answers 5432 || { echo "PostgreSQL did not start" >&2; exit 1; }
  # A fresh Debian install authenticates TCP clients by password: give the suite one.
  as_root su postgres -c "psql -qc \"ALTER USER postgres PASSWORD 'postgres'\""
}

# MariaDB for the MySQL pass (one database per test, on STOCKD_TEST_MYSQL_URL) and for the fault
# tests, which run their own throwaway mariadbd from the same package.
mariadb_root_over_tcp() { mariadb --protocol=tcp -h 127.0.0.1 -P 3306 -u root -e 'SELECT 1' >/dev/null 2>&1; }

ensure_mariadb() {
  [ -x /usr/sbin/mariadbd ] && command -v mariadb-install-db >/dev/null 2>&1 || {
    echo "== installing mariadb-server"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mariadb-server >/dev/null
  }
  [ -x /usr/sbin/mariadbd ] || { echo "mariadb-server could not be installed" >&2; exit 1; }
  if ! answers 3306; then
    echo "== starting MariaDB (none answers on 127.0.0.1:3306)"
    # What Debian's init script runs, without its wait on /etc/mysql/debian.cnf, which not
    # every install has. The package's configuration makes it listen on 127.0.0.1:3306.
    local log="${TMPDIR:-/tmp}/stockd-mariadbd-safe.log"
    as_root install -d -m 755 -o mysql -g root /run/mysqld
    as_root setsid nohup mariadbd-safe >"$log" 2>&1 </dev/null &
    for _ in $(seq 1 120); do answers 3306 && break; sleep 0.5; done
    answers 3306 || { echo "MariaDB did not start on 127.0.0.1:3306 (see $log and its error log)" >&2; exit 1; }
  fi
  mariadb_root_over_tcp && return 0
  # A fresh Debian install lets root in through the unix socket only: let the suite's URL in
  # too (root without a password, over TCP from this machine), keeping the socket login.
  echo "== letting root connect to MariaDB over TCP from 127.0.0.1 without a password"
  as_root mariadb --protocol=socket -u root -e "
    ALTER USER 'root'@'localhost' IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD('');
    CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY '';
    GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;"
  mariadb_root_over_tcp || { echo "root cannot connect to MariaDB on 127.0.0.1:3306" >&2; exit 1; }
}

# Redis for the redis-mode tests (tests that stop or restart Redis start their own
# redis-server on a free port). Redis keeps nothing on disk here: the tests make their own
# snapshots where they need one.
ensure_redis() {
  command -v redis-server >/dev/null 2>&1 || {
    echo "== installing redis-server"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  }
  command -v redis-server >/dev/null 2>&1 || { echo "redis-server could not be installed" >&2; exit 1; }
  answers 6379 && return 0
  echo "== starting Redis (none answers on 127.0.0.1:6379)"
  redis-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no --daemonize yes >/dev/null
  for _ in $(seq 1 60); do answers 6379 && break; sleep 0.25; done
  answers 6379 || { echo "Redis did not start on 127.0.0.1:6379" >&2; exit 1; }
}

# NATS with JetStream for the broker-sink tests (tests/api/nats_sink.rs), each of which makes
# its own stream and deletes it. Debian installs the binary in /usr/sbin.
nats_server() { command -v nats-server 2>/dev/null || { [ -x /usr/sbin/nats-server ] && echo /usr/sbin/nats-server; }; }

ensure_nats() {
  nats_server >/dev/null || {
    echo "== installing nats-server"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >/dev/null
  }
  local bin
  bin=$(nats_server) || { echo "nats-server could not be installed" >&2; exit 1; }
  answers 4222 && return 0
  echo "== starting NATS with JetStream (none answers on 127.0.0.1:4222)"
  local dir="${TMPDIR:-/tmp}/stockd-nats"
  mkdir -p "$dir"
  setsid nohup "$bin" -a 127.0.0.1 -p 4222 -js -sd "$dir/jetstream" >"$dir/nats-server.log" 2>&1 </dev/null &
  for _ in $(seq 1 60); do answers 4222 && break; sleep 0.25; done
  answers 4222 || { echo "NATS did not start on 127.0.0.1:4222 (see $dir/nats-server.log)" >&2; exit 1; }
}

# Debian's Chromium and the pinned playwright-core for the console's browser test
# (tests/api/console.rs, driving tests/console/console.test.mjs with Node.js).
ensure_browser() {
  [ -x /usr/bin/chromium ] || {
    echo "== installing chromium"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  }
  [ -x /usr/bin/chromium ] || { echo "chromium could not be installed" >&2; exit 1; }
  command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || {
    echo "== installing nodejs and npm"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
  }
  local pinned installed
  pinned=$(node -p 'require("./tests/console/package.json").dependencies["playwright-core"]')
  installed=$(node -p 'try { require("./tests/console/node_modules/playwright-core/package.json").version } catch { "" }')
  if [ "$pinned" != "$installed" ]; then
    echo "== npm ci (tests/console: playwright-core $pinned)"
    npm ci --prefix tests/console --no-audit --no-fund >/dev/null
  fi
}

# The JavaScript and Python plugins' tools: componentize-js needs Node.js 20+ (ensure_browser
# installs node and npm when missing), componentize-py a Python with its venv module.
ensure_components() {
  python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || {
    echo "== installing python3-venv"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  }
  echo "== building the JavaScript and Python example plugins (plugins/build-components.sh)"
  bash plugins/build-components.sh
}

ensure_postgres
ensure_mariadb
ensure_redis
ensure_nats
ensure_browser
ensure_components
export STOCKD_TEST_REDIS_URL="${STOCKD_TEST_REDIS_URL:-redis://127.0.0.1:6379}"
export STOCKD_TEST_NATS_URL="${STOCKD_TEST_NATS_URL:-nats://127.0.0.1:4222}"

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy"
cargo clippy --all-targets --locked -- -D warnings

echo "== cargo test (unit tests; HTTP suite on SQLite; fault tests on PostgreSQL; model check, see docs/TESTING.md)"
cargo test --all-targets --locked

echo "== cargo test (HTTP suite on PostgreSQL)"
STOCKD_TEST_BACKEND=postgres cargo test --test api --locked

echo "== cargo test (HTTP suite on MySQL, on MariaDB; fault tests on MariaDB)"
STOCKD_TEST_BACKEND=mysql cargo test --test api --test faults --locked

echo "== schemathesis (the server against its own OpenAPI document, see docs/TESTING.md)"
bash scripts/schemathesis.sh
