#!/usr/bin/env bash
# Builds the JavaScript and Python plugins under plugins/ into plugins/dist/:
#   plugins/js/<name>/plan.js    -> dist/js-<name>.wasm      (flash-sale, marketplace, hostile)
#   plugins/python/<name>/app.py -> dist/python-<name>.wasm  (flash-sale)
#
# Needs node (20 or newer) and npm for JavaScript, python3 with its venv module for Python; it
# fails, naming what is missing, rather than skip anything. The pinned tools are installed
# outside the clone, under ${CARGO_TARGET_DIR:-$HOME/.cache/stockd-target}/components/:
#   node-<hash of js/package-lock.json>/  componentize-js and jco (npm ci, ~390 MB)
#   venv-<hash of python/requirements.txt>/  componentize-py (pip, ~75 MB)
# so a changed lock or requirements file installs afresh beside the old one.
#
# A component is rebuilt only when its inputs change: its sources, its SDK, the WIT contract,
# the pinned tools and this script, hashed into dist/.<file>.inputs beside the built file. A
# run with nothing to rebuild takes about a second; a full build about a minute here (each
# JavaScript component takes 10-40 s, the Python one ~20 s).
#
# Safe to run concurrently (tests in several processes call it): one run at a time holds the
# lock file in the cache folder, and each file is published by copy and rename, so a reader
# sees the old file or the new one, never half of one.
set -euo pipefail
cd "$(dirname "$0")"

JS_COMPONENTS=(flash-sale marketplace hostile)
PYTHON_COMPONENTS=(flash-sale)
# A component may import nothing, and componentize-js imports WASI for each of these unless
# it is disabled.
JS_DISABLED_FEATURES=(stdio random clocks http fetch-event)
# How long to wait for another run holding the lock (a first run installs and builds all).
LOCK_WAIT_SECONDS=1800

fail() {
  echo "build-components.sh: $*" >&2
  exit 1
}

need() {
  command -v "$1" >/dev/null 2>&1 || fail "$1 is missing: $2"
}

need node "install Node.js 20 or newer to build the JavaScript plugins"
need npm "install npm (it comes with Node.js) to build the JavaScript plugins"
need python3 "install Python 3.10 or newer with its venv module to build the Python plugins"
need flock "install util-linux (flock keeps concurrent builds apart)"
need sha256sum "install coreutils (sha256sum keys the caches)"
node_major=$(node -p 'process.versions.node.split(".")[0]')
[ "$node_major" -ge 20 ] || fail "node $(node --version) is too old: componentize-js needs Node.js 20 or newer"

cache="${CARGO_TARGET_DIR:-$HOME/.cache/stockd-target}/components"
mkdir -p "$cache" dist
cache=$(cd "$cache" && pwd) # absolute: the JavaScript build runs in another folder
exec 9>"$cache/lock"
flock -w "$LOCK_WAIT_SECONDS" 9 || fail "waited ${LOCK_WAIT_SECONDS}s for another build holding $cache/lock"
rm -rf "$cache"/build.* # left by a run that was killed; no other run is building now

short_hash() {
  sha256sum "$1" | cut -c1-16
}

# One hash over the named files' paths and contents.
hash_files() {
  sha256sum "$@" | sha256sum | cut -c1-64
}

# The files a component is built from besides the tools: sources and SDK, not tests or caches.
sources_of() {
  find "$@" -type f \( -name '*.js' -o -name '*.py' \) ! -name '*.test.js' ! -name 'test_*.py' \
    ! -path '*/__pycache__/*' ! -path '*/node_modules/*' | LC_ALL=C sort
}

# Installs the JavaScript tools if this lock file's set is not there yet; prints the folder.
node_tools() {
  local dir
  dir="$cache/node-$(short_hash js/package-lock.json)"
  if [ ! -f "$dir/.installed" ]; then
    rm -rf "$dir"
    mkdir -p "$dir"
    cp js/package.json js/package-lock.json "$dir/"
    echo "build-components.sh: installing componentize-js and jco into $dir" >&2
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >&2) || fail "npm ci failed in $dir"
    touch "$dir/.installed"
  fi
  echo "$dir/node_modules/.bin"
}

