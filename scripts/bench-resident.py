#!/usr/bin/env python3
"""The resident baseline through the core's decode step, against the same build's old private
forward loop: two bmoe-cli binaries on one model, runs interleaved so drift hits both alike.

  bench-resident.py MODEL --old OLD_BIN [--new target/release/bmoe-cli] [-n 48] [--threads 1,2]
                    [--reps 5]

OLD_BIN is a build from before the resident run went through the step (commit 7b02d87, where
`Qwen3Moe::forward_resident` was its loop). Both run resident (no --moe-stream), greedy, same
prompt. Prints per thread count the median decode s/token (mean of the CSV rows' wall_ms) and
prefill seconds (the CSV trailer's prefill_s) of each, and new/old ratios (> 1 = the new one is slower).
The old build decoded N-1 tokens for -n N and the new one N: the per-token means compare.
"""
import argparse
import os
import re
import statistics
import subprocess
import tempfile

PROMPT = ("The expert cache keeps the experts the router asked for, and the streamer reads the "
          "rest from flash while the dense weights stay resident in memory the whole time")


def run(bin_, model, n, t):
    with tempfile.TemporaryDirectory() as d:
        csv = os.path.join(d, "m.csv")
        out = subprocess.run([bin_, "-m", model, "-p", PROMPT, "-n", str(n), "-t", str(t),
                              "--csv", csv], capture_output=True, text=True, check=True)
        lines = open(csv).read().splitlines()
        header = next(l for l in lines if l.startswith("step,")).split(",")
        wall = header.index("wall_ms")
        rows = [l.split(",") for l in lines if l[:1].isdigit()]
        # Mean decode wall per token from the rows (3 decimals of ms, where the report's
        # `generation:` line rounds s/token to the ms).
        spt = sum(float(r[wall]) for r in rows) / len(rows) / 1e3
        summary = [l for l in lines if l.startswith("# summary")][-1]
        prefill = float(re.search(r"prefill_s=([0-9.]+)", summary).group(1))
    assert out.returncode == 0
    return spt, prefill


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default="target/release/bmoe-cli")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    print(f"model {a.model}, -n {a.n}, median of {a.reps} interleaved runs")
    print("threads | old s/tok | new s/tok | new/old | spread of pairs | old prefill s | new prefill s | new/old")
    for t in [int(x) for x in a.threads.split(",")]:
        old, new = [], []
        for i in range(a.reps):
            # Alternate which goes first, so neither always runs on a warmer machine.
            pair = [("old", a.old), ("new", a.new)]
            if i % 2:
                pair.reverse()
            for tag, b in pair:
                (old if tag == "old" else new).append(run(b, a.model, a.n, t))
        mo, mn = statistics.median(x[0] for x in old), statistics.median(x[0] for x in new)
        po, pn = statistics.median(x[1] for x in old), statistics.median(x[1] for x in new)
        ratios = sorted(n_[0] / o[0] for o, n_ in zip(old, new))
        print(f"{t} | {mo:.5f} | {mn:.5f} | {mn / mo:.3f} | {ratios[0]:.3f}-{ratios[-1]:.3f} | "
              f"{po:.3f} | {pn:.3f} | {pn / po:.3f}")


if __name__ == "__main__":
    main()
