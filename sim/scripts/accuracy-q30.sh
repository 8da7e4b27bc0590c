#!/bin/bash
# The held-out accuracy study of docs/simulator.md (Accuracy, Qwen3-30B-A3B shape): calibrate at
# 1 and 4 lanes, combine, replay seven other configurations and diff. Needs release binaries and
# the 17.4 GB model (bmoe-cli gen --preset qwen3-30b-a3b-shape --type q4_k_m); M= names it.
# Writes its runs into the current directory: run it in a scratch directory.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
E=${E:-$ROOT/target/release/bmoe-cli}; S=${S:-$ROOT/target/release/bmoe-sim}
M=${M:-/work/big/q30.gguf}; P="The old lighthouse keeper climbed the stairs every evening and"
run() { # tag mb ov lanes n
  local ov=""; [ "$3" = ov ] && ov="--overlap"
  timeout 900 $E -m $M -p "$P" -n $5 -t 2 --moe-stream --cache-mb $2 --force-cache $ov --io-threads $4 --route-trace $1.route.csv --io-trace $1.io.csv --csv $1.csv >/dev/null 2>&1
}
uptime
run c1 2000 - 1 40; $S calibrate --csv c1.csv --trace c1.route.csv --io-trace c1.io.csv --out c1.json --name c1 | grep -E "flash: lat|compute:|mgmt|prefill|in-sample tok"
run c4 2000 - 4 40; $S calibrate --csv c4.csv --trace c4.route.csv --io-trace c4.io.csv --out c4.json --name c4 | grep -E "flash: lat|compute:|mgmt|prefill|in-sample tok"
python3 - <<'PY'
import json
a=json.load(open('c1.json')); b=json.load(open('c4.json'))
b['name']='q30-here'; b['flash']['lane_mib_per_s']=a['flash']['device_mib_per_s']
b['flash']['read_latency_us']=a['flash']['read_latency_us']
b['sources']=['lane rate and latency from c1 (1 lane)']+a['sources'][:2]+['device, compute, mgmt from c4 (4 lanes)']+b['sources']
json.dump(b,open('q30-here.json','w'),indent=2)
print('combined: lane',round(b['flash']['lane_mib_per_s']),'device',round(b['flash']['device_mib_per_s']),'lat',round(b['flash']['read_latency_us'],1),'compute',round(b['compute']['dense_mib_per_s']))
PY
for c in "h1 2000 - 4 40" "h2 0 - 4 12" "h3 1000 - 4 40" "h4 6000 - 4 40" "h5 2000 ov 4 40" "h6 1000 ov 4 40" "h7 2000 - 2 40"; do
  set -- $c; run $@
  ov=""; [ "$3" = ov ] && ov="--overlap"
  $S replay --trace $1.route.csv --profile q30-here.json --cache-mb $2 --force-cache $ov --io-threads $4 --csv $1.sim.csv >/dev/null 2>&1
  ex=$($S diff $1.sim.csv $1.csv --exact-only >/dev/null && echo exact-ok || echo EXACT-FAIL)
  line=$($S diff $1.sim.csv $1.csv | awk '/tok\/s/{t=$0} /wall_ms per token/{w=$0} /io_ms per token/{i=$0} /stall_ms per token/{s=$0} END{print t" | "w" | "i" | "s}' | sed -E 's/ +/ /g; s/tol [0-9.]+%//g; s/time //g')
  echo "$1 cache=$2 ${ov:-serial} lanes=$4 $ex :: $line"
done
uptime
