#!/usr/bin/env python3
"""How a scenario's commits went, from the server's own histograms: batches, how long each took
and how many took long, and (SQLite) the writer's WAL checkpoints; read from `/metrics` just
before and just after each load, so only the load counts.

Usage:
  commits.py BINARY BENCH_ARGS...      runs `BINARY bench BENCH_ARGS --json F` with this script
                                       as its load hooks, then prints the table
  commits.py snap before|after STATE   (the hooks; STOCKD_BENCH_SCENARIO names the scenario)

Columns: `commits` batches committed during the load, `batch` their mean size (requests), `ms`
their mean duration (`stockd_batch_commit_seconds`: from the first statement to the answers),
`>5ms` `>10ms` `>25ms` the share of commits longer than that, `ckpt` the SQLite writer's own
WAL checkpoints and `ckpt ms` their mean (`stockd_sqlite_checkpoint_seconds`). A commit's
duration is what every request of its batch waits on top of queueing, so a few long ones are
what a p99 is made of. Needs `ss` (iproute2) to find the server's port."""
import json, os

import hooked

METRICS = ("stockd_batch_commit_seconds", "stockd_batch_size", "stockd_sqlite_checkpoint_seconds")


def snap(which, state):
    text = hooked.metrics_text(hooked.server_pid())
    scenario = os.environ.get("STOCKD_BENCH_SCENARIO", "?")
    with open(state, "a") as f:
        f.write(json.dumps({"which": which, "scenario": scenario, "h": hooked.histograms(text, METRICS)}) + "\n")


def delta(before, after, metric):
    b, a = before[metric], after[metric]
    n = a["count"] - b["count"]
    le = {k: a["le"].get(k, 0) - b["le"].get(k, 0) for k in a["le"]}
    return n, (a["sum"] - b["sum"]), le


def report(state, results):
    snaps = [json.loads(line) for line in open(state)]
    ok = {r["scenario"]: r for r in results}
    print(f"{'scenario':22s} {'ok/s':>7s} {'p99 ms':>7s} {'commits':>8s} {'batch':>6s} {'ms':>6s} "
          f"{'>5ms':>6s} {'>10ms':>6s} {'>25ms':>6s} {'ckpt':>5s} {'ckpt ms':>8s}")
    for before, after in zip(snaps[0::2], snaps[1::2]):
        sc = before["scenario"]
        r = ok.get(sc)
        if r is None:
            continue
        n, total, le = delta(before["h"], after["h"], "stockd_batch_commit_seconds")
        size_n, size_sum, _ = delta(before["h"], after["h"], "stockd_batch_size")
        ck_n, ck_sum, _ = delta(before["h"], after["h"], "stockd_sqlite_checkpoint_seconds")
        over = lambda bound: (n - le.get(bound, n)) / n * 100 if n else 0.0
        print(f"{sc:22s} {r['ok_per_sec']:7.0f} {r['p99_us'] / 1000:7.2f} {n:8.0f} {size_sum / max(size_n, 1):6.1f} "
              f"{total / max(n, 1) * 1000:6.2f} {over('0.005'):5.1f}% {over('0.01'):5.1f}% {over('0.025'):5.1f}% "
              f"{ck_n:5.0f} {ck_sum / max(ck_n, 1) * 1000:8.2f}")


if __name__ == "__main__":
    hooked.main(__file__, __doc__, snap, report)
