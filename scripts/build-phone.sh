#!/usr/bin/env bash
# Build the phone binary: bmoe-cli for aarch64-unknown-linux-musl, statically linked, so the
# one file runs from `adb shell` in /data/local/tmp, in Termux and on any aarch64 Linux (no
# Android NDK, no bionic: musl is linked in). Installs its toolchain first (scripts/arm.sh),
# strips the debug info (the release profile keeps it for profiling on the host), checks the
# result is static and runs it under qemu-aarch64-static as a smoke test.
#
#   scripts/build-phone.sh            # build, strip, check, `--version` under qemu
#   scripts/build-phone.sh --smoke    # also `gen --preset tiny` and a streamed generation with
#                                     # telemetry under qemu (a minute or two of emulation)
#
# Out: target/phone/bmoe-cli (stripped). The unstripped binary stays at
# target/aarch64-unknown-linux-musl/release/bmoe-cli.
set -euo pipefail
cd "$(dirname "$0")/.."
smoke=0
for a in "$@"; do
  case $a in
    --smoke) smoke=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "build-phone.sh: unknown argument $a (try --help)" >&2; exit 2 ;;
  esac
done

scripts/arm.sh
target=aarch64-unknown-linux-musl
# No debug info (the release profile's line tables): the binary is stripped below anyway, and
# the build is shorter; scripts/test.sh builds the aarch64 unit tests alike, sharing its crates.
CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --target "$target" -p bmoe-engine --bin bmoe-cli
built=target/$target/release/bmoe-cli
out=target/phone/bmoe-cli
mkdir -p target/phone
# The debug info is most of the file and a phone needs none of it; symbols stay, so a crash
# still names functions.
aarch64-linux-gnu-strip --strip-debug -o "$out" "$built"
size() { stat -c %s "$1"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

kind=$(file -b "$out")
case $kind in
  *"statically linked"*|*"static-pie linked"*) ;;
  *) echo "build-phone.sh: $out is not static: $kind" >&2; exit 1 ;;
esac
case $kind in
  *aarch64*) ;;
  *) echo "build-phone.sh: $out is not an aarch64 binary: $kind" >&2; exit 1 ;;
esac

version=$(qemu-aarch64-static "$out" --version)
echo "build-phone.sh: $out: $(mib "$(size "$out")") (unstripped $(mib "$(size "$built")") at $built)"
echo "build-phone.sh: $kind"
echo "build-phone.sh: under qemu-aarch64-static: $version"

if ((smoke)); then
  dir=target/phone/smoke
  rm -rf "$dir" && mkdir -p "$dir"
  run() { echo "+ qemu-aarch64-static $out $*" >&2; qemu-aarch64-static "$out" "$@"; }
  run gen --preset tiny --seed 1 --out "$dir/tiny.gguf"
  run -m "$dir/tiny.gguf" -p "Once upon a time" -n 16 --moe-stream --cache-mb 2 --force-cache \
      --overlap --csv "$dir/run.csv" --route-trace "$dir/r.csv" --io-trace "$dir/io.csv"
  for f in run.csv r.csv io.csv; do
    [[ -s $dir/$f ]] || { echo "build-phone.sh: smoke run wrote no $dir/$f" >&2; exit 1; }
  done
  echo "build-phone.sh: smoke run under qemu: OK ($dir: $(wc -l <"$dir/run.csv") CSV lines," \
       "$(wc -l <"$dir/io.csv") io-trace lines)"
fi
echo "build-phone.sh: on the phone: adb push $out /data/local/tmp/ && adb shell chmod +x /data/local/tmp/bmoe-cli (README.md, \"On a phone\")"
