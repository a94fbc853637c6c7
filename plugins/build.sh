#!/usr/bin/env bash
# Builds every plugin and test fixture under plugins/ into plugins/dist/:
#   plugins/<name>/          -> dist/<name>.wasm           (examples: default, flash-sale, ...)
#   plugins/hostile/<name>/  -> dist/hostile-<name>.wasm   (fixtures for the host's tests)
#   dist/hostile-garbage.wasm: bytes that are not WebAssembly at all.
# Needs the wasm32-wasip2 Rust target; it is added here when rustup is present and it is
# missing. Builds share a target directory outside the clone so they stay warm:
# ${CARGO_TARGET_DIR:-$HOME/.cache/stockd-target}/plugins. Safe to run concurrently.
set -euo pipefail
cd "$(dirname "$0")"

target=wasm32-wasip2
if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed | grep -qx "$target"; then
  rustup target add "$target"
fi

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/stockd-target}/plugins"
cargo build --release --locked --quiet --target "$target" --workspace

built="$CARGO_TARGET_DIR/$target/release"
mkdir -p dist
# Copy, then rename: a concurrent reader sees the old file or the new one, never half of one.
publish() {
  local tmp
  tmp=$(mktemp "dist/.$2.XXXXXX")
  cat "$1" >"$tmp"
  chmod 644 "$tmp"
  mv -f "$tmp" "dist/$2"
}

for manifest in */Cargo.toml hostile/*/Cargo.toml; do
  dir=$(dirname "$manifest")
  crate=$(sed -n 's/^name = "\(.*\)"$/\1/p' "$manifest" | head -n 1)
  artifact="$built/${crate//-/_}.wasm"
  [ -f "$artifact" ] || continue # the SDK is a library, not a plugin
  publish "$artifact" "${dir//\//-}.wasm"
done

garbage=$(mktemp dist/.garbage.XXXXXX)
printf 'MZ\220\0\3\0\0\0 this is not WebAssembly\n' >"$garbage"
publish "$garbage" hostile-garbage.wasm
rm -f "$garbage"
