#!/usr/bin/env python3
"""Kernel speed of two bmoe-cli builds, side by side in one run: `bmoe-cli bench` of each,
interleaved --reps times (A, B, A, B, ...) so machine load and drift hit both alike.

  bench-kernels.py --bin OLD/bmoe-cli --compare-bin NEW/bmoe-cli [-t 2] [--size-mib 256] [--reps 5]
                  [--stat median|best|both]

Prints, per format, the median (or best: the least disturbed run on a busy machine) GB/s of
each build (memory-bound, matrices of --size-mib) and of the in-L2 column (the kernel's compute
ceiling), with the ratio NEW/OLD and the spread (min-max) of the ratios of the interleaved
pairs, plus the expert-sized matvec / matmul times (best = lowest).
"""
import argparse
import re
import statistics
import subprocess

ROW = re.compile(r"^(\S+)\s+(\S+)\s+\d+x\d+\s+[0-9.]+\s+([0-9.]+)\s+[0-9.]+\s+([0-9.]+)$")
EXPERT = re.compile(r"matvec ([0-9.]+) us, 16-token matmul ([0-9.]+) us per token")
READ = re.compile(r"memory: read ([0-9.]+) GB/s")


def run(bin_, threads, size):
    out = subprocess.run([bin_, "bench", "-t", str(threads), "--size-mib", str(size)],
                         capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line.strip())
        if m:
            rows[f"{m.group(1)} {m.group(2)}"] = (float(m.group(3)), float(m.group(4)))
    e = EXPERT.search(out)
    rows["expert matvec us"] = (float(e.group(1)), float("nan"))
    rows["expert matmul us/token"] = (float(e.group(2)), float("nan"))
    rows["memory read GB/s"] = (float(READ.search(out).group(1)), float("nan"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="the baseline build (A)")
    ap.add_argument("--compare-bin", required=True, help="the build compared with it (B)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stat", choices=["median", "best", "both"], default="median")
    a = ap.parse_args()
    runs = {"A": [], "B": []}
    for _ in range(a.reps):
        runs["A"].append(run(a.bin, a.threads, a.size_mib))
        runs["B"].append(run(a.compare_bin, a.threads, a.size_mib))
    for stat in (["median", "best"] if a.stat == "both" else [a.stat]):
        table(a, runs, stat)


def table(a, runs, stat):
    print(f"A = {a.bin}\nB = {a.compare_bin}\n{a.threads} thread(s), {a.size_mib} MiB, "
          f"{stat} of {a.reps} interleaved runs; ratio B/A (min-max over the pairs)")
    print(f"{'format':<24} {'A GB/s':>8} {'B GB/s':>8} {'B/A':>6} {'spread':>12}"
          f" {'A L2':>8} {'B L2':>8} {'B/A':>6}")
    keys = [k for k in runs["A"][0] if all(k in r for r in runs["A"] + runs["B"])]
    for k in keys:
        col = lambda side, i: [r[k][i] for r in runs[side]]
        lower_is_better = k.endswith("us") or k.endswith("us/token")
        pick = statistics.median if stat == "median" else (min if lower_is_better else max)
        ma, mb = pick(col("A", 0)), pick(col("B", 0))
        pairs = [b / x for x, b in zip(col("A", 0), col("B", 0))]
        la, lb = pick(col("A", 1)), pick(col("B", 1))
        l2 = f" {la:>8.2f} {lb:>8.2f} {lb / la:>6.3f}" if la == la else ""
        print(f"{k:<24} {ma:>8.2f} {mb:>8.2f} {mb / ma:>6.3f} {min(pairs):>5.2f}-{max(pairs):<5.2f}{l2}")

if __name__ == "__main__":
    main()
