#!/usr/bin/env python3
"""Issue 19's prediction table, end to end: does the simulator's time hold out of sample?

  python3 scripts/sim-predict-table.py [MODEL] [-n 128] [-t 2] [--reps 3] [--bin-dir target/release]
                                       [--out target/sim-predict] [--sweep-budgets 160,480] [--reuse]

1. Runs bmoe-cli (`--moe-stream --overlap`, O_DIRECT lanes, so the page cache plays no part and
   no root is needed) in the calibration configuration (200 MiB, LRU, with `--route-trace` and
   `--io-trace`) and in each predicted configuration (120 MiB LFU, 120 MiB LRU, 320 MiB LRU,
   80 MiB LFRU), `--reps` times each, interleaved rep by rep so every configuration samples the
   same minutes of machine noise. With `--sweep-budgets`, LRU runs at those budgets are added to
   each rep as extra calibration runs.
2. `bmoe-sim calibrate` fits a profile on the calibration run with the median tok/s (one run,
   as the issue's table); `bmoe-sim calibrate --sweep` fits one over all the calibration
   configuration's reps (the same configuration: its leave-one-run-out error is the machine's
   noise as the profile sees it); with `--sweep-budgets`, a third over the median calibration
   run and the median run at each sweep budget (leave-one-run-out error printed). Each
   calibration is also redone with `--single-rate` (the fit before issue 19) for comparison.
3. `bmoe-sim replay` replays the calibration run's route trace once per predicted configuration
   (its budget and policy), with each profile.
4. Prints a markdown table: configuration, flash MiB/token, predicted tok/s, the measured tok/s
   of every rep, their median, the prediction's error against the median, and the spread of the
   reps ((max - min) / median: the machine's run-to-run noise over those minutes), plus the load
   average before and after. `--reuse` skips engine runs whose files are already in `--out`
   (re-analysis of stored runs with another bmoe-sim). stdlib only.
"""
import argparse
import os
import statistics
import sys

from benchlib import bmoe_binaries, decode_tok_s, loadavg, mib_per_token, run_or_exit as run, spread

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle, "
          "and what the message asks of her.")

CALIBRATION = (200, "lru")
PREDICTED = [(120, "lfu"), (120, "lru"), (320, "lru"), (80, "lfru")]


