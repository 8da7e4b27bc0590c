#!/usr/bin/env python3
"""How much slower a Python eviction policy is than the core's Rust one: the same replay
(DeepSeek-V2-Lite's real trace, full timing, overlap, 4 lanes) with the core's `lru` and with
bmoe_sim.policies.Lru (the same decisions: the counts are checked equal), side by side in one
run, best of N each. A benchmark, not a test (docs/simulator.md, "Python").

    python3 sim/python/examples/policy_speed.py [TRACE] [--experts-per-layer 6,12,24] [--repeat 3]
"""

import argparse
import time
from pathlib import Path

import bmoe_sim
from bmoe_sim.policies import Lru

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=ROOT.parent / "shared/traces/deepseek-v2-lite-puffin.route.csv")
    ap.add_argument("--experts-per-layer", default="6,12,24")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    trace = bmoe_sim.load_trace(a.trace)
    print(f"{Path(trace.path).name}: {trace.cells} cells, {len(trace.moe_layers)} MoE layers x {trace.n_expert} experts, best of {a.repeat}")
    print(f"{'per_layer':>9} {'rust_s':>8} {'python_s':>9} {'ratio':>6} {'calls':>8} {'us/call':>8}")
    for n in map(int, a.experts_per_layer.split(",")):
        mb = n * len(trace.moe_layers) * max(trace.expert_bytes) // 2**20
        best, counts = {}, {}
        for name, make in (("rust", lambda: "lru"), ("python", Lru)):
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                r = bmoe_sim.replay(trace, cache_mb=mb, force_cache=True, overlap=True, io_threads=4, policy=make())
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            counts[name] = {k: r.counters[k] for k in ("hits", "misses", "evictions", "inserts")}
        assert counts["rust"] == counts["python"], counts
        c = counts["rust"]
        # The cache's calls into the policy: one per hit, insert and removal, and one victim per eviction.
        calls = c["hits"] + c["inserts"] + 2 * c["evictions"]
        extra_us = 1e6 * (best["python"] - best["rust"]) / calls
        print(f"{n:>9} {best['rust']:>8.3f} {best['python']:>9.3f} {best['python'] / best['rust']:>5.2f}x {calls:>8} {extra_us:>8.3f}")


if __name__ == "__main__":
    main()
