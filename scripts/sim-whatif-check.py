#!/usr/bin/env python3
"""Issue 19's whatif line, end to end: one model's recorded routing priced as another model.

  python3 scripts/sim-whatif-check.py SOURCE TARGET [--calibrate-with MODEL:MIB ...]
          [--source-cache-mb 2000] [--cache-mb 200[,320,...]] [-n 64] [-t 2] [--temp 0.7] [--seed 1]
          [--reps 3] [--bin-dir target/release] [--out target/sim-whatif] [--reuse]

1. Runs bmoe-cli on SOURCE once (`--moe-stream --force-cache --overlap`, O_DIRECT lanes) with
   `--route-trace`, `--csv` and `--io-trace`: the routing to re-price, and a calibration run.
   Each `--calibrate-with MODEL:MIB` adds a run of another model at that budget, so the profile
   is fitted across shapes (`calibrate --sweep` separates a cost per model layer from the rate).
   TARGET never takes part in the calibration.
2. `bmoe-sim calibrate` fits the device profile on those runs; `bmoe-cli inspect TARGET
   --layout-out` gives TARGET's bytes without reading its weights.
3. `bmoe-sim whatif --trace SOURCE's route trace --model TARGET's layout --device the profile`
   predicts TARGET's decode tok/s at `--cache-mb` (each budget, when several are given), and
   writes the mapped routing.
4. Measures TARGET at `--cache-mb`, `--reps` times: with its own routing (the issue's line), and
   following the mapped routing (`--routing-from`, interleaved rep by rep), which separates what
   the price gets wrong from how TARGET's router differs from SOURCE's.
5. Prints a markdown table: per budget, hit rate, MiB/token, predicted and measured tok/s, the
   error against the measured median, the spread of the reps, and the load average before and
   after; then each budget's error split into the routings' difference and the price's.

The issue's run (docs/simulator.md, "What if"): the 30B-A3B shape's routing priced as `small`,
the profile fitted across the 30B shape and a reduced DeepSeek-V2-Lite shape:

  bmoe-cli gen --preset qwen3-30b-a3b-shape --out q30b.gguf        # ~17 GB, ~3 minutes
  bmoe-cli gen --preset small --out small.gguf
  bmoe-cli gen --preset deepseek-v2-lite-qwen2moe-stand-in --d-model 1024 --expert-ffn 512 --shared-ffn 1024 \
      --heads 16 --kv-heads 4 --head-dim 64 --out ds-lite-reduced.gguf
  python3 scripts/sim-whatif-check.py q30b.gguf small.gguf --calibrate-with ds-lite-reduced.gguf:400
  python3 scripts/sim-whatif-check.py ... --cache-mb 120,200,320,480     # by budget

`--temp` samples the decoded tokens (with `--seed`, the same text every run): a random-weight
model's greedy text soon repeats one token, and its routing then repeats too (docs/models.md),
which no real model's does; `--temp 0` measures greedy decoding instead. stdlib only.
"""
import argparse
import os
import statistics
import sys

from benchlib import bmoe_binaries, decode_tok_s, loadavg, mib_per_token, run_or_exit as run, spread, csv_summary

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle, "
          "and what the message asks of her.")


