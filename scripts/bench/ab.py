#!/usr/bin/env python3
"""A/B of two stockd release binaries with `stockd bench`, for docs/PERFORMANCE.md.

Usage: ab.py BEFORE_BINARY AFTER_BINARY sqlite|postgres SCENARIO[,SCENARIO...] [RUNS]
(DUR=seconds per run, default 5). Alternates the binaries per scenario (the order flips each
run), and prints ok/s, the CPU time per successful operation of the bench process and its
server child (user + system), and the server's alone as the bench measures it (`server_cpu_us_per_op`:
the figure to compare, since the load generator's share does not depend on the server), then the
means and ratios."""
import json, os, resource, subprocess, sys, tempfile
bins = {"before": sys.argv[1], "after": sys.argv[2]}
backend = sys.argv[3]
scenarios = sys.argv[4].split(",")
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 2
dur = os.environ.get("DUR", "5")
rows = []
for rep in range(reps):
    for sc in scenarios:
        order = ["before", "after"] if rep % 2 == 0 else ["after", "before"]
        for name in order:
            out = tempfile.mktemp(suffix=".json")
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            r = subprocess.run([bins[name], "bench", "--backend", backend, "--duration-secs", dur,
                                "--scenarios", sc, "--json", out, "--plugins-dir", "plugins/dist"],
                               capture_output=True, text=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            if r.returncode != 0:
                print(name, sc, "FAILED", r.stderr[-2000:], file=sys.stderr)
                continue
            res = [x for x in json.load(open(out)) if x["scenario"] == sc][0]
            ops = res["ok_per_sec"] * float(dur)
            server = res.get("server_cpu_us_per_op") or 0.0
            rows.append((rep, sc, name, res["ok_per_sec"], res.get("p99_us", 0)/1000, cpu / max(ops, 1) * 1e6, server))
            print(f"{rep} {sc:16s} {name:6s} ok/s={res['ok_per_sec']:9.0f} p99={res.get('p99_ms')} "
                  f"cpu_us/op={cpu/max(ops,1)*1e6:7.1f} server_us/op={server:7.1f}", flush=True)
agg = {}
for rep, sc, name, oks, p99, cpu, server in rows:
    agg.setdefault((sc, name), []).append((oks, p99 or 0, cpu, server))
print("\nscenario          before ok/s  after ok/s  ratio   before cpu/op  after cpu/op  ratio"
      "   before server/op  after server/op  ratio")
for sc in scenarios:
    b = agg.get((sc, "before"), []); a = agg.get((sc, "after"), [])
    if not a or not b: continue
    mb = sum(x[0] for x in b)/len(b); ma = sum(x[0] for x in a)/len(a)
    cb = sum(x[2] for x in b)/len(b); ca = sum(x[2] for x in a)/len(a)
    sb = sum(x[3] for x in b)/len(b); sa = sum(x[3] for x in a)/len(a)
    print(f"{sc:16s} {mb:11.0f} {ma:11.0f} {ma/mb:6.2f}x {cb:12.1f} {ca:12.1f} {ca/cb:6.2f}x"
          f" {sb:17.1f} {sa:16.1f} {sa/max(sb, 1e-9):6.2f}x")
