#!/usr/bin/env bash
# The benchmark suite in one command, on the machine it runs on: build the release binaries
# (timed), then scripts/bench-suite.py with every argument given here — decode and prefill in
# RAM and streaming past RAM (a cgroup v1 cap at half the model) against llama.cpp, each figure
# beside its floor and the simulator's prediction, plus real routing; writes OUT/suite.md,
# suite.json, suite.svg and suite.png (OUT = bench-out unless --out).
#
#   scripts/bench.sh [--llama-cpp DIR] [--trace ROUTE.csv] [--out DIR] [--full] [--quick] ...
#
# The past-RAM cells need root (the cgroup cap, dropping the page cache): run as a user, the
# build stays yours and the suite goes through sudo; BMOE_NO_SUDO=1 runs it without (those
# cells are then skipped with a message). See scripts/bench-suite.py --help.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
echo "bench.sh: cargo build --release -p bmoe-engine -p bmoe-sim" >&2
cargo build --release -q -p bmoe-engine -p bmoe-sim
build_s=$(( $(date +%s) - start ))
echo "bench.sh: build took ${build_s} s" >&2
suite=(python3 scripts/bench-suite.py --build-seconds "$build_s" "$@")
if [ "$(id -u)" -ne 0 ] && [ -z "${BMOE_NO_SUDO:-}" ] && command -v sudo >/dev/null; then
  echo "bench.sh: running the suite through sudo for its past-RAM cells (BMOE_NO_SUDO=1: without)" >&2
  exec sudo "${suite[@]}"
fi
exec "${suite[@]}"
