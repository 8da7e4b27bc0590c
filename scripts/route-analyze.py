#!/usr/bin/env python3
"""Routing statistics of a route_trace v1 file (stdlib only).

  route-analyze.py TRACE [--phase decode|prefill|all] [--capacities 2,4,6] [--json]

Reports, per MoE layer and overall:
  - previous-token reuse: the fraction of a token's routed experts that the previous token
    (same turn, same phase, same layer) also routed — what `--prefetch` bets on;
  - per-layer LRU hit rate with C experts cached per layer, for each C in --capacities;
  - the uniform-random baseline k/n for comparison.
Prefill rows of the last MoE layer (one token) are skipped, as are steps with a gap.
"""
import argparse
import collections
import json
import sys


def load(path, phase):
    cells = collections.defaultdict(dict)  # (turn, phase, layer) -> step -> {slot: expert}
    meta = {}
    header = None
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("#"):
                for kv in line[1:].split():
                    if "=" in kv and not kv.startswith("layer="):
                        k, v = kv.split("=", 1)
                        meta.setdefault(k, v)
                continue
            if header is None:
                header = line.split(",")
                idx = {c: i for i, c in enumerate(header)}
                continue
            r = line.split(",")
            ph = int(r[idx["phase"]])
            if phase == "decode" and ph != 1 or phase == "prefill" and ph != 0:
                continue
            key = (int(r[idx["turn"]]), ph, int(r[idx["layer"]]))
            cells[key].setdefault(int(r[idx["step"]]), {})[int(r[idx["slot"]])] = int(r[idx["expert"]])
    return meta, cells


def lru_hits(seq, cap):
    cache = collections.OrderedDict()
    hits = total = 0
    for experts in seq:
        for e in experts:  # hits first (admission rule of the core), then misses
            if e in cache:
                hits += 1
                cache.move_to_end(e)
        for e in experts:
            total += 1
            if e not in cache:
                cache[e] = True
                while len(cache) > cap:
                    cache.popitem(last=False)
    return hits, total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--phase", default="decode", choices=["decode", "prefill", "all"])
    ap.add_argument("--capacities", default="")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    meta, cells = load(a.trace, a.phase)
    n_expert = int(meta.get("n_expert", 0))
    k = int(meta.get("n_expert_used", 0))
    caps = [int(c) for c in a.capacities.split(",") if c] or sorted({max(1, n_expert // 8), max(1, n_expert // 4), max(1, n_expert // 2)})
    per_layer = collections.defaultdict(lambda: {"reuse": [0, 0], "lru": collections.defaultdict(lambda: [0, 0])})
    for (turn, ph, layer), steps in cells.items():
        order = sorted(steps)
        if len(order) < 2:
            continue
        seq = [set(steps[s].values()) for s in order]
        st = per_layer[layer]
        for i in range(1, len(order)):
            if order[i] != order[i - 1] + 1:
                continue
            st["reuse"][0] += len(seq[i] & seq[i - 1])
            st["reuse"][1] += len(seq[i])
        for c in caps:
            h, t = lru_hits(seq, c)
            st["lru"][c][0] += h
            st["lru"][c][1] += t
    tot_r = [sum(v["reuse"][0] for v in per_layer.values()), sum(v["reuse"][1] for v in per_layer.values())]
    tot_l = {c: [sum(v["lru"][c][0] for v in per_layer.values()), sum(v["lru"][c][1] for v in per_layer.values())] for c in caps}
    pct = lambda x: 100.0 * x[0] / x[1] if x[1] else float("nan")
    out = {
        "phase": a.phase, "n_expert": n_expert, "k": k,
        "random_reuse_pct": 100.0 * k / n_expert if n_expert else None,
        "prev_token_reuse_pct": pct(tot_r),
        "lru_hit_pct": {str(c): pct(tot_l[c]) for c in caps},
        "layers": {str(l): {"reuse_pct": pct(v["reuse"])} for l, v in sorted(per_layer.items())},
    }
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"phase {a.phase}: {n_expert} experts, top-{k}; random reuse would be {out['random_reuse_pct']:.1f}%")
    print(f"previous-token reuse: {out['prev_token_reuse_pct']:.1f}%")
    for c in caps:
        print(f"per-layer LRU, {c} experts/layer: {pct(tot_l[c]):.1f}% hit")
    print("per layer reuse: " + " ".join(f"{l}:{v['reuse_pct']:.0f}%" for l, v in out["layers"].items()))


if __name__ == "__main__":
    sys.exit(main())