def median_index(values):
    m = statistics.median_low(values)
    return values.index(m)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="/work/models/small-q4_k_m.gguf")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--out", default="target/sim-predict")
    ap.add_argument("--sweep-budgets", default="",
                    help="comma-separated LRU budgets (MiB) run as extra calibration runs for "
                         "`calibrate --sweep`, e.g. 160,480")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse engine runs already in --out (re-run only calibration and replays)")
    a = ap.parse_args()
    cli, sim = bmoe_binaries(a.bin_dir)
    if not os.path.exists(a.model):
        sys.exit(f"model {a.model} not found (bmoe-cli gen makes the small preset)")
    os.makedirs(a.out, exist_ok=True)
    sweep = [int(x) for x in a.sweep_budgets.split(",") if x.strip()]
    common = ["-m", a.model, "-p", PROMPT, "-n", str(a.n), "-t", str(a.t), "--moe-stream",
              "--force-cache", "--overlap"]
    path = lambda tag, rep, ext: os.path.join(a.out, f"{tag}.{rep}{ext}")
    tag = lambda mb, pol: f"{mb}-{pol}"

    load_before = loadavg()
    print(f"load average before: {load_before}", file=sys.stderr)
    cal_tag = tag(*CALIBRATION)
    configs = [CALIBRATION] + [(mb, "lru") for mb in sweep] + PREDICTED
    measured = {tag(*c): [] for c in configs}
    ran = 0
    for rep in range(a.reps):
        for mb, pol in configs:
            t = tag(mb, pol)
            csv = path(t, rep, ".csv")
            cmd = [cli] + common + ["--cache-mb", str(mb), "--eviction", pol, "--csv", csv]
            if t == cal_tag or (pol == "lru" and mb in sweep):
                cmd += ["--route-trace", path(t, rep, ".route.csv"), "--io-trace", path(t, rep, ".io.csv")]
            if not (a.reuse and all(os.path.exists(x) for x in cmd if x.startswith(a.out))):
                run(cmd)
                ran += 1
            measured[t].append(decode_tok_s(csv))
            print(f"rep {rep + 1}: {t} {measured[t][-1]:.2f} tok/s, {mib_per_token(csv):.1f} MiB/token "
                  f"(load {loadavg()})", file=sys.stderr, flush=True)

    def triple(t):
        i = median_index(measured[t])
        return [path(t, i, ".csv"), path(t, i, ".route.csv"), path(t, i, ".io.csv")]

    profiles = []
    cal = triple(cal_tag)

    def calibrate(name, label, triples, extra):
        out = os.path.join(a.out, f"profile-{name}.json")
        cmd = [sim, "calibrate", "--out", out] + extra + (["--sweep"] if len(triples) > 1 else [])
        for c, tr, io in triples:
            cmd += ["--csv", c, "--trace", tr, "--io-trace", io]
        r = run(cmd)
        print(r.stdout.strip(), file=sys.stderr)
        profiles.append((label, out))

    reps = [[path(cal_tag, i, ".csv"), path(cal_tag, i, ".route.csv"), path(cal_tag, i, ".io.csv")]
            for i in range(a.reps)]
    for extra, suffix in (([], ""), (["--single-rate"], ", single-rate")):
        calibrate("one-run" + suffix.replace(", ", "-"), f"one run (200 MiB lru{suffix})", [cal], extra)
        if a.reps > 1:
            calibrate("reps" + suffix.replace(", ", "-"), f"sweep over the {a.reps} 200 MiB lru runs{suffix}",
                      reps, extra)
        if sweep:
            budgets = [cal_tag] + [tag(mb, "lru") for mb in sweep]
            calibrate("budgets" + suffix.replace(", ", "-"),
                      f"sweep ({','.join(str(x) for x in [CALIBRATION[0]] + sweep)} MiB lru{suffix})",
                      [triple(t) for t in budgets], extra)

    load_after = loadavg()
    print(f"\nmodel {a.model}, -n {a.n} -t {a.t} --overlap, {a.reps} reps interleaved; calibrated on "
          f"the median 200 MiB LRU run (measured {' / '.join(f'{x:.1f}' for x in measured[cal_tag])} "
          f"tok/s, spread {100 * spread(measured[cal_tag]):.0f}%), replaying its route trace; "
          + (f"load average {load_before} before, {load_after} after\n" if ran else
             "engine runs reused from an earlier run of this script (--reuse: see its log for their "
             "load)\n"))
    print("| profile | budget, policy | MiB/token | predicted tok/s | measured tok/s | median | error | "
          "spread of reps |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = {}
    for pname, prof in profiles:
        for mb, pol in PREDICTED:
            t = tag(mb, pol)
            sim_csv = os.path.join(a.out, f"{t}.{os.path.basename(prof)[:-5]}.sim.csv")
            run([sim, "replay", "--trace", cal[1], "--profile", prof, "--moe-stream", "--force-cache",
                 "--cache-mb", str(mb), "--eviction", pol, "--overlap", "--csv", sim_csv])
            pred = decode_tok_s(sim_csv)
            med = statistics.median(measured[t])
            meas = " / ".join(f"{x:.1f}" for x in measured[t])
            print(f"| {pname} | {mb}, {pol} | {mib_per_token(sim_csv):.1f} | {pred:.1f} | {meas} | "
                  f"{med:.1f} | {100 * (pred / med - 1):+.1f}% | {100 * spread(measured[t]):.0f}% |")
            worst[pname] = max(worst.get(pname, 0.0), abs(pred / med - 1))
    print()
    for pname, w in worst.items():
        print(f"- {pname}: worst |error| {100 * w:.1f}% (the issue's bar: 10% of the measured median)")


if __name__ == "__main__":
    sys.exit(main())
