#!/usr/bin/env bash
# The benchmark suite in one command, on the machine it runs on: build the release binaries
# (timed), then scripts/bench-suite.py with every argument given here — in RAM and past RAM
# (cgroup v1 cap, needs root) against llama.cpp, each figure beside its floor and the
# simulator's prediction; writes OUT/suite.md, suite.json, suite.svg and suite.png.
#
#   sudo scripts/bench.sh [--llama-cpp DIR] [--trace ROUTE.csv] [--out DIR] [--full] [--quick]
#
# See scripts/bench-suite.py --help.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
echo "bench.sh: cargo build --release -p bmoe-engine -p bmoe-sim" >&2
cargo build --release -q -p bmoe-engine -p bmoe-sim
build_s=$(( $(date +%s) - start ))
echo "bench.sh: build took ${build_s} s" >&2
exec python3 scripts/bench-suite.py --build-seconds "$build_s" "$@"
