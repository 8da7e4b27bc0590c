#!/usr/bin/env python3
"""Prefill of bmoe builds (or SIMD levels) side by side, interleaved, judged by CPU time as well
as by rate: on cores shared with other jobs the wall-clock rate mostly measures the neighbours,
while the prefill's CPU seconds (the CSV trailer's prefill_cpu_s, user + system time of all
threads, waiting included) move much less.

  ab-prefill-cpu.py MODEL PROMPT_FILE --run NAME=BIN[:ENV=VALUE,...] --run ... [--reps 5] [-t 2]

The first --run is the baseline; each other run prints the median (min-max) of its per-repetition
rate ratio run/base and CPU-time ratio base/run (both > 1 when the run is faster). Example:

  ab-prefill-cpu.py small-q4_k_m.gguf p128.txt --run base=OLD/bmoe-cli \
      --run avx2=NEW/bmoe-cli:BMOE_SIMD=avx2 --run new=NEW/bmoe-cli --reps 5
"""
import argparse
import os
import statistics
import subprocess
import tempfile


def run(bin_, env, model, prompt, t):
    with tempfile.NamedTemporaryFile(suffix=".csv") as f:
        subprocess.run([bin_, "-m", model, "-p", prompt, "-n", "1", "-t", str(t), "--csv", f.name],
                       capture_output=True, check=True, env={**os.environ, **env})
        tr = [l for l in open(f.name) if l.startswith("# summary")][-1]
    kv = dict(x.split("=", 1) for x in tr.split() if "=" in x)
    return int(kv["n_prompt"]) / float(kv["prefill_s"]), float(kv["prefill_cpu_s"]), int(kv["n_prompt"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("prompt_file")
    ap.add_argument("--run", action="append", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-t", type=int, default=2)
    a = ap.parse_args()
    prompt = open(a.prompt_file).read()
    runs = []
    for r in a.run:
        name, spec = r.split("=", 1)
        bin_, _, envs = spec.partition(":")
        env = dict(e.split("=", 1) for e in envs.split(",") if e)
        runs.append((name, bin_, env))
    rate = {n: [] for n, _, _ in runs}
    cpu = {n: [] for n, _, _ in runs}
    print(f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, {a.reps} repetitions")
    n_prompt = None
    for _ in range(a.reps):
        for name, bin_, env in runs:
            r, c, n_prompt = run(bin_, env, a.model, prompt, a.t)
            rate[name].append(r)
            cpu[name].append(c)
    print(f"load average at end {os.getloadavg()[0]:.1f}; prompt {n_prompt} tokens, {a.t} threads")
    fmt = lambda xs, p: f"{statistics.median(xs):.{p}f} ({min(xs):.{p}f}-{max(xs):.{p}f})"
    for name, _, _ in runs:
        print(f"{name}: prefill {fmt(rate[name], 1)} tok/s, {fmt(cpu[name], 3)} cpu-s")
    base = runs[0][0]
    for name, _, _ in runs[1:]:
        rr = [x / y for x, y in zip(rate[name], rate[base])]
        cr = [y / x for x, y in zip(cpu[name], cpu[base])]
        print(f"{name} vs {base}: rate ratio {fmt(rr, 2)}, cpu-time ratio {fmt(cr, 2)}")


if __name__ == "__main__":
    main()
