#!/usr/bin/env bash
# Install what the ARM work needs on a Debian machine, and nothing that is already there:
# the aarch64 Rust targets (glibc for the test binaries, musl for the static phone binary),
# the cross linker (`aarch64-linux-gnu-gcc`, named in .cargo/config.toml; its g++ builds
# ggml's repack.cpp for scripts/arm-mca.py), qemu-user (the
# runner .cargo/config.toml names, so `cargo test --target aarch64-...` runs under emulation)
# and llvm-19 (llvm-mca with the Neoverse-N2/V1 models the kernels are priced on).
# Idempotent and silent when everything is present; apt-get needs root (or sudo).
set -euo pipefail

need_targets=()
installed=$(rustup target list --installed 2>/dev/null || true)
for t in aarch64-unknown-linux-gnu aarch64-unknown-linux-musl; do
  grep -qx "$t" <<<"$installed" || need_targets+=("$t")
done
if ((${#need_targets[@]})); then
  echo "arm.sh: rustup target add ${need_targets[*]}" >&2
  rustup target add "${need_targets[@]}" >&2
fi

# Debian package -> a file it installs (checked instead of asking dpkg, so a tool installed
# some other way counts as present too).
declare -A probe=(
  [gcc-aarch64-linux-gnu]=aarch64-linux-gnu-gcc
  [g++-aarch64-linux-gnu]=aarch64-linux-gnu-g++
  [qemu-user-static]=qemu-aarch64-static
  [llvm-19]=/usr/lib/llvm-19/bin/llvm-mca
)
need_pkgs=()
for p in gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user-static llvm-19; do
  f=${probe[$p]}
  if [[ $f == /* ]]; then [[ -x $f ]] && continue; else command -v "$f" >/dev/null && continue; fi
  need_pkgs+=("$p")
done
if ((${#need_pkgs[@]})); then
  sudo=()
  if ((EUID != 0)); then
    command -v sudo >/dev/null || { echo "arm.sh: need root to apt-get install ${need_pkgs[*]}" >&2; exit 1; }
    sudo=(sudo)
  fi
  echo "arm.sh: apt-get install ${need_pkgs[*]}" >&2
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null \
    || { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq "${need_pkgs[@]}" >/dev/null; }
fi
