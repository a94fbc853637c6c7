#!/usr/bin/env python3
"""The SQLite writer's WAL frames per commit, by the b-tree each frame's page belongs to, for
docs/PERFORMANCE.md ("What an order writes, frame by frame").

Usage: wal-frames.py STOCKD_BINARY SCENARIO[,SCENARIO...] [SECONDS]
(SECONDS per scenario, default 6, at least 5). Needs `strace` and the `sqlite3` command-line
client (Debian: apt-get install strace sqlite3).

Runs `stockd bench --backend sqlite` and, through its load hooks, attaches `strace` to the
server's writer thread for STRACE_SECS (default 2) seconds of each scenario's load, one second
after it starts, recording only the WAL's frame headers (the first bytes of each 24-byte
header hold the page number) and the commits' syncs. After the load it maps page numbers to
b-trees with `dbstat` and prints, per scenario: commits, frames per commit, and for each b-tree
its frames per commit. A frame is one 4 KiB page written to the WAL: what a commit costs the
writer grows with them, not with the bytes the rows hold. strace slows the writer, so its
batches are larger than without it: compare the b-trees' shares, and counts per commit between
builds measured the same way, not with `cpu-split.py`'s per-order figures."""
import collections, json, os, re, shutil, subprocess, sys, tempfile, time

HEADER = re.compile(r'pwrite64\((\d+), "((?:\\x[0-9a-f]{2})+)"\.*, 24, \d+\) = 24')
SYNC = re.compile(r'f(?:data)?sync\((\d+)\)')


def parent(pid):
    """A process's parent pid (/proc/PID/stat; its name may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    return int(raw[raw.rindex(")") + 2:].split()[1])


def server_of(bench):
    """The `stockd serve` the bench started (its child)."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            ppid = parent(p)
            with open(f"/proc/{p}/cmdline") as f:
                args = f.read().split("\0")
        except (OSError, ValueError):
            continue
        if ppid == bench and "serve" in args:
            return int(p)
    sys.exit("wal-frames: the bench's server was not found")


def attach(work):
    """Before the load: strace the writer thread, detached, for STRACE_SECS after a second."""
    scenario = os.environ.get("STOCKD_BENCH_SCENARIO", "?")
    server = server_of(parent(os.getppid()))  # the hook runs under `sh -c`, the bench's child
    writer = next((t for t in os.listdir(f"/proc/{server}/task")
                   if open(f"/proc/{server}/task/{t}/comm").read().strip() == "stockd-writer"), None)
    if writer is None:
        sys.exit("wal-frames: the server has no SQLite writer thread")
    files = {}
    for fd in os.listdir(f"/proc/{server}/fd"):
        try:
            files[fd] = os.readlink(f"/proc/{server}/fd/{fd}")
        except OSError:
            pass
    with open(f"{work}/{scenario}.fds.json", "w") as f:
        json.dump(files, f)
    secs = os.environ.get("STRACE_SECS", "2")
    out = f"{work}/{scenario}.strace"
    tracer = subprocess.Popen(["sh", "-c", f"sleep 1; exec timeout -s INT {secs} strace -xx -s 4 -p {writer} "
                               f"-e trace=pwrite64,fsync,fdatasync -o {out}"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    with open(f"{work}/{scenario}.tracer", "w") as f:
        f.write(str(tracer.pid))


def running(pid):
    """Whether a process is still running (a zombie nobody reaped yet has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2] != "Z"


def pages(work):
    """After the load: wait for the trace to end (its process gone), then map every page to
    its b-tree."""
    scenario = os.environ.get("STOCKD_BENCH_SCENARIO", "?")
    tracer = open(f"{work}/{scenario}.tracer").read().strip()
    deadline = time.time() + 30
    while running(tracer) and time.time() < deadline:
        time.sleep(0.1)
    files = json.load(open(f"{work}/{scenario}.fds.json"))
    db = next(p for p in files.values() if p.endswith(".db"))
    out = subprocess.run(["sqlite3", f"file:{db}?mode=ro", "SELECT pageno, name FROM dbstat"],
                         capture_output=True, text=True, check=True).stdout
    with open(f"{work}/{scenario}.pages", "w") as f:
        f.write(out)


def report(work, scenario):
    files = json.load(open(f"{work}/{scenario}.fds.json"))
    wal = {fd for fd, p in files.items() if p.endswith(".db-wal")}
    btree = {}
    for line in open(f"{work}/{scenario}.pages"):
        page, _, name = line.strip().partition("|")
        if page.isdigit():
            btree[int(page)] = name
    commits, current = [], []
    for line in open(f"{work}/{scenario}.strace"):
        m = HEADER.match(line)
        if m and m.group(1) in wal:
            header = bytes(int(x, 16) for x in re.findall(r"\\x([0-9a-f]{2})", m.group(2)))
            current.append(int.from_bytes(header[:4], "big"))
            continue
        m = SYNC.match(line)
        if m and m.group(1) in wal and current:
            commits.append(current)
            current = []
    if not commits:
        print(f"{scenario}: no commit traced")
        return
    frames = collections.Counter(btree.get(p, "(freed since)") for c in commits for p in c)
    total = sum(frames.values())
    print(f"{scenario}: {len(commits)} commits traced, {total / len(commits):.1f} frames per commit")
    print(f"  {'b-tree':32s} {'frames/commit':>13s} {'share':>6s}")
    for name, n in frames.most_common():
        print(f"  {name:32s} {n / len(commits):13.1f} {100 * n / total:5.1f}%")


def main():
    if len(sys.argv) > 2 and sys.argv[1] in ("--attach", "--pages"):
        (attach if sys.argv[1] == "--attach" else pages)(sys.argv[2])
        return
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    for tool in ("strace", "sqlite3"):
        if shutil.which(tool) is None:
            sys.exit(f"wal-frames: `{tool}` is not installed (Debian: apt-get install strace sqlite3)")
    binary, scenarios = sys.argv[1], sys.argv[2]
    seconds = max(int(sys.argv[3]) if len(sys.argv) > 3 else 6, 5)
    work = tempfile.mkdtemp(prefix="stockd-wal-frames-")
    me = os.path.abspath(__file__)
    try:
        subprocess.run([binary, "bench", "--backend", "sqlite", "--scenarios", scenarios,
                        "--duration-secs", str(seconds),
                        "--exec-before-load", f"python3 {me} --attach {work}",
                        "--exec-after-load", f"python3 {me} --pages {work}"],
                       check=True)
        for scenario in scenarios.split(","):
            report(work, scenario)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
