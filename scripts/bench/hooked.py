"""The shared driver of the bench scripts that read something around each load: runs
`BINARY bench ARGS --json F` with `python3 SCRIPT snap before|after STATE` as its load hooks,
then hands the state file and the bench's results to the script's report."""
import json, os, re, subprocess, sys, tempfile, urllib.request


def main(script, doc, snap, report):
    """`script` is the caller's `__file__`; `snap(which, state)` and `report(state, results)`."""
    if len(sys.argv) >= 4 and sys.argv[1] == "snap":
        snap(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) < 3:
        sys.exit(doc)
    binary, args = sys.argv[1], sys.argv[2:]
    state = tempfile.mktemp(suffix=".state")
    out = tempfile.mktemp(suffix=".json")
    me = os.path.abspath(script)
    cmd = [binary, "bench", *args, "--json", out,
           "--exec-before-load", f"python3 {me} snap before {state}",
           "--exec-after-load", f"python3 {me} snap after {state}"]
    subprocess.run(cmd, check=True)
    report(state, json.load(open(out)))


def server_pid():
    """The `stockd serve` the bench started: a child of the bench (the hook's shell's parent)."""
    with open(f"/proc/{os.getppid()}/stat") as f:
        bench = int(f.read().rsplit(")", 1)[1].split()[1])
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{p}/cmdline") as f:
                args = f.read().split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == bench and "serve" in args:
            return int(p)
    sys.exit("no `stockd serve` child of the bench (run with --url? this needs the bench's own server)")


def port_of(pid):
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if f"pid={pid}," in line:
            return line.split()[3].rsplit(":", 1)[1]
    sys.exit(f"process {pid} listens on no TCP port")


def metrics_text(pid):
    """The `/metrics` page of the server `pid`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port_of(pid)}/metrics", timeout=10) as r:
        return r.read().decode()


def histograms(text, names):
    """{metric: {"count": n, "sum": s, "le": {bound: cumulative}}} of the histograms `names`."""
    found = {m: {"count": 0.0, "sum": 0.0, "le": {}} for m in names}
    for line in text.splitlines():
        m = re.match(r'^(\w+)_bucket\{le="([^"]+)"\} (\S+)$', line)
        if m and m.group(1) in found:
            found[m.group(1)]["le"][m.group(2)] = float(m.group(3))
            continue
        m = re.match(r"^(\w+)_(count|sum) (\S+)$", line)
        if m and m.group(1) in found:
            found[m.group(1)][m.group(2)] = float(m.group(3))
    return found
