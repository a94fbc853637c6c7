#!/usr/bin/env bash
# What the commit's fsync costs a scenario, as a measurement and never as a setting: runs
# `cpu-split.py BINARY BENCH_ARGS` twice, with the disk's fsync and without it (an LD_PRELOAD
# library whose fsync and fdatasync return at once, inherited by the server the bench starts),
# alternating with / without / without / with. Every commit still writes its frames and answers
# after COMMIT; only the wait for the disk is gone. Needs a C compiler (`cc`).
#
#   bash scripts/bench/fsync-bound.sh target/release/stockd --backend sqlite \
#     --scenarios ceiling,hot-key,uniform,multi-line --duration-secs 6
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,9p' "$0"; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
printf 'int fsync(int fd) { (void)fd; return 0; }\nint fdatasync(int fd) { (void)fd; return 0; }\n' > "$dir/nofsync.c"
cc -shared -fPIC -O2 -o "$dir/nofsync.so" "$dir/nofsync.c"
for run in with without without with; do
  echo "== $run fsync"
  if [ "$run" = without ]; then
    LD_PRELOAD="$dir/nofsync.so" python3 "$here/cpu-split.py" "$@"
  else
    python3 "$here/cpu-split.py" "$@"
  fi
done
