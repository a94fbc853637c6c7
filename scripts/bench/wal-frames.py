#!/usr/bin/env python3
"""The SQLite writer's WAL frames per commit, by the b-tree each frame's page belongs to, for
docs/PERFORMANCE.md ("What an order writes, frame by frame").

Usage: wal-frames.py STOCKD_BINARY SCENARIO[,SCENARIO...] [SECONDS]
(SECONDS per scenario, default 6, at least 5). Needs the `sqlite3` command-line client.

Runs `stockd bench --backend sqlite` and, from its before-load hook to its after-load hook,
reads the frame headers at the start of the server's WAL file every SAMPLE_SECS (default 0.2),
up to 4,000 frames of the WAL's current generation (their salts are the header's): a frame's
page number is in its 24-byte header, and a commit ends at the frame that carries a database
size. The WAL starts over after each checkpoint (every 10,000 pages), so the reads see a sample
of the load's commits, each counted once. After the load it maps page numbers to b-trees with
`dbstat` and prints, per scenario: the commits read, frames per commit, and for each b-tree its
frames per commit. A frame is one page written to the WAL: what a commit costs the writer grows
with them, not with the bytes the rows hold. Only headers are read (a system call each), so
the sampling takes little of the machine and nothing of the writer's thread.

(Until 2026-12-06 this traced the writer's frame-header writes with strace; since the writer's
VFS gathers a commit's frames into a few large writes, that saw none.)"""
import collections, json, os, shutil, struct, subprocess, sys, tempfile, time

import hooked


# Frame headers read at most a sample: a few dozen commits of each WAL generation.
MOST_FRAMES = 4000


def wal_of(server):
    """The path of the WAL the server has open."""
    for fd in os.listdir(f"/proc/{server}/fd"):
        try:
            path = os.readlink(f"/proc/{server}/fd/{fd}")
        except OSError:
            continue
        if path.endswith(".db-wal"):
            return path
    sys.exit("wal-frames: the server has no SQLite WAL open")


def attach(work):
    """Before the load: start a sampler that reads the WAL until the load ends (`pages`)."""
    scenario = os.environ.get("STOCKD_BENCH_SCENARIO", "?")
    wal = wal_of(hooked.server_pid())
    subprocess.Popen([sys.executable, os.path.abspath(__file__), "--sample", work, scenario, wal],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)


def sample(work, scenario, wal):
    """Reads the WAL's first commits every SAMPLE_SECS until the load ends: a commit is kept
    once, by its generation's salts and its first frame's offset."""
    every = float(os.environ.get("SAMPLE_SECS", "0.2"))
    seen = {}
    deadline = time.time() + 600
    fd = os.open(wal, os.O_RDONLY)
    try:
        while not os.path.exists(f"{work}/{scenario}.done") and time.time() < deadline:
            for key, pages_of_commit in commits_of(fd):
                seen.setdefault(key, pages_of_commit)
            time.sleep(every)
    finally:
        os.close(fd)
    with open(f"{work}/{scenario}.commits.json", "w") as f:
        json.dump(list(seen.values()), f)


def pages(work):
    """After the load: stop the sampler, and map every page to its b-tree."""
    scenario = os.environ.get("STOCKD_BENCH_SCENARIO", "?")
    db = wal_of(hooked.server_pid())[:-len("-wal")]
    open(f"{work}/{scenario}.done", "w").close()
    deadline = time.time() + 30
    while not os.path.exists(f"{work}/{scenario}.commits.json") and time.time() < deadline:
        time.sleep(0.1)
    out = subprocess.run(["sqlite3", f"file:{db}?mode=ro", "SELECT pageno, name FROM dbstat"],
                         capture_output=True, text=True, check=True).stdout
    with open(f"{work}/{scenario}.pages", "w") as f:
        f.write(out)


def commits_of(fd, most=MOST_FRAMES):
    """The first commits in the WAL's current generation, up to `most` frames: ((salts, offset
    of the commit's first frame), the page numbers of its frames). Only frame headers are read,
    so a read costs a system call a frame, not the frames' pages."""
    header = os.pread(fd, 32, 0)
    if len(header) < 32:
        return []
    page_size = struct.unpack(">I", header[8:12])[0]
    page_size = 65536 if page_size == 1 else page_size
    salts = header[16:24]
    commits, current, first, at = [], [], 32, 32
    for _ in range(most):
        frame = os.pread(fd, 24, at)
        if len(frame) < 24 or frame[8:16] != salts:
            break
        page, db_size = struct.unpack(">II", frame[:8])
        current.append(page)
        at += 24 + page_size
        if db_size:
            commits.append(((salts.hex(), first), current))
            current, first = [], at
    return commits


def report(work, scenario):
    btree = {}
    for line in open(f"{work}/{scenario}.pages"):
        page, _, name = line.strip().partition("|")
        if page.isdigit():
            btree[int(page)] = name
    with open(f"{work}/{scenario}.commits.json") as f:
        commits = json.load(f)
    if not commits:
        print(f"{scenario}: no commit in the WAL")
        return
    frames = collections.Counter(btree.get(p, "(freed since)") for c in commits for p in c)
    total = sum(frames.values())
    print(f"{scenario}: {len(commits)} commits read, {total / len(commits):.1f} frames per commit")
    print(f"  {'b-tree':32s} {'frames/commit':>13s} {'share':>6s}")
    for name, n in frames.most_common():
        print(f"  {name:32s} {n / len(commits):13.1f} {100 * n / total:5.1f}%")


def main():
    if len(sys.argv) > 2 and sys.argv[1] in ("--attach", "--pages"):
        (attach if sys.argv[1] == "--attach" else pages)(sys.argv[2])
        return
    if len(sys.argv) > 4 and sys.argv[1] == "--sample":
        sample(*sys.argv[2:5])
        return
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    if shutil.which("sqlite3") is None:
        sys.exit("wal-frames: `sqlite3` is not installed (Debian: apt-get install sqlite3)")
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
