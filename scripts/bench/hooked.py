"""The shared driver of the bench scripts that read something around each load: runs
`BINARY bench ARGS --json F` with `python3 SCRIPT snap before|after STATE` as its load hooks,
then hands the state file and the bench's results to the script's report."""
import json, os, subprocess, sys, tempfile


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
