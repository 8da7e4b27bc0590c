#!/usr/bin/env bash
# Streaming benchmark under a memory cap (issue 4): the same model on plain mmap and streamed
# in several configurations, each run in a cgroup v1 memory limit with the page cache dropped
# first, side by side in one invocation. Needs root (cgroup, drop_caches).
#
#   scripts/bench-stream.sh MODEL [LIMIT_GIB=8] [N_TOKENS=16]
#
# Prints one line per configuration: tok/s, s/token, MiB/token read, achieved MiB/s, hit %,
# peak RSS (max_usage of the cgroup) — and the raw O_DIRECT read ceiling at the same request
# size for comparison.
set -euo pipefail
MODEL=$1; LIMIT_GIB=${2:-8}; N=${3:-16}
BIN=${BIN:-target/release/bmoe-cli}
CG=/sys/fs/cgroup/memory/bmoe-bench
mkdir -p "$CG"
echo $((LIMIT_GIB << 30)) > "$CG/memory.limit_in_bytes"
PROMPT="The expert cache keeps what the router asked for, and the streamer reads the rest from flash."
run() {
  local name=$1; shift
  sync; echo 3 > /proc/sys/vm/drop_caches
  echo 0 > "$CG/memory.max_usage_in_bytes" 2>/dev/null || true
  local err; err=$(mktemp)
  sh -c 'echo $$ > '"$CG"'/cgroup.procs; exec "$@"' sh "$BIN" -m "$MODEL" -p "$PROMPT" -n "$N" "$@" >/dev/null 2>"$err" || { echo "$name: FAILED"; cat "$err"; return; }
  local peak; peak=$(( $(cat "$CG/memory.max_usage_in_bytes") >> 20 ))
  printf '%-34s %s | %s | %s | peak cgroup %s MiB\n' "$name" \
    "$(grep -o 'generation: .*' "$err")" \
    "$(grep -o 'read [0-9.]* MiB ([0-9.]* MiB/token).*MiB/s)' "$err" | sed 's/decode.*flash I\/O/flash I\/O/')" \
    "$(grep -o '^moe-cache: [0-9.]*% hit, resident [0-9.]* MiB' "$err" || echo 'no cache')" "$peak"
  rm -f "$err"
}
echo "model $MODEL, cgroup limit ${LIMIT_GIB} GiB, $N tokens, caches dropped before each run"
run "mmap baseline"
run "stream cache off, serial, 4 lanes"     --moe-stream --cache-mb 0
run "stream cache off, overlap, 4 lanes"    --moe-stream --cache-mb 0 --overlap
run "stream cache auto, overlap, 4 lanes"   --moe-stream --overlap
run "stream cache 4000, serial, 4 lanes"    --moe-stream --cache-mb 4000 --force-cache
run "stream cache 4000, overlap, 1 lane"    --moe-stream --cache-mb 4000 --overlap --io-threads 1
run "stream cache 4000, overlap, 2 lanes"   --moe-stream --cache-mb 4000 --overlap --io-threads 2
run "stream cache 4000, overlap, 4 lanes"   --moe-stream --cache-mb 4000 --overlap --io-threads 4
sync; echo 3 > /proc/sys/vm/drop_caches
"$BIN" bench --io-file "$MODEL" --io-request-kib 1024 --io-lanes 1,2,4 --io-total-mib 1024
