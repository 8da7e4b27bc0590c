#!/usr/bin/env python3
"""Decode past RAM, side by side in one run: bmoe-cli with no streaming flag (it streams by itself
when the model does not fit the cgroup), bmoe-cli --no-moe-stream (plain mmap) and llama.cpp's
llama-bench (plain mmap), each inside the same cgroup v1 memory limit, page cache dropped before
every run, interleaved over --reps repetitions. Needs root.

  bench-capped.py MODEL --limit-gib 5 --llama-bench /work/llama-build/bin/llama-bench
                  [--bin target/release/bmoe-cli] [-n 32] [-t 2] [--reps 2] [--temp 0.7]
                  [--routing-from TRACE]

Prints tok/s per engine (median and range) and each ratio against llama.cpp's.

`--temp T` (with `--seed 1`) samples bmoe's tokens: a random-weight model's greedy text soon
repeats one token, and its routing repeats with it, which flatters every cache (docs/models.md);
llama-bench's tg decodes random token ids, which its routing treats as varied text.

`--routing-from TRACE` makes both bmoe runs route as a recorded capture does (docs/models.md,
"Real routing"): the streamed figure on a real model's routing, while llama.cpp routes by the
file's own random router (it has no such hook).
"""
import argparse
import statistics

from benchlib import generation_tps, in_cgroup, llama_bench_rates, set_limit_bytes

PROMPT = "the"


def bmoe(bin_, model, n, t, flags):
    r = in_cgroup([bin_, "-m", model, "-p", PROMPT, "-n", str(n), "-t", str(t), "--ignore-eos"] + flags)
    if r.returncode != 0:
        # Under a cap the kernel may kill a run outright (exit 137, nothing on stderr).
        print(f"bmoe-cli {' '.join(flags)} failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
        return float("nan"), ""
    mode = next((l for l in r.stderr.splitlines() if l.startswith("mode:")), "")
    return generation_tps(r.stderr), mode


def llama(lb, model, n, t):
    # Plain mmap: with its CPU repack on (its default) llama-bench copies the weights into
    # anonymous memory, which a cap below the model's size kills (measured: OOM at 5 GiB).
    r = in_cgroup([lb, "-m", model, "-t", str(t), "-p", "0", "-n", str(n), "-r", "1",
                   "--repack", "0", "-lm", "mmap", "-o", "jsonl"])
    if r.returncode != 0:
        print(f"llama-bench failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
        return float("nan")
    return llama_bench_rates(r.stdout)[f"tg{n}"][0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--limit-gib", type=float, required=True,
                    help="the cgroup's memory limit in GiB (fractions allowed: half a 9.4 GiB file is 4.7)")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--bin", default="target/release/bmoe-cli")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--temp", type=float, default=0.0,
                    help="sample bmoe's tokens at this temperature (seed 1); 0 = greedy")
    ap.add_argument("--routing-from", metavar="TRACE",
                    help="bmoe routes as this route trace does (both bmoe runs)")
    a = ap.parse_args()
    sample = ["--temp", str(a.temp), "--seed", "1"] if a.temp > 0 else []
    if a.routing_from:
        sample += ["--routing-from", a.routing_from]
    set_limit_bytes(int(a.limit_gib * (1 << 30)))
    res = {"bmoe (no flags)": [], "bmoe --no-moe-stream": [], "llama.cpp mmap": []}
    modes = {}
    print(f"{a.model}: cgroup limit {a.limit_gib} GiB, tg{a.n}, {a.t} threads, {a.reps} reps, "
          f"page cache dropped before each run, bmoe {'--temp ' + str(a.temp) + ' --seed 1' if a.temp > 0 else 'greedy'}"
          + (f", bmoe routed by {a.routing_from}" if a.routing_from else ""),
          flush=True)
    for rep in range(a.reps):
        tps, modes["bmoe (no flags)"] = bmoe(a.bin, a.model, a.n, a.t, sample)
        res["bmoe (no flags)"].append(tps)
        tps, modes["bmoe --no-moe-stream"] = bmoe(a.bin, a.model, a.n, a.t, sample + ["--no-moe-stream"])
        res["bmoe --no-moe-stream"].append(tps)
        res["llama.cpp mmap"].append(llama(a.llama_bench, a.model, a.n, a.t))
        print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in res.items()), flush=True)
    ok = lambda v: [x for x in v if x == x]
    base = statistics.median(ok(res["llama.cpp mmap"]) or [float("nan")])
    print("\n| engine | tok/s median (range) | × llama.cpp mmap | failed runs |\n| --- | --- | --- | --- |")
    for k, v in res.items():
        good = ok(v)
        med = statistics.median(good) if good else float("nan")
        rng = f"{min(good):.2f}-{max(good):.2f}" if good else "-"
        print(f"| {k} | {med:.2f} ({rng}) | {med / base:.2f} | {len(v) - len(good)} |")
    for k, m in modes.items():
        print(f"{k}: {m}")


if __name__ == "__main__":
    main()
