#!/usr/bin/env python3
"""How often, and where, bmoe's logits part from llama.cpp's on generated models of one
architecture and weight type, over several seeds — the count the architectures' parity gate
makes on one seed, with each position's router margin beside it.

  python3 scripts/parity-rate.py --arch gemma4 --type q4_k_m --seeds 1,2,3,4,5,6 \
      [--bin-dir target/release] [--out target/parity-rate]

Per seed: `bmoe-cli gen --arch A --preset tiny --seed S --expert-ffn 512 --type T` (the gate's
file but for the seed), bmoe's teacher-forced logits over the gate's prompt (`--logits-out`,
whose sidecar holds each position's smallest router margin), llama.cpp's through
`scripts/llama_parity.py` (llama-cpp-python), and the gate's judgement of each position: off
when the cosine is below 0.999 or the top-1 differs beyond a near-tie. Prints each seed's
positions off with their cosine and router margin, the rate over all seeds, and quantiles of the
margins of every position (a position off on a routing near-tie of its own has a margin near
0). stdlib only, besides what llama_parity.py needs.
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gate_prompt():
    src = open(os.path.join(ROOT, "gates", "src", "llama.rs")).read()
    m = re.search(r'pub const PROMPT: &str = "(.*?)";', src, re.S)
    if not m:
        sys.exit("parity-rate: cannot find PROMPT in gates/src/llama.rs")
    return m.group(1).replace("\\\n", "").replace("\\", "")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, help="qwen3moe, qwen2moe, gemma4, gpt-oss")
    ap.add_argument("--type", default="q4_k_m", help="weight types of the file (bmoe-cli gen --type)")
    ap.add_argument("--seeds", default="1,2,3,4,5,6", help="comma-separated generator seeds")
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--out", default=os.path.join(ROOT, "target", "parity-rate"))
    a = ap.parse_args()
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x]
    except ValueError:
        sys.exit(f"--seeds {a.seeds}: expected comma-separated integers")
    cli = os.path.join(a.bin_dir, "bmoe-cli")
    if not os.path.exists(cli):
        sys.exit(f"{cli} not found: cargo build --release -p bmoe-engine")
    prompt = gate_prompt()
    d = os.path.join(a.out, f"{a.arch}-{a.type}")
    os.makedirs(d, exist_ok=True)
    jobs, outs = [], []
    for s in seeds:
        f = os.path.join(d, f"m{s}.gguf")
        subprocess.run([cli, "gen", "--arch", a.arch, "--preset", "tiny", "--seed", str(s),
                        "--expert-ffn", "512", "--type", a.type, "--quiet", "-o", f], check=True)
        mine = os.path.join(d, f"m{s}.ours.f32")
        subprocess.run([cli, "-m", f, "-p", prompt, "-n", "8", "--logits-out", mine],
                       check=True, capture_output=True)
        side = json.load(open(mine + ".json"))
        ref, res = os.path.join(d, f"m{s}.ref.f32"), os.path.join(d, f"m{s}.cmp.json")
        jobs.append({"op": "logits", "args": [f, mine + ".json", ref]})
        jobs.append({"op": "compare", "out": res, "args": [mine, ref, str(side["n_vocab"])]})
        outs.append((s, res))
    batch = os.path.join(d, "jobs.json")
    json.dump(jobs, open(batch, "w"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "llama_parity.py"), "batch", batch],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"llama_parity.py batch failed:\n{r.stderr}")
    off_total, n_total, margins, off_margins = 0, 0, [], []
    for s, res in outs:
        v = json.load(open(res))
        mg = v.get("router_margin") or []
        off = [i for i, (c, t) in enumerate(zip(v["cos"], v["top1_tie"])) if c < 0.999 or not t]
        off_total += len(off)
        n_total += len(v["cos"])
        margins += [m for m in mg if m is not None]
        off_margins += [mg[i] for i in off if i < len(mg) and mg[i] is not None]
        shown = ", ".join(f"{i} (cos {v['cos'][i]:.4f}, margin {mg[i]:.2e})" if i < len(mg) and mg[i] is not None
                          else f"{i} (cos {v['cos'][i]:.4f})" for i in off)
        print(f"seed {s}: {len(off)} of {len(v['cos'])} positions off{': ' + shown if off else ''}")
    print(f"{a.arch} {a.type}: {off_total} of {n_total} positions off ({100 * off_total / max(n_total, 1):.2f} %)")
    if margins:
        margins.sort()
        q = lambda p: margins[int(p * (len(margins) - 1))]
        print(f"router margins of all positions: p1 {q(0.01):.2e}, p5 {q(0.05):.2e}, p50 {q(0.5):.2e}; "
              f"of the positions off: {', '.join(f'{m:.2e}' for m in sorted(off_margins)) or 'none'}")


if __name__ == "__main__":
    main()
