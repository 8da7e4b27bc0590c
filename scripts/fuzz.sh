#!/usr/bin/env bash
# Run one fuzz target under libFuzzer (nightly + cargo-fuzz):
#   scripts/fuzz.sh TARGET SECONDS [libFuzzer flags...]   fuzz for SECONDS (0 = until stopped)
#   scripts/fuzz.sh TARGET repro FILE                     run one input (a crash artifact)
# Targets: gguf route_trace io_trace metrics_csv chat_template. The body of each is
# bmoe_engine::fuzzing::Target::run, which `cargo test -p bmoe-engine --test fuzz` also runs on
# stable over the seeds and a few thousand mutations. The corpus starts from seeds made from real
# files (written to fuzz/corpus/TARGET by the fuzz_seeds example) and keeps what libFuzzer finds;
# crashes land in fuzz/artifacts/TARGET. Needs: rustup toolchain nightly, cargo install cargo-fuzz.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  sed -n '2,9p' "$0" >&2
  exit 2
fi
target=$1
shift
case "$target" in
  gguf|route_trace|io_trace|metrics_csv|chat_template) ;;
  *) echo "fuzz.sh: unknown target $target" >&2; exit 2 ;;
esac
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: cargo-fuzz is missing: cargo install cargo-fuzz" >&2
  exit 1
fi
if [ "$1" = repro ]; then
  exec cargo +nightly fuzz run "$target" "$2"
fi
secs=$1
shift
corpus=fuzz/corpus/$target
artifacts=fuzz/artifacts/$target
mkdir -p "$corpus" "$artifacts"
cargo run -q --release -p bmoe-engine --example fuzz_seeds -- "$target" "$corpus"
# -rss_limit_mb: an input must not make the reader allocate beyond reason;
# -timeout: a single input must not run for seconds (fuel bounds the templates).
exec cargo +nightly fuzz run "$target" "$corpus" -- \
  -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
  -artifact_prefix="$artifacts/" "$@"
