#!/usr/bin/env python3
"""Predicted vs measured, per policy, on one model under a memory cap (issue 6, docs/policies.md).

  sudo python3 scripts/policy-table.py MODEL [--limit-gib 8] [-n 64] [-c 512] [--cache-mb 4000]
                                       [--bin-dir target/release] [--out DIR] [--only NAME]

1. Runs bmoe-cli once per policy inside a cgroup v1 memory limit, page cache dropped first, every
   run with the same prompt, budget and `--overlap`, each writing its `--csv`. The baseline (LRU)
   also writes `--io-trace`, and runs once more with `--predict-log --route-trace` for a trace
   carrying the recorded predictions (the probe changes nothing read, but costs time).
2. `bmoe-sim calibrate` fits a device profile on the timed baseline run.
3. `bmoe-sim replay` replays the baseline trace once per policy with that policy's flags and the
   calibrated profile.
4. Prints one markdown row per policy: predicted and measured tok/s, flash MiB/token, hit rate and
   drop rate, and the simulator's error on each.

Lossless policies (eviction, prefetch) route exactly as the baseline did, so the replay of the
baseline trace is the policy's own routing. Lossy ones (dropping, substitution, route-ahead)
change the routing, and with it every later hidden state; replaying the baseline's routing is then
an approximation, and the table says so. stdlib only; needs root (cgroup, drop_caches).
"""
import argparse
import os
import re
import subprocess
import sys

from benchlib import in_cgroup, set_limit

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle, "
          "and what the message asks of her.")

# name, flags, lossless
POLICIES = [
    ("lru (baseline)", [], True),
    ("lfu", ["--eviction", "lfu"], True),
    ("lfru", ["--eviction", "lfru"], True),
    ("layer-lfu", ["--eviction", "layer-lfu"], True),
    ("prefetch 1", ["--prefetch", "1"], True),
    ("predict-prefetch", ["--predict-prefetch"], True),
    ("route-ahead 2", ["--route-ahead", "2"], False),
    ("drop-cold 0.5", ["--drop-cold-experts", "0.5"], False),
    ("substitute 0.1", ["--expert-substitute", "0.1"], False),
]


def summary(csv_path):
    """The `# summary` trailer of a bmoe_metrics CSV as a dict of floats (last one wins)."""
    out = {}
    with open(csv_path) as f:
        for line in f:
            if line.startswith("# summary "):
                for tok in line[len("# summary "):].split():
                    k, _, v = tok.partition("=")
                    try:
                        out[k] = float(v)
                    except ValueError:
                        pass
    return out


def metrics(csv_path):
    s = summary(csv_path)
    toks = s.get("tokens", 0.0) or 1.0
    routed = s.get("experts_routed", 0.0)
    return {
        "tok/s": s.get("tok/s", 0.0),
        "MiB/tok": s.get("read_MiB", 0.0) / toks,
        "hit": s.get("cache_hit_pct", 0.0),
        "drop": 100.0 * s.get("experts_dropped", 0.0) / routed if routed else 0.0,
    }


def err(sim, meas):
    return f"{100.0 * (sim / meas - 1.0):+.1f}%" if meas else "—"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--limit-gib", type=int, default=8)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-c", type=int, default=512)
    ap.add_argument("--cache-mb", type=int, default=4000)
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--out", default="target/policy-table")
    ap.add_argument("--only", default=None, help="only policies whose name contains this (plus the baseline)")
    a = ap.parse_args()
    cli, sim = os.path.join(a.bin_dir, "bmoe-cli"), os.path.join(a.bin_dir, "bmoe-sim")
    os.makedirs(a.out, exist_ok=True)
    set_limit(a.limit_gib)
    policies = [p for p in POLICIES if not a.only or a.only in p[0] or p[0].startswith("lru")]
    common = ["-m", a.model, "-p", PROMPT, "-n", str(a.n), "-c", str(a.c), "--moe-stream",
              "--cache-mb", str(a.cache_mb), "--overlap"]
    path = lambda name, ext: os.path.join(a.out, re.sub(r"[^a-z0-9]+", "-", name).strip("-") + ext)

    base_csv, base_route, base_io = path("lru", ".csv"), path("lru", ".route.csv"), path("lru", ".io.csv")
    measured = {}
    for name, flags, _ in policies:
        csv_path = path(name, ".csv")
        extra = ["--csv", csv_path]
        if name.startswith("lru"):
            # The route trace comes from a run with the probe on, so it carries the stale-gate
            # predictions the predictor replays need (the probe changes nothing that is read or
            # computed, so the routing is the timed run's); the probe costs time, so the timed
            # run — the measured row and the calibration — runs without it.
            probe = [cli] + common + ["--route-trace", base_route, "--csv", path("lru-probe", ".csv"),
                                      "--predict-log"]
            r = in_cgroup(probe)
            if r.returncode != 0:
                r = in_cgroup([cli] + common + ["--route-trace", base_route])
            if r.returncode == 0:
                r = in_cgroup([cli] + common + ["--csv", base_csv, "--io-trace", base_io])
                if r.returncode == 0:
                    measured[name] = metrics(base_csv)
        else:
            r = in_cgroup([cli] + common + flags + extra)
            if r.returncode == 0:
                measured[name] = metrics(csv_path)
        if r.returncode != 0:
            tail = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else str(r.returncode)
            print(f"{name}: engine run failed: {tail}", file=sys.stderr)
        else:
            m = measured.get(name, {})
            print(f"measured {name}: {m}", file=sys.stderr, flush=True)

    profile = os.path.join(a.out, "profile.json")
    r = subprocess.run([sim, "calibrate", "--csv", base_csv, "--trace", base_route, "--io-trace", base_io,
                        "--out", profile], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"calibrate failed: {r.stderr.strip()}")
    print(r.stderr.strip(), file=sys.stderr)

    print(f"\nmodel {a.model}, cgroup {a.limit_gib} GiB, -n {a.n} -c {a.c}, --cache-mb {a.cache_mb} "
          f"--overlap; simulator calibrated on the LRU run, replaying its trace\n")
    print("| policy | tok/s sim / measured (err) | MiB/token sim / measured (err) | hit % sim / measured | "
          "drop % sim / measured | routing |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, flags, lossless in policies:
        m = measured.get(name)
        sim_csv = path(name, ".sim.csv")
        r = subprocess.run([sim, "replay", "--trace", base_route, "--profile", profile, "--moe-stream",
                            "--cache-mb", str(a.cache_mb), "--overlap", "--csv", sim_csv] + flags,
                           capture_output=True, text=True)
        routing = "same as measured" if lossless else "baseline's (approximation)"
        if r.returncode != 0:
            why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else str(r.returncode)
            print(f"| {name} | sim refused: {why} | | | | {routing} |")
            continue
        s = metrics(sim_csv)
        if not m:
            print(f"| {name} | {s['tok/s']:.2f} / — | {s['MiB/tok']:.1f} / — | {s['hit']:.1f} / — | "
                  f"{s['drop']:.1f} / — | {routing} |")
            continue
        print(f"| {name} | {s['tok/s']:.2f} / {m['tok/s']:.2f} ({err(s['tok/s'], m['tok/s'])}) | "
              f"{s['MiB/tok']:.1f} / {m['MiB/tok']:.1f} ({err(s['MiB/tok'], m['MiB/tok'])}) | "
              f"{s['hit']:.1f} / {m['hit']:.1f} | {s['drop']:.1f} / {m['drop']:.1f} | {routing} |")


if __name__ == "__main__":
    sys.exit(main())
