#!/usr/bin/env python3
"""Where the SQLite writer thread's wall time goes, per scenario: in a batch or idle between
batches, and within batches on a core, waiting for one, or blocked (the commit's fsync, reads).

Usage:
  writer-time.py BINARY BENCH_ARGS...     runs `BINARY bench BENCH_ARGS --json F` with this script
                                          as its load hooks (SQLite only), then prints the table
  writer-time.py snap before|after STATE  (the hooks; STOCKD_BENCH_SCENARIO names the scenario)

Read around each load: the writer's `/proc/PID/task/TID/schedstat` (nanoseconds on a core,
nanoseconds runnable but waiting for one) and the server's `stockd_batch_commit_seconds` (a
batch from its first statement to the end of its COMMIT, fsync included) and
`stockd_batch_size` from `/metrics`. `blocked` is a batch's time neither on a core nor waiting
for one; the writer's time outside batches (taking the next jobs) is small enough to count as
idle."""
import json, os, sys, time

import hooked


def snapshot():
    pid = hooked.server_pid()
    state = {"t": time.monotonic()}
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/comm") as f:
            if f.read().strip() == "stockd-writer":
                with open(f"/proc/{pid}/task/{t}/schedstat") as s:
                    on_cpu, waiting, _ = s.read().split()
                state["on_cpu"], state["waiting"] = int(on_cpu) / 1e9, int(waiting) / 1e9
    if "on_cpu" not in state:
        sys.exit("writer-time: the server has no stockd-writer thread (SQLite only)")
    found = hooked.histograms(hooked.metrics_text(pid), ("stockd_batch_commit_seconds", "stockd_batch_size"))
    state["in_batch"] = found["stockd_batch_commit_seconds"]["sum"]
    state["orders"], state["batches"] = found["stockd_batch_size"]["sum"], found["stockd_batch_size"]["count"]
    return state


def snap(which, state):
    scenario = os.environ.get("STOCKD_BENCH_SCENARIO", "?")
    with open(state, "a") as f:
        f.write(json.dumps({"which": which, "scenario": scenario, "state": snapshot()}) + "\n")


def report(state, results):
    rows = [json.loads(line) for line in open(state)]
    before = {r["scenario"]: r["state"] for r in rows if r["which"] == "before"}
    print(f"{'scenario':<20}{'orders/batch':>13}{'in batch':>10}{'on core':>9}{'wait core':>11}{'blocked':>9}{'idle':>7}")
    for r in rows:
        if r["which"] != "after" or r["scenario"] not in before:
            continue
        a, b = r["state"], before[r["scenario"]]
        wall = a["t"] - b["t"]
        batches, orders, in_batch = (a[k] - b[k] for k in ("batches", "orders", "in_batch"))
        on_cpu, waiting = a["on_cpu"] - b["on_cpu"], a["waiting"] - b["waiting"]
        blocked = max(in_batch - on_cpu - waiting, 0.0)
        share = lambda x: f"{100 * x / wall:.0f} %"
        print(f"{r['scenario']:<20}{orders / max(batches, 1):>13.1f}{share(in_batch):>10}{share(on_cpu):>9}"
              f"{share(waiting):>11}{share(blocked):>9}{share(max(wall - in_batch, 0.0)):>7}")


if __name__ == "__main__":
    hooked.main(__file__, __doc__, snap, report)
