#!/usr/bin/env bash
# The main job on an embedded default: build, make a small synthetic model, and stream a
# generation from it with telemetry. Needs nothing outside this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${BMOE_OUT:-out}
mkdir -p "$OUT"
cargo build --release -q -p bmoe-engine -p bmoe-sim
BIN=target/release
if [ ! -f "$OUT/tiny.gguf" ]; then
  "$BIN/bmoe-cli" gen --preset tiny --seed 1 --out "$OUT/tiny.gguf"
fi
"$BIN/bmoe-cli" inspect "$OUT/tiny.gguf" | head -n 40
echo
echo "== streaming a generation (experts from flash, 2 MiB cache, telemetry in $OUT/) =="
"$BIN/bmoe-cli" -m "$OUT/tiny.gguf" -p "The cache of experts" -n 32 "$@"
