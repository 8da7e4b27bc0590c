#!/usr/bin/env python3
"""What decides whether speculative decoding pays (issue 33), measured side by side in one run.

Random-weight models do not copy their prompt, so real acceptance cannot be measured on them.
This measures the two things that decide the speed-up instead:

(a) the cost of one verify decode over k drafted tokens (k+1 positions) against one plain decode
    step, from the per-token CSV (a group's first row carries its decode's whole cost), and the
    expert bytes the group's union routes (token_demand_MiB: per decode);
(b) the ceiling: the hidden --draft-replay hook drafts the tokens a recorded greedy run of the
    same prompt generated, so every draft is accepted; tokens/s timed from outside the process
    (wall of -n N+1 minus -n 1), against plain decoding timed the same way.

Then, from (a), the speed-up each acceptance rate would give (a draft of k tokens each accepted
with probability a, independently: expected tokens per decode (1 - a^(k+1)) / (1 - a)).

With --mtp (a file with an MTP head): (a) the same verify costs with the head drafting, and what
drafting costs per decode (mtp_draft_ms: k head decodes and the head's catch-up on the last
step's rows); a random head's drafts are rejected, so every decode is a verify of k + 1 rows
confirming one token; then the speed-up each acceptance rate would give, drafting included.
No ceiling (the head drafts what it drafts).

Usage: scripts/bench-spec.py MODEL [--reps 3] [-n 64] [--threads 2] [--stream-cache-mb 256] [--mtp]
Stdlib only; needs target/release/bmoe-cli (cargo build --release).
"""
import argparse
import csv
import os
import statistics
import sys
import tempfile

from benchlib import cpu_name, csv_summary, timed_or_exit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(ROOT, "target", "release", "bmoe-cli")
PROMPT = "The cache of experts keeps what the router asked for, and the rest waits on flash"


def run(args, csv_path=None):
    wall, p = timed_or_exit([CLI] + args + (["--csv", csv_path] if csv_path else []))
    return wall, p.stdout, p.stderr


def rows(path):
    with open(path) as f:
        lines = [l for l in f if not l.startswith("#")]
    return list(csv.DictReader(lines))


def trailer(path, key):
    return float(csv_summary(path)[key])


def group_costs(path):
    """wall_ms of each decode (a group's first row) and its width."""
    out = []
    r = rows(path)
    i = 0
    while i < len(r):
        m = int(r[i]["mtp_batch"])
        out.append((m, float(r[i]["wall_ms"]), int(r[i]["read_bytes"])))
        i += m
    return out


