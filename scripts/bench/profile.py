#!/usr/bin/env python3
"""Where the server's CPU goes, per operation and by part of the server: `perf record` of the
server the bench starts, over each scenario's load, its samples sorted by what their call
stacks pass through.

Usage:
  profile.py BINARY BENCH_ARGS...       runs `BINARY bench BENCH_ARGS --json F` with this script
                                        as its load hooks, then prints the table
  profile.py snap before|after STATE    (the hooks; STOCKD_BENCH_SCENARIO names the scenario)

Needs `perf` (Debian's linux-perf) and a build with debug info (the release profile keeps it).
The samples are the kernel's `cpu-clock` (no hardware counters needed), with DWARF call stacks;
`PERF_FREQ` sets the rate (default 999 a second). Each sample goes to the first part, in the
order of `PARTS`, that a frame of its stack names, so an inner part wins over the request that
runs it (a plugin's plan over the handler that asked for it). The shares are of the server's
samples; `us/op` multiplies them by the bench's own `cpu us/op` for the scenario (from
/proc, over the whole load), so the parts add up to it. A part is a place in the code, not a
cost model: `http` is hyper's and axum's own work on the connection and what the kernel does
for its sockets, `redis-io` the Redis client's connection tasks, `idle` a worker thread parking
and being woken (a context switch, which a machine with more cores than threads needs less
often). Reading the stacks (`perf script`) takes about a minute a scenario."""
import os, re, signal, subprocess, sys, time
from collections import Counter

import hooked

# (part, substrings of a frame, any of which puts a sample there), first match wins.
PARTS = [
    ("plan", ["stockd::plugin::"]),
    ("writer", ["stockd-writer"]),
    ("ckpt", ["stockd-checkpoi"]),
    ("lookup", ["stockd::storage::lookups::"]),
    ("settle", ["stockd::jobs::settlement"]),
    ("batch", ["stockd::storage::batcher::run_batcher"]),
    ("redis-sale", ["stockd::redis_mode::orders::"]),
    ("redis-io", ["redis::aio::", "redis::cluster_async::"]),
    ("auth", ["stockd::api::extract::Tenant"]),
    ("json-in", ["stockd::api::extract::ValidJson"]),
    ("handler", ["stockd::api::", "stockd::pipeline::"]),
    ("http", ["hyper::", "axum::serve"]),
    ("idle", ["park_internal", "park_timeout", "park_condvar"]),
]
PART_NAMES = [p for p, _ in PARTS] + ["other"]


def running(pid):
    """Whether `pid` is alive: perf outlives the hook that started it, so nobody reaps it and
    it ends as a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def perf_data(state, scenario):
    return f"{state}.{scenario}.perf"


def snap(which, state):
    scenario = os.environ.get("STOCKD_BENCH_SCENARIO", "?")
    pidfile = f"{state}.perfpid"
    if which == "before":
        freq = os.environ.get("PERF_FREQ", "999")
        out = perf_data(state, scenario)
        proc = subprocess.Popen(
            ["perf", "record", "-F", freq, "-e", "cpu-clock", "-g", "--call-graph", "dwarf,16384",
             "-p", str(hooked.server_pid()), "-o", out],
            stdout=subprocess.DEVNULL, stderr=open(f"{out}.log", "w"), start_new_session=True)
        with open(pidfile, "w") as f:
            f.write(str(proc.pid))
        # perf attaches to every thread before it counts; the load starts when this returns.
        time.sleep(0.5)
        return
    try:
        pid = int(open(pidfile).read())
    except (OSError, ValueError):
        return
    os.kill(pid, signal.SIGINT)
    deadline = time.time() + 120
    while time.time() < deadline and running(pid):
        time.sleep(0.2)
    with open(state, "a") as f:
        f.write(scenario + "\n")


def parts_of(data):
    """{part: samples} of one perf.data, and the number of samples."""
    out = subprocess.run(["perf", "script", "-i", data, "-F", "comm,ip,sym"],
                         capture_output=True, text=True, check=True).stdout
    counts, total = Counter(), 0
    # A sample is its thread's name on a line of its own, then one indented line per frame.
    for sample in re.split(r"\n(?=\S)", out):
        lines = sample.split("\n")
        if len(lines) < 2:
            continue
        total += 1
        for part, needles in PARTS:
            if any(n in sample for n in needles):
                counts[part] += 1
                break
        else:
            counts["other"] += 1
    return counts, total


def report(state, results):
    try:
        scenarios = [line.strip() for line in open(state) if line.strip()]
    except OSError:
        sys.exit("no load was profiled (is perf installed?)")
    by_name = {r["scenario"]: r for r in results}
    print("share of the server's samples, then us of server CPU an operation (the bench's cpu us/op)")
    print(f"{'scenario':16s} {'ok/s':>7s} {'us/op':>6s} {'samples':>7s} " + " ".join(f"{p:>10s}" for p in PART_NAMES))
    for sc in scenarios:
        r = by_name.get(sc)
        data = perf_data(state, sc)
        if r is None or not r.get("ok") or not os.path.exists(data):
            continue
        counts, total = parts_of(data)
        if total == 0:
            continue
        cpu = r.get("server_cpu_us_per_op") or 0.0
        share = {p: counts.get(p, 0) / total for p in PART_NAMES}
        print(f"{sc:16s} {r['ok_per_sec']:7.0f} {cpu:6.1f} {total:7d} "
              + " ".join(f"{share[p] * 100:9.1f}%" for p in PART_NAMES))
        print(f"{'':16s} {'':7s} {'':6s} {'':7s} " + " ".join(f"{share[p] * cpu:10.1f}" for p in PART_NAMES))
        for leftover in (data, f"{data}.log"):
            try:
                os.remove(leftover)
            except OSError:
                pass


if __name__ == "__main__":
    hooked.main(__file__, __doc__, snap, report)
