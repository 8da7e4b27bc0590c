#!/usr/bin/env python3
"""Independent count of expert-cache hits over a route trace (stdlib only).

bmoe-sim replays a route trace through the core's ExpertCache; this script reads the same
trace with its own parser and simulates the same global cache by itself, so a gate can
compare the two counts exactly. It shares no code with bmoe.

The model it implements (docs/simulator.md, "Admission rule"):
  - one global cache of BUDGET bytes over every (layer, expert); an expert costs its layer's
    expert_bytes;
  - accesses come in groups, one per (engine step, MoE layer), in step order and then layer
    order; a decode step is one token; a turn's prefill rows are one step over the whole
    prompt (a layer's group is the union of its rows' experts, rows in position order);
    within a group, experts in first-use order (row order, then router rank), each once;
  - admission rule: every expert of a group is looked up first (hits are pinned and, for LRU,
    become most recent); then the misses are admitted in order, each evicting unpinned
    entries (LRU: least recent first; Belady: farthest next use first, ties to the smallest
    key) until it fits; a miss that does not fit beside the pinned entries unpins the group's
    pinned entries first (a new admission wave);
  - the cache persists across turns (a session keeps it warm).

Usage:
  sim-check.py TRACE [--experts-per-layer 2,4,6 | --budget-bytes N,...] [--policy lru,belady]
Prints one JSON object per (policy, budget).
"""

import argparse
import csv
import json
import sys
from collections import OrderedDict

INF = float("inf")


def read_trace(path):
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    lines = [l for l in lines if l.strip()]
    if not lines or lines[0].lstrip("\ufeff").strip() != "# route_trace v1":
        sys.exit(f"{path}: not a route_trace v1 file")
    model = {}
    layers = []  # (layer id, expert_bytes) in file order
    body = []
    for line in lines[1:]:
        if line.startswith("#"):
            text = line[1:].strip()
            if text.startswith("note:"):
                continue
            pairs = dict(tok.split("=", 1) for tok in text.split() if "=" in tok)
            if "model" in pairs:
                model = pairs
            elif "layer" in pairs:
                layers.append((int(pairs["layer"]), int(pairs["expert_bytes"])))
            continue
        body.append(line)
    n_expert = int(model["n_expert"])
    pos_of = {lid: i for i, (lid, _) in enumerate(layers)}
    cells = {}
    for row in csv.DictReader(body):
        key = (int(row["turn"]), int(row["phase"]), int(row["step"]), pos_of[int(row["layer"])])
        cells.setdefault(key, []).append((int(row["slot"]), int(row["expert"])))
    return n_expert, [b for _, b in layers], cells


def access_groups(n_layers, cells):
    """Groups of (layer_pos, expert), in the order the engine looks them up."""
    groups = []
    by_turn = {}
    for (turn, phase, step, layer), slots in cells.items():
        by_turn.setdefault(turn, {}).setdefault(phase, {}).setdefault(step, {})[layer] = [
            e for _, e in sorted(slots)
        ]
    for turn in sorted(by_turn):
        phases = by_turn[turn]
        if 0 in phases:  # prefill: one batch over every prompt position
            steps = phases[0]
            for layer in range(n_layers):
                union = []
                for step in sorted(steps):
                    for e in steps[step].get(layer, []):
                        if (layer, e) not in union:
                            union.append((layer, e))
                groups.append(union)
        for step in sorted(phases.get(1, {})):
            for layer in range(n_layers):
                ids = phases[1][step][layer]
                groups.append([(layer, e) for e in dict.fromkeys(ids)])
    return groups


def simulate(groups, expert_bytes, n_expert, budget, policy):
    size = lambda k: expert_bytes[k[0]]
    index = lambda k: k[0] * n_expert + k[1]
    nxt = []
    if policy == "belady":
        last = {}
        nxt = [None] * len(groups)
        for g in range(len(groups) - 1, -1, -1):
            nxt[g] = {k: last.get(k, INF) for k in groups[g]}
            for k in groups[g]:
                last[k] = g
    resident = OrderedDict()  # key -> next use (belady) or None; order = LRU order
    used = 0
    held = set()
    c = {"lookups": 0, "hits": 0, "misses": 0, "evictions": 0, "rereads": 0, "inserts": 0}
    for g, group in enumerate(groups):
        pinned = set()
        misses = []
        for k in group:
            c["lookups"] += 1
            if k in resident:
                c["hits"] += 1
                pinned.add(k)
                if policy == "lru":
                    resident.move_to_end(k)
                else:
                    resident[k] = nxt[g][k]
            else:
                c["misses"] += 1
                if k in held:
                    c["rereads"] += 1
                misses.append(k)
        for k in misses:
            if sum(size(p) for p in pinned) + size(k) > budget:
                if not pinned:
                    sys.exit(f"expert {k} does not fit in an empty cache of {budget} bytes")
                pinned.clear()  # the wave is computed and unpinned
            while used + size(k) > budget:
                candidates = [r for r in resident if r not in pinned]
                if policy == "lru":
                    victim = candidates[0]
                else:
                    victim = max(candidates, key=lambda r: (resident[r], -index(r)))
                del resident[victim]
                used -= size(victim)
                c["evictions"] += 1
            resident[k] = nxt[g][k] if policy == "belady" else None
            used += size(k)
            held.add(k)
            pinned.add(k)
            c["inserts"] += 1
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--experts-per-layer", default="2,4,6",
                    help="budgets as N experts per layer: N x layers x expert_bytes (default 2,4,6)")
    ap.add_argument("--budget-bytes", default=None, help="budgets in bytes (overrides the above)")
    ap.add_argument("--policy", default="lru,belady")
    a = ap.parse_args()
    n_expert, expert_bytes, cells = read_trace(a.trace)
    groups = access_groups(len(expert_bytes), cells)
    if a.budget_bytes:
        budgets = [int(b) for b in a.budget_bytes.split(",")]
    else:
        per = max(expert_bytes)
        budgets = [int(n) * len(expert_bytes) * per for n in a.experts_per_layer.split(",")]
    for policy in a.policy.split(","):
        if policy not in ("lru", "belady"):
            sys.exit(f"unknown policy {policy}")
        for b in budgets:
            c = simulate(groups, expert_bytes, n_expert, b, policy)
            print(json.dumps({"policy": policy, "budget_bytes": b, **c}))


if __name__ == "__main__":
    main()