def mtp_mode(a, ks, base, modes, tmp):
    """--mtp: verify and drafting costs per decode, plain and speculated runs interleaved."""
    for mode, flags in modes.items():
        plain_step, verify, draft = [], {k: [] for k in ks}, {k: [] for k in ks}
        for rep in range(a.reps):
            for what in ["plain"] + ks:
                extra = [] if what == "plain" else ["--mtp", "--draft", str(what)]
                c = os.path.join(tmp, f"mtp-{what}.csv")
                run(base + flags + extra + ["-n", str(a.n + 1)], c)
                r = rows(c)
                # Each decode's first row (decodes after the first, which follows the prefill).
                firsts, i = [], 0
                while i < len(r):
                    firsts.append(r[i])
                    i += int(r[i]["mtp_batch"])
                if what == "plain":
                    plain_step += [float(x["wall_ms"]) for x in firsts[1:]]
                else:
                    verify[what] += [float(x["wall_ms"]) for x in firsts[1:]]
                    draft[what] += [float(x["mtp_draft_ms"]) for x in firsts[1:]]
        p = statistics.median(plain_step)
        print(f"\n## {mode}, --mtp")
        print(f"plain decode step: median {p:.2f} ms over {len(plain_step)} steps")
        print("| k drafted | verify decode (ms) | × plain | drafting per decode (ms) | × plain | per drafted token (ms) | verify + drafting × plain |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        cost = {}
        for k in ks:
            v, d = statistics.median(verify[k]), statistics.median(draft[k])
            cost[k] = (v + d) / p
            print(f"| {k} | {v:.2f} | {v / p:.2f} | {d:.2f} | {d / p:.2f} | {d / k:.2f} | {cost[k]:.2f} |")
        print("\nspeed-up an acceptance rate a would give, drafting included:")
        print("| a | " + " | ".join(f"k={k}" for k in ks) + " |")
        print("| --- |" + " --- |" * len(ks))
        for acc in [0.5, 0.6, 0.7, 0.8, 0.9]:
            cells = [f"{(1 - acc ** (k + 1)) / (1 - acc) / cost[k]:.2f}x" for k in ks]
            print(f"| {acc:.1f} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stream-cache-mb", type=int, default=256,
                    help="the streamed runs' expert cache (MiB): the model streams past it")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--mtp", action="store_true", help="draft with the file's MTP head")
    a = ap.parse_args()
    if not os.path.exists(CLI):
        sys.exit("bench-spec: build first: cargo build --release -p bmoe-engine")
    ks = [int(k) for k in a.ks.split(",")]
    tmp = tempfile.mkdtemp(prefix="bench-spec-")
    base = ["-m", a.model, "-p", PROMPT, "--ignore-eos", "-t", str(a.threads), "--temp", "0"]
    modes = {
        "in RAM": ["--no-moe-stream"],
        f"streamed, {a.stream_cache_mb} MiB cache": ["--moe-stream", "--cache-mb", str(a.stream_cache_mb), "--force-cache", "--overlap"],
    }
    if a.mtp:
        print(f"# bench-spec --mtp: {os.path.basename(a.model)}, {cpu_name()}, -t {a.threads}, -n {a.n + 1}, {a.reps} reps interleaved")
        mtp_mode(a, ks, base, modes, tmp)
        return
    # The recorded greedy run the replay drafts from (its tokens are the same in every mode).
    rec = os.path.join(tmp, "rec")
    run(base + ["-n", str(a.n + 1), "--no-moe-stream", "--logits-out", rec])
    rec_json = rec + ".json"
    print(f"# bench-spec: {os.path.basename(a.model)}, {cpu_name()}, -t {a.threads}, -n {a.n + 1}, {a.reps} reps interleaved")
    for mode, flags in modes.items():
        plain_step, verify, demand, reads = [], {k: [] for k in ks}, {}, {}
        outside = {"plain": [], **{k: [] for k in ks}}
        for rep in range(a.reps):
            for what in ["plain"] + ks:
                extra = [] if what == "plain" else ["--draft-replay", rec_json, "--draft", str(what)]
                c = os.path.join(tmp, f"{what}.csv")
                w_long, _, _ = run(base + flags + extra + ["-n", str(a.n + 1)], c)
                w_one, _, _ = run(base + flags + extra + ["-n", "1"])
                outside[what].append((a.n) / (w_long - w_one))
                g = group_costs(c)
                if what == "plain":
                    plain_step += [w for (_, w, _) in g[1:]]
                    demand["plain"] = trailer(c, "token_demand_MiB")
                    reads.setdefault("plain", []).extend(b for (_, _, b) in g[1:])
                else:
                    verify[what] += [w for (m, w, _) in g[1:] if m == what + 1]
                    demand[what] = trailer(c, "token_demand_MiB")
                    reads.setdefault(what, []).extend(b for (m, _, b) in g[1:] if m == what + 1)
        p = statistics.median(plain_step)
        print(f"\n## {mode}")
        print(f"plain decode step: median {p:.2f} ms over {len(plain_step)} steps "
              f"(p10 {statistics.quantiles(plain_step, n=10)[0]:.2f}, p90 {statistics.quantiles(plain_step, n=10)[-1]:.2f}); "
              f"routed {demand['plain']:.1f} MiB/decode")
        print("| k drafted | verify decode (ms, median) | × plain step | routed MiB/decode (union) | × plain | read MiB/decode |")
        print("| --- | --- | --- | --- | --- | --- |")
        for k in ks:
            v = statistics.median(verify[k])
            rb = statistics.mean(reads[k]) / 2**20 if reads[k] else 0.0
            print(f"| {k} | {v:.2f} | {v / p:.2f} | {demand[k]:.1f} | {demand[k] / demand['plain']:.2f} | {rb:.1f} |")
        op = statistics.median(outside["plain"])
        print(f"\nceiling (every draft accepted), tok/s timed from outside: plain {op:.1f}")
        for k in ks:
            o = statistics.median(outside[k])
            print(f"  replay --draft {k}: {o:.1f} tok/s = {o / op:.2f}x plain "
                  f"(spread {min(outside[k]) / op:.2f}-{max(outside[k]) / op:.2f})")
        print("\nspeed-up an acceptance rate a would give (expected tokens per decode / verify cost):")
        print("| a | " + " | ".join(f"k={k}" for k in ks) + " |")
        print("| --- |" + " --- |" * len(ks))
        for acc in [0.3, 0.5, 0.6, 0.7, 0.8, 0.9]:
            cells = []
            for k in ks:
                tokens = (1 - acc ** (k + 1)) / (1 - acc)
                cells.append(f"{tokens / (statistics.median(verify[k]) / p):.2f}x")
            print(f"| {acc:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
