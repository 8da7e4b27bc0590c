#!/usr/bin/env python3
"""Independent count of the reordering study (`bmoe-sim sweep --placements`), stdlib only.

Reads a route trace with sim-check.py's parser, runs its own LRU over the trace's access
groups (sim-check.py's `simulate`, which shares no code with bmoe), and counts, over the
decode steps of the trace's second half, the flash requests each placement of the experts in
the file would take (docs/simulator.md, "Reordering study"):

  separate         one request per missed (expert, projection);
  file             misses of one (step, layer) merged into runs of adjacent expert ids, one
                   request per run and projection;
  coact            the same with each layer's experts placed by co-activation, fitted on the
                   first half's decode steps: pairs counted per decode step and layer, a path
                   cover built greedily from the heaviest pairs (ties: lower ids first), paths
                   laid out most-routed first (ties: lower first id);
  coact-in-sample  that placement fitted on the counted half.

Halves: the first len//2 turns that decode fit, the rest are counted; a one-turn trace splits
its decode steps the same way.

Usage:
  reorder-check.py TRACE [--experts-per-layer 6,12 | --budget-bytes N,...] [--turns N]
Prints one JSON object per (budget, placement): budget_bytes, placement, tokens, misses,
requests.
"""

import argparse
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("sim_check", os.path.join(HERE, "sim-check.py"))
sim_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim_check)


def n_projections(path):
    """Projections per expert of each MoE layer, from the `# layer=` lines' `proj=` lists
    (1 when a layer lists none: the expert is one extent)."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            pairs = dict(t.split("=", 1) for t in line[1:].split() if "=" in t)
            if "layer" in pairs and "expert_bytes" in pairs:
                out.append(len(pairs["proj"].split(",")) if "proj" in pairs else 1)
    return out


def halves(tags):
    """(fit, count): sets of (turn, step) decode steps."""
    decode = []
    for turn, phase, step in tags:
        if phase == 1 and (turn, step) not in decode[-1:]:
            decode.append((turn, step))
    turns = sorted({t for t, _ in decode})
    if len(turns) >= 2:
        half = len(turns) // 2
        fit = {d for d in decode if d[0] in turns[:half]}
    else:
        fit = set(decode[: len(decode) // 2])
    return fit, set(decode) - fit


def placement(n_expert, n_layers, groups, tags, steps):
    """Per layer: position of each expert."""
    pairs = [dict() for _ in range(n_layers)]
    routed = [[0] * n_expert for _ in range(n_layers)]
    for g, tag in zip(groups, tags):
        if tag[1] != 1 or (tag[0], tag[2]) not in steps:
            continue
        for a, (layer, i) in enumerate(g):
            routed[layer][i] += 1
            for _, j in g[a + 1:]:
                key = (min(i, j), max(i, j))
                pairs[layer][key] = pairs[layer].get(key, 0) + 1
    positions = []
    for layer in range(n_layers):
        edges = sorted(((w, i, j) for (i, j), w in pairs[layer].items()),
                       key=lambda e: (-e[0], e[1], e[2]))
        comp = list(range(n_expert))

        def find(x):
            while comp[x] != x:
                x = comp[x]
            return x

        nbr = [[] for _ in range(n_expert)]
        for _, i, j in edges:
            if len(nbr[i]) < 2 and len(nbr[j]) < 2 and find(i) != find(j):
                comp[find(i)] = find(j)
                nbr[i].append(j)
                nbr[j].append(i)
        seen, paths = set(), []
        for start in range(n_expert):
            if start in seen or len(nbr[start]) > 1:
                continue
            path, prev = [start], None
            seen.add(start)
            while True:
                nxt = [x for x in nbr[path[-1]] if x != prev and x not in seen]
                if not nxt:
                    break
                prev = path[-1]
                path.append(nxt[0])
                seen.add(nxt[0])
            paths.append(path)
        paths.sort(key=lambda p: (-sum(routed[layer][e] for e in p), p[0]))
        pos = [0] * n_expert
        for at, e in enumerate(e for p in paths for e in p):
            pos[e] = at
        positions.append(pos)
    return positions


def runs(ids):
    ids = sorted(ids)
    return sum(1 for a, b in zip([None] + ids, ids) if a is None or b != a + 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--experts-per-layer", default="6,12")
    ap.add_argument("--budget-bytes", default=None)
    ap.add_argument("--turns", type=int, default=None, help="only the first N turns (by id)")
    a = ap.parse_args()
    n_expert, expert_bytes, cells = sim_check.read_trace(a.trace)
    if a.turns is not None:
        keep = sorted({key[0] for key in cells})[: a.turns]
        cells = {key: v for key, v in cells.items() if key[0] in keep}
    n_layers = len(expert_bytes)
    n_proj = n_projections(a.trace)
    tags = []
    groups = sim_check.access_groups(n_layers, cells, tags)
    fit, count = halves(tags)
    if not fit or not count:
        sys.exit("the trace has too few decode steps to fit on one half and count on the other")
    places = {
        "file": [list(range(n_expert)) for _ in range(n_layers)],
        "coact": placement(n_expert, n_layers, groups, tags, fit),
        "coact-in-sample": placement(n_expert, n_layers, groups, tags, count),
    }
    if a.budget_bytes:
        budgets = [int(b) for b in a.budget_bytes.split(",")]
    else:
        per = max(expert_bytes)
        budgets = [int(n) * n_layers * per for n in a.experts_per_layer.split(",")]
    for budget in budgets:
        totals = {p: 0 for p in ["separate", *places]}
        missed = [0]

        def on_misses(g, misses):
            turn, phase, step = tags[g]
            if phase != 1 or (turn, step) not in count or not misses:
                return
            layer = misses[0][0]
            missed[0] += len(misses)
            totals["separate"] += len(misses) * n_proj[layer]
            for name, pos in places.items():
                totals[name] += runs(pos[layer][e] for _, e in misses) * n_proj[layer]

        sim_check.simulate(groups, expert_bytes, n_expert, budget, "lru", on_misses)
        for name, requests in totals.items():
            print(json.dumps({"budget_bytes": budget, "placement": name, "tokens": len(count),
                              "misses": missed[0], "requests": requests}))


if __name__ == "__main__":
    main()
