#!/usr/bin/env python3
"""Reconciliation over a long ledger, for docs/PERFORMANCE.md ("Incremental reconciliation").

Usage: reconciliation.py STOCKD_BINARY sqlite|postgres [RESOURCES] [ROWS_PER_RESOURCE]
(defaults 1000 x 1000 = 1,000,000 ledger rows; PostgreSQL on $PG_URL, default
postgres://postgres@127.0.0.1:5432/postgres, where a fresh database is created and dropped).

1. A fresh database is migrated by the binary itself (so its own migrations and indexes are in
   place) and tenant `bench` is created through the admin API.
2. With the server stopped, SQL seeds RESOURCES resources, each with one `create` entry and
   ROWS_PER_RESOURCE - 1 `deduct` entries of 1 (interleaved across resources, as real traffic
   writes them), and counters that agree with them: reconciliation is clean.
3. The server starts with `[reconciliation] interval_seconds = 3600`, so the job passes once,
   at start-up, over every tenant. That pass is timed from the `listening on` line (the jobs are
   started after it) to the moment `stockd_reconciliation_checked_resources` appears in
   `/metrics` (set when the pass ends; polled every 5 ms).
4. `GET /v1/reconciliation` is timed REPEAT times (the data does not change), then
   `?pass=full` (a binary without passes ignores the parameter and does its only kind).
5. The server is restarted RESTARTS times (default 3) and the quickest start-up pass taken: on
   a binary with checkpoints it now starts from the checkpoints the first pass stored.
Start-up passes are reported minus the quickest start-up pass over the empty tenant, timed the
same way before seeding (what start-up does beside the pass).
Prints one line per measurement. KEEP=1 keeps the database (and prints its URL)."""
import os, re, statistics, subprocess, sys, tempfile, time, urllib.request, json, threading

binary = os.path.abspath(sys.argv[1])
backend = sys.argv[2]
resources = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
per_resource = int(sys.argv[4]) if len(sys.argv) > 4 else 1000
REPEAT = int(os.environ.get("REPEAT", "5"))
RESTARTS = int(os.environ.get("RESTARTS", "3"))
PG_URL = os.environ.get("PG_URL", "postgres://postgres@127.0.0.1:5432/postgres")
ADMIN = "bench-admin-token-0123456789"
tmp = tempfile.mkdtemp(prefix="stockd-recon-bench-")

if backend == "sqlite":
    db_url = f"sqlite://{tmp}/bench.db"
else:
    db_name = f"recon_bench_{os.getpid()}"
    subprocess.run(["psql", PG_URL, "-qc", f"CREATE DATABASE {db_name}"], check=True)
    db_url = PG_URL.rsplit("/", 1)[0] + "/" + db_name
config = os.path.join(tmp, "stockd.toml")
with open(config, "w") as f:
    # A full pass over a long ledger may outlast the default request time limit.
    f.write("[reconciliation]\ninterval_seconds = 3600\n[server]\nrequest_timeout_ms = 600000\n")


servers = []


def start():
    env = dict(os.environ, STOCKD_DATABASE_URL=db_url, STOCKD_LISTEN="127.0.0.1:0", STOCKD_ADMIN_TOKEN=ADMIN,
               RUST_LOG="warn")
    proc = subprocess.Popen([binary, "serve", "--config", config], env=env, stdout=subprocess.PIPE, text=True)
    servers.append(proc)
    for line in proc.stdout:
        m = re.match(r"listening on (http://\S+)", line.strip())
        if m:
            listening = time.perf_counter()
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1), listening
    raise SystemExit("the server exited before listening")