def hit_pct(csv_path):
    return float(csv_summary(csv_path).get("cache_hit_pct", "nan"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="the model whose routing is recorded (e.g. the 30B-A3B shape)")
    ap.add_argument("target", help="the model to predict (e.g. the small preset)")
    ap.add_argument("--calibrate-with", action="append", default=[], metavar="MODEL:MIB",
                    help="another model (and its cache budget) run for the cross-shape calibration")
    ap.add_argument("--source-cache-mb", type=int, default=2000)
    ap.add_argument("--cache-mb", default="200", metavar="MIB[,MIB...]",
                    help="the target's cache budget, or several (comma-separated): one whatif and "
                         "one row pair each, so the routings' difference shows by budget")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--temp", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--out", default="target/sim-whatif")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse engine runs already in --out (re-run only calibration and whatif)")
    a = ap.parse_args()
    try:
        budgets = [int(b) for b in a.cache_mb.split(",")]
    except ValueError:
        sys.exit(f"--cache-mb {a.cache_mb}: expected MiB, or several comma-separated (120,200,320)")
    if not budgets or min(budgets) <= 0:
        sys.exit(f"--cache-mb {a.cache_mb}: every budget must be a positive number of MiB")
    cli, sim = bmoe_binaries(a.bin_dir)
    extra = []
    for spec in a.calibrate_with:
        model, _, mb = spec.rpartition(":")
        if not model or not mb.isdigit():
            sys.exit(f"--calibrate-with {spec}: expected MODEL:MIB, e.g. ds-lite-reduced.gguf:400")
        extra.append((model, int(mb)))
    for m in [a.source, a.target] + [m for m, _ in extra]:
        if not os.path.exists(m):
            sys.exit(f"model {m} not found (bmoe-cli gen makes the presets: docs/models.md)")
    os.makedirs(a.out, exist_ok=True)
    out = lambda name: os.path.join(a.out, name)
    common = ["-p", PROMPT, "-n", str(a.n), "-t", str(a.t), "--moe-stream", "--force-cache", "--overlap",
              "--temp", str(a.temp), "--seed", str(a.seed)]

    def engine(model, mb, tag, *flags):
        files = [out(f"{tag}.csv")]
        cmd = [cli, "-m", model] + common + ["--cache-mb", str(mb), "--csv", files[0]] + list(flags)
        if not (a.reuse and all(os.path.exists(f) for f in files)):
            run(cmd)
        tok_s = decode_tok_s(files[0])
        print(f"{tag}: {tok_s:.2f} tok/s, {hit_pct(files[0]):.1f}% hits, "
              f"{mib_per_token(files[0]):.2f} MiB/token (load {loadavg()})", file=sys.stderr, flush=True)
        return tok_s

    load_before = loadavg()
    print(f"load average before: {load_before}", file=sys.stderr)
    cal_runs = []
    for i, (model, mb) in enumerate([(a.source, a.source_cache_mb)] + extra):
        tag = "source" if i == 0 else f"calib{i}"
        engine(model, mb, tag, "--route-trace", out(f"{tag}.route.csv"), "--io-trace", out(f"{tag}.io.csv"))
        cal_runs.append(tag)

    profile = out("profile.json")
    cmd = [sim, "calibrate", "--out", profile] + (["--sweep"] if len(cal_runs) > 1 else [])
    for tag in cal_runs:
        cmd += ["--csv", out(f"{tag}.csv"), "--trace", out(f"{tag}.route.csv"), "--io-trace", out(f"{tag}.io.csv")]
    print(run(cmd).stdout.strip(), file=sys.stderr)
    layout = out("target.layout.csv")
    run([cli, "inspect", a.target, "--layout-out", layout])
    # One budget keeps the file names of a single-budget run (--reuse finds earlier runs).
    tag_of = lambda mb: "" if len(budgets) == 1 else f"-{mb}"
    results = []
    for mb in budgets:
        t = tag_of(mb)
        mapped, pred_csv = out(f"mapped{t}.route.csv"), out(f"whatif{t}.sim.csv")
        r = run([sim, "whatif", "--trace", out("source.route.csv"), "--model", layout, "--device", profile,
                 "--moe-stream", "--force-cache", "--overlap", "--cache-mb", str(mb),
                 "--csv", pred_csv, "--route-trace", mapped])
        print("\n".join(l for l in r.stdout.splitlines() if l.startswith("whatif:")), file=sys.stderr)
        own, held = [], []
        for rep in range(a.reps):
            own.append(engine(a.target, mb, f"target-own{t}.{rep}"))
            held.append(engine(a.target, mb, f"target-mapped{t}.{rep}", "--routing-from", mapped))
        results.append((mb, t, pred_csv, decode_tok_s(pred_csv), own, held))
    load_after = loadavg()

    print(f"\nsource {a.source} (routing and calibration, {a.source_cache_mb} MiB)"
          + "".join(f", calibration also on {m} ({mb} MiB)" for m, mb in extra)
          + f"; target {a.target} at {a.cache_mb} MiB, LRU, --overlap, -n {a.n} -t {a.t}, "
          f"--temp {a.temp} --seed {a.seed}, {a.reps} reps interleaved; load average {load_before} "
          f"before, {load_after} after\n")
    print("| budget | target | hits | MiB/token | tok/s | vs the whatif prediction |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mb, t, pred_csv, predicted, own, held in results:
        print(f"| {mb} MiB | `whatif` of the source's routing | {hit_pct(pred_csv):.1f} % | "
              f"{mib_per_token(pred_csv):.2f} | **{predicted:.2f}** (predicted) | — |")
        for label, tag, vals in (("measured, its own routing (the issue's line)", f"target-own{t}", own),
                                 ("measured, following the mapped routing", f"target-mapped{t}", held)):
            med = statistics.median(vals)
            first = out(f"{tag}.0.csv")
            print(f"| {mb} MiB | {label} | {hit_pct(first):.1f} % | {mib_per_token(first):.2f} | "
                  f"{' / '.join(f'{x:.2f}' for x in vals)} (median {med:.2f}, spread "
                  f"{100 * spread(vals):.0f} %) | **{100 * (predicted / med - 1):+.1f} %** |")
    print("\nThe issue's error splits into the routings' difference, measured (the target on the mapped "
          "routing against its own), and the price of the routing the prediction is given (whatif "
          "against the target on that routing):\n")
    print("| budget | the issue's line | = routings' difference | × price |")
    print("| --- | --- | --- | --- |")
    for mb, _, _, predicted, own, held in results:
        own_med, held_med = statistics.median(own), statistics.median(held)
        print(f"| {mb} MiB | {100 * (predicted / own_med - 1):+.1f} % | {100 * (held_med / own_med - 1):+.1f} % "
              f"| {100 * (predicted / held_med - 1):+.1f} % |")
    print("\nThe issue's bar: within 15 % of the measured median of the target's own routing.")


if __name__ == "__main__":
    sys.exit(main())