# Installs componentize-py if this requirements file's venv is not there yet; prints its bin.
python_tools() {
  local dir
  dir="$cache/venv-$(short_hash python/requirements.txt)"
  if [ ! -f "$dir/.installed" ]; then
    rm -rf "$dir"
    echo "build-components.sh: installing componentize-py into $dir" >&2
    python3 -m venv "$dir" >&2 || fail "python3 -m venv failed: install Python's venv module (e.g. the python3-venv package)"
    "$dir/bin/pip" install --disable-pip-version-check --quiet -r python/requirements.txt >&2 ||
      fail "pip could not install python/requirements.txt into $dir"
    touch "$dir/.installed"
  fi
  echo "$dir/bin"
}

# Copy, then rename: a concurrent reader sees the old file or the new one, never half of one.
publish() {
  local tmp
  tmp=$(mktemp "dist/.$2.XXXXXX")
  cat "$1" >"$tmp"
  chmod 644 "$tmp"
  mv -f "$tmp" "dist/$2"
}

# Whether dist/$1 was built from inputs hashing to $2.
up_to_date() {
  [ -f "dist/$1" ] && [ -f "dist/.$1.inputs" ] && [ "$(cat "dist/.$1.inputs")" = "$2" ]
}

# Fails unless the component at $1 imports nothing (stockd refuses any import).
check_imports_nothing() {
  local wit
  wit=$("$jco" wit "$1") || fail "jco cannot read the component built as $2"
  if grep -Eq '^[[:space:]]*import[[:space:]]' <<<"$wit"; then
    fail "$2 imports something, and stockd refuses any import:"$'\n'"$wit"
  fi
}

# Builds dist/$1 by running "${@:3}" with the output path appended, checks that it imports
# nothing, publishes it and stamps it with its inputs' hash $2.
build() {
  local name=$1 inputs=$2
  shift 2
  local work started=$SECONDS
  work=$(mktemp -d "$cache/build.XXXXXX")
  if ! "$@" "$work/$name" >"$work/log" 2>&1; then
    cat "$work/log" >&2
    rm -rf "$work"
    fail "building dist/$name failed (output above)"
  fi
  check_imports_nothing "$work/$name" "dist/$name"
  publish "$work/$name" "$name"
  echo "$inputs" >"$work/inputs"
  publish "$work/inputs" ".$name.inputs"
  echo "build-components.sh: built dist/$name ($(stat -c %s "dist/$name") bytes) in $((SECONDS - started)) s" >&2
  rm -rf "$work"
}

# componentize-js gives the engine the working directory as its file system, so it runs in
# js/ for plan.js to import ../sdk/stockd.js.
componentize_js() {
  (cd js && "$node_bin/componentize-js" "$1/plan.js" --wit ../../wit --world-name planner \
    -d "${JS_DISABLED_FEATURES[@]}" -o "$2")
}

# --stub-wasi: the Python runtime imports WASI; stubbed, the component imports nothing.
componentize_py() {
  "$python_bin/componentize-py" -d ../wit -w planner componentize --stub-wasi \
    -p "python/$1" -p python/sdk app -o "$2"
}

node_bin=$(node_tools)
jco="$node_bin/jco"
python_bin=$(python_tools)
# --tools: install the tools if needed, print where they are (the folder of componentize-js and
# jco, then the folder of componentize-py) and build nothing.
if [ "${1:-}" = "--tools" ]; then
  printf '%s\n%s\n' "$node_bin" "$python_bin"
  exit 0
fi

mapfile -t wit_files < <(find ../wit -type f -name '*.wit' | LC_ALL=C sort)
script_inputs=("${wit_files[@]}" build-components.sh)

js_tools_inputs=(js/package-lock.json "${script_inputs[@]}")
for component in "${JS_COMPONENTS[@]}"; do
  name="js-$component.wasm"
  [ -f "js/$component/plan.js" ] || fail "js/$component/plan.js is missing"
  mapfile -t files < <(sources_of "js/$component" js/sdk)
  inputs=$(hash_files "${files[@]}" "${js_tools_inputs[@]}")
  up_to_date "$name" "$inputs" || build "$name" "$inputs" componentize_js "$component"
done

python_tools_inputs=(python/requirements.txt "${script_inputs[@]}")
for component in "${PYTHON_COMPONENTS[@]}"; do
  name="python-$component.wasm"
  [ -f "python/$component/app.py" ] || fail "python/$component/app.py is missing"
  mapfile -t files < <(sources_of "python/$component" python/sdk)
  inputs=$(hash_files "${files[@]}" "${python_tools_inputs[@]}")
  up_to_date "$name" "$inputs" || build "$name" "$inputs" componentize_py "$component"
done