def request(base, path, token, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, headers={"Authorization": f"Bearer {token}",
                                                                   "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read() or b"null")


def first_pass_seconds(base, listening):
    while True:
        with urllib.request.urlopen(base + "/metrics", timeout=60) as resp:
            if b"stockd_reconciliation_checked_resources" in resp.read():
                return time.perf_counter() - listening
        time.sleep(0.005)


def stop(proc):
    proc.terminate()
    proc.wait(timeout=60)


def seed():
    def series(name, upto):
        if backend == "sqlite":
            return f"{name}(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM {name} WHERE n < {upto})"
        return f"{name}(n) AS (SELECT generate_series(1, {upto}))"
    last = per_resource - 1
    sql = f"""
WITH RECURSIVE {series('r', resources)}
INSERT INTO resources (tenant_id, key, kind, status, mode, buckets, total, available, reserved, consumed,
                       version, created_at, updated_at)
SELECT 'bench', 'sku-' || n, 'inventory', 'active', 'db', 1, 1000000, {1000000 - last}, 0, {last},
       {per_resource}, 0, 0 FROM r;
WITH RECURSIVE {series('r', resources)}, {series('v', per_resource)}
INSERT INTO ledger (tenant_id, resource_key, bucket, op, qty, request_id, available_after, reserved_after,
                    consumed_after, version_after, at)
SELECT 'bench', 'sku-' || r.n, 0, CASE WHEN v.n = 1 THEN 'create' ELSE 'deduct' END,
       CASE WHEN v.n = 1 THEN 1000000 ELSE 1 END, 'req-' || r.n || '-' || v.n, 1000000 - (v.n - 1), 0, v.n - 1,
       v.n, 0
FROM v, r ORDER BY v.n, r.n;
"""
    started = time.perf_counter()
    if backend == "sqlite":
        subprocess.run(["sqlite3", f"{tmp}/bench.db"], input=sql, text=True, check=True)
    else:
        subprocess.run(["psql", db_url, "-q", "-v", "ON_ERROR_STOP=1"], input=sql + "ANALYZE;", text=True,
                       check=True)
    return time.perf_counter() - started


def ms(seconds):
    return f"{seconds * 1000:.1f} ms"


def startup_pass(restarts):
    """The quickest of `restarts` start-up passes."""
    best = None
    for _ in range(restarts):
        proc, base, listening = start()
        took = first_pass_seconds(base, listening)
        stop(proc)
        best = took if best is None else min(best, took)
    return best


try:
    proc, base, listening = start()
    first_pass_seconds(base, listening)
    key = request(base, "/v1/admin/tenants", ADMIN, {"id": "bench", "name": "bench"})["api_key"]
    stop(proc)
    empty = startup_pass(RESTARTS)
    print(f"start-up pass, empty tenant (the baseline: start-up work beside the pass): {ms(empty)}", flush=True)
    print(f"{backend}: seeded {resources * per_resource:,} ledger rows in {seed():.1f} s", flush=True)

    proc, base, listening = start()
    print(f"start-up pass (first over the ledger): {ms(first_pass_seconds(base, listening) - empty)}",
          flush=True)
    times, reads = [], None
    for _ in range(REPEAT):
        t = time.perf_counter()
        report = request(base, "/v1/reconciliation", key)
        times.append(time.perf_counter() - t)
        assert report["drift"] == [] and report["checked"] == resources, report
        reads = report.get("ledger_rows_read", "-")
    print(f"GET /v1/reconciliation x{REPEAT}: median {ms(statistics.median(times))}, "
          f"min {ms(min(times))}, max {ms(max(times))}; ledger_rows_read {reads}", flush=True)
    times = []
    for _ in range(max(1, REPEAT // 2)):
        t = time.perf_counter()
        report = request(base, "/v1/reconciliation?pass=full", key)
        times.append(time.perf_counter() - t)
        assert report["drift"] == [], report
    print(f"GET /v1/reconciliation?pass=full x{len(times)}: median {ms(statistics.median(times))}; "
          f"ledger_rows_read {report.get('ledger_rows_read', '-')}", flush=True)
    stop(proc)

    unchanged = startup_pass(RESTARTS)
    print(f"start-up pass, data unchanged (quickest of {RESTARTS} restarts): {ms(unchanged - empty)}", flush=True)
finally:
    for server in servers:
        if server.poll() is None:
            server.kill()
    if os.environ.get("KEEP"):
        print(f"kept {db_url}", flush=True)
    elif backend == "postgres":
        subprocess.run(["psql", PG_URL, "-qc", f"DROP DATABASE IF EXISTS {db_name} WITH (FORCE)"])
    if not os.environ.get("KEEP"):
        subprocess.run(["rm", "-rf", tmp])
