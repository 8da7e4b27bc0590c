#!/usr/bin/env python3
"""Write a synthetic route trace shaped like Qwen3-30B-A3B Q4_K_M (stdlib only).

48 MoE layers, 128 experts, top-8; per expert gate/up Q4_K (884736 B) and down Q6_K on even
layers, Q4_K on odd ones (1290240 / 884736 B), so an expert averages the 2.72 MiB
features.md section 12 states, and one token routes 1046 MiB. Routing per layer is skewed:
expert popularity ~ 1/(rank+1)^S over a fixed random permutation, 8 drawn without
replacement per token. docs/simulator.md uses S=1.5, whose global-LRU hit rates at 2000 and
4000 MiB (55%, 76%) match the origin phone's measured anchors (53%, 76%), to check that the
origin-12gb-phone profile, replayed, reproduces those anchors' tok/s.

Usage: synthetic-qwen3-30b-trace.py S OUT.csv [DECODE_TOKENS=160]
"""
import random
import sys

s = float(sys.argv[1]); out = sys.argv[2]; n_dec = int(sys.argv[3]) if len(sys.argv) > 3 else 160
L, E, K = 48, 128, 8
gate = 884736; down_q4 = 884736; down_q6 = 1290240
rng = random.Random(42)
lines = ["# route_trace v1", f"# model=qwen3-30b-a3b-shape-synthetic arch=qwen3moe n_layer={L} n_expert={E} n_expert_used={K}",
         f"# note: synthetic routing, popularity ~ 1/(rank+1)^{s} per layer (random permutation), for the origin-profile check"]
off = 1 << 20
weights = []
for l in range(L):
    down = down_q6 if l % 2 == 0 else down_q4
    eb = 2 * gate + down
    proj = []
    for stride in (gate, gate, down):
        proj.append(f"0:{off}:{stride}"); off += stride * E
    lines.append(f"# layer={l} expert_bytes={eb} dense_bytes=12373196 proj={','.join(proj)}")
    perm = list(range(E)); rng.shuffle(perm)
    w = [0.0] * E
    for r, e in enumerate(perm): w[e] = 1.0 / (r + 1) ** s
    weights.append(w)
lines.append("turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped")
for t in range(n_dec):
    for l in range(L):
        w = list(weights[l]); chosen = []
        for _ in range(K):
            tot = sum(w); x = rng.random() * tot; acc = 0
            for e in range(E):
                acc += w[e]
                if acc >= x and w[e] > 0: chosen.append(e); w[e] = 0; break
        for slot, e in enumerate(chosen):
            lines.append(f"0,1,{100+t},{l},{slot},{e},0.125,0,0,0")
open(out, "w").write("\n".join(lines) + "\n")
