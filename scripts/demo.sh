#!/usr/bin/env bash
# The main job on an embedded default: build, make a small synthetic model, and stream a
# generation from it with telemetry. Needs nothing outside this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${BMOE_OUT:-out}
mkdir -p "$OUT"
cargo build --release -q -p bmoe-engine
BIN=target/release
if [ ! -f "$OUT/tiny.gguf" ]; then
  "$BIN/bmoe-cli" gen --preset tiny --seed 1 --out "$OUT/tiny.gguf"
fi
"$BIN/bmoe-cli" inspect "$OUT/tiny.gguf" | sed -n '1,/^tensors:/p' 
echo
echo "== streaming a generation (experts from flash, 8 MiB cache of ~19 MiB of experts, telemetry in $OUT/) =="
"$BIN/bmoe-cli" -m "$OUT/tiny.gguf" -p "The cache of experts" -n 32 \
  --moe-stream --cache-mb 8 --force-cache --overlap --progress \
  --csv "$OUT/demo.csv" --route-trace "$OUT/demo.route.csv" --io-trace "$OUT/demo.io.csv" "$@"
echo
echo "telemetry written: $OUT/demo.csv (per-token metrics), $OUT/demo.route.csv (routing), $OUT/demo.io.csv (reads)"
