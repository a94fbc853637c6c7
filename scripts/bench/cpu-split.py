#!/usr/bin/env python3
"""Where a scenario's CPU goes, per order: the server's threads by role, the load generator, the
database server, Redis, and the machine as a whole, from /proc around each load.

Usage:
  cpu-split.py BINARY BENCH_ARGS...       runs `BINARY bench BENCH_ARGS --json F` with this script
                                          as its load hooks, then prints the table
  cpu-split.py snap before|after STATE    (the hooks; STOCKD_BENCH_SCENARIO names the scenario)

Columns are CPU microseconds (user + system) per successful operation over the load alone:
`http` is the server's Tokio workers (HTTP, JSON, auth, plan calls into the plugin pool when a
plugin runs inline, storage clients, Redis calls), `writer` the SQLite writer thread, `plan` the
plugin threads, `ckpt` SQLite's checkpoint thread, `other` the server's remaining threads; `load`
the bench process (the load generator; in a `core-` scenario, the tasks that hand orders to the
storage core in the bench's own process, whose writer and checkpoint thread count as `writer`
and `ckpt`); `db` every PostgreSQL or MariaDB process, `redis` the
Redis server; `rest` whatever else the machine ran (kernel threads, interrupts, other
processes); `busy` the machine's busy share of all its cores over the load.

On SQLite a second table gives the writer thread's I/O per operation from
`/proc/PID/task/TID/io`: read and write system calls (`rd/op`, `wr/op`) and the bytes they
moved (`rKiB/op`, `wKiB/op`). A WAL frame is two writes (its header and its page), so
`wr/op` / 2 is about the frames an order dirties; the checkpoints the writer itself runs are in
the figures. Unlike CPU time these hardly depend on how busy the machine is."""
import json, os, subprocess, sys

import hooked

HZ = os.sysconf("SC_CLK_TCK")


def stat_fields(path):
    with open(path) as f:
        raw = f.read()
    # comm may hold spaces and parentheses: split after its last ')'.
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state); utime, stime are fields 14, 15.
    return comm, int(rest[1]), int(rest[11]) + int(rest[12])


def processes():
    """(pid, comm, ppid, ticks) of every process readable now."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            comm, ppid, ticks = stat_fields(f"/proc/{p}/stat")
        except (OSError, ValueError):
            continue
        yield int(p), comm, ppid, ticks


def thread_role(comm):
    if comm.startswith("tokio-r"):
        return "http"
    if comm == "stockd-writer":
        return "writer"
    if comm.startswith("stockd-plan"):
        return "plan"
    if comm.startswith("stockd-checkpoi"):
        return "ckpt"
    return "other"


def thread_io(path):
    """A thread's read and write system calls and the bytes they moved ({} if unreadable)."""
    try:
        with open(path) as f:
            fields = dict(line.split(":") for line in f)
    except OSError:
        return {}
    return {k: int(fields[k]) for k in ("syscr", "syscw", "rchar", "wchar") if k in fields}


def snapshot():
    bench = os.getppid()
    # The hook runs under `sh -c`: the bench is the shell's parent.
    try:
        _, bench, _ = stat_fields(f"/proc/{bench}/stat")
    except OSError:
        pass
    parts = {}

    def add(k, ticks):
        parts[k] = parts.get(k, 0) + ticks

    for pid, comm, ppid, ticks in processes():
        if comm.startswith("postgres") or comm in ("mariadbd", "mysqld"):
            add("db", ticks)
        elif comm.startswith("redis-server"):
            add("redis", ticks)
        elif ppid == bench and "serve" in open(f"/proc/{pid}/cmdline").read().split("\0"):
            # The server the bench started: its threads by role.
            for t in os.listdir(f"/proc/{pid}/task"):
                try:
                    thread, _, spent = stat_fields(f"/proc/{pid}/task/{t}/stat")
                except OSError:
                    continue
                add(thread_role(thread), spent)
                if thread == "stockd-writer":
                    for k, v in thread_io(f"/proc/{pid}/task/{t}/io").items():
                        add("io_" + k, v)
    # The bench's own threads (the load generator, or in a `core-` scenario the tasks feeding
    # the storage core); its children are counted above. A `core-` scenario's SQLite writer and
    # checkpoint thread are the bench's: counted under their roles.
    # The process's own figure keeps the time of threads that have ended (Tokio's blocking
    # threads come and go); the sum of the live ones would not.
    try:
        load = stat_fields(f"/proc/{bench}/stat")[2]
        for t in os.listdir(f"/proc/{bench}/task"):
            thread, _, spent = stat_fields(f"/proc/{bench}/task/{t}/stat")
            role = thread_role(thread)
            if role in ("writer", "ckpt"):
                add(role, spent)
                load -= spent
            if thread == "stockd-writer":
                for k, v in thread_io(f"/proc/{bench}/task/{t}/io").items():
                    add("io_" + k, v)
        add("load", load)
    except OSError:
        pass
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal
    parts["machine_busy"] = sum(cpu[:3]) + sum(cpu[5:8])
    parts["machine_all"] = sum(cpu[:8])
    # Exited processes (PostgreSQL backends that ended) are not counted; the bench keeps its
    # connections, so under load there are none.
    return parts


def snap(which, state):
    scenario = os.environ.get("STOCKD_BENCH_SCENARIO", "?")
    with open(state, "a") as f:
        f.write(json.dumps({"which": which, "scenario": scenario, "ticks": snapshot()}) + "\n")


COLS = ["http", "writer", "plan", "ckpt", "other", "load", "db", "redis", "rest"]


def report(state, results):
    snaps = [json.loads(line) for line in open(state)]
    ok = {r["scenario"]: r for r in results}
    print(f"{'scenario':22s} {'ok/s':>7s} {'busy':>5s} " + " ".join(f"{c:>7s}" for c in COLS) + f" {'total':>7s}")
    io = []
    for before, after in zip(snaps[0::2], snaps[1::2]):
        sc = before["scenario"]
        r = ok.get(sc)
        if r is None or not r["ok"]:
            continue
        d = {k: after["ticks"].get(k, 0) - before["ticks"].get(k, 0) for k in set(after["ticks"]) | set(before["ticks"])}
        # The load is what lies between the hooks; ok counts exactly it.
        per = lambda ticks: ticks / HZ * 1e6 / r["ok"]
        known = sum(d.get(c, 0) for c in COLS if c != "rest")
        d["rest"] = max(0, d["machine_busy"] - known)
        busy = d["machine_busy"] / max(d["machine_all"], 1) * 100 * os.cpu_count()
        total = per(d["machine_busy"])
        print(f"{sc:22s} {r['ok_per_sec']:7.0f} {busy:4.0f}% " + " ".join(f"{per(d.get(c, 0)):7.1f}" for c in COLS)
              + f" {total:7.1f}")
        if any(k.startswith("io_") for k in d):
            io.append((sc, {k: d.get(k, 0) / r["ok"] for k in ("io_syscr", "io_syscw", "io_rchar", "io_wchar")}))
    if io:
        print(f"\n{'writer I/O':22s} {'rd/op':>7s} {'rKiB/op':>8s} {'wr/op':>7s} {'wKiB/op':>8s}")
        for sc, v in io:
            print(f"{sc:22s} {v['io_syscr']:7.2f} {v['io_rchar'] / 1024:8.1f} {v['io_syscw']:7.2f} {v['io_wchar'] / 1024:8.1f}")


if __name__ == "__main__":
    hooked.main(__file__, __doc__, snap, report)
