#!/usr/bin/env python3
"""Bytes per order by table and by index, for docs/PERFORMANCE.md ("Storage per order").

Usage: storage-breakdown.py STOCKD_BINARY sqlite|postgres SCENARIO [SECONDS] [--keep DIR]
(DATABASE_URL: the PostgreSQL server on which a fresh database is created and dropped; default
postgres://postgres@127.0.0.1:5432/postgres).

Starts `stockd serve` on a fresh database, runs `stockd bench --url ... --scenarios SCENARIO`
against it (SECONDS, default 5) and sizes every b-tree just before and just after the load
(through the bench's --exec-before-load / --exec-after-load), then prints the growth of each
divided by the successful operations. `stockd bench` itself reports the total and the split by
table (indexes included); this splits a table from its indexes, and on SQLite shows from
`dbstat` how full the new pages are: `payload` (bytes of rows), `unused` (free bytes in the
pages) and `ncell` (entries). On PostgreSQL: `main` (the relation's pages), `fsm+vm` (its free
space and visibility maps) and `toast`. With --keep DIR (SQLite) the database is left in DIR as
DIR/stockd.db, e.g. for `schema-trial.py`. Needs the `sqlite3` or `psql` command-line client."""
import json, os, secrets, shutil, subprocess, sys, tempfile

SQLITE_QUERY = (
    "SELECT d.name, COALESCE(s.type, 'table'), COALESCE(s.tbl_name, d.name), SUM(d.pgsize), SUM(d.payload), "
    "SUM(d.unused), SUM(d.ncell) FROM dbstat d LEFT JOIN sqlite_schema s ON s.name = d.name GROUP BY d.name")
POSTGRES_QUERY = (
    "SELECT c.relname, CASE c.relkind WHEN 'i' THEN 'index' ELSE 'table' END, COALESCE(t.relname, c.relname), "
    "pg_relation_size(c.oid), pg_relation_size(c.oid, 'fsm') + pg_relation_size(c.oid, 'vm'), "
    "COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0) "
    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "LEFT JOIN pg_index i ON i.indexrelid = c.oid LEFT JOIN pg_class t ON t.oid = i.indrelid "
    "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'i')")


def snapshot(backend, target, out):
    """Writes `name|kind|table|sizes...` for every b-tree (the bench's load hooks call this)."""
    if backend == "sqlite":
        cmd = ["sqlite3", "-separator", "|", target, SQLITE_QUERY]
    else:
        cmd = ["psql", target, "-F|", "-Atc", POSTGRES_QUERY]
    with open(out, "w") as f:
        f.write(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def parse(path):
    rows = {}
    for line in open(path).read().splitlines():
        name, kind, table, *sizes = line.split("|")
        rows[name] = (kind, table, [int(x or 0) for x in sizes])
    return rows


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--snapshot":
        snapshot(*sys.argv[2:5])
        return
    args = sys.argv[1:]
    keep = None
    if "--keep" in args:
        i = args.index("--keep")
        keep = args[i + 1]
        del args[i:i + 2]
    binary, backend, scenario = args[0], args[1], args[2]
    seconds = args[3] if len(args) > 3 else "5"
    admin_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    work = keep or tempfile.mkdtemp(prefix="stockd-breakdown-")
    os.makedirs(work, exist_ok=True)
    pg_db = None
    if backend == "sqlite":
        target = f"{work}/stockd.db"
        db_url = f"sqlite://{target}"
    else:
        pg_db = "stockd_breakdown_" + secrets.token_hex(4)
        subprocess.run(["psql", admin_url, "-qAtc", f"CREATE DATABASE {pg_db}"], check=True)
        target = db_url = admin_url.rsplit("/", 1)[0] + "/" + pg_db
    token = "breakdown-" + secrets.token_hex(12)
    env = dict(os.environ, STOCKD_LISTEN="127.0.0.1:0", STOCKD_DATABASE_URL=db_url, STOCKD_ADMIN_TOKEN=token,
               RUST_LOG="warn")
    server = subprocess.Popen([binary, "serve"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        base = None
        for line in server.stdout:
            if line.startswith("listening on "):
                base = line.split()[-1]
                break
        if base is None:
            sys.exit("the server exited before listening")
        me = os.path.abspath(__file__)
        hook = f"python3 {me} --snapshot {backend} '{target}' {work}/"
        bench = subprocess.run([binary, "bench", "--url", base, "--admin-token", token, "--scenarios", scenario,
                                "--duration-secs", seconds, "--json", f"{work}/bench.json",
                                "--exec-before-load", hook + "before", "--exec-after-load", hook + "after"],
                               capture_output=True, text=True)
        if bench.returncode != 0:
            sys.exit(f"stockd bench failed:\n{bench.stdout}{bench.stderr}")
        result = json.load(open(f"{work}/bench.json"))[0]
        ok = result["ok"]
        before, after = parse(f"{work}/before"), parse(f"{work}/after")
        columns = ["pgsize", "payload", "unused", "ncell"] if backend == "sqlite" else ["main", "fsm+vm", "toast"]
        print(f"{backend} {scenario}: {ok} successful operations ({result['ok_per_sec']:.0f}/s), bytes per operation")
        print(f"{'b-tree':32s} {'kind':6s} {'table':14s} " + " ".join(f"{c:>9s}" for c in columns))
        total = 0.0
        for name, (kind, table, sizes) in sorted(after.items(), key=lambda r: (r[1][1], r[1][0] != "table", r[0])):
            old = before.get(name, (kind, table, [0] * len(sizes)))[2]
            grown = [(a - b) / ok for a, b in zip(sizes, old)]
            if all(abs(g) < 0.05 for g in grown):
                continue
            total += grown[0] if backend == "sqlite" else sum(grown)
            print(f"{name:32s} {kind:6s} {table:14s} " + " ".join(f"{g:9.1f}" for g in grown))
        print(f"{'total':54s} {total:9.1f}")
    finally:
        server.terminate()
        server.wait()
        if pg_db:
            subprocess.run(["psql", admin_url, "-qAtc", f"DROP DATABASE IF EXISTS {pg_db} WITH (FORCE)"])
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
