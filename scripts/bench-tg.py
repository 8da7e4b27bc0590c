#!/usr/bin/env python3
"""Decode in RAM, bmoe-cli against llama.cpp's best tgN, both timed as the issue asks (issue 33).

  bench-tg.py MODEL... --llama-bench /work/llama-build/bin/llama-bench [-t 2] [-n 64] [--reps 5]
              [--bin target/release/bmoe-cli]

bmoe is timed from outside the process: the wall time of `-n N+1` minus that of `-n 1` (same
one-word prompt, --ignore-eos, resident), so load, prefill and exit cancel and every per-token
cost — sampling, detokenising, the telemetry, the pool hand-off — counts. llama.cpp:
`llama-bench -p 0 -n N -r 1` with its weight repacking on and off (`--repack`); "best" is the
faster in that repetition. The model file is read once first, so both start from a warm page
cache. Runs are interleaved (bmoe, llama.cpp, bmoe, ...) so drift hits both alike.
Prints per model the median tok/s of each and the ratio bmoe / llama.cpp best: the median of the
repetitions' ratios and their spread (min-max). Stdlib only.
"""
import argparse
import os
import statistics
import subprocess
import sys

from benchlib import cpu_name, llama_bench_rates, timed_or_exit

PROMPT = "Hello"


def wall(cmd):
    return timed_or_exit(cmd)[0]


def bmoe_tps(bin_, model, n, t):
    base = [bin_, "-m", model, "-p", PROMPT, "--ignore-eos", "--no-moe-stream", "-t", str(t)]
    long = wall(base + ["-n", str(n + 1)])
    one = wall(base + ["-n", "1"])
    return n / (long - one)


def llama_best(lb, model, n, t, repack):
    p = subprocess.run([lb, "-m", model, "-p", "0", "-n", str(n), "-t", str(t), "-r", "1",
                        "--repack", repack, "-o", "jsonl"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench-tg: llama-bench failed:\n{p.stderr}")
    rates = llama_bench_rates(p.stdout)[f"tg{n}"]
    return max(rates.values()), rates


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(__file__), "..", "target", "release", "bmoe-cli"))
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--repack", default="0,1",
                    help="llama-bench's --repack settings to take the best of; a model near the "
                         "RAM size wants 0 alone: repacking copies the weights to anonymous "
                         "memory and evicts the file's page cache that bmoe's next run reads")
    a = ap.parse_args()
    print(f"# bench-tg: {cpu_name()}, -t {a.t}, tg{a.n}, {a.reps} reps interleaved; bmoe timed from outside")
    print("| model | bmoe tok/s | llama.cpp best tok/s (repack 0 / 1) | bmoe / best (median) | spread |")
    print("| --- | --- | --- | --- | --- |")
    for model in a.models:
        # Warm the page cache for both (a one-token run reads the dense weights).
        subprocess.run(["cat", model], stdout=subprocess.DEVNULL, check=True)
        ours, theirs, ratios, per_repack = [], [], [], {}
        for _ in range(a.reps):
            b = bmoe_tps(a.bin, model, a.n, a.t)
            l, rates = llama_best(a.llama_bench, model, a.n, a.t, a.repack)
            for k, v in rates.items():
                per_repack.setdefault(k, []).append(v)
            ours.append(b)
            theirs.append(l)
            ratios.append(b / l)
        rp = " / ".join(f"{statistics.median(per_repack[k]):.1f}" for k in sorted(per_repack))
        print(f"| {os.path.basename(model)} | {statistics.median(ours):.1f} | "
              f"{statistics.median(theirs):.1f} ({rp}) | {statistics.median(ratios):.2f}x | "
              f"{min(ratios):.2f}-{max(ratios):.2f} |", flush=True)


if __name__ == "__main__":
    main()
