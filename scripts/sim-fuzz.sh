#!/usr/bin/env bash
# Randomised simulation testing at scale: scripts/sim-fuzz.sh [SEEDS] [FIRST] [JOBS]
# runs `bmoe-sim fuzz` over SEEDS seeds (default 1,000,000) from FIRST (default 0) in JOBS
# parallel slices (default: the machine's cores). Any failing seed stops its slice and is
# printed; reproduce it with `bmoe-sim fuzz --seed N --verbose`.
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=${1:-1000000}
first=${2:-0}
jobs=${3:-$(nproc)}
cargo build -q --release -p bmoe-sim
per=$(( (seeds + jobs - 1) / jobs ))
pids=()
for j in $(seq 0 $((jobs - 1))); do
  start=$(( first + j * per ))
  n=$(( seeds - j * per < per ? seeds - j * per : per ))
  [ "$n" -gt 0 ] || break
  target/release/bmoe-sim fuzz --seed "$start" --seeds "$n" 2>/dev/null &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
